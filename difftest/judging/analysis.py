"""`difftest analyze`: judge every stored case against its model's reference, write the CSVs, summarise."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.registry import calibrations_of, capabilities_of, get_setting, load_plugins, root_of
from difftest.contracts.setting import Outputs, Setting, SettingRole
from difftest.contracts.spec import ModelSpec
from difftest.contracts.status import PENDING, STATUSES, Status
from difftest.contracts.tolerance import BOUND_PREFIX, UNIT_ROUNDOFF, Tolerance
from difftest.judging.envelope import Envelope
from difftest.judging.oracle import compare
from difftest.storage.run_folder import list_models, sweep_in_progress
from difftest.storage.store import CaseRecord, Store

# how a case that ran begins its message when what judges it failed: its verdict is its reference's failure
CANNOT_JUDGE = "cannot judge: "
CSV_COLUMNS = [
    "model", "input", "kind", "setting", "reference", "phase", "tensor",
    "linf", "max_rel", "mismatches", "numel", "oracle", "bound", "bound_ratio", "status", "message",
    # the calibrated oracle (`difftest.judging.envelope`): distance to the root's float64 result and its ratio to the
    # envelope; `status` is its verdict where it applies, `d3_status` always the fixed allclose/bound one
    "calibrated_linf", "calibrated_ratio", "d3_status",
]
CASE_COLUMNS = ["model", "kind", "setting", "verdict", "d3_verdict", "calibrated", "why_uncalibrated", "worst_linf",
                "wall_s"]


@dataclass
class Analysis:
    comparisons: pd.DataFrame  # every comparison, consistent ones included, plus one row per failed case
    cases: pd.DataFrame  # one row per (model, setting) with its final verdict
    by_setting: pd.DataFrame
    by_kind: pd.DataFrame
    by_feature: pd.DataFrame  # per (model feature, setting), e.g. (Conv1D, convert/onnx2torch/eval)
    # a sweep was still committing cases when the store was read: this is the snapshot of what it had committed
    # (one read transaction), and a case whose reference is still to run is `pending`, not an error
    sweep_running: bool = False
    # where the last analysis's files were kept, because it judged more cases than this one (`keep_superseded`)
    superseded: Path | None = None

    @property
    def inconsistencies(self) -> pd.DataFrame:
        return self.comparisons[self.comparisons["status"] != Status.OK]

    def count(self, status: str) -> int:
        return int((self.cases["verdict"] == status).sum())


ORACLES = ("calibrated", "d3")


def analyze(run_dir: Path, tol: Tolerance = Tolerance(), plugins: tuple[str, ...] = (),
            oracle: str = "calibrated", judged: Judged | None = None) -> Analysis:
    """Judge each case against its setting's reference (`Setting.reference`) on the tensors it `judges`: by the
    calibrated oracle where its root was calibrated (`oracle="calibrated"`), else by the fixed D3 one; both verdicts
    are kept (`verdict`, `d3_verdict`). `judged`: judgements already made with the same tolerance and oracle (the
    sweep's live ones), each taken as it is where the store still holds the record it judged."""
    if oracle not in ORACLES:
        raise UserError(f"unknown oracle {oracle!r}; oracles: {', '.join(ORACLES)}")
    load_plugins(plugins)
    specs = {spec.model_id: spec for _, spec in list_models(run_dir)}
    running = sweep_in_progress(run_dir)
    store = Store(run_dir)
    try:
        records = store.records()
        # while a sweep runs, a case not committed yet may be one it has still to run
        judge = Judge(store, tol, oracle, will_run=lambda model, setting: running)
        for record in records:
            judge.add(record)
        rows: list[dict[str, Any]] = []
        verdicts: list[dict[str, Any]] = []
        for record in records:
            spec = specs.get(record.model)
            if spec is None:
                continue  # a model deleted from the run after its cases ran
            earlier = (judged or {}).get((record.model, record.setting))
            judgement = earlier[1] if earlier is not None and earlier[0] == record else judge.judge(record, spec)
            if judgement is None:
                judgement = Judgement(PENDING)  # judged once the sweep has run its reference and calibrations
            rows.extend(judgement.rows)
            verdicts.append({"model": record.model, "kind": spec.kind, "setting": record.setting,
                             "verdict": judgement.verdict, "d3_verdict": judgement.d3_verdict or judgement.verdict,
                             "calibrated": judgement.calibrated, "why_uncalibrated": judgement.why_uncalibrated,
                             "worst_linf": judgement.worst_linf,
                             "wall_s": record.wall_s})
    finally:
        store.close()

    comparisons_df = pd.DataFrame(rows, columns=CSV_COLUMNS)
    cases_df = pd.DataFrame(verdicts, columns=CASE_COLUMNS)
    analysis = Analysis(comparisons_df, cases_df, _summarise(cases_df, "setting"), _summarise(cases_df, "kind"),
                        _by_feature(cases_df, specs), sweep_running=running)
    write_tables(run_dir, analysis)
    return analysis


def envelope_spread(run_dir: Path, model: str, setting: str, tol: Tolerance = Tolerance()) -> dict[str, float]:
    """Per recorded tensor of `setting` on `model`: the largest distance from the float64 result that its root's
    legitimate runs reached (what the calibrated oracle judges it by); empty where no envelope judges it."""
    registered = _registered(setting)
    store = Store(run_dir)
    try:
        judge = Judge(store, tol)
        for record in store.records():
            if record.model == model:
                judge.add(record)
        envelope, _ = judge.envelope(model, registered)
    finally:
        store.close()
    return {} if envelope is None else {name: float(e.max(initial=0.0)) for name, e in envelope.spread.items()}


# what an analysis writes into the run folder (and ISSUE.md per finding): an analysis that judges fewer cases than the
# last one moves these aside before it writes its own
DERIVED_FILES = ("comparisons.csv", "inconsistencies.csv", "summary.csv", "by_feature.csv", "first_divergence.csv",
                 "findings.csv", "findings.md", "report.html", "summary.json", "junit.xml")


def judged_before(run_dir: Path) -> int | None:
    """How many cases the last analysis of the run judged (its summary.csv), None where it has none."""
    try:
        return int(pd.read_csv(run_dir / "summary.csv")["cases"].sum())
    except (OSError, ValueError, KeyError, pd.errors.ParserError):
        return None


def keep_superseded(run_dir: Path, cases: int) -> Path | None:
    """Where the last analysis judged more than `cases` cases, move what it wrote to `superseded-<time>/` (an analysis
    never silently replaces results by fewer) and return that folder."""
    import shutil
    import time

    before = judged_before(run_dir)
    if before is None or cases >= before:
        return None
    folder = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(exist_ok=True)
    for name in DERIVED_FILES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, folder / name)
    return folder


