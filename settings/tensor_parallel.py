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

# ruff: noqa: F821 -- `distribute` and `backward_on_share` call a kind's own `model_tp_plan` and `model_loss`, which a
# standalone script of its model defines

from __future__ import annotations

from collections.abc import Callable
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
from settings._training import build_for_training, device_mesh, full_parameters, gathered_parameters

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# a kind's own plan, which a standalone script of its model defines (declared here so that this module checks on its own)
model_tp_plan: Callable[..., dict[str, Any]]
model_loss: Callable[..., Any]


def linear_pairs(module: Any) -> list[tuple[str, str]]:
    """(column-wise, row-wise) qualified names of Linear layers: consecutive linear children of one parent, paired
    greedily. A child is linear if it is an nn.Linear, or, in a Sequential/ModuleList (whose children run one after
    the other), holds exactly one nn.Linear and no other parameter (TorchRec's Perceptron: a Linear then its
    activation), which then stands for that Linear."""
    import torch

    def linear_of(name: str, child: Any, in_sequence: bool) -> str | None:
        if type(child) is torch.nn.Linear:
            return name
        if not in_sequence:
            return None
        inner = [(n, m) for n, m in child.named_modules() if type(m) is torch.nn.Linear]
        if len(inner) == 1 and sum(1 for _ in child.parameters()) == sum(1 for _ in inner[0][1].parameters()):
            return f"{name}.{inner[0][0]}"
        return None

    pairs = []
    for parent_name, parent in module.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        in_sequence = isinstance(parent, (torch.nn.Sequential, torch.nn.ModuleList))
        linears = [found for name, child in parent.named_children() if (found := linear_of(name, child, in_sequence))]
        pairs += [(prefix + linears[i], prefix + linears[i + 1]) for i in range(0, len(linears) - 1, 2)]
    return pairs


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
        module = build_for_training(model, ctx.device)
        self.parallelize(ctx, model, module, inputs, device_mesh(ctx, name="tp"))
        return self.train(ctx, model, inputs, module, data_shard=(0, 1))

    def parallelize(self, ctx: RunContext, model: Any, module: Any, inputs: Any, mesh: Any) -> None:
        """Apply this setting's plan over the 1-D tensor-parallel `mesh`, in place."""
        from torch.distributed.tensor.parallel import parallelize_module

        plan = self.plan(model, module, inputs, ctx.device)
        parallelize_module(module, mesh, plan)
        ctx.notes["plan"] = ", ".join(f"{name}: {_describe(style)}" for name, style in plan.items())

    def train(self, ctx: RunContext, model: Any, inputs: Any, module: Any, data_shard: tuple[int, int],
              outputs_whole: bool = False) -> Outputs | None:
        """Plain SGD on the share `data_shard` of the batch through a parallelized module (ranks of one
        tensor-parallel group share a data share); `outputs_whole`: the module already hands back whole outputs and
        gradients (`whole_outputs_and_gradients`, registered by a `distribute`)."""
        import contextlib

        import torch
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        # a sharded tensor may reach the model's output: hand back the whole tensor, except to a loss-parallel loss
        training = [False]
        if not outputs_whole:
            whole_outputs_and_gradients(module, keep_sharded=lambda: training[0] and self.loss_parallel)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            training[0] = True
            try:
                with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                    loss = model.loss(model.forward(module, batch, ctx.device), batch)
                    loss.backward()
            finally:
                training[0] = False
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            optimizer.step()
            return loss.item()

        with stepping(module):
            return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step,
                                   lambda: gathered_parameters(ctx, model, module), data_shard=data_shard)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, TensorParallel, "style")

        from difftest import Inputs, LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        module = model.build("cpu")
        own, fields = own_plan(case, model, module, self.world_size, self.sequence_parallel, self.loss_parallel)
        plan = {} if own else self.derived_plan(model, module, Inputs(case.inputs["train"], case.inputs["eval"]), "cpu")
        described = own or ", ".join(f"{name}: {_describe(parallel_style(spec))}" for name, spec in plan.items())
        if self.loss_parallel:
            described += "; the cross-entropy on the vocabulary-sharded logits under loss_parallel()"
        return training_script(case, f"Tensor parallel (parallelize_module; {described})", self.world_size,
                               (parallel_style, keep_dtensor_activations, whole_outputs_and_gradients, stepping,
                                distribute, full_parameters, *((backward_on_share,) if self.loss_parallel else ())),
                               {"plan": plan, "data_parallel": 1, "loss_parallel": self.loss_parallel,
                                "dtensor_activations": self.dtensor_activations, **fields})


