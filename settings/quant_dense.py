"""Dense quantization in PyTorch, on both model kinds (the PyTorch form of a Keras model is its converted one).

* `quant/dynamic/<qint8|float16>/<engine>`: `torch.ao.quantization.quantize_dynamic` of every nn.Linear under one
  quantized engine (x86, fbgemm, onednn, qnnpack). An engine that refuses a dtype is `unsupported`, with its words.
* `quant/bf16-autocast`: the float model run under `torch.autocast("cpu"|"cuda", dtype=torch.bfloat16)`.

Each is judged against the float `reference` within a first-order bound derived from where it rounds
(see `settings/_error_bounds.py`): the per-tensor int8 step of each Linear's weights and (dynamically quantized)
input, fp16 rounding of the weights, or bf16 rounding of every autocast op's inputs, weights and outputs.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import ACTIVATION, Outputs, RunContext, Setting, Unsupported, register_settings, to_numpy
from settings import _error_bounds as bounds
from settings._training import build_for_training

ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")
DYNAMIC_DTYPES = ("qint8", "float16")
# torch's dynamic Linear quantizes its input with reduce_range=True: 7-bit, so fbgemm's int16 products cannot overflow
ACTIVATION_LEVELS = 127
# symmetric per-tensor qint8 weights span [-128, 127]: max|W| is 127.5 steps
WEIGHT_STEPS = 127.5


class _DenseQuantization(Setting):
    """What the dense quantization settings share: judged on the eval outputs against the float reference."""

    family: ClassVar[str] = "quant"
    precision: ClassVar[str] = "quantized"  # judged by the bounds its scheme's rounding implies, not an envelope
    world_size: int = 1

    def judges(self, tensor_name: str) -> bool:
        return tensor_name.startswith("eval_before/")

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        device, why = self.compute_device(ctx)
        if device != ctx.device:
            ctx.notes["device"] = f"ran on {device}, not {ctx.device}: {why}"
        # fresh builds rather than deep copies: a converted graph can hold references that do not copy
        with self.quantized(ctx, build_for_training(model, device).eval()) as forward:
            with torch.no_grad():
                predicted = forward(lambda m: model.evaluate(m, inputs.eval, device))
        # the bounds cover the model's outputs; a layer's own activation is not bounded, so it is not recorded
        outputs = {f"eval_before/{name}": to_numpy(value.float()) for name, value in predicted.items()
                   if not name.endswith(ACTIVATION)}
        reference = bounds.all_trainable(build_for_training(model, device).eval())
        perturbations = bounds.Perturbations()
        with perturbations.hooked(self.rounding_sites(reference), self.rounding):
            evaluated = model.evaluate(reference, inputs.eval, device)
        for name, value in evaluated.items():
            if name.endswith(ACTIVATION):
                continue
            bound = bounds.first_order_bound(value, perturbations.sources)
            outputs[f"allowed/eval_before/{name}"] = (bound + self.final_rounding(to_numpy(value))).astype(np.float32)
        return outputs

    def compute_device(self, ctx: RunContext) -> tuple[str, str]:
        """(where the quantized and the float model run, why there if not on the case's device)."""
        return ctx.device, ""

    def quantized(self, ctx: RunContext, module: Any) -> Any:
        """Context yielding `forward(evaluate)`, which runs `evaluate` on the quantized form of `module`."""
        raise NotImplementedError

    def rounding_sites(self, module: Any) -> list[Any]:
        raise NotImplementedError

    def rounding(self, module: Any, x: Any, y: Any) -> tuple[Any | None, Any | None]:
        raise NotImplementedError

    def final_rounding(self, value: np.ndarray) -> np.ndarray:
        return np.zeros_like(value, dtype=np.float64)


def _linear_modules(module: Any) -> list[Any]:
    import torch

    return [m for m in module.modules() if type(m) is torch.nn.Linear]


@functools.cache
def _graph_dynamic_linear() -> type:
    """torch's dynamic quantized Linear, callable the way onnx2pytorch calls a module it does not know.

    onnx2pytorch passes only the activation to the layer types it lists as standard (nn.Linear among them) and
    every graph input, weight initializers included, to any other module: the swapped-in module then receives
    the float weights it has already packed, and ignores them.
    """
    from torch.ao.nn.quantized.dynamic import Linear

    class GraphDynamicLinear(Linear):
        def forward(self, x: Any, *initializers: Any) -> Any:
            return super().forward(x)

    return GraphDynamicLinear


def _reordered_sum(module: Any, x: Any) -> Any:
    """Bound on the difference between two fp32 evaluations of x @ W.T summing in different orders."""
    import torch

    fan_in = module.weight.shape[1]
    return 2 * fan_in * bounds.FP32_UNIT * torch.nn.functional.linear(x.abs(), module.weight.detach().abs())


@dataclass(frozen=True)
class DynamicQuantization(_DenseQuantization):
    """torch.ao quantize_dynamic of every nn.Linear (int8 or fp16 weights) under one quantized engine."""

    tier_axes: ClassVar[tuple[str, ...]] = ("dtype", "engine")
    dtype: str
    engine: str

    @property
    def name(self) -> str:
        return f"quant/dynamic/{self.dtype}/{self.engine}"

    def describe(self) -> str:
        return f"torch.ao quantize_dynamic ({self.dtype} Linear weights), {self.engine} engine, vs float within the rounding bound"

    def available(self) -> str | None:
        import torch

        if self.engine not in torch.backends.quantized.supported_engines:
            return f"this torch build has no {self.engine} quantized engine ({torch.backends.quantized.supported_engines})"
        return None

    def compute_device(self, ctx: RunContext) -> tuple[str, str]:
        # by design: on a GPU machine both models are built on the CPU, where the quantized kernels are
        return "cpu", "torch.ao's dynamic quantized Linear has CPU kernels only (quantized engines are CPU backends)"

    @contextlib.contextmanager
    def quantized(self, ctx: RunContext, module: Any) -> Iterator[Any]:
        import torch

        if not _linear_modules(module):
            raise Unsupported("the model has no nn.Linear for quantize_dynamic to quantize")
        before = torch.backends.quantized.engine
        torch.backends.quantized.engine = self.engine
        try:
            try:
                quantized = torch.ao.quantization.quantize_dynamic(
                    module, {torch.nn.Linear}, dtype=getattr(torch, self.dtype), inplace=True,
                    mapping={torch.nn.Linear: _graph_dynamic_linear()},
                )
            except RuntimeError as exc:
                if "not supported" in str(exc):
                    raise Unsupported(f"the {self.engine} engine refuses {self.dtype}: {str(exc).splitlines()[0]}") from None
                raise
            yield lambda evaluate: evaluate(quantized)
        finally:
            torch.backends.quantized.engine = before

    def rounding_sites(self, module: Any) -> list[Any]:
        return _linear_modules(module)

    def rounding(self, module: Any, x: Any, y: Any) -> tuple[Any | None, Any | None]:
        import torch

        weight = module.weight.detach()
        if self.dtype == "float16":
            # fp16 weights, fp32 activations and accumulation
            error = torch.nn.functional.linear(
                x.abs(), torch.from_numpy(bounds.fp16_rounding(weight.cpu().numpy())).float().to(x.device))
            return None, error + _reordered_sum(module, x)
        # the input is quantized per tensor over [min(x, 0), max(x, 0)], and the zero point rounded: one step
        step_x = float((x.max().clamp(min=0) - x.min().clamp(max=0)) / ACTIVATION_LEVELS)
        step_w = float(weight.abs().max()) / WEIGHT_STEPS
        input_error = torch.full_like(x, step_x)
        # |dW x~| <= (step_w / 2) * sum_j |x~_j|, the same for every output unit of a sample
        weight_error = (step_w / 2) * (x.abs() + step_x).sum(dim=-1, keepdim=True).expand_as(y)
        return input_error, weight_error + _reordered_sum(module, x)


@dataclass(frozen=True)
class Bf16Autocast(_DenseQuantization):
    """The float model run under torch.autocast with bfloat16."""

    @property
    def name(self) -> str:
        return "quant/bf16-autocast"

    def describe(self) -> str:
        return "torch.autocast(bfloat16) inference, vs float within the bf16 rounding bound"

    @contextlib.contextmanager
    def quantized(self, ctx: RunContext, module: Any) -> Iterator[Any]:
        import torch

        device_type = ctx.device.split(":")[0]

        def forward(evaluate: Any) -> Any:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                return evaluate(module)

        yield forward

    def rounding_sites(self, module: Any) -> list[Any]:
        return [m for m in module.modules() if not list(m.children())]

    def rounding(self, module: Any, x: Any, y: Any) -> tuple[Any | None, Any | None]:
        import torch

        if not torch.is_floating_point(y):
            return None, None
        output_error = y.abs() * bounds.BF16_UNIT
        if type(module) is torch.nn.Linear:  # autocast casts input and weight to bf16, accumulates in fp32
            weight_error = torch.nn.functional.linear(x.abs(), module.weight.detach().abs() * bounds.BF16_UNIT)
            return x.abs() * bounds.BF16_UNIT, output_error + weight_error + _reordered_sum(module, x)
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            weight_error = module._conv_forward(x.abs(), module.weight.detach().abs() * bounds.BF16_UNIT, None)
            return x.abs() * bounds.BF16_UNIT, output_error + weight_error
        return None, output_error

    def final_rounding(self, value: np.ndarray) -> np.ndarray:
        return bounds.output_rounding(value, bounds.BF16_UNIT)


register_settings(
    [DynamicQuantization(dtype, engine) for dtype, engine in itertools.product(DYNAMIC_DTYPES, ENGINES)]
    + [Bf16Autocast()]
)