def write_tables(run_dir: Path, analysis: Analysis) -> None:
    """The run's CSVs of an analysis (comparisons, inconsistencies, summary per setting, by_feature), each replaced
    whole (a reader never sees half of one)."""
    from difftest.storage.artifacts import atomic_path

    analysis.superseded = keep_superseded(run_dir, len(analysis.cases))
    for name, frame, index in (("comparisons.csv", analysis.comparisons, False),
                               ("inconsistencies.csv", analysis.inconsistencies, False),
                               ("summary.csv", analysis.by_setting, True), ("by_feature.csv", analysis.by_feature, False)):
        with atomic_path(run_dir / name) as tmp:
            frame.to_csv(tmp, index=index)


@dataclass
class Judgement:
    """One case's verdicts and its comparisons rows (one per tensor compared, or one for a case judged whole)."""

    verdict: str
    d3_verdict: str = ""  # "": the case was not compared tensor by tensor, its one verdict is D3's too
    calibrated: bool = False  # judged against its root's envelope
    why_uncalibrated: str = ""  # where not: why the envelope does not judge it
    worst_linf: float = math.nan
    rows: list[dict[str, Any]] = field(default_factory=list)


# judgements made before an analysis (the sweep's live ones), by (model, setting), each with the record it judged
Judged = Mapping[tuple[str, str], tuple[CaseRecord, Judgement]]


