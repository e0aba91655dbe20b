"""TorchRec EmbeddingCollections (sequence embeddings: one vector per id, no pooling) sharded by DistributedModelParallel.

The model's own tables, held as EmbeddingCollections instead of bags (one collection per bag collection and embedding
dim: an EmbeddingCollection takes tables of one dim), with the model's initial weights; its batches' ids (weights of
weighted features ignored: a sequence embedding has no pooling to weigh). Each table sharded table-, row-, column-wise
or data-parallel, with and without TorchRec's index dedup (`EmbeddingCollectionSharder(use_index_dedup=…)`), the
tables trained by fused SGD in backward. The family's root runs the same collections unsharded in one process. Recorded
per feature: the embedding of every id of the batch in order (`eval_before/seq.<feature>`), then the loss (the mean over
samples of their embeddings' dot products with a fixed vector) and every table after each step. The root's result
depends on the order of each bag's ids, so its calibration does not reorder samples or ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    EVAL_BEFORE,
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Unsupported,
    record_training,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    traits_of,
)
from settings._torchrec_plan import (
    SHARDING_TYPES,
    plan_functions,
)
from settings._torchrec_script import sharded_tables
from settings._torchrec_sequence_script import (
    _sequences,
    on_rank,
    single_process,
    standalone_sequence_features,
    standalone_sequence_tables,
)
from settings._training import build_for_training
from settings.torchrec_sharding import HeldTablesSharding

SHARDINGS = ("table_wise", "row_wise", "column_wise", "data_parallel")
DEDUP = {"all-ids": False, "dedup": True}  # (names sort so that the default tier takes every id)
WORLD_SIZES = (2, 4)


def _wider_than_fp32(collection: Any) -> bool:
    """An unsharded collection whose tables are float64 (a calibration's centre)."""
    import torch

    return any(p.dtype == torch.float64 for p in collection.parameters()) and hasattr(collection, "embeddings")


def _lookup_in_own_dtype(collection: Any, kjt: Any) -> dict[str, Any]:
    """`EmbeddingCollection.forward` without its cast of every lookup to float32 (a float64 centre would become an
    fp32 one), through the collection's public API: each feature's ids looked up in its table."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    by_feature = kjt.to_dict()
    return {feature: JaggedTensor(values=collection.embeddings[config.name](by_feature[feature].values()),
                                  lengths=by_feature[feature].lengths())
            for config in collection.embedding_configs() for feature in config.feature_names}


def sequence_tables(model: Any, module: Any) -> Any:
    """The model's tables as EmbeddingCollections under `<bag collection>_d<dim>` (dots as `_`), weights, dtype and
    requires_grad copied from `module` (the model built: a calibration's float64 weights stay float64); its
    `features` attribute: collection → its features, in order."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    tables = model.generator.embedding_tables(model.spec)
    if not tables:
        raise Unsupported(f"model kind {model.spec.kind!r} declares no embedding tables")
    class Tables(torch.nn.Module):
        """The collections by name; forward takes the batch's ids per collection and returns each feature's
        JaggedTensor of embeddings."""

        def forward(self, features: dict[str, Any]) -> dict[str, Any]:
            found = {}
            for name, kjt in features.items():
                collection = self.get_submodule(name)
                embedded = _lookup_in_own_dtype(collection, kjt) if _wider_than_fp32(collection) else collection(kjt)
                for feature in kjt.keys():
                    found[feature] = embedded[feature]  # indexing waits for a sharded collection's output
            return found

    holder = Tables()
    holder.features = {}
    groups = itertools.groupby(sorted(tables, key=lambda t: (t.collection, t.embedding_dim)),
                               key=lambda t: (t.collection, t.embedding_dim))
    for (collection, dim), members in groups:
        members = list(members)
        bags = module.get_submodule(collection)
        sequence = EmbeddingCollection(tables=[
            EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=dim, feature_names=list(t.features))
            for t in members], device=torch.device("cpu"))
        sequence = sequence.to(bags.embedding_bags[members[0].name].weight.dtype)
        with torch.no_grad():
            for t in members:
                bag = bags.embedding_bags[t.name].weight
                sequence.embeddings[t.name].weight.copy_(bag)
                sequence.embeddings[t.name].weight.requires_grad_(bag.requires_grad)
        name = f"{collection.replace('.', '_')}_d{dim}"
        holder.add_module(name, sequence)
        holder.features[name] = [f for t in members for f in t.features]
    return holder


def sequence_outputs(holder: Any, features: dict[str, list[str]], batch: Any, device: str) -> dict[str, Any]:
    """`seq.<feature>` → [ids, dim]: the embedding of every id of the batch, in the batch's order (samples, then each
    bag's ids), so shares of a batch concatenate to the whole batch's. `holder` is `sequence_tables`'s, sharded or
    not; `features` its `features`."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjts = {name: KeyedJaggedTensor.from_lengths_sync(
        keys=names, values=torch.from_numpy(np.concatenate([batch.sparse[f].values for f in names])).to(device),
        lengths=torch.from_numpy(np.concatenate([batch.sparse[f].lengths for f in names])).to(device))
        for name, names in features.items()}
    return {f"seq.{f}": jagged.values() for f, jagged in holder(kjts).items()}


def sequence_loss(outputs: dict[str, Any], samples: int) -> Any:
    """Per sample, the sum of its embeddings' dot products with a fixed vector (1, -1/2, 1/3, …); the mean over the
    `samples` of the batch."""
    import torch

    total = None
    for value in outputs.values():
        dim = value.shape[-1]
        direction = torch.tensor([(-1) ** i / (i + 1) for i in range(dim)], dtype=value.dtype, device=value.device)
        term = (value * direction).sum() / samples
        total = term if total is None else total + term
    return total


def _missing_kernel(operator: str, device: str) -> str | None:
    """Why `operator` cannot run on `device` in the installed build (probed in PyTorch's dispatcher), or None."""
    import fbgemm_gpu  # noqa: F401  (registers fbgemm's operators)
    import torch

    key = device.split(":")[0].upper()
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(operator, k)  # its own kernel, or one made of other ops
           for k in (key, "CompositeImplicitAutograd", "CompositeExplicitAutograd")):
        return None
    return f"{operator}, which the installed fbgemm build has no {key} kernel for"


def _supports(spec: Any) -> str | None:
    if "torchrec" not in traits_of(spec.kind):
        return f"TorchRec sequence embeddings are made of a model's tables; model kind {spec.kind!r} has none"
    return None


@dataclass(frozen=True)
class SequenceSharding(HeldTablesSharding):
    """TorchRec DMP over the model's tables as EmbeddingCollections, every table one sharding type."""

    family: ClassVar[str] = "torchrec-seq"
    tier_axes: ClassVar[tuple[str, ...]] = ("sharding",)
    dedup: str = "all-ids"

    @property
    def name(self) -> str:
        return f"torchrec-seq/{self.sharding}/{self.dedup}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return SequenceReference().name

    def describe(self) -> str:
        return (f"TorchRec DMP over EmbeddingCollections (sequence embeddings), every table {self.sharding}"
                f"{', index dedup' if DEDUP[self.dedup] else ''}, {self.world_size} ranks")

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if DEDUP[self.dedup] and (missing := _missing_kernel("fbgemm::jagged_unique_indices", ctx.device)):
            raise Unsupported(f"index dedup needs {missing}")
        return super().run(ctx, model, inputs)

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        return sequence_tables(model, module)

    def sharder(self) -> Any:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        return EmbeddingCollectionSharder(use_index_dedup=DEDUP[self.dedup])

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        features = dmp.module.features

        def train_step(batch: Any) -> float:
            if optimizer is not None:
                optimizer.zero_grad()
            loss = sequence_loss(sequence_outputs(dmp, features, batch, ctx.device), batch.size)
            loss.backward()  # the tables are updated inside backward (fused SGD)
            if optimizer is not None:
                self.dense_step(ctx, optimizer)
            return float(loss.item())

        return train_step, lambda batch: sequence_outputs(dmp, features, batch, ctx.device)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, SequenceSharding, "load_initial_state", "sharded_module", "trainer", "full_state",
                             "sharder", "initial_state")
        phase, _, tensor = case.first_divergence.partition("/")
        if case.first_divergence and (phase != EVAL_BEFORE or not tensor.startswith("seq.")):
            raise Unsupported(f"it first diverges at {case.first_divergence}, not at a sequence embedding of the first "
                              "evaluation, which is what the script compares")
        tables = case.generator.embedding_tables(case.spec) or []
        groups: dict[tuple[str, int], list[Any]] = {}
        for t in tables:
            groups.setdefault((t.collection, t.embedding_dim), []).append(t)
        listed, data = [], {}
        for (collection, dim), members in sorted(groups.items()):  # as `sequence_tables` holds them
            name = f"{collection.replace('.', '_')}_d{dim}"
            listed.append({"name": name, "dim": dim, "tables": [
                {"name": t.name, "num_embeddings": t.num_embeddings, "features": list(t.features)} for t in members]})
            data |= {f"state.{name}.embeddings.{t.name}.weight": case.init_state[t.state_key] for t in members}
        batch = case.inputs["eval"]
        features = [f for g in listed for t in g["tables"] for f in t["features"]]
        data |= {f"eval.{f}.{part}": getattr(batch.sparse[f], part) for f in features for part in ("lengths", "values")}
        return Script(
            summary=f"The model's TorchRec tables as EmbeddingCollections (sequence embeddings), sharded by "
                    f"DistributedModelParallel over {self.world_size} CPU ranks (gloo), every table {self.sharding}"
                    f"{' with index dedup' if DEDUP[self.dedup] else ''}"
                    + case.against("the same collections in one process: every id's embedding of one batch, before "
                                   "any training") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}"),
            case={"sharding": self.sharding, "dedup": DEDUP[self.dedup], "local_world_size": case.local_world_size,
                  "device": "cpu", "batch": batch.size, "lr": case.lr, "groups": listed},
            functions=(*plan_functions(self.sharding, tables, 0, self.world_size), sharded_tables, standalone_sequence_tables, standalone_sequence_features, _sequences, single_process, on_rank),
            tensors={f"seq.{f}": f"{EVAL_BEFORE}/seq.{f}" for f in features}, data=data, world_size=self.world_size)


@dataclass(frozen=True)
class SequenceReference(Setting):
    """The family's root: the model's tables as EmbeddingCollections, unsharded, in one process, trained by SGD."""

    world_size: int = 1
    family: ClassVar[str] = "torchrec-seq"
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "torchrec-seq/single/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        return "one process, the model's tables as unsharded EmbeddingCollections trained by SGD"

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        holder = sequence_tables(model, build_for_training(model, ctx.device))
        optimizer = torch.optim.SGD([p for p in holder.parameters() if p.requires_grad], lr=ctx.lr)
        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            loss = sequence_loss(sequence_outputs(holder, holder.features, batch, ctx.device), batch.size)
            loss.backward()
            optimizer.step()
            return float(loss.item())

        return record_training(ctx, inputs, lambda b: sequence_outputs(holder, holder.features, b, ctx.device), train_step,
                               lambda: {n: to_numpy(p) for n, p in holder.state_dict().items()})


register_settings(
    [SequenceReference()]
    + [SequenceSharding(sharding=s, world_size=ws, dedup=d)
       for s, d, ws in itertools.product(SHARDINGS, DEDUP, WORLD_SIZES)]
)
