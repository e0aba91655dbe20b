"""What every training setting records, and how per-rank pieces become full tensors on rank 0.

Recorded names (phase/tensor):
  eval_before/{prediction,pooled.<feature>}, train_step{i}/loss, param_after_step{i}/<canonical name>, eval_after_step{k}/prediction
Each rank trains on its contiguous share of the same global batch; losses are per-rank means, so the global
loss is the mean over ranks (equal shares) and gradients follow the global-mean convention of the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from difftest.artifacts import Inputs
from difftest.setting import Outputs, RunContext
from generators.inputs import Batch

# the first phase every training setting records: the evaluation before any step
EVAL_BEFORE = "eval_before"


def gather_to_rank0(ctx: RunContext, obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=ctx.group)
    return gathered


def to_numpy(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; widening to float32 is exact
        tensor = tensor.float()
    return tensor.to("cpu", copy=True).contiguous().numpy()


def assemble(shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], np.ndarray]], name: str) -> np.ndarray:
    """A full tensor from (offsets, block) pieces; every element must be covered exactly once."""
    full = np.zeros(shape, dtype=pieces[0][1].dtype if pieces else np.float32)
    covered = np.zeros(shape, dtype=np.int32)
    for offsets, block in pieces:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape))
        full[index] = block
        covered[index] += 1
    if not np.all(covered == 1):
        raise RuntimeError(
            f"shards of {name} do not tile it: {int((covered == 0).sum())} elements missing, "
            f"{int((covered > 1).sum())} covered twice"
        )
    return full


def loss_record(losses: list[float]) -> np.ndarray:
    """The global loss from each share's mean loss, kept in float64 (a float64 calibration run's stays exact)."""
    return np.array([np.mean(losses)], dtype=np.float64)


def record_training(
    ctx: RunContext,
    inputs: Inputs,
    evaluate: Callable[[Batch], dict[str, Any] | None],
    train_step: Callable[[Batch], Any],
    full_parameters: Callable[[], dict[str, np.ndarray] | None],
    data_shard: tuple[int, int] | None = None,
    optimizer_state: Callable[[], dict[str, np.ndarray] | None] | None = None,
) -> Outputs | None:
    """Evaluate, train `ctx.steps` steps on this rank's share, evaluate again; full tensors on rank 0.

    `data_shard` = (index, count): which contiguous share of the global batch this rank trains on. It is
    (rank, world size) for pure data parallelism; ranks that split one model (tensor or pipeline parallel)
    share an index. `evaluate` and `train_step` may return None on ranks that hold no output (a pipeline's
    inner stages); rank 0 keeps one answer per share. `train_step` runs forward, backward and the optimizer
    step and returns the share's mean loss; `full_parameters` is collective and returns every parameter
    under its canonical name on rank 0. `optimizer_state`, where given, is collective too and returns the optimizer's
    state after each step (`state_after_step<i>/<parameter>.<state>`): an optimizer that keeps state (Adagrad's
    accumulators) is judged on it, not only on the weights it moved.
    """
    import torch

    index, count = data_shard or (ctx.rank, ctx.world_size)
    train = inputs.train.shard(index, count)
    eval_batch = inputs.eval.shard(index, count)
    outputs: Outputs = {}

    def one_per_share(value: Any) -> list[Any] | None:
        pieces = gather_to_rank0(ctx, (index, value))
        if pieces is None:
            return None
        by_share = {i: v for i, v in reversed(pieces) if v is not None}
        if sorted(by_share) != list(range(count)):
            raise RuntimeError(f"no rank answered for data shares {sorted(set(range(count)) - set(by_share))}")
        return [by_share[i] for i in range(count)]

    def gathered_predictions(phase: str) -> None:
        with torch.no_grad():
            evaluated = evaluate(eval_batch)
        local = None if evaluated is None else {name: to_numpy(t) for name, t in evaluated.items()}
        pieces = one_per_share(local)
        if pieces is not None:
            for name in pieces[0]:
                outputs[f"{phase}/{name}"] = np.concatenate([p[name] for p in pieces])

    gathered_predictions(EVAL_BEFORE)
    for step in range(1, ctx.steps + 1):
        loss = train_step(train)
        losses = one_per_share(None if loss is None else float(loss))
        params = full_parameters()
        state = optimizer_state() if optimizer_state is not None else {}
        if ctx.rank == 0:
            assert losses is not None and params is not None and state is not None
            outputs[f"train_step{step}/loss"] = loss_record(losses)
            outputs.update({f"param_after_step{step}/{k}": v for k, v in params.items()})
            outputs.update({f"state_after_step{step}/{k}": v for k, v in state.items()})
    gathered_predictions(f"eval_after_step{ctx.steps}")
    return outputs if ctx.rank == 0 else None


def build_for_training(model: Any, device: str, **options: Any) -> Any:
    """The model's PyTorch module; a model without one (its conversion failed) cannot run this setting."""
    from difftest.errors import ConversionFailed, Unsupported

    try:
        return model.build(device, **options)
    except ConversionFailed as exc:  # the conversion settings report it as an error
        raise Unsupported(f"no PyTorch form: {exc}") from None


