"""TorchRec's managed collisions: each of the model's bag tables behind a zero-collision hash
(`MCHManagedCollisionModule`) in a `ManagedCollisionEmbeddingBagCollection`, sharded row-wise by
DistributedModelParallel (`ManagedCollisionEmbeddingBagCollectionSharder`, the only sharding type it has), against the
same modules unsharded in one process.

A managed table gives each raw id the next free row of its rank's segment, so the sharded and the unsharded module
place the same id in different rows. Both sides are made alike where that placement cannot matter: every row of a
table starts as the same vector (the generated table's first row, and `init_fn` writes it again into a row an id is
given after eviction), and the raw ids are the model's ids plus 2**40, as hashed ids are, so that row-wise routing
(id mod ranks, for ids past the table) spreads them over the ranks. Then each id's embedding, trained or not, is the
same whichever row holds it, and every sample's pooled embedding must agree.
- `ample`: 4 × (rows + 1) slots per table, more than any rank can be sent: no id ever misses or evicts another.
- `scarce`: 8 slots (7 and a miss slot) and least-recently-used eviction every step: ids evict each other. Only one
  rank runs it, where sharded and unsharded hand out rows alike; on more ranks each rank's share of the slots
  decides who is evicted, which differs by design.
Recorded: every feature's pooled embedding per sample (`pooled.<feature>`) and the loss of the variable-batch family
(`settings.torchrec_vbe`), before and after the steps; not the tables, whose rows hold the ids in different orders.
Every table trains (a frozen variant's too: the family tests the collision modules). The CPU planner offers no
sharding type for these modules (torchrec#2958), so the plan is built explicitly, as the sharding family's is.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import RunContext, Setting, Unsupported, register_settings, traits_of
from settings._torchrec_plan import embedding_collections, table_configs
from settings._training import build_for_training
from settings.torchrec_sharding import HeldTablesSharding
from settings.torchrec_vbe import sharded_pooled_steps, train_alone

if TYPE_CHECKING:
    from difftest import Outputs, Script, StandaloneCase

RAW_ID_BASE = 2**40  # past every table: fbgemm's row-wise bucketing sends such an id to rank id mod ranks
SCARCE_SLOTS = 8
BUCKETS = 4  # the planner wants a table's buckets to divide by the ranks (1, 2 and 4 here)


@dataclass(frozen=True)
class Capacity:
    """How many slots each managed table has and how it frees them."""

    name: str
    eviction: str  # a torchrec.modules.mc_modules eviction policy

    def slots(self, rows: int) -> int:
        return SCARCE_SLOTS if self.name == "scarce" else 4 * (rows + 1)

    def policy(self) -> Any:
        from torchrec.modules import mc_modules

        return getattr(mc_modules, self.eviction)()


CAPACITIES = {c.name: c for c in (Capacity("ample", "LFU_EvictionPolicy"), Capacity("scarce", "LRU_EvictionPolicy"))}


def _constant_rows(row: Any) -> Callable[[Any], Any]:
    """An `init_fn` writing `row` into every row of the tensor it is given (in place, as torch.nn.init does)."""
    import torch

    def init(weight: Any) -> Any:
        with torch.no_grad():
            return weight.copy_(row.to(weight.dtype).expand_as(weight))

    return init


def managed_holder(module: Any, capacity: Capacity) -> Any:
    """The model's bag collections, each as a managed-collision collection of its tables under its own path (dots
    as `_`); `features`: path → its features. Its forward takes a KeyedJaggedTensor per path (the model's ids) and
    returns each collection's pooled embeddings by feature."""
    import torch
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    class Collections(torch.nn.Module):
        def forward(self, kjts: dict[str, Any]) -> dict[str, dict[str, Any]]:
            pooled = {}
            for path, kjt in kjts.items():
                raw = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() + RAW_ID_BASE, lengths=kjt.lengths(),
                                        weights=kjt.weights_or_none())
                pooled[path] = self.get_submodule(path)(raw)[0].to_dict()
            return pooled

    holder = Collections()
    holder.features = {}
    for path, collection in embedding_collections(module).items():
        if not isinstance(collection, EmbeddingBagCollection):
            raise Unsupported(f"{path} is a sequence collection; this family manages bag collections")
        weights = collection.state_dict()
        dtype, device = next(iter(weights.values())).dtype, next(iter(weights.values())).device
        configs = [dataclasses.replace(config, num_embeddings=capacity.slots(config.num_embeddings),
                                       init_fn=_constant_rows(weights[f"embedding_bags.{config.name}.weight"][0]))
                   for config in table_configs(collection)]
        bags = EmbeddingBagCollection(tables=configs, device=device).to(dtype)
        if "forward" in vars(collection):  # pool as the model's collection was made to (the float64 centre's own)
            bags.forward = types.MethodType(vars(collection)["forward"].__func__, bags)
        managers = {config.name: MCHManagedCollisionModule(
            zch_size=config.num_embeddings, device=device, eviction_policy=capacity.policy(),
            eviction_interval=1, buckets=BUCKETS) for config in configs}
        name = path.replace(".", "_")
        holder.add_module(name, ManagedCollisionEmbeddingBagCollection(
            bags, ManagedCollisionCollection(managers, configs)))
        holder.features[name] = [f for config in configs for f in config.feature_names]
    return holder


