"""TorchRec's train pipelines: the sharded model trained by `pipeline.progress(batches)` as production TorchRec trains
it, instead of a plain loop. `TrainPipelineBase` copies the next batch to the device while the current one trains;
`TrainPipelineSparseDist` (and its lighter `TrainPipelineSparseDistLite`, and `PrefetchTrainPipelineSparseDist`)
rewrite the sharded modules' forward so that the next batch's input distribution (the ids' all-to-all) runs during
the current batch's forward and backward. The rewrite traces the model with torch.fx to find each sharded module's
input in the batch, so the model runs inside a wrapper that takes the batch object and returns (loss, output), as
TorchRec's own training modules do.

Each step trains a fresh copy of the same share of the batch, the pipeline filled from one iterator for all steps (so
it really runs a batch ahead). Judged against `torchrec/ebc/<sharding>/ws<n>`: the same sharding trained by the plain
loop, so a bug of the sharding itself (judged there) is not counted again here. `TrainPipelineSemiSync` is left out
by design: it looks embeddings up before the previous step's update lands, a documented staleness, not the plain
loop's result.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import RunContext, Unsupported, register_settings
from settings._torchrec_plan import gather_whole
from settings.torchrec_sharding import TorchRecSharding

# the setting's name for each pipeline class of torchrec.distributed.train_pipeline
PIPELINES = {"base": "TrainPipelineBase", "sparse-dist": "TrainPipelineSparseDist",
             "sparse-dist-lite": "TrainPipelineSparseDistLite", "prefetch": "PrefetchTrainPipelineSparseDist"}
# the attribute under which the wrapper holds the model (every parameter name gains it as a prefix)
WRAPPED = "module"


@dataclass(frozen=True)
class TrainPipelineSharding(TorchRecSharding):
    """A TorchRec DMP trained through one of TorchRec's train pipelines."""

    pipeline: str = "sparse-dist"  # a key of PIPELINES
    family: ClassVar[str] = "torchrec-pipeline"
    tier_axes: ClassVar[tuple[str, ...]] = ("pipeline",)

    @property
    def name(self) -> str:
        return f"torchrec-pipeline/{self.pipeline}/{self.sharding}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return TorchRecSharding(self.sharding, self.world_size).name

    def describe(self) -> str:
        return f"TorchRec DMP, every table {self.sharding}, {self.world_size} ranks, trained by {PIPELINES[self.pipeline]}"

    def available(self) -> str | None:
        missing = super().available()
        if missing is not None:
            return missing
        from torchrec.distributed.train_pipeline import train_pipelines

        if not hasattr(train_pipelines, PIPELINES[self.pipeline]):
            return f"this torchrec has no {PIPELINES[self.pipeline]} (torchrec.distributed.train_pipeline)"
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Any:
        if self.pipeline == "prefetch" and ctx.device.split(":")[0] == "cpu":
            # probed on torchrec 1.9.2: without a device stream `prefetch_embeddings` returns at once, and the
            # pipelined forward then asserts that the prefetch it expected is missing
            raise Unsupported("PrefetchTrainPipelineSparseDist prefetches embeddings on a device stream; on the CPU "
                              "torchrec skips the prefetch and its forward asserts (\"Invalid PrefetchPipelinedForward "
                              "usage\"): it runs on CUDA")
        return super().run(ctx, model, inputs)

    def standalone(self, case: Any) -> Any:
        """The whole model inside the batch model the pipeline drives, its tables fused with SGD and sharded under the
        case's plan, trained by the case's pipeline class against the plain loop on the unsharded model in one process
        (settings/_torchrec_pipeline_script.py): every parameter after the steps."""
        import dataclasses

        from difftest import refuse_changed_hooks
        from settings import _torchrec_pipeline_script as script
        from settings._torchrec_clip_script import sharded_with_fused_sgd
        from settings._torchrec_plan import SHARDING_TYPES, _local_pieces, plan_functions
        from settings._training_script import training_script
        from settings.torchrec_optimizers import _is_table

        refuse_changed_hooks(self, TrainPipelineSharding, "sharded_module", "load_initial_state", "full_state",
                             "trainer", "table_optimizer", "dense_optimizer", "dense_step", "initial_state", "sharder",
                             "_plan")
        if self.pipeline == "prefetch":  # the script runs on the CPU, where the setting is refused (`run`)
            raise Unsupported("PrefetchTrainPipelineSparseDist prefetches on a device stream, and the script runs on "
                              "the CPU, where its forward asserts; repro.py reproduces the case through difftest")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        module = case.generator.build(case.spec, case.init_state, "cpu", case.model_dir)
        arity = len(model_inputs(case.generator, case.spec.kind)(module, case.inputs["train"].slice(0, 1), "cpu"))
        made = training_script(
            case, f"TorchRec DistributedModelParallel over the whole model inside the batch model a train pipeline "
                  f"drives, every table {self.sharding}, fused with SGD, trained by {PIPELINES[self.pipeline]}",
            self.world_size,
            (*plan_functions(self.sharding, tables, self.plan_seed, self.world_size), _is_table, _local_pieces,
             sharded_with_fused_sgd, NoDenseParameters, pipeline_batch, batch_model, script.distribute,
             script.sgd_on_share, script.full_parameters),
            {"sharding": self.sharding, "plan_seed": self.plan_seed, "local_world_size": case.local_world_size,
             "lr": case.lr, "pipeline": PIPELINES[self.pipeline], "inputs": arity,
             "batches": case.steps},  # as many as the run's pipeline was given: it ran a batch ahead at every step
            libraries=("fbgemm-gpu",))
        return dataclasses.replace(made, preamble=(
            *made.preamble, "import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}", f"INPUTS = {INPUTS!r}",
            f"WRAPPED = {WRAPPED!r}"))

    def sharded_module(self, model: Any, module: Any, inputs: Any) -> Any:
        arity = len(model_inputs(model.generator, model.spec.kind)(module, inputs.train.slice(0, 1), "cpu"))
        wrapped = batch_model(module, model.generator.predict, lambda prediction, labels: model.loss(
            prediction, types.SimpleNamespace(labels=labels.cpu().numpy())), arity)
        if self.pipeline != "base":  # the others rewrite the sharded modules' forward, found by tracing the model
            refuse_untraceable(wrapped)
        return wrapped

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        super().load_initial_state(ctx, dmp, {f"{WRAPPED}.{name}": value for name, value in state.items()})

    def full_state(self, ctx: RunContext, dmp: Any) -> dict | None:
        whole = gather_whole(ctx, dmp.state_dict())
        return None if whole is None else {name.removeprefix(f"{WRAPPED}."): value for name, value in whole.items()}

    def trainer(self, ctx: RunContext, model: Any, dmp: Any, optimizer: Any) -> tuple[Callable, Callable]:
        import torch
        from torchrec.distributed.train_pipeline import train_pipelines

        inner = getattr(dmp.module, WRAPPED)  # the model with its sharded collections, called as the plain loop calls it
        running: dict[str, Any] = {}

        def train_step(share: Any) -> float:
            if "pipeline" not in running:  # one iterator for every step: the pipeline fills itself a batch ahead
                inputs_of = model_inputs(model.generator, model.spec.kind)
                running["batches"] = (pipeline_batch(inputs_of(inner, share, ctx.device), torch.from_numpy(share.labels))
                                      for _ in range(ctx.steps))
                cls = getattr(train_pipelines, PIPELINES[self.pipeline])
                running["pipeline"] = cls(dmp, optimizer if optimizer is not None else NoDenseParameters(),
                                          torch.device(ctx.device))
            try:
                loss = running["pipeline"].progress(running["batches"])
            except StopIteration:
                raise RuntimeError(f"{PIPELINES[self.pipeline]} stopped before its last step") from None
            pipelined = getattr(running["pipeline"], "_pipelined_modules", None)
            if pipelined is not None:
                ctx.notes["pipelined modules"] = str(len(pipelined))
            return float(loss)

        def evaluate(batch: Any) -> dict[str, Any]:
            if "pipeline" in running and hasattr(running["pipeline"], "detach"):
                running["pipeline"].detach()  # the original forwards back: evaluation runs the plain sharded modules
            return model.evaluate(inner, batch, ctx.device)

        return train_step, evaluate