def sgd_step(model: Any, module: Any, optimizer: Any, batch: Batch, device: str) -> float:
    """One plain SGD step on `batch`: forward, mean loss, backward, update; returns the loss."""
    optimizer.zero_grad()
    loss = model.loss(model.forward(module, batch, device), batch)
    loss.backward()
    optimizer.step()
    return loss.item()


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """Every tensor `read(wrapped)` names, whole: a DTensor (FSDP2, tensor parallel) all-gathered, so every rank must
    call it. A standalone script of a setting whose parameters are whole or DTensors copies this one."""
    from torch.distributed.tensor import DTensor

    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in read(wrapped).items()}


def canonical_parameters(model: Any, module: Any) -> dict[str, np.ndarray]:
    """Every parameter under its canonical name, whole (collective for DTensors: every rank must call it)."""
    return {name: to_numpy(tensor) for name, tensor in full_parameters(module, model.parameters).items()}


def gathered_parameters(ctx: RunContext, model: Any, module: Any) -> dict[str, np.ndarray] | None:
    """`canonical_parameters` on every rank (DTensors gather collectively), kept on rank 0."""
    full = canonical_parameters(model, module)
    return full if ctx.rank == 0 else None


def train_single_process(ctx: RunContext, model: Any, inputs: Inputs, module: Any) -> Outputs | None:
    """Plain SGD on the global batch in this one process: what the references do."""
    import torch

    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr)
    return record_training(
        ctx, inputs, lambda b: model.evaluate(module, b, ctx.device),
        lambda b: sgd_step(model, module, optimizer, b, ctx.device),
        lambda: canonical_parameters(model, module),
    )


def train_data_parallel(ctx: RunContext, model: Any, inputs: Inputs, wrapped: Any,
                        full_parameters: Callable[[], dict[str, np.ndarray] | None],
                        data_shard: tuple[int, int] | None = None) -> Outputs | None:
    """Plain SGD on this rank's share through a wrapper that synchronises gradients itself."""
    import torch

    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=ctx.lr)
    return record_training(
        ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device),
        lambda b: sgd_step(model, wrapped, optimizer, b, ctx.device), full_parameters, data_shard,
    )


def device_mesh(ctx: RunContext, group: Any = None, name: str = "dp") -> Any:
    """A 1-D DeviceMesh over `group` (default: the case's group), reusing it instead of creating new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else ctx.group, device_type=ctx.device.split(":")[0],
                                 mesh_dim_names=(name,))


def parameter_holders(module: Any) -> list[tuple[str, Any]]:
    """(qualified name, submodule) of every submodule that itself holds a parameter, in module order. A ParameterList
    or ParameterDict is indexed, never called (TorchRec's cross net reads its kernels so): its parameters count as its
    parent's, since a wrapper that hooks a module's forward (FSDP2's unit) would never see it run."""
    from torch import nn

    holders = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ParameterList, nn.ParameterDict)):
            continue
        owned = any(True for _ in m.parameters(recurse=False)) or any(
            isinstance(child, (nn.ParameterList, nn.ParameterDict)) for child in m.children())
        if name and owned:
            holders.append((name, m))
    return holders

