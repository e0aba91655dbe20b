"""The reference every other setting is compared with: one process, fp32, deterministic algorithms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.registry import register_setting
from difftest.setting import Outputs, RunContext, Setting
from settings._training import bce_loss, record_training, to_numpy


@dataclass(frozen=True)
class Reference(Setting):
    """Single process, fp32, torch.use_deterministic_algorithms(True), plain SGD on the global batch."""

    family: ClassVar[str] = "reference"
    deterministic: ClassVar[bool] = True
    world_size: int = 1

    @property
    def name(self) -> str:
        return "reference"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        module = model.build(ctx.device)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            loss = bce_loss(model.forward(module, batch, ctx.device), batch)
            loss.backward()
            optimizer.step()
            return loss.item()

        def full_parameters() -> dict:
            return {name: to_numpy(p) for name, p in module.named_parameters()}

        return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step, full_parameters)


register_setting(Reference())
