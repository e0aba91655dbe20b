"""A case's signature: what stays the same across the cases one bug makes fail, and nothing else — the normalised
message and innermost library frame of a failure; the setting family (or the parameter values the bug follows) and
where in the computation a disagreement starts. Pure functions of a run's verdicts; triage groups by them, the
minimiser and `repro.py` check them, the live view of a sweep drafts with them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.failure import Failure
from difftest.contracts.notes import parse_notes
from difftest.contracts.registry import capabilities_of, get_setting
from difftest.contracts.setting import without_sizes
from difftest.contracts.status import DISAGREEMENTS, FAILURES, Status
from difftest.judging.analysis import Analysis

# a replica's parameters after a step (partial reduce records each one's beside their mean) are parameters after it
_PHASE = re.compile(
    r"^(eval_before|train_step|state_after_step|param_after_step|eval_after_step|replica\d+_after_step)(\d*)$")
# an optimizer's state is updated before the weights it moves: a wrong accumulator is where a wrong weight starts
_PHASE_RANK = {"eval_before": 0, "train_step": 1, "state_after_step": 2, "param_after_step": 3, "eval_after_step": 4}


def normalise_message(message: str) -> str:
    """The part of a failure message that stays the same across models, ranks, shapes and runs."""
    text = Failure.parse(message).head
    text = re.sub(r"0x[0-9a-fA-F]+", "ADDR", text)
    # a peer's socket address, or "[none]" where gloo has not connected it yet: which one is a value of the run
    text = re.sub(r"\[(?:none|\d+(?:\.\d+){3}|[\da-fA-F]*:[\da-fA-F:]*)\](?::\d+)?(?:\$\d+)?", "PEER", text)
    text = _PATH.sub(_readable_path, text)
    text = re.sub(r"torch\.Size\(\[[^\]]*\]\)|\[[\d,\s]+\]|\(\d+(, \d+)+\)", "SHAPE", text)
    text = re.sub(r"\b\d+(\.\d+)?(e[-+]?\d+)?\b", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    # a wrapper's head (a rank's log tail after `ProcessesFailed`, DCP's `CheckpointException ranks:…`) names the
    # exception that was raised only at its end: where the cut would drop it, it is kept, so two failures that share
    # a wrapper and a frame stay two (DCP's missing key and its size mismatch)
    raised = [m for m in _RAISED.finditer(text) if m.start() >= MESSAGE_KEPT]
    if raised:
        last = raised[-1].group(0)[:MESSAGE_KEPT // 3]
        return f"{text[:MESSAGE_KEPT - len(last) - 3]} … {last}"
    return text[:MESSAGE_KEPT]


MESSAGE_KEPT = 240  # characters of a failure's normalised head in its signature
_RAISED = re.compile(r"(?<![\w.])(?:[\w.]*\.)?[A-Z]\w*(?:Error|Exception): [^|]*")


# a path token, absolute or relative (`results/default/models/…/model.onnx`), whole: a relative path's first folder
# must not stay glued to its file name
_PATH = re.compile(r"(?<![\w.\-/])(?:[\w.\-]+)?(?:/[\w.\-]+)+")
_RUN_FOLDERS = ("models", "outputs", "logs", "findings")
# `ModelSpec.model_id`: kind, seed, index, then a suffix (`-frozen`) and a variant (`-min`, a minimiser's trial `-m252`)
_MODEL_ID = re.compile(r"^[a-z][\w\-]*-s\d+-i\d+(?:-\w+)*$")


def _readable_path(match: re.Match[str]) -> str:
    """A path inside a run folder relative to the run, its model id generic (`<run>/models/<model>/model.onnx`), so
    one failure on several models reads and groups as one; any other path as its file name."""
    token = match.group(0)
    parts = [p for p in token.split("/") if p]
    if not token.startswith("/") and "." not in parts[-1]:
        return token  # `fp16/int2`, `quant/torchrec/fp16/out-fp16`: a setting's name or words, not a file
    for i, part in enumerate(parts[:-1]):
        if part in _RUN_FOLDERS:
            return "/".join(["<run>", *("<model>" if _MODEL_ID.match(p) else p for p in parts[i:])])
    return parts[-1] if parts else match.group(0)


def innermost_library_frame(message: str) -> str:
    """`torch/distributed/pipelining/schedules.py:_perform_action` for the deepest frame outside our code, among the
    traceback's last lines and the log (never the calling frame a stored raise keeps before them)."""
    failure = Failure.parse(str(message))
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)',
                        " ".join((failure.head, failure.last_frames, failure.log)))
    for path, function in reversed(frames):
        if "site-packages/" in path:
            return f"{path.split('site-packages/', 1)[1]}:{function}"
    return ""


