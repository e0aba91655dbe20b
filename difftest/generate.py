"""`difftest generate`: specs, initial weights and inputs for N models of each kind, reproducible from (seed, index)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from difftest import stack
from difftest.artifacts import atomic_write_text, save_model
from difftest.errors import UserError
from difftest.registry import get_generator, load_plugins
from difftest.spec import ModelSpec, RunConfig

RUN_FILE = "run.json"


def prepare_run(run_dir: Path, config: RunConfig) -> RunConfig:
    """Create a run folder, or check that an existing one was made with the same configuration (resume)."""
    path = run_dir / RUN_FILE
    if path.exists():
        existing = RunConfig.load(path)
        if existing != config:
            raise UserError(
                f"{run_dir} holds a run made with other options ({existing.to_json().replace(chr(10), ' ')}); "
                "rerun with the same options to resume, or pass another --out"
            )
        return existing
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.to_json(), path)
    return config


def materialise(spec: ModelSpec, model_dir: Path, batch_size: int) -> None:
    """Write a model's folder from its spec: initial weights, inputs of `batch_size` samples, its generator's extra
    files (a Keras model's ONNX export); a folder already complete is left as it is."""
    if (model_dir / "spec.json").exists():
        return
    generator = get_generator(spec.kind)
    state = generator.init_state(spec)
    save_model(model_dir, spec, state, generator.inputs(spec, batch_size), generator.artifacts(spec, state))


def generate(run_dir: Path, config: RunConfig, on_model: Callable[[str], None] | None = None) -> list[str]:
    load_plugins(config.plugins)
    if config.batch_size % 12:
        raise UserError(f"--batch-size {config.batch_size}: must be a multiple of 12 so it splits over 1, 2, 3 and 4 ranks")
    config = prepare_run(run_dir, config)
    stack.record(run_dir / RUN_FILE)
    ids = []
    for kind in config.kinds:
        generator = get_generator(kind)
        for index in range(config.count(kind)):
            spec = generator.spec(config.seed, index)
            model_dir = run_dir / "models" / spec.model_id
            materialise(spec, model_dir, config.batch_size)
            ids.append(spec.model_id)
            if on_model is not None:
                on_model(spec.model_id)
    return ids
