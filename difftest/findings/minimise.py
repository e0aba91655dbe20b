"""Shrink each finding's example case while its signature still reproduces: the smallest program that shows it.

Delta debugging over the case, greedy and batched: a round proposes, for every finding still shrinking, smaller
cases one step away from its smallest so far (a table, feature or layer dropped, rows/dims/widths cut, a smaller
batch, the same setting at a smaller world size — the generator of the model's kind says what can go); all
proposals of all findings run as one sweep over a private run (the sweep's work queue: as many worker groups at
once as the cores hold, kept warm from round to round; a model shared by two findings built once), and a finding moves to its smallest proposal whose case is
signed as the finding is (`difftest.findings.triage.case_signature`, with the original run's contrast). The changes that
succeeded are tried together first in the next round. A finding stops when no proposal one step away reproduces,
or when its time budget is spent: it keeps the smallest case found so far and says so.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.contracts.errors import UserError
from difftest.contracts.registry import all_settings, get_generator, get_setting, kind_unavailable, loaded_plugins
from difftest.contracts.spec import ModelSpec, RunConfig, config_with_commands
from difftest.contracts.status import FAILURES, Status
from difftest.generation.generate import ModelBuilders, try_materialise
from difftest.judging.analysis import CANNOT_JUDGE, Analysis, analyze, envelope_spread
from difftest.storage.artifacts import load_spec
from difftest.storage.run_folder import MINIMISE_FILE, OLD_MINIMISE_FILE

if TYPE_CHECKING:
    from difftest.findings.triage import Finding
    from difftest.runner.executor import SweepOptions
    from difftest.runner.local import WarmGroups

PER_FINDING_PER_ROUND = 8  # proposals a finding runs per round: a round's time is what every finding is charged
MIN_BATCH = 12  # splits over 1, 2, 3 and 4 ranks
ALONE = "(the example, alone)"
FIRST_TRY_COST_S: dict[str, float] = {Status.CRASH: 4.0, Status.TIMEOUT: 120.0}  # measured here: a crash's group restart is 3-4 s


@dataclass(frozen=True)
class Trial:
    spec: ModelSpec
    setting: str
    batch_size: int
    change: str = ""  # what this one-step-smaller case removed

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    def key(self) -> str:  # two findings proposing the same model share its folder and its reference run
        return json.dumps([self.spec.kind, self.spec.seed, self.spec.index, self.spec.params, list(self.spec.frozen),
                           self.batch_size], sort_keys=True)


@dataclass
class Minimisation:
    """How one finding's example shrank."""

    finding_id: str
    signature: str
    original: Trial
    best: Trial
    changes: list[str] = field(default_factory=list)
    tries: int = 0
    rounds: int = 0
    seconds: float = 0.0
    outcome: str = ""  # why it stopped
    status: str = ""
    budget_s: float = 0.0
    pending: list[Trial] = field(default_factory=list)
    composite: list[str] = field(default_factory=list)  # changes that succeeded last round, to try together
    active: bool = True
    unbuilt: list[str] = field(default_factory=list)  # proposals its generator could not build, with why
    # the calibrated envelope's spread per tensor on `best` (`difftest.judging.analysis.envelope_spread`), where one judged it
    spread: dict[str, float] = field(default_factory=dict)

    def size(self, trial: Trial | None = None) -> dict[str, int]:
        trial = trial or self.best
        # the ranks or replicas the setting distributes over (`scale`), not the sweep processes it takes: a setting
        # that starts its own processes, or simulates ranks in one, runs in one
        return {**_generator_size(trial.spec), "world_size": get_setting(trial.setting).scale,
                "batch": trial.batch_size}

    def to_json(self) -> dict[str, Any]:
        return {"finding": self.finding_id, "signature": self.signature, "outcome": self.outcome, "budget_s": self.budget_s,
                "original": {"model": self.original.model_id, "setting": self.original.setting,
                             "size": self.size(self.original)},
                "minimal": {"model": self.best.model_id, "setting": self.best.setting, "size": self.size()},
                "changes": self.changes, "tries": self.tries, "rounds": self.rounds, "seconds": round(self.seconds, 1),
                "spread": self.spread}


