"""The model run in DTensor end to end: data parallel written the way DTensor's SPMD API documents it.

`distribute_module` makes every parameter and buffer a replicated DTensor; every tensor the model is called with
becomes a DTensor sharded over the ranks (`distribute_tensor`), on the batch dimension or on the last one, and what
the model returns is made whole again. So every operator of the forward and backward pass, and the optimizer's
update, runs under DTensor's sharding rules on the model's own composition of views, reshapes, reductions and
normalisations: a batch-sharded matmul's weight gradient arrives as a pending sum (`Partial`) that the update
reduces; a last-dim-sharded input makes the first layer contract over a sharded dimension, and whatever follows
runs on partial sums until a rule redistributes them. The model's widths and the batch need not divide by the
number of ranks: DTensor shards unevenly, as `torch.chunk` does. Plain tensors the model makes itself (a mask, a
position range) meet DTensors as replicated ones (`implicit_replication`, as tensor parallel runs). Judged against
one process on the whole batch: evaluation before and after training, the losses and every parameter after each
step.

`dtensor/batch-sharded/fully-shard/…` and `…/replicate/…` hand such a model to FSDP2 on the mesh its DTensors already
live on, the way torch documents it for a whole-model DTensor program (`fully_shard(module, mesh=mesh,
dp_mesh_dims=DataParallelMeshDims(shard="dp"))`; `replicate_with_fsdp.replicate` with `replicate="dp"`): FSDP then
owns the reduction of the gradients over the data-parallel dimension, which arrive as DTensor's pending sums. A
release without `DataParallelMeshDims` has them `unsupported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    SHARDED,
    ModelSpec,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    refuse_changed_hooks,
    register_settings,
    traits_of,
)
from settings._tp_apply import stepping
from settings._training import build_for_training, full_parameters, gathered_parameters, train_data_parallel
from settings.fsdp import make_contiguous
from settings.tensor_parallel import views_refused_by_design

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# where each tensor the model is called with is sharded: its first (batch) dimension, or its last one
SHARDED_DIMS = ("batch", "last")


@dataclass(frozen=True)
class DTensorSpmd(Setting):
    """Replicated DTensor parameters, inputs sharded on `dim` over `world_size` ranks, plain SGD."""

    world_size: int
    dim: str = "batch"
    # the loss taken on the model's outputs as DTensor leaves them (sharded like its inputs: a DTensor program's own
    # loss), not on the whole outputs (`ShardedLossSpmd`)
    sharded_loss: bool = False
    wrap: str = ""  # a key of WRAPS: FSDP2 over the DTensors' own mesh; "": DTensor alone reduces the gradients
    family: ClassVar[str] = "dtensor"
    tier_axes: ClassVar[tuple[str, ...]] = ("dim",)

    @property
    def name(self) -> str:
        return (f"dtensor/{self.dim}-sharded{'/sharded-loss' if self.sharded_loss else ''}"
                f"{'/' + self.wrap if self.wrap else ''}/ws{self.world_size}")

    def describe(self) -> str:
        where = "the batch dimension" if self.dim == "batch" else "the last dimension"
        loss = "; the loss taken on the sharded outputs" if self.sharded_loss else ""
        wrap = f"; {WRAPS[self.wrap]} over the same mesh" if self.wrap else ""
        return (f"DTensor over {self.scale} ranks: parameters replicated, the model's inputs sharded on {where}, "
                f"every operator under DTensor's rules{loss}{wrap}")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_reduce"})

    @property
    def options(self) -> dict[str, Any]:
        """What `distribute` takes; `data_parallel` 1: every rank is called with the whole batch, which DTensor
        shards (a standalone script feeds it so)."""
        return {"dim": self.dim, "data_parallel": 1, "sharded_loss": self.sharded_loss, "wrap": self.wrap}

    def supports(self, spec: ModelSpec) -> str | None:
        if "torchrec" in traits_of(spec.kind):
            return (f"model kind {spec.kind!r} is called with KeyedJaggedTensors, which DTensor does not shard "
                    f"(TorchRec shards its tables itself: the torchrec family)")
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        module = distribute(build_for_training(model, ctx.device), ctx.group, ctx.device, self.options)
        with views_refused_by_design("its inputs' sharding left"), stepping(module):
            return train_data_parallel(ctx, model, inputs, module, lambda: gathered_parameters(ctx, model, module),
                                       data_shard=(0, 1))

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, DTensorSpmd)  # its subclasses change fields, no hook
        return self._script(case, self.world_size)

    def _script(self, case: StandaloneCase, ranks: int) -> Script:
        from settings._training_script import training_script

        where = "the batch dimension" if self.dim == "batch" else "the last dimension"
        loss = "; the loss on the outputs as DTensor leaves them, sharded" if self.sharded_loss else ""
        wrap = f"; then {WRAPS[self.wrap]} on that mesh" if self.wrap else ""
        return training_script(case, f"DTensor SPMD (distribute_module: parameters replicated; the model's inputs "
                                     f"sharded on {where} by distribute_tensor{loss}{wrap})", ranks,
                               (make_contiguous, distribute, data_parallel_over_mesh, stepping, full_parameters),
                               self.options)


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """Every parameter and buffer a replicated DTensor over `group`; every tensor the module is called with a DTensor
    sharded on `setting["dim"]` (its first or its last dimension: each rank keeps its chunk), and every DTensor it
    returns whole again, except, with `setting["sharded_loss"]`, while it trains (gradients enabled: an evaluation runs
    without): then its outputs reach the loss as DTensor leaves them."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
    from torch.utils._pytree import tree_map

    mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("dp",))
    if setting.get("wrap"):
        make_contiguous(module)  # FSDP2 refuses the transposed views a converted graph holds

    def sharded(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0:
            return value
        return distribute_tensor(value, mesh, [Shard(0 if setting["dim"] == "batch" else value.dim() - 1)])

    def whole(value: Any) -> Any:
        if setting.get("sharded_loss") and torch.is_grad_enabled():
            return value
        return value.full_tensor() if isinstance(value, DTensor) else value

    distribute_module(module, mesh)  # no partition function: every parameter and buffer replicated
    module.register_forward_pre_hook(lambda _m, args, kwargs: (tree_map(sharded, args), tree_map(sharded, kwargs)),
                                     with_kwargs=True)
    module.register_forward_hook(lambda _m, _args, output: tree_map(whole, output))
    if setting.get("wrap"):  # FSDP2 takes over the gradients' reduction on the mesh dimension the batch is sharded on
        data_parallel_over_mesh(module, mesh, setting["wrap"])
    return module


# what each `wrap` applies, as torch's documentation names it
WRAPS = {"fully-shard": "fully_shard(dp_mesh_dims=DataParallelMeshDims(shard='dp'))",
         "replicate": "replicate_with_fsdp.replicate(dp_mesh_dims=DataParallelMeshDims(replicate='dp'))"}


def data_parallel_over_mesh(module: Any, mesh: Any, wrap: str) -> None:
    """FSDP2 (`fully-shard`) or its replicate (`replicate`) applied to `module`, whose parameters are DTensors on
    `mesh`, with the mesh's `dp` dimension as the data-parallel one; a release without `DataParallelMeshDims` raises
    Unsupported."""
    import torch

    try:
        from torch.distributed.fsdp import DataParallelMeshDims
    except ImportError:
        raise Unsupported(f"torch {torch.__version__} has no DataParallelMeshDims: FSDP2 over parameters that are "
                          "DTensors on its own mesh (fully_shard's dp_mesh_dims) came in a later release") from None
    if wrap == "fully-shard":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))


