"""TorchRec's fused embedding optimizers: the tables trained inside fbgemm's lookup kernel by Adagrad, row-wise Adagrad
or Adam (`apply_optimizer_in_backward`, as production TorchRec trains them), sharded under every sharding type.

The family's root trains the unsharded model in one process with the optimizer's own PyTorch implementation, the
documented update rule (`torch.optim.Adagrad`, `torch.optim.Adam`, TorchRec's `RowWiseAdagrad`), the dense part with
plain SGD in both. Besides the weights, each step records the optimizer's state (`state_after_step<i>/<table>.sum`:
Adagrad's accumulator; Adam's `exp_avg`, `exp_avg_sq`), read from TorchRec's fused optimizer and from the root's
`optimizer.state`: a kernel that updates the state wrongly, or a sharding that splits it wrongly, shows before the
weights it moves. fbgemm's CPU build runs exact SGD, Adagrad and row-wise Adagrad; every other `EmbOptimType` is
refused by TorchRec ("Optimizer adam is not supported in CPU mode") and recorded unsupported with those words.

Every step trains on the same batch, so dense and sparse (lazy) Adam move the same rows: a row no step touches keeps
zero moments in both.

The full tier adds what a torch.optim user sets beside the learning rate (`WITH_OPTIONS`): SGD's momentum and weight
decay, Adagrad's and row-wise Adagrad's weight decay, and row-wise Adagrad's weight decay with fbgemm's
`weight_decay_mode` named (TorchRec hands every option to fbgemm as it is). fbgemm's update is sparse: its weight decay
touches only the rows a batch looks up ("local" weight decay, FBGEMM#2516), so with weight decay the root steps its
PyTorch optimizer on those rows only (`step_touched_rows`), the documented rule of the kernel it is judged against.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import Outputs, RunContext, Setting, record_training, register_settings, to_numpy, traits_of
from settings._torchrec_optim_script import (
    fbgemm_options,
    fuse_table_optimizers,
    step_touched_rows,
    table_name,
    unfused_table_optimizers,
)
from settings._torchrec_plan import SHARDING_TYPES, embedding_collections, gather_whole, plan_functions, table_configs
from settings._training import build_for_training, canonical_parameters, sgd_step
from settings.torchrec_sharding import TorchRecSharding

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase


@dataclass(frozen=True)
class TableOptimizer:
    """One fused optimizer: the PyTorch class TorchRec maps to its fbgemm kernel (and the root trains with), options
    beside the learning rate, and the root's state keys in fbgemm's order (`_state_name`)."""

    module: str
    cls: str
    options: tuple[tuple[str, float], ...]
    states: tuple[str, ...]
    rowwise: bool = False  # one accumulator per row: fbgemm keeps it as a vector, TorchRec's reference as a column
    touched_rows_only: bool = False  # the PyTorch optimizer steps only the rows a batch looks up, as fbgemm's does
    min_steps: int = 1  # momentum acts from the second step on
    second: str = ""  # a key of OPTIMIZERS: every other table (by name) is trained by it, given the same options dict

    def load(self) -> type:
        import importlib

        return getattr(importlib.import_module(self.module), self.cls)  # type: ignore[no-any-return]


EPS = 1e-8  # fbgemm's and the reference's alike (their defaults differ: torch's Adagrad 1e-10)
OPTIMIZERS = {
    "adagrad": TableOptimizer("torch.optim", "Adagrad", (("eps", EPS),), ("sum",)),
    "rowwise-adagrad": TableOptimizer("torchrec.optim", "RowWiseAdagrad", (("eps", EPS),), ("sum",), rowwise=True),
    "adam": TableOptimizer("torch.optim", "Adam", (("eps", EPS),), ("exp_avg", "exp_avg_sq")),
}
WEIGHT_DECAY = 0.1
WITH_OPTIONS = {
    "sgd-momentum": TableOptimizer("torch.optim", "SGD", (("momentum", 0.9),), (), min_steps=2),
    "sgd-weight-decay": TableOptimizer("torch.optim", "SGD", (("weight_decay", WEIGHT_DECAY),), (),
                                       touched_rows_only=True),
    "adagrad-weight-decay": TableOptimizer("torch.optim", "Adagrad", (("eps", EPS), ("weight_decay", WEIGHT_DECAY)),
                                           ("sum",), touched_rows_only=True),
    "rowwise-adagrad-weight-decay": TableOptimizer("torchrec.optim", "RowWiseAdagrad",
                                                   (("eps", EPS), ("weight_decay", WEIGHT_DECAY)), ("sum",),
                                                   rowwise=True, touched_rows_only=True),
    # fbgemm's L2 mode is the update RowWiseAdagrad documents (its weight decay an L2 penalty); RowWiseAdagrad takes
    # the extra option and ignores it, as TorchRec's fbgemm-only options are meant to pass
    "rowwise-adagrad-l2": TableOptimizer("torchrec.optim", "RowWiseAdagrad",
                                         (("eps", EPS), ("weight_decay", WEIGHT_DECAY), ("weight_decay_mode", "L2")),
                                         ("sum",), rowwise=True, touched_rows_only=True),
    # per-table optimizers sharing one hyperparameter dict, as a user writes them: row-wise Adagrad for some tables,
    # Adagrad for the others
    "rowwise-adagrad-and-adagrad": TableOptimizer("torchrec.optim", "RowWiseAdagrad", (("eps", EPS),), ("sum",),
                                                  rowwise=True, second="adagrad"),
}
TABLE_OPTIMIZERS = {**OPTIMIZERS, **WITH_OPTIONS}
WORLD_SIZES = (2, 4)


class Optimizers:
    """Several optimizers stepped as one (the tables' and the dense part's); those in `touched_rows_only` step only
    the rows their batch looked up (`step_touched_rows`)."""

    def __init__(self, *optimizers: Any, touched_rows_only: tuple[Any, ...] = ()) -> None:
        self.optimizers = [o for o in optimizers if o is not None]
        self.touched_rows_only = [o for o in touched_rows_only if o is not None]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            step_touched_rows(optimizer) if optimizer in self.touched_rows_only else optimizer.step()


@dataclass(frozen=True)
class FusedOptimizerSharding(TorchRecSharding):
    """TorchRec DMP with an explicit sharding plan, the tables trained by a fused optimizer other than SGD."""

    family: ClassVar[str] = "torchrec-optim"
    tier_axes: ClassVar[tuple[str, ...]] = ("optimizer",)
    optimizer: str = "adagrad"

    @property
    def name(self) -> str:
        return f"torchrec-optim/{self.optimizer}/{self.sharding}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return FusedOptimizerReference(optimizer=self.optimizer).name

    def describe(self) -> str:
        spec = TABLE_OPTIMIZERS[self.optimizer]
        return (f"TorchRec DMP, every table {self.sharding} and trained by fused {spec.cls}{_options_said(spec)}, "
                f"{self.world_size} ranks")

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return super().run(_enough_steps(ctx, self.optimizer), model, inputs)

    def table_optimizer(self, ctx: RunContext) -> tuple[type, dict[str, Any]]:
        spec = TABLE_OPTIMIZERS[self.optimizer]
        return spec.load(), fbgemm_options({"lr": ctx.lr, **dict(spec.options)})

    def fuse_table_optimizer(self, ctx: RunContext, module: Any, optimizer: type, options: dict[str, Any]) -> None:
        tables = {table_name(n): p for collection in embedding_collections(module).values()
                  for n, p in collection.named_parameters() if p.requires_grad}
        fuse_table_optimizers(tables, optimizer_case(self.optimizer, ctx.lr, module))

    def dense_optimizer(self, ctx: RunContext, named: list[tuple[str, Any]]) -> Any:
        """Data-parallel tables come back from DMP as plain parameters with no fused optimizer: their users train them
        with the same optimizers, unfused; the dense layers with SGD, as the root does."""
        import torch

        tables = {table_name(n): p for n, p in named if _is_table(n)}
        dense = [p for n, p in named if not _is_table(n)]
        unfused = unfused_table_optimizers(tables, optimizer_case(self.optimizer, ctx.lr, None, list(tables))) \
            if tables else []
        return Optimizers(*unfused, torch.optim.SGD(dense, lr=ctx.lr) if dense else None,
                          touched_rows_only=tuple(unfused) if TABLE_OPTIMIZERS[self.optimizer].touched_rows_only else ())

    def optimizer_state(self, ctx: RunContext, dmp: Any, dense: Any) -> Callable[[], dict | None] | None:
        specs = _specs(self.optimizer)

        def read() -> dict | None:
            values: dict[str, Any] = {}
            for parameter, states in dmp.fused_optimizer.state_dict()["state"].items():
                for key, value in states.items():
                    named = (_state_name(key.rpartition(".")[2], spec) for spec in specs)
                    if (state := next((n for n in named if n is not None), None)) is not None:
                        values[f"{_canonical(parameter)}.{state}"] = value
            values |= unfused_state(dense, dict(dmp.named_parameters()), specs)
            return gather_whole(ctx, values)

        return read

    def standalone(self, case: StandaloneCase) -> Script:
        """The tables alone, one fused step under the case's plan against the optimizer's PyTorch class in one
        process (settings/_torchrec_optim_script.py): the tables' weights after it, judged by allclose (the script's
        loss is the tables' own, not the model's the envelope was measured on)."""
        from difftest import Script, Unsupported, refuse_changed_hooks
        from settings import _torchrec_optim_script as script
        from settings._torchrec_script import (
            bag_runs_kjt,
            embedding_script_data,
            sharded_tables,
            standalone_features,
            standalone_tables,
        )
        from settings.torchrec_vbe import pooled_loss

        refuse_changed_hooks(self, FusedOptimizerSharding, "table_optimizer", "fuse_table_optimizer",
                             "dense_optimizer", "optimizer_state",
                             "load_initial_state", "sharded_module", "trainer", "full_state")
        if case.failure:
            raise Unsupported("the fused-optimizer script shows a disagreement; a failure reproduces through repro.py")
        if self.sharding == "data_parallel":
            raise Unsupported("a data-parallel table is trained unfused, by DDP and the optimizer's PyTorch class, "
                              "not by the fused kernel the script shows")
        if not case.first_divergence.startswith(("param_after_step", "state_after_step")):
            # a lookup that pools wrongly before any step (grid_shard's MEAN) is the sharding family's script's
            raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a table or its "
                              "optimizer state after the fused step, which is what the script compares")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        data, table_list = embedding_script_data(case, tables)
        spec = TABLE_OPTIMIZERS[self.optimizer]
        return Script(
            summary=f"TorchRec EmbeddingBagCollections sharded by DistributedModelParallel over {self.world_size} CPU "
                    f"ranks (gloo), every table {self.sharding}, trained {max(case.steps, spec.min_steps)} step(s) by fused {spec.cls}"
                    f"{_options_said(spec)} inside the lookup (apply_optimizer_in_backward), each rank on its share "
                    "of one batch"
                    + case.against(f"{spec.module}.{spec.cls} on the same collections in one process"
                                   + (" stepping the rows the batch looks up" if spec.touched_rows_only else "")
                                   + ": every table after the steps") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}"),
            case={"sharding": self.sharding, "local_world_size": case.local_world_size, "device": "cpu",
                  "batch": case.inputs["eval"].size, "lr": case.lr, "steps": max(case.steps, spec.min_steps),
                  **optimizer_case(self.optimizer, case.lr, None, [t.name for t in tables]),
                  "touched_rows_only": spec.touched_rows_only, "tables": table_list,
                  "frozen": frozen_tables(tables, case)},
            functions=(*plan_functions(self.sharding, tables, 0, self.world_size), sharded_tables, standalone_tables,
                       standalone_features, bag_runs_kjt, pooled_loss, script.table_optimizer, fbgemm_options,
                       script.second_tables, fuse_table_optimizers, script.fuse_as_trained, unfused_table_optimizers,
                       script.trained_tables, table_name,
                       step_touched_rows, script.whole_tables, script.single_process, script.on_rank),
            # named apart from the run's tensors: the envelope measured the model's loss, not the script's
            tensors={f"{t.state_key}": f"script/{t.state_key}" for t in tables}, data=data,
            world_size=self.world_size)


@dataclass(frozen=True)
class FusedOptimizerReference(Setting):
    """The family's root: the unsharded model in one process, its tables trained by the optimizer's PyTorch class."""

    optimizer: str
    world_size: int = 1
    family: ClassVar[str] = "torchrec-optim"
    deterministic: ClassVar[bool] = True
    sample_order_free: ClassVar[bool] = True  # one full-batch step: any sample order is as good

    @property
    def name(self) -> str:
        return f"torchrec-optim/{self.optimizer}/single/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        spec = TABLE_OPTIMIZERS[self.optimizer]
        rows = ", on the rows each batch looks up" if spec.touched_rows_only else ""
        return f"one process, the tables trained by {spec.cls}{_options_said(spec)} (PyTorch){rows}, the rest by SGD"

    def supports(self, spec: Any) -> str | None:
        if "torchrec" not in traits_of(spec.kind):
            return f"TorchRec's fused optimizers train EmbeddingBagCollections; model kind {spec.kind!r} has none"
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        spec = TABLE_OPTIMIZERS[self.optimizer]
        ctx = _enough_steps(ctx, self.optimizer)
        module = build_for_training(model, ctx.device)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        tables = {f"{path}.{n}" for path, c in embedding_collections(module).items() for n, _ in c.named_parameters()}
        table_params = {table_name(n): p for n, p in named if n in tables}
        dense = [p for n, p in named if n not in tables]
        unfused = unfused_table_optimizers(table_params, optimizer_case(self.optimizer, ctx.lr, module)) \
            if table_params else []
        optimizer = Optimizers(*unfused, torch.optim.SGD(dense, lr=ctx.lr) if dense else None,
                               touched_rows_only=tuple(unfused) if spec.touched_rows_only else ())
        specs = _specs(self.optimizer)
        return record_training(
            ctx, inputs, lambda b: model.evaluate(module, b, ctx.device),
            lambda b: sgd_step(model, module, optimizer, b, ctx.device),
            lambda: canonical_parameters(model, module),
            optimizer_state=lambda: {n: to_numpy(v) for n, v in unfused_state(optimizer, dict(named), specs).items()})


def unfused_state(optimizers: Any, parameters: dict[str, Any], specs: list[TableOptimizer]) -> dict[str, Any]:
    """`<table>.<state>` → the state a PyTorch optimizer (of `optimizers`, each of a class in `specs`) keeps for each
    table among `parameters`, shaped as fbgemm keeps it (a row-wise accumulator as a vector)."""
    found: dict[str, Any] = {}
    for optimizer in getattr(optimizers, "optimizers", [optimizers] if optimizers is not None else []):
        spec = next((s for s in specs if type(optimizer).__name__ == s.cls), None)
        if spec is None:  # the dense part's SGD
            continue
        for name, parameter in parameters.items():
            if _is_table(name) and parameter in optimizer.state:
                for key in spec.states:
                    value = optimizer.state[parameter][key]
                    found[f"{_canonical(name)}.{key}"] = value.reshape(-1) if spec.rowwise else value
    return found


def _state_name(fused: str, spec: TableOptimizer) -> str | None:
    """The reference's name of a fused state: TorchRec calls the first `momentum1` (and a second, where it renames
    it, `momentum2`); the rest keep fbgemm's names, which are torch's (Adam's `exp_avg_sq`)."""
    renamed = {f"momentum{i}": state for i, state in enumerate(spec.states, 1)}
    return renamed.get(fused, fused if fused in spec.states else None)


@dataclass(frozen=True)
class OptionedOptimizerSharding(FusedOptimizerSharding):
    """A fused optimizer with options beside the learning rate (`WITH_OPTIONS`): the full tier."""

    in_default_tier: ClassVar[bool] = False

    @property
    def reference(self) -> str:  # type: ignore[override]
        return OptionedOptimizerReference(optimizer=self.optimizer).name


@dataclass(frozen=True)
class OptionedOptimizerReference(FusedOptimizerReference):
    """The root of a fused optimizer with options: the full tier."""

    in_default_tier: ClassVar[bool] = False


def frozen_tables(tables: list[Any], case: StandaloneCase) -> list[str]:
    """The names of the model's embedding tables (`Generator.embedding_tables`) that the case's model freezes."""
    return sorted(t.name for t in tables if t.state_key in case.spec.frozen)


def optimizer_case(optimizer: str, lr: float, module: Any, names: list[str] | None = None) -> dict[str, Any]:
    """The optimizers as the script's functions take them (`fuse_table_optimizers`, `unfused_table_optimizers`): the
    second optimizer's tables every other one, by name, of `module`'s tables (or of `names`)."""
    spec = TABLE_OPTIMIZERS[optimizer]
    if names is None:
        names = [c.name for collection in embedding_collections(module).values() for c in table_configs(collection)]
    second = OPTIMIZERS[spec.second] if spec.second else None
    return {"optimizer": (spec.module, spec.cls), "options": dict(spec.options), "lr": lr,
            "second": (second.module, second.cls) if second else None,
            "second_tables": sorted(names)[1::2] if second else []}


def _specs(optimizer: str) -> list[TableOptimizer]:
    spec = TABLE_OPTIMIZERS[optimizer]
    return [spec, OPTIMIZERS[spec.second]] if spec.second else [spec]


def _enough_steps(ctx: RunContext, optimizer: str) -> RunContext:
    """`ctx` with at least the steps the optimizer needs to show what its options do."""
    import dataclasses

    return dataclasses.replace(ctx, steps=max(ctx.steps, TABLE_OPTIMIZERS[optimizer].min_steps))


def _options_said(spec: TableOptimizer) -> str:
    said = [f"{k}={v}" for k, v in spec.options if k != "eps"]
    if spec.second:
        said.append(f"every other table {OPTIMIZERS[spec.second].cls}, both given one options dict")
    return f" ({', '.join(said)})" if said else ""


def _is_table(name: str) -> bool:
    return ".embedding_bags." in f".{name}"


def _canonical(name: str) -> str:
    """A parameter's name in the unsharded model (DMP's wrapper and DDP's add their own prefixes)."""
    for prefix in ("_dmp_wrapped_module.", "module."):
        name = name.replace(prefix, "")
    return name


register_settings(
    [FusedOptimizerReference(optimizer=o) for o in OPTIMIZERS]
    + [FusedOptimizerSharding(sharding=s, world_size=ws, optimizer=o)
       for o, s, ws in itertools.product(OPTIMIZERS, SHARDING_TYPES, WORLD_SIZES)]
    + [OptionedOptimizerReference(optimizer=o) for o in WITH_OPTIONS]
    + [OptionedOptimizerSharding(sharding=s, world_size=ws, optimizer=o)
       for o, s, ws in itertools.product(WITH_OPTIONS, SHARDING_TYPES, WORLD_SIZES)]
)