def exception_type(message: str) -> str:
    match = re.match(r"^([A-Za-z_][\w.]*(Error|Exception|Failed|Violated|Interrupt|Exit)\w*):", str(message))
    return match.group(1) if match else ""


def setting_family(setting: str) -> str:
    """A setting's `family_key`, its name without its sizes: `pipeline/gpipe/ws2/stages2/mb4/balanced` →
    `pipeline/gpipe/balanced` (for a setting no loaded plugin registers, by the naming convention alone)."""
    try:
        return get_setting(setting).family_key
    except UserError:
        return without_sizes(setting)


def setting_sizes(setting: str) -> set[str]:
    """`world_size=2`, … of a registered setting: what a finding's cases may share besides their models."""
    try:
        return {f"{k}={v}" for k, v in get_setting(setting).sizes.items()}
    except UserError:
        return set()


def computation_order(kind: str, phase: str, tensor: str) -> tuple[int, int, int, int, str]:
    """Sort key of a recorded tensor of a model of `kind`: its step and phase (the training loop's), then where the
    kind's generator places it in the model (`Generator.tensor_order`)."""
    match = _PHASE.match(phase or "")
    name, step = (re.sub(r"^replica\d+_", "param_", match.group(1)), int(match.group(2) or 0)) if match else ("", 0)
    stage, position = capabilities_of(kind).tensor_order(tensor)
    return (step if name != "eval_before" else -1, _PHASE_RANK.get(name, 9), stage, position, tensor)


def tensor_class(kind: str, tensor: str) -> str:
    """The kind of tensor a divergence starts in, without the instance (`Generator.tensor_class`): `pooled.f3` →
    `pooled`, a Keras `l2_dense/kernel` → `dense/kernel`, `over.0.weight` → `over.weight`."""
    return capabilities_of(kind).tensor_class(tensor)


def first_divergence(rows: list[dict[str, Any]]) -> str:
    """`phase/tensor` of the earliest disagreeing tensor of one case's comparisons rows, in computation order, or ""."""
    bad = [r for r in rows if r["status"] in DISAGREEMENTS and r["tensor"]]
    if not bad:
        return ""
    first = min(bad, key=lambda r: computation_order(r["kind"], r["phase"], r["tensor"]))
    return f"{first['phase']}/{first['tensor']}"


def first_divergences(analysis: Analysis) -> pd.DataFrame:
    """`first_divergence` of every disagreeing case of a run at once: model, setting, phase, tensor."""
    rows = analysis.comparisons
    bad = rows[rows["status"].isin(DISAGREEMENTS) & (rows["tensor"] != "")]
    if bad.empty:
        return pd.DataFrame(columns=["model", "setting", "phase", "tensor"])
    order = bad.apply(lambda r: computation_order(r["kind"], r["phase"], r["tensor"]), axis=1)
    ordered = bad.assign(_order=order).sort_values("_order", kind="stable")
    return ordered.groupby(["model", "setting"], as_index=False).first()[["model", "setting", "phase", "tensor"]]


def setting_parameters(setting_name: str) -> tuple[str, dict[str, str]]:
    """(class name, the parameters that are not sizes) of a setting; ("", {}) for one no plugin registers now."""
    try:
        setting = get_setting(setting_name)
    except UserError:
        return "", {}
    params = {k: repr(v) for k, v in setting.params.items() if k not in setting.size_parameters}
    return type(setting).__name__, params


def separating_values(cases: pd.DataFrame) -> dict[str, set[tuple[str, str]]]:
    """Per setting class, the parameter values under which most cases disagree and elsewhere few do
    (`sharding='row_wise'` for the quantized row-wise MEAN bags): the values a bug follows."""
    judged = cases[cases["verdict"].isin((Status.OK,) + DISAGREEMENTS)]  # what ran and was compared
    table = [(cls, key, value, verdict in DISAGREEMENTS) for setting, verdict in zip(judged["setting"], judged["verdict"])
             for cls, params in [setting_parameters(setting)] for key, value in params.items()]
    if not table:
        return {}
    frame = pd.DataFrame(table, columns=["cls", "key", "value", "bad"])
    separating: dict[str, set[tuple[str, str]]] = {}
    for (cls, key), group in frame.groupby(["cls", "key"]):
        rates = group.groupby("value")["bad"].mean()
        for value, rate in rates.items():
            elsewhere = group[group["value"] != value]["bad"].mean() if (group["value"] != value).any() else 0.0
            if rate >= 0.5 and elsewhere <= rate / 2:
                separating.setdefault(cls, set()).add((key, value))
    return separating


