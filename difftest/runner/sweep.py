"""Plan the (model, setting) cases of a run and stream the uncommitted ones through warm worker groups."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from difftest.artifacts import load_spec
from difftest.errors import UserError
from difftest.registry import get_setting, load_plugins, select_settings, with_references
from difftest.runner.pool import CaseRequest, CaseResult, GroupBroken, GroupStartError, WorkerGroup
from difftest.setting import Setting
from difftest.spec import ModelSpec, RunConfig
from difftest.store import CaseRecord, Store


SWEEP_MARKER = "sweep.pid"  # present, naming a live process, while a sweep commits cases to the run


@dataclass(frozen=True)
class SweepOptions:
    settings: str | None = None  # comma-separated globs over setting names
    tier: str | None = None  # default | full; None: `default` without globs, `full` with them
    models: str | None = None  # comma-separated globs over model ids
    jobs: int = 1  # worker groups (of different world sizes) running at once
    timeout_s: float = 120.0
    device: str = "cpu"
    backend: str | None = None  # default: gloo on cpu, nccl on cuda
    plugins: tuple[str, ...] = ()
    twice: bool = False  # add `rerun/<name>` of every selected setting (the determinism oracle)
    # a warm group is replaced after this many cases: libraries that keep what every case built (legacy FSDP's
    # FlatParameter cycles, pytorch#183211; ~0.4 MB a case here, ~0.26 MB for TorchRec DMP) cannot grow a rank forever
    recycle_after: int = 2000
    # exactly these (model id, setting name) cases and what they are judged against, instead of globs × globs
    pairs: tuple[tuple[str, str], ...] | None = None
    # of `pairs`, those whose verdict needs the calibrated oracle: only they bring calibration runs (None: all do)
    calibrated_pairs: tuple[tuple[str, str], ...] | None = None

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


@dataclass(frozen=True)
class Case:
    model_id: str
    model_dir: Path
    spec: ModelSpec
    setting: Setting


@dataclass
class SweepReport:
    total: int = 0
    skipped_done: int = 0
    statuses: Counter = field(default_factory=Counter)
    groups_started: int = 0


def list_models(run_dir: Path) -> list[tuple[Path, ModelSpec]]:
    models_dir = run_dir / "models"
    if not models_dir.is_dir():
        raise UserError(f"{run_dir}: no models/ folder; run `difftest generate --out {run_dir}` first")
    found = [(d, load_spec(d)) for d in sorted(models_dir.iterdir()) if (d / "spec.json").exists()]
    if not found:
        raise UserError(f"{models_dir}: no generated models; run `difftest generate --out {run_dir}` first")
    return found


def plan_cases(run_dir: Path, options: SweepOptions) -> list[Case]:
    import fnmatch

    if options.pairs is not None:
        return _plan_pairs(run_dir, options.pairs, options.calibrated_pairs)
    settings = select_settings(options.settings, options.tier)
    if options.twice:
        names = {s.name for s in settings}
        settings += [get_setting(f"rerun/{s.name}") for s in list(settings)
                     if not s.name.startswith("rerun/") and f"rerun/{s.name}" not in names]
    settings = with_references(settings)
    globs = [g.strip() for g in (options.models or "*").split(",") if g.strip()]
    models = [(d, s) for d, s in list_models(run_dir) if any(fnmatch.fnmatchcase(s.model_id, g) for g in globs)]
    if not models:
        raise UserError(f"--models-filter {options.models!r} matches no model in {run_dir / 'models'}")
    return [Case(spec.model_id, d, spec, setting) for d, spec in models for setting in settings]


def _plan_pairs(run_dir: Path, pairs: tuple[tuple[str, str], ...],
                calibrated: tuple[tuple[str, str], ...] | None = None) -> list[Case]:
    models = {spec.model_id: (d, spec) for d, spec in list_models(run_dir)}
    cases: dict[tuple[str, str], Case] = {}
    for model_id, name in pairs:
        if model_id not in models:
            raise UserError(f"{run_dir / 'models'}: no model {model_id}")
        model_dir, spec = models[model_id]
        calibrate = calibrated is None or (model_id, name) in calibrated
        for setting in with_references([get_setting(name)], calibrate=calibrate):
            cases.setdefault((model_id, setting.name), Case(model_id, model_dir, spec, setting))
    return list(cases.values())


def _device_refusal(options: SweepOptions, world_size: int) -> str | None:
    if options.device != "cuda":
        return None
    import torch

    available = torch.cuda.device_count()
    if available < world_size:
        return f"needs {world_size} CUDA devices, this machine has {available}"
    return None


class WarmGroups:
    """Worker groups kept warm from one sweep to the next (the minimiser's rounds: many small sweeps in a row): a
    bucket starts on the idle group of its kind, if there is one, and leaves its group here, healthy, when done."""

    def __init__(self) -> None:
        self._idle: dict[tuple, WorkerGroup] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple) -> WorkerGroup | None:
        with self._lock:
            return self._idle.pop(key, None)

    def give(self, key: tuple, group: WorkerGroup) -> None:
        with self._lock:
            previous, self._idle[key] = self._idle.get(key), group
        if previous is not None:
            previous.close()

    def close(self) -> None:
        with self._lock:
            groups, self._idle = list(self._idle.values()), {}
        for group in groups:
            group.close()


def run_sweep(
    run_dir: Path,
    options: SweepOptions,
    on_result: Callable[[Case, CaseRecord], None] | None = None,
    on_planned: Callable[[list[Case], int], None] | None = None,
    warm: WarmGroups | None = None,
) -> SweepReport:
    config = RunConfig.load(run_dir / "run.json")
    plugins = load_plugins(config.plugins + options.plugins)
    cases = plan_cases(run_dir, options)
    store = Store(run_dir)
    report = SweepReport(total=len(cases))
    lock = threading.Lock()
    marker = run_dir / SWEEP_MARKER
    marker.write_text(f"{os.getpid()}\n")

    def record(case: Case, record: CaseRecord, outputs: dict | None) -> None:
        store.commit(record, outputs)
        with lock:
            report.statuses[record.status] += 1
        if on_result is not None:
            on_result(case, record)

    try:
        done = store.done()
        pending: dict[tuple[int, str], list[Case]] = defaultdict(list)
        refused: list[tuple[Case, str]] = []
        for case in cases:
            if (case.model_id, case.setting.name) in done:
                report.skipped_done += 1
                continue
            reason = (
                case.setting.supports(case.spec)
                or case.setting.available()
                or _device_refusal(options, case.setting.world_size)
            )
            if reason:
                refused.append((case, reason))
            else:
                pending[(case.setting.world_size, case.setting.process_affinity)].append(case)
        if on_planned is not None:
            # refused cases first: they are recorded at once, before any case runs
            on_planned([case for case, _ in refused] + [case for bucket in pending.values() for case in bucket],
                       len(refused))
        for case, reason in refused:
            record(case, CaseRecord(case.model_id, case.setting.name, "unsupported", reason), None)

        buckets = sorted(pending.items(), key=lambda item: -len(item[1]) * item[0][0])
        queue_lock = threading.Lock()

        def next_bucket() -> tuple[tuple[int, str], list[Case]] | None:
            with queue_lock:
                return buckets.pop(0) if buckets else None

        def drain() -> None:
            while (bucket := next_bucket()) is not None:
                _run_bucket(run_dir, config, options, plugins, bucket[0], bucket[1], record, report, lock, warm)

        threads = [threading.Thread(target=drain, daemon=True) for _ in range(max(1, options.jobs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # short joins keep Ctrl-C responsive
    finally:
        store.close()
        marker.unlink(missing_ok=True)
    return report


class _GroupSupply:
    """Warm groups of one world size for one bucket: the group in use, and, once a group of this bucket has had to
    be replaced (a crash, a hang, a rank stuck outside a collective, its case budget spent), a spare started in the
    background so the next replacement is already warm. A bucket that never replaces its group pays for no spare."""

    def __init__(self, make: Callable[[], WorkerGroup]) -> None:
        self._make = make
        self._starter = ThreadPoolExecutor(max_workers=1)
        self._spare: Future | None = None
        self.started = 0

    def first(self) -> WorkerGroup:
        self.started += 1
        return self._make()

    def replacement(self) -> WorkerGroup:
        """The spare if one is starting (raises its GroupStartError), else a new group; then a new spare starts."""
        if self._spare is None:
            group = self.first()
        else:
            spare, self._spare = self._spare, None
            self.started += 1
            group = spare.result()
        self._spare = self._starter.submit(self._make)
        return group

    def close(self) -> None:
        if self._spare is not None and self._spare.exception() is None:
            self._spare.result().close()
        self._starter.shutdown()


def _run_bucket(
    run_dir: Path,
    config: RunConfig,
    options: SweepOptions,
    plugins: tuple[str, ...],
    bucket: tuple[int, str],
    cases: list[Case],
    record: Callable[[Case, CaseRecord, dict | None], None],
    report: SweepReport,
    lock: threading.Lock,
    warm: WarmGroups | None = None,
) -> None:
    world_size = bucket[0]
    warm_key = (*bucket, options.device, options.resolved_backend, plugins, options.timeout_s)
    supply = _GroupSupply(
        lambda: WorkerGroup(
            world_size,
            run_dir / "logs",
            plugins,
            device=options.device,
            backend=options.resolved_backend,
            collective_timeout_s=options.timeout_s,
        )
    )
    group: WorkerGroup | None = warm.take(warm_key) if warm is not None else None
    completed = False  # a group given back to `warm` has finished its last case
    served = 0  # cases the current group has run
    broken_before = False  # a group of this bucket was replaced: the next one comes from the spare
    start_failure: str | None = None
    failed_starts = 0
    try:
        queue = list(cases)
        while queue:
            case = queue[0]
            if group is None and failed_starts >= 2:
                # the group cannot start at all: say so for every remaining case rather than retrying each
                record(case, CaseRecord(case.model_id, case.setting.name, "crash", f"worker group: {start_failure}"), None)
                queue.pop(0)
                continue
            if group is None:
                try:
                    group = supply.replacement() if broken_before else supply.first()
                    failed_starts = 0
                except GroupStartError as exc:
                    start_failure, failed_starts = str(exc), failed_starts + 1
                    record(case, CaseRecord(case.model_id, case.setting.name, "crash", f"worker group: {exc}"), None)
                    queue.pop(0)
                    continue
            request = CaseRequest(str(case.model_dir), case.setting.name, config.steps, config.lr, config.seed)
            try:
                result: CaseResult = group.run_case(request, options.timeout_s)
            except GroupBroken:
                group, broken_before = None, True  # the case never started: it runs on the replacement
                continue
            queue.pop(0)
            record(
                case,
                CaseRecord(
                    case.model_id, case.setting.name, result.status, result.message, result.rank, round(result.wall_s, 4)
                ),
                result.outputs,
            )
            served += 1
            # a setting with per-process state (a TF strategy and its servers) that failed may have left that state
            # broken, and the case's sockets were cut: its processes are not trusted with the next case
            kept_state_broken = case.setting.process_affinity and result.status not in ("ok", "unsupported")
            if not result.reusable or kept_state_broken:
                group.kill()
                group, broken_before = None, True
            elif served >= options.recycle_after and queue:
                group.close()
                group, broken_before = None, True  # the replacement comes warm from the spare after the first
            if group is None:
                served = 0
        completed = True
    finally:
        if group is not None and warm is not None and completed:
            warm.give(warm_key, group)
        elif group is not None:
            group.close()
        supply.close()
        with lock:
            report.groups_started += supply.started
