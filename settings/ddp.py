"""DistributedDataParallel, with the constructor options that change its numerics or control flow.

Every rank trains on its contiguous share of the global batch; DDP averages gradients, which equals the
reference's global-mean gradient because the shares are equal. `no-sync` accumulates two micro-batches
locally (`no_sync()` on the first) before the synchronising backward, each loss scaled by 1/2. `sync-batchnorm`
converts a model's BatchNorm layers to SyncBatchNorm first (`SyncBatchNorm.convert_sync_batchnorm`, as torch's DDP
documentation tells users to): statistics over the global batch, as one process computes them; torch computes them
on GPU tensors only, so on the CPU the variant is `unsupported` with torch's words.
"""

# ruff: noqa: F821 -- `backward_on_share` calls the model's `model_loss`, which a standalone script defines before it

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    DATA_PARALLEL,
    ModelSpec,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    features_of,
    record_training,
    refuse_changed_hooks,
    register_settings,
)
from settings._training import build_for_training, canonical_parameters, full_parameters

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# the model's loss, defined in a standalone script before `backward_on_share` (declared so that this module checks)
model_loss: Callable[..., Any]

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # one bucket per parameter: reductions run in a different grouping and order
    "bucket-tiny": {"bucket_cap_mb": 1e-6},
    "grad-as-bucket-view": {"gradient_as_bucket_view": True},
    "static-graph": {"static_graph": True},
    "find-unused": {"find_unused_parameters": True},
    "no-sync": {},
    "sync-batchnorm": {},
}


@dataclass(frozen=True)
class DataParallel(Setting):
    """torch DistributedDataParallel over gloo/nccl, plain SGD."""

    world_size: int
    variant: str = "default"
    family: ClassVar[str] = "ddp"
    tier_axes: ClassVar[tuple[str, ...]] = ("variant",)

    @property
    def name(self) -> str:
        return f"ddp/{self.variant}/ws{self.world_size}"

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in VARIANTS[self.variant].items()) or "defaults"
        if self.variant == "no-sync":
            options = "2 micro-batches, no_sync() on the first"
        if self.variant == "sync-batchnorm":
            options = "BatchNorm converted to SyncBatchNorm"
        return f"DDP over {self.world_size} ranks ({options})"

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, DATA_PARALLEL)

    def supports(self, spec: ModelSpec) -> str | None:
        if self.variant == "sync-batchnorm" and "BatchNorm" not in features_of(spec):
            return "the model has no BatchNorm layer: SyncBatchNorm would change nothing (ddp/default runs it)"
        return None

    @property
    def options(self) -> dict[str, Any]:
        """What `distribute` takes: DDP's keyword options, and whether BatchNorm becomes SyncBatchNorm first."""
        return {"options": VARIANTS[self.variant], "sync_batchnorm": self.variant == "sync-batchnorm"}

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        try:
            return self._train(ctx, model, inputs)
        except ValueError as exc:  # torch's refusal of SyncBatchNorm on a device it does not synchronise on, by
            # design (DDP's constructor and SyncBatchNorm's forward check it), in torch's words
            if self.variant == "sync-batchnorm" and "SyncBatchNorm" in str(exc):
                raise Unsupported(f"torch refuses SyncBatchNorm on {ctx.device}: {exc}") from None
            raise

    def _train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        module = build_for_training(model, ctx.device)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise Unsupported("every parameter is frozen; DDP refuses a module with nothing to train")
        ddp = distribute(module, ctx.group, ctx.device, self.options)
        optimizer = torch.optim.SGD(trainable, lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            if self.variant != "no-sync":
                loss = model.loss(model.forward(ddp, batch, ctx.device), batch)
                loss.backward()
                optimizer.step()
                return loss.item()
            half = batch.size // 2
            first, second = batch.slice(0, half), batch.slice(half, batch.size)
            with ddp.no_sync():
                loss_a = model.loss(model.forward(ddp, first, ctx.device), first) * (first.size / batch.size)
                loss_a.backward()
            loss_b = model.loss(model.forward(ddp, second, ctx.device), second) * (second.size / batch.size)
            loss_b.backward()
            optimizer.step()
            return loss_a.item() + loss_b.item()

        def read() -> dict | None:
            return canonical_parameters(model, ddp) if ctx.rank == 0 else None

        return record_training(ctx, inputs, lambda b: model.evaluate(ddp, b, ctx.device), train_step, read)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, DataParallel)

        from settings._training_script import training_script

        options = ", ".join(f"{k}={v}" for k, v in VARIANTS[self.variant].items()) or "default options"
        own: tuple[Any, ...] = (distribute, full_parameters)
        if self.variant == "no-sync":
            options, own = "two micro-batches per step, no_sync() on the first", (*own, backward_on_share)
        if self.variant == "sync-batchnorm":
            options = "BatchNorm converted to SyncBatchNorm"
        return training_script(case, f"DistributedDataParallel ({options})", self.world_size, own, self.options)


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The model in DistributedDataParallel with the variant's options, as the setting wraps it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(device)] if device.startswith("cuda") else None
    if setting.get("sync_batchnorm"):  # the same parameters, in SyncBatchNorm layers reducing over `group`
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group, **setting["options"])


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """The no-sync step's gradients of training samples start..stop, as the setting takes them: two micro-batches, the
    first's backward inside DDP's no_sync() (its gradients stay local, to be all-reduced with the second's), each loss
    weighted by its part of the share. One process (no DDP) takes the share in one backward pass."""
    if not hasattr(module, "no_sync"):
        model_loss(module, data, start, stop, dtype).backward()
        return
    middle = start + (stop - start) // 2
    with module.no_sync():
        (model_loss(module, data, start, middle, dtype) * ((middle - start) / (stop - start))).backward()
    (model_loss(module, data, middle, stop, dtype) * ((stop - middle) / (stop - start))).backward()


register_settings(DataParallel(ws, variant) for variant in VARIANTS for ws in (2, 3, 4))
