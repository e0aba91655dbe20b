"""TorchRec DistributedModelParallel: every sharding type × world size, the planner's plan, seeded mixed plans.

Plans are built explicitly with `construct_module_sharding_plan` and the per-type generators, because the
CPU planner refuses the row-wise family. The dense part runs under DMP's own DDP wrapper; embedding tables
use TorchRec's fused in-backward SGD; both follow the global-mean loss like the reference.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    EVAL_BEFORE,
    SHARDED,
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Unsupported,
    across,
    gather_to_rank0,
    record_training,
    refuse_changed_hooks,
    register_settings,
    register_world_reset,
    to_numpy,
    traits_of,
)
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
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        module = self.sharded_module(model, model.build("cpu"), inputs)
        tables = [p for collection in embedding_collections(module).values() for p in collection.parameters()]
        table_optimizer, options = self.table_optimizer(ctx)
        apply_optimizer_in_backward(table_optimizer, [p for p in tables if p.requires_grad], options)
        # a fused table is trained whatever its requires_grad says: without an optimizer of its own it gets the
        # sharder's default fused SGD (fbgemm's lr 0.01). TorchRec's way to freeze one is an optimizer that does not
        # move it (torchrec#1990): a frozen table takes gradients (the hook needs them) into SGD with lr 0, and
        # w - 0·g is w, bit for bit
        frozen = [p.requires_grad_(True) for p in tables if not p.requires_grad]
        if frozen:
            apply_optimizer_in_backward(torch.optim.SGD, frozen, {"lr": 0.0})

        initial = self.initial_state(model, module)  # read before DMP shards `module` in place
        sharder = self.sharder()
        env = ShardingEnv.from_process_group(ctx.group)
        device = torch.device(ctx.device)
        plan = self._plan(ctx, module, sharder)
        features = {config.name: list(config.feature_names) for collection in embedding_collections(module).values()
                    for config in table_configs(collection)}
        try:
            dmp = DistributedModelParallel(module, env=env, plan=plan, sharders=[sharder], device=device)
        except (ValueError, NotImplementedError, AssertionError) as exc:  # its words: an optimizer fbgemm's CPU
            # kernels lack says "Optimizer adam is not supported in CPU mode"
            raise Unsupported(f"TorchRec refused the plan or the optimizer: {type(exc).__name__}: {exc}") from exc
        self.load_initial_state(ctx, dmp, initial)
        ctx.notes["plan"] = _plan_summary(dmp.plan, features)

        # DMP hands data-parallel tables back as new parameters that require grad, with no optimizer of their own:
        # the dense optimizer trains them, so a frozen one is kept out of it by name
        frozen_names = set(model.spec.frozen)
        dense = [(n, p) for n, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad
                 and not any(n == f or n.endswith("." + f) for f in frozen_names)]
        optimizer = self.dense_optimizer(ctx, dense) if dense else None
        train_step, evaluate = self.trainer(ctx, model, dmp, optimizer)
        state = self.optimizer_state(ctx, dmp, optimizer)
        return record_training(ctx, inputs, evaluate, train_step, lambda: self.full_state(ctx, dmp),
                               optimizer_state=state)

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        """What DMP wraps: the model itself (a family that trains through another interface wraps it)."""
        return module

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        """(train_step, evaluate) of the plain loop: forward, backward (the fused tables update inside it), the dense
        optimizer's step."""

        def train_step(batch: Any) -> float:
            if optimizer is not None:
                optimizer.zero_grad()
            loss = model.loss(model.forward(dmp, batch, ctx.device), batch)
            loss.backward()  # embedding tables are updated inside backward (fused SGD)
            if optimizer is not None:
                self.dense_step(ctx, optimizer)
            return loss.item()

        return train_step, lambda batch: model.evaluate(dmp, batch, ctx.device)

    def full_state(self, ctx: RunContext, dmp: Any) -> dict | None:
        """Every parameter, unsharded, under the model's names, on rank 0 (collective)."""
        return _full_state(ctx, dmp)

    def sharder(self) -> Any:
        """What shards the collections (`sharded_module`'s): bags here."""
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        return EmbeddingBagCollectionSharder()

    def initial_state(self, model: Any, module: Any) -> dict[str, Any]:
        """The initial weights of what DMP wraps (`module`), under its names: the model's own here."""
        return dict(model.init_state)

    def table_optimizer(self, ctx: RunContext) -> tuple[type, dict[str, Any]]:
        """The optimizer TorchRec fuses into the tables' backward, by its class (TorchRec maps it to fbgemm's kernel),
        with its options: plain SGD here, the reference's."""
        import torch

        return torch.optim.SGD, {"lr": ctx.lr}

    def dense_optimizer(self, ctx: RunContext, named: list[tuple[str, Any]]) -> Any:
        """What trains the parameters outside the fused tables (data-parallel tables among them): plain SGD."""
        import torch

        return torch.optim.SGD([p for _, p in named], lr=ctx.lr)

    def optimizer_state(self, ctx: RunContext, dmp: Any, dense: Any) -> Callable[[], dict | None] | None:
        """What reads the optimizers' state after a step (collective), or None: plain SGD keeps none."""
        return None

    # hooks, so a planted fault (tests/faults) changes one step and nothing else
    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        _load_full_state(dmp, state)

    def dense_step(self, ctx: RunContext, optimizer: Any) -> None:
        optimizer.step()

    def _plan(self, ctx: RunContext, module: Any, sharder: Any) -> Any:
        try:
            return sharding_plan(module, sharder, self.sharding, self.plan_seed, ctx.world_size,
                                 ctx.local_world_size, ctx.device, ctx.group)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            if self.sharding == "planner":
                raise
            raise Unsupported(f"TorchRec cannot build this plan: {type(exc).__name__}: {exc}") from exc

    def attribute(self, first_divergence: str, notes: str) -> str | None:
        """A mixed plan's case is the case of the sharding type of the table its first divergence lies in: a pooled
        embedding names its feature (`pooled.tf0`), a table's weight names its table (`…embedding_bags.t0.weight`)."""
        if self.sharding != "mixed" or not first_divergence:
            return None
        parts = set(re.split(r"[./]", first_divergence.partition("/")[2]))
        for table, (sharding, features) in plan_tables(notes).items():
            if sharding in SHARDING_TYPES and (table in parts or parts & set(features)):
                return TorchRecSharding(sharding=sharding, world_size=self.world_size).name
        return None

    # --- a standalone script (difftest.scripts.emit) ------------------------------------------------
    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, TorchRecSharding, "load_initial_state", "sharded_module", "trainer", "full_state")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        pooled = {f"{EVAL_BEFORE}/{name}": name for t in tables for name in t.outputs}
        # by the tensor's kind (`pooled`): the example's first-diverging feature may not be in the minimal model
        phase, _, tensor = case.first_divergence.partition("/")
        kinds = {case.generator.tensor_class(name) for name in pooled.values()}
        if phase != EVAL_BEFORE or case.generator.tensor_class(tensor) not in kinds:
            raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a pooled embedding "
                              "of the first evaluation, which is what the script compares")
        if any("." in t.collection for t in tables):
            raise Unsupported("its embedding collections are nested inside the model; the script holds them at its top")
        batch = case.inputs["eval"]
        data, table_list = embedding_script_data(case, tables)
        plan = {"planner": "the plan TorchRec's EmbeddingShardingPlanner chooses",
                "mixed": f"a seeded random sharding type per table (seed {self.plan_seed})"}.get(
                    self.sharding, f"every table {self.sharding}")
        return Script(
            summary=f"TorchRec EmbeddingBagCollections sharded by DistributedModelParallel over {self.world_size} "
                    f"CPU ranks (gloo), {plan}"
                    + case.against("the same collections in one process: the pooled embeddings of one batch, before "
                                   "any training") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}"),
            case={"sharding": self.sharding, "plan_seed": self.plan_seed, "local_world_size": case.local_world_size,
                  "device": "cpu", "batch": batch.size, "tables": table_list},
            functions=(embedding_collections, table_configs, collection_tables, table_kinds, sharding_plan, _generator,
                       *_plan_helpers(self.sharding, tables, self.plan_seed, self.world_size),
                       _local_pieces, _load_full_state, standalone_tables, standalone_features, _pooled,
                       single_process, on_rank),
            tensors={name: recorded for recorded, name in pooled.items()},
            data=data, world_size=self.world_size)


