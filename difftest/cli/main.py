"""The `difftest` command line: generate → sweep → analyze, or all three with `run`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from difftest.contracts.errors import UserError
from difftest.contracts.spec import RunConfig
from difftest.contracts.status import NOT_OK, Status
from difftest.contracts.tolerance import Tolerance
from difftest.pipeline import PipelineEvents, PipelineOptions, run_pipeline
from difftest.releases.bisect import REPRODUCER_TIMEOUT_S
from difftest.reporting.progress import SweepProgress, status_counts
from difftest.runner.executor import ExecutorConfig, SweepOptions
from difftest.storage import integrity
from difftest.storage.paths import absolute, shown

if TYPE_CHECKING:
    from difftest.findings.minimise import Minimisation
    from difftest.findings.triage import Finding
    from difftest.judging.analysis import Analysis, Judged
    from difftest.runner.executor import Case
    from difftest.scripts.write import Emitted
    from difftest.storage.store import CaseRecord

app = typer.Typer(
    help="Differential testing of distributed/quantized training settings against a single-process reference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    """`--version`: difftest's release and the stack it would test (every library a finding can live in)."""
    if not value:
        return
    from difftest.storage import stack

    print(f"difftest {stack.difftest_version()}\nstack under test: {stack.describe(stack.current())}")
    raise typer.Exit()


@app.callback()
def _options_of_every_command(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print difftest's version and the stack under test, then exit.")] = False,
) -> None:
    """Differential testing of distributed/quantized training settings against a single-process reference."""


settings_app = typer.Typer(help="Inspect the registered settings.", no_args_is_help=True)
app.add_typer(settings_app, name="settings")
# off a terminal a message is one line, whatever its length (a log is read with grep); on one, rich fits the live
# progress display to the terminal's width
console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
# off a terminal (CI logs, files, pipes) nothing limits the width: tables keep full kind and setting names
out_console = Console() if sys.stdout.isatty() else Console(width=1000)

DEFAULT_OUT = Path("results/default")
_SWEPT: list[Path] = []  # the run folders this process has swept, the last one being swept now

# Shared options --------------------------------------------------------------------------------------
SettingsOpt = Annotated[str | None, typer.Option("--settings", help="Comma-separated globs over setting names, e.g. 'reference,torchrec/*/ws2'.")]
JobsOpt = Annotated[int | None, typer.Option("--jobs", min=1, help="Worker groups running at once (default: locally, as many as the machine's cores hold ranks, one core per rank; with --executor ray, as many gangs of two ranks as the cluster's CPUs hold).")]
ExecutorOpt = Annotated[str, typer.Option("--executor", help="local: worker groups on this machine; ray: gangs on a Ray cluster (the \\[ray] extra; see --address).")]
AddressOpt = Annotated[str | None, typer.Option("--address", help="With --executor ray: the cluster to run on ('auto' or HOST:PORT of its head, as `ray start --head` prints); without it, Ray starts on this machine alone.")]
CpusPerRankOpt = Annotated[float, typer.Option("--cpus-per-rank", min=0.01, help="With --executor ray: CPUs each rank's bundle reserves on its node.")]
# every option's one default: the options objects the commands fill (a command declares its own only where none
# has it; tests/test_units.py checks every command against them)
DEFAULTS, SWEEP, EXECUTOR, RUN = PipelineOptions(), SweepOptions(), ExecutorConfig(), RunConfig()
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Seconds a case may take before its group is killed and it is recorded as timeout.")]
PluginOpt = Annotated[list[str] | None, typer.Option("--plugin", help="Extra module registering settings/generators (repeatable); workers import it too.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu (gloo) or cuda (nccl, one GPU per rank).")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="gloo or nccl (default: gloo on cpu, nccl on cuda). With --device cuda, gloo lets several ranks share one GPU (rank r on GPU r mod the GPUs there are).")]
AtolOpt = Annotated[float, typer.Option("--atol", min=0, help="Absolute tolerance of the allclose verdict.")]
RtolOpt = Annotated[float, typer.Option("--rtol", min=0, help="Relative tolerance of the allclose verdict.")]
OracleOpt = Annotated[str, typer.Option(
    "--oracle", help="calibrated: judge each case by its distance to its root's float64 run against the envelope of "
    "legitimate results (difftest.judging.envelope), D3's allclose where no envelope applies; d3: allclose only. Both "
    "verdicts are written either way (verdict, d3_verdict).")]
FailOpt = Annotated[bool, typer.Option("--fail-on-inconsistency", help="Exit 1 when any case is inconsistent, errored, crashed or timed out.")]
BaselineOpt = Annotated[Path | None, typer.Option("--baseline", help="Accepted causes: a JSON list of cause keys, or an earlier run's summary.json. Exit 1 only when a finding's cause is not in it (summary.json and junit.xml mark the accepted ones).")]
# the built-in kinds, written out so that --help needs no import of torch (a test keeps the list in step)
BUILTIN_KINDS = ("dlrm", "torchrec-dlrm", "torchrec-deepfm", "transformer", "transformer-looped", "sequential", "keras-dag",
                 "keras-transformer")
KindOpt = Annotated[str, typer.Option("--kind", help=f"Model kind to generate: {', '.join(BUILTIN_KINDS)} (needs the \\[tf] extra), a model zoo's (hf-llama, hf-qwen2, hf-qwen3, hf-mixtral, hf-gpt2, hf-bert, timm-resnet, timm-vit, timm-convnext: the \\[zoo] extra; titan-llama3, titan-qwen3: the \\[titan] extra), a kind a --plugin registers, or 'all' (every kind this machine can build).")]
TierOpt = Annotated[str | None, typer.Option("--tier", help="default: every family, sharding type, schedule, quantization scheme and oracle once, at the smallest world size (a few minutes); full: every registered setting. Without --tier: default, or full when --settings is given (a glob then means all it matches).")]
ShrinkOpt = Annotated[float, typer.Option("--shrink-budget", min=0, help="Seconds per finding to shrink its standalone script by trials (statements removed one at a time while it still shows the same bug); 0: only what never ran is removed; 60 before filing a finding.")]
MinimiseOpt = Annotated[float, typer.Option("--minimise-budget", "--minimize-budget", min=0, help="Seconds per finding to shrink its example case (fewer tables, layers, rows, ranks) while it still fails the same way; 0: no minimisation.")]
# the default job's models per kind where not --models: one each of the larger kinds keeps it within minutes; the
# looped transformers (the transformer's blocks applied several times) only when asked for
DEFAULT_JOB_MODELS_OF = "torchrec-dlrm=1,torchrec-deepfm=1,transformer=1,transformer-looped=0,keras-dag=1,keras-transformer=1"
DEFAULT_MODELS = 2
ModelsOfOpt = Annotated[str, typer.Option("--models-of", help="Comma-separated kind=N: models of those kinds, instead of --models ('' for none).")]
RunModelsOfOpt = Annotated[str | None, typer.Option("--models-of", help=f"Comma-separated kind=N: models of those kinds, instead of --models ('' for none). Default with --kind all: {DEFAULT_JOB_MODELS_OF}; with one --kind, --models is that kind's count.")]
ModelsFilterOpt = Annotated[str | None, typer.Option("--models-filter", help="Comma-separated globs over model ids to sweep.")]


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"), console=console, transient=False,
    )


