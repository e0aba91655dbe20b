"""TorchRec DistributedModelParallel: every sharding type × world size, the planner's plan, seeded mixed plans.

Plans are built explicitly with `construct_module_sharding_plan` and the per-type generators, because the
CPU planner refuses the row-wise family. The dense part runs under DMP's own DDP wrapper; embedding tables
use TorchRec's fused in-backward SGD; both follow the global-mean loss like the reference.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

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
    record_training,
    refuse_changed_hooks,
    register_settings,
    register_world_reset,
    to_numpy,
    traits_of,
)
from settings._torchrec_plan import (
    SHARDING_TYPES,
    _full_state,
    _load_full_state,
    _plan_summary,
    embedding_collections,
    gather_whole,
    plan_functions,
    plan_tables,
    sharding_plan,
    table_configs,
)
from settings._torchrec_script import (
    _pooled,
    bag_runs_kjt,
    embedding_script_data,
    on_rank,
    script_sharder,
    sharded_tables,
    single_process,
    standalone_features,
    standalone_tables,
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
        if (fused := self.table_optimizer(ctx)) is not None:
            self.fuse_table_optimizer(ctx, module, *fused)
            # a fused table is trained whatever its requires_grad says: without an optimizer of its own it gets the
            # sharder's default fused SGD (fbgemm's lr 0.01). TorchRec's way to freeze one is an optimizer that does
            # not move it (torchrec#1990): a frozen table takes gradients (the hook needs them) into SGD with lr 0,
            # and w - 0·g is w, bit for bit
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
        outputs = record_training(ctx, inputs, evaluate, train_step, lambda: self.full_state(ctx, dmp),
                                  optimizer_state=state)
        self.after_training(ctx, dmp, optimizer)
        return outputs

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

    def table_optimizer(self, ctx: RunContext) -> tuple[type, dict[str, Any]] | None:
        """The optimizer TorchRec fuses into the tables' backward, by its class (TorchRec maps it to fbgemm's kernel),
        with its options: plain SGD here, the reference's. None: no optimizer is fused, so the plan gives the tables
        TorchRec's DENSE kernel and the dense optimizer trains them."""
        import torch

        return torch.optim.SGD, {"lr": ctx.lr}

    def fuse_table_optimizer(self, ctx: RunContext, module: Any, optimizer: type, options: dict[str, Any]) -> None:
        """Fuses `table_optimizer`'s optimizer into the trainable tables of `module`, in one call."""
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        tables = [p for collection in embedding_collections(module).values() for p in collection.parameters()]
        apply_optimizer_in_backward(optimizer, [p for p in tables if p.requires_grad], options)

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

    def after_training(self, ctx: RunContext, dmp: Any, optimizer: Any) -> None:
        """What a family does with the trained model after the steps were recorded (collective): nothing here; a
        checkpoint's first phase saves it."""

    def _plan(self, ctx: RunContext, module: Any, sharder: Any) -> Any:
        try:
            return sharding_plan(module, sharder, self.sharding, self.plan_seed, ctx.world_size,
                                 ctx.local_world_size, ctx.device, ctx.group)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            if self.sharding == "planner":
                raise
            raise Unsupported(f"TorchRec cannot build this plan: {type(exc).__name__}: {exc}") from exc

    def attribute(self, first_divergence: str, notes: Mapping[str, str]) -> str | None:
        """A mixed plan's case is the case of the sharding type of the table its first divergence lies in: a pooled
        embedding names its feature (`pooled.tf0`), a table's weight names its table (`…embedding_bags.t0.weight`)."""
        if self.sharding != "mixed" or not first_divergence:
            return None
        parts = set(re.split(r"[./]", first_divergence.partition("/")[2]))
        for table, (sharding, features) in plan_tables(notes.get("plan", "")).items():
            if sharding in SHARDING_TYPES and (table in parts or parts & set(features)):
                return TorchRecSharding(sharding=sharding, world_size=self.world_size).name
        return None

    # --- a standalone script (difftest.scripts.emit) ------------------------------------------------
    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, TorchRecSharding, "load_initial_state", "sharded_module", "trainer", "full_state")
        return self.sharding_script(case)

    def sharding_script(self, case: StandaloneCase, variable_batch: bool = False) -> Script:
        """The collections alone, sharded under the case's plan, their pooled embeddings of the evaluation batch
        against one process's; `variable_batch`: each rank sends each feature's runs of equal bags once (VBE), and
        the run recorded the pooled embeddings by feature (`pooled.<feature>`)."""
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        pooled = {f"{EVAL_BEFORE}/{f'pooled.{feature}' if variable_batch else name}": name
                  for t in tables for feature, name in zip(t.features, t.outputs, strict=True)}
        # by the tensor's kind (`pooled`): the example's first-diverging feature may not be in the minimal model
        phase, _, tensor = case.first_divergence.partition("/")
        kinds = {case.generator.tensor_class(name) for name in pooled.values()}
        if phase != EVAL_BEFORE or case.generator.tensor_class(tensor) not in kinds:
            raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a pooled embedding "
                              "of the first evaluation, which is what the script compares")
        batch = case.inputs["eval"]
        data, table_list = embedding_script_data(case, tables)
        plan = {"planner": "the plan TorchRec's EmbeddingShardingPlanner chooses",
                "mixed": f"a seeded random sharding type per table (seed {self.plan_seed})"}.get(
                    self.sharding, f"every table {self.sharding}")
        comms = self.script_comms()
        return Script(
            summary=f"TorchRec EmbeddingBagCollections sharded by DistributedModelParallel over {self.world_size} "
                    f"CPU ranks (gloo), {plan}"
                    + (f", pooled embeddings sent in {comms[0].lower()} by fbgemm's codecs (QCommsConfig)" if comms
                       else "")
                    + (", each rank sending each feature's runs of equal bags once (variable batch per feature: "
                       "stride_per_key_per_rank, inverse_indices)" if variable_batch else "")
                    + case.against("the same collections in one process: the pooled embeddings of one batch, before "
                                   "any training") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}"),
            case={"sharding": self.sharding, "plan_seed": self.plan_seed, "local_world_size": case.local_world_size,
                  "device": "cpu", "batch": batch.size, "tables": table_list, "lr": case.lr,
                  "frozen": sorted(t.state_key for t in tables if t.state_key in case.spec.frozen),
                  **({"qcomms": comms} if comms else {}), **({"variable_batch": True} if variable_batch else {})},
            functions=(*plan_functions(self.sharding, tables, self.plan_seed, self.world_size), sharded_tables, standalone_tables, standalone_features, bag_runs_kjt, _pooled,
                       single_process, script_sharder, on_rank),
            tensors={name: recorded for recorded, name in pooled.items()},
            data=data, world_size=self.world_size)


    def script_comms(self) -> tuple[str, str] | None:
        """The precisions (forward, backward) of the pooled embeddings' collectives the script asks fbgemm's codecs
        for (`script_sharder`); None: sent as they are."""
        return None


@dataclass(frozen=True)
class HeldTablesSharding(TorchRecSharding):
    """A family that shards a module of its own holding the model's tables (its `sharded_module`): the initial state
    is that module's, and the full state after a step every one of its tables whole."""

    def initial_state(self, model: Any, module: Any) -> dict[str, Any]:
        return {name: to_numpy(value) for name, value in module.state_dict().items()}

    def full_state(self, ctx: RunContext, dmp: Any) -> dict | None:
        return gather_whole(ctx, {name.replace("_dmp_wrapped_module.", "").replace("module.", ""): value
                                  for name, value in dmp.state_dict().items()})


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
