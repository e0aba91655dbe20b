"""`difftest diff RUN_A RUN_B`: two runs of the same models on different stacks (another torch, another machine).

Findings are matched by signature (setting class and contrast, where the first divergence lies or which exception at
which frame), cases by (model, setting); a model whose initial weights or inputs differ between the runs is not the
same model, and its cases are left out of the comparison, with a line saying so.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.status import Status
from difftest.storage import stack


@dataclass(frozen=True)
class VerdictChange:
    model: str
    setting: str
    before: str
    after: str
    message: str  # the case's first message in the run where it is not ok


@dataclass
class RunDiff:
    stacks: tuple[dict[str, Any], dict[str, Any]]
    only_a: pd.DataFrame  # findings.csv rows
    only_b: pd.DataFrame
    both: list[tuple[str, str, str]]  # (signature, id in A, id in B)
    changed: list[VerdictChange] = field(default_factory=list)
    compared_cases: int = 0
    models_differ: list[str] = field(default_factory=list)

    def library_changes(self) -> list[str]:
        a, b = (s.get("libraries", {}) for s in self.stacks)
        return [f"{name} {a.get(name, '-')} -> {b.get(name, '-')}" for name in sorted(set(a) | set(b))
                if a.get(name) != b.get(name)]


def _model_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in ("spec.json", "init.safetensors", "inputs.safetensors"):
        path = model_dir / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return digest.hexdigest()


def _findings(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "findings.csv"
    if not path.is_file():
        raise UserError(f"{path}: missing; run `difftest analyze {run_dir}` first")
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def _verdicts(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "comparisons.csv"
    if not path.is_file():
        raise UserError(f"{path}: missing; run `difftest analyze {run_dir}` first")
    rows = pd.read_csv(path, dtype=str, keep_default_na=False, usecols=["model", "setting", "status", "message"])
    # a case's verdict is its worst comparison's: any row not ok makes the case not ok
    ranked = rows.assign(bad=rows["status"] != Status.OK).sort_values("bad", ascending=False, kind="stable")
    return ranked.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])


def diff_runs(run_a: Path, run_b: Path) -> RunDiff:
    for run in (run_a, run_b):
        if not (run / "run.json").is_file():
            raise UserError(f"{run}: no run.json; give two run folders made by `difftest run` or `difftest generate`")
    findings_a, findings_b = _findings(run_a), _findings(run_b)
    ids_a = dict(zip(findings_a["signature"], findings_a["id"], strict=True))
    ids_b = dict(zip(findings_b["signature"], findings_b["id"], strict=True))
    result = RunDiff(
        stacks=(stack.recorded(run_a), stack.recorded(run_b)),
        only_a=findings_a[~findings_a["signature"].isin(ids_b)],
        only_b=findings_b[~findings_b["signature"].isin(ids_a)],
        both=[(s, ids_a[s], ids_b[s]) for s in ids_a if s in ids_b],
    )
    models_a = {p.name: p for p in (run_a / "models").iterdir() if p.is_dir()}
    models_b = {p.name: p for p in (run_b / "models").iterdir() if p.is_dir()}
    same = set()
    for name in sorted(set(models_a) & set(models_b)):
        if _model_digest(models_a[name]) == _model_digest(models_b[name]):
            same.add(name)
        else:
            result.models_differ.append(name)
    verdicts_a, verdicts_b = _verdicts(run_a), _verdicts(run_b)
    common = [key for key in verdicts_a.index.intersection(verdicts_b.index) if key[0] in same]
    result.compared_cases = len(common)
    for key in sorted(common):
        before, after = verdicts_a.loc[key], verdicts_b.loc[key]
        if before["status"] != after["status"]:
            message = after["message"] if after["status"] != Status.OK else before["message"]
            result.changed.append(VerdictChange(key[0], key[1], before["status"], after["status"], message))
    return result
