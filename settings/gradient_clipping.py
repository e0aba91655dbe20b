"""Gradient clipping: the global gradient norm computed over every parameter and the gradients scaled to `MAX_NORM`
before each SGD step, in one process (the family's root) and under DDP, legacy FSDP and FSDP2, each as its users
clip: `torch.nn.utils.clip_grad_norm_` over DDP's replicated gradients and over FSDP2's sharded DTensor gradients
(the total norm a DTensor reduced across the shards), `FullyShardedDataParallel.clip_grad_norm_` for legacy FSDP (its
documented way: the plain function would see only each rank's shard).

`MAX_NORM` is small enough that every generated model's gradient norm exceeds it, so the clipping really scales
(each case notes the norm it found). Besides what every training setting records, each step records the total norm
the clipping function returned (`train_step<i>/grad_norm`): a wrong norm and a wrong scaling both show, judged by the
calibrated envelope of the single-process root with the same norm type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest.devices import DATA_PARALLEL, SHARDED, across
from difftest.errors import Unsupported
from difftest.registry import register_settings
from difftest.setting import Outputs, RunContext, Setting
from settings._compat import fully_shard_for
from settings._training import build_for_training, record_training, to_numpy
from settings.fsdp import fsdp2_units, make_contiguous

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
        units = [name for name, _ in fsdp2_units(model, module)] if self.wrap == "fsdp2" else []
        wrapped = distribute(module, ctx.group, ctx.device, self.wrap, units)
        return clipped_training(ctx, model, inputs, wrapped, self.wrap, NORMS[self.norm])


@dataclass(frozen=True)
class ClipReference(GradientClipping):
    """The family's root: one process, deterministic algorithms, the same clipping on the whole batch's gradients."""

    world_size: int = 1
    wrap: str = "single"
    deterministic: ClassVar[bool] = True
    sample_order_free: ClassVar[bool] = True  # one full-batch step per clipping: any sample order is as good

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    @property
    def collectives(self) -> frozenset[str]:
        return frozenset()


def distribute(module: Any, group: Any, device: str, wrap: str, units: list[str]) -> Any:
    """The module as the setting wraps it: itself, DDP, legacy FSDP (use_orig_params) or FSDP2 (each of `units`, then
    the root, as the FSDP2 family shards)."""
    import torch

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
        for name in reversed(units):
            fully_shard(module.get_submodule(name), mesh=mesh)
        return fully_shard(module, mesh=mesh)
    return module


def clip(wrapped: Any, wrap: str, norm_type: float) -> float:
    """Clip the gradients of `wrapped` to `MAX_NORM` as the wrapper's users do; the total norm before clipping."""
    import torch

    if wrap == "fsdp1":
        total = wrapped.clip_grad_norm_(MAX_NORM, norm_type)
    else:
        trainable = [p for p in wrapped.parameters() if p.requires_grad]
        total = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM, norm_type)
    if hasattr(total, "full_tensor"):  # FSDP2: the norm of DTensor gradients is a DTensor
        total = total.full_tensor()
    return float(total)


def clipped_training(ctx: RunContext, model: Any, inputs: Any, wrapped: Any, wrap: str, norm_type: float) -> Outputs | None:
    """Plain SGD on this rank's share, the gradients clipped before each step; the norms each step found recorded."""
    import torch

    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=ctx.lr)
    norms: list[float] = []

    def train_step(batch: Any) -> float:
        optimizer.zero_grad()
        loss = model.loss(model.forward(wrapped, batch, ctx.device), batch)
        loss.backward()
        norms.append(clip(wrapped, wrap, norm_type))
        optimizer.step()
        return float(loss.item())

    def read() -> dict[str, np.ndarray] | None:
        from torch.distributed.tensor import DTensor

        if wrap == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
                full = {n: to_numpy(t) for n, t in model.parameters(wrapped).items()}
        else:
            full = {n: to_numpy(t.full_tensor() if isinstance(t, DTensor) else t)
                    for n, t in model.parameters(wrapped).items()}
        return full if ctx.rank == 0 else None

    outputs = record_training(ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device), train_step, read)
    ctx.notes["total norm before clipping"] = ", ".join(f"{n:.4g}" for n in norms) + f" (max_norm {MAX_NORM:g})"
    if outputs is not None:
        for step, total in enumerate(norms, 1):
            outputs[f"train_step{step}/grad_norm"] = np.array([total], dtype=np.float64)
    return outputs


register_settings(
    [ClipReference(norm=norm) for norm in NORMS]
    + [GradientClipping(ws, wrap, norm) for norm in NORMS for wrap in WRAPS[1:] for ws in (2, 4)]
)
