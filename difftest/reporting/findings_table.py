"""findings.csv and findings.md: a run's findings as a table and as the page a person reads first (written after
triage, and again once the standalone scripts are written: the page names them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from difftest.contracts.script import STANDALONE_FILE, STANDALONE_VERDICT_FILE
from difftest.findings.triage import Finding, distinct_cases, upstream_counts
from difftest.reporting.render import render
from difftest.storage import stack
from difftest.storage.artifacts import atomic_path, atomic_write_text

FINDINGS_COLUMNS = ["id", "rank", "consequence", "status", "upstream", "known_issue", "references", "merged", "title", "signature", "cases", "models",
                    "settings", "worst_linf", "worst_bound_ratio", "first_divergence", "distinguishing",
                    "example_model", "example_setting", "example_message", "reproducer"]


def _reproducer(run_dir: Path, finding: Finding) -> str:
    return str(run_dir / "findings" / finding.id / "repro.py")


def _summary_rows(run_dir: Path, findings: list[Finding]) -> list[dict[str, Any]]:
    return [{
        "id": f.id, "rank": f.rank, "consequence": f.describe_consequence(), "status": f.status, "upstream": str(f.upstream), "known_issue": f.known.id if f.known else "",
        "references": "; ".join(str(r) for r in f.known.references) if f.known else "",
        "merged": "; ".join(i for i, _, _ in f.merged), "title": f.title, "signature": f.signature, "cases": len(f.rows),
        "models": f.rows["model"].nunique(), "settings": f.rows["setting"].nunique(),
        "worst_linf": f.rows["worst_linf"].max(), "worst_bound_ratio": f.rows["bound_ratio"].max(),
        "first_divergence": f.first_divergence, "distinguishing": "; ".join(f.distinguishing),
        "example_model": f.example["model"], "example_setting": f.example["setting"],
        "example_message": str(f.example["message"])[:300], "reproducer": _reproducer(run_dir, f),
    } for f in findings]


def standalone_verdicts(run_dir: Path, findings: list[Finding]) -> dict[str, str]:
    """Per finding, the first line of its `standalone.txt`: what its script gave, or why it has none."""
    verdicts = {}
    for f in findings:
        path = run_dir / "findings" / f.id / STANDALONE_VERDICT_FILE
        if path.is_file():
            verdicts[f.id] = path.read_text().partition("\n")[0]
    return verdicts


def write_findings(run_dir: Path, findings: list[Finding]) -> None:
    """findings.csv and findings.md (again after the standalone scripts are written: it names them)."""
    with atomic_path(run_dir / "findings.csv") as tmp:
        pd.DataFrame(_summary_rows(run_dir, findings), columns=FINDINGS_COLUMNS).to_csv(tmp, index=False)
    atomic_write_text(render(
        "findings.md.j2", run_dir=run_dir, stack=stack.describe(stack.recorded(run_dir)), findings=findings,
        reproducers={f.id: _reproducer(run_dir, f) for f in findings}, cases=distinct_cases(findings),
        upstream=upstream_counts(findings), standalone=standalone_verdicts(run_dir, findings),
        with_script={f.id for f in findings if (run_dir / "findings" / f.id / STANDALONE_FILE).is_file()}),
        run_dir / "findings.md")