class Judge:
    """Judges one case at a time against its setting's reference (`Setting.reference`) on the tensors it `judges`: by
    the calibrated oracle where its root was calibrated (`oracle="calibrated"`), else by the fixed D3 one. Reference
    and calibration outputs are read from the store once per model. `will_run(model, setting)`: whether a case not
    committed yet is one the sweep will still run; a case that needs it is then pending, not an error."""

    def __init__(self, store: Store, tol: Tolerance = Tolerance(), oracle: str = "calibrated",
                 will_run: Callable[[str, str], bool] = lambda model, setting: False) -> None:
        self.store, self.tol, self.oracle, self.will_run = store, tol, oracle, will_run
        self.records: dict[tuple[str, str], CaseRecord] = {}
        self._outputs: dict[tuple[str, str], Outputs | None] = {}
        self._envelopes: dict[tuple[str, str, str], tuple[Envelope | None, str]] = {}

    def add(self, record: CaseRecord) -> None:
        self.records[(record.model, record.setting)] = record

    def forget(self, model: str) -> None:
        """Let go of the outputs and envelopes read for `model` (every case of it is judged)."""
        self._outputs = {k: v for k, v in self._outputs.items() if k[0] != model}
        self._envelopes = {k: v for k, v in self._envelopes.items() if k[0] != model}

    def _missing(self, model: str, setting: str) -> bool:
        return (model, setting) not in self.records and self.will_run(model, setting)

    def _reference_outputs(self, model: str, reference: str) -> Outputs | None:
        key = (model, reference)
        if key not in self._outputs:
            ref = self.records.get(key)
            self._outputs[key] = _load(self.store, ref) if ref is not None and ref.status == Status.OK else None
        return self._outputs[key]

    def envelope(self, model: str, setting: Setting | None) -> tuple[Envelope | None, str]:
        """The envelope judging `setting` on `model`, or why the D3 verdict stands (`PENDING`: not yet known)."""
        if self.oracle != "calibrated":
            return None, "d3 oracle chosen"
        if setting is None or setting.role is SettingRole.CALIBRATION:
            return None, "a calibration run is what the envelope is made of"
        if setting.tolerance(self.tol) == Tolerance(0.0, 0.0):
            return None, "judged bitwise"
        if setting.precision not in UNIT_ROUNDOFF:
            return None, f"{setting.precision} arithmetic: judged by its scheme's bound"
        root = root_of(setting)
        centre_name, run_names = calibrations_of(root, setting.precision)
        if any(self._missing(model, name) for name in [centre_name, *run_names] if name is not None):
            return None, PENDING
        key = (model, root.name, setting.precision)
        if key not in self._envelopes:
            self._envelopes[key] = self._measure(model, root, setting.precision, centre_name, run_names)
        return self._envelopes[key]

    def _measure(self, model: str, root: Setting, precision: str, centre_name: str | None,
                 run_names: list[str]) -> tuple[Envelope | None, str]:
        if centre_name is None:
            return None, f"{root.name} has no float64 calibration"
        centre = self._reference_outputs(model, centre_name)
        if centre is None:
            record = self.records.get((model, centre_name))
            why = "never ran" if record is None else f"ended {record.status}: {record.message[:160]}"
            return None, f"{centre_name} {why}"
        runs = {name: out for name in run_names if (out := self._reference_outputs(model, name)) is not None}
        if not runs:
            return None, f"none of {', '.join(run_names) or 'its runs'} ran ok"
        return Envelope.measure(centre, runs, UNIT_ROUNDOFF[precision]), ""

    def judge(self, record: CaseRecord, spec: ModelSpec) -> Judgement | None:
        """`record`'s verdicts; None while what judges it (its reference, its root's calibrations) has still to run."""
        setting = _registered(record.setting)
        reference = setting.reference if setting is not None else "reference"
        base = {"model": record.model, "input": spec.input_id, "kind": spec.kind, "setting": record.setting,
                "reference": reference}
        if record.status != Status.OK:
            return Judgement(record.status, rows=[_case_row(base, record.status, record.message)])
        if record.setting == reference:
            return Judgement(Status.OK)
        if self._missing(record.model, reference):
            return None
        expected = self._reference_outputs(record.model, reference)
        if expected is None:
            ref = self.records.get((record.model, reference))
            why = "never ran" if ref is None else f"ended {ref.status}: {ref.message[:200]}"
            return Judgement(Status.ERROR, rows=[_case_row(base, Status.ERROR, f"{CANNOT_JUDGE}the reference case {why}")])
        envelope, why_not = self.envelope(record.model, setting)
        if why_not == PENDING:
            return None
        actual = _load(self.store, record)
        return judge_outputs(actual, expected, envelope, why_not, setting, self.tol, base, record.message)


