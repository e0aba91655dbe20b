"""Activation checkpointing: a transformer's blocks wrapped by `checkpoint_wrapper` (torch.distributed.algorithms), their
activations dropped after forward and recomputed in backward, in one process or composed with DDP or FSDP2 (the
checkpointing applied first, then the wrapper, as torchtitan composes them).

Recomputing a block runs the same operations on the same values, so training must match the reference's within the
calibrated envelope. Modes: `reentrant` (torch.utils.checkpoint with use_reentrant=True), `non-reentrant`, and
`selective` (non-reentrant with an op policy that saves matrix products and recomputes the rest, torchtitan's
selective AC). Reentrant checkpointing needs a block input that requires grad (documented): where none does (the
model's embedding is frozen), torch warns and leaves the block's parameters without gradients, and the setting is
`unsupported` with torch's words rather than a finding. So is reentrant checkpointing inside DDP of a model that applies
a block more than once: DDP's reducer refuses a parameter made ready by several reentrant backward passes of one step
(its documented way, `static_graph=True`, is another DDP than this setting's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    DATA_PARALLEL,
    SHARDED,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    record_training,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    traits_of,
)
from settings._compat import fully_shard_for
from settings._training import build_for_training, full_parameters, sgd_step
from settings.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from difftest import ModelSpec, Script, StandaloneCase

MODES = ("reentrant", "non-reentrant", "selective")
WRAPS = ("single", "ddp", "fsdp2")
# what torch says when a reentrant checkpoint has no input that requires grad (torch/utils/checkpoint.py)
_NO_GRAD_INPUTS = "None of the inputs have requires_grad=True"
# what DDP's reducer says when a parameter is used by several reentrant backward passes of one step (a block applied
# more than once): "DDP does not support such use cases in default" (torch/csrc/distributed/c10d/reducer.cpp); its
# docstring names static_graph=True as what supports "activation checkpointing multiple times"
_DDP_READY_TWICE = "Expected to mark a variable ready only once"


@dataclass(frozen=True)
class ActivationCheckpointing(Setting):
    """A transformer's blocks under activation checkpointing, alone or inside DDP or FSDP2, plain SGD."""

    world_size: int
    wrap: str = "single"  # or "ddp", "fsdp2"
    mode: str = "non-reentrant"  # or "reentrant", "selective"
    family: ClassVar[str] = "ac"
    tier_axes: ClassVar[tuple[str, ...]] = ("wrap", "mode")

    @property
    def name(self) -> str:
        return f"ac/{self.wrap}/{self.mode}/ws{self.world_size}"

    def describe(self) -> str:
        inside = {"single": "in one process", "ddp": f"inside DDP over {self.world_size} ranks",
                  "fsdp2": f"inside FSDP2 (a unit per block) over {self.world_size} ranks"}[self.wrap]
        return f"activation checkpointing ({self.mode}) of every transformer block, {inside}"

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, {"single": frozenset(), "ddp": DATA_PARALLEL, "fsdp2": SHARDED}[self.wrap])

    def supports(self, spec: ModelSpec) -> str | None:
        if "blocks" not in traits_of(spec.kind):
            return (f"model kind {spec.kind!r} has no blocks to checkpoint (an adapter names them: "
                    "ModelAdapter(blocks=(...)))")
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import warnings

        import torch

        if self.wrap == "fsdp2":
            fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the model is built
        module = build_for_training(model, ctx.device)
        layout = self.layout(model, module)
        wrapped = distribute(module, ctx.group, ctx.device, layout)
        ctx.notes["checkpointed blocks"] = str(sum(name.endswith("_checkpoint_wrapped_module")
                                                   for name, _ in wrapped.named_modules()))

        def read() -> dict[str, Any] | None:
            full = {name: to_numpy(t) for name, t in full_parameters(wrapped, model.parameters).items()}
            return full if ctx.rank == 0 else None

        optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            # only while gradients are taken: an evaluation (no_grad) gives a reentrant checkpoint no input that
            # requires grad either, which costs nothing there
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    loss = sgd_step(model, wrapped, optimizer, batch, ctx.device)
                except RuntimeError as exc:
                    if not (self.wrap == "ddp" and self.mode == "reentrant" and _DDP_READY_TWICE in str(exc)):
                        raise
                    raise Unsupported(f"DDP refuses, by design, a parameter used by several reentrant backward passes "
                                      f"of one step (this model applies a block more than once): "
                                      f"{str(exc).split('. ')[0]}; DDP does not support such use cases in default "
                                      f"(its documented way is static_graph=True)") from None
            said = next((str(w.message) for w in caught if _NO_GRAD_INPUTS in str(w.message)), None)
            if said is not None:
                raise Unsupported(f"torch.utils.checkpoint (use_reentrant=True) on this model: {said} (documented: "
                                  "a reentrant checkpoint needs an input that requires grad; a block gets none)")
            return loss

        return record_training(ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device), train_step, read)

    def layout(self, model: Any, module: Any) -> dict[str, Any]:
        """What `distribute` needs: the blocks to checkpoint, the mode, what wraps them."""
        blocks = model.blocks(module)
        if not blocks:
            raise Unsupported(f"model kind {model.spec.kind!r} declares no repeated blocks to checkpoint")
        return {"blocks": [name for name, _ in blocks], "mode": self.mode, "wrap": self.wrap}

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, ActivationCheckpointing)

        from difftest import LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        return training_script(case, self.describe().replace(" in one process", "") + " (checkpoint_wrapper)",
                               self.world_size, (selective_policy, checkpointed, fully_shard_for, distribute,
                                                 full_parameters), self.layout(model, model.build("cpu")))


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing's op policy: keep what matrix products computed, recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    keep = op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(module: Any, blocks: list[str], mode: str) -> Any:
    """`module` with each of `blocks` wrapped by checkpoint_wrapper in `mode` (torch's apply_activation_checkpointing)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    chosen = {id(module.get_submodule(name)) for name in blocks}
    options: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.REENTRANT if mode == "reentrant"
                               else CheckpointImpl.NO_REENTRANT}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    apply_activation_checkpointing(module, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, **options),
                                   check_fn=lambda m: id(m) in chosen)
    return module


def distribute(module: Any, group: Any, device: str, layout: dict[str, Any]) -> Any:
    """The blocks checkpointed, then the model wrapped as the setting wraps it: nothing more (one process), DDP, or
    FSDP2 with a unit per (checkpointed) block and the root."""
    import torch

    module = checkpointed(module, layout["blocks"], layout["mode"])
    if layout["wrap"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(device)] if device.startswith("cuda") else None
        return DistributedDataParallel(module, device_ids=device_ids, process_group=group)
    if layout["wrap"] == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh

        fully_shard = fully_shard_for(device)
        mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("dp",))
        for name in reversed(layout["blocks"]):
            fully_shard(module.get_submodule(name), mesh=mesh)
        return fully_shard(module, mesh=mesh)
    return module


@dataclass(frozen=True)
class CheckpointedTensorParallel(TensorParallel):
    """Tensor parallel (the `tp` family's plan and training), then each block checkpointed, as torchtitan applies
    activation checkpointing after the plan: the recomputation in backward runs on the DTensor parameters and
    activations the plan leaves. Non-reentrant and selective (torchtitan's modes); in the full tier."""

    mode: str = "non-reentrant"
    family: ClassVar[str] = "ac"
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel", "mode")
    in_default_tier: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"ac/tp{'-sp' if self.sequence_parallel else ''}/{self.mode}/ws{self.world_size}"

    def describe(self) -> str:
        return f"activation checkpointing ({self.mode}) of every transformer block after {super().describe()}"

    def supports(self, spec: ModelSpec) -> str | None:
        return ActivationCheckpointing(self.world_size, "single", self.mode).supports(spec) or super().supports(spec)

    def parallelize(self, ctx: RunContext, model: Any, module: Any, inputs: Any, mesh: Any) -> None:
        super().parallelize(ctx, model, module, inputs, mesh)
        checkpointed(module, self.blocks(model, module), self.mode)
        ctx.notes["checkpointed blocks"] = str(sum(name.endswith("_checkpoint_wrapped_module")
                                                   for name, _ in module.named_modules()))

    @staticmethod
    def blocks(model: Any, module: Any) -> list[str]:
        return ActivationCheckpointing(1).layout(model, module)["blocks"]

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, CheckpointedTensorParallel, "style", "trained", "parallelize")

        from difftest import LoadedModel
        from settings._training_script import training_script

        summary, world_size, functions, layout = self.script_parts(case)
        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        return training_script(case, f"{summary}, then each block checkpointed (checkpoint_wrapper, {self.mode})",
                               world_size, (*functions, selective_policy, checkpointed),
                               {**layout, "checkpointed": self.blocks(model, model.build("cpu")),
                                "checkpoint_mode": self.mode})


@dataclass(frozen=True)
class CheckpointedPipeline(Setting):
    """The `pipeline` family's training under `schedule` over `world_size` ranks (as many micro-batches as pipeline
    ranks, DualPipeV as many as stages, which it requires; the V schedules trained without their eval(), which
    raises), each stage's layer units checkpointed (`checkpoint_stages`) before the schedule is built: the schedule's backward recomputes every unit's
    activations, and a split-backward schedule (interleaved zero bubble, ZBV, DualPipeV) does so in the input
    gradient's pass and keeps what the weight gradient's needs. Non-reentrant and selective (torchtitan's modes; a
    reentrant checkpoint refuses the `inputs` every schedule's stage backward passes to autograd, documented: "When
    use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an `inputs` parameter to
    .backward()"); in the full tier."""

    world_size: int
    schedule: str = "1f1b"
    mode: str = "non-reentrant"
    family: ClassVar[str] = "ac"
    tier_axes: ClassVar[tuple[str, ...]] = ("schedule", "mode")
    in_default_tier: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"ac/pipeline/{self.schedule}/{self.mode}/ws{self.world_size}"

    def parallel(self) -> Any:
        """The pipeline setting whose training this one checkpoints."""
        from settings.pipeline import V_SCHEDULES, Pipeline, PipelineTrainedOnly, microbatch_counts

        kind = PipelineTrainedOnly if self.schedule in V_SCHEDULES else Pipeline
        return kind(self.schedule, self.world_size, microbatch_counts(self.schedule, self.world_size)[0])

    @property
    def reference(self) -> str:  # type: ignore[override]
        return str(self.parallel().reference)

    def describe(self) -> str:
        return f"activation checkpointing ({self.mode}) of every layer unit of each stage, {self.parallel().describe()}"

    @property
    def collectives(self) -> frozenset[str]:
        return frozenset(self.parallel().collectives)

    def available(self) -> str | None:
        return self.parallel().available()  # type: ignore[no-any-return]

    def judges(self, tensor_name: str) -> bool:
        return bool(self.parallel().judges(tensor_name))

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        def prepare(stages: dict[int, Any]) -> None:
            checkpoint_stages(stages.values(), self.mode)
            ctx.notes["checkpointed units"] = str(sum(name.endswith("_checkpoint_wrapped_module") for stage in
                                                      stages.values() for name, _ in stage.named_modules()))

        return self.parallel().trained(ctx, model, inputs, prepare_stages=prepare)  # type: ignore[no-any-return]

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, CheckpointedPipeline, "parallel")

        from settings._pipeline_stages import pipeline_script

        pipeline = self.parallel()
        return pipeline_script(case, self.describe(),
                               lambda chain: {**pipeline.layout(chain, case.seed), "checkpointing": self.mode},
                               self.world_size, "plain SGD", pipeline.replicas(),
                               functions=(selective_policy, checkpointed, checkpoint_stages))


def checkpoint_stages(stages: Any, mode: str) -> None:
    """Every layer unit of each pipeline stage (a `ChainStage`, its `units`) checkpointed in `mode`, in place."""
    for stage in stages:
        checkpointed(stage, [f"units.{i}" for i in range(len(stage.units))], mode)


register_settings(
    [ActivationCheckpointing(1, "single", mode) for mode in MODES]
    + [ActivationCheckpointing(ws, wrap, mode) for wrap in ("ddp", "fsdp2") for mode in MODES for ws in (2, 4)]
    + [CheckpointedTensorParallel(2, sp, mode=mode) for sp in (False, True) for mode in ("non-reentrant", "selective")]
    + [CheckpointedPipeline(2, schedule, mode) for mode in ("non-reentrant", "selective")
       for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")]
)
