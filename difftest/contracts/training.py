"""What every training setting records, and the helpers that record it (`record_training`).

Recorded names (phase/tensor):
  eval_before/<evaluation tensor>, train_step{i}/loss, param_after_step{i}/<canonical name>,
  state_after_step{i}/<parameter>.<state>, eval_after_step{k}/<evaluation tensor>
Each rank trains on its contiguous share of the same global batch; losses are per-rank means, so the global loss is
the mean over ranks (equal shares) and gradients follow the global-mean convention of the reference. A plugin's
setting that records these names is judged, triaged and minimised like a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from difftest.contracts.batch import Batch
from difftest.contracts.model import Inputs
from difftest.contracts.setting import Outputs, RunContext

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
    return tensor.to("cpu", copy=True).contiguous().numpy()  # type: ignore[no-any-return]


def loss_record(losses: list[float]) -> np.ndarray:
    """The global loss from each share's mean loss, kept in float64 (a float64 calibration run's stays exact)."""
    return np.array([np.mean(losses)], dtype=np.float64)


def record_training(
    ctx: RunContext,
    inputs: Inputs,
    evaluate: Callable[[Batch], dict[str, Any] | None] | None,
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
    accumulators) is judged on it, not only on the weights it moved. `evaluate` None: nothing evaluated, no
    `eval_*` phase recorded (a setting whose library cannot evaluate is still judged on its training; its `judges`
    leaves those phases out).
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
        if evaluate is None:
            return
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