def judge_outputs(actual: Outputs, expected: Outputs, envelope: Envelope | None, why_not: str, setting: Setting | None,
                  tol: Tolerance, base: dict[str, Any], message: str = "") -> Judgement:
    """Judging one case, without I/O: its outputs against its reference's on the tensors the setting `judges`, each
    by the root's envelope where there is one (`why_not` says why there is none), D3's allclose beside it; `base`
    holds the row's identifying columns."""
    if setting is not None:
        expected = {k: v for k, v in expected.items() if setting.judges(k)}
        # (a bound `allowed/<name>` goes with its tensor)
        actual = {k: v for k, v in actual.items() if setting.judges(k.removeprefix(BOUND_PREFIX))}
    comparisons = compare(actual, expected, setting.tolerance(tol) if setting is not None else tol)
    mismatch = setting.mismatch_status if setting is not None else Status.INCONSISTENT
    rows, finals, d3 = [], [], []
    for c in comparisons:
        name = f"{c.phase}/{c.tensor}"
        judged = (envelope.judge(name, actual[name])
                  if envelope is not None and name in actual and c.oracle != "bound" else None)
        ok = judged.consistent if judged is not None else c.consistent
        finals.append(ok)
        d3.append(c.consistent)
        rows.append({**base, **{k: v for k, v in asdict(c).items() if k != "consistent"},
                     "status": Status.OK if ok else mismatch, "message": c.message or message,
                     "calibrated_linf": judged.linf if judged else math.nan,
                     "calibrated_ratio": judged.ratio if judged else math.nan,
                     "d3_status": Status.OK if c.consistent else mismatch})
    return Judgement(Status.OK if all(finals) else mismatch, Status.OK if all(d3) else mismatch,
                     envelope is not None, "" if envelope is not None else why_not,
                     max((c.linf for c in comparisons if not math.isnan(c.linf)), default=math.nan), rows)


def _load(store: Store, record: CaseRecord) -> Outputs:
    """A case's stored outputs. A file truncated, corrupted or deleted is a damaged run (`DamagedRun`: one line, and
    `difftest verify --repair` runs the case again), never a finding: the library computed nothing wrong."""
    return store.load_outputs(record)


def _case_row(base: dict[str, Any], status: str, message: str) -> dict[str, Any]:
    """A comparisons row for a case judged as a whole (it failed, or its reference did)."""
    return {**base, "phase": "", "tensor": "", "linf": math.nan, "max_rel": math.nan, "mismatches": 0, "numel": 0,
            "oracle": "", "bound": math.nan, "bound_ratio": math.nan, "status": status, "message": message,
            "calibrated_linf": math.nan, "calibrated_ratio": math.nan, "d3_status": status}


def _registered(name: str) -> Setting | None:
    try:
        return get_setting(name)
    except UserError:
        return None  # a setting from a plugin not loaded now: judged against the default reference


def _by_feature(cases: pd.DataFrame, specs: dict[str, ModelSpec]) -> pd.DataFrame:
    """Verdict counts per (feature, setting): which layer kinds fail or diverge under which setting."""
    columns = ["feature", "setting", "cases", *STATUSES, "worst_linf"]
    rows: list[dict[str, Any]] = []
    for case in cases.itertuples():
        features = capabilities_of(specs[case.model].kind).features(specs[case.model])
        rows.extend({"feature": f, "setting": case.setting, "verdict": case.verdict, "worst_linf": case.worst_linf}
                    for f in features)
    if not rows:
        return pd.DataFrame(columns=columns)
    exploded = pd.DataFrame(rows)
    table = pd.crosstab([exploded["feature"], exploded["setting"]], exploded["verdict"]).reindex(
        columns=list(STATUSES), fill_value=0)
    table.insert(0, "cases", table.sum(axis=1))
    table["worst_linf"] = exploded.groupby(["feature", "setting"])["worst_linf"].max()
    return table.reset_index()[columns]


def _summarise(cases: pd.DataFrame, key: str) -> pd.DataFrame:
    pending = [PENDING] if (cases["verdict"] == PENDING).any() else []  # a snapshot of a running sweep
    table = pd.crosstab(cases[key], cases["verdict"]).reindex(columns=list(STATUSES) + pending, fill_value=0)
    table.insert(0, "cases", table.sum(axis=1))
    table["worst_linf"] = cases.groupby(key)["worst_linf"].max()
    return table
