"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters sharded on dim 0 over the ranks as DTensors,
all-gathered for forward/backward, gradients reduce-scattered to the global mean.

Wrapping is per layer (every submodule that holds a parameter is its own FSDP unit, then the root) or the
whole model as one unit; `reshard_after_forward` frees or keeps the gathered parameters between forward and
backward, or (an int) reshards them to that many ranks after forward. The policies `fully_shard` takes are axes
too: `MixedPrecisionPolicy` as `precision` (the dtype of the parameters in compute, then that of the gradient
reduction: `bf16` = bf16 parameters reduced in fp32, `bf16-reduce-bf16`, `fp32-reduce-bf16`) and `CPUOffloadPolicy`
(`offload`: parameters, gradients and the optimizer step on the CPU, parameters copied to the device for compute).
Two layouts torchtitan uses are options too: `shard_dim="last"` (`shard_placement_fn`: each parameter sharded on its
last dimension where that divides by the ranks sharing it, else on dim 0, as torchtitan shards MoE experts when they
are fewer than the ranks) and `replicate` > 1 (HSDP: a 2-D (replicate, shard) mesh, each parameter sharded within
groups of world_size / replicate ranks and replicated across the groups, gradients reduce-scattered within a group and
all-reduced across them); both are in the full tier.
A reduced-precision variant is judged by a tolerance derived from bf16's unit roundoff instead of the fp32 one, in
two steps that keep precision and distribution apart: on one rank against the fp32 `reference` (what bf16 itself
costs), on 2+ ranks against that one-rank run of the same policy (what sharding adds).
"""

from __future__ import annotations

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
    variant_of,
)
from settings._compat import fully_shard_for
from settings._training import (
    build_for_training,
    full_parameters,
    gathered_parameters,
    parameter_holders,
    train_data_parallel,
    world_mesh,
)

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# bf16 keeps 8 significant bits: unit roundoff u = 2**-8. A layer rounds its input, its weights and its
# output (3u); the generated models are at most ~6 layers deep, so outputs may be off by ~18u relative.
BF16_TOLERANCE = Tolerance(atol=18 * 2**-8, rtol=18 * 2**-8)
# MixedPrecisionPolicy's (param_dtype, reduce_dtype) by `precision`; None keeps the parameters' own (fp32)
PRECISIONS = {"fp32": (None, None), "bf16": ("bfloat16", "float32"), "bf16-reduce-bf16": ("bfloat16", "bfloat16"),
              "fp32-reduce-bf16": (None, "bfloat16")}


@dataclass(frozen=True)
class FullyShard(Setting):
    """FSDP2 fully_shard on a 1-D CPU/GPU mesh, plain SGD on each rank's share of the batch."""

    world_size: int
    wrap: str = "per-layer"  # or "whole-model"
    reshard_after_forward: bool | int = True  # an int: reshard to that many ranks after forward
    policy: str = "fp32"  # a key of PRECISIONS: the compute dtype, then the gradient reduction's
    offload: bool = False  # CPUOffloadPolicy
    shard_dim: str = "first"  # "last": shard_placement_fn puts each parameter's shards on its last dim where it divides
    replicate: int = 1  # > 1: HSDP over a (replicate, shard) mesh of that many replica groups
    family: ClassVar[str] = "fsdp2"
    tier_axes: ClassVar[tuple[str, ...]] = ("wrap", "reshard_after_forward", "policy", "offload")

    @property
    def name(self) -> str:
        reshard = {True: "reshard", False: "no-reshard"}.get(self.reshard_after_forward,  # type: ignore[call-overload]
                                                             f"reshard-to-{self.reshard_after_forward}")
        layout = ("/offload" if self.offload else "") + ("/shard-last" if self.shard_dim == "last" else "") \
            + (f"/hsdp{self.replicate}" if self.replicate > 1 else "")
        return f"fsdp2/{self.wrap}/{reshard}/{self.policy}{layout}/ws{self.world_size}"

    def describe(self) -> str:
        ranks = f"{self.world_size} ranks" if self.world_size > 1 else "1 rank (nothing sharded)"
        param, reduce = PRECISIONS[self.policy]
        return (f"FSDP2 over {ranks}, {self.wrap} units, reshard_after_forward={self.reshard_after_forward}, "
                f"{param or 'fp32'} compute, gradients reduced in {reduce or 'fp32'}"
                + (", CPUOffloadPolicy" if self.offload else "")
                + (", each parameter sharded on its last dimension where it divides (shard_placement_fn)"
                   if self.shard_dim == "last" else "")
                + (f", HSDP: sharded within {self.world_size // self.replicate} ranks, replicated over {self.replicate}"
                   if self.replicate > 1 else ""))

    @property
    def reference(self) -> str:  # type: ignore[override]
        if self.policy == "fp32" or self.world_size == 1:
            return "reference"
        return variant_of(FullyShard, self, world_size=1, reshard_after_forward=True, offload=False, shard_dim="first",
                          replicate=1).name

    @property
    def precision(self) -> str:  # type: ignore[override]
        return policy_precision(self.policy)

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BF16_TOLERANCE if self.precision == "bf16" else default

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the model is built
        module = build_for_training(model, ctx.device)
        layout = self.layout(model, module)
        hsdp = (self.replicate, self.world_size // self.replicate)
        distribute(module, world_mesh(ctx, hsdp, ("replicate", "shard")) if self.replicate > 1 else ctx.group,
                   ctx.device, layout)
        ctx.notes["units"] = str(len(layout["units"]) + 1)
        if self.shard_dim != "first" or self.replicate > 1:  # the layout FSDP2 made, to show the option took effect
            ctx.notes["placements"] = placements_made(module)
        self.sharded(ctx, module)

        return train_data_parallel(ctx, model, inputs, module, lambda: gathered_parameters(ctx, model, module))

    def layout(self, model: Any, module: Any) -> dict[str, Any]:
        """What `distribute` needs: the units (a transformer's blocks, else every layer holding a parameter; none for
        one whole-model unit), whether they are blocks, and the options."""
        units = [name for name, _ in fsdp2_units(model, module)] if self.wrap == "per-layer" else []
        return {"units": units, "blocks": self.wrap == "per-layer" and model.blocks(module) is not None,
                "reshard_after_forward": self.reshard_after_forward, "dtypes": PRECISIONS[self.policy],
                "offload": self.offload, "shard_dim": self.shard_dim, "replicate": self.replicate}

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, FullyShard, "sharded")

        from difftest import LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        return training_script(case, f"FSDP2 fully_shard ({self.describe().partition(', ')[2]})", self.world_size,
                               (*distribute_functions(), full_parameters),
                               self.layout(model, model.build("cpu")))

    def sharded(self, ctx: RunContext, module: Any) -> None:
        """Called once the model is sharded, before training (a hook for planted faults)."""