def _supports(spec: Any) -> str | None:
    if "torchrec" not in traits_of(spec.kind):
        return f"TorchRec's managed collisions hash a model's EmbeddingBagCollections; model kind {spec.kind!r} has none"
    return None


@dataclass(frozen=True)
class ManagedCollisionSharding(HeldTablesSharding):
    """TorchRec DMP over the model's tables behind managed-collision modules, every table row-wise."""

    family: ClassVar[str] = "torchrec-mc"
    tier_axes: ClassVar[tuple[str, ...]] = ("capacity",)
    sharding: str = "row_wise"
    world_size: int = 2
    capacity: str = "ample"

    @property
    def name(self) -> str:
        label = self.sharding if self.capacity == "ample" else f"{self.sharding}-{self.capacity}"
        return f"torchrec-mc/{label}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return ManagedCollisionReference(capacity=self.capacity).name

    def describe(self) -> str:
        slots = CAPACITIES[self.capacity]
        return (f"TorchRec DMP over managed-collision bag collections ({slots.name} slots, "
                f"{slots.eviction.removesuffix('_EvictionPolicy')} eviction), every table {self.sharding}, "
                f"{self.world_size} ranks")

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        return managed_holder(module, CAPACITIES[self.capacity])

    def sharder(self) -> Any:
        from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

        return ManagedCollisionEmbeddingBagCollectionSharder()

    def _plan(self, ctx: RunContext, module: Any, sharder: Any) -> Any:
        """Every table row-wise, keyed by the managed collection (not the bag collection inside it)."""
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingPlan

        return ShardingPlan({
            path: construct_module_sharding_plan(
                getattr(module, path), {f: row_wise() for f in _table_names(getattr(module, path))}, sharder=sharder,
                local_size=ctx.local_world_size, world_size=ctx.world_size, device_type=ctx.device.split(":")[0])
            for path in module.features})

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        """Every table's rows, shard by shard (DMP initialises the kernels' rows afresh); the collision modules start
        empty on each rank, as TorchRec builds them for its segment."""
        import torch

        from settings._torchrec_plan import _local_pieces

        with torch.no_grad():
            for name, value in dmp.state_dict().items():
                key = name.replace("_dmp_wrapped_module.", "").replace("module.", "")
                if key.endswith(".weight") and key in state:
                    full = torch.from_numpy(state[key])
                    for offsets, local in _local_pieces(value) or [((0, 0), value)]:
                        local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))])

    def full_state(self, ctx: RunContext, dmp: Any) -> dict | None:
        return {}  # rows hold the ids in an order of each side's own: compared through the pooled embeddings

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        return sharded_pooled_steps(self, ctx, dmp, optimizer, variable=False)

    def standalone(self, case: StandaloneCase) -> Script:
        raise Unsupported("the managed-collision family has no standalone emitter yet")


def _table_names(managed: Any) -> list[str]:
    return [config.name for config in managed._managed_collision_collection.embedding_configs()]


@dataclass(frozen=True)
class ManagedCollisionReference(Setting):
    """The family's root: the model's tables behind the same managed-collision modules, unsharded, plain SGD."""

    world_size: int = 1
    capacity: str = "ample"
    family: ClassVar[str] = "torchrec-mc"
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "torchrec-mc/single/ws1" if self.capacity == "ample" else f"torchrec-mc/single-{self.capacity}/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        return f"one process, the model's tables behind managed-collision modules ({self.capacity} slots), trained by SGD"

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        holder = managed_holder(build_for_training(model, ctx.device), CAPACITIES[self.capacity])
        return train_alone(ctx, inputs, holder, dict)


register_settings(
    [ManagedCollisionReference(capacity=c) for c in CAPACITIES]
    + [ManagedCollisionSharding(world_size=ws) for ws in (1, 2, 4)]
    + [ManagedCollisionSharding(world_size=1, capacity="scarce")]
)