def attributed_setting(model: str, setting: str, message: str, first_divergence: str,
                       disagreeing: set[tuple[str, str]]) -> str:
    """The setting a disagreeing case is signed as: itself, or the narrower setting its own `Setting.attribute` names
    for the mechanism its first divergence lies in (one table's sharding type in a mixed plan), where that narrower
    setting disagrees on the same model too (`disagreeing`: (model, setting) pairs). A bug that needs the mix (one table corrupting another
    that alone is fine) stays the mix's."""
    try:
        narrower = get_setting(setting).attribute(first_divergence, parse_notes(message))
    except UserError:
        return setting
    return narrower if narrower and narrower != setting and (model, narrower) in disagreeing else setting


@dataclass(frozen=True)
class Divergence:
    """One independent divergence of a disagreeing case: the setting it is signed as, where it starts, and how large
    it is there (over the sibling tensors it covers)."""

    signed_as: str
    first_divergence: str
    worst_linf: float
    worst_relative: float  # the largest |setting - reference| / |reference| over its tensors
    d3_status: str = ""  # D3's allclose over its tensors alone: "inconsistent" where it flags one of them


def _sized(signed_as: str, members: list[dict[str, Any]]) -> Divergence:
    """A divergence starting at the first of `members`, sized and judged by D3 over them alone."""
    flagged = [v for r in members if isinstance(v := r.get("d3_status"), str) and v not in ("", Status.OK)]
    return Divergence(signed_as, f"{members[0]['phase']}/{members[0]['tensor']}",
                      max(float(r["linf"]) for r in members), max(float(r["max_rel"]) for r in members),
                      flagged[0] if flagged else Status.OK)


def divergences(model: str, setting: str, kind: str, message: str, bad: list[dict[str, Any]],
                disagreeing: set[tuple[str, str]]) -> list[Divergence]:
    """The independent divergences of one disagreeing case, first in computation order first. `bad` are its
    disagreeing comparisons rows. Tensors that do not feed one another — the first divergence and the tensors of its
    class at the same step, phase and stage (the pooled embeddings of other tables, other heads) — are attributed each
    on its own (`attributed_setting`): where they fall to different settings (a mixed plan's tables of two sharding
    types, each with its own bug), the case holds two divergences, each signed and sized on its own. So does a case
    whose first divergence is small and a later tensor far larger than it grows to (`_later_cause`: a rounding-sized
    known bug beside a large one). A case with one cause gives one, sized over its first divergence's siblings."""
    rows = sorted((r for r in bad if r.get("tensor")), key=lambda r: computation_order(kind, r["phase"], r["tensor"]))
    if not rows:
        return [Divergence(attributed_setting(model, setting, message, "", disagreeing), "", math.nan, math.nan)]
    first = rows[0]
    where, cls = computation_order(kind, first["phase"], first["tensor"])[:3], tensor_class(kind, first["tensor"])
    siblings = [r for r in rows if r["phase"] == first["phase"] and tensor_class(kind, r["tensor"]) == cls
                and computation_order(kind, r["phase"], r["tensor"])[:3] == where]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in siblings:
        signed = attributed_setting(model, setting, message, f"{r['phase']}/{r['tensor']}", disagreeing)
        groups.setdefault(signed, []).append(r)
    found = [_sized(signed, members) for signed, members in groups.items()]
    later = _later_cause(kind, rows, siblings)
    if later:
        found.append(_sized(setting, later))
    return found


# a later tensor this many times further outside its calibrated envelope than the first divergence's worst one is
# not that divergence carried forward: a rounding-sized bug stays a few envelopes off as it trains on (the row-wise
# 1 - 2^-20 scaling: 2.1 envelopes before the steps, 1.95 after), while the bug it hid is 1e4-1e6 envelopes off
LATER_CAUSE_GROWTH = 1000.0


def _envelopes(row: dict[str, Any]) -> float:
    """How many envelopes off the calibrated oracle found a tensor; NaN where it did not calibrate it."""
    ratio = row.get("calibrated_ratio")
    return float(ratio) if isinstance(ratio, int | float) else math.nan


