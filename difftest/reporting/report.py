"""`report.html`: one self-contained page a person reads after a run — counts, the findings with where each starts
and how to reproduce it, a settings × models map of verdicts, and how far each family's outputs are from their
references against the tolerance. Plotly's JavaScript is embedded once, so the page opens offline."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from difftest.contracts.status import PENDING, Status
from difftest.findings.signature import setting_family
from difftest.judging.analysis import Analysis
from difftest.storage import stack
from difftest.storage.artifacts import atomic_write_text

if TYPE_CHECKING:
    from difftest.findings.minimise import Minimisation
    from difftest.findings.triage import Finding

REPORT = "report.html"
# verdict → (heatmap code, colour); the order is the colour bar's
VERDICT_COLOURS = {Status.OK: "#2e9d5b", Status.UNSUPPORTED: "#c9ccd1", PENDING: "#eeeeee", Status.ERROR: "#e8a33d",
                   Status.TIMEOUT: "#9b59b6", Status.CRASH: "#8c1c13", Status.NONDETERMINISTIC: "#3d7fe8", Status.INCONSISTENT: "#e0403a"}
EXACT = 1e-12  # where an error of exactly 0 is drawn on a log axis

PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #1d1d1f; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 4px 6px; vertical-align: top; }
#findings { width: 100%; table-layout: fixed; } #findings td { overflow-wrap: anywhere; }
#findings td code { word-break: break-all; } #findings td.repro code { font-size: 11px; color: #555; }
#findings th:nth-child(1) { width: 6em; } #findings th:nth-child(2) { width: 7em; } #findings th:nth-child(3) { width: 34%; }
#findings th:nth-child(4), #findings th:nth-child(5), #findings th:nth-child(6) { width: 4.5em; }
th { background: #f3f4f6; text-align: left; } td.num { text-align: right; } code { font-size: 12px; }
.status-inconsistent, .status-nondeterministic { color: #b3261e; font-weight: 600; }
.status-crash, .status-timeout, .status-error { color: #8a5300; font-weight: 600; }
section.finding { border-top: 1px solid #ccc; margin-top: 1.5em; } .muted { color: #666; }
"""


def write_report(run_dir: Path, analysis: Analysis, findings: list[Finding], minimised: list[Minimisation] | None = None,
                 tol: Any = None) -> Path:
    """Write `run_dir/report.html` and return its path."""
    import plotly.graph_objects as go  # noqa: F401  (fails here, not halfway through, if plotly is missing)
    from markupsafe import Markup

    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import distinct_cases
    from difftest.reporting.render import render

    tol = tol or Tolerance()
    smallest = {m.finding_id: m for m in (minimised or [])}
    claims, calibrations = heatmap_rows(analysis.cases)
    reasons = case_messages(analysis)
    drawn: list[tuple[str, bool, Markup]] = []
    for folded, (title, figure) in (
            ("", _heatmap(analysis.cases, claims, "Verdicts: settings × models, failing settings first", reasons)),
            (f"Calibration runs ({len(calibrations)}): the calibrated oracle's measurements of each root's noise, "
             "not claims", _heatmap(analysis.cases, calibrations, "Calibration runs × models", reasons)),
            ("", _distances(analysis, tol))):
        if figure is None:
            continue
        # plotly's own markup, its JavaScript embedded once; a folded figure is shown on request: a reader asked
        # for the settings, not for the oracle's bookkeeping
        html_figure = Markup(figure.to_html(full_html=False, include_plotlyjs=not drawn, config={"displaylogo": False}))
        drawn.append((folded or title, bool(folded), html_figure))
    counts = analysis.cases["verdict"].value_counts()
    d3 = analysis.cases["d3_verdict"].value_counts()
    page = render(
        "report.html.j2", run_name=run_dir.name, run_dir=str(run_dir), written=time.strftime("%Y-%m-%d %H:%M:%S"),
        stack=stack.describe(stack.recorded(run_dir)), style=Markup(PAGE_STYLE), sweep_running=analysis.sweep_running,
        calibrated=int(analysis.cases["calibrated"].astype(bool).sum()), total=len(analysis.cases),
        counts=[(v, int(counts.get(v, 0)), int(d3.get(v, 0))) for v in VERDICT_COLOURS
                if counts.get(v, 0) or d3.get(v, 0)],
        findings=[_shown(run_dir, f, smallest.get(f.id)) for f in findings],
        not_ok=distinct_cases(findings), figures=drawn, python=sys.executable, command=_command(run_dir))
    path = run_dir / REPORT
    atomic_write_text(page, path)
    return path


def _size(m: Any, which: str) -> str:
    size = m.size(m.original if which == "original" else None)
    return ", ".join(f"{k} {v}" for k, v in size.items())


