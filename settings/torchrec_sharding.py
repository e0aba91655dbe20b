"""TorchRec DistributedModelParallel: every sharding type × world size, the planner's plan, seeded mixed plans.

Plans are built explicitly with `construct_module_sharding_plan` and the per-type generators, because the
CPU planner refuses the row-wise family. The dense part runs under DMP's own DDP wrapper; embedding tables
use TorchRec's fused in-backward SGD; both follow the global-mean loss like the reference.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.devices import SHARDED, across
from difftest.errors import Unsupported
from difftest.registry import register_settings, register_world_reset, traits_of
from difftest.setting import Outputs, RunContext, Setting
from settings._training import assemble, gather_to_rank0, record_training, to_numpy

SHARDING_TYPES = (
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "data_parallel",
    "grid_shard",
)
WORLD_SIZES = (2, 3, 4)


@dataclass(frozen=True)
class TorchRecSharding(Setting):
    """TorchRec DMP with an explicit per-table sharding plan (EmbeddingBagCollectionSharder)."""

    family: ClassVar[str] = "torchrec"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "plan_seed"})
    tier_axes: ClassVar[tuple[str, ...]] = ("sharding",)
    sharding: str
    world_size: int
    plan_seed: int = 0  # mixed plans only

    @property
    def name(self) -> str:
        label = f"mixed-s{self.plan_seed}" if self.sharding == "mixed" else self.sharding
        return f"torchrec/ebc/{label}/ws{self.world_size}"

    def describe(self) -> str:
        if self.sharding == "planner":
            return f"TorchRec DMP, plan chosen by EmbeddingShardingPlanner, {self.world_size} ranks"
        if self.sharding == "mixed":
            return f"TorchRec DMP, each table a seeded random sharding type (seed {self.plan_seed}), {self.world_size} ranks"
        return f"TorchRec DMP, every table {self.sharding}, {self.world_size} ranks"

    def supports(self, spec: Any) -> str | None:
        if "torchrec" not in traits_of(spec.kind):
            return f"TorchRec sharding needs EmbeddingBagCollections; model kind {spec.kind!r} has none"
        return None

    def available(self) -> str | None:
        try:
            import fbgemm_gpu  # noqa: F401
            import torchrec  # noqa: F401
        except Exception as exc:  # a broken fbgemm raises OSError/RuntimeError, not only ImportError
            return f"torchrec/fbgemm do not import ({type(exc).__name__}: {exc}); run ./install.sh"
        return None

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_to_all", "all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        module = model.build("cpu")
        tables = [p for collection in embedding_collections(module).values() for p in collection.parameters()]
        apply_optimizer_in_backward(torch.optim.SGD, [p for p in tables if p.requires_grad], {"lr": ctx.lr})
        # a fused table is trained whatever its requires_grad says: without an optimizer of its own it gets the
        # sharder's default fused SGD (fbgemm's lr 0.01). TorchRec's way to freeze one is an optimizer that does not
        # move it (torchrec#1990): a frozen table takes gradients (the hook needs them) into SGD with lr 0, and
        # w - 0·g is w, bit for bit
        frozen = [p.requires_grad_(True) for p in tables if not p.requires_grad]
        if frozen:
            apply_optimizer_in_backward(torch.optim.SGD, frozen, {"lr": 0.0})

        sharder = EmbeddingBagCollectionSharder()
        env = ShardingEnv.from_process_group(ctx.group)
        device = torch.device(ctx.device)
        plan = self._plan(ctx, module, sharder)
        try:
            dmp = DistributedModelParallel(module, env=env, plan=plan, sharders=[sharder], device=device)
        except (ValueError, NotImplementedError, AssertionError) as exc:
            raise Unsupported(f"TorchRec refused the plan: {type(exc).__name__}: {exc}") from exc
        self.load_initial_state(ctx, dmp, model.init_state)
        ctx.notes["plan"] = _plan_summary(dmp.plan)

        # DMP hands data-parallel tables back as new parameters that require grad, with no optimizer of their own:
        # the dense optimizer trains them, so a frozen one is kept out of it by name
        frozen_names = set(model.spec.frozen)
        dense = [p for n, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad
                 and not any(n == f or n.endswith("." + f) for f in frozen_names)]
        optimizer = torch.optim.SGD(dense, lr=ctx.lr) if dense else None

        def train_step(batch: Any) -> float:
            if optimizer is not None:
                optimizer.zero_grad()
            loss = model.loss(model.forward(dmp, batch, ctx.device), batch)
            loss.backward()  # embedding tables are updated inside backward (fused SGD)
            if optimizer is not None:
                self.dense_step(ctx, optimizer)
            return loss.item()

        return record_training(
            ctx, inputs, lambda b: model.evaluate(dmp, b, ctx.device), train_step, lambda: _full_state(ctx, dmp)
        )

    # hooks, so a planted fault (tests/faults) changes one step and nothing else
    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        _load_full_state(dmp, state)

    def dense_step(self, ctx: RunContext, optimizer: Any) -> None:
        optimizer.step()

    # --- plans ----------------------------------------------------------------------------------
    def _plan(self, ctx: RunContext, module: Any, sharder: Any) -> Any:
        from torchrec.distributed.types import ShardingPlan

        local_size = ctx.local_world_size
        if self.sharding == "planner":
            from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

            topology = Topology(
                world_size=ctx.world_size, compute_device=ctx.device.split(":")[0], local_world_size=local_size
            )
            return EmbeddingShardingPlanner(topology=topology).collective_plan(module, [sharder], ctx.group)

        rng = random.Random(self.plan_seed * 1009 + ctx.world_size)
        per_collection: dict[str, Any] = {}
        for path, collection in embedding_collections(module).items():
            generators = {}
            for position, table in enumerate(collection_tables(collection)):
                kind = rng.choice(SHARDING_TYPES) if self.sharding == "mixed" else self.sharding
                generators[table["name"]] = _generator(kind, position, table, ctx.world_size, local_size)
            per_collection[path] = _construct(collection, generators, sharder, local_size, ctx.world_size, ctx.device)
        return ShardingPlan(per_collection)


def embedding_collections(module: Any) -> dict[str, Any]:
    """Qualified name → EmbeddingBagCollection of every collection in an unsharded model, in module order (where a
    sharding plan names them: the `dlrm` kind's `sparse`, TorchRec DLRM's `sparse_arch.embedding_bag_collection`)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return {name: m for name, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)}