NOT_MINIMISED = "not minimised"  # how an outcome begins whose minimisation could not start


def load_previous(run_dir: Path, finding: Any, budget_s: float) -> Minimisation | None:
    """The finding's minimisation from an earlier triage of this run, if it is still good: same signature, same
    example, and it either reached a minimum or had at least this budget (a rerun resumes, it does not redo). One that
    could not start (its example alone did not reproduce, its generator was missing, its tries would time out) is
    tried again by a rerun with a budget (a fixed harness, an extra installed since); a budget of 0 takes it as is."""
    target = run_dir / "findings" / finding.id
    try:
        saved_at = target / MINIMISE_FILE if (target / MINIMISE_FILE).is_file() else target / OLD_MINIMISE_FILE
        saved = json.loads(saved_at.read_text())
        original = (saved["original"]["model"], saved["original"]["setting"])
        best_dir = target / "run" / "models" / saved["minimal"]["model"]
        if (saved["signature"] != finding.signature or original != (finding.example["model"], finding.example["setting"])
                or not (saved["outcome"].startswith("minimal") or budget_s <= 0
                        or (not saved["outcome"].startswith(NOT_MINIMISED) and saved["budget_s"] >= budget_s))):
            return None
        first = Trial(load_spec(run_dir / "models" / original[0]), original[1], saved["original"]["size"]["batch"])
        best = Trial(load_spec(best_dir), saved["minimal"]["setting"], saved["minimal"]["size"]["batch"])
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None
    return Minimisation(finding.id, finding.signature, first, best if best.model_id != first.model_id else first,
                        changes=list(saved["changes"]), tries=saved["tries"], rounds=saved["rounds"],
                        seconds=saved["seconds"], outcome=saved["outcome"], status=finding.status,
                        budget_s=saved["budget_s"], active=False, spread=saved.get("spread", {}))


def _generator_size(spec: ModelSpec) -> dict[str, int]:
    return dict(get_generator(spec.kind).size(spec))


def _order(m: Minimisation, trial: Trial) -> tuple[int, ...]:
    """Smaller first: structure (tables, features, layers, …, parameters), then world size, then batch."""
    size = m.size(trial)
    return (*_generator_size(trial.spec).values(), size["world_size"], size["batch"])


def _smaller_settings(name: str) -> list[str]:
    """The same setting class with the same non-size parameters at a smaller world size."""
    from difftest.findings.signature import setting_parameters

    setting = get_setting(name)
    cls, params = setting_parameters(name)
    return sorted((s.name for s in all_settings()
                   if type(s) is type(setting) and s.world_size < setting.world_size
                   and setting_parameters(s.name) == (cls, params)),
                  key=lambda n: get_setting(n).world_size)


def _proposals(m: Minimisation, serial: Callable[[], str]) -> list[Trial]:
    """Every case one step smaller than `m.best`, the changes that succeeded last round applied together first."""
    best = m.best
    generator = get_generator(best.spec.kind)
    steps: list[tuple[str, ModelSpec, str, int]] = []
    for change, params in generator.reductions(best.spec):
        steps.append((change, _with_params(best.spec, params), best.setting, best.batch_size))
    if best.batch_size > MIN_BATCH:
        steps.append((f"batch {MIN_BATCH}", best.spec, best.setting, MIN_BATCH))
    for name in _smaller_settings(best.setting):
        steps.append((f"world size {get_setting(name).world_size}", best.spec, name, best.batch_size))
    if best.spec.frozen:
        steps.append(("nothing frozen", dataclasses.replace(best.spec, frozen=()), best.setting, best.batch_size))
    trials = [Trial(dataclasses.replace(spec, variant=serial()), setting, batch, change)
              for change, spec, setting, batch in steps]
    together = _compose(best, m.composite, serial)
    return ([together] if together is not None else []) + trials


