"""2-D parallelism, torchtitan's way: tensor parallel inside groups of `tp` ranks, FSDP2 across the `dp` groups, on
one (dp, tp) device mesh. Every rank of a tensor-parallel group trains on the same share of the batch; the dp
groups split the batch. The model's own tensor-parallel plan runs where it has one (a transformer), the derived
column-/row-wise pairs elsewhere; FSDP2 then wraps per block (or per parameter-holding layer) and the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.devices import SHARDED, across
from difftest.registry import register_settings, register_world_reset
from difftest.setting import Outputs, RunContext, Setting
from settings._training import build_for_training, parameter_holders
from settings.fsdp import make_contiguous
from settings.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class FsdpTensorParallel(Setting):
    """FSDP2 over data-parallel groups × tensor parallel inside each, on a 2-D device mesh."""

    data_parallel: int
    tensor_parallel: int
    sequence_parallel: bool = False
    family: ClassVar[str] = "fsdp2-tp"
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel",)

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.data_parallel * self.tensor_parallel

    @property
    def name(self) -> str:
        style = "sequence-parallel" if self.sequence_parallel else "colwise-rowwise"
        return f"fsdp2-tp/dp{self.data_parallel}-tp{self.tensor_parallel}/{style}/ws{self.world_size}"

    def describe(self) -> str:
        return (f"FSDP2 over {self.data_parallel} data-parallel groups × tensor parallel over {self.tensor_parallel} "
                f"ranks{' with sequence parallel' if self.sequence_parallel else ''} (2-D mesh)")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._compat import fully_shard_for

        fully_shard = fully_shard_for(ctx.device)
        mesh = _mesh(ctx, self.data_parallel, self.tensor_parallel)
        tensor_parallel = TensorParallel(self.tensor_parallel, self.sequence_parallel)
        module = build_for_training(model, ctx.device)
        make_contiguous(module)  # FSDP2 refuses the transposed views a converted graph holds
        tensor_parallel.parallelize(ctx, model, module, inputs, mesh["tp"])
        units = model.blocks(module) or parameter_holders(module)
        for _, unit in reversed(units):
            if any(p.requires_grad for p in unit.parameters()):
                fully_shard(unit, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        dp_index = mesh["dp"].get_local_rank()
        return tensor_parallel.train(ctx, model, inputs, module, data_shard=(dp_index, self.data_parallel))


_MESHES: dict[tuple[int, int], Any] = {}
register_world_reset(_MESHES.clear)  # the mesh's groups die with the case's world


def _mesh(ctx: RunContext, dp: int, tp: int) -> Any:
    """The (dp, tp) mesh over the case's ranks, made once per world: every rank creates its subgroups in step."""
    if (dp, tp) not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[(dp, tp)] = init_device_mesh(ctx.device.split(":")[0], (dp, tp), mesh_dim_names=("dp", "tp"))
    return _MESHES[(dp, tp)]


register_settings(FsdpTensorParallel(2, 2, sp) for sp in (False, True))
