"""Models on disk: spec.json + init.safetensors + inputs.safetensors per model, so any case re-runs alone."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from difftest.batch import Batch
from difftest.errors import UserError
from difftest.generator import Generator
from difftest.registry import get_generator
from difftest.spec import ModelSpec

SPEC_FILE, INIT_FILE, INPUTS_FILE = "spec.json", "init.safetensors", "inputs.safetensors"


def atomic_save_arrays(arrays: dict[str, np.ndarray], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(path)


def atomic_write_text(text: str, path: Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed over `path` when the block ends, removed if it raises: a
    reader (or a kill at any moment) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise UserError(f"{path}: missing; regenerate the model with `difftest generate`") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc}); delete it and rerun to regenerate") from None


def save_model(model_dir: Path, spec: ModelSpec, init_state: dict[str, np.ndarray], batches: dict[str, Batch],
               extra_files: dict[str, bytes] | None = None) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, data in (extra_files or {}).items():
        tmp = model_dir / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(model_dir / name)
    atomic_save_arrays(init_state, model_dir / INIT_FILE)
    arrays: dict[str, np.ndarray] = {}
    for split, batch in batches.items():
        arrays.update(batch.to_arrays(split))
    atomic_save_arrays(arrays, model_dir / INPUTS_FILE)
    atomic_write_text(spec.to_json(), model_dir / SPEC_FILE)  # written last: its presence marks a complete model


def stored_batch_size(model_dir: Path) -> int:
    """Samples in the model folder's training batch, read from the file's header alone."""
    from safetensors import safe_open

    with safe_open(str(model_dir / INPUTS_FILE), framework="numpy") as handle:
        return int(handle.get_slice(Batch.labels_key("train")).get_shape()[0])


def load_spec(model_dir: Path) -> ModelSpec:
    path = model_dir / SPEC_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: missing; regenerate the model with `difftest generate`") from None
    return ModelSpec.from_json(text, source=str(path))


@dataclass
class LoadedModel:
    """A model as a setting receives it: the spec, its generator, the initial weights and its folder."""

    spec: ModelSpec
    generator: Generator
    init_state: dict[str, np.ndarray]
    model_dir: Path | None = None

    def build(self, device: str, **options: Any) -> Any:
        """A fresh unsharded PyTorch module with the initial weights and the frozen parameters frozen."""
        return self.generator.build(self.spec, self.init_state, device, self.model_dir, **options)

    def chain(self, device: str) -> Any:
        """The model as a LayerChain (generators/chain.py) for pipeline stages, if its kind has one."""
        return self.generator.chain(self.spec, self.init_state, device, self.model_dir)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        return self.generator.forward(module, batch, device)

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """Named evaluation tensors (predictions and whatever intermediates the generator exposes)."""
        return self.generator.evaluate(module, batch, device)

    def loss(self, prediction: Any, batch: Batch) -> Any:
        """The mean training loss over `batch` (so shares of equal size average to the global loss)."""
        return self.generator.loss(prediction, batch)

    def parameters(self, module: Any) -> dict[str, Any]:
        """Canonical parameter name → tensor of an unsharded module (possibly wrapped by DDP)."""
        return self.generator.parameters(module)

    def blocks(self, module: Any) -> list[tuple[str, Any]] | None:
        """(name, submodule) of the repeated blocks of an architecture that has them (a transformer's layers), which
        per-block wrapping (FSDP2) takes as its units; None when the kind has no such structure."""
        return self.generator.blocks(module)

    def tp_plan(self, module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any] | None:
        """The architecture's own tensor-parallel plan (module name → ParallelStyle), as its authors would write it;
        None when the kind has none and a setting derives one from the module's layers."""
        return self.generator.tp_plan(module, world_size, sequence_parallel, loss_parallel)


@dataclass
class Inputs:
    train: Batch
    eval: Batch


def load_model(model_dir: Path) -> tuple[LoadedModel, Inputs]:
    spec = load_spec(model_dir)
    generator = get_generator(spec.kind)
    arrays = load_arrays(model_dir / INPUTS_FILE)
    inputs = Inputs(Batch.from_arrays(arrays, "train"), Batch.from_arrays(arrays, "eval"))
    return LoadedModel(spec, generator, load_arrays(model_dir / INIT_FILE), model_dir), inputs