def _compose(best: Trial, changes: list[str], serial: Callable[[], str]) -> Trial | None:
    """`best` with each of `changes` applied in turn, by name, where it still applies (two or more of them)."""
    if len(changes) < 2:
        return None
    current = best
    applied: list[str] = []
    for change in changes:
        for trial in _proposals(Minimisation("", "", current, current), lambda: current.spec.variant):
            if trial.change == change:
                current, applied = trial, applied + [change]
                break
    if len(applied) < 2:
        return None
    return Trial(dataclasses.replace(current.spec, variant=serial()), current.setting, current.batch_size,
                 " + ".join(applied))


def _with_params(spec: ModelSpec, params: dict[str, Any]) -> ModelSpec:
    """`spec` with `params`; a frozen parameter or layer the smaller model no longer has is no longer frozen."""
    smaller = dataclasses.replace(spec, params=params)
    have = get_generator(spec.kind).frozen_names(params)
    if have is None:
        return smaller
    return dataclasses.replace(smaller, frozen=tuple(f for f in spec.frozen if f in have))


def _start(run_dir: Path, findings: list[Finding], budget_s: float,
           timeout_s: float) -> tuple[list[Minimisation], dict[str, Minimisation]]:
    """Planning, once: a minimisation per finding, those an earlier triage finished kept apart, and those that
    cannot shrink here (their generator is missing; a timeout the budget cannot wait for twice) stopped at once."""
    work: list[Minimisation] = []
    kept: dict[str, Minimisation] = {}
    for finding in findings:
        previous = load_previous(run_dir, finding, budget_s)
        if previous is not None:
            kept[finding.id] = previous
            continue
        spec = load_spec(run_dir / "models" / finding.example["model"])
        original = Trial(spec, finding.example["setting"], _batch_of(run_dir / "models" / spec.model_id))
        m = Minimisation(finding.id, finding.signature, original, original, status=finding.status, budget_s=budget_s)
        if (why := kind_unavailable(spec.kind)) is not None:  # its smaller models cannot be made on this machine
            m.active, m.outcome = False, f"{NOT_MINIMISED}: the {spec.kind} generator {why}"
        elif finding.status == Status.TIMEOUT and budget_s < 2 * timeout_s:
            m.active, m.outcome = False, (f"{NOT_MINIMISED}: each try waits for the {timeout_s:g} s timeout; "
                                          f"a --minimise-budget of {2 * timeout_s:g} s or more tries")
        work.append(m)
    return work, kept


@dataclass
class _Round:
    """One round: the trials each active finding runs, what each case cost, and how each was signed."""

    number: int
    folder: Path
    planned: dict[str, list[Trial]] = field(default_factory=dict)
    built_s: float = 0.0  # materialising the round's models
    build_cost: dict[str, float] = field(default_factory=dict)  # seconds per model id, where it was built
    cost: dict[tuple[str, str], float] = field(default_factory=dict)  # per case, including its references
    signed: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # one per independent divergence
    spreads: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)  # of the calibrated cases
    seconds: float = 0.0

    def pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple(dict.fromkeys((t.model_id, t.setting) for ts in self.planned.values() for t in ts))


