"""`report.html`: one self-contained page a person reads after a run — counts, the findings with where each starts
and how to reproduce it, a settings × models map of verdicts, and how far each family's outputs are from their
references against the tolerance. Plotly's JavaScript is embedded once, so the page opens offline."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from difftest import stack
from difftest.analysis import Analysis
from difftest.signature import setting_family

if TYPE_CHECKING:
    from difftest.minimize import Minimisation
    from difftest.triage import Finding

REPORT = "report.html"
# verdict → (heatmap code, colour); the order is the colour bar's
VERDICT_COLOURS = {"ok": "#2e9d5b", "unsupported": "#c9ccd1", "pending": "#eeeeee", "error": "#e8a33d",
                   "timeout": "#9b59b6", "crash": "#8c1c13", "nondeterministic": "#3d7fe8", "inconsistent": "#e0403a"}
EXACT = 1e-12  # where an error of exactly 0 is drawn on a log axis

_STYLE = """
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

    from difftest.oracle import Tolerance

    tol = tol or Tolerance()
    smallest = {m.finding_id: m for m in (minimised or [])}
    parts = [f"<h1>difftest report</h1><p class='muted'>{html.escape(str(run_dir))} · written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p><p id='stack' class='muted'>Stack: "
             f"{html.escape(stack.describe(stack.recorded(run_dir)))}</p>", _counts(analysis), _findings_table(run_dir, findings, smallest)]
    claims, calibrations = heatmap_rows(analysis.cases)
    figures = [("", _heatmap(analysis.cases, claims, "Verdicts: settings × models, failing settings first")),
               (f"Calibration runs ({len(calibrations)}): the calibrated oracle's measurements of each root's noise, "
                "not claims", _heatmap(analysis.cases, calibrations, "Calibration runs × models")),
               ("", _distances(analysis, tol))]
    first = True
    for folded, (title, figure) in figures:
        if figure is None:
            continue
        drawn = figure.to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False})
        if folded:  # shown on request: a reader asked for the settings, not for the oracle's bookkeeping
            parts.append(f"<details id='calibration-runs'><summary>{html.escape(folded)}</summary>{drawn}</details>")
        else:
            parts.append(f"<h2>{html.escape(title)}</h2>{drawn}")
        first = False
    parts += [_finding_section(run_dir, f, smallest.get(f.id)) for f in findings]
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>difftest: {html.escape(run_dir.name)}"
            f"</title><style>{_STYLE}</style></head><body>{''.join(parts)}</body></html>")
    path = run_dir / REPORT
    path.write_text(page, encoding="utf-8")
    return path


def _counts(analysis: Analysis) -> str:
    counts = analysis.cases["verdict"].value_counts()
    d3 = analysis.cases["d3_verdict"].value_counts()
    cells = "".join(f"<tr><td class='status-{v}'>{v}</td><td class='num'>{int(counts.get(v, 0))}</td>"
                    f"<td class='num'>{int(d3.get(v, 0))}</td></tr>"
                    for v in VERDICT_COLOURS if counts.get(v, 0) or d3.get(v, 0))
    running = ("<p><b>A sweep is still writing this run:</b> this is a snapshot of the cases it had committed.</p>"
               if analysis.sweep_running else "")
    calibrated = int((analysis.cases["calibrated"] == "yes").sum())
    return (f"<h2>Cases</h2>{running}<p>{calibrated} cases judged by the calibrated oracle (distance to the root's "
            "float64 run against the envelope of legitimate results); the others, and the D3 column, by "
            f"allclose or their scheme's bound.</p><table id='counts'><tr><th>verdict</th><th>cases</th>"
            f"<th>D3 allclose</th></tr>{cells}<tr><th>all</th><th class='num'>{len(analysis.cases)}</th>"
            f"<th class='num'>{len(analysis.cases)}</th></tr></table>")


def _size(m: Any, which: str) -> str:
    size = m.size(m.original if which == "original" else None)
    return ", ".join(f"{k} {v}" for k, v in size.items())


