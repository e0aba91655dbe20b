"""`difftest generate`: specs, initial weights and inputs for N models of each kind, reproducible from (seed, index)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from difftest.contracts.errors import UserError
from difftest.contracts.registry import get_generator, load_plugins
from difftest.contracts.spec import ModelSpec, RunConfig
from difftest.storage import integrity, stack
from difftest.storage.artifacts import atomic_write_text, save_model

RUN_FILE = "run.json"


def prepare_run(run_dir: Path, config: RunConfig) -> RunConfig:
    """Create a run folder, or check that an existing one was made with the same configuration (resume)."""
    path = run_dir / RUN_FILE
    if path.exists():
        existing = RunConfig.load(path)
        if existing.generated() != config.generated():
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


def try_materialise(spec: ModelSpec, model_dir: Path, batch_size: int) -> str | None:
    """`materialise`, or why the spec's generator cannot build it (a smaller model Keras refuses): one line, and no
    half-written folder left behind. A `UserError` (an input of the user's to fix) is raised."""
    try:
        materialise(spec, model_dir, batch_size)
    except UserError:
        raise
    except Exception as exc:
        shutil.rmtree(model_dir, ignore_errors=True)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}"
    return None


def _materialise_in_builder(plugins: tuple[str, ...], spec: ModelSpec, model_dir: str, batch_size: int) -> str | None:
    load_plugins(plugins)
    return try_materialise(spec, Path(model_dir), batch_size)


def _timed_materialise(spec: ModelSpec, model_dir: Path, batch_size: int) -> tuple[str | None, float]:
    """`try_materialise`, and the seconds it took."""
    started = time.perf_counter()
    why = try_materialise(spec, model_dir, batch_size)
    return why, time.perf_counter() - started


def _timed_in_builder(plugins: tuple[str, ...], spec: ModelSpec, model_dir: str,
                      batch_size: int) -> tuple[str | None, float]:
    load_plugins(plugins)
    return _timed_materialise(spec, Path(model_dir), batch_size)


