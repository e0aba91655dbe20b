"""What follows a sweep, as one explicit pipeline: judge → triage → minimise → standalone scripts → report (ISSUE.md per finding,
report.html).

Every command that ends a run (`run`, `sweep`, `quant`, `analyze`) calls `run_pipeline` with one `PipelineOptions`;
each step is a function of the steps before it, and what a person sees of each step goes through `PipelineEvents`
(the CLI prints it; a test or another front end may listen or not).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from difftest.contracts.tolerance import Tolerance
from difftest.runner.executor import SweepOptions

if TYPE_CHECKING:
    from difftest.findings.minimise import Minimisation
    from difftest.findings.triage import Finding
    from difftest.judging.analysis import Analysis, Judged
    from difftest.scripts.write import Emitted

@dataclass(frozen=True)
class PipelineOptions:
    """The options every step after a sweep shares."""

    tolerance: Tolerance = field(default_factory=Tolerance)
    oracle: str = "calibrated"  # one of difftest.judging.analysis.ORACLES
    minimise_budget_s: float = 20.0  # per finding; 0: no minimisation
    shrink_budget_s: float = 0.0  # per finding's script, for trials (`difftest.scripts.shrink`); 0: none
    timeout_s: float = SweepOptions.timeout_s  # per case the minimiser runs
    device: str = SweepOptions.device
    # each finding's standalone script is run once, in a process where difftest does not import, within this many
    # seconds; 0: written, not run
    check_standalone_s: float = 120.0
    # which findings deserve minimisation and a checked script (default: all); a campaign spends neither on what the
    # manifest or an earlier round already explains
    focus: Callable[[Finding], bool] | None = None
    # the causes a baseline accepts (`difftest.reporting.ci_summary`): summary.json and junit.xml mark them; None: no baseline
    baseline: frozenset[str] | None = None


class PipelineEvents:
    """What the pipeline tells as it goes; every method does nothing here, a front end overrides what it shows."""

    def judged(self, analysis: Analysis) -> None: ...

    def triaged(self, findings: list[Finding], seconds: float) -> None: ...

    def minimising(self, fresh: int, kept: int, budget_s: float) -> None: ...

    def minimise_round(self, number: int, work: list[Minimisation], seconds: float, built_s: float,
                       cases: int) -> None: ...

    def minimised(self, seconds: float) -> None: ...

    def standalone(self, emitted: list[Emitted], seconds: float) -> None: ...


@dataclass(frozen=True)
class PipelineResult:
    analysis: Analysis
    findings: list[Finding]
    minimised: list[Minimisation]
    report: Path


def judge(run_dir: Path, options: PipelineOptions, judged: Judged | None = None) -> Analysis:
    """Every stored case against its reference (the CSVs of the run), less those `judged` already holds. The run's
    plugins are imported here, from where its commands ran if not from here: minimisation's groups inherit them."""
    from difftest.contracts.registry import load_run_plugins
    from difftest.judging.analysis import analyze

    return analyze(run_dir, options.tolerance, load_run_plugins(run_dir), options.oracle, judged)


def triage_run(run_dir: Path, analysis: Analysis) -> list[Finding]:
    """The distinct findings (findings.csv, findings.md), each with its folder and reproducer."""
    from difftest.findings.triage import triage
    from difftest.reporting.finding_folders import write_finding_folders
    from difftest.reporting.findings_table import write_findings
    from difftest.scripts.write import script_lines

    # a finding is minimised, reproduced and scripted through the setting of its shortest script
    found = triage(run_dir, analysis, functools.partial(script_lines, run_dir))
    write_findings(run_dir, found)
    write_finding_folders(run_dir, found)
    return found


def minimise(run_dir: Path, findings: list[Finding], analysis: Analysis, options: PipelineOptions,
             events: PipelineEvents,
             on_done: Callable[[Minimisation], None] | None = None) -> list[Minimisation]:
    """Each finding's example shrunk within its budget (`on_done` told of each as soon as it is final); a run still
    being swept, or a budget of 0, keeps what earlier triages of the run minimised."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.minimise import load_previous, minimise

    budget = options.minimise_budget_s
    if not findings:
        return []
    if budget <= 0 or analysis.sweep_running:
        return [m for f in findings if (m := load_previous(run_dir, f, 0.0)) is not None]
    started = time.perf_counter()
    fresh = sum(load_previous(run_dir, f, budget) is None for f in findings)
    events.minimising(fresh, len(findings) - fresh, budget)
    done = minimise(run_dir, findings, analysis, budget_s=budget, timeout_s=options.timeout_s, device=options.device,
                    plugins=RunConfig.load(run_dir / "run.json").plugins, on_round=events.minimise_round,
                    on_done=on_done)
    events.minimised(time.perf_counter() - started)
    return done


def run_pipeline(run_dir: Path, options: PipelineOptions, events: PipelineEvents | None = None,
                 judged: Judged | None = None) -> PipelineResult:
    """judge → triage → minimise → standalone scripts → report, on a swept (or still sweeping) run folder; a run
    still being swept gets no scripts (its findings are not final). `judged`: the sweep's own judgements of its cases
    (`LiveFindings.judged`), made with `options`' tolerance and oracle: not made again."""
    from difftest.reporting.ci_summary import summarise
    from difftest.reporting.findings_table import write_findings
    from difftest.reporting.issue_report import write_issues
    from difftest.reporting.report import write_report
    from difftest.scripts.write import StandaloneScripts
    from difftest.storage import integrity

    integrity.check_models(run_dir)  # what the cases ran on is what generate wrote
    integrity.check_store(run_dir)  # a damaged store is never judged as an empty one
    events = events or PipelineEvents()
    started = time.perf_counter()
    analysis = judge(run_dir, options, judged)
    events.judged(analysis)
    findings = triage_run(run_dir, analysis)
    events.triaged(findings, time.perf_counter() - started)
    focused = [f for f in findings if options.focus is None or options.focus(f)]
    # a running sweep's findings are not final: they get no scripts
    scripts = None if analysis.sweep_running else StandaloneScripts(run_dir, focused, options.tolerance,
                                                                      options.check_standalone_s,
                                                                      options.shrink_budget_s)
    minimised = minimise(run_dir, focused, analysis, options, events,
                         on_done=scripts.finding_done if scripts is not None else None)
    if scripts is not None:
        started = time.perf_counter()
        emitted = scripts.finish(minimised)
        write_findings(run_dir, findings)  # again: it names each finding's script
        events.standalone(emitted, time.perf_counter() - started)
    write_issues(run_dir, analysis, findings, minimised)
    summarise(run_dir, analysis, findings, set(options.baseline) if options.baseline is not None else None)
    report = write_report(run_dir, analysis, findings, minimised, options.tolerance)
    if not analysis.sweep_running:
        integrity.keep_last_good(run_dir)
    return PipelineResult(analysis, findings, minimised, report)