def _models_of(text: str) -> dict[str, int]:
    counts = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, number = item.partition("=")
        if not number.isdigit():
            raise UserError(f"--models-of {text!r}: {item!r} is not kind=N; write e.g. --models-of transformer=3,keras-dag=1")
        counts[name.strip()] = int(number)
    return counts


def _default_job_models_of() -> str:
    """The default job's models per kind: a model zoo's kinds (trait "zoo", the [zoo] extra) only when asked for."""
    from difftest.contracts.registry import generator_kinds, load_plugins, traits_of

    load_plugins()
    zoo = [f"{kind}=0" for kind in generator_kinds() if "zoo" in traits_of(kind)]
    return ",".join([DEFAULT_JOB_MODELS_OF, *zoo])


def model_counts(models: int | None, models_of: str | None, kind: str,
                 default_models_of: str = DEFAULT_JOB_MODELS_OF) -> tuple[int, str, str | None]:
    """(models per kind, --models-of, one line saying which option won where they disagree) for `run`: `--kind K`
    makes `--models` mean K's count; otherwise the larger kinds keep their own default counts unless --models-of
    says otherwise."""
    count = DEFAULT_MODELS if models is None else models
    if models_of is not None:  # written by the user: it wins for the kinds it names
        named = _models_of(models_of)
        if models is not None and kind != "all" and kind in named and named[kind] != models:
            return count, models_of, (f"--models-of {kind}={named[kind]} wins over --models {models} for kind {kind}")
        return count, models_of, None
    if kind != "all":
        return count, "", None
    if models is None:
        return count, default_models_of, None
    larger = ", ".join(f"{k} {n}" for k, n in _models_of(default_models_of).items())
    return count, default_models_of, (f"--models {models} applies to the kinds without a count of their own; "
                                      f"the default job keeps {larger} (--models-of '' gives every kind --models)")


def _generate(out: Path, models: int, seed: int, kind: str, steps: int, lr: float, batch_size: int,
              plugins: tuple[str, ...], models_of: str = "", first_index: int = 0) -> None:
    from difftest.contracts.registry import generator_kinds, get_generator, kind_unavailable, load_plugins
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate

    load_plugins(plugins)
    kinds: tuple[str, ...]
    if kind == "all":
        available: list[str] = []
        for name in generator_kinds():
            why = kind_unavailable(name)
            if why:
                console.print(f"[yellow]kind {name!r} left out: it {escape(why)}")
            else:
                available.append(name)
        kinds = tuple(available)
    else:
        get_generator(kind)  # an unknown kind: one line naming the known ones
        why = kind_unavailable(kind)
        if why:
            raise UserError(f"--kind {kind}: this kind {why}")
        kinds = (kind,)
    named = _models_of(models_of)
    unknown = sorted(set(named) - set(generator_kinds()))
    if unknown:
        raise UserError(f"--models-of: no kind {', '.join(map(repr, unknown))}; the kinds are "
                        f"{', '.join(generator_kinds())} (and those a --plugin registers)")
    counts = {k: n for k, n in named.items() if k in kinds}  # kinds left out above stay out
    config = RunConfig(seed=seed, models=models, kinds=kinds, models_of=counts, steps=steps, lr=lr,
                       batch_size=batch_size, plugins=plugins, first_index=first_index)
    with _progress() as progress:
        task = progress.add_task("generate", total=sum(config.count(k) for k in kinds), detail="")
        generate(out, config, on_model=lambda m: progress.update(task, advance=1, detail=m), on_repaired=_tell_repaired)


def _adapter_kind(model: str) -> str:
    """The kind name of the ModelAdapter `module:attribute` (loaded already)."""
    import importlib

    module, _, attribute = model.partition(":")
    if not attribute:
        raise UserError(f"--model {model!r}: write MODULE:ATTRIBUTE, e.g. --model mypkg.models:adapter")
    return str(getattr(importlib.import_module(module), attribute).name)


def _record_command(run_dir: Path) -> None:
    """run.json keeps the command (as typed) that now works on the run: the report says what made it, and when."""
    from difftest.storage.run_folder import record_command

    record_command(run_dir, ["difftest", *sys.argv[1:]])


def _tell_repaired(path: Path) -> None:
    console.print(f"recreated {escape(shown(path))}: byte for byte what generate first wrote", highlight=False)


def _executor(executor: str, address: str | None, cpus_per_rank: float) -> ExecutorConfig:

    config = ExecutorConfig(kind=executor, address=address, cpus_per_rank=cpus_per_rank)  # checks the combination
    if executor == "ray":
        from difftest.runner.ray_executor import import_ray, probe_address

        import_ray()  # a missing extra or a dead address fails here, before anything is generated
        if address:
            probe_address(address)
    return config


def _check_devices(device: str, backend: str | None, executor: object = None) -> None:
    """One line, before anything runs, when the device options cannot work here."""
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: use cpu or cuda")
    if backend not in (None, "gloo", "nccl"):
        raise UserError(f"--backend {backend!r}: use gloo or nccl")
    if backend == "nccl" and device != "cuda":
        raise UserError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only); use gloo on the CPU")
    if device == "cuda" and getattr(executor, "kind", "local") == "local":  # a Ray cluster's GPUs are on its nodes
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"--device cuda: torch {torch.__version__} sees no CUDA device on this machine; "
                            "run on a machine with a GPU and a CUDA build of torch, or use --device cpu")


def _check_jobs(jobs: int | None, executor: object = None) -> None:
    from difftest.runner.scheduler import RANKS_BEYOND_CORES, ranks_at_once

    if jobs is not None and getattr(executor, "kind", "local") == "local" and jobs > (ranks := ranks_at_once()):
        raise UserError(f"--jobs {jobs}: this machine runs {ranks} ranks at once (one per core, {RANKS_BEYOND_CORES} "
                        f"more for the time ranks wait on their peers), so at most {ranks} worker groups; leave --jobs "
                        "out to use them all")