def _findings_table(run_dir: Path, findings: list[Finding], smallest: dict[str, Minimisation]) -> str:
    if not findings:
        return "<h2>Findings</h2><p>No findings: every case that ran agreed with its reference.</p>"
    head = ("<tr><th>id</th><th>status</th><th>finding (and its reproducer)</th><th>cases</th><th>settings</th>"
            "<th>models</th><th>first divergence</th><th>worst L∞</th><th>minimal case</th></tr>")
    rows = []
    for f in findings:
        m = smallest.get(f.id)
        minimal = html.escape(_size(m, "minimal")) if m is not None and m.best is not m.original else ""
        worst = f.rows["worst_linf"].max()
        rows.append(
            f"<tr><td><a href='#{f.id}'>{f.id}</a></td><td class='status-{f.status}'>{f.status}</td>"
            f"<td class='repro'>{html.escape(f.title)}<br><code>python "
            f"{html.escape(str(run_dir / 'findings' / f.id / 'repro.py'))}</code></td><td class='num'>{len(f.rows)}</td>"
            f"<td class='num'>{f.rows['setting'].nunique()}</td><td class='num'>{f.rows['model'].nunique()}</td>"
            f"<td><code>{html.escape(f.first_divergence)}</code></td>"
            f"<td class='num'>{'' if pd.isna(worst) else f'{worst:.3g}'}</td><td>{minimal}</td></tr>")
    return (f"<h2>Findings</h2><p>{len(findings)} distinct findings cover the "
            f"{sum(len(f.rows) for f in findings)} cases that are not ok; each case belongs to exactly one.</p>"
            f"<table id='findings'><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>")


def heatmap_rows(cases: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(the settings a reader asked about, the calibration runs), each ordered with the most failing cases first,
    then by name."""
    from difftest.registry import is_calibration

    if cases.empty:
        return [], []
    failing = (~cases["verdict"].isin(("ok", "unsupported", "pending"))).groupby(cases["setting"]).sum()
    ordered = sorted(failing.index, key=lambda name: (-int(failing[name]), name))
    return [n for n in ordered if not is_calibration(n)], [n for n in ordered if is_calibration(n)]


def _heatmap(cases: pd.DataFrame, settings: list[str], title: str) -> tuple[str, Any]:
    import plotly.graph_objects as go

    if not settings:
        return title, None
    codes = {v: i for i, v in enumerate(VERDICT_COLOURS)}
    grid = cases.pivot_table(index="setting", columns="model", values="verdict", aggfunc="first").reindex(settings)
    z = grid.apply(lambda column: column.map(codes)).to_numpy(dtype=float)
    n = len(VERDICT_COLOURS)
    scale = []
    for i, colour in enumerate(VERDICT_COLOURS.values()):  # one flat band per verdict
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    figure = go.Figure(go.Heatmap(
        z=z, x=list(grid.columns), y=list(grid.index), zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        text=grid.fillna("not run").to_numpy(), hovertemplate="%{y} × %{x}: %{text}<extra></extra>",
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


def _finding_section(run_dir: Path, f: Any, m: Any) -> str:
    lines = [f"<section class='finding' id='{f.id}'><h3>{f.id}: {html.escape(f.title)}</h3>",
             f"<p><code>{html.escape(f.signature)}</code></p><ul>",
             f"<li><span class='status-{f.status}'>{f.status}</span>, {len(f.rows)} case(s) on "
             f"{f.rows['model'].nunique()} model(s): {html.escape(', '.join(sorted(f.rows['setting'].unique())[:12]))}</li>"]
    if f.first_divergence:
        lines.append(f"<li>first diverges at <code>{html.escape(f.first_divergence)}</code></li>")
    if f.distinguishing:
        lines.append(f"<li>its cases share, and passing cases of the same settings mostly lack: "
                     f"{html.escape(', '.join(f.distinguishing))}</li>")
    message = str(f.example["message"])
    if message:
        lines.append(f"<li>message: <code>{html.escape(message[:500])}</code></li>")
    if m is not None:
        lines.append(f"<li>example <code>{html.escape(m.original.model_id)}</code> × "
                     f"<code>{html.escape(m.original.setting)}</code> ({html.escape(_size(m, 'original'))}) → minimal "
                     f"<code>{html.escape(m.best.model_id)}</code> × <code>{html.escape(m.best.setting)}</code> "
                     f"({html.escape(_size(m, 'minimal'))}) in {m.tries} tries, {m.seconds:.0f} s: "
                     f"{html.escape(m.outcome)}</li>")
    lines.append(f"<li>reproduce: <code>python {html.escape(str(run_dir / 'findings' / f.id / 'repro.py'))}</code> "
                 "(exits 1 while the finding is present)</li></ul>")
    if f.pairwise:
        sides = [(k, v) for k, v in f.pairwise.items() if k.startswith("agree")]
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td class='num'>{len(v)}</td>"
                        f"<td>{html.escape(', '.join(v[:10]))}{' …' if len(v) > 10 else ''}</td></tr>" for k, v in sides)
        lines.append(f"<p>Pairwise, on <code>{html.escape(f.pairwise['model'][0])}</code> at "
                     f"<code>{html.escape(f.pairwise['tensor'][0])}</code>: the peers of "
                     f"<code>{html.escape(f.pairwise['failing'][0])}</code> (judged against the same reference)</p>"
                     f"<table class='pairwise'><tr><th>side</th><th>settings</th><th></th></tr>{cells}</table>")
    lines.append("</section>")
    return "".join(lines)

