"""TensorFlow behind the `[tf]` extra: one place that imports it, in the one order that does not crash."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from difftest import UserError

EXTRA_HINT = "install the TensorFlow extra: pip install -e '.[tf]' (./install.sh does)"
LOGICAL_CPUS = 4  # MirroredStrategy runs over 1..4 of these in one process

_REQUIRED = ("tensorflow", "tf2onnx", "onnx", "onnxruntime")
_MODULES: tuple[Any, Any] | None = None


def missing() -> str | None:
    """None when the TF stack is importable, else which package is missing and how to get it."""
    absent = [name for name in _REQUIRED if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(absent)}: {EXTRA_HINT}" if absent else None


@contextlib.contextmanager
def _native_stderr_quieted() -> Iterator[None]:
    """TensorFlow's C++ start-up lines ("All log messages before absl::InitializeLog() …", the oneDNN notice) go to
    file descriptor 2 before absl reads any setting, so TF_CPP_MIN_LOG_LEVEL cannot stop them; they would print
    through the progress display. Hold fd 2 in a file meanwhile; show what it caught only if TF failed to start."""
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                caught.seek(0)
                sys.stderr.write(caught.read().decode(errors="replace"))


def import_tensorflow() -> tuple[Any, Any]:
    """(tensorflow, keras), with the CPU split into LOGICAL_CPUS logical devices.

    torch and triton are imported first: with the CUDA build of torch, loading triton *after* TensorFlow
    segfaults the process (measured here; see STACK.md), and torchvision/torchrec/the ONNX converters load
    triton lazily.
    """
    global _MODULES
    if _MODULES is not None:
        return _MODULES
    why = missing()
    if why:
        raise UserError(f"TensorFlow settings and sequential models {why}")
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import torch  # noqa: F401

    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401
    with _native_stderr_quieted():
        import tensorflow as tf

        cpus = tf.config.list_physical_devices("CPU")
        try:
            tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)
        except RuntimeError:
            pass  # the runtime is already initialised (someone imported TF before us): keep its devices
        tf.config.experimental.enable_op_determinism()
        import keras

    _MODULES = (tf, keras)
    return _MODULES