def _sweep(out: Path, settings: str | None, models_filter: str | None, jobs: int | None, timeout: float, device: str, plugins: tuple[str, ...], twice: bool = False, tier: str | None = None, executor: ExecutorConfig | None = None, backend: str | None = None, judging: PipelineOptions | None = None) -> Judged:
    """Sweep the run; its cases as the live findings judged them with `judging` (what its pipeline need not judge
    again)."""
    from difftest.contracts.registry import load_run_plugins
    from difftest.runner.sweep import plan_cases, run_sweep

    _check_devices(device, backend, executor)  # before the libraries' imports: told in a second
    _check_jobs(jobs, executor)
    load_run_plugins(out, plugins)
    integrity.check_models(out)  # a damaged input never runs as a case
    integrity.check_store(out)  # nor is a damaged store taken for an empty one
    options = SweepOptions(settings=settings, tier=tier, models=models_filter, jobs=jobs, timeout_s=timeout, device=device, plugins=plugins, twice=twice, executor=executor or ExecutorConfig(), backend=backend)
    plan_cases(out, options)  # bad input fails here, before any progress bar or worker starts
    _SWEPT.append(out)  # what an interruption's line counts
    from difftest.storage import stack

    before = stack.record(out / "run.json")
    if before is not None and before.get("libraries") != stack.recorded(out).get("libraries"):
        console.print(f"[yellow]{escape(shown(out))} was swept before on another stack ({escape(stack.describe(before))}); "
                      "run.json keeps both, and its results now mix them", highlight=False)
    from difftest.findings.live import LiveFindings

    started = time.perf_counter()
    with SweepProgress(console) as progress:
        judged_as = judging or PipelineOptions()  # the live findings judge as the pipeline after the sweep will
        live = LiveFindings(out, judged_as.tolerance, judged_as.oracle, on_new=progress.finding)

        def on_result(case: Case, record: CaseRecord) -> None:
            live.result(case, record)
            progress.result(record.setting, record.status, findings=len(live.found))

        def on_planned(cases: list[Case], refused: int) -> None:
            live.planned(cases)
            progress.planned([c.setting.name for c in cases], refused)

        try:
            report = run_sweep(out, options, on_result=on_result, on_planned=on_planned)
        finally:
            live.close()
    integrity.keep_last_good(out)
    first = min((f.seconds for f in live.found.values()), default=None)
    console.print(
        f"sweep: {report.total} cases, {report.skipped_done} already done, ran {sum(report.statuses.values())} "
        f"({status_counts(report.statuses)}) with {report.groups_started} worker group(s) in {time.perf_counter() - started:.1f}s"
        + (f"; {report.executor_note}" if report.executor_note else "")
        + (f"; {live.cases_not_ok} case(s) not ok under {len(live.found)} signature(s) so far, the first after "
           f"{first:.0f}s" if first is not None else "")
    )
    return live.judged() if judging is not None else {}  # judged as the caller's pipeline will judge


def _options(atol: float, rtol: float, oracle: str, minimise_budget: float, timeout: float,
             device: str, shrink_budget: float = DEFAULTS.shrink_budget_s) -> PipelineOptions:
    return PipelineOptions(Tolerance(atol=atol, rtol=rtol), oracle, minimise_budget, shrink_budget, timeout, device)


class _ConsoleEvents(PipelineEvents):
    """The pipeline's steps as the terminal shows them: tables on stdout, progress on stderr."""

    def __init__(self, out: Path, options: PipelineOptions) -> None:
        self.out, self.options = out, options

    def judged(self, analysis: Analysis) -> None:
        out, tol = self.out, self.options.tolerance
        frame = analysis.by_kind
        table = Table(title=f"per model kind (allclose atol={tol.atol:g}, rtol={tol.rtol:g}; per setting: "
                            f"{shown(out / 'summary.csv')})")
        table.add_column(frame.index.name or "")
        for column in frame.columns:
            table.add_column(str(column), justify="right")
        for index, row in frame.iterrows():
            cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row]
            style = "red" if any(row.get(s, 0) for s in NOT_OK) else None
            table.add_row(str(index), *cells, style=style)
        out_console.print(table)
        counts = {s: analysis.count(s) for s in NOT_OK + (Status.UNSUPPORTED,)}
        cases = analysis.cases
        judged = cases[cases["calibrated"].astype(bool)]
        out_console.print(
            f"calibrated oracle: {len(judged)} cases judged against their root's float64 envelope; it flags "
            f"{int((judged['verdict'] != Status.OK).sum())}, D3's allclose "
            f"{int((judged['d3_verdict'] != Status.OK).sum())} of "
            f"them (columns verdict / d3_verdict of {shown(out / 'comparisons.csv')})", highlight=False)
        out_console.print(
            f"{len(analysis.cases)} cases: " + ", ".join(f"{k} {v}" for k, v in counts.items())
            + f"\n{shown(out / 'inconsistencies.csv')} ({len(analysis.inconsistencies)} rows), {shown(out / 'comparisons.csv')} "
            f"({len(analysis.comparisons)} rows), {shown(out / 'by_feature.csv')} (verdicts per layer kind × setting)"
        )
        if analysis.superseded is not None:
            out_console.print(f"this analysis judged {len(analysis.cases)} cases, fewer than the last one: what that "
                              f"one wrote is kept in {shown(analysis.superseded)}", style="yellow", highlight=False)
        if analysis.sweep_running:
            out_console.print(f"a sweep is still writing {shown(out)}: this is a snapshot of the {len(analysis.cases)} "
                              "cases it has committed so far", style="yellow")

    def triaged(self, findings: list[Finding], seconds: float) -> None:
        console.print(f"triage: {len(findings)} findings in {seconds:.1f}s", highlight=False)

    def minimising(self, fresh: int, kept: int, budget_s: float) -> None:
        console.print(f"minimising {fresh} findings (at most {budget_s:g}s each; --minimise-budget 0 skips this); "
                      f"{kept} minimised by an earlier triage of this run", highlight=False)

    def minimise_round(self, number: int, work: list[Minimisation], seconds: float, built_s: float,
                       cases: int) -> None:
        active = sum(m.active for m in work)
        console.print(f"minimise round {number}: {cases} cases in {seconds:.1f}s (their models built in "
                      f"{built_s:.1f}s); {active} of {len(work)} findings still shrinking", highlight=False)

    def minimised(self, seconds: float) -> None:
        console.print(f"minimised in {seconds:.1f}s", highlight=False)

    def standalone(self, emitted: list[Emitted], seconds: float) -> None:
        scripts = [e for e in emitted if e.path is not None]
        reproducing = sum(e.checked is not None and e.checked.reproduces for e in scripts)
        ours = [e for e in emitted if e.our_defect]
        console.print(f"standalone scripts (no difftest needed): {len(scripts)} of {len(emitted)} findings, "
                      f"{reproducing} reproducing when run alone; {seconds:.1f}s after minimisation (a script starts "
                      "as soon as its finding is minimal)"
                      + ("; findings.md says why the others have none" if len(scripts) < len(emitted) else ""),
                      highlight=False)
        for e in ours:
            console.print(f"  {e.finding_id}: {escape(e.describe())}", style="yellow", highlight=False, soft_wrap=True)
        if ours:
            console.print(f"{len(ours)} finding(s) lack a checked script through a defect of difftest's (above; "
                          "please report it to difftest, not upstream)", style="yellow", highlight=False)


