"""The legacy `FullyShardedDataParallel` (FSDP1): flat parameters sharded over the ranks. It refuses a CPU
run unless given `device_id=cpu`, so the device is passed explicitly. `use_orig_params=True` lets a unit
mix frozen and trainable parameters, as the frozen-parameter variants need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    DATA_PARALLEL,
    SHARDED,
    Outputs,
    RunContext,
    Setting,
    across,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
)
from settings._training import build_for_training, train_data_parallel

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

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
        module = build_for_training(model, ctx.device)
        wrapped = distribute(module, ctx.group, ctx.device, {"strategy": self.strategy})
        self.wrapped(ctx, wrapped)

        def read() -> dict | None:
            full = {name: to_numpy(tensor) for name, tensor in full_parameters(wrapped, model.parameters).items()}
            return full if ctx.rank == 0 else None

        return train_data_parallel(ctx, model, inputs, wrapped, read)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, LegacyFsdp, "wrapped")

        from settings._training_script import training_script

        return training_script(case, f"Legacy FullyShardedDataParallel (ShardingStrategy.{self.strategy.upper()}, "
                               "use_orig_params=True) around the whole model", self.world_size,
                               (distribute, full_parameters), {"strategy": self.strategy})

    def wrapped(self, ctx: RunContext, module: Any) -> None:
        """Called once the model is wrapped, before training (a hook for planted faults)."""


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The model in legacy FSDP, as the setting wraps it (a standalone script copies this)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    return FullyShardedDataParallel(module, process_group=group, device_id=torch.device(device),
                                    sharding_strategy=ShardingStrategy[setting["strategy"].upper()], use_orig_params=True)


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """Every tensor `read(wrapped)` names, whole: copied while FSDP1 has gathered its flat shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        return {name: tensor.detach().clone() for name, tensor in read(wrapped).items()}


register_settings(LegacyFsdp(ws, strategy) for strategy in STRATEGIES for ws in (2, 3, 4))
