"""Conversion checked differentially: TensorFlow vs ONNX Runtime vs each ONNX → PyTorch converter.

`eval` settings compare the predictions before training with TensorFlow's; `train` settings compare one
whole training run (loss, every weight in Keras layout, predictions after) with TensorFlow's on the same
batch. A failed export or conversion is an `error` row carrying the converter's own message. A model whose
Keras weights the converted graph cannot hold as separate trainable tensors (folded BatchNorm) is
`unsupported` for `train`, with the weights and the reason, rather than a false alarm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import (
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Unsupported,
    failure_pattern,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    traits_of,
)
from generators import _tf
from generators.conversion import convert_graph, shipped_export
from settings._training import train_single_process
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

    # --- a standalone script (difftest.scripts.emit) ------------------------------------------------
    def standalone(self, case: StandaloneCase) -> Script:
        """A converter's or ONNX Runtime's failure on the exported graph: the ONNX file is the script's data, so
        it needs onnx and the backend, not TensorFlow (a disagreement is judged against TensorFlow: no script)."""
        refuse_changed_hooks(self, Conversion, "converted")
        if not case.failure:
            raise Unsupported("a conversion that disagrees is judged against TensorFlow's run, which the script "
                              "does not hold")
        graph, made_by = shipped_export(case.model_dir)
        # difftest records a converter's exception inside its ConversionFailed; the script raises it unwrapped
        message = re.sub(rf"^(?:[\w.]*\.)?ConversionFailed: {self.backend}(?: module fails to run:)? ", "", case.message)
        return Script(
            summary=f"The ONNX graph tf2onnx (opset 18) exported from a Keras model ({made_by}), "
                    f"{standalone_backend_use(self.backend)} on a probe batch: it fails where the same model runs in "
                    "TensorFlow. The graph is the script's data: TensorFlow is not needed to run it.",
            libraries=("torch", "onnx", self.backend, "numpy"),
            preamble=(),
            case={"backend": self.backend},
            functions=(convert_graph, single_process, on_rank),
            tensors={}, world_size=1, failure=failure_pattern(case.status, message),
            data={"onnx": graph, "probe": case.generator.inputs(case.spec, 12)["eval"].dense})


def _onnxruntime_predict(model: Any, x: Any) -> Any:
    import onnxruntime

    from generators.onnx_files import onnx_export

    path = onnx_export(model.model_dir)  # ConversionFailed → an error row with tf2onnx's message
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def standalone_backend_use(backend: str) -> str:
    return "loaded by ONNX Runtime and run" if backend == "onnxruntime" else f"converted to PyTorch by {backend} and run"


# --- what a standalone script runs (plain onnx / converters: copied into the script as they are) ---------------------
def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """A conversion script shows a failure: there is nothing to compare."""
    return {}


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, Any] | None:
    """The setting: the exported graph in the backend, run on the probe batch."""
    import torch

    if case["backend"] == "onnxruntime":
        import onnxruntime

        session = onnxruntime.InferenceSession(data["onnx"].tobytes(), providers=["CPUExecutionProvider"])
        session.run(None, {session.get_inputs()[0].name: data["probe"]})
        return {}
    import onnx

    proto = onnx.load_model_from_string(data["onnx"].tobytes())
    graph = convert_graph(proto, case["backend"])
    with torch.no_grad():
        graph.float()(torch.from_numpy(data["probe"]))
    return {}


register_settings(Conversion(backend, "eval") for backend in BACKENDS)
register_settings(Conversion(backend, "train") for backend in BACKENDS[1:])
