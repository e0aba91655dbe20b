"""What a CI job reads from a run: `summary.json` (the cases by status, every finding with its cause, upstream status
and script) and `junit.xml` (one test case per finding, failing unless a baseline accepts its cause), written by every
analysis. A baseline is a file of accepted causes — a JSON list of cause keys, or an earlier run's summary.json, whose
findings are all accepted — so that CI fails only on what is new since it was accepted.

A cause key is what makes two findings one cause across runs: the manifest entry's id where one explains it, else the
finding's signature (which names the setting family, the phase and the error or tensor class, not sizes or seeds).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from difftest.contracts.errors import UserError
from difftest.storage.artifacts import atomic_write_text

SUMMARY_FILE = "summary.json"
JUNIT_FILE = "junit.xml"


def cause_key(finding: Any) -> str:
    """The manifest entry's id (a known bug's, or a semantic difference's of the model), else the finding's
    signature."""
    cause = finding.known or getattr(finding, "semantics", None)
    return str(cause.id) if cause is not None else str(finding.signature)


@dataclass(frozen=True)
class FindingSummary:
    id: str
    cause: str
    status: str
    upstream: str
    title: str
    cases: int
    example_model: str
    example_setting: str
    script: str | None  # run-relative path of its standalone script, where it has one
    script_verdict: str  # the first line of standalone.txt: whether the script reproduces, or why there is none
    accepted: bool  # a baseline lists its cause


def load_baseline(path: Path) -> set[str]:
    """The cause keys a baseline file accepts: a JSON list of keys, or a summary.json (all its findings' causes)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--baseline {path}: not readable as JSON ({exc}); give a list of cause keys or an earlier "
                        f"run's {SUMMARY_FILE}") from None
    if isinstance(data, dict) and isinstance(data.get("findings"), list):
        return {str(f["cause"]) for f in data["findings"] if isinstance(f, dict) and "cause" in f}
    if isinstance(data, list) and all(isinstance(k, str) for k in data):
        return set(data)
    raise UserError(f"--baseline {path}: neither a JSON list of cause keys nor a difftest {SUMMARY_FILE}")


def summarise(run_dir: Path, analysis: Any, findings: list[Any], baseline: set[str] | None = None) -> list[FindingSummary]:
    """Write summary.json and junit.xml into `run_dir`; the findings as summarised."""
    from difftest.contracts.script import STANDALONE_FILE
    from difftest.contracts.status import Status
    from difftest.reporting.findings_table import standalone_verdicts

    verdicts = standalone_verdicts(run_dir, findings)
    accepted = baseline or set()
    summaries = []
    for f in findings:
        script = run_dir / "findings" / f.id / STANDALONE_FILE
        summaries.append(FindingSummary(
            f.id, cause_key(f), f.status, str(f.upstream), f.title, len(f.rows), str(f.example["model"]),
            str(f.example["setting"]), str(script.relative_to(run_dir)) if script.is_file() else None,
            verdicts.get(f.id, ""), cause_key(f) in accepted))
    counts = {str(status): analysis.count(status) for status in Status}
    atomic_write_text(json.dumps({"cases": counts, "findings": [asdict(s) for s in summaries],
                                  "baseline": sorted(accepted) if baseline is not None else None}, indent=1),
                      run_dir / SUMMARY_FILE)
    atomic_write_text(_junit(summaries, sum(counts.values())), run_dir / JUNIT_FILE)
    return summaries


def _junit(summaries: list[FindingSummary], cases: int) -> str:
    """One test case per finding (failing unless accepted), or one passing case when there is none."""
    suite = ElementTree.Element("testsuite", name="difftest", tests=str(max(len(summaries), 1)),
                                failures=str(sum(not s.accepted for s in summaries)),
                                skipped=str(sum(s.accepted for s in summaries)))
    if not summaries:
        ElementTree.SubElement(suite, "testcase", classname="difftest", name=f"{cases} cases agree with their reference")
    for s in summaries:
        case = ElementTree.SubElement(suite, "testcase", classname=f"difftest.{s.status}", name=f"{s.id}: {s.title}")
        details = (f"cause {s.cause} ({s.upstream} upstream), {s.cases} case(s), e.g. {s.example_model} under "
                   f"{s.example_setting}; script: {s.script or 'none'} ({s.script_verdict})")
        if s.accepted:
            ElementTree.SubElement(case, "skipped", message=f"accepted by the baseline: {s.cause}")
        else:
            ElementTree.SubElement(case, "failure", message=s.title).text = details
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True)
