"""Gradient clipping: the global gradient norm computed over every parameter and the gradients scaled to `MAX_NORM`
before each SGD step, in one process (the family's root) and under DDP, legacy FSDP, FSDP2, tensor parallel,
FSDP2 × tensor parallel and pipelines (alone, or replicated by DDP or FSDP2), each as its users clip: `torch.nn.utils.clip_grad_norm_` over DDP's replicated
gradients, over FSDP2's sharded DTensor gradients (the total norm a DTensor reduced across the shards) and over the
DTensor gradients of a tensor-parallel plan (the `tp` settings' and the `fsdp2-tp` settings' training, the model's own
plan where it has one), `FullyShardedDataParallel.clip_grad_norm_` for legacy FSDP (its documented way: the plain
function would see only each rank's shard), and a pipeline as torchtitan clips one (each rank's norm reduced over the
pipeline's ranks).

`MAX_NORM` is small enough that every generated model's gradient norm exceeds it, so the clipping really scales
(each case notes the norm it found). Besides what every training setting records, each step records the total norm
the clipping function returned (`train_step<i>/grad_norm`): a wrong norm and a wrong scaling both show, judged by the
calibrated envelope of the single-process root with the same norm type.
"""

# ruff: noqa: F821 -- `backward_on_share` calls the model's `model_loss`, reads `CLIP_NORM` and enters `stepping`, which
# a standalone script defines before it

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

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
)
from settings._compat import fully_shard_for
from settings._training import OneProcessRoot, build_for_training
from settings.fsdp import fsdp2_units, make_contiguous

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# what a standalone script defines before `backward_on_share` (declared so that this module checks)
model_loss: Callable[..., Any]
stepping: Callable[..., Any]
CLIP_NORM: float

MAX_NORM = 0.01
NORMS = {"2": 2.0, "inf": math.inf}
WRAPS = ("single", "ddp", "fsdp1", "fsdp2")


@dataclass(frozen=True)
class GradientClipping(Setting):
    """Plain SGD with the gradients clipped to a global norm, alone or under a data-parallel wrapper."""

    world_size: int
    wrap: str = "ddp"
    norm: str = "2"
    family: ClassVar[str] = "clip"
    tier_axes: ClassVar[tuple[str, ...]] = ("wrap",)

    @property
    def name(self) -> str:
        return f"clip/{self.wrap}/norm{self.norm}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return ClipReference(norm=self.norm).name

    def describe(self) -> str:
        return (f"gradients clipped to {self.norm}-norm {MAX_NORM:g} before each SGD step, {self.wrap} over "
                f"{self.world_size} ranks")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED if self.wrap in ("fsdp1", "fsdp2") else DATA_PARALLEL)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if self.wrap == "fsdp2":
            fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the model is built
        module = build_for_training(model, ctx.device)
        if not any(p.requires_grad for p in module.parameters()):
            raise Unsupported("every parameter is frozen: there is no gradient to clip")
        wrapped = distribute(module, ctx.group, ctx.device, self.layout(model, module))
        return clipped_training(ctx, model, inputs, wrapped, NORMS[self.norm])

    def layout(self, model: Any, module: Any) -> dict[str, Any]:
        return wrapper_layout(model, module, self.wrap)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, GradientClipping)

        from difftest import LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        script = training_script(case, f"Gradients clipped to {self.norm}-norm {MAX_NORM:g} after each backward "
                                 f"({'FullyShardedDataParallel.clip_grad_norm_' if self.wrap == 'fsdp1' else 'torch.nn.utils.clip_grad_norm_'}), "
                                 f"{self.wrap}", self.world_size,
                                 (fully_shard_for, make_contiguous, distribute, clip, full_parameters,
                                  backward_on_share), self.layout(model, model.build("cpu")))
        return with_clip_constants(script, self.norm)


def with_clip_constants(script: Script, norm: str) -> Script:
    """`script` with what its `clip` and `backward_on_share` read: the largest norm allowed and the norm's order."""
    return dataclasses.replace(script, preamble=(*script.preamble, "", f"MAX_NORM = {MAX_NORM!r}",
                                                 f"CLIP_NORM = float({norm!r})"))


@dataclass(frozen=True)
class ClipReference(OneProcessRoot, GradientClipping):  # type: ignore[misc]
    """The family's root: one process, the same clipping on the whole batch's gradients."""

    world_size: int = 1
    wrap: str = "single"