@dataclass(frozen=True)
class ShardedLossSpmd(DTensorSpmd):
    """Inputs sharded on the batch, and the loss taken on the outputs as DTensor leaves them: a class of its own, so
    that the default tier runs it beside the plain batch-sharded setting, not in its place."""

    sharded_loss: bool = True


@dataclass(frozen=True)
class EmptyShardSpmd(DTensorSpmd):
    """Over 4 ranks: a dimension of 5, 6 or 9 chunks as 2+2+1+0, 2+2+2+0 or 3+3+3+0, so that one rank holds an empty
    shard of the inputs and of what follows from them; over 3 ranks only widths of 1, 2 and 4 leave one (the full
    tier, as ws3 is; the default tier runs 2 ranks)."""

    in_default_tier: ClassVar[bool] = False


@dataclass(frozen=True)
class FsdpOverSpmd(DTensorSpmd):
    """Inputs sharded on the batch, then FSDP2 (or its replicate) over the DTensors' own mesh, in `ranks` new
    processes: FSDP2 keeps what it set up on a mesh in process state, and a second model wrapped in the same process
    (the next case of a worker) met it ("Expected param's DTensor mesh to be the same mesh passed to fully_shard",
    or gradients reduced otherwise than in a fresh process), which a user's program that wraps one model never meets.
    In the full tier: new processes cost a case seconds of start-up and imports."""

    world_size: int = 1  # the sweep's process only starts the new processes' group
    wrap: str = "fully-shard"
    ranks: int = 2
    size_parameters: ClassVar[frozenset[str]] = frozenset()
    in_default_tier: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"dtensor/{self.dim}-sharded/{self.wrap}/ws{self.ranks}"

    @property
    def scale(self) -> int:
        return self.ranks

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.ranks, SHARDED | {"all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._resumable import train_in_new_processes

        return train_in_new_processes(self, ctx, model, self.ranks, "FSDP2 over DTensors' own mesh")

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """One new process's part: what `DTensorSpmd.run` does, on the new processes' group."""
        return DTensorSpmd.run(self, ctx, model, inputs)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, FsdpOverSpmd, "train")
        return self._script(case, self.ranks)  # the script starts its ranks itself, as the new processes are


register_settings([*(DTensorSpmd(ws, dim) for dim in SHARDED_DIMS for ws in (2, 3)),
                   *(ShardedLossSpmd(ws) for ws in (2, 3)),
                   *(FsdpOverSpmd(wrap=wrap, ranks=ranks) for wrap in WRAPS for ranks in (2, 3)),
                   *(EmptyShardSpmd(4, dim) for dim in SHARDED_DIMS)])