def heatmap_rows(cases: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(the settings a reader asked about, the calibration runs), each ordered with the most failing cases first,
    then by name."""
    from difftest.contracts.registry import is_calibration

    if cases.empty:
        return [], []
    failing = (~cases["verdict"].isin((Status.OK, Status.UNSUPPORTED, PENDING))).groupby(cases["setting"]).sum()
    ordered = sorted(failing.index, key=lambda name: (-int(failing[name]), name))
    return [n for n in ordered if not is_calibration(n)], [n for n in ordered if is_calibration(n)]


def case_messages(analysis: Analysis) -> dict[tuple[str, str], str]:
    """(model, setting) → what the case recorded (an unsupported case's reason, a failure's message)."""
    rows = analysis.comparisons.drop_duplicates(["model", "setting"])
    return {(m, s): str(text) for m, s, text in zip(rows["model"], rows["setting"], rows["message"], strict=True)
            if isinstance(text, str) and text}


def _command(run_dir: Path) -> str:
    """The command working on the run, and for how long it has (the report is its last step)."""
    from difftest.storage.run_folder import last_command

    last = last_command(run_dir)
    if not last:
        return ""
    argv = last.get("argv")
    words = " ".join(str(word) for word in argv) if isinstance(argv, list) else ""
    started = float(str(last.get("started") or time.time()))
    return (f"{words} (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}, "
            f"{time.time() - started:.0f} s before this report)")


def _heatmap(cases: pd.DataFrame, settings: list[str], title: str,
             reasons: dict[tuple[str, str], str] | None = None) -> tuple[str, Any]:
    import plotly.graph_objects as go

    if not settings:
        return title, None
    codes = {v: i for i, v in enumerate(VERDICT_COLOURS)}
    grid = cases.pivot_table(index="setting", columns="model", values="verdict", aggfunc="first").reindex(settings)
    z = grid.apply(lambda column: column.map(codes)).to_numpy(dtype=float)
    # on hover, an unsupported (or failed) cell says why: the reason the setting gave
    why = reasons or {}
    text = [[("not run" if not isinstance(verdict, str) else verdict if verdict in (Status.OK, Status.INCONSISTENT)
              else f"{verdict}: {why.get((model, setting), '')[:160]}")
             for model, verdict in zip(grid.columns, row, strict=True)] for setting, row in zip(grid.index,
                                                                                               grid.to_numpy(), strict=True)]
    n = len(VERDICT_COLOURS)
    scale = []
    for i, colour in enumerate(VERDICT_COLOURS.values()):  # one flat band per verdict
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    figure = go.Figure(go.Heatmap(
        z=z, x=list(grid.columns), y=list(grid.index), zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        text=text, hovertemplate="%{y} × %{x}: %{text}<extra></extra>",
        colorbar={"tickvals": list(range(n)), "ticktext": list(VERDICT_COLOURS), "title": "verdict"}))
    figure.update_layout(height=max(400, 14 * len(grid.index) + 150), margin={"l": 320},
                         yaxis={"autorange": "reversed", "tickfont": {"size": 10}})
    return title, figure


def _distances(analysis: Analysis, tol: Any) -> tuple[str, Any]:
    """Per family, each judged case's worst distance from its reference: L∞ where allclose judges it (the
    tolerance's absolute floor drawn), the ratio to the allowed error where a bound does (1 drawn)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = analysis.comparisons.dropna(subset=["linf"])
    if rows.empty:
        return "Distances", None
    rows = rows.assign(family=rows["setting"].map(lambda s: setting_family(s).split("/")[0]))
    bounded = rows["oracle"] == "bound"
    per_case = rows[~bounded].groupby(["family", "model", "setting"], as_index=False)["linf"].max()
    ratios = rows[bounded].groupby(["family", "model", "setting"], as_index=False)["bound_ratio"].max()
    figure = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=(
        "allclose: worst L∞ per case (log)", "bounded (quantized): worst error / allowed per case (log)"))
    for frame, column, col, line, label in ((per_case, "linf", 1, tol.atol, f"atol {tol.atol:g}"),
                                            (ratios, "bound_ratio", 2, 1.0, "allowed")):
        for family, group in frame.groupby("family"):
            values = np.maximum(group[column].to_numpy(dtype=float), EXACT)
            figure.add_trace(go.Box(y=values, name=family, boxpoints="all", jitter=0.4, pointpos=0, showlegend=False,
                                    text=[f"{m} × {s}" for m, s in zip(group["model"], group["setting"])],
                                    hovertemplate="%{text}: %{y:.3g}<extra></extra>"), row=1, col=col)
        if not frame.empty:
            figure.add_hline(y=line, line_dash="dash", line_color="#b3261e", annotation_text=label, row=1, col=col)
    figure.update_yaxes(type="log")
    figure.update_layout(height=520, margin={"b": 140})
    return f"How far from the reference, per family (exact agreement drawn at {EXACT:g})", figure


@dataclass(frozen=True)
class _Shown:
    """A finding as the report shows it, with what the template would otherwise compute."""

    f: Finding
    m: Minimisation | None
    reproducer: str  # relative to the run folder, as every path of the report
    standalone: str | None
    settings: list[str]
    models: int
    worst: str
    message: str
    minimal_size: str
    original_size: str
    best_size: str


def _shown(run_dir: Path, f: Finding, m: Minimisation | None) -> _Shown:
    worst = f.rows["worst_linf"].max()
    shrunk = m is not None and m.best is not m.original
    script = run_dir / "findings" / f.id / "standalone.py"
    return _Shown(f, m, f"findings/{f.id}/repro.py", f"findings/{f.id}/standalone.py" if script.is_file() else None,
                  sorted(f.rows["setting"].unique()),
                  int(f.rows["model"].nunique()), "" if pd.isna(worst) else f"{worst:.3g}",
                  str(f.example["message"])[:500], _size(m, "minimal") if shrunk else "",
                  _size(m, "original") if m is not None else "", _size(m, "minimal") if m is not None else "")