def _plan(this: _Round, work: list[Minimisation], serial: Callable[[], str], builders: ModelBuilders) -> None:
    """Planning a round: each active finding's next proposals, as many as the rest of its budget affords at what
    a try has cost it so far (a crash costs a worker group's restart), each model materialised once. The models are
    built side by side, in waves: a proposal that cannot be built is told in its finding's outcome and replaced by
    the finding's next one in the next wave, so each finding gets the same trials as one by one."""
    started = time.perf_counter()
    wanted: dict[str, int] = {}
    for m in work:
        if not m.active:
            continue
        if this.number == 1:  # the example alone first: a case that only fails beside others is no minimum
            m.pending = [dataclasses.replace(m.original, spec=dataclasses.replace(m.original.spec, variant=serial()),
                                             change=ALONE)]
            m.pending += _proposals(m, serial)
        elif not m.pending:
            m.pending = _proposals(m, serial)
        per_try = m.seconds / m.tries if m.tries else FIRST_TRY_COST_S.get(m.status, 1.0)
        room = max(1, min(PER_FINDING_PER_ROUND, int((m.budget_s - m.seconds) / per_try)))
        wanted[m.finding_id] = room + (this.number == 1)
        this.planned[m.finding_id] = []
    built: dict[str, Trial] = {}  # by `Trial.key`: the trial whose folder holds that model
    unbuildable: dict[str, str] = {}
    while wave := [(m, m.pending.pop(0)) for m in work if m.finding_id in wanted
                   for _ in range(min(len(m.pending), wanted[m.finding_id] - len(this.planned[m.finding_id])))]:
        new: dict[str, Trial] = {}  # the wave's models not built yet, each once (two findings may propose one)
        for _, trial in wave:
            if trial.key() not in built and trial.key() not in unbuildable:
                new.setdefault(trial.key(), trial)
        for trial, (why, seconds) in zip(new.values(), builders.build_timed(
                [(t.spec, this.folder / "models" / t.model_id, t.batch_size) for t in new.values()])):
            this.build_cost[trial.model_id] = seconds
            if why is None:
                built[trial.key()] = trial
            else:
                unbuildable[trial.key()] = why
        for m, trial in wave:
            if trial.key() in unbuildable:  # told in its outcome: a generator whose reductions cannot be built looks minimal
                m.unbuilt.append(f"{trial.change}: {unbuildable[trial.key()]}")
            else:
                this.planned[m.finding_id].append(dataclasses.replace(trial, spec=built[trial.key()].spec))
    this.built_s = time.perf_counter() - started


def _run(this: _Round, needs_envelope: set[str], fails_alone: set[str], options: SweepOptions, warm: WarmGroups,
         separating: dict[str, Any], plugins: tuple[str, ...]) -> None:
    """Running a round: its cases as one sweep over the round's private run, each case's time taken as the time
    since the case before it in its worker group (so references and a crash's restart are in it), then signed. The
    trials of a finding in `fails_alone` (the case itself raised, crashed or hung) run without their references:
    whatever the case computes when it does not fail so, it is not that finding."""
    from difftest.findings.signature import signatures
    from difftest.findings.triage import known_causes_here
    from difftest.runner.sweep import run_sweep

    clocks: dict[int, float] = {}
    sweep_start = time.perf_counter()

    def clock(case: Any, record: Any) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        this.cost[(case.model_id, case.setting.name)] = now - clocks.get(thread, sweep_start)
        clocks[thread] = now

    if pairs := this.pairs():
        # calibration runs only for the findings only the calibrated oracle sees: the others keep failing D3
        # (or erring) without them, and each trial model would otherwise pay its root's calibrations
        calibrated = tuple(dict.fromkeys((t.model_id, t.setting) for f, ts in this.planned.items()
                                         if f in needs_envelope for t in ts))
        referenced = tuple(dict.fromkeys((t.model_id, t.setting) for f, ts in this.planned.items()
                                         if f not in fails_alone for t in ts))
        run_sweep(this.folder, dataclasses.replace(options, pairs=pairs, calibrated_pairs=calibrated,
                                                   referenced_pairs=referenced), on_result=clock, warm=warm)
        # with the known cause of each: a finding triage signed apart by its cause is recognised by it
        this.signed = signatures(analyze(this.folder, plugins=plugins), separating, known_causes_here(this.folder))
        this.spreads = {pair: envelope_spread(this.folder, *pair) for pair in calibrated}
    this.seconds = this.built_s + time.perf_counter() - sweep_start


def needing_envelope(analysis: Analysis, findings: list[Any]) -> set[str]:
    """The inconsistent findings whose trials need the calibrated envelope, a pure function: those whose example the
    fixed D3 oracle, which judges a case without calibrations, signs otherwise than the calibrated one did — it passes
    the example, or the example's first divergence under it is another tensor (one beyond allclose but within a wide
    envelope comes first). Judged by D3 alone, such an example would not sign as its finding even unchanged."""
    from difftest.findings.signature import first_divergence

    verdicts = {(c.model, c.setting): c.d3_verdict for c in analysis.cases.itertuples()}
    rows = analysis.comparisons
    needing = set()
    for f in findings:
        if f.status != Status.INCONSISTENT:
            continue
        example = (f.example["model"], f.example["setting"])
        mine = rows[(rows["model"] == example[0]) & (rows["setting"] == example[1])].to_dict("records")
        by_d3 = [{**r, "status": r["d3_status"]} for r in mine]
        if verdicts.get(example) == Status.OK or first_divergence(by_d3) != first_divergence(mine):
            needing.add(f.id)
    return needing


