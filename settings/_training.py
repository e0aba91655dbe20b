"""What every training setting records, and how per-rank pieces become full tensors on rank 0.

Recorded names (phase/tensor):
  eval_before/{prediction,pooled.<feature>}, train_step{i}/loss, param_after_step{i}/<canonical name>, eval_after_step{k}/prediction
Each rank trains on its contiguous share of the same global batch; losses are per-rank means, so the global
loss is the mean over ranks (equal shares) and gradients follow the global-mean convention of the reference.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from difftest.artifacts import Inputs
from difftest.setting import Outputs, RunContext
from generators.inputs import Batch


def gather_to_rank0(ctx: RunContext, obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=ctx.group)
    return gathered


def to_numpy(tensor: Any) -> np.ndarray:
    return tensor.detach().to("cpu", copy=True).contiguous().numpy()


def assemble(shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], np.ndarray]], name: str) -> np.ndarray:
    """A full tensor from (offsets, block) pieces; every element must be covered exactly once."""
    full = np.zeros(shape, dtype=np.float32)
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


def record_training(
    ctx: RunContext,
    inputs: Inputs,
    evaluate: Callable[[Batch], dict[str, Any]],
    train_step: Callable[[Batch], Any],
    full_parameters: Callable[[], dict[str, np.ndarray] | None],
) -> Outputs | None:
    """Evaluate, train `ctx.steps` steps on this rank's share, evaluate again; full tensors on rank 0.

    `train_step` runs forward, backward and the optimizer step and returns the local mean loss;
    `full_parameters` is collective and returns every parameter under its canonical name on rank 0.
    """
    import torch

    train = inputs.train.shard(ctx.rank, ctx.world_size)
    eval_batch = inputs.eval.shard(ctx.rank, ctx.world_size)
    outputs: Outputs = {}

    def gathered_predictions(phase: str) -> None:
        with torch.no_grad():
            local = {name: to_numpy(t) for name, t in evaluate(eval_batch).items()}
        pieces = gather_to_rank0(ctx, local)
        if pieces is not None:
            for name in pieces[0]:
                outputs[f"{phase}/{name}"] = np.concatenate([p[name] for p in pieces])

    gathered_predictions("eval_before")
    for step in range(1, ctx.steps + 1):
        losses = gather_to_rank0(ctx, float(train_step(train)))
        params = full_parameters()
        if ctx.rank == 0:
            assert losses is not None and params is not None
            outputs[f"train_step{step}/loss"] = np.array([np.mean(losses)], dtype=np.float32)
            outputs.update({f"param_after_step{step}/{k}": v for k, v in params.items()})
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


def canonical_parameters(model: Any, module: Any) -> dict[str, np.ndarray]:
    return {name: to_numpy(tensor) for name, tensor in model.parameters(module).items()}


def train_single_process(ctx: RunContext, model: Any, inputs: Inputs, module: Any) -> Outputs | None:
    """Plain SGD on the global batch in this one process: what the references do."""
    import torch

    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr)
    return record_training(
        ctx, inputs, lambda b: model.evaluate(module, b, ctx.device),
        lambda b: sgd_step(model, module, optimizer, b, ctx.device),
        lambda: canonical_parameters(model, module),
    )