def embedding_script_data(case: StandaloneCase, tables: list[Any]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """What a script of embedding collections ships: the tables' initial weights and the eval batch's bags (its data
    file), and each table as a literal (its `CASE["tables"]`)."""
    data = {f"state.{t.state_key}": case.init_state[t.state_key] for t in tables}
    for feature, bags in case.inputs["eval"].sparse.items():
        data |= {f"eval.{feature}.lengths": bags.lengths, f"eval.{feature}.values": bags.values}
        if bags.weights is not None:
            data[f"eval.{feature}.weights"] = bags.weights
    return data, [{"collection": t.collection, "name": t.name, "num_embeddings": t.num_embeddings,
                   "embedding_dim": t.embedding_dim, "pooling": t.pooling, "features": list(t.features),
                   "weighted": t.weighted, "outputs": list(t.outputs)} for t in tables]


def _plan_helpers(sharding: str, tables: list[Any], plan_seed: int, world_size: int) -> tuple[Callable, ...]:
    """The helpers `_generator` calls for the sharding types this plan uses (a script leaves the others out)."""
    helpers: dict[str, tuple[Callable, ...]] = {
        "planner": (_planner_plan,), "column_wise": (_column_shards,),
        "table_column_wise": (_column_shards, _table_column_wise), "grid_shard": (_column_shards, _grid_shard)}
    kinds = sorted(set(table_kinds(sharding, plan_seed, world_size, len(tables))))
    return tuple(dict.fromkeys(h for kind in kinds for h in helpers.get(kind, ())))


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


def plan_tables(notes: str) -> dict[str, tuple[str, list[str]]]:
    """Table → (sharding type, features) from a case's recorded plan (`_plan_summary`); {} where none is recorded."""
    return {m["table"]: (m["sharding"], [f for f in m["features"].split(",") if f])
            for m in _PLAN_ENTRY.finditer(notes)}


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


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def standalone_tables(case: dict[str, Any]) -> Any:
    """The model's embedding collections alone, each under the name the model gives it."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Tables(torch.nn.Module):
        def forward(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
            return {k: v for path, kjt in features.items() for k, v in self.get_submodule(path)(kjt).to_dict().items()}

    module = Tables()
    for path in dict.fromkeys(t["collection"] for t in case["tables"]):
        mine = [t for t in case["tables"] if t["collection"] == path]
        configs = [EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                                      feature_names=list(t["features"]), pooling=PoolingType[t["pooling"]]) for t in mine]
        module.add_module(path, EmbeddingBagCollection(tables=configs, is_weighted=mine[0]["weighted"],
                                                       device=torch.device(case["device"])))
    return module


def standalone_features(data: dict[str, Any], case: dict[str, Any], start: int, stop: int, dtype: Any) -> dict:
    """Samples start..stop of the evaluation batch: one KeyedJaggedTensor per collection, keyed in table order."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    features = {}
    for path in dict.fromkeys(t["collection"] for t in case["tables"]):
        keys, values, lengths, weights = [], [], [], []
        for f in [f for t in case["tables"] if t["collection"] == path for f in t["features"]]:
            bags = data[f"eval.{f}.lengths"]
            lo, hi = np.concatenate([[0], np.cumsum(bags)])[[start, stop]]
            keys.append(f)
            lengths.append(bags[start:stop])
            values.append(data[f"eval.{f}.values"][lo:hi])
            if f"eval.{f}.weights" in data:
                weights.append(data[f"eval.{f}.weights"][lo:hi])
        features[path] = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(lengths)),
            weights=torch.from_numpy(np.concatenate(weights)).to(dtype) if weights else None)
    return features


def _pooled(pooled: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: pooled[f].detach().cpu().numpy() for t in case["tables"] for f, name in zip(t["features"], t["outputs"])}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections on the whole batch, in `dtype`."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    with torch.no_grad():
        return _pooled(tables.to(dtype)(standalone_features(data, case, 0, case["batch"], dtype)), case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the collections; each rank pools its share of the batch."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    module, sharder = standalone_tables(case), EmbeddingBagCollectionSharder()
    plan = sharding_plan(module, sharder, case["sharding"], case["plan_seed"], world_size, case["local_world_size"],
                         case["device"], dist.group.WORLD)
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device(case["device"]))
    _load_full_state(dmp, {k[len("state."):]: v for k, v in data.items() if k.startswith("state.")})
    share = case["batch"] // world_size
    with torch.no_grad():
        mine = _pooled(dmp(standalone_features(data, case, rank * share, (rank + 1) * share, torch.float32)), case)
    shares = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {name: np.concatenate([s[name] for s in shares]) for name in mine} if shares else None


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
