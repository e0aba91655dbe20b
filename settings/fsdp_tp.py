"""2-D parallelism, torchtitan's way: tensor parallel inside groups of `tp` ranks, FSDP2 across the `dp` groups, on
one (dp, tp) device mesh. Every rank of a tensor-parallel group trains on the same share of the batch; the dp
groups split the batch. The model's own tensor-parallel plan runs where it has one (a transformer), the derived
column-/row-wise pairs elsewhere; FSDP2 then wraps per block (or per parameter-holding layer) and the root, with the
`MixedPrecisionPolicy` of the FSDP2 family's `policy` (torchtitan's bf16 parameters reduced in fp32, and the two
bf16 reductions). A reduced-precision variant is judged as the FSDP2 family judges its own: against FSDP2 on one
rank with the same policy, by bf16's tolerance.
"""

# ruff: noqa: F821 -- `distribute` calls a kind's own `model_tp_plan`, which a standalone script of its model defines

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    SHARDED,
    Outputs,
    RunContext,
    Setting,
    Tolerance,
    across,
    refuse_changed_hooks,
    register_settings,
)
from settings._compat import fully_shard_for
from settings._tp_apply import parallel_style, stepping, whole_outputs_and_gradients
from settings._tp_plan import _describe, own_plan
from settings._training import Training, build_for_training, full_parameters, parameter_holders, world_mesh
from settings.fsdp import (
    BF16_TOLERANCE,
    PRECISIONS,
    FullyShard,
    fsdp2_units,
    make_contiguous,
    mixed_precision,
    policy_precision,
)
from settings.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# a kind's own plan, which a standalone script of its model defines (declared here so that this module checks on its own)
model_tp_plan: Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class FsdpTensorParallel(Setting):
    """FSDP2 over data-parallel groups × tensor parallel inside each, on a 2-D device mesh."""

    data_parallel: int
    tensor_parallel: int
    sequence_parallel: bool = False
    policy: str = "fp32"  # a key of the FSDP2 family's PRECISIONS: the compute dtype, then the gradient reduction's
    reshard: str = "always"  # each unit's reshard_after_forward: a key of RESHARD_POLICIES
    family: ClassVar[str] = "fsdp2-tp"
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel",)

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.data_parallel * self.tensor_parallel

    @property
    def name(self) -> str:
        style = "sequence-parallel" if self.sequence_parallel else "colwise-rowwise"
        policy = f"/{self.policy}" if self.policy != "fp32" else ""
        reshard = f"/reshard-{self.reshard}" if self.reshard != "always" else ""
        return (f"fsdp2-tp/dp{self.data_parallel}-tp{self.tensor_parallel}/{style}{policy}{reshard}/"
                f"ws{self.world_size}")

    def describe(self) -> str:
        param, reduce = PRECISIONS[self.policy]
        policy = (f", {param or 'fp32'} compute, gradients reduced in {reduce or 'fp32'}" if self.policy != "fp32"
                  else "")
        reshard = f", {RESHARD_POLICIES[self.reshard]}" if self.reshard != "always" else ""
        return (f"FSDP2 over {self.data_parallel} data-parallel groups × tensor parallel over {self.tensor_parallel} "
                f"ranks{' with sequence parallel' if self.sequence_parallel else ''} (2-D mesh){policy}{reshard}")

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference" if self.policy == "fp32" else FullyShard(1, "per-layer", True, self.policy).name

    @property
    def precision(self) -> str:  # type: ignore[override]
        return policy_precision(self.policy)

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BF16_TOLERANCE if self.precision == "bf16" else default

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return self.trained(ctx, model, inputs)

    def trained(self, ctx: RunContext, model: Any, inputs: Any, before_step: Callable[[Any], None] | None = None,
                training: Training | None = None) -> Outputs | None:
        """The model parallelized and trained as this setting does; `before_step` and `training` as
        `TensorParallel.trained` says."""
        fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the mesh is made
        mesh = world_mesh(ctx, (self.data_parallel, self.tensor_parallel), ("dp", "tp"))
        tensor_parallel = TensorParallel(self.tensor_parallel, self.sequence_parallel)
        module = build_for_training(model, ctx.device)
        layout = self.layout(model, module, tensor_parallel.plan(model, module, inputs, ctx.device))
        distribute(module, mesh, ctx.device, layout)
        ctx.notes["plan"] = ", ".join(f"{name}: {_describe(style)}" for name, style in layout["plan"].items())
        dp_index = mesh["dp"].get_local_rank()
        return tensor_parallel.train(ctx, model, inputs, module, data_shard=(dp_index, self.data_parallel),
                                     outputs_whole=True, before_step=before_step, training=training)

    def layout(self, model: Any, module: Any, plan: dict[str, Any]) -> dict[str, Any]:
        """What `distribute` needs: the mesh's shape, the tensor-parallel plan (module name → ParallelStyle, or a
        derived plan's spec for `parallel_style`) and FSDP2's units (a transformer's blocks, else every layer holding
        a parameter, those with a trainable one; under a reduced-precision policy the FSDP2 family's units, frozen
        layers included: a frozen layer left to the root would take its bf16 weights to the fp32 output of the unit
        before it, and the one-rank run it is judged against cuts the model there too)."""
        if self.policy == "fp32":
            units = [name for name, unit in model.blocks(module) or parameter_holders(module)
                     if any(p.requires_grad for p in unit.parameters())]
        else:
            units = [name for name, _ in fsdp2_units(model, module)]
        return {"mesh": [self.data_parallel, self.tensor_parallel], "plan": plan, "units": units,
                "data_parallel": self.data_parallel, "dtypes": PRECISIONS[self.policy],
                "blocks": model.blocks(module) is not None, "reshard": self.reshard}

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, FsdpTensorParallel, "trained")

        from settings._training_script import training_script

        return training_script(case, *self.script_parts(case))

    def script_parts(self, case: StandaloneCase) -> tuple[str, int, tuple[Any, ...], dict[str, Any]]:
        """What `training_script` takes for this setting: the summary, the world size, the functions copied and the
        layout `distribute` reads."""
        from difftest import Inputs, LoadedModel

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        module = model.build("cpu")
        tensor_parallel = TensorParallel(self.tensor_parallel, self.sequence_parallel)
        own, fields = own_plan(case, model, module, self.tensor_parallel, self.sequence_parallel, False)
        plan = {} if own else tensor_parallel.derived_plan(model, module, Inputs(case.inputs["train"],
                                                                                  case.inputs["eval"]), "cpu")
        return (f"{self.describe()}: parallelize_module with "
                f"{own or 'column-/row-wise pairs (' + ', '.join(plan) + ')'}, then fully_shard", self.world_size,
                (fully_shard_for, make_contiguous, mixed_precision, parallel_style, whole_outputs_and_gradients,
                 stepping, distribute, full_parameters), {**self.layout(model, module, plan), **fields})


