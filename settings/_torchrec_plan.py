"""How a TorchRec sharding setting places tables on ranks, and moves whole tensors in and out of a sharded model.

The plans (`sharding_plan`): one sharding type for every table, TorchRec's own planner, or a seeded random type per
table (mixed), each as TorchRec's parameter generators build it; what a case's plan was (`_plan_summary`, read back by
`plan_tables`). The state (`_load_full_state`, `gather_whole`): a model's full tensors scattered into its shards and
gathered back on rank 0. A standalone script copies these functions as they are."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from difftest import RunContext, gather_to_rank0, to_numpy
from settings._training import assemble

SHARDING_TYPES = (
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "data_parallel",
    "grid_shard",
)


def _plan_helpers(sharding: str, tables: list[Any], plan_seed: int, world_size: int) -> tuple[Callable, ...]:
    """The helpers `_generator` calls for the sharding types this plan uses (a script leaves the others out)."""
    helpers: dict[str, tuple[Callable, ...]] = {
        "planner": (_planner_plan,), "column_wise": (_column_shards,),
        "table_column_wise": (_column_shards, _table_column_wise), "grid_shard": (_column_shards, _grid_shard)}
    kinds = sorted(set(table_kinds(sharding, plan_seed, world_size, len(tables))))
    return tuple(dict.fromkeys(h for kind in kinds for h in helpers.get(kind, ())))


def plan_functions(sharding: str, tables: list[Any], plan_seed: int, world_size: int) -> tuple[Callable, ...]:
    """What a script copies to build the case's plan (`sharding_plan` and what it calls, the helpers of the sharding
    types this plan uses among them) and to load the initial weights into the shards (`_load_full_state`)."""
    return (embedding_collections, table_configs, collection_tables, table_kinds, sharding_plan, _generator,
            *_plan_helpers(sharding, tables, plan_seed, world_size), _local_pieces, _load_full_state)


def table_kinds(sharding: str, plan_seed: int, world_size: int, count: int) -> list[str]:
    """The sharding type of each of `count` tables, in plan order: `sharding`, or for "mixed" a seeded random one."""
    rng = random.Random(plan_seed * 1009 + world_size)
    return [rng.choice(SHARDING_TYPES) if sharding == "mixed" else sharding for _ in range(count)]


def sharding_plan(module: Any, sharder: Any, sharding: str, plan_seed: int, world_size: int, local_size: int,
                  device: str, group: Any) -> Any:
    """Every table of every collection sharded `sharding` ("mixed": a seeded random type per table), or the plan
    TorchRec's planner chooses ("planner"). Built explicitly, because the CPU planner refuses the row-wise family."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    if sharding == "planner":
        return _planner_plan(module, sharder, world_size, local_size, device, group)
    collections = embedding_collections(module)
    count = sum(len(collection_tables(c)) for c in collections.values())
    kinds = iter(table_kinds(sharding, plan_seed, world_size, count))
    per_collection: dict[str, Any] = {}
    for path, collection in collections.items():
        generators = {}
        for position, table in enumerate(collection_tables(collection)):
            generators[table["name"]] = _generator(next(kinds), position, table, world_size, local_size)
        per_collection[path] = construct_module_sharding_plan(
            collection, generators, sharder=sharder, local_size=local_size, world_size=world_size,
            device_type=device.split(":")[0])
    return ShardingPlan(per_collection)


def embedding_collections(module: Any) -> dict[str, Any]:
    """Qualified name → EmbeddingBagCollection (or EmbeddingCollection) of every collection in an unsharded model, in
    module order (where a sharding plan names them: the `dlrm` kind's `sparse`, TorchRec DLRM's
    `sparse_arch.embedding_bag_collection`)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return {name: m for name, m in module.named_modules() if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)}


def table_configs(collection: Any) -> list[Any]:
    """A collection's table configs: a bag collection's or a sequence collection's."""
    configs = getattr(collection, "embedding_bag_configs", None) or collection.embedding_configs
    return list(configs())


def collection_tables(collection: Any) -> list[dict[str, Any]]:
    """The tables of a collection, in its order, as the plan generators read them (name, embedding dim)."""
    return [{"name": c.name, "embedding_dim": c.embedding_dim, "num_embeddings": c.num_embeddings}
            for c in table_configs(collection)]


def _planner_plan(module: Any, sharder: Any, world_size: int, local_size: int, device: str, group: Any) -> Any:
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    topology = Topology(world_size=world_size, compute_device=device.split(":")[0], local_world_size=local_size)
    return EmbeddingShardingPlanner(topology=topology).collective_plan(module, [sharder], group)


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


def _plan_summary(plan: Any, features: dict[str, list[str]]) -> str:
    """Which sharding type and ranks each table (with its features) got, e.g. 't0(tf0)=grid_shard@[0,1]
    w0(wf0)=table_wise@[1]': what `TorchRecSharding.attribute` reads back."""
    parts = []
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            ranks = ",".join(str(r) for r in sharding.ranks or [])
            parts.append(f"{table}({','.join(features.get(table, []))})={sharding.sharding_type}@[{ranks}]")
    return " ".join(sorted(parts))


_PLAN_ENTRY = re.compile(r"(?P<table>[^\s(=]+)\((?P<features>[^)]*)\)=(?P<sharding>\w+)@")


def plan_tables(plan: str) -> dict[str, tuple[str, list[str]]]:
    """Table → (sharding type, features) from a case's recorded plan (`_plan_summary`); {} where none is recorded."""
    return {m["table"]: (m["sharding"], [f for f in m["features"].split(",") if f])
            for m in _PLAN_ENTRY.finditer(plan)}


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


def _load_full_state(dmp: Any, state: dict, names: set[str] | None = None) -> None:
    """Copy every rank's share of the initial weights into the model (TorchRec initialises shards afresh); `names`:
    only those (the rest of the model's state, such as collision modules' per-rank buffers, stays as built)."""
    import torch

    held = dmp.state_dict()
    if names is not None and (missing := names - set(held)):
        raise KeyError(f"the sharded model holds no {sorted(missing)}")
    with torch.no_grad():
        for name, value in held.items():
            if names is not None and name not in names:
                continue
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
    return gather_whole(ctx, dmp.state_dict())


def gather_whole(ctx: RunContext, values: dict[str, Any]) -> dict | None:
    """Each of `values` (sharded, a DTensor, or replicated) whole, on rank 0 (replicated: the copy of the first rank
    holding it); collective. A name may be held by some ranks only (a fused optimizer's state of a table-wise table
    lives where the table does)."""
    mine = {}
    for name, value in values.items():
        pieces = _local_pieces(value)
        whole = pieces is None
        mine[name] = (tuple(value.shape), whole, [((0,) * value.dim(), to_numpy(value))] if whole else
                      [(offsets, to_numpy(tensor)) for offsets, tensor in pieces])
    gathered = gather_to_rank0(ctx, mine)
    if gathered is None:
        return None
    full = {}
    for name in dict.fromkeys(n for rank_values in gathered for n in rank_values):
        held = [rank_values[name] for rank_values in gathered if name in rank_values]
        shape, whole, _ = held[0]
        full[name] = held[0][2][0][1] if whole else assemble(shape, [p for _, _, pieces in held for p in pieces], name)
    return full