def _analyze(out: Path, options: PipelineOptions, fail: bool = False, new_only: bool = False,
             baseline: Path | None = None, judged: Judged | None = None) -> None:
    """The pipeline after a sweep, shown on the terminal; exit 1 with `fail` while a case is not ok, or with a
    `baseline` while a finding's cause is not in it."""
    import dataclasses

    from difftest.reporting.ci_summary import SUMMARY_FILE, cause_key, load_baseline

    if baseline is not None:
        options = dataclasses.replace(options, baseline=frozenset(load_baseline(absolute(baseline))))
    result = run_pipeline(out, options, _ConsoleEvents(out, options), judged)
    _print_findings(out, result.findings, result.minimised, result.report, new_only)
    if options.baseline is not None:
        unaccepted = [f for f in result.findings if cause_key(f) not in options.baseline]
        out_console.print(f"baseline {shown(absolute(baseline or out))}: {len(result.findings) - len(unaccepted)} "
                          f"finding(s) accepted, {len(unaccepted)} not" + (f" ({', '.join(f.id for f in unaccepted)}; "
                          f"their causes are in {shown(out / SUMMARY_FILE)})" if unaccepted else ""), highlight=False)
        if unaccepted:
            raise typer.Exit(1)
    if fail and any(result.analysis.count(s) for s in NOT_OK):
        raise typer.Exit(1)


def _print_findings(out: Path, findings: list[Finding], minimised: list[Minimisation], report: Path,
                    new_only: bool = False) -> None:
    from difftest.findings.known import Upstream
    from difftest.findings.triage import upstream_counts

    if not findings:
        out_console.print(f"no findings: every case that ran agreed with its reference. Report: {shown(report)}")
        return
    smallest = {m.finding_id: m for m in minimised}
    listed = [f for f in findings if f.upstream == Upstream.NEW] if new_only else findings
    listed_here = listed[:30]
    out_console.print(f"{len(findings)} distinct findings, ranked by consequence ({shown(out / 'findings.md')}); upstream: "
                      f"{upstream_counts(findings)}" + (" (only the new ones below)" if new_only else "") + ":",
                      highlight=False)
    for f in listed_here:
        m = smallest.get(f.id)
        minimal = ""
        if m is not None and m.best is not m.original:
            size = m.size()
            minimal = " — minimal: " + ", ".join(f"{k} {v}" for k, v in size.items() if k not in ("parameters",))
        title = f.title if len(f.title) <= 110 else f.title[:109] + "…"
        out_console.print(f"  {f.rank:>2}. {f.id} {f.status:<12} {f.upstream!s:<10} {len(f.rows):>3} case(s)  "
                          f"{escape(title)}{minimal}", highlight=False, soft_wrap=True)
    if len(listed) > len(listed_here):
        out_console.print(f"  … and {len(listed) - len(listed_here)} more in {shown(out / 'findings.csv')}")
    out_console.print(f"each one: `difftest show {shown(out)} <id>` (its ISSUE.md), `difftest repro {shown(out)} <id>` "
                      f"(its minimal case); without difftest: python {shown(out / 'findings')}/<id>/standalone.py\n"
                      f"report: {shown(report)}", highlight=False)


@app.command()
def run(
    out: Annotated[Path, typer.Option("--out", help="Run folder; an existing one is resumed.")] = DEFAULT_OUT,
    models: Annotated[int | None, typer.Option("--models", min=1, help=f"Models per kind (default {DEFAULT_MODELS}); with --kind all the larger kinds keep --models-of's counts.")] = None,
    models_of: RunModelsOfOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Generation seed.")] = 0,
    kind: KindOpt = "all",
    settings: SettingsOpt = None,
    tier: TierOpt = None,
    jobs: JobsOpt = None,
    executor: ExecutorOpt = EXECUTOR.kind,
    address: AddressOpt = None,
    cpus_per_rank: CpusPerRankOpt = EXECUTOR.cpus_per_rank,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Training steps per case.")] = RUN.steps,
    lr: Annotated[float, typer.Option("--lr", help="SGD learning rate.")] = RUN.lr,
    batch_size: Annotated[int, typer.Option("--batch-size", min=12, help="Global batch (a multiple of 12).")] = RUN.batch_size,
    atol: AtolOpt = DEFAULTS.tolerance.atol,
    rtol: RtolOpt = DEFAULTS.tolerance.rtol,
    oracle: OracleOpt = DEFAULTS.oracle,
    device: DeviceOpt = SWEEP.device,
    backend: BackendOpt = None,
    plugin: PluginOpt = None,
    fail_on_inconsistency: FailOpt = False,
    baseline: BaselineOpt = None,
    minimise_budget: MinimiseOpt = DEFAULTS.minimise_budget_s,
    shrink_budget: ShrinkOpt = DEFAULTS.shrink_budget_s,
    model: Annotated[str | None, typer.Option("--model", help="Your own model: MODULE:ATTRIBUTE naming a difftest.ModelAdapter (docs/your-model.md); the run takes that kind only.")] = None,
) -> None:
    """Generate models, sweep the default tier, analyse, group what is not ok into findings and shrink each one's
    example: the whole job on a small default."""
    out = absolute(out)
    from difftest.contracts.registry import load_plugins, select_settings

    # the options that need no registry first: a mistyped one is told in a second, not after the libraries' imports
    where = _executor(executor, address, cpus_per_rank)
    _check_devices(device, backend, where)
    _check_jobs(jobs, where)
    plugins = tuple(plugin or ()) + ((model,) if model else ())
    load_plugins(plugins)
    if model:
        kind = _adapter_kind(model)
    select_settings(settings, tier)  # a glob that selects nothing fails before any model is written
    count, models_of, which_wins = model_counts(models, models_of, kind, _default_job_models_of())
    if which_wins:
        console.print(which_wins, highlight=False)
    if getattr(where, "kind", "local") == "local":
        from difftest.runner.pool import start_rank_server

        start_rank_server(device)  # its imports overlap the models' generation
    _generate(out, count, seed, kind, steps, lr, batch_size, plugins, models_of)
    _record_command(out)
    judging = _options(atol, rtol, oracle, minimise_budget, timeout, device, shrink_budget)
    judged = _sweep(out, settings, None, jobs, timeout, device, plugins, tier=tier, executor=where, backend=backend,
                    judging=judging)
    _analyze(out, judging, fail_on_inconsistency, baseline=baseline, judged=judged)


