"""Gradient accumulation under sharded data parallelism: each rank's share of a step's batch is cut into
`micro_steps` contiguous micro-batches, each one's backward runs with the gradient reduction switched off but the
last's, and the optimizer steps once. That is how sharded training reaches a large global batch, and each wrapper has
its own switch: legacy FSDP's `no_sync()` (gradients kept unsharded and local until the synchronising backward),
FSDP2's `set_requires_gradient_sync(False)` (gradients accumulated unreduced), and FSDP2 with
`set_reshard_after_backward(False)` besides (parameters kept gathered between micro-batches: no all-gather after the
first). Each micro-batch's mean loss is weighted by its part of the share, so the gradients equal one backward of the
share's mean loss; judged against the plain single-process `reference`, one SGD step on the whole batch.
(DDP's `no_sync()` is a variant of the DDP family.)
"""

# ruff: noqa: F821 -- `backward_on_share` calls the model's `model_loss` and reads `WRAP`/`MICRO_STEPS`, which a
# standalone script defines before it

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
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
from settings._training import build_for_training
from settings.fsdp import make_contiguous
from settings.gradient_clipping import distribute, full_parameters, wrapper_layout

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# what a standalone script defines before `backward_on_share` (declared so that this module checks)
model_loss: Callable[..., Any]
WRAP: str
MICRO_STEPS: int

# the switch each wrapper offers, as `describe` and the script's summary name it
SWITCHES = {"fsdp1": "no_sync()", "fsdp2": "set_requires_gradient_sync(False)",
            "fsdp2-unsharded": "set_requires_gradient_sync(False) and set_reshard_after_backward(False)"}


@dataclass(frozen=True)
class GradientAccumulation(Setting):
    """Sharded data parallelism stepping once per `micro_steps` backward passes, gradient reduction off but on the
    last."""

    world_size: int
    wrap: str = "fsdp2"  # a key of SWITCHES
    micro_steps: int = 2
    family: ClassVar[str] = "accum"
    tier_axes: ClassVar[tuple[str, ...]] = ("wrap", "micro_steps")

    @property
    def name(self) -> str:
        return f"accum/{self.wrap}/micro{self.micro_steps}/ws{self.world_size}"

    def describe(self) -> str:
        return (f"{self.wrap.split('-')[0].upper()} over {self.world_size} ranks, each share in {self.micro_steps} "
                f"micro-batches, {SWITCHES[self.wrap]} on all but the last")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        if self.wrap.startswith("fsdp2"):
            fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the model is built
        share = inputs.train.size // self.world_size
        if share < self.micro_steps:
            raise Unsupported(f"a share of {share} sample(s) does not make {self.micro_steps} micro-batches")
        module = build_for_training(model, ctx.device)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise Unsupported("every parameter is frozen: there is no gradient to accumulate")
        wrapped = distribute(module, ctx.group, ctx.device, self.layout(model, module))
        optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            loss = accumulate(wrapped, self.wrap, self.micro_steps, batch.size,
                              lambda a, b: model.loss(model.forward(wrapped, batch.slice(a, b), ctx.device),
                                                      batch.slice(a, b)))
            optimizer.step()
            return loss

        def read() -> dict[str, Any] | None:
            full = {n: to_numpy(t) for n, t in full_parameters(wrapped, model.parameters).items()}
            return full if ctx.rank == 0 else None

        return record_training(ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device), train_step, read)

    def layout(self, model: Any, module: Any) -> dict[str, Any]:
        return wrapper_layout(model, module, "fsdp2" if self.wrap.startswith("fsdp2") else self.wrap)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, GradientAccumulation)

        from difftest import LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        script = training_script(case, f"Gradient accumulation: each rank's share in {self.micro_steps} micro-batches, "
                                 f"{SWITCHES[self.wrap]} on all but the last", self.world_size,
                                 (fully_shard_for, make_contiguous, distribute, full_parameters, synchronising,
                                  accumulate, backward_on_share), self.layout(model, model.build("cpu")))
        return dataclasses.replace(script, preamble=(*script.preamble, "", f"WRAP = {self.wrap!r}",
                                                     f"MICRO_STEPS = {self.micro_steps!r}"))


def synchronising(wrapped: Any, wrap: str, last: bool) -> Any:
    """The context a micro-batch's backward runs in: reduction on for the `last`, off before it, by `wrap`'s switch."""
    if wrap == "fsdp1":
        return contextlib.nullcontext() if last else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(last)
    if wrap == "fsdp2-unsharded":
        wrapped.set_reshard_after_backward(last)
    return contextlib.nullcontext()


def accumulate(wrapped: Any, wrap: str, micro_steps: int, size: int, loss_of: Callable[[int, int], Any]) -> float:
    """The gradients of a share of `size` samples, `micro_steps` contiguous micro-batches a backward each, each mean
    loss `loss_of(start, stop)` weighted by its part of the share; the share's mean loss."""
    bounds = [size * j // micro_steps for j in range(micro_steps + 1)]
    total = 0.0
    for j, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        with synchronising(wrapped, wrap, last=j == micro_steps - 1):
            loss = loss_of(start, stop) * ((stop - start) / size)
            loss.backward()
        total += loss.item()
    return total


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """A standalone script's gradients of samples start..stop: accumulated as the setting does under the wrapper; one
    backward pass of their mean loss in the single process."""
    if not (hasattr(module, "no_sync") or hasattr(module, "set_requires_gradient_sync")):
        model_loss(module, data, start, stop, dtype).backward()
        return
    accumulate(module, WRAP, MICRO_STEPS, stop - start,
               lambda a, b: model_loss(module, data, start + a, start + b, dtype))


register_settings(GradientAccumulation(ws, wrap, micro) for wrap in SWITCHES for micro in (2, 3) for ws in (2, 4))
