"""`findings/<id>/` of a run: one folder per finding of its latest triage, each with a reproducer.

Kept apart from triage, which judges and writes tables only: a reproducer runs cases (`difftest.findings.repro`), and a
finding minimised by an earlier triage of the run keeps the minimal reproducer its minimisation wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from difftest.findings.minimise import load_previous
from difftest.findings.repro import write_reproducer
from difftest.findings.triage import Finding
from difftest.storage.run_folder import MINIMISE_FILE


def write_finding_folders(run_dir: Path, findings: list[Finding]) -> None:
    """A folder per finding with its `repro.py`; folders of findings gone since the last triage are removed."""
    folder = run_dir / "findings"
    current = {f.id for f in findings}
    for stale in (folder.iterdir() if folder.is_dir() else []):
        if stale.name not in current:
            shutil.rmtree(stale, ignore_errors=True)
    for f in findings:
        if load_previous(run_dir, f, budget_s=0.0) is not None:
            continue  # minimised by an earlier triage of this run, and still the same finding: its reproducer stays
        (folder / f.id / MINIMISE_FILE).unlink(missing_ok=True)
        write_reproducer(run_dir, folder / f.id, f.id, f.title, f.example["model"], f.example["setting"],
                         signature=f.signature, contrast=f.contrast)