def own_plan(case: StandaloneCase, model: Any, module: Any, world_size: int, sequence_parallel: bool,
             loss_parallel: bool) -> tuple[str, dict[str, Any]]:
    """How a script describes the plan of a kind that ships its own (`model_tp_plan`, copied from the kind's module with
    its model), and the setting's field `distribute` calls it with; "" and none where the kind has no plan of its own
    (the script derives it as the setting does)."""
    if (plan := model.tp_plan(module, world_size, sequence_parallel, loss_parallel)) is None:
        return "", {}
    code = case.generator.standalone_model(case.spec, case.init_state, case.model_dir, case.inputs["train"])
    if code is None or "model_tp_plan" not in {f.__name__ for f in code.functions}:
        raise Unsupported(f"{case.spec.kind} models run their own tensor-parallel plan, and their standalone form has "
                          "no model_tp_plan")
    return (f"the model's own plan, model_tp_plan, over {len(plan)} modules",
            {"own_plan": [world_size, sequence_parallel, loss_parallel]})


def parallel_style(spec: dict[str, Any]) -> Any:
    """ColwiseParallel keeping its output a DTensor, or RowwiseParallel: all-reduced to a replicated plain tensor, or
    with `shard_dim` (sequence parallel) reduce-scattered onto the positions, kept a DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if spec["style"] == "colwise":
        return ColwiseParallel(use_local_output=False)
    if spec["shard_dim"] is not None:
        return RowwiseParallel(output_layouts=Shard(spec["shard_dim"]), use_local_output=False)
    return RowwiseParallel(output_layouts=Replicate(), use_local_output=True)


def keep_dtensor_activations(plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with every ColwiseParallel's output kept a DTensor (`use_local_output=False`): what runs between a
    column-wise and a row-wise layer (attention's views, rotary slices and concatenation, head repetition, the
    attention itself, a gated activation) runs on DTensors under DTensor's sharding rules, uneven shards included,
    and the row-wise layer takes the DTensor as it is. The remedy pytorch#150336 proposes for uneven widths."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for style in plan.values():
        if isinstance(style, ColwiseParallel):
            style.use_local_output = False
    return plan


def whole_outputs_and_gradients(module: Any, keep_sharded: Any = lambda: False) -> None:
    """A sharded tensor reaching the model's output is handed back whole (unless `keep_sharded()`: to a loss-parallel
    loss), and a parameter outside the plan that met a DTensor activation gets its gradient whole, not a replicated
    DTensor an optimizer cannot add to it."""
    from torch.distributed.tensor import DTensor

    def whole_gradient(parameter: Any) -> None:
        if isinstance(parameter.grad, DTensor):
            parameter.grad = parameter.grad.full_tensor()

    module.register_forward_hook(lambda _m, _a, out: out.full_tensor()
                                 if isinstance(out, DTensor) and not keep_sharded() else out)
    for parameter in module.parameters():
        if parameter.requires_grad and not isinstance(parameter, DTensor):
            parameter.register_post_accumulate_grad_hook(whole_gradient)


def stepping(module: Any) -> Any:
    """Plain constants in a converted graph meet DTensor activations: replicated implicitly while the model steps."""
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """Tensor parallel over `group` with the plan (module name → `parallel_style`'s spec), as the setting applies it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("tp",))
    own = model_tp_plan(module, *setting["own_plan"]) if "own_plan" in setting else None
    if own is not None and setting.get("dtensor_activations"):
        own = keep_dtensor_activations(own)
    parallelize_module(module, mesh, own if own is not None else
                       {name: parallel_style(spec) for name, spec in setting["plan"].items()})
    # a script only trains: a loss-parallel model hands its loss the logits sharded, as the setting's training does
    whole_outputs_and_gradients(module, keep_sharded=lambda: setting.get("loss_parallel", False))
    return module


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """Loss parallel's gradients of training samples start..stop: the cross-entropy on the vocabulary-sharded logits
    under `loss_parallel()`, inside `stepping` as every tensor-parallel step."""
    from torch.distributed.tensor.parallel import loss_parallel

    with stepping(module), loss_parallel():
        model_loss(module, data, start, stop, dtype).backward()


def _describe(style: Any) -> str:
    from torch.distributed.tensor.parallel import RowwiseParallel

    if isinstance(style, RowwiseParallel):
        return f"RowwiseParallel(output {style.output_layouts[0]})"
    return type(style).__name__


def _feeding(model: Any, module: Any, inputs: Any, pairs: list[tuple[str, str]], device: str) -> list[tuple[str, str]]:
    """The pairs whose row-wise layer reads what is computed from the column-wise layer's output alone, which nothing
    else reads: consecutive children need not be consecutive in the data flow (a DAG's branches), a row-wise layer
    fed a plain tensor would treat the whole of it as its shard, and a sharded activation that escapes the pair (a
    residual around it) would meet the row-wise layer's plain output. Found by one probe forward in which each
    column-wise output is replaced by a marker leaf; the autograd graph then shows what each row-wise input is made of
    and who reads each step between."""
    import torch

    submodules = dict(module.named_modules())
    markers: dict[str, Any] = {}
    reads: dict[str, Any] = {}

    def mark(name: str) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> Any:
            markers[name] = out.detach().requires_grad_(True)
            return markers[name]
        return hook

    handles = [submodules[column].register_forward_hook(mark(column)) for column, _ in pairs]
    handles += [submodules[row].register_forward_pre_hook(lambda _m, args, row=row: reads.update({row: args[0]}))
                for _, row in pairs]
    try:
        with torch.enable_grad():
            output = model.forward(module, inputs.eval, device)
    finally:
        for handle in handles:
            handle.remove()
    # the analysis keys autograd nodes by id(): every node's Python object is held until it is done, or a node whose
    # object was freed comes back as a new object with another id (torch 2.6-2.8 do not keep them: no pair was found)
    alive: list[Any] = []
    readers = _readers(output.grad_fn, alive)
    return [(column, row) for column, row in pairs
            if column in markers and row in reads and _closed_path(reads[row], markers[column], readers)]


def _readers(root: Any, alive: list[Any]) -> dict[int, set[int]]:
    """Autograd node → the nodes that read its output, over the graph that computed the model's output; every node
    is appended to `alive`, which the caller holds while it uses the ids."""
    readers: dict[int, set[int]] = {}  # keyed by id of node (and of each leaf tensor)
    pending, seen = [root], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        for source, _ in node.next_functions:
            if source is not None:
                readers.setdefault(id(source), set()).add(id(node))
                if type(source).__name__ == "AccumulateGrad":  # a leaf: also keyed by the tensor itself
                    readers.setdefault(id(source.variable), set()).add(id(node))
                pending.append(source)
    return readers


def _closed_path(tensor: Any, marker: Any, readers: dict[int, set[int]]) -> bool:
    """Whether `tensor` is computed from the leaf `marker` and parameters only, by steps nothing else reads (the
    row-wise layer reads `tensor` in one step of its own)."""
    import torch

    if tensor is marker:
        return len(readers.get(id(marker), ())) <= 1
    top = tensor.grad_fn
    if len(readers.get(id(top), ())) > 1:
        return False  # what the row-wise layer reads is read elsewhere too (a residual around the layer)
    steps, leaves, pending = {}, set(), [top]
    while pending:
        node = pending.pop()
        if node is None or id(node) in steps:
            continue
        steps[id(node)] = node
        for source, _ in node.next_functions:
            if source is None:
                continue
            if type(source).__name__ == "AccumulateGrad":
                if not isinstance(source.variable, torch.nn.Parameter):
                    leaves.add(id(source.variable))
                    steps[id(source)] = source
            else:
                pending.append(source)
    if leaves != {id(marker)}:
        return False  # it reads another branch (or a plain tensor), not only the column-wise output
    inside = set(steps) | {id(top)}
    return all(readers.get(n, set()) <= inside for n in steps if n != id(top))


def _position_dims(model: Any, module: Any, inputs: Any, names: list[str], device: str) -> dict[str, int]:
    """The dim holding positions in each named layer's output: 1 for (batch, seq, feature); 0 for a
    (batch·seq, feature) output of a layer applied position-wise (more rows than the model has samples)."""
    import torch

    rows: dict[str, tuple[int, ...]] = {}
    submodules = dict(module.named_modules())
    handles = [submodules[n].register_forward_hook(lambda _m, _a, out, n=n: rows.update({n: tuple(out.shape)}))
               for n in names]
    try:
        with torch.no_grad():
            samples = len(model.forward(module, inputs.eval, device))
    finally:
        for handle in handles:
            handle.remove()
    dims = {n: 1 for n, shape in rows.items() if len(shape) == 3}
    dims.update({n: 0 for n, shape in rows.items()
                 if len(shape) == 2 and shape[0] > samples and shape[0] % samples == 0})
    return dims


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
