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
- `adagrad` (beside SGD): the tables trained by fused Adagrad, the root's by torch.optim.Adagrad (eps 1e-8 on both).
- `dense` (beside fused): no optimizer fused into the tables, as a user who trains them with a torch.optim optimizer
  has them. `construct_module_sharding_plan` then gives every table TorchRec's DENSE kernel (its rule without an
  in-backward optimizer, although the collision sharder lists only fused kernels), and torch.optim.SGD over DMP's
  parameters steps them.
Recorded: every feature's pooled embedding per sample (`pooled.<feature>`) and the loss of the variable-batch family
(`settings.torchrec_vbe`), before and after the steps; not the tables, whose rows hold the ids in different orders.
Every table trains (a frozen variant's too: the family tests the collision modules). The CPU planner offers no
sharding type for these modules (torchrec#2958), so the plan is built explicitly, as the sharding family's is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import RunContext, Setting, Unsupported, register_settings, traits_of
from settings import _torchrec_mc_script as mc
from settings._torchrec_mc_script import (
    BUCKETS,
    EVICTION,
    KERNELS,
    OPTIMIZERS,
    RAW_ID_BASE,
    SCARCE_SLOTS,
    _constant_rows,
    managed_holder,
    managed_plan,
    managed_slots,
    table_rows,
)
from settings._torchrec_plan import _load_full_state, _local_pieces, embedding_collections, table_configs
from settings._training import build_for_training
from settings.torchrec_sharding import HeldTablesSharding
from settings.torchrec_vbe import sharded_pooled_steps, train_alone

if TYPE_CHECKING:
    from difftest import Outputs, Script, StandaloneCase


def _supports(spec: Any) -> str | None:
    if "torchrec" not in traits_of(spec.kind):
        return f"TorchRec's managed collisions hash a model's EmbeddingBagCollections; model kind {spec.kind!r} has none"
    return None


@dataclass(frozen=True)
class ManagedCollisionSharding(HeldTablesSharding):
    """TorchRec DMP over the model's tables behind managed-collision modules, every table row-wise."""

    family: ClassVar[str] = "torchrec-mc"
    tier_axes: ClassVar[tuple[str, ...]] = ("capacity", "kernel", "optimizer")
    sharding: str = "row_wise"
    world_size: int = 2
    capacity: str = "ample"
    kernel: str = "fused"  # KERNELS
    optimizer: str = "sgd"  # OPTIMIZERS

    @property
    def name(self) -> str:
        parts = (self.capacity, self.kernel, self.optimizer)
        label = "-".join([self.sharding] + [v for v in parts if v not in ("ample", "fused", "sgd")])
        return f"torchrec-mc/{label}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return ManagedCollisionReference(capacity=self.capacity, optimizer=self.optimizer).name

    def describe(self) -> str:
        return (f"TorchRec DMP over managed-collision bag collections ({self.capacity} slots, "
                f"{EVICTION[self.capacity].removesuffix('_EvictionPolicy')} eviction), every table {self.sharding}, "
                f"{OPTIMIZERS[self.optimizer][1]} {KERNELS[self.kernel]}, {self.world_size} ranks")

    def table_optimizer(self, ctx: RunContext) -> tuple[type, dict[str, Any]] | None:
        return mc.table_optimizer({"optimizer": self.optimizer, "lr": ctx.lr}) if self.kernel == "fused" else None

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        return managed_holder(module, self.capacity)

    def sharder(self) -> Any:
        from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

        return ManagedCollisionEmbeddingBagCollectionSharder()

    def _plan(self, ctx: RunContext, module: Any, sharder: Any) -> Any:
        return managed_plan(module, sharder, ctx.world_size, ctx.local_world_size, ctx.device)

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        _load_full_state(dmp, state, table_rows(state))

    def full_state(self, ctx: RunContext, dmp: Any) -> dict | None:
        return {}  # rows hold the ids in an order of each side's own: compared through the pooled embeddings

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        return sharded_pooled_steps(self, ctx, dmp, optimizer, variable=False)

    def standalone(self, case: StandaloneCase) -> Script:
        """The managed tables alone (`managed_holder`, as the run built them), sharded row-wise on the script's
        ranks and unsharded in one process: the pooled embeddings of the phase the case first diverged in."""
        from difftest import Script, refuse_changed_hooks
        from settings._torchrec_script import (
            bag_runs_kjt,
            embedding_script_data,
            standalone_features,
            standalone_tables,
        )
        from settings.torchrec_vbe import pooled_loss

        refuse_changed_hooks(self, ManagedCollisionSharding, "sharded_module", "trainer", "full_state",
                             "load_initial_state", "sharder", "_plan")
        tables = case.generator.embedding_tables(case.spec) or []
        phase, _, tensor = case.first_divergence.partition("/")
        if not case.failure and (phase not in ("eval_before", f"eval_after_step{case.steps}")
                                 or not tensor.startswith("pooled.")):
            raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a pooled embedding "
                              "of an evaluation, which is what the script compares")
        if not tables:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        data, listed = embedding_script_data(case, tables, parts=("train", "eval"))
        phase = phase or f"eval_after_step{case.steps}"  # a failure's script runs every phase until it fails
        names = [f"{phase}/pooled.{f}" for t in tables for f in t.features]
        return Script(
            summary=f"The model's TorchRec tables behind managed-collision modules ({self.capacity} slots, "
                    f"{EVICTION[self.capacity].removesuffix('_EvictionPolicy')} eviction), sharded row-wise by "
                    f"DistributedModelParallel over {self.world_size} CPU ranks (gloo), {OPTIMIZERS[self.optimizer][1]} "
                    f"{KERNELS[self.kernel]}"
                    + case.against(f"the same modules in one process trained by {OPTIMIZERS[self.optimizer][1]}: "
                                   f"every sample's pooled embeddings at {phase}") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import dataclasses", "import types", "", f"RAW_ID_BASE = {RAW_ID_BASE!r}",
                      f"SCARCE_SLOTS = {SCARCE_SLOTS!r}", f"BUCKETS = {BUCKETS!r}", f"EVICTION = {EVICTION!r}",
                      f"OPTIMIZERS = {OPTIMIZERS!r}"),
            case={"capacity": self.capacity, "kernel": self.kernel, "optimizer": self.optimizer,
                  "local_world_size": case.local_world_size,
                  "device": "cpu", "batch": case.inputs["eval"].size, "steps": case.steps, "lr": case.lr,
                  "tables": listed},
            functions=(managed_slots, _constant_rows, embedding_collections, table_configs, managed_holder,
                       standalone_tables, standalone_features, bag_runs_kjt, pooled_loss, mc.managed_tables,
                       mc.table_optimizer, mc.pooled_phases, managed_plan, table_rows, _local_pieces,
                       _load_full_state, mc.single_process, mc.on_rank),
            tensors={name: name for name in names}, data=data, world_size=self.world_size)


