"""`difftest triage`: from rows to findings — every case that is not ok belongs to a finding, and to one per
independent divergence it holds (`difftest.findings.signature.divergences`: a mixed plan's two bugs are two findings).

A finding is what a maintainer would call one bug:
- a failure (`error`, `crash`, `timeout`): its status, exception type, message with numbers, shapes, paths and
  addresses removed, and the innermost frame inside the library under test (not our harness), whatever setting
  or model it happened under;
- a disagreement (`inconsistent`, `nondeterministic`): its setting family (the setting's name without world sizes,
  micro-batch and stage counts) and where it first diverges, in the order the model computes (eval before training;
  within a step, embeddings, then the dense part, then the over-arch and the prediction; parameters in module order).
For each finding the contrast with the passing cases of the same settings names what its cases share that the
passing ones mostly lack (a model kind, a world size, a layer feature). Ids are hashes of the signature: the same
run triaged again gives the same ids.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.registry import capabilities_of, get_setting
from difftest.contracts.setting import Setting
from difftest.contracts.status import CONSEQUENCE, DISAGREEMENTS, FAILURES, Status
from difftest.contracts.tolerance import Tolerance
from difftest.findings.known import KnownIssue, Upstream, match, stack_versions
from difftest.findings.semantics import SemanticDifference, semantic_difference_of
from difftest.findings.signature import (
    KNOWN_CAUSE,
    CauseOf,
    Divergence,
    bad_rows,
    case_signature,
    contrast_of,
    disagreeing_cases,
    divergence_d3,
    divergences,
    first_divergences,
    separating_values,
    setting_family,
    setting_sizes,
)
from difftest.judging.analysis import Analysis
from difftest.storage import stack
from difftest.storage.artifacts import atomic_path
from difftest.storage.run_folder import MINIMISE_FILE, list_models
from difftest.storage.store import Store


@dataclass(frozen=True)
class Pairwise:
    """D3's pairwise view of a disagreement on its example model, at its first divergence: the peers of the failing
    setting (judged against the same reference) that side with the reference, with the failing setting, or with
    neither — "this setting is wrong" against "the reference is wrong"."""

    model: str
    tensor: str
    failing: str
    with_reference: list[str]
    with_failing: list[str]
    with_neither: list[str]

    def sides(self) -> list[tuple[str, list[str]]]:
        return [("agree with the reference", self.with_reference), ("agree with the failing setting", self.with_failing),
                ("agree with neither", self.with_neither)]


@dataclass
class Finding:
    id: str
    status: str
    title: str
    signature: str
    rows: pd.DataFrame  # the failing cases: one row each (model, setting, message, first divergence, …)
    first_divergence: str = ""
    distinguishing: list[str] = field(default_factory=list)
    pairwise: Pairwise | None = None  # on the example model, for a disagreement
    # the parameter values of the run's contrast that sign this finding's cases (its reproducer signs with them too)
    contrast: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    # the library bug of difftest/findings/known_issues.toml that explains its cases, if any
    known: KnownIssue | None = None
    # else the semantic difference of difftest/findings/model_semantics.toml that explains every case: the model's
    # layers compute otherwise on a split batch by design (BatchNorm's statistics), not a library's bug
    semantics: SemanticDifference | None = None
    # findings of other signatures merged into this one because one known library bug explains them all:
    # (their id, signature, cases); the finding's own signature stays its example's, which its reproducer checks
    merged: list[tuple[str, str, int]] = field(default_factory=list)
    # its consequence (`consequence`): how many times what rounding explains its worst tensor is off (the calibrated
    # envelope's ratio, else D3's bound's), and the share of its cases' compared tensors that disagree
    beyond: float = math.nan
    touched: float = math.nan
    rank: int = 0  # 1 for the finding of the gravest consequence in its run

    def describe_consequence(self) -> str:
        if self.status not in DISAGREEMENTS:
            return f"{self.status}: the setting does not finish"
        beyond = f"{self.beyond:.3g}× what rounding explains" if not math.isnan(self.beyond) else "size not measured"
        touched = f", {self.touched:.0%} of the compared tensors" if not math.isnan(self.touched) else ""
        return beyond + touched

    @property
    def upstream(self) -> Upstream:
        if self.known is not None:
            return self.known.upstream
        if self.semantics is not None:
            return Upstream.YOUR_MODEL
        on_user_models = all("user" in capabilities_of(kind).traits for kind in self.rows["kind"])
        return Upstream.YOUR_MODEL if on_user_models else Upstream.NEW

    @property
    def example(self) -> pd.Series:
        return self.rows.iloc[0]

    @property
    def attributed(self) -> list[tuple[str, str, str, str]]:
        """(model, setting, signed as, first divergence) of its cases signed as a narrower setting
        (`Setting.attribute`: a mixed plan's case diverging in one sharding type that fails alone too)."""
        if "signed_as" not in self.rows:
            return []
        moved = self.rows[self.rows["signed_as"] != self.rows["setting"]]
        return list(zip(moved["model"], moved["setting"], moved["signed_as"], moved["first_divergence"], strict=True))


def _features(run_dir: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Model → what triage contrasts ("kind=dlrm", "has Conv1D"), and model → its layer kinds as its generator reads
    them (`Generator.features`)."""
    features, layer_kinds = {}, {}
    for _, spec in list_models(run_dir):
        layer_kinds[spec.model_id] = set(capabilities_of(spec.kind).features(spec))
        features[spec.model_id] = {f"kind={spec.kind}"} | {f"has {f}" for f in layer_kinds[spec.model_id]}
    return features, layer_kinds


def _distinguishing(failing: pd.DataFrame, cases: pd.DataFrame, features: dict[str, set[str]]) -> list[str]:
    """What every failing case has and at most half of the passing cases of the same setting families have."""
    families = set(failing["setting"].map(setting_family))
    passing = cases[cases["setting"].map(setting_family).isin(families) & (cases["verdict"] == Status.OK)]
    if passing.empty:
        return []

    def traits(model: str, setting: str) -> set[str]:
        return features.get(model, set()) | setting_sizes(setting)

    shared = set.intersection(*(traits(r.model, r.setting) for r in failing.itertuples()))
    counts = Counter(t for r in passing.itertuples() for t in traits(r.model, r.setting))
    return sorted(t for t in shared if counts[t] <= len(passing) / 2)[:4]


# how many lines the standalone script of a case has, or None where it has none: (title, model, setting, status,
# first divergence, message) -> lines (`difftest.scripts.write.script_lines`, a stage above this one)
ScriptLines = Callable[[str, str, str, str, str, str], "int | None"]


def triage(run_dir: Path, analysis: Analysis, script_lines: ScriptLines | None = None) -> list[Finding]:
    """Group every not-ok case of `analysis` into findings; write findings.csv and findings.md into `run_dir`.
    With `script_lines`, each finding's example is its case of the shortest standalone script among its settings."""
    cases = analysis.cases
    failed = cases[cases["verdict"].isin(FAILURES + DISAGREEMENTS)]
    messages = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    earliest = first_divergences(analysis)
    with atomic_path(run_dir / "first_divergence.csv") as tmp:
        earliest.to_csv(tmp, index=False)  # per disagreeing case
    bad = bad_rows(analysis)
    features, layer_kinds = _features(run_dir)
    versions = stack_versions(stack.recorded(run_dir).get("libraries", {}))
    separating = separating_values(cases)
    disagreeing = disagreeing_cases(cases)
    keyed: dict[str, list[dict[str, Any]]] = {}
    titles: dict[str, str] = {}
    for case in failed.itertuples():
        message = str(messages.get((case.model, case.setting), "") or "")
        # each independent divergence on its own: a mixed case whose divergence lies in one mechanism that disagrees
        # alone too is that mechanism's case, and a case with two causes counts in both findings
        found = divergences(case.model, case.setting, case.kind, message, bad.get((case.model, case.setting), []),
                            disagreeing)
        for d in found:
            row = {"model": case.model, "setting": case.setting, "status": case.verdict, "kind": case.kind,
                   "d3_verdict": divergence_d3(case.d3_verdict, d, len(found)), "message": message,
                   "first_divergence": d.first_divergence,
                   "signed_as": d.signed_as, "relative": d.worst_relative, "causes": len(found),
                   # split, each cause is sized over its own tensors (not the other's, nor what both feed later)
                   "worst_linf": d.worst_linf if len(found) > 1 else case.worst_linf}
            signature, title = case_signature(case.verdict, case.kind, case.setting, message, d.first_divergence,
                                              separating, d.signed_as)
            keyed.setdefault(signature, []).append(row)
            titles[signature] = title
    bounds = _worst_bound_ratios(analysis)

    lines_of = functools.cache(script_lines) if script_lines is not None else None  # a case's, measured once
    kept = _minimised_examples(run_dir) if script_lines is not None else {}
    findings = []
    for signature, group, known in (split for signed, rows in keyed.items()
                                    for split in _by_known_cause(signed, rows, versions, layer_kinds)):
        frame = pd.DataFrame(group)
        # the example (the first row) is a case signed as itself where the finding has one: a case signed as another
        # setting (a mixed plan's, by its run's contrast) signs as itself when run alone, as its reproducer and the
        # minimisation run it, and would not reproduce the finding
        frame = frame.assign(attributed=frame["signed_as"] != frame["setting"]).sort_values(
            ["attributed", "model", "setting"]).drop(columns="attributed")
        if lines_of is not None:
            frame = _simplest_example_first(frame, functools.partial(lines_of, titles[signature.partition(KNOWN_CAUSE)[0]]),
                                            kept.get(_finding_id(signature)))
        frame = frame.assign(bound_ratio=[bounds.get((m, s), float("nan")) for m, s in zip(frame["model"], frame["setting"])])
        finding = Finding(id=_finding_id(signature), status=frame.iloc[0]["status"],
                          title=titles[signature.partition(KNOWN_CAUSE)[0]], signature=signature, rows=frame)
        finding.first_divergence = next((d for d in frame["first_divergence"] if d), "")
        finding.distinguishing = _distinguishing(frame, cases, features)
        finding.contrast = contrast_of(finding.example["setting"], separating)
        finding.known = known
        if finding.known is None:
            finding.semantics = semantic_difference_of(frame, layer_kinds)
        findings.append(finding)
    _measure_consequence(findings, analysis)
    findings.sort(key=consequence)  # a merged finding is led by a part of its gravest status
    findings = merge_known(findings, functools.partial(_example_lines, lines_of) if lines_of else None, kept)
    _measure_consequence(findings, analysis)
    findings.sort(key=consequence)
    for rank, f in enumerate(findings, 1):
        f.rank = rank
    _pairwise(run_dir, findings)
    return findings


# at most this many of a finding's settings are measured for its example (a pipeline signature spans dozens)
MEASURED_SETTINGS = 8


def _simplest_example_first(frame: pd.DataFrame, lines_of: Callable[[str, str, str, str, str], int | None],
                            kept: tuple[str, str, str] | None = None) -> pd.DataFrame:
    """The finding's rows with, first, the case of its shortest standalone script (`lines_of(model, setting, status,
    first divergence, message)`) among its first `MEASURED_SETTINGS` settings, each on the first model of its rows (a
    case signed as another setting never leads, see above): one bug shown through several settings (a pipeline
    schedule alone and inside a hybrid mesh) is minimised, reproduced and scripted through the one a maintainer reads
    quickest. Ties, and a finding none of whose cases has a script, keep the order they have. `kept` (signature, model,
    setting): the example an earlier triage of the run minimised, which leads again while it is one of these cases."""
    own = frame[frame["signed_as"] == frame["setting"]]
    if kept is not None:
        again = own[(own["model"] == kept[1]) & (own["setting"] == kept[2])]
        if len(again):
            return _first(frame, again.index[0])
    own = own.drop_duplicates("setting").head(MEASURED_SETTINGS)
    if len(own) < 2:
        return frame
    lines = {index: lines_of(str(row.model), str(row.setting), str(row.status), str(row.first_divergence),
                             str(row.message)) for index, row in zip(own.index, own.itertuples(), strict=True)}
    order = list(own.index)
    return _first(frame, min(order, key=lambda index: (_or_infinite(lines[index]), order.index(index))))


def _first(frame: pd.DataFrame, label: Any) -> pd.DataFrame:
    """`frame` with the row of index `label` first, the others in their order."""
    position = frame.index.get_loc(label)
    return pd.concat([frame.iloc[[position]], frame.drop(index=label)]) if position else frame


def _minimised_examples(run_dir: Path) -> dict[str, tuple[str, str, str]]:
    """Per finding id, the (signature, model, setting) of the example an earlier triage of this run minimised
    (`findings/<id>/minimise.json`): a rerun keeps it as the example rather than discard that minimisation."""
    import json

    kept = {}
    for path in (run_dir / "findings").glob(f"*/{MINIMISE_FILE}"):
        try:
            saved = json.loads(path.read_text())
            kept[path.parent.name] = (str(saved["signature"]), str(saved["original"]["model"]),
                                      str(saved["original"]["setting"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged file: the example is chosen afresh, and minimised again
    return kept


def _finding_id(signature: str) -> str:
    return f"F{hashlib.sha1(signature.encode()).hexdigest()[:8]}"


def _example_lines(lines_of: ScriptLines, f: Finding) -> int | None:
    e = f.example
    return lines_of(f.title, str(e["model"]), str(e["setting"]), str(e["status"]), str(e["first_divergence"]),
                    str(e["message"]))


def _signed_otherwise(example: pd.Series) -> bool:
    """Whether a finding's example is a case signed as another setting (a mixed plan's): never a merge's lead where
    another part's is signed as itself."""
    return str(example.get("signed_as", example["setting"])) != str(example["setting"])


def _or_infinite(lines: int | None) -> float:
    return math.inf if lines is None else lines


def merge_known(findings: list[Finding], example_lines: Callable[[Finding], int | None] | None = None,
                kept: Mapping[str, tuple[str, str, str]] | None = None) -> list[Finding]:
    """One root cause, one finding: findings whose cases one known library bug (or one semantic difference of the
    model's) explains become one, titled by that cause; the others are recorded in `merged`. It is led (its example,
    signature and reproducer) by the one an earlier triage of the run minimised (`kept`, by the merged id: signature,
    model, setting) while it is still among them, else by the first of them, in the order given, among those of the
    gravest status whose example is signed as itself, whose example has the shortest standalone script
    (`example_lines`; without it, the first): the same bug through the plain setting rather than through the one that
    composes it with more. Findings no entry explains stay apart (their signatures are all the evidence there is).
    Order is kept."""
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        cause = f.known or f.semantics
        groups.setdefault(cause.id if cause is not None else f.id, []).append(f)
    merged = []
    for key, group in groups.items():
        merged_id = _finding_id(f"known | {key}")
        if example_lines is not None and len(group) > 1:
            peers = [f for f in group if f.status == group[0].status]
            before = (kept or {}).get(merged_id)
            again = [f for f in peers if (f.signature, str(f.example["model"]), str(f.example["setting"])) == before]
            simplest = again[0] if again else min(peers, key=lambda f: (
                _signed_otherwise(f.example), _or_infinite(example_lines(f)), peers.index(f)))
            group = [simplest, *(f for f in group if f is not simplest)]
        lead = group[0]
        cause = lead.known or lead.semantics
        if cause is not None:  # named by its cause, as a maintainer would say it, rather than where it shows
            lead = dataclasses.replace(lead, title=f"{lead.status}: {cause.title}")
        if len(group) > 1:
            lead = dataclasses.replace(
                lead, id=merged_id,
                rows=pd.concat([f.rows for f in group]),  # the lead's rows first: its example stays the example
                merged=[(f.id, f.signature, len(f.rows)) for f in group])
        merged.append(lead)
    return merged


def distinct_cases(findings: list[Finding]) -> int:
    """The cases the findings cover, each once (a case with two independent divergences is in two findings)."""
    return len({(m, s) for f in findings for m, s in zip(f.rows["model"], f.rows["setting"], strict=True)})


def upstream_counts(findings: list[Finding]) -> str:
    """`1 known, 7 related, 5 unreported, 0 new`: how many findings upstream has, in the order of `Upstream`."""
    counted = Counter(f.upstream for f in findings)
    return ", ".join(f"{counted.get(u, 0)} {u}" for u in Upstream)


def _number(value: object) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(str(value))


def known_cause_of(versions: Mapping[str, str | None] | None, layer_kinds: Mapping[str, set[str]]) -> CauseOf:
    """How `_by_known_cause` names the cause of one divergence of a case, for `signatures`: the known bug that
    explains it on the releases `versions` (a run's, `stack_versions`), its model's layer kinds in `layer_kinds`."""
    def cause(case: Any, message: str, divergence: Divergence, d3_verdict: str) -> str | None:
        issue = _explaining(divergence.signed_as, case.verdict, message, case.kind, case.model, d3_verdict,
                            _number(divergence.worst_relative), versions, layer_kinds)
        return issue.id if issue is not None else None

    return cause


def known_causes_here(run_dir: Path) -> CauseOf:
    """`known_cause_of` for the cases of `run_dir`'s models run by this process, on its stack: how the minimisation
    and a reproducer sign a case as triage signed its finding."""
    return known_cause_of(_versions_here(), _features(run_dir)[1])


@functools.cache
def _versions_here() -> dict[str, str | None]:
    """This process's libraries (asked once: a minimisation signs every round with them)."""
    return stack_versions(stack.current().get("libraries", {}))


def _explaining(signed_as: str, status: str, message: str, kind: str, model: str, d3_verdict: str,
                relative: float | None, versions: Mapping[str, str | None] | None,
                layer_kinds: Mapping[str, set[str]] | None) -> KnownIssue | None:
    """The known bug that explains one divergence of a case: its kind's traits and its model's layer kinds match."""
    return match(signed_as, status, message, capabilities_of(kind).traits | (layer_kinds or {}).get(model, set()),
                 d3_verdict, versions=versions, relative=relative)


def _by_known_cause(signature: str, rows: list[dict[str, Any]], versions: Mapping[str, str | None] | None,
                    layer_kinds: Mapping[str, set[str]] | None) -> list[tuple[str, list[dict[str, Any]], KnownIssue | None]]:
    """A signature's cases grouped by the known library bug that explains each (among those known on the run's
    releases, `versions`; an entry's traits match the kind's or the model's layer kinds), with that bug: cases that
    look alike (one setting class, one first tensor) under settings with two known causes are two findings. One
    group keeps the signature; several are signed apart by their cause."""
    groups: dict[str | None, tuple[KnownIssue | None, list[dict[str, Any]]]] = {}
    for row in rows:
        issue = _explaining(row.get("signed_as", row["setting"]), row["status"], row["message"], row["kind"],
                            row["model"], row["d3_verdict"], _number(row.get("relative")), versions, layer_kinds)
        groups.setdefault(issue.id if issue is not None else None, (issue, []))[1].append(row)
    if len(groups) == 1:
        ((issue, group),) = groups.values()
        return [(signature, group, issue)]
    return [(f"{signature}{KNOWN_CAUSE}{cause}", group, issue) for cause, (issue, group) in groups.items()]


def _pairwise(run_dir: Path, findings: list[Finding], tol: Tolerance = Tolerance()) -> None:
    """For each disagreement, every peer of the failing setting on the example model (judged against the same
    reference, by the plain tolerance), compared at the first divergence with the reference and with it."""
    store = Store(run_dir)
    try:
        records = store.records()
        for finding in findings:
            if finding.status not in DISAGREEMENTS or not finding.first_divergence:
                continue
            example = finding.rows[finding.rows["first_divergence"] != ""].iloc[0]
            model, failing, tensor = example["model"], example["setting"], example["first_divergence"]
            failing_setting = _registered(failing)
            if failing_setting is None:
                continue
            by_setting = {r.setting: r for r in records if r.model == model and r.status == Status.OK and r.outputs}

            def value(setting: str) -> np.ndarray | None:
                try:
                    return store.load_outputs(by_setting[setting]).get(tensor)
                except (KeyError, UserError):
                    return None

            reference, bad = value(failing_setting.reference), value(failing)
            if reference is None or bad is None:
                continue
            sides: dict[str, list[str]] = {"reference": [], "failing": [], "neither": []}
            for name in sorted(by_setting):
                other = _registered(name)
                if (name in (failing, failing_setting.reference) or other is None or other.tolerance(tol) != tol
                        or other.reference != failing_setting.reference):  # peers: judged against the same run
                    continue
                mine = value(name)
                if mine is None or mine.shape != reference.shape:
                    continue
                with_reference = np.allclose(mine, reference, atol=tol.atol, rtol=tol.rtol)
                # the failing setting's tensor may have another shape (it is one way a setting disagrees)
                with_failing = mine.shape == bad.shape and np.allclose(mine, bad, atol=tol.atol, rtol=tol.rtol)
                sides["reference" if with_reference else "failing" if with_failing else "neither"].append(name)
            if any(sides.values()):  # no peer at all (a quantized setting's reference is its own): nothing to show
                finding.pairwise = Pairwise(model, tensor, failing, sides["reference"], sides["failing"],
                                            sides["neither"])
    finally:
        store.close()


def _registered(name: str) -> Setting | None:
    try:
        return get_setting(name)
    except UserError:
        return None


def consequence(f: Finding) -> tuple[int, float, float, int, str]:
    """Sort key, the gravest first: a crash, a hang, an error (the run stops), then a silent difference by the order of
    magnitude it exceeds what rounding explains, then by the share of the output it touches, then by its cases."""
    magnitude = math.floor(math.log10(f.beyond)) if f.beyond > 0 and math.isfinite(f.beyond) else \
        (99 if f.beyond == math.inf else -99)
    return (CONSEQUENCE.index(f.status), -magnitude, -(0.0 if math.isnan(f.touched) else f.touched), -len(f.rows),
            f.id)


def _measure_consequence(findings: list[Finding], analysis: Analysis) -> None:
    """Each disagreement's `beyond` and `touched`, over its cases' compared tensors (the calibrated ratio where the
    calibrated oracle judged a tensor, else D3's bound ratio)."""
    rows = analysis.comparisons[analysis.comparisons["tensor"] != ""]
    by_case = {key: group for key, group in rows.groupby(["model", "setting"])}
    for f in findings:
        if f.status not in DISAGREEMENTS:
            continue
        cases = [by_case[key] for key in set(zip(f.rows["model"], f.rows["setting"], strict=True)) if key in by_case]
        if not cases:
            continue
        compared = pd.concat(cases)
        ratio = compared["calibrated_ratio"].where(compared["calibrated_ratio"].notna(), compared["bound_ratio"])
        f.beyond = float(ratio.max()) if ratio.notna().any() else math.nan
        f.touched = float(compared["status"].isin(DISAGREEMENTS).mean())


def _worst_bound_ratios(analysis: Analysis) -> dict[tuple[str, str], float]:
    rows = analysis.comparisons.dropna(subset=["bound_ratio"])
    ratios: dict[tuple[str, str], float] = rows.groupby(["model", "setting"])["bound_ratio"].max().to_dict()
    return ratios
