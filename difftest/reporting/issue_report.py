"""`findings/<id>/ISSUE.md`: a finding as a library maintainer would want it filed.

A title, the environment the run recorded (`difftest.storage.stack`), what happened on the finding's example and what was
expected instead (and why: the oracle in one paragraph), how to reproduce it, and the upstream issues the manifest
relates it to. Rendered from `templates/ISSUE.md.j2`; every value comes from the run's own tables and outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.failure import Failure
from difftest.contracts.script import STANDALONE_FILE
from difftest.contracts.status import Status
from difftest.reporting.render import render
from difftest.scripts.write import recorded_run, why_no_script
from difftest.storage import stack
from difftest.storage.artifacts import atomic_write_text

if TYPE_CHECKING:
    from difftest.findings.minimise import Minimisation
    from difftest.findings.triage import Finding
    from difftest.judging.analysis import Analysis

ISSUE_FILE = "ISSUE.md"
# the environment lines a report carries: the recorded libraries, less Ray (difftest's executor, not a library under
# test); one the run's stack lacks is left out
ENVIRONMENT = tuple(name for name in stack.LIBRARIES if name != "ray")


@dataclass(frozen=True)
class Evidence:
    """What the run measured on the finding's example at its worst tensor."""

    tensor: str
    reference: str  # the setting it was judged against
    linf: float
    mismatches: int
    numel: int
    calibrated_linf: float | None
    calibrated_ratio: float | None
    reference_value: float | None
    setting_value: float | None
    # where the setting's tensor is one factor times the reference's at every element: that factor, as a maintainer
    # weighs it (`difftest.judging.oracle.describe_scale`)
    scale: str | None = None


def _number(value: object) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(str(value))


def evidence(run_dir: Path, analysis: Analysis, model: str, setting: str, tensor: str = "") -> Evidence | None:
    """The example's comparison row of `tensor` (its first divergence) where it has one, else the one with the
    largest error among those not ok (else overall), with both sides' values at its worst element."""
    from difftest.findings.repro import stored_pair
    from difftest.judging.oracle import describe_ratio

    rows = analysis.comparisons[(analysis.comparisons["model"] == model) & (analysis.comparisons["setting"] == setting)]
    compared = rows.dropna(subset=["linf"])
    if compared.empty:
        return None
    failing = compared[compared["status"] != Status.OK]
    named = compared[compared["phase"] + "/" + compared["tensor"] == tensor]
    pool = named if not named.empty else failing if not failing.empty else compared
    worst: pd.Series = pool.loc[pool["linf"].idxmax()]
    pair = stored_pair(run_dir, setting, worst)
    values, scale = None, None
    if pair is not None:
        theirs, mine = pair
        at = np.unravel_index(np.argmax(np.abs(mine.astype(np.float64) - theirs.astype(np.float64))), mine.shape)
        values = theirs[at].item(), mine[at].item()
        scale = describe_ratio(mine, theirs, "the first run" if setting.startswith("rerun/") else
                               "the single-process program")
    return Evidence(tensor=f"{worst['phase']}/{worst['tensor']}", reference=str(worst["reference"]),
                    linf=float(worst["linf"]), mismatches=int(worst["mismatches"]), numel=int(worst["numel"]),
                    calibrated_linf=_number(worst.get("calibrated_linf")),
                    calibrated_ratio=_number(worst.get("calibrated_ratio")),
                    reference_value=values[0] if values else None, setting_value=values[1] if values else None,
                    scale=scale)


def _readable(message: str) -> str:
    """A stored message keeps a traceback on one line (`exception || frame | code | frame …`): its lines again."""
    return Failure.parse(message).readable()


def _family(setting: str) -> str:
    from difftest.contracts.registry import get_setting

    try:
        return get_setting(setting).family
    except UserError:  # a plugin's setting, judged without its plugin
        return setting.split("/")[0]


# an inline script a maintainer reads in the issue itself; a longer one is named
INLINE_LINES = 120


def script_libraries(script: Path) -> tuple[str, ...] | None:
    """The distributions a standalone script prints the releases of (its `LIBRARIES`): what its finding involves."""
    import re

    from difftest.contracts.syntax import literal

    if not script.is_file():
        return None
    found = re.search(r"^LIBRARIES = (\(.*\))$", script.read_text(encoding="utf-8"), re.MULTILINE)
    try:
        return tuple(literal(found[1])) if found else None
    except (ValueError, SyntaxError):
        return None


def environment(run_dir: Path, involved: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """The machine and the releases of the libraries the finding `involved` (every recorded one where not known)."""
    recorded = stack.recorded(run_dir)
    if not recorded:
        return [("stack", "not recorded (a run made before difftest recorded it)")]
    libraries = recorded.get("libraries", {})
    cpu = recorded.get("cpu", "?") + (f" ({recorded['cpu_capability']} kernels)" if recorded.get("cpu_capability")
                                      else "")
    lines = [("python", recorded.get("python", "?")), ("OS", recorded.get("os", "?")), ("CPU", cpu)]
    if recorded.get("gpus"):
        lines.append(("GPUs", f"{', '.join(recorded['gpus'])} (CUDA {recorded.get('cuda')})"))
    return lines + [(name, libraries[name]) for name in ENVIRONMENT if name in libraries
                    and (involved is None or name in involved)]


def write_issue(run_dir: Path, analysis: Analysis, finding: Finding, minimised: Minimisation | None) -> Path:
    """Write `findings/<id>/ISSUE.md` for one finding and return its path."""
    folder = run_dir / "findings" / finding.id
    folder.mkdir(parents=True, exist_ok=True)
    model, setting = str(finding.example["model"]), str(finding.example["setting"])
    minimal = None
    if minimised is not None and minimised.best is not minimised.original:
        minimal = {"model": minimised.best.model_id, "setting": minimised.best.setting, "size": minimised.size(),
                   "original": minimised.size(minimised.original), "outcome": minimised.outcome}
    standalone = folder / STANDALONE_FILE
    source = standalone.read_text(encoding="utf-8") if standalone.is_file() else ""
    text = render("ISSUE.md.j2", finding=finding, model=model, setting=setting, family=_family(setting),
                  environment=environment(run_dir, script_libraries(standalone)),
                  inline=source if source and source.count("\n") <= INLINE_LINES else None,
                  script_lines=source.count("\n"),
                  evidence=evidence(run_dir, analysis, model, setting, finding.first_divergence),
                  worst_linf=float(finding.rows["worst_linf"].max()),
                  minimal=minimal, message=_readable(str(finding.example.get("message") or "")),
                  standalone=standalone.name if standalone.is_file() else None, ran=recorded_run(folder),
                  no_script=why_no_script(folder),
                  settings=sorted(finding.rows["setting"].unique()), models=finding.rows["model"].nunique())
    path = folder / ISSUE_FILE
    atomic_write_text(text, path)
    return path


def write_issues(run_dir: Path, analysis: Analysis, findings: list[Finding],
                 minimised: list[Minimisation]) -> list[Path]:
    by_id = {m.finding_id: m for m in minimised}
    return [write_issue(run_dir, analysis, f, by_id.get(f.id)) for f in findings]
