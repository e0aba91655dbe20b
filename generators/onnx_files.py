"""Where a Keras model's ONNX export lives in its model folder: written by the Keras generators when the model is
generated, read by the converters (`generators.conversion`) and the conversion settings."""

from __future__ import annotations

from pathlib import Path

from difftest import ConversionFailed

ONNX_FILE = "model.onnx"
EXPORT_ERROR_FILE = "onnx_export_error.txt"  # tf2onnx's message, when the export failed: a finding of its own


def onnx_export(model_dir: Path | None) -> Path:
    """The model's ONNX file; ConversionFailed with tf2onnx's message when the export failed."""
    if model_dir is None:
        raise ConversionFailed("no model folder to read the ONNX export from")
    error = Path(model_dir) / EXPORT_ERROR_FILE
    if error.exists():
        raise ConversionFailed(error.read_text())
    return Path(model_dir) / ONNX_FILE