def _later_cause(kind: str, rows: list[dict[str, Any]], first: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The divergence of a second cause in a case whose first divergence is small: the first later tensor (in
    computation order) more than LATER_CAUSE_GROWTH times as far outside its envelope as the first divergence's
    worst, with the tensors of its class at its step; empty where the oracle did not calibrate those tensors."""
    start = max((_envelopes(r) for r in first), default=math.nan)
    if not start > 0:
        return []
    head = next((r for r in rows if r not in first and _envelopes(r) > LATER_CAUSE_GROWTH * start), None)
    if head is None:
        return []
    where, cls = computation_order(kind, head["phase"], head["tensor"])[:3], tensor_class(kind, head["tensor"])
    return [r for r in rows if r["phase"] == head["phase"] and tensor_class(kind, r["tensor"]) == cls
            and computation_order(kind, r["phase"], r["tensor"])[:3] == where]


def case_signature(verdict: str, kind: str, setting: str, message: str, first_divergence: str,
                   separating: dict[str, set[tuple[str, str]]], signed_as: str | None = None) -> tuple[str, str]:
    """(signature, title) of one case that is not ok; `separating` is what `separating_values` learned over its run
    (a case rerun alone, as the minimiser does, is signed with its run's contrast). A disagreement is signed as the
    setting `signed_as` names (`attributed_setting`), by default its own."""
    setting = signed_as or setting
    if verdict in FAILURES:
        frame = innermost_library_frame(message)
        text = normalise_message(message)
        signature = f"{verdict} | {exception_type(message)} | {text} | {frame}"
        return signature, f"{verdict}: {text[:120]}" + (f" (in {frame})" if frame else "")
    if first_divergence:
        phase, tensor = first_divergence.split("/", 1)
        start = re.sub(r"\d+$", "", phase) + "/" + tensor_class(kind, tensor)
    else:
        start = "?"
    cls, params = setting_parameters(setting)
    follows = sorted(set(params.items()) & set(map(tuple, separating.get(cls, ()))))
    if follows:  # the bug follows these parameter values whatever the others are: one finding
        what = f"{setting.split('/')[0]} [{', '.join(f'{k}={v}' for k, v in follows)}]"
    else:
        what = setting_family(setting)
    return (f"{verdict} | {cls} | {what} | first diverges in {start}",
            f"{verdict}: {what} first diverges in {start}")


def bad_rows(analysis: Analysis) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(model, setting) → its disagreeing comparisons rows (those naming a tensor)."""
    rows = analysis.comparisons
    bad = rows[rows["status"].isin(DISAGREEMENTS) & (rows["tensor"] != "")]
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in bad.to_dict("records"):
        grouped.setdefault((row["model"], row["setting"]), []).append(row)
    return grouped


KNOWN_CAUSE = " | known cause "  # what signs apart the cases of one signature that two known bugs explain

# the id of the known library bug that explains one divergence of a case (None: none does), given the case (a row of
# `Analysis.cases`), its message, the divergence and the D3 verdict it carries (`divergence_d3`)
CauseOf = Callable[[Any, str, "Divergence", str], "str | None"]


def divergence_d3(case_d3: str, divergence: Divergence, count: int) -> str:
    """The D3 verdict one of a case's `count` divergences carries: split, each cause is judged by D3 over its own
    tensors (a rounding-sized known bug is D3-clean beside a large one that D3 flags)."""
    return divergence.d3_status if count > 1 and divergence.d3_status else case_d3


def signatures(analysis: Analysis, separating: dict[str, set[tuple[str, str]]],
               cause_of: CauseOf | None = None) -> dict[tuple[str, str], set[str]]:
    """(model, setting) → the signatures of each case of `analysis` that is not ok (one per independent divergence,
    `divergences`), signed with `separating`; with `cause_of`, each also with the known cause that explains it
    (`KNOWN_CAUSE`), as triage signs the cases of a signature that two known bugs share."""
    messages = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    disagreeing = disagreeing_cases(analysis.cases)
    bad = bad_rows(analysis)
    signed: dict[tuple[str, str], set[str]] = {}
    for case in analysis.cases[analysis.cases["verdict"].isin(FAILURES + DISAGREEMENTS)].itertuples():
        key = (case.model, case.setting)
        message = str(messages.get(key, "") or "")
        found = divergences(case.model, case.setting, case.kind, message, bad.get(key, []), disagreeing)
        signed[key] = set()
        for d in found:
            signature = case_signature(case.verdict, case.kind, case.setting, message, d.first_divergence, separating,
                                       d.signed_as)[0]
            signed[key].add(signature)
            if cause_of is not None:
                cause = cause_of(case, message, d, divergence_d3(case.d3_verdict, d, len(found)))
                signed[key].add(f"{signature}{KNOWN_CAUSE}{cause}")
    return signed


def disagreeing_cases(cases: pd.DataFrame) -> set[tuple[str, str]]:
    """(model, setting) of every case whose verdict is a disagreement."""
    bad = cases[cases["verdict"].isin(DISAGREEMENTS)]
    return set(zip(bad["model"], bad["setting"], strict=True))


def contrast_of(setting: str, separating: dict[str, set[tuple[str, str]]]) -> dict[str, set[tuple[str, str]]]:
    """The part of a run's contrast that signs cases of `setting`'s class: what a finding's reproducer carries."""
    cls, _ = setting_parameters(setting)
    return {cls: separating[cls]} if cls in separating else {}