@dataclass(frozen=True)
class ManagedCollisionReference(Setting):
    """The family's root: the model's tables behind the same managed-collision modules, unsharded, trained by the
    optimizer's PyTorch class."""

    world_size: int = 1
    capacity: str = "ample"
    optimizer: str = "sgd"
    family: ClassVar[str] = "torchrec-mc"
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        label = "-".join(["single"] + [v for v in (self.capacity, self.optimizer) if v not in ("ample", "sgd")])
        return f"torchrec-mc/{label}/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        return (f"one process, the model's tables behind managed-collision modules ({self.capacity} slots), trained by "
                f"{OPTIMIZERS[self.optimizer][1]}")

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        holder = managed_holder(build_for_training(model, ctx.device), self.capacity)
        return train_alone(ctx, inputs, holder, dict, mc.table_optimizer({"optimizer": self.optimizer, "lr": ctx.lr}))


register_settings(
    [ManagedCollisionReference(capacity=c, optimizer=o) for c in EVICTION for o in OPTIMIZERS]
    + [ManagedCollisionSharding(world_size=ws, kernel=k) for ws in (1, 2, 4) for k in KERNELS]
    + [ManagedCollisionSharding(world_size=1, capacity="scarce")]
    + [ManagedCollisionSharding(world_size=ws, optimizer="adagrad") for ws in (1, 2)]
    + [ManagedCollisionSharding(world_size=1, capacity="scarce", optimizer="adagrad")]
)