def distribute(module: Any, mesh: Any, device: str, layout: dict[str, Any]) -> Any:
    """Tensor parallel over the mesh's `tp` dimension with the layout's plan, then FSDP2 over its `dp` dimension:
    each unit, innermost first, then the root; as `FsdpTensorParallel.run` applies them. `mesh`: the (dp, tp)
    DeviceMesh, or the process group of all its ranks (a standalone script's world), laid out as one."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    fully_shard = fully_shard_for(device)  # a script run on a torch too old says so, as the setting does

    if not isinstance(mesh, DeviceMesh):
        mesh = init_device_mesh(device.split(":")[0], tuple(layout["mesh"]), mesh_dim_names=("dp", "tp"))
    make_contiguous(module)  # FSDP2 refuses the transposed views a converted graph holds
    styles = model_tp_plan(module, *layout["own_plan"]) if "own_plan" in layout else layout["plan"]
    plan = {name: parallel_style(s) if isinstance(s, dict) else s for name, s in styles.items()}
    parallelize_module(module, mesh["tp"], plan)
    dtypes, reshard = layout.get("dtypes", (None, None)), layout.get("reshard", "always")
    for index in reversed(range(len(layout["units"]))):
        # the last unit's backward comes right after the forward: "all-but-last" keeps it gathered
        keep = reshard == "never" or (reshard == "all-but-last" and index == len(layout["units"]) - 1)
        fully_shard(module.get_submodule(layout["units"][index]), mesh=mesh["dp"], reshard_after_forward=not keep,
                    mp_policy=mixed_precision(dtypes, inner=layout.get("blocks", False)))
    # the root as torchtitan wraps it, with fully_shard's default (it keeps the root gathered)
    fully_shard(module, mesh=mesh["dp"], mp_policy=mixed_precision(dtypes, inner=False))
    whole_outputs_and_gradients(module)  # a sharded output handed back whole, as the tensor-parallel training does
    return module


@dataclass(frozen=True)
class FullTierFsdpTensorParallel(FsdpTensorParallel):
    """FSDP2 × tensor parallel with a policy besides the defaults: a reduced-precision `MixedPrecisionPolicy`, or
    units keeping their gathered parameters after forward (torchtitan's `reshard_after_forward_policy` "never", or
    all but the last block resharded). A class of its own so that the default tier keeps the fp32 resharding pair and
    these run in the full tier."""

    in_default_tier: ClassVar[bool] = False


# each unit's reshard_after_forward (the root keeps fully_shard's default, as torchtitan leaves it): every unit, as
# torchtitan's "always" and its default without pipelines; none, as its "never"; all but the last block
RESHARD_POLICIES = {"always": "every unit resharded after forward",
                    "all-but-last": "every unit but the last resharded after forward",
                    "never": "no unit resharded after forward"}

register_settings(FsdpTensorParallel(2, 2, sp) for sp in (False, True))
register_settings(FullTierFsdpTensorParallel(2, 2, sp, reshard=reshard) for reshard in ("all-but-last", "never")
                  for sp in (False, True))
register_settings(FullTierFsdpTensorParallel(2, 2, sp, policy) for policy in PRECISIONS if policy != "fp32"
                  for sp in (False, True))
