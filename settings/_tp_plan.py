"""A tensor-parallel setting's plan where a model kind has none of its own: which consecutive Linear layers pair
column-wise then row-wise (each pair's layers fed only through each other), and on which dimension a sequence-parallel
pair's output holds the positions; a kind's own plan described for its script (`own_plan`)."""

from __future__ import annotations

from typing import Any

from difftest import StandaloneCase, Unsupported


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
