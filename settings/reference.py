"""The reference every other setting is compared with: one process, fp32, deterministic algorithms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import Outputs, RunContext, Setting, register_setting
from settings._training import build_for_training, train_single_process


@dataclass(frozen=True)
class Reference(Setting):
    """Single process, fp32, torch.use_deterministic_algorithms(True), plain SGD on the global batch."""

    family: ClassVar[str] = "reference"
    deterministic: ClassVar[bool] = True
    sample_order_free: ClassVar[bool] = True
    world_size: int = 1

    @property
    def name(self) -> str:
        return "reference"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return train_single_process(ctx, model, inputs, build_for_training(model, ctx.device))


register_setting(Reference())
