"""The legacy `FullyShardedDataParallel` (FSDP1): flat parameters sharded over the ranks. It refuses a CPU
run unless given `device_id=cpu`, so the device is passed explicitly. `use_orig_params=True` lets a unit
mix frozen and trainable parameters, as the frozen-parameter variants need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.devices import DATA_PARALLEL, SHARDED, across
from difftest.registry import register_settings
from difftest.setting import Outputs, RunContext, Setting
from settings._training import build_for_training, canonical_parameters, train_data_parallel

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


@dataclass(frozen=True)
class LegacyFsdp(Setting):
    """torch.distributed.fsdp.FullyShardedDataParallel with one sharding strategy, plain SGD."""

    world_size: int
    strategy: str = "full_shard"
    family: ClassVar[str] = "fsdp1"
    tier_axes: ClassVar[tuple[str, ...]] = ("strategy",)

    @property
    def name(self) -> str:
        return f"fsdp1/{self.strategy}/ws{self.world_size}"

    def describe(self) -> str:
        return f"legacy FSDP over {self.world_size} ranks, ShardingStrategy.{self.strategy.upper()}"

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, DATA_PARALLEL | (SHARDED if self.strategy != "no_shard" else frozenset()))

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        module = build_for_training(model, ctx.device)
        wrapped = FullyShardedDataParallel(
            module, process_group=ctx.group, device_id=torch.device(ctx.device),
            sharding_strategy=ShardingStrategy[self.strategy.upper()], use_orig_params=True,
        )
        self.wrapped(ctx, wrapped)

        def full_parameters() -> dict | None:
            with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
                full = canonical_parameters(model, wrapped)
            return full if ctx.rank == 0 else None

        return train_data_parallel(ctx, model, inputs, wrapped, full_parameters)

    def wrapped(self, ctx: RunContext, module: Any) -> None:
        """Called once the model is wrapped, before training (a hook for planted faults)."""


register_settings(LegacyFsdp(ws, strategy) for strategy in STRATEGIES for ws in (2, 3, 4))