def wrapper_layout(model: Any, module: Any, wrap: str) -> dict[str, Any]:
    """What `distribute` needs: the wrapper, and FSDP2's units (as the FSDP2 family shards them)."""
    return {"wrap": wrap, "units": [name for name, _ in fsdp2_units(model, module)] if wrap == "fsdp2" else []}


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The module as the setting wraps it: itself, DDP, legacy FSDP (use_orig_params) or FSDP2 (each of its units,
    then the root, as the FSDP2 family shards)."""
    import torch

    wrap = setting["wrap"]
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[torch.device(device)] if device.startswith("cuda") else None,
                                       process_group=group)
    if wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module, process_group=group, device_id=torch.device(device),
                                        use_orig_params=True)
    if wrap == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh

        fully_shard = fully_shard_for(device)
        make_contiguous(module)
        mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("dp",))
        for name in reversed(setting["units"]):
            fully_shard(module.get_submodule(name), mesh=mesh)
        return fully_shard(module, mesh=mesh)
    return module


def clip(wrapped: Any, norm_type: float) -> float:
    """Clip the gradients of `wrapped` to `MAX_NORM` as its users do (legacy FSDP by its own method, which sees every
    shard; the rest by torch.nn.utils.clip_grad_norm_); the total norm before clipping."""
    import torch

    if hasattr(wrapped, "clip_grad_norm_"):  # legacy FSDP
        total = wrapped.clip_grad_norm_(MAX_NORM, norm_type)
    else:
        trainable = [p for p in wrapped.parameters() if p.requires_grad]
        total = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM, norm_type)
    if hasattr(total, "full_tensor"):  # FSDP2: the norm of DTensor gradients is a DTensor
        total = total.full_tensor()
    return float(total)


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """Every tensor `read(wrapped)` names, whole: legacy FSDP's while it has gathered its shards, a DTensor
    all-gathered (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    if hasattr(wrapped, "clip_grad_norm_"):  # legacy FSDP
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
            return {name: t.detach().clone() for name, t in read(wrapped).items()}
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in read(wrapped).items()}


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """A standalone script's backward pass of samples start..stop, then the clipping (the single process's too), inside
    what the setting's steps run in (tensor parallel's implicit replication)."""
    with stepping(module):
        model_loss(module, data, start, stop, dtype).backward()
        clip(module, CLIP_NORM)


def clipped_training(ctx: RunContext, model: Any, inputs: Any, wrapped: Any, norm_type: float) -> Outputs | None:
    """Plain SGD on this rank's share, the gradients clipped before each step; the norms each step found recorded."""
    import torch

    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=ctx.lr)
    norms: list[float] = []

    def train_step(batch: Any) -> float:
        optimizer.zero_grad()
        loss = model.loss(model.forward(wrapped, batch, ctx.device), batch)
        loss.backward()
        norms.append(clip(wrapped, norm_type))
        optimizer.step()
        return float(loss.item())

    def read() -> dict[str, np.ndarray] | None:
        full = {n: to_numpy(t) for n, t in full_parameters(wrapped, model.parameters).items()}
        return full if ctx.rank == 0 else None

    outputs = record_training(ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device), train_step, read)
    return with_norms(ctx, outputs, norms)


def with_norms(ctx: RunContext, outputs: Outputs | None, norms: list[float]) -> Outputs | None:
    """`outputs` (rank 0's) with the total norm each step's clipping returned, which the case's notes also say."""
    ctx.notes["total norm before clipping"] = ", ".join(f"{n:.4g}" for n in norms) + f" (max_norm {MAX_NORM:g})"
    if outputs is not None:
        for step, total in enumerate(norms, 1):
            outputs[f"train_step{step}/grad_norm"] = np.array([total], dtype=np.float64)
    return outputs


@dataclass(frozen=True)
class TensorParallelClipping(GradientClipping):
    """`clip_grad_norm_` over tensor-parallel gradients: tensor parallel alone (every rank on the whole batch, as the
    `tp` settings train) or FSDP2 over `world_size / 2` data-parallel groups × tensor parallel over 2 ranks (a 2-D
    mesh, as the `fsdp2-tp` settings train), with the model's own plan where it has one (its norms and embeddings
    in it with sequence parallel), else the column-/row-wise pairs."""

    wrap: str = "tp"
    sequence_parallel: bool = False
    # the default tier: tensor parallel on 2 ranks with and without sequence parallel (a derived plan without
    # positions refuses sequence parallel; the other covers those kinds)
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel",)

    @property
    def name(self) -> str:
        return f"clip/{self.wrap}{'-sp' if self.sequence_parallel else ''}/norm{self.norm}/ws{self.world_size}"

    def describe(self) -> str:
        return (f"gradients clipped to {self.norm}-norm {MAX_NORM:g} before each SGD step, "
                f"{self.parallel().describe()}")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_reduce"})

    def parallel(self) -> Any:
        """The tensor-parallel setting whose training this one clips."""
        from settings.fsdp_tp import FsdpTensorParallel
        from settings.tensor_parallel import TensorParallel

        if self.wrap == "tp":
            return TensorParallel(self.world_size, self.sequence_parallel)
        return FsdpTensorParallel(self.world_size // 2, 2, self.sequence_parallel)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if not any(p.requires_grad for p in model.build("cpu").parameters()):
            raise Unsupported("every parameter is frozen: there is no gradient to clip")
        norms: list[float] = []
        outputs = self.parallel().trained(ctx, model, inputs,
                                          before_step=lambda module: norms.append(clip(module, NORMS[self.norm])))
        return with_norms(ctx, outputs, norms)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, TensorParallelClipping, "parallel")

        from settings._training_script import training_script

        summary, world_size, functions, layout = self.parallel().script_parts(case)
        return with_clip_constants(
            training_script(case, f"{summary}; the gradients clipped to {self.norm}-norm {MAX_NORM:g} after each "
                            "backward (torch.nn.utils.clip_grad_norm_)", world_size,
                            (*functions, clip, backward_on_share), layout), self.norm)