@app.command()
def generate(
    out: Annotated[Path, typer.Option("--out", help="Run folder to create; on an existing run, the options it was made with are taken where none is given, and its missing or damaged files are recreated.")] = DEFAULT_OUT,
    models: Annotated[int | None, typer.Option("--models", min=1, help="Models per kind (default 2).")] = None,
    models_of: Annotated[str | None, typer.Option("--models-of", help="Comma-separated kind=N: models of those kinds, instead of --models.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Generation seed (default 0).")] = None,
    kind: Annotated[str | None, typer.Option("--kind", help=f"Model kind to generate: {', '.join(BUILTIN_KINDS)} (needs the \\[tf] extra), a model zoo's (hf-llama, hf-mixtral, timm-vit, …: the \\[zoo] extra; titan-llama3, titan-qwen3: the \\[titan] extra), a kind a --plugin registers, or 'all' (the default: every kind this machine can build).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help=f"Training steps per case (default: the run's own, else {RUN.steps}).")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help=f"SGD learning rate (default: the run's own, else {RUN.lr}).")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", min=12, help=f"Global batch, a multiple of 12 (default: the run's own, else {RUN.batch_size}).")] = None,
    plugin: PluginOpt = None,
) -> None:
    """Generate model specs, initial weights and inputs, reproducible from (seed, index), and record each file's
    digest. On an existing run folder, given no options, it takes the run's own and recreates exactly the files that
    are missing or damaged, byte for byte."""
    from difftest.contracts.registry import load_run_plugins
    from difftest.contracts.spec import RunConfig

    out, plugins = absolute(out), tuple(plugin or ())
    given = (models, models_of, seed, kind, steps, lr, batch_size)
    if (out / "run.json").is_file() and all(option is None for option in given):
        from difftest.generation.generate import generate as generate_run

        config = RunConfig.load(out / "run.json")
        load_run_plugins(out, plugins)  # from where the run was made, if not from here
        with _progress() as progress:
            task = progress.add_task("generate", total=sum(config.count(k) for k in config.kinds), detail="")
            generate_run(out, config, on_model=lambda m: progress.update(task, advance=1, detail=m),
                         on_repaired=_tell_repaired)
        _record_command(out)
        return
    _generate(out, 2 if models is None else models, seed or 0, kind or "all", steps or 1, 0.1 if lr is None else lr,
              batch_size or 24, plugins, models_of or "")
    _record_command(out)  # with where its plugins came from: a sweep from elsewhere imports them from there


@app.command()
def sweep(
    run_dir: Annotated[Path, typer.Argument(help="A folder made by `difftest generate`.")],
    settings: SettingsOpt = None,
    tier: TierOpt = None,
    models_filter: ModelsFilterOpt = None,
    jobs: JobsOpt = None,
    executor: ExecutorOpt = EXECUTOR.kind,
    address: AddressOpt = None,
    cpus_per_rank: CpusPerRankOpt = EXECUTOR.cpus_per_rank,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    device: DeviceOpt = SWEEP.device,
    backend: BackendOpt = None,
    plugin: PluginOpt = None,
    twice: Annotated[bool, typer.Option("--twice", help="Also run every selected setting a second time (rerun/<name>), judged bitwise against the first: differences are `nondeterministic`.")] = False,
    atol: AtolOpt = DEFAULTS.tolerance.atol,
    rtol: RtolOpt = DEFAULTS.tolerance.rtol,
    oracle: OracleOpt = DEFAULTS.oracle,
    minimise_budget: MinimiseOpt = DEFAULTS.minimise_budget_s,
    shrink_budget: ShrinkOpt = DEFAULTS.shrink_budget_s,
) -> None:
    """Run every (model, setting) case not yet committed in RUN_DIR (a rerun resumes), then analyse and triage."""
    run_dir = absolute(run_dir)
    _record_command(run_dir)
    where = _executor(executor, address, cpus_per_rank)
    judging = _options(atol, rtol, oracle, minimise_budget, timeout, device, shrink_budget)
    judged = _sweep(run_dir, settings, models_filter, jobs, timeout, device, tuple(plugin or ()), twice, tier, where,
                    backend, judging)
    _analyze(run_dir, judging, judged=judged)


QUANT_SETTINGS = "quant/*"


@app.command()
def quant(
    run_dir: Annotated[Path, typer.Argument(help="A folder made by `difftest generate` (or `difftest run`).")],
    settings: Annotated[str | None, typer.Option("--settings", help="Globs over the quantization settings (default: all of them, 'quant/*').")] = None,
    models_filter: ModelsFilterOpt = None,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    atol: AtolOpt = DEFAULTS.tolerance.atol,
    rtol: RtolOpt = DEFAULTS.tolerance.rtol,
    oracle: OracleOpt = DEFAULTS.oracle,
    device: DeviceOpt = SWEEP.device,
    backend: BackendOpt = None,
    plugin: PluginOpt = None,
    executor: ExecutorOpt = EXECUTOR.kind,
    address: AddressOpt = None,
    cpus_per_rank: CpusPerRankOpt = EXECUTOR.cpus_per_rank,
    fail_on_inconsistency: FailOpt = False,
    minimise_budget: MinimiseOpt = DEFAULTS.minimise_budget_s,
    shrink_budget: ShrinkOpt = DEFAULTS.shrink_budget_s,
) -> None:
    """The quantization sweep: every quantized setting on RUN_DIR's models, single process, then analyse.

    Sharded quantized embeddings are judged against the unsharded quantized model (oracle 1); unsharded
    quantized models against float within the error their rounding allows, reported beside the measured error
    (oracle 2). The float references run too, where RUN_DIR has not run them yet.
    """
    from difftest.contracts.registry import load_run_plugins

    plugins, run_dir = tuple(plugin or ()), absolute(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UserError(f"{run_dir}: no run.json; make the run first with `difftest generate --out {run_dir}`")
    load_run_plugins(run_dir, plugins)
    _record_command(run_dir)
    where = _executor(executor, address, cpus_per_rank)
    judging = _options(atol, rtol, oracle, minimise_budget, timeout, device, shrink_budget)
    judged = _sweep(run_dir, settings or QUANT_SETTINGS, models_filter, None, timeout, device, plugins, executor=where,
                    backend=backend, judging=judging)
    _analyze(run_dir, judging, fail_on_inconsistency, judged=judged)


@app.command()
def analyze(
    run_dir: Annotated[Path, typer.Argument(help="A swept run folder (or one whose sweep is still going).")],
    atol: AtolOpt = DEFAULTS.tolerance.atol,
    rtol: RtolOpt = DEFAULTS.tolerance.rtol,
    oracle: OracleOpt = DEFAULTS.oracle,
    fail_on_inconsistency: FailOpt = False,
    baseline: BaselineOpt = None,
    minimise_budget: MinimiseOpt = DEFAULTS.minimise_budget_s,
    shrink_budget: ShrinkOpt = DEFAULTS.shrink_budget_s,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    device: DeviceOpt = SWEEP.device,
    new_only: Annotated[bool, typer.Option("--new-only", help="List only the findings no entry of difftest/findings/known_issues.toml explains (all are still written).")] = False,
) -> None:
    """Judge stored outputs against their references (inconsistencies.csv, comparisons.csv), group what is not ok
    into distinct findings (findings.csv, findings.md), shrink each one's example (findings/<id>/{repro.py,
    minimise.json, run/}) and write report.html. A run whose sweep is still going is judged and triaged as far as
    it has got (not minimised). Also callable as `difftest triage`."""
    _record_command(absolute(run_dir))
    _analyze(absolute(run_dir), _options(atol, rtol, oracle, minimise_budget, timeout, device, shrink_budget), fail_on_inconsistency,
             new_only, baseline)


# the one command under its older name: scripts that call `difftest triage` keep working
app.command(name="triage", hidden=True)(analyze)


def _finding_folder(run_dir: Path, finding: str) -> Path:
    """The folder of a finding of the run, or one line listing the run's findings."""
    folder = run_dir / "findings" / finding
    if (folder / "ISSUE.md").is_file() or (folder / "repro.py").is_file():
        return folder
    known = sorted(p.name for p in (run_dir / "findings").glob("F*") if p.is_dir()) if (run_dir / "findings").is_dir() \
        else []
    raise UserError(f"{run_dir}: no finding {finding!r}; " + (f"its findings are {', '.join(known)}" if known else
                    "it has no findings (run `difftest analyze` on it first)"))


@app.command()
def repro(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (or a finding's run/ copy).")],
    model: Annotated[str, typer.Argument(help="A finding's id (e.g. Fbe4d0053): its minimal case; or a model id, e.g. dlrm-s0-i0, with a SETTING.")],
    setting: Annotated[str | None, typer.Argument(help="Setting name, e.g. torchrec/ebc/grid_shard/ws2 (with a model id).")] = None,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    device: DeviceOpt = SWEEP.device,
    plugin: PluginOpt = None,
) -> None:
    """Rerun one case alone (with what it is judged against): a finding's minimal case (`repro RUN FINDING`), or a
    model under a setting; exit 1 while it is not ok (a finding: while it fails as the finding did)."""
    import subprocess

    from difftest.contracts.registry import get_setting, load_run_plugins
    from difftest.findings.repro import reproduce

    run_dir = absolute(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UserError(f"{run_dir}: no run.json; give a run folder made by `difftest generate` or `difftest run`")
    load_run_plugins(run_dir, tuple(plugin or ()))  # a setting or kind of the run's plugins is known below
    if setting is None:
        folder = _finding_folder(run_dir, model)
        if not (folder / "repro.py").is_file():
            raise UserError(f"{folder}: no repro.py; run `difftest analyze {run_dir}` to write it")
        integrity.check_models(run_dir)
        raise typer.Exit(subprocess.run([sys.executable, str(folder / "repro.py")], check=False).returncode)
    get_setting(setting)  # an unknown name fails here with the hint
    integrity.check_models(run_dir, {model})
    result = reproduce(run_dir, model, setting, timeout_s=timeout, device=device, plugins=tuple(plugin or ()))
    out_console.print(escape(result.describe()), highlight=False)
    if result.reproduces:
        raise typer.Exit(1)


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="A run folder with findings.")],
    finding: Annotated[str, typer.Argument(help="A finding's id, as findings.md lists it (e.g. Fbe4d0053).")],
) -> None:
    """Print a finding's ISSUE.md: what happens, what was expected, its reduced script and what it printed."""
    folder = _finding_folder(absolute(run_dir), finding)
    if not (folder / "ISSUE.md").is_file():
        raise UserError(f"{folder}: no ISSUE.md yet; run `difftest analyze {absolute(run_dir)}` to write it")
    print((folder / "ISSUE.md").read_text(encoding="utf-8"), end="")