def collection_tables(collection: Any) -> list[dict[str, Any]]:
    """The tables of a collection, in its order, as the plan generators read them (name, embedding dim)."""
    return [{"name": c.name, "embedding_dim": c.embedding_dim, "num_embeddings": c.num_embeddings}
            for c in collection.embedding_bag_configs()]


def _construct(collection: Any, generators: dict, sharder: Any, local_size: int, world_size: int, device: str) -> Any:
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    try:
        return construct_module_sharding_plan(
            collection, generators, sharder=sharder, local_size=local_size, world_size=world_size,
            device_type=device.split(":")[0],
        )
    except (ValueError, AssertionError, NotImplementedError) as exc:
        raise Unsupported(f"TorchRec cannot build this plan: {type(exc).__name__}: {exc}") from exc


def _column_shards(dim: int, world_size: int) -> int:
    """Most column shards (≤ world size) that split `dim` into equal multiples of 4 (TBE's row alignment)."""
    for count in range(world_size, 1, -1):
        if dim % count == 0 and (dim // count) % 4 == 0:
            return count
    return 1


def _generator(kind: str, position: int, table: dict, world_size: int, local_size: int) -> Callable:
    from torchrec.distributed import sharding_plan as sp

    hosts = world_size // local_size
    if kind == "table_wise":
        return sp.table_wise(rank=position % world_size)
    if kind == "row_wise":
        return sp.row_wise()
    if kind == "column_wise":
        count = _column_shards(table["embedding_dim"], world_size)
        return sp.column_wise(ranks=[(position + j) % world_size for j in range(count)])
    if kind == "table_row_wise":
        return sp.table_row_wise(host_index=position % hosts)
    if kind == "table_column_wise":
        return _table_column_wise(position, table, world_size, local_size)
    if kind == "data_parallel":
        return sp.data_parallel()
    if kind == "grid_shard":
        return _grid_shard(table, world_size, local_size)
    raise ValueError(f"unknown sharding type {kind!r}")


def _table_column_wise(position: int, table: dict, world_size: int, local_size: int) -> Callable:
    """Column shards of a table placed on ranks of one host (TorchRec 1.9 ships no helper for this type)."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingType

    host = position % (world_size // local_size)
    count = _column_shards(table["embedding_dim"], local_size)
    ranks = [host * local_size + (position + j) % local_size for j in range(count)]

    def generator(param: Any, local: int, world: int, device_type: str, sharder: Any) -> Any:
        width = param.shape[1] // count
        placements = [([param.shape[0], width], [0, j * width], rank) for j, rank in enumerate(ranks)]
        return sp._get_parameter_sharding(
            param, ShardingType.TABLE_COLUMN_WISE.value, placements, local, device_type, sharder
        )

    return generator


def _grid_shard(table: dict, world_size: int, local_size: int) -> Callable:
    """One column block per host, rows split over the host's ranks.

    TorchRec's `grid_shard` helper takes no column block size and makes a single block for tables narrower
    than its minimum, so with two hosts it fails with IndexError; we pass the block size it computes with.
    """
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingType

    hosts = _column_shards(table["embedding_dim"], world_size // local_size)

    def generator(param: Any, local: int, world: int, device_type: str, sharder: Any) -> Any:
        blocks = sp._get_parameter_size_offsets(
            param, ShardingType.GRID_SHARD, local, world, col_wise_shard_dim=param.shape[1] // hosts
        )
        placements = [(size, offset, i) for i, (size, offset) in enumerate(blocks)]  # block-major: host h = ranks h*local..
        return sp._get_parameter_sharding(
            param, ShardingType.GRID_SHARD.value, placements, local, device_type, sharder
        )

    return generator


def _plan_summary(plan: Any) -> str:
    """Which sharding type and ranks each table got, e.g. 't0=grid_shard@[0,1] w0=table_wise@[1]'."""
    parts = []
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            ranks = sharding.ranks or []
            parts.append(f"{table}={sharding.sharding_type}@{ranks}")
    return " ".join(sorted(parts))


# --- state in and out of a sharded model ------------------------------------------------------------
def _local_pieces(value: Any) -> list[tuple[tuple[int, ...], Any]] | None:
    """(offsets, local tensor) of a sharded value, or None for a replicated plain tensor."""
    if hasattr(value, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment]
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [(tuple(offsets), value.to_local())]
    return None


def _load_full_state(dmp: Any, state: dict) -> None:
    """Copy every rank's share of the initial weights into the model (TorchRec initialises shards afresh)."""
    import torch

    with torch.no_grad():
        for name, value in dmp.state_dict().items():
            full = torch.from_numpy(state[name])
            pieces = _local_pieces(value)
            if pieces is None:
                value.copy_(full)
                continue
            for offsets, local in pieces:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                local.copy_(full[index])


def _full_state(ctx: RunContext, dmp: Any) -> dict | None:
    """Every parameter, unsharded, on rank 0 (replicated tensors: rank 0's copy)."""
    shapes, replicated, mine = {}, set(), {}
    for name, value in dmp.state_dict().items():
        shapes[name] = tuple(value.shape)
        pieces = _local_pieces(value)
        if pieces is None:
            replicated.add(name)
            mine[name] = [((0,) * value.dim(), to_numpy(value))]
        else:
            mine[name] = [(offsets, to_numpy(tensor)) for offsets, tensor in pieces]
    gathered = gather_to_rank0(ctx, mine)
    if gathered is None:
        return None
    return {
        name: gathered[0][name][0][1]
        if name in replicated
        else assemble(shape, [piece for rank_pieces in gathered for piece in rank_pieces[name]], name)
        for name, shape in shapes.items()
    }


register_settings(
    [TorchRecSharding(sharding=s, world_size=ws) for s, ws in itertools.product(SHARDING_TYPES, WORLD_SIZES)]
    + [TorchRecSharding(sharding="planner", world_size=ws) for ws in WORLD_SIZES]
    + [TorchRecSharding(sharding="mixed", world_size=ws, plan_seed=seed) for ws in WORLD_SIZES for seed in (0, 1)]
)


@register_world_reset
def _forget_torchrec_node_groups() -> None:
    """TorchRec creates its intra-/cross-node groups once per process (`torchrec.distributed.comm`); they belong
    to the case's world and are destroyed with it."""
    import sys

    comm = sys.modules.get("torchrec.distributed.comm")
    if comm is not None:
        for name in ("_INTRA_PG", "_CROSS_PG", "_INTRA_PG_2D", "_CROSS_PG_2D", "_NODE_GROUP_SIZE_2D"):
            if hasattr(comm, name):
                setattr(comm, name, None)
