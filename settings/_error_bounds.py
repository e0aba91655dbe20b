"""How far a quantized model may legitimately be from its float reference, derived from the quantization scheme.

Two kinds of bound, both computed from the *float* model and the scheme's own rounding rules, never from the
quantized library's output (a kernel with a wrong scale would otherwise widen its own bound):

* exact per-element bounds where the arithmetic is a sum: a pooled embedding bag is off by at most
  sum_i |w_i| * delta(row_i) (divided by the bag length for MEAN), delta being the per-element rounding error
  of the table's scheme (row-wise N-bit: half a step plus the fp16 rounding of scale and bias; fp16: 2^-11 |x|);
* first-order worst-case bounds through everything else: |y_i - y~_i| <= sum_s |dy_i/ds| * delta_s over every
  place s where the quantized model rounds (a weight, an activation, an op's output), with every rounding error
  taken at its maximum and with the sign that hurts. The terms left out are products of two rounding errors.

Per-sample sensitivities come from one backward pass per output column: the models are evaluated in inference
form, where samples do not interact, so the gradient of a column's sum w.r.t. sample n's tensors is sample n's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

FP16_UNIT = 2.0**-11  # unit roundoff of IEEE half
FP16_SUBNORMAL = 2.0**-25  # half its smallest subnormal: the absolute floor of fp16 rounding
BF16_UNIT = 2.0**-8
FP32_UNIT = 2.0**-24


def fp16_rounding(x: np.ndarray) -> np.ndarray:
    """Bound on |fp16(x) - x|, element-wise."""
    return np.abs(x) * FP16_UNIT + FP16_SUBNORMAL


def rowwise_nbit_rounding(table: np.ndarray, bits: int) -> np.ndarray:
    """Bound on the error of fbgemm's row-wise N-bit quantization (fp16 scale and bias), element-wise.

    Each row is stored as q * scale + bias with bias = fp16(min), scale = fp16((max - min) / (2^bits - 1)),
    q = clamp(round((x - bias) / scale), 0, 2^bits - 1): half a step of rounding, plus what the fp16 rounding of
    bias and scale can push past either end of the row (clamped), plus the fp32 arithmetic of dequantizing.
    """
    x = table.astype(np.float64)
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    bias = low.astype(np.float16).astype(np.float64)
    levels = 2**bits - 1
    scale = ((high - low) / levels).astype(np.float16).astype(np.float64)
    scale = np.where(scale == 0, 1.0, scale)  # a constant row: fbgemm stores scale 1 and q = 0
    # fbgemm may derive the scale from the rounded bias: allow it one fp16 step either way
    below = np.maximum(bias - low, 0.0)
    above = np.maximum(high - (bias + levels * scale * (1 - 2 * FP16_UNIT)), 0.0)
    step = np.where(high > low, scale * (1 + 2 * FP16_UNIT) / 2, 0.0)
    per_row = step + below + above + np.abs(x).max(axis=1, keepdims=True) * 4 * FP32_UNIT
    return np.broadcast_to(per_row + np.abs(x - bias) * (high == low), x.shape).astype(np.float64)


def pooled_bound(
    feature: Any, element_error: np.ndarray, table: np.ndarray, pooling: str, batch_size: int
) -> np.ndarray:
    """Bound on each sample's pooled bag, given the per-element error bound of its table's rows."""
    weights = np.ones(len(feature.values)) if feature.weights is None else np.abs(feature.weights.astype(np.float64))
    offsets = np.concatenate([[0], np.cumsum(feature.lengths)])
    bound = np.zeros((batch_size, table.shape[1]))
    magnitude = np.abs(table.astype(np.float64))
    for n in range(batch_size):
        lo, hi = offsets[n], offsets[n + 1]
        if hi == lo:
            continue
        rows, w = feature.values[lo:hi], weights[lo:hi, None]
        # fp32 accumulation of the bag and the float reference's own sum, each within (length + 2) units
        accumulation = (hi - lo + 2) * FP32_UNIT * 2 * (w * magnitude[rows]).sum(axis=0)
        total = (w * element_error[rows]).sum(axis=0) + accumulation
        bound[n] = total / (hi - lo) if pooling == "MEAN" else total
    return bound


def output_rounding(values: np.ndarray, unit: float) -> np.ndarray:
    """Bound added when a result is stored in a narrower type (values: the float result, bound excluded)."""
    return np.abs(values.astype(np.float64)) * unit + (FP16_SUBNORMAL if unit == FP16_UNIT else 0.0)


# --- first-order propagation (torch) -----------------------------------------------------------------------
Rule = Callable[[Any, Any, Any], "tuple[Any | None, Any | None]"]


class Perturbations:
    """Where a model rounds, found by hooks: for each hooked module, a zero tensor added to its input and one to
    its output (so gradients reach them without cutting the graph), with the error bound of each."""

    def __init__(self) -> None:
        self.sources: list[tuple[Any, Any]] = []  # (zero leaf in the graph, its error bound as a tensor)

    @contextlib.contextmanager
    def hooked(self, modules: list[Any], rule: Rule) -> Iterator[Perturbations]:
        """`rule(module, input, output) -> (input_bound | None, output_bound | None)` for each module."""
        import torch

        pending: dict[int, tuple[Any, Any]] = {}

        def before(module: Any, args: tuple) -> tuple | None:
            x = args[0] if args else None
            if not (torch.is_tensor(x) and torch.is_floating_point(x)):  # ids, lengths: nothing rounds there
                pending[id(module)] = (None, None)
                return None
            zero = torch.zeros_like(x, requires_grad=True)
            pending[id(module)] = (x.detach(), zero)
            return (x + zero, *args[1:])

        def after(module: Any, args: tuple, output: Any) -> Any:
            x, input_zero = pending.pop(id(module))
            if x is None or not (torch.is_tensor(output) and torch.is_floating_point(output)):
                return None
            input_bound, output_bound = rule(module, x, output.detach())
            if input_bound is not None:
                self.sources.append((input_zero, input_bound))
            if output_bound is None:
                return None
            zero = torch.zeros_like(output, requires_grad=True)
            self.sources.append((zero, output_bound))
            return output + zero

        handles = [m.register_forward_pre_hook(before) for m in modules] + [m.register_forward_hook(after) for m in modules]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def first_order_bound(output: Any, sources: list[tuple[Any, Any]]) -> np.ndarray:
    """Per-element bound on `output` ([batch, ...]) from `(tensor in output's graph, error bound)` sources."""
    import torch

    flat = output.reshape(output.shape[0], -1)
    bound = np.zeros(tuple(flat.shape), dtype=np.float64)
    tensors = [t for t, _ in sources]
    if not tensors:
        return bound.reshape(tuple(output.shape))
    for column in range(flat.shape[1]):
        grads = torch.autograd.grad(flat[:, column].sum(), tensors, retain_graph=True, allow_unused=True)
        for grad, (tensor, delta) in zip(grads, sources):
            if grad is None:
                continue
            weighted = grad.detach().abs().double() * delta.double()
            if tensor.dim() and tensor.shape[0] == flat.shape[0]:
                contribution = weighted.reshape(tensor.shape[0], -1).sum(dim=1)
            else:  # not batch-major (a time-major transpose): charge every sample with all of it
                contribution = weighted.sum().expand(flat.shape[0])
            bound[:, column] += contribution.cpu().numpy()
    return bound.reshape(tuple(output.shape))


def all_trainable(module: Any) -> Any:
    """`module` with every parameter requiring grad, so sensitivities reach frozen layers too."""
    for parameter in module.parameters():
        parameter.requires_grad_(True)
    return module


def trainable_copy(module: Any) -> Any:
    import copy

    return all_trainable(copy.deepcopy(module))