def placements_made(module: Any) -> str:
    """How many of `module`'s parameters FSDP2 holds in each distinct placement, e.g. "(Replicate(), Shard(dim=1)): 3"."""
    from collections import Counter

    counts = Counter(str(tuple(p.placements)) for p in module.parameters() if hasattr(p, "placements"))
    return ", ".join(f"{placement}: {n}" for placement, n in sorted(counts.items()))


def policy_precision(policy: str) -> str:
    """The arithmetic the envelope is calibrated for under a key of PRECISIONS: bf16 wherever the policy rounds to it
    (parameters or gradients)."""
    return "fp32" if policy == "fp32" else "bf16"


def mixed_precision(dtypes: tuple[str | None, str | None], inner: bool) -> Any:
    """FSDP2's policy for `dtypes` (a value of PRECISIONS: the parameters' dtype in compute, the gradient
    reduction's; None keeps the parameters' own). With bf16 parameters a block hands bf16 activations to the next and to the root's own layers
    (torchtitan's policy); a unit per layer (`inner` False) hands back fp32, so what runs between units (activations,
    pooling) stays fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param, reduce = (getattr(torch, dtype) if dtype else None for dtype in dtypes)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                output_dtype=torch.float32 if param is not None and not inner else None)


def distribute_functions() -> tuple[Any, ...]:
    """`distribute` and every function of this module it calls: what a script that shards as this family does copies
    (this family's, a resume's)."""
    return fully_shard_for, make_contiguous, mixed_precision, shard_placement, distribute


def shard_placement(dim: str, ranks: int) -> Any:
    """`fully_shard`'s `shard_placement_fn` for `dim`: None (its default, dim 0) for "first"; for "last", each
    parameter's last dimension where that divides by the `ranks` sharing it (FSDP2 refuses an uneven shard off dim 0),
    else dim 0."""
    from torch.distributed.tensor import Shard

    if dim == "first":
        return None
    return lambda p: Shard(p.dim() - 1) if p.dim() > 1 and p.shape[-1] % ranks == 0 else Shard(0)


def distribute(module: Any, group: Any, device: str, layout: dict[str, Any]) -> Any:
    """FSDP2 over `group`, as `FullyShard.run` shards: each unit named in `layout`, innermost first (a unit owns what
    its wrapped children do not), then the root, on a 1-D mesh of the group, or for HSDP (`layout["replicate"]` > 1)
    on a (replicate, shard) mesh: `group` is that DeviceMesh, or the process group of all its ranks (a standalone
    script's world), laid out as one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    fully_shard = fully_shard_for(device)  # a script run on a torch too old says so, as the setting does
    make_contiguous(module)
    replicate = layout.get("replicate", 1)
    if isinstance(group, DeviceMesh):
        mesh = group
    elif replicate > 1:
        mesh = init_device_mesh(device.split(":")[0], (replicate, dist.get_world_size(group) // replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("dp",))
    options = dict(mesh=mesh, reshard_after_forward=layout["reshard_after_forward"],
                   shard_placement_fn=shard_placement(layout.get("shard_dim", "first"), mesh.size(mesh.ndim - 1)))
    if layout.get("offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy

        # pinned host memory needs a CUDA driver; on a CPU-only machine the copies are plain CPU tensors
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.startswith("cuda"))
    for name in reversed(layout["units"]):
        fully_shard(module.get_submodule(name), **options, mp_policy=mixed_precision(layout["dtypes"],
                                                                                      inner=layout["blocks"]))
    return fully_shard(module, **options, mp_policy=mixed_precision(layout["dtypes"], inner=False))


def fsdp2_units(model: Any, module: Any) -> list[tuple[str, Any]]:
    """The submodules FSDP2 shards as units of their own, innermost last: a transformer's blocks (torchtitan's
    units), else every submodule that holds a parameter. A unit holding a tied parameter (an embedding shared with the
    output projection) is left to the root: FSDP2 refuses a parameter managed by two groups, and one group has it."""
    units = model.blocks(module) or parameter_holders(module)
    names: dict[int, int] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        names[id(parameter)] = names.get(id(parameter), 0) + 1
    return [(n, u) for n, u in units if all(names[id(p)] == 1 for p in u.parameters())]


def make_contiguous(module: Any) -> None:
    """FSDP2 refuses non-contiguous parameters ("not supported yet"); converted graphs hold transposed views.
    A contiguous copy under the same attribute keeps values and names, so the comparison is unaffected."""
    import torch

    for owner in module.modules():
        for attr, parameter in list(owner._parameters.items()):
            if parameter is not None and not parameter.is_contiguous():
                replacement = torch.nn.Parameter(parameter.detach().contiguous(), parameter.requires_grad)
                owner._parameters[attr] = replacement


@dataclass(frozen=True)
class FullTierFullyShard(FullyShard):
    """FSDP2 with torchtitan's other layouts (`shard_dim="last"`, HSDP): a class of its own so that they run in the
    full tier, the default tier keeping the dim-0, one-dimensional layout of every policy."""

    in_default_tier: ClassVar[bool] = False


register_settings(
    [FullyShard(ws, wrap, reshard) for wrap in ("per-layer", "whole-model") for reshard in (True, False)
     for ws in (2, 3, 4)]
    + [FullyShard(ws, "per-layer", True, policy) for policy in PRECISIONS if policy != "fp32" for ws in (1, 2, 3, 4)]
    + [FullyShard(4, wrap, 2) for wrap in ("per-layer", "whole-model")]
    + [FullyShard(ws, "per-layer", True, policy, offload=True) for policy in ("fp32", "bf16") for ws in (2, 4)]
    + [FullTierFullyShard(ws, wrap, True, shard_dim="last") for wrap in ("per-layer", "whole-model") for ws in (2, 3)]
    + [FullTierFullyShard(4, "per-layer", reshard, policy, shard_dim=dim, replicate=2) for reshard in (True, False)
       for policy in ("fp32", "bf16") for dim in ("first", "last")]
)
