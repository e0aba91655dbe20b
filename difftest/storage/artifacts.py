"""Models on disk: spec.json + init.safetensors + inputs.safetensors per model, so any case re-runs alone."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from difftest.contracts.batch import Batch
from difftest.contracts.errors import UserError
from difftest.contracts.model import Inputs, LoadedModel
from difftest.contracts.registry import get_generator
from difftest.contracts.spec import ModelSpec

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


def load_model(model_dir: Path) -> tuple[LoadedModel, Inputs]:
    spec = load_spec(model_dir)
    generator = get_generator(spec.kind)
    arrays = load_arrays(model_dir / INPUTS_FILE)
    inputs = Inputs(Batch.from_arrays(arrays, "train"), Batch.from_arrays(arrays, "eval"))
    return LoadedModel(spec, generator, load_arrays(model_dir / INIT_FILE), model_dir), inputs
