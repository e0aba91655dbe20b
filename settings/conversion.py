"""Conversion checked differentially: TensorFlow vs ONNX Runtime vs each ONNX → PyTorch converter.

`eval` settings compare the predictions before training with TensorFlow's; `train` settings compare one
whole training run (loss, every weight in Keras layout, predictions after) with TensorFlow's on the same
batch. A failed export or conversion is an `error` row carrying the converter's own message. A model whose
Keras weights the converted graph cannot hold as separate trainable tensors (folded BatchNorm) is
`unsupported` for `train`, with the weights and the reason, rather than a false alarm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.errors import Unsupported
from difftest.registry import register_settings, traits_of
from difftest.setting import Outputs, RunContext, Setting
from generators import _tf
from settings._training import to_numpy, train_single_process
from settings.tensorflow import TF_REFERENCE

BACKENDS = ("onnxruntime", "onnx2pytorch", "onnx2torch")


@dataclass(frozen=True)
class Conversion(Setting):
    """The exported ONNX graph run by ONNX Runtime or converted to PyTorch, judged against TensorFlow."""

    backend: str
    phase: str  # "eval" or "train"
    world_size: int = 1
    family: ClassVar[str] = "conversion"
    tier_axes: ClassVar[tuple[str, ...]] = ("backend", "phase")
    deterministic: ClassVar[bool] = True
    reference: ClassVar[str] = TF_REFERENCE

    @property
    def name(self) -> str:
        return f"convert/{self.backend}/{self.phase}"

    def describe(self) -> str:
        what = "predictions" if self.phase == "eval" else "one training run (SGD)"
        return f"tf2onnx (opset 18) → {self.backend}: {what} vs TensorFlow"

    def judges(self, tensor_name: str) -> bool:
        return self.phase == "train" or tensor_name.startswith("eval_before/")

    def supports(self, spec: Any) -> str | None:
        return None if "keras" in traits_of(spec.kind) else f"conversion applies to Keras models, not kind {spec.kind!r}"

    def available(self) -> str | None:
        return _tf.missing()

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if self.backend == "onnxruntime":
            return {"eval_before/logits": _onnxruntime_predict(model, inputs.eval.dense)}
        module = self.converted(model.build(ctx.device, converter=self.backend))  # ConversionFailed → an error row
        if self.phase == "eval":
            import torch

            with torch.no_grad():
                return {f"eval_before/{k}": to_numpy(v) for k, v in model.evaluate(module, inputs.eval, ctx.device).items()}
        if module.unmapped:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(module.unmapped.items()))
            raise Unsupported(f"{len(module.unmapped)} Keras weights have no trainable PyTorch counterpart ({reasons})")
        ctx.notes["trainable"] = str(sum(p.requires_grad for p in module.parameters()))
        return train_single_process(ctx, model, inputs, module)


    def converted(self, module: Any) -> Any:
        """The converted module as this setting runs it (a hook for planted faults)."""
        return module


def _onnxruntime_predict(model: Any, x: Any) -> Any:
    import onnxruntime

    from generators.onnx_files import onnx_export

    path = onnx_export(model.model_dir)  # ConversionFailed → an error row with tf2onnx's message
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


register_settings(Conversion(backend, "eval") for backend in BACKENDS)
register_settings(Conversion(backend, "train") for backend in BACKENDS[1:])
