"""TorchRec's variable batch per feature (VBE): each rank sends, per feature, only the distinct bags of its samples
(`KeyedJaggedTensor(stride_per_key_per_rank=…, inverse_indices=…)`), and the sharded EmbeddingBagCollections pool
those and hand every sample its bag's result back, sharded by DistributedModelParallel.

The batch is made to have repeated bags first, the same for the family's root and its settings: for the j-th feature,
groups of 1 + j mod 3 consecutive samples share the first one's bag (ids and weights). Each rank then finds the runs of
equal bags in its share (a run may be cut by the share's edge: strides differ per feature and per rank, as VBE is meant
for) and sends each run's bag once, with every sample's run as its inverse index. The root pools the same samples with
every bag written out, unsharded in one process, plain SGD; the settings train the tables with TorchRec's fused SGD.
Recorded: every feature's pooled embedding per sample (`pooled.<feature>`), the loss (the mean over samples of the
pooled embeddings' dot products with a fixed vector, summed in float64) and every table after each step. What fbgemm's
CPU kernels refuse in their own words ("… is not supported on CPU": several table batches on a rank, as mixed pooling
makes) is `unsupported` with them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from difftest import (
    Inputs,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    record_training,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    traits_of,
)
from settings._torchrec_plan import SHARDING_TYPES, embedding_collections, table_configs
from settings._torchrec_script import bag_runs_kjt
from settings._training import build_for_training
from settings.torchrec_sharding import HeldTablesSharding

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

WORLD_SIZES = (2, 4)


def repeated_bags(inputs: Inputs, features: list[str]) -> Inputs:
    """`inputs` with, for the j-th of `features`, every group of 1 + j mod 3 consecutive samples given the bag (ids,
    weights) of the group's first sample."""
    def repeat(batch: Any) -> Any:
        sparse = dict(batch.sparse)
        for j, name in enumerate(features):
            bags = sparse[name]
            starts = np.concatenate([[0], np.cumsum(bags.lengths)])
            heads = [i - i % (1 + j % 3) for i in range(batch.size)]
            pieces = [slice(starts[h], starts[h + 1]) for h in heads]
            sparse[name] = dataclasses.replace(
                bags, lengths=bags.lengths[heads],
                values=np.concatenate([bags.values[p] for p in pieces]),
                weights=None if bags.weights is None else np.concatenate([bags.weights[p] for p in pieces]))
        return dataclasses.replace(batch, sparse=sparse)

    return Inputs(repeat(inputs.train), repeat(inputs.eval))


def _features(model: Any) -> list[str]:
    """The model's features, in the order of its generator's tables: which of them repeat bags how often."""
    return [f for table in model.generator.embedding_tables(model.spec) or () for f in table.features]


def _feature_kjt(batch: Any, names: list[str], device: str, dtype: Any, variable: bool) -> Any:
    """The batch's bags of `names` as one KeyedJaggedTensor (`bag_runs_kjt`): every sample's bag written out, or
    (`variable`) each run of equal consecutive bags once, with each sample's run as its inverse index (VBE)."""
    return bag_runs_kjt({name: (batch.sparse[name].lengths, batch.sparse[name].values, batch.sparse[name].weights)
                         for name in names}, variable, dtype).to(device)


def pooled_outputs(holder: Any, features: dict[str, list[str]], batch: Any, device: str, variable: bool,
                   strides: dict[str, int] | None = None) -> dict[str, Any]:
    """`pooled.<feature>` → [samples, dim]: every sample's pooled embedding of the feature, through `holder`'s own
    forward (`_holder`'s, or DMP's around it, so a data-parallel table's DDP sees the forward it synchronises);
    `features`: collection path → its features; `strides` gets how many bags each feature sent."""
    import torch

    # the weights of weighted features in the tables' dtype: float64 in a calibration's centre, else float32
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in holder.parameters()) else torch.float32
    kjts = {path: _feature_kjt(batch, names, device, dtype, variable) for path, names in features.items()}
    if strides is not None:
        for path, names in features.items():
            strides.update(zip(names, kjts[path].stride_per_key(), strict=True))
    pooled = holder(kjts)
    return {f"pooled.{name}": pooled[path][name] for path, names in features.items() for name in names}


