"""Plan the (model, setting) cases of a run and stream the uncommitted ones through warm worker groups."""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from difftest.contracts.errors import UserError
from difftest.contracts.registry import get_setting, load_run_plugins, select_settings, with_references
from difftest.contracts.setting import Outputs, Setting
from difftest.contracts.spec import RunConfig
from difftest.contracts.status import Status
from difftest.runner.executor import Case, Executor, ExecutorConfig, SweepContext, SweepOptions
from difftest.runner.local import LocalExecutor, WarmGroups
from difftest.runner.pool import CaseResult
from difftest.storage.run_folder import SWEEP_MARKER, list_models
from difftest.storage.store import CaseRecord, Store


@dataclass
class SweepReport:
    total: int = 0
    skipped_done: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    groups_started: int = 0
    cases_rerun: int = 0  # started again on another node after theirs went away (recorded once all the same)
    executor_note: str = ""  # what the executor has to say about its run (Ray: nodes, gangs, cases re-run)


def plan_cases(run_dir: Path, options: SweepOptions) -> list[Case]:
    import fnmatch

    if options.pairs is not None:
        return _plan_pairs(run_dir, options.pairs, options.calibrated_pairs, options.referenced_pairs)
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


def _plan_pairs(run_dir: Path, pairs: tuple[tuple[str, str], ...], calibrated: tuple[tuple[str, str], ...] | None = None,
                referenced: tuple[tuple[str, str], ...] | None = None) -> list[Case]:
    models = {spec.model_id: (d, spec) for d, spec in list_models(run_dir)}
    cases: dict[tuple[str, str], Case] = {}
    for model_id, name in pairs:
        if model_id not in models:
            raise UserError(f"{run_dir / 'models'}: no model {model_id}")
        model_dir, spec = models[model_id]
        calibrate = calibrated is None or (model_id, name) in calibrated
        alone = referenced is not None and (model_id, name) not in referenced
        for setting in [get_setting(name)] if alone else with_references([get_setting(name)], calibrate=calibrate):
            cases.setdefault((model_id, setting.name), Case(model_id, model_dir, spec, setting))
    return list(cases.values())


def _device_refusal(options: SweepOptions, setting: Setting) -> str | None:
    """Why the sweep's device and backend cannot run `setting`: collectives the backend does not carry there (on any
    executor), or too few GPUs on this machine (local executor; a cluster's GPUs are its nodes')."""
    if options.device != "cuda":
        return None
    from difftest.contracts.devices import collective_refusal, device_refusal, visible_gpus

    backend = options.resolved_backend
    return collective_refusal(options.device, backend, setting.world_size, setting.collectives) or (
        device_refusal(options.device, backend, setting.world_size, visible_gpus())
        if options.executor.kind == "local" else None)


def run_sweep(
    run_dir: Path,
    options: SweepOptions,
    on_result: Callable[[Case, CaseRecord], None] | None = None,
    on_planned: Callable[[list[Case], int], None] | None = None,
    warm: WarmGroups | None = None,
) -> SweepReport:
    config = RunConfig.load(run_dir / "run.json")
    plugins = load_run_plugins(run_dir, options.plugins)
    cases = plan_cases(run_dir, options)
    store = Store(run_dir)
    report = SweepReport(total=len(cases))
    lock = threading.Lock()
    marker = run_dir / SWEEP_MARKER
    marker.write_text(f"{os.getpid()}\n")

    def record(case: Case, record: CaseRecord, outputs: Outputs | None) -> None:
        record = store.commit(record, outputs)
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
                or _device_refusal(options, case.setting)
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
            record(case, CaseRecord(case.model_id, case.setting.name, Status.UNSUPPORTED, reason), None)

        def report_result(case: Case, result: CaseResult) -> None:
            record(case, CaseRecord(case.model_id, case.setting.name, result.status, result.message, result.rank,
                                    round(result.wall_s, 4) if result.wall_s else None), result.outputs)

        executor = _make_executor(options.executor, warm)
        ran = executor.run(SweepContext(run_dir, config, options, plugins), dict(pending), report_result)
        report.groups_started += ran.groups_started
        report.cases_rerun, report.executor_note = ran.cases_rerun, ran.note
    finally:
        store.close()
        marker.unlink(missing_ok=True)
    return report


def _make_executor(config: ExecutorConfig, warm: WarmGroups | None) -> Executor:
    if config.kind == "local":
        return LocalExecutor(warm)
    from difftest.runner.ray_executor import RayExecutor  # the `[ray]` extra: imported only when asked for

    return RayExecutor(config)
