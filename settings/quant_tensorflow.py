"""Quantized TensorFlow forms of the Keras models, judged against float TensorFlow (`tf/reference`).

* `quant/tflite/dynamic-int8`: TFLite post-training dynamic-range quantization (int8 weights; the hybrid
  kernels quantize their input on the fly).
* `quant/tflite/float16`: TFLite post-training float16 quantization (fp16 weights, fp32 arithmetic).
* `quant/tf/mixed-bfloat16`: the Keras model built under the `mixed_bfloat16` policy.
* `quant/tfmot/qat-int8`: TF-MOT quantization-aware 8-bit, where its package installs.

TFLite converts with a batch of 1 (it cannot lower an LSTM with a variable batch size) and runs sample by sample.
Bounds are first order (see `settings/_error_bounds.py`), with TensorFlow's autodiff: every kernel the converted model
stores quantized rounded by at most its scheme's step (TFLite keeps a weight of under 1024 elements in float), and
the input of every layer that owns such a kernel rounded as its hybrid kernel does.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import Outputs, RunContext, Setting, Unsupported, register_settings, traits_of
from generators import _tf
from settings import _error_bounds as bounds
from settings.tensorflow import TF_REFERENCE

SCHEMES = ("dynamic-int8", "float16", "mixed-bfloat16", "qat-int8")
INT8_STEPS = 127.0  # symmetric int8: max|x| is 127 steps


@dataclass(frozen=True)
class TensorFlowQuantization(Setting):
    """A quantized TensorFlow/TFLite form of the Keras model, vs float TensorFlow within the rounding bound."""

    scheme: str
    family: ClassVar[str] = "quant"
    precision: ClassVar[str] = "quantized"  # judged by the bounds its scheme's rounding implies, not an envelope
    framework: ClassVar[str] = "tensorflow"
    tier_axes: ClassVar[tuple[str, ...]] = ("scheme",)
    reference: ClassVar[str] = TF_REFERENCE
    world_size: int = 1

    @property
    def name(self) -> str:
        if self.scheme == "mixed-bfloat16":
            return "quant/tf/mixed-bfloat16"
        if self.scheme == "qat-int8":
            return "quant/tfmot/qat-int8"
        return f"quant/tflite/{self.scheme}"

    def describe(self) -> str:
        return {
            "dynamic-int8": "TFLite dynamic-range int8 post-training quantization",
            "float16": "TFLite float16 post-training quantization",
            "mixed-bfloat16": "Keras mixed_bfloat16 policy",
            "qat-int8": "TF-MOT quantization-aware training, 8-bit",
        }[self.scheme] + ", vs float TensorFlow within the rounding bound"

    def supports(self, spec: Any) -> str | None:
        return None if "keras" in traits_of(spec.kind) else f"TensorFlow quantization runs Keras models; kind {spec.kind!r} is PyTorch-only"

    def available(self) -> str | None:
        missing = _tf.missing()
        if missing or self.scheme != "qat-int8":
            return missing
        try:
            import tensorflow_model_optimization  # noqa: F401
        except Exception as exc:  # it fails at import without tf_keras, not only when absent
            return (
                f"tensorflow-model-optimization does not import ({type(exc).__name__}: {str(exc)[:120]}); it quantizes "
                "tf_keras (Keras 2) models only, tf_keras needs the full `tensorflow` package, and the models here "
                "are Keras 3 models on tensorflow-cpu"
            )
        return "tensorflow-model-optimization imports, but its QAT wrappers take tf_keras models, not these Keras 3 models"

    def judges(self, tensor_name: str) -> bool:
        return tensor_name.startswith("eval_before/")

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        tf, keras = _tf.import_tensorflow()
        x = inputs.eval.dense
        if self.scheme == "mixed-bfloat16":
            logits, stored = self._mixed_bfloat16(keras, model, x), None
        else:
            logits, stored = self._tflite(tf, keras, model, x)
        float_model = model.generator.keras_model(model.spec, model.init_state)
        kernels = [w for w in float_model.weights if _is_kernel(w)]
        rounded = [w for w in kernels if stored is None or stored[int(np.prod(w.shape))]]
        # TFLite keeps a weight of under 1024 elements in float (tensorflow#53094): the bound rounds only the others,
        # and a model with none left has nothing of the scheme to test
        if stored is not None and not rounded:
            raise Unsupported(f"TFLite stored none of the model's {len(kernels)} kernels {self.scheme.split('-')[-1]} "
                              "(it keeps a weight of under 1024 elements in float: tensorflow#53094)")
        if len(rounded) < len(kernels):
            ctx.notes["kernels quantized"] = f"{len(rounded)} of {len(kernels)}; TFLite keeps the others in float"
        allowed = self.allowed_error(tf, model, float_model, x, rounded)
        return {"eval_before/logits": logits.astype(np.float32), "allowed/eval_before/logits": allowed.astype(np.float32)}

    def quantized_source(self, model: Any) -> Any:
        """The Keras model the scheme quantizes (a hook for planted faults); built afresh, under the global policy."""
        return model.generator.keras_model(model.spec, model.init_state)

    def _mixed_bfloat16(self, keras: Any, model: Any, x: np.ndarray) -> np.ndarray:
        before = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            quantized = self.quantized_source(model)
        finally:
            keras.mixed_precision.set_global_policy(before)  # a global: later cases must build in float32
        return np.asarray(quantized(x, training=False), dtype=np.float32)

    def _tflite(self, tf: Any, keras: Any, model: Any, x: np.ndarray) -> tuple[np.ndarray, Counter[int]]:
        """Convert through a SavedModel whose one endpoint takes a batch of 1, then run sample by sample; also how
        many of the converted model's tensors of each size the scheme stores quantized (int8, or float16).

        The batch is fixed because TFLite cannot lower an LSTM with a variable one; the SavedModel route because
        converting a tf.function over a Keras 3 model directly (`from_concrete_functions`) gave outputs of 1e37
        from uninitialised variables, even unoptimised, while the SavedModel of the same model converts exactly.
        """
        keras_model = self.quantized_source(model)
        with tempfile.TemporaryDirectory(prefix="difftest-tflite-") as saved:
            archive = keras.export.ExportArchive()
            archive.track(keras_model)
            archive.add_endpoint(
                "serve", lambda v: keras_model(v, training=False),
                input_signature=[tf.TensorSpec((1, *x.shape[1:]), tf.as_dtype(x.dtype))],
            )
            archive.write_out(saved, verbose=False)
            converter = tf.lite.TFLiteConverter.from_saved_model(saved)
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            if self.scheme == "float16":
                converter.target_spec.supported_types = [tf.float16]
            flatbuffer = converter.convert()
        interpreter = tf.lite.Interpreter(model_content=flatbuffer, num_threads=1)
        interpreter.allocate_tensors()
        kind = np.float16 if self.scheme == "float16" else np.int8
        stored = Counter(int(np.prod(d["shape"])) for d in interpreter.get_tensor_details() if d["dtype"] == kind)
        source, target = interpreter.get_input_details()[0]["index"], interpreter.get_output_details()[0]["index"]
        rows = []
        for sample in x:
            interpreter.set_tensor(source, sample[None])
            interpreter.invoke()
            rows.append(np.array(interpreter.get_tensor(target), dtype=np.float32))
        return np.concatenate(rows), stored

    # --- the bound ---------------------------------------------------------------------------------------
    def allowed_error(self, tf: Any, model: Any, keras_model: Any, x: np.ndarray, kernels: list[Any]) -> np.ndarray:
        """First-order bound on the logits: the `kernels` the scheme stores rounded (a kernel of the same size as a
        quantized tensor counts as one), and (per scheme) layer inputs and outputs rounded."""
        sites: list[tuple[Any, Any]] = []

        def site(layer: Any, value: Any) -> Any:
            if tf.as_dtype(value.dtype).is_floating:
                tape.watch(value)  # noqa: F821 (the tape below: `site` is called only inside it)
                sites.append((layer, value))
            return value

        with tf.GradientTape(persistent=True) as tape:
            _, keras = _tf.import_tensorflow()
            logits = model.generator.layer_by_layer(keras, model.spec, keras_model, tf.constant(x), site)
        bound = np.zeros(tuple(logits.shape), dtype=np.float64)
        # one backward pass for every kernel's jacobian ([batch, classes, *kernel] each), one per logit column for
        # every site's gradient: the same derivatives as one pass per tensor, a fraction of the passes
        for kernel, jacobian in zip(kernels, tape.jacobian(logits, kernels, experimental_use_pfor=True) if kernels else []):
            delta = self._weight_rounding(np.asarray(kernel.numpy(), dtype=np.float64))
            bound += np.abs(np.asarray(jacobian, dtype=np.float64)).reshape(*logits.shape, -1) @ delta.reshape(-1)
        quantized = {id(w) for w in kernels}
        rounded = [(activation, delta) for layer, activation in sites
                   if (delta := self._activation_rounding(layer, np.asarray(activation, dtype=np.float64),
                                                          quantized)) is not None]
        for column in range(logits.shape[1]) if rounded else ():
            selector = tf.one_hot(tf.fill([len(x)], column), logits.shape[1], dtype=logits.dtype)
            grads = tape.gradient(logits, [activation for activation, _ in rounded], output_gradients=selector)
            for (_, delta), grad in zip(rounded, grads):
                if grad is not None:
                    bound[:, column] += (np.abs(np.asarray(grad, dtype=np.float64)) * delta).reshape(len(x), -1).sum(axis=1)
        del tape
        logits_np = np.asarray(logits, dtype=np.float64)
        if self.scheme == "mixed-bfloat16":
            bound += bounds.output_rounding(logits_np, bounds.BF16_UNIT)
        return bound + 16 * bounds.FP32_UNIT * (np.abs(logits_np) + 1)

    def _weight_rounding(self, kernel: np.ndarray) -> np.ndarray:
        if self.scheme == "float16":
            return bounds.fp16_rounding(kernel)
        if self.scheme == "mixed-bfloat16":
            return np.abs(kernel) * bounds.BF16_UNIT
        # symmetric int8, per tensor at worst (per-channel steps are no larger): half a step
        return np.full_like(kernel, np.abs(kernel).max() / INT8_STEPS / 2)

    def _activation_rounding(self, layer: Any, activation: np.ndarray, quantized: set[int]) -> np.ndarray | None:
        if self.scheme == "mixed-bfloat16":
            # each layer's input is the bf16 output of the layer before, rounded after each of its ops (a kernel
            # product, a bias add, an activation): three roundings of a value of this size, a first-order model
            # that does not see deeper layer internals (recurrent steps, normalisation statistics)
            return 3 * np.abs(activation) * bounds.BF16_UNIT
        if self.scheme == "dynamic-int8" and any(id(w) in quantized for w in layer.weights):
            # hybrid kernels quantize their float input to int8 on the fly: at most one step of max|x| / 127
            return np.full_like(activation, np.abs(activation).max() / INT8_STEPS)
        return None


def _is_kernel(weight: Any) -> bool:
    """The weights TFLite stores quantized: matrices and filters, not biases or normalisation statistics."""
    leaf = weight.path.rsplit("/", 1)[-1]
    return len(weight.shape) >= 2 and leaf in ("kernel", "recurrent_kernel", "embeddings", "depthwise_kernel", "pointwise_kernel")


register_settings(TensorFlowQuantization(scheme) for scheme in SCHEMES)
