"""Tensor parallelism with DTensor `parallelize_module`: Megatron-style column-wise then row-wise sharding
of consecutive Linear layers, every rank on the whole batch.

The column-wise layer's output stays a DTensor (sharded on the feature dim), so whatever runs between the
pair (an activation, a reshape) runs under DTensor's own sharding rules rather than on a bare local shard;
the row-wise layer all-reduces back to a replicated tensor. The sequence-parallel variant ends a pair with
a reduce-scatter onto the positions instead, runs what follows on position shards, and the next column-wise
layer all-gathers them. It applies where a row-wise layer outputs a (batch, seq, feature) tensor (`Shard(1)`)
or a (batch·seq, feature) one (`Shard(0)`): tf2onnx lowers a Keras Dense over a sequence to
reshape → MatMul → reshape, so a converted graph's Linear sees every position of every sample as a row.

A model kind that ships its own plan (a transformer: `LoadedModel.tp_plan`) runs that one instead, as its authors
apply it (torchtitan's Llama plan). Loss parallel keeps the logits sharded over the vocabulary into a cross-entropy
computed under `loss_parallel()`; it applies to those plans only (a derived plan has no vocabulary projection).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    SHARDED,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    record_training,
    refuse_changed_hooks,
    register_settings,
)
from settings._tp_apply import (
    backward_on_share,
    distribute,
    keep_dtensor_activations,
    parallel_style,
    stepping,
    whole_outputs_and_gradients,
)
from settings._tp_plan import _describe, _feeding, _position_dims, linear_pairs, own_plan
from settings._training import Training, build_for_training, device_mesh, full_parameters, gathered_parameters

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# DTensor's refusals by design, by their words: a view that would split a sharded dimension where the shards do not
# fall ("Cannot unflatten unevenly sharded tensor: … Please redistribute the tensor before this operation.",
# pytorch#149764 and #161950), a view that would remove or reshape a sharded dimension (`view` never redistributes:
# "… which requires redistribution. Please redistribute the input first."), and a tensor's values read into Python,
# which no tensor subclass supports (".tolist() is not supported for tensor subclasses": a converted graph's padding)
REFUSED_BY_DESIGN = ("Please redistribute the tensor before this operation", "Please redistribute the input first",
                     ".tolist() is not supported for tensor subclasses")


@contextlib.contextmanager
def views_refused_by_design(under: str) -> Iterator[None]:
    """DTensor's refusals by design (`REFUSED_BY_DESIGN`: a view of a sharded activation that would need its shards
    moved, or a subclass's values read into Python) become `unsupported` in DTensor's words; `under`: what sharded the
    activation."""
    try:
        yield
    except RuntimeError as exc:
        lines = str(exc).splitlines() or [""]
        refusal = next((line for line in lines if any(words in line for words in REFUSED_BY_DESIGN)), None)
        if refusal is None:
            raise
        # the refusal's own line, after the first where it is not the first (Dynamo's "when making fake tensor call")
        said = lines[0] if refusal == lines[0] else f"{lines[0]} … {refusal.strip()}"
        raise Unsupported(f"DTensor refuses, by design, an operation on a sharded activation {under}: {said}") from None


@dataclass(frozen=True)
class TensorParallel(Setting):
    """DTensor tensor parallelism: ColwiseParallel then RowwiseParallel on consecutive Linear layers."""

    world_size: int
    sequence_parallel: bool = False
    loss_parallel: bool = False
    dtensor_activations: bool = False  # a kind's own plan with every column-wise output kept a DTensor
    family: ClassVar[str] = "tp"
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel",)

    @property
    def name(self) -> str:
        loss = "/loss-parallel" if self.loss_parallel else ""
        dtensors = "/dtensor-activations" if self.dtensor_activations else ""
        return (f"tp/{'sequence-parallel' if self.sequence_parallel else 'colwise-rowwise'}{loss}{dtensors}"
                f"/ws{self.world_size}")

    def describe(self) -> str:
        detail = ", row-wise outputs reduce-scattered onto the sequence dim" if self.sequence_parallel else ""
        detail += ", cross-entropy on vocabulary-sharded logits" if self.loss_parallel else ""
        detail += ", the column-wise outputs kept DTensors" if self.dtensor_activations else ""
        return f"tensor parallel over {self.world_size} ranks{detail}"

    def plan(self, model: Any, module: Any, inputs: Any, device: str) -> dict[str, Any]:
        """Module name → ParallelStyle over this setting's `world_size` tensor-parallel ranks."""
        own = model.tp_plan(module, self.world_size, self.sequence_parallel, self.loss_parallel)
        if own is not None:
            return keep_dtensor_activations(own) if self.dtensor_activations else own
        if self.dtensor_activations:
            raise Unsupported("a plan difftest derives keeps every column-wise output a DTensor already; this variant "
                              "runs a kind's own plan (a transformer's) with its column-wise outputs kept DTensors")
        return {name: self.style(spec) for name, spec in self.derived_plan(model, module, inputs, device).items()}

    def style(self, spec: dict[str, Any]) -> Any:
        """The ParallelStyle of a derived plan's spec (a hook for planted faults)."""
        return parallel_style(spec)

    def derived_plan(self, model: Any, module: Any, inputs: Any, device: str) -> dict[str, dict[str, Any]]:
        """The plan of a kind without its own, as data (module name → `parallel_style`'s spec): column-wise then
        row-wise on every pair of Linear layers one feeds the other alone."""
        if self.loss_parallel:
            raise Unsupported(f"loss parallel needs a plan that shards the output projection over the vocabulary; "
                              f"{model.spec.kind} models have no such plan")
        pairs = _feeding(model, module, inputs, linear_pairs(module), device)
        if not pairs:
            raise Unsupported("no two consecutive nn.Linear layers to shard column-wise then row-wise")
        position_dims = _position_dims(model, module, inputs, [row for _, row in pairs], device)
        if self.sequence_parallel and not position_dims:
            raise Unsupported("no row-wise Linear outputs a (batch, seq, feature) or (batch·seq, feature) tensor "
                              "to shard on positions")
        plan: dict[str, dict[str, Any]] = {}
        for column, row in pairs:
            plan[column] = {"style": "colwise"}
            plan[row] = {"style": "rowwise",
                         "shard_dim": position_dims.get(row) if self.sequence_parallel else None}
        return plan

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, SHARDED | {"all_reduce"})

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return self.trained(ctx, model, inputs)

    def trained(self, ctx: RunContext, model: Any, inputs: Any, before_step: Callable[[Any], None] | None = None,
                training: Training | None = None) -> Outputs | None:
        """The model parallelized and trained as this setting does; `before_step(module)` runs between each step's
        backward and its optimizer step (a composing setting's gradient clipping); `training`: a composing setting's
        optimizer in place of plain SGD, its state recorded too."""
        module = build_for_training(model, ctx.device)
        self.parallelize(ctx, model, module, inputs, device_mesh(ctx, name="tp"))
        return self.train(ctx, model, inputs, module, data_shard=(0, 1), before_step=before_step, training=training)

    def parallelize(self, ctx: RunContext, model: Any, module: Any, inputs: Any, mesh: Any) -> None:
        """Apply this setting's plan over the 1-D tensor-parallel `mesh`, in place."""
        from torch.distributed.tensor.parallel import parallelize_module

        plan = self.plan(model, module, inputs, ctx.device)
        parallelize_module(module, mesh, plan)
        ctx.notes["plan"] = ", ".join(f"{name}: {_describe(style)}" for name, style in plan.items())

    def train(self, ctx: RunContext, model: Any, inputs: Any, module: Any, data_shard: tuple[int, int],
              outputs_whole: bool = False, before_step: Callable[[Any], None] | None = None,
              training: Training | None = None) -> Outputs | None:
        """Plain SGD on the share `data_shard` of the batch through a parallelized module (ranks of one
        tensor-parallel group share a data share); `outputs_whole`: the module already hands back whole outputs and
        gradients (`whole_outputs_and_gradients`, registered by a `distribute`); `before_step` and `training` as
        `trained` says."""
        import contextlib

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        # a sharded tensor may reach the model's output: hand back the whole tensor, except to a loss-parallel loss
        in_step = [False]
        if not outputs_whole:
            whole_outputs_and_gradients(module, keep_sharded=lambda: in_step[0] and self.loss_parallel)
        training = training or Training()
        optimizer = training.optimizer(module, ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            in_step[0] = True
            try:
                with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                    loss = model.loss(model.forward(module, batch, ctx.device), batch)
                    loss.backward()
            finally:
                in_step[0] = False
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            if before_step is not None:
                before_step(module)
            optimizer.step()
            return loss.item()

        with views_refused_by_design("under this plan"), stepping(module):
            return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step,
                                   lambda: gathered_parameters(ctx, model, module), data_shard=data_shard,
                                   optimizer_state=training.state_reader(ctx, model, module, optimizer))

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, TensorParallel, "style", "trained")

        from settings._training_script import training_script

        return training_script(case, *self.script_parts(case))

    def script_parts(self, case: StandaloneCase) -> tuple[str, int, tuple[Any, ...], dict[str, Any]]:
        """What `training_script` takes for this setting: the summary, the world size, the functions copied and the
        layout `distribute` reads."""
        from difftest import Inputs, LoadedModel

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        module = model.build("cpu")
        own, fields = own_plan(case, model, module, self.world_size, self.sequence_parallel, self.loss_parallel)
        plan = {} if own else self.derived_plan(model, module, Inputs(case.inputs["train"], case.inputs["eval"]), "cpu")
        described = own or ", ".join(f"{name}: {_describe(parallel_style(spec))}" for name, spec in plan.items())
        if self.loss_parallel:
            described += "; the cross-entropy on the vocabulary-sharded logits under loss_parallel()"
        return (f"Tensor parallel (parallelize_module; {described})", self.world_size,
                (parallel_style, keep_dtensor_activations, whole_outputs_and_gradients, stepping, distribute,
                 full_parameters, *((backward_on_share,) if self.loss_parallel else ())),
                {"plan": plan, "data_parallel": 1, "loss_parallel": self.loss_parallel,
                 "dtensor_activations": self.dtensor_activations, **fields})


@dataclass(frozen=True)
class LossParallel(TensorParallel):
    """Tensor parallel whose logits stay sharded over the vocabulary into the cross-entropy (`loss_parallel()`).

    A class of its own, so the default tier runs it beside plain tensor parallel instead of in its place: it applies
    to transformers with untied embeddings only."""

    loss_parallel: bool = True


@dataclass(frozen=True)
class DTensorActivations(TensorParallel):
    """A kind's own tensor-parallel plan with every column-wise output kept a DTensor (`use_local_output=False`).

    A class of its own, so the default tier runs it beside the plan as its authors apply it: it exercises DTensor's
    sharding rules on whatever runs between the layers (views, slices, concatenation, attention), on uneven shards
    too."""

    dtensor_activations: bool = True


register_settings(cls(ws, sp) for cls in (TensorParallel, LossParallel) for sp in (False, True) for ws in (2, 4))
register_settings(DTensorActivations(ws) for ws in (2, 4))