@app.command()
def bisect(
    run_dir: Annotated[Path, typer.Argument(help="A run folder with findings (`difftest run` or `difftest analyze`).")],
    finding: Annotated[str, typer.Argument(help="A finding's id, as findings.csv lists it (e.g. Fbe4d0053).")],
    torch: Annotated[str, typer.Option("--torch", help="Releases to try, oldest first: a range 2.6.0..2.14.1 (every supported release between), a list 2.8,2.10, or paths to a python with its own torch (a local build, a nightly).")],
    cache: Annotated[Path | None, typer.Option("--cache", help="Where each release's environment is made once and kept (default: $DIFFTEST_STACKS, else ~/.cache/difftest/stacks).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds the finding's reproducer may take on one release.")] = REPRODUCER_TIMEOUT_S,
    standalone: Annotated[bool, typer.Option("--standalone", help="Run the finding's standalone.py instead of its repro.py: it needs no difftest, so a python given by path needs only torch and the finding's libraries.")] = False,
) -> None:
    """Re-run a finding's minimal case on each torch release (with the fbgemm-gpu and torchrec made for it): which
    reproduce it, which are ok, and the first release where it appears and where it is gone."""
    from difftest.releases.bisect import Step, verdict
    from difftest.releases.bisect import bisect as run_bisect

    table = Table("torch", "stack there", "outcome", "detail", "s", title=f"{finding} across torch releases")

    def show(step: Step) -> None:
        console.print(f"  {step.target}: {step.outcome} ({step.seconds:.0f}s) {escape(step.detail)}", highlight=False)
        table.add_row(step.target, escape(step.stack), str(step.outcome), escape(step.detail), f"{step.seconds:.0f}")

    steps = run_bisect(absolute(run_dir), finding, torch, cache, timeout, log=lambda line: console.print(escape(line)),
                       on_step=show, standalone=standalone)
    out_console.print(table)
    out_console.print(verdict(steps), highlight=False)


@app.command("diff")
def diff_command(
    run_a: Annotated[Path, typer.Argument(help="A run folder (say, on the older stack).")],
    run_b: Annotated[Path, typer.Argument(help="A run of the same models on another stack.")],
) -> None:
    """Two runs of the same models on different stacks: the libraries that changed, findings present in one run
    and not the other, and every case whose verdict changed."""
    from difftest.releases.diff import diff_runs
    from difftest.storage import stack

    run_a, run_b = absolute(run_a), absolute(run_b)
    if run_a == run_b or (run_a.exists() and run_b.exists() and run_a.samefile(run_b)):
        raise UserError(f"{run_a}: given twice; `difftest diff` compares two runs of the same models (say, on two "
                        "stacks): give the other run's folder")
    result = diff_runs(run_a, run_b)
    for label, recorded in zip("AB", result.stacks, strict=True):
        out_console.print(f"{label}: {escape(stack.describe(recorded))}", highlight=False)
    out_console.print("libraries changed: " + (", ".join(result.library_changes()) or "none"), highlight=False)
    for label, rows in (("only in A", result.only_a), ("only in B", result.only_b)):
        out_console.print(f"\n{len(rows)} finding(s) {label}:", highlight=False)
        for _, row in rows.iterrows():
            out_console.print(f"  {row['id']} {escape(row['title'])} ({row['cases']} cases)", highlight=False)
    out_console.print(f"\n{len(result.both)} finding(s) in both", highlight=False)
    out_console.print(f"{len(result.changed)} of {result.compared_cases} cases changed verdict:", highlight=False)
    for change in result.changed:
        out_console.print(f"  {change.model} × {change.setting}: {change.before} -> {change.after}"
                          f"{'  ' + escape(change.message[:160]) if change.message else ''}", highlight=False)
    if result.models_differ:
        out_console.print(f"left out: {len(result.models_differ)} model(s) whose weights or inputs differ between the "
                          f"runs ({', '.join(result.models_differ)})", highlight=False)