@dataclass(frozen=True)
class PipelineClipping(GradientClipping):
    """Clipping across a pipeline's stages as torchtitan clips (`settings._pipeline_stages.clip_stages`): each rank
    the norm of its own stages' gradients, reduced over the pipeline's ranks, then its gradients scaled by it; the
    training of the `pipeline` setting of `schedule` over `world_size` ranks, with as many micro-batches as pipeline
    ranks; with `data_parallel` > 1, the hybrid's: that many pipelines side by side, `inner` (DDP or FSDP2) around
    each stage, the norm of an FSDP2 stage's sharded gradients a DTensor reduced over its replicas first."""

    wrap: str = "pipeline"
    schedule: str = "1f1b"
    data_parallel: int = 1
    inner: str = ""
    tier_axes: ClassVar[tuple[str, ...]] = ()  # one representative: the cheapest

    @property
    def name(self) -> str:
        if self.data_parallel == 1:
            return f"clip/pipeline/{self.schedule}/norm{self.norm}/ws{self.world_size}"
        return (f"clip/hybrid/{self.schedule}/dp{self.data_parallel}x{self.inner}/pp{self.parallel().pipeline_ranks}/"
                f"norm{self.norm}/ws{self.world_size}")

    def describe(self) -> str:
        return (f"gradients clipped to {self.norm}-norm {MAX_NORM:g} across the stages (torchtitan's way) before each "
                f"SGD step, {self.parallel().describe()}")

    def parallel(self) -> Any:
        """The pipeline setting whose training this one clips."""
        from settings.pipeline import Pipeline

        return Pipeline(self.schedule, self.world_size, self.world_size // self.data_parallel,
                        data_parallel=self.data_parallel, inner=self.inner)

    def available(self) -> str | None:
        import torch

        if not all(hasattr(torch.nn.utils, f) for f in ("get_total_norm", "clip_grads_with_norm_")):
            return f"torch {torch.__version__} has no torch.nn.utils.get_total_norm / clip_grads_with_norm_ (2.6 has)"
        return self.parallel().available()

    def judges(self, tensor_name: str) -> bool:
        return bool(self.parallel().judges(tensor_name))

    @property
    def collectives(self) -> frozenset[str]:
        return self.parallel().collectives | across(self.world_size, {"all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._pipeline_stages import clip_stages

        norms: list[float] = []
        clipping = {"norm": self.norm, "max_norm": MAX_NORM, "device": ctx.device}
        outputs = self.parallel().trained(
            ctx, model, inputs, before_step=lambda stages, group: norms.append(clip_stages(stages.values(), clipping,
                                                                                           group)))
        return with_norms(ctx, outputs, norms)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, PipelineClipping, "parallel")

        from settings._pipeline_stages import pipeline_script

        pipeline = self.parallel()
        return pipeline_script(case, pipeline.describe(),
                               lambda chain: {**pipeline.layout(chain, case.seed),
                                              "clipping": {"norm": self.norm, "max_norm": MAX_NORM,
                                                           "device": "cpu"}},
                               self.world_size, f"plain SGD, the gradients clipped to {self.norm}-norm {MAX_NORM:g} "
                               "across the stages before each step (torchtitan's way: each rank's norm reduced over "
                               "the pipeline's ranks)", pipeline.replicas())


register_settings(
    [ClipReference(norm=norm) for norm in NORMS]
    + [GradientClipping(ws, wrap, norm) for norm in NORMS for wrap in WRAPS[1:] for ws in (2, 4)]
    + [TensorParallelClipping(ws, "tp", norm, sp) for norm in NORMS for sp in (False, True) for ws in (2, 4)]
    + [TensorParallelClipping(4, "fsdp2-tp", norm, sp) for norm in NORMS for sp in (False, True)]
    + [PipelineClipping(ws, "pipeline", norm, schedule) for norm in NORMS
       for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble") for ws in (2, 4)]
    + [PipelineClipping(4, "pipeline", norm, schedule, data_parallel=2, inner=inner) for norm in NORMS
       for schedule in ("1f1b", "interleaved-1f1b") for inner in ("ddp", "fsdp2")]
)
