"""torchtitan's own recipes (the `[titan]` extra): a torchtitan model trained the way torchtitan's trainer trains it,
against the plain single-process program.

The model is rebuilt from its own config, updated for the recipe (`update_from_config`: its sharding declarations,
sequence parallel or not), on the meta device; torchtitan's `ParallelDims` lays the mesh out (`dp_shard` × `tp`)
and the model's `parallelize` function (`parallelize_llama` for Llama 3) applies tensor parallelism, activation
checkpointing (`full`, or `selective` by op), per-block `torch.compile` and FSDP2 as torchtitan orders them, under
one of its SPMD backends (`spmd_types`, its default; `partial_dtensor`; `full_dtensor`). The weights are then the
case's, laid into the sharded parameters; each step feeds the inputs as the trainer does (annotated for the backend,
the batch split over the data-parallel ranks), takes torchtitan's own cross-entropy (the sum over tokens divided by
the global token count) and steps plain SGD.

What is adapted for the CPU, and recorded in each case's notes: torchtitan picks "cuda" as its device where no
accelerator is found (`torchtitan.tools.utils.device_type`, copied into `torchtitan.distributed.parallel_dims`), so
the mesh's device is set to the case's; FSDP2's gradient reduction is asked for a plain sum where the backend is gloo
(torchtitan's divide factor becomes a `PREMUL_SUM`, which gloo lacks). What the recipe is run with: parameters in
fp32 (`mixed_precision_param`; `/bf16` runs its default, bf16 parameters with fp32 gradient reduction, judged by the
root's bf16 envelope), `/compile` compiling the model's blocks (not the loss). Gradient clipping, the learning-rate
schedule and AdamW, which the trainer adds around the recipe, are not part of it (the `clip` family tests clipping).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

from difftest import (
    SHARDED,
    ModelSpec,
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Tolerance,
    Unsupported,
    across,
    refuse_changed_hooks,
    register_settings,
    traits_of,
)
from settings._training import build_for_training
from settings.compiled import inductor_cannot_compile
from settings.fsdp import BF16_TOLERANCE

BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")
CHECKPOINTING = ("none", "full", "selective")
# the schedules torchtitan's `pipeline_parallel_schedule` names (torch's `get_schedule_class`), less its two abstract
# bases, which run only a schedule read from a CSV file
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")
# torchtitan's prefixes of wrapped modules in parameter names: checkpoint_wrapper's and torch.compile's
_WRAPPED = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class TorchtitanRecipe(Setting):
    """A torchtitan model under its own `parallelize` function: FSDP2 over `data_parallel` ranks × tensor parallel
    over `tensor_parallel`, with the recipe's checkpointing, compile and SPMD backend, in a new group of processes."""

    data_parallel: int
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    checkpointing: str = "none"  # a value of CHECKPOINTING
    compile: bool = False
    backend: str = "spmd_types"  # a value of BACKENDS
    # torchtitan's `mixed_precision_param`: "bfloat16" (its default) is FSDP2's MixedPrecisionPolicy (bf16 parameters
    # in compute, gradients reduced in fp32), so it takes a data-parallel mesh
    param_dtype: str = "float32"
    world_size: int = 1  # the sweep's process only launches the recipe's own group
    pipeline_parallel: int = 1  # >1: `TorchtitanPipelineRecipe`
    schedule: str = ""  # the pipeline schedule, by the name torchtitan's `pipeline_parallel_schedule` takes
    microbatches: int = 1  # a data-parallel share's micro-batches per schedule step
    family: ClassVar[str] = "titan"
    tier_axes: ClassVar[tuple[str, ...]] = ("backend", "checkpointing", "sequence_parallel", "data_parallel",
                                            "tensor_parallel", "param_dtype")
    size_parameters: ClassVar[frozenset[str]] = frozenset()

    @property
    def ranks(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def name(self) -> str:
        mesh = f"dp{self.data_parallel}-tp{self.tensor_parallel}" + (
            "" if self.sequence_parallel or self.tensor_parallel == 1 else "-no-sp")
        if self.pipeline_parallel > 1:
            mesh += f"-pp{self.pipeline_parallel}/{self.schedule.lower()}/mb{self.microbatches}"
        return (f"titan/{self.backend}/{mesh}/ac-{self.checkpointing}" + ("/compile" if self.compile else "")
                + ("/bf16" if self.param_dtype == "bfloat16" else "") + ("" if self.evaluates else "/train-only")
                + f"/ws{self.ranks}")

    @property
    def precision(self) -> str:  # type: ignore[override]
        """bf16 parameters in compute: judged by the root's bf16 envelope (what bf16 itself costs, and sharding)."""
        return "bf16" if self.param_dtype == "bfloat16" else "fp32"

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BF16_TOLERANCE if self.precision == "bf16" else default

    def describe(self) -> str:
        parts = [f"FSDP2 over {self.data_parallel} ranks" if self.data_parallel > 1 else "",
                 f"tensor parallel over {self.tensor_parallel}"
                 + (" with sequence parallel" if self.sequence_parallel else "") if self.tensor_parallel > 1 else "",
                 f"{self.checkpointing} activation checkpointing" if self.checkpointing != "none" else "",
                 "each block compiled" if self.compile else "",
                 "bf16 parameters, fp32 gradient reduction" if self.param_dtype == "bfloat16" else "",
                 f"pipelined over {self.pipeline_parallel} ranks by its {self.schedule} schedule, "
                 f"{self.microbatches} micro-batches a step" if self.pipeline_parallel > 1 else "",
                 "" if self.evaluates else "trained without evaluating"]
        return (f"torchtitan's parallelize recipe ({', '.join(p for p in parts if p)}; SPMD backend "
                f"{self.backend}) in {self.ranks} new processes")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.ranks, SHARDED | {"all_reduce"})

    def supports(self, spec: ModelSpec) -> str | None:
        if "titan" not in traits_of(spec.kind):
            return f"torchtitan's recipes parallelize torchtitan's models, not kind {spec.kind!r}"
        return None

    def available(self) -> str | None:
        if importlib.util.find_spec("torchtitan") is None:
            return "needs torchtitan (pip install 'difftest[titan]')"
        return inductor_cannot_compile() if self.compile else None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """The recipe in new processes: torchtitan keeps the meshes of the model it parallelized in process state
        (its SPMD backends' registries), so a second model parallelized in one process has its parameters on the
        first one's meshes; a training job parallelizes one model per process, and so does each case."""
        from settings._resumable import train_in_new_processes

        outputs = train_in_new_processes(self, ctx, model, self.ranks, "torchtitan's recipe")
        ctx.notes["adapted"] = f"torchtitan's mesh on {ctx.device.split(':')[0]}" + (
            "; gloo: FSDP2 reduces gradients by plain sum (gloo has no PREMUL_SUM)" if ctx.backend == "gloo" else "")
        return outputs

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """One process's part of the recipe's training, in the recipe's own group."""
        import torch
        from torch.distributed.tensor import DTensor

        from difftest import gather_to_rank0, record_training, to_numpy

        plain = build_for_training(model, ctx.device)
        recipe = _Recipe(self, ctx, plain, share=len(inputs.train.dense) // self.data_parallel)
        parameters = lay_out(recipe, plain)
        optimizer = torch.optim.SGD([p for p in parameters.values() if p.requires_grad], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            loss = recipe.step(batch)
            self.optimizer_step(ctx, optimizer)
            return loss

        def whole_parameters() -> dict[str, Any] | None:
            full = {name: to_numpy(p.full_tensor() if isinstance(p, DTensor) else p) for name, p in parameters.items()}
            if self.pipeline_parallel == 1:
                return full if ctx.rank == 0 else None
            stages = gather_to_rank0(ctx, full)  # each pipeline rank holds its stages' parameters
            return None if stages is None else {name: t for stage in stages for name, t in stage.items()}

        return record_training(ctx, inputs, recipe.evaluate if self.evaluates else None, train_step,
                               whole_parameters, data_shard=(recipe.data_index, self.data_parallel))

    # whether the model is evaluated before and after training (`TorchtitanPipelineTrainedOnly`: not)
    evaluates: ClassVar[bool] = True

    def standalone(self, case: StandaloneCase) -> Script:
        """The recipe as a script: torchtitan's `_Recipe` (copied) over the plain model with the case's weights,
        evaluated and trained as the setting does, against the steps on the whole batch in one process."""
        from difftest import Script, to_numpy
        from settings._training_script import (
            backward_on_share,
            parameters_after,
            sgd_on_share,
            single_process,
            stepping,
            trained_parameters,
        )

        refuse_changed_hooks(self, TorchtitanRecipe, "train", "optimizer_step")
        model, steps, tensors = trained_parameters(case)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        evaluated = "evaluated before and after, " if self.evaluates else ""
        return Script(
            summary=f"{self.describe()}: {evaluated}{steps} step(s) of plain SGD (lr {case.lr:g}), each data-parallel "
                    f"share of the batch fed as torchtitan's trainer feeds it, over {self.ranks} CPU ranks (gloo)"
                    + case.against("the same steps on the whole batch in one process: the parameters after them")
                    + f". {model.summary}",
            libraries=("torch", *model.libraries, "numpy"),
            preamble=(*model.preamble, "import copy", "import importlib", "import tempfile",
                      "from types import SimpleNamespace", f"_WRAPPED = {_WRAPPED!r}"),
            case={**model.case, "setting": {**fields, "ranks": self.ranks, "evaluates": self.evaluates},
                  "device": "cpu", "lr": case.lr, "steps": steps, "batch": case.inputs["train"].size},
            functions=(*model.functions, to_numpy, stepping, backward_on_share, sgd_on_share, parameters_after,
                       single_process, _all_gather, _use_device, _model_spec, _checkpointing, _parallel_dims,
                       _Recipe, lay_out, on_rank),
            tensors=tensors, data={**model.data, **case.inputs["eval"].to_arrays("eval")}, world_size=self.ranks)

    def optimizer_step(self, ctx: RunContext, optimizer: Any) -> None:
        """The step after each backward (a hook for planted faults)."""
        optimizer.step()


@dataclass(frozen=True)
class TorchtitanPipelineRecipe(TorchtitanRecipe):
    """The recipe pipelined as torchtitan pipelines it: its `pipelining_fn` (`pipeline_llm`) splits the model into
    stages by module (the embedding and the output each weighing one layer), each stage parallelized by the model's
    `parallelize` function, scheduled by the schedule torchtitan is configured with (`scale_grads` off: its loss is
    each micro-batch's token sum over the global token count); trained by `schedule.step` and evaluated by
    `schedule.eval` on pre-split micro-batches as its trainer and validator call them."""

    pipeline_parallel: int = 2
    schedule: str = "1F1B"
    microbatches: int = 4  # no fewer than the stages of a looped schedule on 2 ranks (torchtitan warns of a bubble)
    tier_axes: ClassVar[tuple[str, ...]] = ("schedule",)
    # a case starts 2-4 processes and builds its stages anew: 10-20 s on 2 cores
    in_default_tier: ClassVar[bool] = False


@dataclass(frozen=True)
class TorchtitanPipelineTrainedOnly(TorchtitanPipelineRecipe):
    """A V schedule's recipe trained without `schedule.eval`, which raises under ZBVZeroBubble and DualPipeV on torch
    2.12-2.14 (known issue `pipelining-zbv-eval`, as torchtitan's validator would meet it): judged on the losses and
    the parameters after each step, so that what their split backward trains is seen behind that error."""

    evaluates: ClassVar[bool] = False

    def judges(self, tensor_name: str) -> bool:
        return super().judges(tensor_name) and not tensor_name.startswith("eval_")


@dataclass(frozen=True)
class CompiledTorchtitanRecipe(TorchtitanRecipe):
    """The recipe with torchtitan's per-block `torch.compile` (Inductor)."""

    compile: bool = True
    # Inductor compiles each block's forward and backward anew: 15-30 s a case on 2 cores
    in_default_tier: ClassVar[bool] = False


class _Recipe:
    """One rank's part of a torchtitan recipe: the parallelized model (a pipeline rank's: its stages and their
    schedule, as torchtitan's `pipelining_fn` made them), and the trainer's way of feeding it."""

    def __init__(self, setting: TorchtitanRecipe, ctx: RunContext, plain: Any, share: int) -> None:
        import torch
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

        device = ctx.device.split(":")[0]
        _use_device(device)
        self.setting, self.ctx = setting, ctx
        self.vocabulary = plain.config.vocab_size
        pipelined = setting.pipeline_parallel > 1
        if pipelined and share % setting.microbatches:
            raise Unsupported(f"a data-parallel share of {share} samples does not split into "
                              f"{setting.microbatches} equal micro-batches (torchtitan refuses it)")
        parallelism = ParallelismConfig(data_parallel_shard_degree=setting.data_parallel,
                                        tensor_parallel_degree=setting.tensor_parallel,
                                        enable_sequence_parallel=setting.sequence_parallel,
                                        spmd_backend=setting.backend,
                                        pipeline_parallel_degree=setting.pipeline_parallel,
                                        pipeline_parallel_schedule=setting.schedule or "1F1B",
                                        pipeline_parallel_microbatch_size=share // setting.microbatches)
        config = copy.deepcopy(plain.config)
        try:
            config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
        except NotImplementedError as refused:  # a combination torchtitan refuses by design (a tied output, pipelined)
            raise Unsupported(f"torchtitan refuses it: {refused}") from None
        self.dims = _parallel_dims(parallelism, setting.ranks)
        from torchtitan.distributed import utils as titan_utils

        titan_utils.set_spmd_backend(setting.backend)
        with torch.device("meta"):
            module = config.build()
        self.compile_config = CompileConfig(enable=setting.compile, components=["model"])
        self.loss = CrossEntropyLoss.Config(global_vocab_size=self.vocabulary).build(compile_config=self.compile_config)
        spec = _model_spec(module)
        self.schedule: Any = None  # a pipeline rank's schedule
        self.first = self.last = True  # whether this rank holds the first (last) stage
        with tempfile.TemporaryDirectory() as dump:  # where selective checkpointing may write its op log
            recipe = dict(parallel_dims=self.dims, training=TrainingConfig(mixed_precision_param=setting.param_dtype,
                                                                             local_batch_size=share),
                          parallelism=parallelism, compile_config=self.compile_config,
                          ac_config=_checkpointing(setting.checkpointing), dump_folder=dump)
            if pipelined:  # as torchtitan's trainer: the stages split, each parallelized, and their schedule
                self.schedule, parts, self.first, self.last = spec.pipelining_fn(
                    module, device=torch.device(ctx.device), model_config=config, parallelize_fn=spec.parallelize_fn,
                    loss_fn=self.loss, **recipe)
            else:
                parts = [spec.parallelize_fn(module, **recipe)]
        for part in parts:
            if ctx.backend == "gloo":
                from torch.distributed.fsdp import FSDPModule

                for unit in part.modules():
                    if isinstance(unit, FSDPModule):
                        unit.set_force_sum_reduction_for_comms(True)
            part.to_empty(device=ctx.device)
            with torch.no_grad():
                part.init_weights(buffer_device=None)  # the buffers (RoPE's cache); the weights are the case's
        self.parts = parts
        self.data_index = self.dims.get_mesh("batch").get_local_rank() if self.dims.dp_enabled else 0

    def parameters(self) -> dict[str, Any]:
        """The parallelized model's parameters (a pipeline rank's: its stages') under the plain model's names."""
        named = {}
        for part in self.parts:
            for name, parameter in part.named_parameters():
                for prefix in _WRAPPED:
                    name = name.replace(prefix, "")
                named[name] = parameter
        return named

    def _fed(self, tokens: Any, labels: Any) -> tuple[Any, Any, dict[str, Any]]:
        """Token ids and labels as the trainer hands them to the model, with their positions, annotated for the SPMD
        backend."""
        import torch

        positions = torch.arange(tokens.shape[1], device=self.ctx.device).expand(tokens.shape).contiguous()
        extra = {"positions": positions}
        if self.setting.backend == "full_dtensor":
            from torchtitan.distributed import full_dtensor

            tokens, labels, extra = full_dtensor.parallelize_inputs(self.dims, tokens, labels, extra)
        elif self.setting.backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            tokens, labels, extra = annotate_input_spmd_types(self.dims, tokens, labels, extra)
        return tokens, labels, extra

    def _batch(self, batch: Any) -> tuple[Any, Any, Any]:
        """The share's token ids and labels, and the global count of tokens the loss divides by."""
        import torch
        from torchtitan.distributed import utils as titan_utils

        tokens = torch.as_tensor(batch.dense, device=self.ctx.device)
        labels = torch.as_tensor(batch.labels, device=self.ctx.device)
        count = torch.tensor(labels.numel(), device=self.ctx.device)
        tokens_counted = (titan_utils.dist_sum_tensor(count, self.dims.get_mesh("batch"))
                          if self.dims.dp_enabled else count)
        return tokens, labels, tokens_counted

    def _microbatches(self, tokens: Any, labels: Any) -> dict[str, Any]:
        """The share split into the schedule's micro-batches, each fed as the trainer feeds one: the schedule's
        `arg_mbs`, `kwarg_mbs` and `target_mbs` on this rank (inputs on the first stage, targets on the last)."""
        import torch

        fed = [self._fed(t, y) for t, y in zip(torch.tensor_split(tokens, self.setting.microbatches),
                                               torch.tensor_split(labels, self.setting.microbatches), strict=True)]
        return {"arg_mbs": [(t,) for t, _, _ in fed] if self.first else None,
                "kwarg_mbs": [extra for _, _, extra in fed], "target_mbs": [y for _, y, _ in fed] if self.last else None}

    def _context(self) -> Any:
        from torchtitan.distributed import utils as titan_utils

        return titan_utils.get_spmd_context(parallel_dims=self.dims, spmd_typechecking=False)()

    def step(self, batch: Any) -> float | None:
        """Forward, torchtitan's loss, backward; the global loss (None on a pipeline rank without the last stage)."""
        import spmd_types  # torchtitan's own dependency
        import torch

        tokens, labels, tokens_counted = self._batch(batch)
        if self.schedule is not None:  # the trainer's pipelined step: the schedule runs forward, loss and backward
            losses: list[Any] | None = [] if self.last else None
            with self._context():
                self.schedule.step(**self._microbatches(tokens, labels), losses=losses,
                                   loss_kwargs={"global_valid_tokens": tokens_counted}, return_outputs=False)
            return self._global_loss(torch.sum(torch.stack(losses))) if losses is not None else None
        tokens, labels, extra = self._fed(tokens, labels)
        with self._context():
            prediction = self.parts[0](tokens, **extra)
            loss, _ = self.loss(prediction, labels, tokens_counted, positions=extra["positions"])
            with spmd_types.no_typecheck():  # as the trainer's backward runs
                loss.backward()
        return self._global_loss(loss)

    def _global_loss(self, loss: Any) -> float:
        """The global loss as torchtitan's trainer logs it: each share's tokens' sum over the global count, summed
        over the loss mesh (`dist_sum`: a DTensor's local value, whatever its mesh)."""
        from torchtitan.distributed import utils as titan_utils

        mesh = self.dims.get_optional_mesh("loss") if self.dims.dp_cp_enabled else None
        return titan_utils.dist_sum(loss.detach(), mesh)

    def evaluate(self, batch: Any) -> dict[str, Any] | None:
        """The logits of this share, whole (None on a pipeline rank without the last stage): a pipeline's through
        its schedule's `eval` as torchtitan's validator runs it; a DTensor gathered (and this share's rows kept), a
        plain tensor sharded over the tensor-parallel ranks (the vocabulary under loss parallel, the sequence under
        sequence parallel) all-gathered."""
        from torch.distributed.tensor import DTensor

        tokens, labels, tokens_counted = self._batch(batch)
        with self._context():
            if self.schedule is not None:
                logits = self.schedule.eval(**self._microbatches(tokens, labels), losses=[] if self.last else None,
                                            loss_kwargs={"global_valid_tokens": tokens_counted})
            else:
                tokens, _, extra = self._fed(tokens, labels)
                logits = self.parts[0](tokens, **extra)
        if not self.last:
            return None
        share = len(batch.dense)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
            if len(logits) != share:  # its mesh holds the data-parallel ranks too (full_dtensor): this share's rows
                logits = logits[self.data_index * share:(self.data_index + 1) * share]
        whole = (share, batch.dense.shape[1], self.vocabulary)
        for dim, size in enumerate(whole):
            if logits.shape[dim] != size and self.dims.tp_enabled:
                logits = _all_gather(logits, dim, self.dims.get_mesh("tp").get_group())
        if tuple(logits.shape) != whole:  # a layout this gathering does not know: ours to learn, not a finding
            raise RuntimeError(f"difftest: the recipe's logits of a share came back {tuple(logits.shape)}, not "
                               f"{whole}, and gathering over the tensor-parallel ranks did not make them whole")
        return {"prediction": logits}


def lay_out(recipe: Any, plain: Any) -> dict[str, Any]:
    """The recipe's parameters (`_Recipe.parameters`), each holding the plain model's weights as the recipe sharded
    them."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    parameters = recipe.parameters()
    with torch.no_grad():
        for name, parameter in parameters.items():
            whole = plain.get_parameter(name).detach().to(parameter.dtype)
            if isinstance(parameter, DTensor):
                parameter.to_local().copy_(distribute_tensor(whole, parameter.device_mesh,
                                                             parameter.placements).to_local())
            else:
                parameter.copy_(whole)
    return parameters


# what a standalone script defines before `on_rank` (declared here so that this module checks on its own): the model's
# `build_model`, the training script's `parameters_after`
build_model: Callable[..., Any]
parameters_after: Callable[..., dict[str, Any]]


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, Any] | None:
    """A standalone script's rank: the recipe over the plain model with the case's weights, evaluated before and after
    (where the setting evaluates), trained by plain SGD on this rank's data-parallel share; every parameter whole on
    rank 0 (a pipeline rank's, its stages')."""
    import torch
    from torch.distributed.tensor import DTensor

    setting = SimpleNamespace(**case["setting"])
    ctx = SimpleNamespace(device=case["device"], backend="gloo", rank=rank)
    share = case["batch"] // setting.data_parallel
    plain = build_model(data, case, torch.float32)  # noqa: F821 -- the script's, declared above
    recipe = _Recipe(setting, ctx, plain, share)
    parameters = lay_out(recipe, plain)
    optimizer = torch.optim.SGD([p for p in parameters.values() if p.requires_grad], lr=case["lr"])

    def batch(split: str) -> Any:
        size = len(data[f"{split}.labels"]) // setting.data_parallel
        rows = slice(recipe.data_index * size, (recipe.data_index + 1) * size)
        return SimpleNamespace(dense=data[f"{split}.dense"][rows], labels=data[f"{split}.labels"][rows])

    def evaluate() -> None:  # as difftest evaluates: without gradients
        if setting.evaluates:
            with torch.no_grad():
                recipe.evaluate(batch("eval"))

    evaluate()
    for _ in range(case["steps"]):
        optimizer.zero_grad()
        recipe.step(batch("train"))
        optimizer.step()
    evaluate()
    whole = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in parameters.items()}
    pieces = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(parameters_after(whole, case), pieces, dst=0)  # noqa: F821 -- the script's
    return {name: t for piece in pieces for name, t in piece.items()} if pieces else None


def _all_gather(tensor: Any, dim: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _use_device(device: str) -> None:
    """torchtitan fixes its device at import (`device_type`: the accelerator found, else "cuda"); its mesh is
    made on the case's device instead."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device


def _model_spec(module: Any) -> Any:
    """The model's spec in its torchtitan package's registry: its own `parallelize_fn` and `pipelining_fn`."""
    package = importlib.import_module(type(module).__module__.rpartition(".")[0])
    return package.model_registry("debugmodel")


def _checkpointing(mode: str) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[mode]


def _parallel_dims(parallelism: Any, world_size: int) -> Any:
    """torchtitan's ParallelDims and its meshes, made anew for each case: torchtitan's SPMD backends keep the meshes
    of the last parallelized model in module state, so a mesh reused by a second model is not the one its
    parameters were laid out on."""
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    return dims


register_settings(
    [TorchtitanRecipe(dp, tp, sp, ac, False, backend) for backend in BACKENDS for dp, tp in ((2, 1), (1, 2), (2, 2))
     for sp in ((True, False) if tp > 1 else (True,)) for ac in CHECKPOINTING]
    # torchtitan's default precision, where it applies (FSDP2's policy needs the data-parallel mesh)
    + [TorchtitanRecipe(dp, tp, True, "none", False, backend, "bfloat16") for backend in BACKENDS
       for dp, tp in ((2, 1), (2, 2))]
    + [CompiledTorchtitanRecipe(dp, tp, True, "selective") for dp, tp in ((2, 1), (1, 2), (2, 2))]
    # every schedule torchtitan configures by name, over 2 pipeline ranks; 1F1B under the other backends, with
    # checkpointing, and beside FSDP2 or tensor parallel
    + [TorchtitanPipelineRecipe(1, schedule=schedule) for schedule in PIPELINE_SCHEDULES]
    + [TorchtitanPipelineTrainedOnly(1, schedule=schedule) for schedule in ("ZBVZeroBubble", "DualPipeV")]
    + [TorchtitanPipelineRecipe(1, backend=backend) for backend in BACKENDS[1:]]
    + [TorchtitanPipelineRecipe(1, checkpointing="full"), TorchtitanPipelineRecipe(2)]
    + [TorchtitanPipelineRecipe(1, 2, backend=backend) for backend in BACKENDS]
    + [TorchtitanPipelineRecipe(1, 2, False)]
)