def pooled_loss(outputs: dict[str, Any], samples: int) -> Any:
    """Per sample, the sum of its pooled embeddings' dot products with a fixed vector (1, -1/2, 1/3, …); the mean
    over the `samples` of the batch, summed in float64: the loss is the test's own arithmetic, and a share's sum
    added to the others' must not differ from the whole batch's by more than the pooled values do."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for value in outputs.values():
        dim = value.shape[-1]
        direction = torch.tensor([(-1) ** i / (i + 1) for i in range(dim)], dtype=torch.float64, device=value.device)
        total = total + (value.double() * direction).sum() / samples
    return total


def pooled_steps(ctx: RunContext, holder: Any, variable: bool, zero_grad: Callable[[], Any], step: Callable[[], Any],
                 on_strides: Callable[[Any, dict[str, int]], None] | None = None) -> tuple[Callable, Callable]:
    """(train_step, evaluate) of a holder of bag collections (`holder.features`, or its module's under DMP): the
    pooled embeddings by feature, their `pooled_loss`, backward, then `step`; `on_strides` gets each evaluated batch
    and how many bags each feature sent."""
    features = getattr(holder, "features", None) or holder.module.features

    def evaluate(batch: Any) -> dict[str, Any]:
        strides: dict[str, int] | None = {} if on_strides is not None else None
        found = pooled_outputs(holder, features, batch, ctx.device, variable=variable, strides=strides)
        if on_strides is not None and strides is not None:
            on_strides(batch, strides)
        return found

    def train_step(batch: Any) -> float:
        zero_grad()
        loss = pooled_loss(evaluate(batch), batch.size)
        loss.backward()  # a sharded holder's tables are updated inside backward (fused SGD)
        step()
        return float(loss.item())

    return train_step, evaluate


def sharded_pooled_steps(setting: Any, ctx: RunContext, dmp: Any, optimizer: Any, variable: bool,
                         on_strides: Callable[[Any, dict[str, int]], None] | None = None) -> tuple[Callable, Callable]:
    """`pooled_steps` of DMP around a holder, the dense optimizer (if any) stepped by the setting's `dense_step`."""
    return pooled_steps(ctx, dmp, variable, optimizer.zero_grad if optimizer is not None else lambda: None,
                        (lambda: setting.dense_step(ctx, optimizer)) if optimizer is not None else lambda: None,
                        on_strides)


def train_alone(ctx: RunContext, inputs: Inputs, holder: Any, full_state: Callable[[], dict | None],
                optimizer_class: tuple[type, dict[str, Any]] | None = None) -> Outputs | None:
    """A holder of bag collections trained in one process by `optimizer_class` (a class and its options; plain SGD
    at the run's learning rate when None), recorded as a family's root records."""
    import torch

    cls, options = optimizer_class or (torch.optim.SGD, {"lr": ctx.lr})
    optimizer = cls([p for p in holder.parameters() if p.requires_grad], **options)
    train_step, evaluate = pooled_steps(ctx, holder, False, optimizer.zero_grad, optimizer.step)
    return record_training(ctx, inputs, evaluate, train_step, full_state)


def _supports(spec: Any) -> str | None:
    if "torchrec" not in traits_of(spec.kind):
        return f"TorchRec's variable batch pools a model's EmbeddingBagCollections; model kind {spec.kind!r} has none"
    return None


@dataclass(frozen=True)
class VariableBatchSharding(HeldTablesSharding):
    """TorchRec DMP over the model's EmbeddingBagCollections, every table one sharding type, fed VBE batches."""

    family: ClassVar[str] = "torchrec-vbe"
    tier_axes: ClassVar[tuple[str, ...]] = ()  # the default tier: column-wise, two ranks

    @property
    def name(self) -> str:
        return f"torchrec-vbe/{self.sharding}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return VariableBatchReference().name

    def describe(self) -> str:
        return (f"TorchRec DMP, every table {self.sharding}, {self.world_size} ranks, each feature's distinct bags "
                "sent once (variable batch per feature)")

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        try:
            return super().run(ctx, model, repeated_bags(inputs, _features(model)))
        except AssertionError as exc:  # fbgemm's own words for what its CPU kernels lack: "… is not supported on CPU"
            if "not supported on CPU" in str(exc) and ctx.device == "cpu":
                raise Unsupported(f"fbgemm refuses it on CPU: {exc}") from exc
            raise

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        return _holder(module)

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        def sent(batch: Any, strides: dict[str, int]) -> None:
            ctx.notes["bags sent per feature"] = (f"{', '.join(f'{f} {n}' for f, n in strides.items())} "
                                                  f"(of {batch.size} samples)")

        return sharded_pooled_steps(self, ctx, dmp, optimizer, variable=True, on_strides=sent)

    def standalone(self, case: StandaloneCase) -> Script:
        """The sharding family's script of the collections (`sharding_script`) on the batch with its repeated bags,
        each rank sending each feature's runs of equal bags once."""
        refuse_changed_hooks(self, VariableBatchSharding, "sharded_module", "trainer", "full_state",
                             "load_initial_state")
        tables = case.generator.embedding_tables(case.spec) or []
        repeated = repeated_bags(Inputs(case.inputs["train"], case.inputs["eval"]),
                                 [f for table in tables for f in table.features])
        return self.sharding_script(dataclasses.replace(case, inputs={"train": repeated.train, "eval": repeated.eval}),
                                    variable_batch=True)


def _holder(module: Any) -> Any:
    """The model's bag collections alone, under their own paths (dots as `_`); `features`: path → its features. Its
    forward takes a KeyedJaggedTensor per path and returns each collection's pooled embeddings by feature."""
    import torch

    class Collections(torch.nn.Module):
        def forward(self, kjts: dict[str, Any]) -> dict[str, dict[str, Any]]:
            return {path: self.get_submodule(path)(kjt).to_dict() for path, kjt in kjts.items()}

    holder = Collections()
    holder.features = {}
    for path, collection in embedding_collections(module).items():
        name = path.replace(".", "_")
        holder.add_module(name, collection)
        holder.features[name] = [f for config in table_configs(collection) for f in config.feature_names]
    return holder


@dataclass(frozen=True)
class VariableBatchReference(Setting):
    """The family's root: the model's bag collections unsharded in one process, every bag written out, plain SGD."""

    world_size: int = 1
    family: ClassVar[str] = "torchrec-vbe"
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "torchrec-vbe/single/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        return "one process, the model's bag collections unsharded, every sample's bag written out, trained by SGD"

    def supports(self, spec: Any) -> str | None:
        return _supports(spec)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:

        holder = _holder(build_for_training(model, ctx.device))
        return train_alone(ctx, repeated_bags(inputs, _features(model)), holder,
                           lambda: {n: to_numpy(p) for n, p in holder.state_dict().items()})


register_settings(
    [VariableBatchReference()]
    + [VariableBatchSharding(sharding=s, world_size=ws) for s, ws in itertools.product(SHARDING_TYPES, WORLD_SIZES)]
)