def charges(planned: dict[str, list[Trial]], cost: dict[tuple[str, str], float],
            build_cost: dict[str, float]) -> dict[str, float]:
    """Charging a round, a pure function: each finding pays for its own cases (a crash: its restart too) and its
    share of the reference runs and of the building of the models it used (each split among the findings that used
    that model): a kind whose models take seconds to build (a Keras model's export) is charged them, not the others."""
    tried = {(t.model_id, t.setting) for ts in planned.values() for t in ts}
    references: dict[str, float] = {}
    for (model, setting), seconds in cost.items():
        if (model, setting) not in tried:
            references[model] = references.get(model, 0.0) + seconds
    users = Counter(model for ts in planned.values() for model in {t.model_id for t in ts})
    return {finding: sum(cost.get((t.model_id, t.setting), 0.0) for t in chosen)
            + sum((references.get(model, 0.0) + build_cost.get(model, 0.0)) / users[model]
                  for model in {t.model_id for t in chosen})
            for finding, chosen in planned.items()}


def resign(m: Minimisation, round_no: int, chosen: list[Trial], signed: dict[tuple[str, str], set[str]],
           seconds: float) -> None:
    """Re-signing, without I/O: the round's trials signed as the finding is are wins; the finding moves to the
    smallest, or stops (minimal, its budget spent, or its example not reproducing alone)."""
    m.rounds, m.tries, m.seconds = m.rounds + 1, m.tries + len(chosen), m.seconds + seconds
    won = [t for t in chosen if m.signature in signed.get((t.model_id, t.setting), set())]
    if round_no == 1:
        alone = next((t for t in chosen if t.change == ALONE), None)
        if alone is None or alone not in won:
            got = " and ".join(sorted(signed.get((alone.model_id, alone.setting), {Status.OK}))) if alone else "not built"
            m.active, m.outcome = False, f"{NOT_MINIMISED}: the example alone does not reproduce ({got})"
            return
        won.remove(alone)
    if won:
        smallest = min(won, key=lambda t: _order(m, t))
        m.best = smallest
        m.changes.append(smallest.change)
        m.composite = [t.change for t in won if " + " not in t.change] if len(won) > 1 else []
        m.pending = []  # the next round proposes from the new smallest
    elif not m.pending:
        m.active, m.outcome = False, "minimal: no case one step smaller reproduces"
        if m.unbuilt:
            m.outcome += f" ({len(m.unbuilt)} smaller case(s) could not be built, e.g. {m.unbuilt[0]})"
        return
    if m.seconds >= m.budget_s:
        m.active = False
        m.outcome = f"budget of {m.budget_s:g} s spent after {m.rounds} rounds: the smallest case found so far is kept"