def refuse_untraceable(wrapped: Any) -> None:
    """Unsupported where torch.fx cannot trace the unsharded model as the pipeline's tracer traces the sharded one
    (every module holding no embedding collection, and each collection, a leaf): the pipeline's own trace could not
    succeed either, and that is the model's limit, not the pipeline's."""
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, module: Any, name: str) -> bool:
            return isinstance(module, EmbeddingBagCollection) or not any(
                isinstance(inner, EmbeddingBagCollection) for inner in module.modules())

    try:
        Tracer().trace(wrapped)
    except Exception as exc:  # torch.fx raises TraceError, TypeError, ... on Python it cannot follow
        raise Unsupported("the pipeline finds each sharded module's input by tracing the model with torch.fx, and "
                          f"the unsharded model does not trace ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None


def model_inputs(generator: Any, kind: str) -> Callable[..., tuple[Any, ...]]:
    """The kind's `model_inputs(module, batch, device)`: the model's arguments (dense tensor, KeyedJaggedTensors) of a
    batch, which a pipeline batch carries as fields."""
    found = getattr(generator, "model_inputs", None)
    if found is None:
        raise Unsupported(f"model kind {kind!r} does not hand out its inputs as tensors and "
                          "KeyedJaggedTensors (model_inputs), which a train pipeline's batch carries")
    return found  # type: ignore[no-any-return]


class NoDenseParameters:
    """The optimizer a pipeline steps when every parameter is a fused table (trained inside backward)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


INPUTS = ("dense", "sparse", "weighted")  # a pipeline batch's fields, in the model's argument order


def pipeline_batch(inputs: tuple[Any, ...], labels: Any) -> Any:
    """The model's inputs and the labels (a tensor) as a batch a pipeline moves: `to(device)` and `record_stream` over
    every tensor and KeyedJaggedTensor (torchrec's `Pipelineable`), each input a field the pipeline's tracer can
    follow."""
    from torchrec.streamable import Pipelineable

    class Batch(Pipelineable):
        def __init__(self, fields: dict[str, Any]) -> None:
            self.fields = fields
            for name, value in fields.items():
                setattr(self, name, value)

        def to(self, device: Any, non_blocking: bool = False) -> Any:
            return Batch({n: v.to(device=device, non_blocking=non_blocking) for n, v in self.fields.items()})

        def record_stream(self, stream: Any) -> None:
            for value in self.fields.values():
                value.record_stream(stream)

    return Batch({**dict(zip(INPUTS, inputs)), "labels": labels})


def batch_model(module: Any, predict: Callable[[Any, tuple[Any, ...]], Any], loss: Callable[[Any, Any], Any],
                arity: int) -> Any:
    """`module` inside a module that takes a pipeline batch (its first `arity` inputs) and returns (loss, loss), as
    TorchRec's training modules do: `predict(module, inputs)`, then `loss(prediction, labels)` in a leaf module of its
    own, which the pipeline's tracer does not enter."""
    import torch

    class Loss(torch.nn.Module):
        def forward(self, prediction: Any, labels: Any) -> Any:
            return loss(prediction, labels)

    class BatchModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, WRAPPED, module)
            self.loss = Loss()

        def forward(self, batch: Any) -> tuple[Any, Any]:
            inputs = tuple(getattr(batch, name) for name in INPUTS[:arity])
            value = self.loss(predict(getattr(self, WRAPPED), inputs), batch.labels)
            return value, value.detach()

    return BatchModel()


register_settings(TrainPipelineSharding(sharding, 2, pipeline=pipeline) for pipeline in PIPELINES
                  for sharding in ("table_wise", "row_wise", "column_wise", "data_parallel"))