def _warm_builder(plugins: tuple[str, ...], examples: list[tuple[ModelSpec, int]]) -> None:
    """A builder's first job: one model of each kind, thrown away, so it has imported what every kind needs."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="difftest-warm-") as scratch:
        for number, (spec, batch_size) in enumerate(examples):
            _materialise_in_builder(plugins, spec, f"{scratch}/{number}", batch_size)


class ModelBuilders:
    """Model folders written side by side: by this process and by builder processes, one per core more. A converted
    Keras model takes a third of a second of tf2onnx, and a minimisation round builds dozens while its worker groups
    wait. The builders fork from the ranks' import server where there is one (torch and the plugins imported) and
    `warm_up` builds one model of each kind in each, so that a builder has imported what they need (TensorFlow: seconds)
    before it is given a batch's model; until then this process builds alone, and no batch waits for their imports."""

    def __init__(self, plugins: tuple[str, ...], processes: int | None = None) -> None:
        """`processes`: builder processes beside this one (default: one per core more; 0 builds one by one here)."""
        from difftest.runner.scheduler import machine_ranks

        self._plugins = plugins
        self._processes = machine_ranks() - 1 if processes is None else processes
        self._pool: ProcessPoolExecutor | None = None
        self._temp_dir = ""
        self._warming: list[Future[None]] = []

    def warm_up(self, examples: list[tuple[ModelSpec, int]]) -> None:
        """Start the builders now, each building (spec, batch size) of every kind in `examples` in a folder of its own
        that is thrown away."""
        kinds = list({spec.kind: (spec, batch) for spec, batch in examples}.values())
        if self._processes and kinds:
            self._warming = [self._builders().submit(_warm_builder, self._plugins, kinds) for _ in range(self._processes)]

    def _warm(self) -> bool:
        if any(f.done() and isinstance(f.exception(), BrokenProcessPool) for f in self._warming):
            self.close()  # a builder died warming up: the next batch starts fresh ones, unwarmed
        return all(future.done() for future in self._warming)

    def build(self, jobs: list[tuple[ModelSpec, Path, int]]) -> list[str | None]:
        """`try_materialise` of each (spec, folder, batch size), in order."""
        return [why for why, _ in self.build_timed(jobs)]

    def build_timed(self, jobs: list[tuple[ModelSpec, Path, int]]) -> list[tuple[str | None, float]]:
        """`try_materialise` of each (spec, folder, batch size), in order, with the seconds it took where it was
        built (what a minimisation charges the findings that use the model). The builders take jobs from the front,
        this process from the back; a builder that dies costs its model (which says so) and the builders are
        replaced."""
        results: dict[int, tuple[str | None, float]] = {}
        waiting = deque(range(len(jobs)))
        running: dict[Future[tuple[str | None, float]], int] = {}
        while waiting or running:
            # two each, so a builder that finishes while this process is busy building has its next model already
            while waiting and len(running) < 2 * self._processes and len(waiting) > 1 and self._warm():
                index = waiting.popleft()
                spec, folder, batch = jobs[index]
                running[self._builders().submit(_timed_in_builder, self._plugins, spec, str(folder), batch)] = index
            if waiting:
                index = waiting.pop()
                results[index] = _timed_materialise(*jobs[index])
            else:
                wait(running, return_when=FIRST_COMPLETED)
            for future in [f for f in running if f.done()]:
                index = running.pop(future)
                try:
                    results[index] = future.result()
                except BrokenProcessPool as exc:  # a library crashed building it (a signal): not a candidate
                    shutil.rmtree(jobs[index][1], ignore_errors=True)
                    results[index] = f"BrokenProcessPool: {str(exc).splitlines()[0][:160]}", 0.0
                    self.close()
        return [results[index] for index in range(len(jobs))]

    def _builders(self) -> ProcessPoolExecutor:
        if self._pool is None:
            from difftest.runner.pool import rank_start
            from difftest.runner.worker import use_temporary_folder

            # the builders' own temporary folder, removed at close: they leave through os._exit, so what a library
            # leaves for deletion at exit (TensorFlow's autograph, a source file per traced export) would stay behind
            self._temp_dir = tempfile.mkdtemp(prefix="difftest-builders-")
            self._pool = ProcessPoolExecutor(max_workers=self._processes, mp_context=rank_start("cpu", gpu_in_ranks=False),
                                             initializer=use_temporary_folder, initargs=(self._temp_dir,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool, self._warming = None, []
            shutil.rmtree(self._temp_dir, ignore_errors=True)


def repair(spec: ModelSpec, model_dir: Path, batch_size: int, damaged: list[Path], digests: dict[str, str],
           run_dir: Path) -> list[Path]:
    """Write the model again in a folder beside it and put back each of the `damaged` files that came out byte for
    byte as `generate` first wrote it (`digests`); return those put back. One that comes out otherwise is left as it
    is, and the error (raised once the others are back) says so: the run's results were computed from its recorded
    bytes."""
    with tempfile.TemporaryDirectory(prefix=".regenerate-", dir=run_dir) as scratch:
        fresh = Path(scratch) / model_dir.name
        materialise(spec, fresh, batch_size)
        same = [p for p in damaged if (fresh / p.name).is_file()
                and integrity.file_digest(fresh / p.name) == digests[p.relative_to(run_dir).as_posix()]]
        model_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(same, key=lambda p: p.name == "spec.json"):  # the spec last: it marks a complete model
            (fresh / path.name).replace(path)
    other = [p for p in damaged if p not in same]
    if other:
        raise UserError(f"{other[0]}: generated again, it does not come out byte for byte as the run first had it "
                        f"({integrity.why_not_repeatable(other[0])}); the run's results were computed from the "
                        "recorded bytes: restore the file from a copy, or make the run again in a new folder")
    return same


def generate(run_dir: Path, config: RunConfig, on_model: Callable[[str], None] | None = None,
             on_repaired: Callable[[Path], None] | None = None) -> list[str]:
    """Write the run's models (a model folder already complete is kept), record every file's digest in run.json, and
    recreate, byte for byte, any recorded file that is missing or damaged (`on_repaired` is told of each)."""
    load_plugins(config.plugins)
    if config.batch_size % 12:
        raise UserError(f"--batch-size {config.batch_size}: must be a multiple of 12 so it splits over 1, 2, 3 and 4 ranks")
    config = prepare_run(run_dir, config)
    stack.record(run_dir / RUN_FILE)
    digests = integrity.recorded_digests(run_dir)
    damage = integrity.damaged_files(run_dir)
    if any(d.path.name == RUN_FILE for d in damage):
        integrity.check_models(run_dir)  # run.json itself: nothing here can recreate it
    damaged = {d.path for d in damage}
    ids, beyond_repair = [], []
    for kind in config.kinds:
        generator = get_generator(kind)
        for index in range(config.first_index, config.first_index + config.count(kind)):
            spec = generator.spec(config.seed, index)
            model_dir = run_dir / "models" / spec.model_id
            broken = sorted(p for p in damaged if p.parent == model_dir)
            if broken:
                try:
                    repaired = repair(spec, model_dir, config.batch_size, broken, digests, run_dir)
                except UserError as exc:  # the other models are repaired all the same
                    beyond_repair.append(str(exc))
                    repaired = [p for p in broken if p.is_file() and integrity.file_digest(p) == digests.get(
                        p.relative_to(run_dir).as_posix())]
                for path in repaired:
                    if on_repaired is not None:
                        on_repaired(path)
                if len(repaired) < len(broken):
                    continue
            else:
                materialise(spec, model_dir, config.batch_size)
            if any(p.relative_to(run_dir).as_posix() not in digests for p in integrity.model_files(model_dir)):
                integrity.record(run_dir, [model_dir])
            ids.append(spec.model_id)
            if on_model is not None:
                on_model(spec.model_id)
    if beyond_repair:
        more = f" (and {len(beyond_repair) - 1} more model(s) like it)" if len(beyond_repair) > 1 else ""
        raise UserError(beyond_repair[0] + more)
    return ids