def minimise(run_dir: Path, findings: list[Finding], analysis: Analysis, *, budget_s: float, timeout_s: float = 120.0,
             device: str = "cpu", plugins: tuple[str, ...] = (),
             on_round: Callable[[int, list[Minimisation], float, float, int], None] | None = None,
             on_done: Callable[[Minimisation], None] | None = None) -> list[Minimisation]:
    """Shrink every finding's example within `budget_s` seconds of rounds each; write each finding's minimal case to
    `findings/<id>/` (model folder, repro.py, minimise.json). Returns the minimisations in the order of `findings`.
    `on_round(number, minimisations, seconds, seconds building models, cases)` after each round; `on_done(m)` once per
    finding as soon as its minimisation is final and written (what comes next may start while others still shrink)."""
    from difftest.findings.signature import separating_values
    from difftest.runner.executor import SweepOptions
    from difftest.runner.local import WarmGroups

    config = RunConfig.load(run_dir / "run.json")
    separating = separating_values(analysis.cases)
    work, kept = _start(run_dir, findings, budget_s, timeout_s)
    for previous in kept.values():
        if on_done is not None:
            on_done(previous)
    needs_envelope = needing_envelope(analysis, findings)
    fails_alone = {f.id for f in findings if f.status in FAILURES
                   and not str(f.example.get("message", "")).startswith(CANNOT_JUDGE)}
    options = SweepOptions(timeout_s=timeout_s, device=device, plugins=plugins)
    scratch = Path(tempfile.mkdtemp(prefix=".minimise-", dir=run_dir))
    warm = WarmGroups()
    builders = ModelBuilders(loaded_plugins())  # the plugins this process loaded: a benchmark's patch too
    builders.warm_up([(m.original.spec, m.original.batch_size) for m in work if m.active])
    counter = iter(range(1, 10**9))
    by_finding = {f.id: f for f in findings}
    written: set[str] = set()

    def finish_stopped() -> None:
        """Each minimisation that has just stopped: its minimal case written out, and `on_done` told."""
        for m in work:
            if not m.active and m.finding_id not in written:
                _write(run_dir, by_finding[m.finding_id], m, config, scratch)
                written.add(m.finding_id)
                if on_done is not None:
                    on_done(m)

    try:
        finish_stopped()  # those that cannot shrink here
        round_no = 0
        while any(m.active for m in work):
            round_no += 1
            this = _Round(round_no, scratch / f"round{round_no}")
            (this.folder / "models").mkdir(parents=True)
            (this.folder / "run.json").write_text(config_with_commands(config, run_dir / "run.json"))
            _plan(this, work, lambda: f"m{next(counter)}", builders)
            _run(this, needs_envelope, fails_alone, options, warm, separating, config.plugins + plugins)
            charged = charges(this.planned, this.cost, this.build_cost)
            for m in work:
                if m.active:
                    resign(m, round_no, this.planned.get(m.finding_id, []), this.signed, charged[m.finding_id])
                    m.spread = this.spreads.get((m.best.model_id, m.best.setting), m.spread)
            if on_round is not None:
                on_round(round_no, work, this.seconds, this.built_s, len(this.pairs()))
            # a minimal model is copied out when its finding stops; a round's outputs are not needed past its verdicts
            shutil.rmtree(this.folder / "outputs", ignore_errors=True)
            finish_stopped()
        by_id = {m.finding_id: m for m in work}
    finally:
        warm.close()
        builders.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return [kept.get(f.id) or by_id[f.id] for f in findings]


def _batch_of(model_dir: Path) -> int:
    from difftest.storage.artifacts import stored_batch_size

    return stored_batch_size(model_dir)


def _write(run_dir: Path, finding: Any, m: Minimisation, config: RunConfig, scratch: Path) -> None:
    from difftest.findings.repro import write_reproducer

    target = run_dir / "findings" / finding.id
    target.mkdir(parents=True, exist_ok=True)
    if m.best is not m.original:
        minimal = dataclasses.replace(m.best, spec=dataclasses.replace(m.best.spec, variant="min"))
        staging = scratch / "minimal" / finding.id  # two findings may shrink the same model two ways
        (staging / "models").mkdir(parents=True, exist_ok=True)
        # built in its round, in a folder that goes with the round
        if (why := try_materialise(minimal.spec, staging / "models" / minimal.model_id, minimal.batch_size)) is not None:
            raise RuntimeError(f"the minimal case of {finding.id} could not be built again: {why}")
        (staging / "run.json").write_text(config_with_commands(dataclasses.replace(config, batch_size=minimal.batch_size),
                                                               run_dir / "run.json"))
        write_reproducer(staging, target, finding.id, finding.title, minimal.model_id, minimal.setting,
                         signature=m.signature, contrast=finding.contrast)
        m.best = minimal
    (target / MINIMISE_FILE).write_text(json.dumps(m.to_json(), indent=1))