@app.command()
def campaign(
    folder: Annotated[Path, typer.Argument(help="The campaign's folder: a new one, or one to resume.")],
    hours: Annotated[float | None, typer.Option("--hours", min=0, help="Run rounds for this long (this call).")] = None,
    cases: Annotated[int | None, typer.Option("--cases", min=1, help="Run rounds until the campaign holds this many cases.")] = None,
    settings: SettingsOpt = None,
    tier: TierOpt = None,
    kind: KindOpt = "all",
    models: Annotated[int | None, typer.Option("--models", min=1, help="Models per kind and round (default: 1, and a core in 4 above 7 cores; a resumed campaign keeps its own).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Round r draws its models from seed SEED + r.")] = 1000,
    minimise_budget: MinimiseOpt = DEFAULTS.minimise_budget_s,
    shrink_budget: ShrinkOpt = DEFAULTS.shrink_budget_s,
    jobs: JobsOpt = None,
    timeout: TimeoutOpt = DEFAULTS.timeout_s,
    sampling: Annotated[str, typer.Option("--sampling", help="How each round picks the (setting family × model kind) cells it runs: guided (toward cells that gave new causes or near misses, 30% of the chance spread over all) or uniform.")] = "guided",
    families_per_round: Annotated[int | None, typer.Option("--families-per-round", min=1, help="Setting families a round runs (on one model kind; default: 4, and a core in 2 above 8 cores; a resumed campaign keeps its own).")] = None,
    executor: ExecutorOpt = EXECUTOR.kind,
    address: AddressOpt = None,
    cpus_per_rank: CpusPerRankOpt = EXECUTOR.cpus_per_rank,
    report: Annotated[bool, typer.Option("--report", help="Print the causes the campaign has seen (first seen, how often, upstream) and stop.")] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start anew in FOLDER: an existing campaign there (another stack's, or damaged) is moved to FOLDER.old-<time>, kept.")] = False,
    max_disk: Annotated[float, typer.Option("--max-disk", min=0, help="Disk budget of the campaign folder in GB, checked before each round (the ok cases' outputs of counted rounds are deleted anyway).")] = 5.0,
    keep_outputs: Annotated[bool, typer.Option("--keep-outputs", help="Keep the outputs of ok cases (by default deleted once their round is counted; a round keeping them can be analysed again).")] = False,
    plugin: PluginOpt = None,
) -> None:
    """Hunt for hours: rounds of freshly drawn models under the selected settings, each judged and triaged as a run;
    a cause the manifest or an earlier round explains is counted, a new one minimised, scripted and announced. Resumes
    after any interruption."""
    from difftest.campaign.page import write_live_page
    from difftest.campaign.rounds import (
        CampaignConfig,
        CampaignEvents,
        RoundResult,
        report_rows,
        round_size,
        run_campaign,
    )
    from difftest.campaign.sampling import RoundPlan, Sampling
    from difftest.pipeline import run_pipeline
    from difftest.runner.scheduler import machine_ranks

    folder = absolute(folder)
    if report:
        _print_campaign(folder, report_rows(folder))
        return
    if hours is None and cases is None:
        raise UserError("campaign: give --hours H or --cases N (how long to hunt)")
    plugins = tuple(plugin or ())
    if sampling not in {str(s) for s in Sampling}:
        raise UserError(f"--sampling {sampling!r}: write one of {', '.join(map(str, Sampling))}")
    # a round sized to this machine's cores unless asked; a campaign resumed (on this or another machine) keeps its own
    existing = None if fresh else CampaignConfig.load(folder)
    sized = (existing.models, existing.families_per_round) if existing else round_size(machine_ranks())
    config = CampaignConfig(settings, tier, kind, models or sized[0], seed, minimise_budget, plugins, sampling,
                            families_per_round or sized[1])
    cluster = _executor(executor, address, cpus_per_rank)

    def one_round(where: Path, round_seed: int, focus: Callable[[Finding], bool], plan: RoundPlan) -> Any:
        import dataclasses

        judging = dataclasses.replace(_options(DEFAULTS.tolerance.atol, DEFAULTS.tolerance.rtol, DEFAULTS.oracle, minimise_budget, timeout, "cpu",
                                                shrink_budget), focus=focus)
        _generate(where, config.models, round_seed, plan.kind, 1, 0.1, plan.batch_size, plugins, "", plan.first_index)
        judged = _sweep(where, ",".join(plan.settings), None, jobs, timeout, "cpu", plugins, judging=judging,
                        executor=cluster)
        return run_pipeline(where, judging, judged=judged)

    def round_done(r: RoundResult) -> None:
        console.print(f"round {r.number}: {r.cases} cases in {r.seconds:.0f}s, {len(r.new)} new cause(s), "
                      f"{r.counted} finding(s) of causes seen before", highlight=False)
        write_live_page(folder, running=True)  # written after every round; once more, not reloading, at the end

    events = CampaignEvents(
        round_started=lambda n, where, plan: console.print(
            f"campaign round {n}: {shown(where)}: {plan.kind} (batch {plan.batch_size}, from index {plan.first_index}) "
            f"× {', '.join(plan.families)} ({len(plan.settings)} settings, {plan.sampling})", highlight=False),
        new_signature=lambda s: console.print(f"NEW: {escape(s.title)} (round {s.first_round}; {s.example})",
                                              style="bold", highlight=False),
        round_done=round_done,
        pruned=lambda where, files, freed: console.print(f"{shown(where)}: deleted the outputs of {files} ok case(s) "
                                                         f"({freed / 1e6:.1f} MB)", highlight=False),
        out_of_time=lambda left, longest: console.print(
            f"campaign stopped with {left / 60:.1f} min of --hours left: a round as long as the longest so far "
            f"({longest / 60:.1f} min) would end past them", highlight=False))
    try:
        run_campaign(folder, config, one_round, hours=hours, cases=cases, events=events, fresh=fresh,
                     max_disk_bytes=max_disk * 1e9, keep_outputs=keep_outputs)
    finally:
        if folder.is_dir():
            write_live_page(folder, running=False)
    _print_campaign(folder, report_rows(folder))


def _print_campaign(folder: Path, rows: list[Any]) -> None:
    from difftest.campaign.rounds import cases_done, disk_used, rounds_done

    table = Table("cause", "upstream", "first round", "rounds", "cases", "where", title=f"{shown(folder)}: "
                  f"{len(rounds_done(folder))} rounds, {cases_done(folder)} cases, {len(rows)} distinct causes, "
                  f"{disk_used(folder) / 1e6:.0f} MB on disk" if folder.is_dir() else f"{shown(folder)}: no campaign")
    for s in rows:
        table.add_row(escape(s.title[:90]), s.upstream, str(s.first_round), str(len(s.rounds)), str(s.cases), s.example)
    out_console.print(table)
    if not folder.is_dir():
        return
    from difftest.campaign.page import family_rows

    spent = Table("family", "rounds", "cases", "seconds", "share", "causes first seen", "rounds near",
                  title="where the time went (the cases' own wall time)")
    for r in family_rows(folder):
        spent.add_row(str(r["family"]), f"{r['rounds']:.0f}", f"{r['cases']:.0f}", f"{r['seconds']:.0f}",
                      f"{r['share']:.0%}", f"{r['new']:.0f}", f"{r['near_miss_rounds']:.0f}")
    out_console.print(spent)


@app.command()
def verify(
    run_dir: Annotated[Path, typer.Argument(help="A run folder.")],
    repair: Annotated[bool, typer.Option("--repair", help="Uncommit the cases whose outputs are missing or damaged, so that the next sweep runs them again (damaged model files: `difftest generate --out RUN_DIR` recreates them).")] = False,
) -> None:
    """Check a run folder: run.json, every model file against the digest generate recorded, the store (SQLite's
    integrity check), every committed case's outputs. Exit 0 only when all is sound; each problem is one line with
    its repair."""
    run_dir = absolute(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    from difftest.storage.verify import verify as verify_run

    result = verify_run(run_dir, repair_outputs=repair)
    for line in result.checked:
        out_console.print(f"ok: {escape(line)}", highlight=False, soft_wrap=True)
    for line in result.problems:
        out_console.print(f"damaged: {escape(line)}", highlight=False, soft_wrap=True)
    out_console.print(f"{shown(run_dir)}: " + ("sound" if result.sound else f"{len(result.problems)} problem(s)"),
                      highlight=False)
    if not result.sound:
        raise typer.Exit(1)


@settings_app.command("list")
def settings_list(
    tier: Annotated[str | None, typer.Option("--tier", help="Only the settings of this tier (default or full); the table always says which tier each is in.")] = None,
    names: Annotated[bool, typer.Option("--names", help="One full setting name per line, nothing else (for scripts).")] = False,
    derived: Annotated[bool, typer.Option("--derived", help="Only the derived families (<prefix>/<any setting>), one per line: prefix, then what it runs.")] = False,
    plugin: PluginOpt = None,
) -> None:
    """Every registered setting, its tier, what it runs, and whether this machine supports it; then one line per
    derived family (`rerun/<setting>`, `calib-…/<setting>`), selectable but not listed one by one."""
    from difftest.contracts.registry import all_settings, load_plugins
    from difftest.contracts.registry import tier as tier_members

    load_plugins(tuple(plugin or ()))
    families = derived_families()
    if derived:
        for prefix, description in families:
            print(f"{prefix}/<setting>\t{description}")
        return
    default = {s.name for s in tier_members("default")}
    shown = tier_members(tier) if tier else all_settings()
    if names:
        for setting in shown:
            print(setting.name)
        return
    rows = [(s.name, "default" if s.name in default else "full", s.family, str(s.world_size), s.describe(),
             "yes" if (reason := s.available()) is None else f"no: {reason}") for s in shown]
    rows += [(f"{prefix}/<setting>", "derived", prefix, "as <setting>", description, "where <setting> runs")
             for prefix, description in families]
    if not out_console.is_terminal:  # a pipe or a file: full names, tab-separated, one setting per line
        print("setting\ttier\tfamily\tranks\truns\there")
        for row in rows:
            print("\t".join(row))
        return
    table = Table()
    for column in ("setting", "tier", "family", "ranks", "runs", "here"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    out_console.print(table)
    out_console.print(
        f"{len(shown)} settings ({len(default)} in the default tier, which `difftest run` runs; --tier full runs all) "
        f"and {len(families)} derived families, selectable as <prefix>/<setting>, e.g. --settings "
        f"'{families[0][0] if families else 'rerun'}/ddp/*'.", highlight=False)


def derived_families() -> list[tuple[str, str]]:
    """(prefix, what it runs) per derived family, described on the first registered setting it applies to."""
    from difftest.contracts.registry import all_settings, derived_prefixes, get_setting
    from difftest.contracts.setting import Repeat

    families = []
    for prefix in derived_prefixes():
        example = None
        for setting in all_settings():
            try:
                example = get_setting(f"{prefix}/{setting.name}")
            except KeyError:
                continue
            if example is not None:
                break
        described = example.describe() if example is not None else ""
        if isinstance(example, Repeat):  # it names the setting it derives from
            described = described.replace(example.base.name, "<setting>")
        families.append((prefix, described or f"{prefix} of a setting"))
    return families


def _committed(run_dir: Path) -> int | None:
    """Cases committed in the run's store, read without writing to it; None where it cannot be read."""
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True, timeout=5)
        try:
            return int(db.execute("SELECT count(*) FROM cases").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return None


class _Interrupted(BaseException):
    """Ctrl-C, raised past click (which would swallow a KeyboardInterrupt into a bare exit) to `main`'s one line."""


# after Ctrl-C, how long the command may take to stop before it leaves at once (a cleanup that waits on a process the
# signal also reached must not keep the terminal)
STOP_WITHIN_S = 20.0


def _interrupted(signum: int, frame: Any) -> None:
    import threading

    timer = threading.Timer(STOP_WITHIN_S, _leave_interrupted)
    timer.daemon = True
    timer.start()
    raise _Interrupted


def _leave_interrupted() -> None:
    """Say how far the command got and that the same command resumes; leave with 130 at once (what is committed is
    committed: the store's transactions are durable when they return)."""
    import os

    _kill_children()
    where = _SWEPT[-1] if _SWEPT else None
    done = _committed(where) if where is not None else None
    console.print("difftest: interrupted" + (f" with {done} case(s) of {shown(where)} committed" if where and
                                             done is not None else "") + "; the same command resumes where it "
                  "stopped (nothing committed is run again)", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _kill_children() -> None:
    """Every rank process this command started, killed: a rank a sweep thread started after the signal (a spare
    group, a broken group's replacement) never had it, and one that waits on its peers (a store, a collective) for
    the collective timeout would hold the terminal's output open for minutes after this process left."""
    import multiprocessing

    for _ in range(3):  # another thread may start or reap one while the set is read
        try:
            children = multiprocessing.active_children()
            break
        except RuntimeError:
            continue
    else:
        return
    for child in children:
        try:
            child.kill()
        except (OSError, ValueError):  # gone already, or closed by its group meanwhile
            pass


def main() -> None:
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell had it ignored
        signal.signal(signal.SIGINT, _interrupted)
    _import_from_the_current_folder()
    try:
        app()
    except UserError as exc:
        console.print(f"difftest: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except (KeyboardInterrupt, _Interrupted):
        _leave_interrupted()


def _import_from_the_current_folder() -> None:
    """A `--model my_model:adapter` or `--plugin` module in the folder difftest runs from imports, as under `python -m`:
    the `difftest` console script's `sys.path` begins with its own bin folder instead (the processes difftest starts
    inherit the path)."""
    import os

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


if __name__ == "__main__":
    main()
