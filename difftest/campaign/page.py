"""The campaign's page (`DIR/report.html`), written again after every round while the campaign runs: the new causes
first, distinct causes over the campaign's time and cases (the saturation curve), cases per minute, and where the
time went per setting family with the chances the next draw gives each cell."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from difftest.storage.artifacts import atomic_write_text

LIVE_PAGE = "report.html"  # in the campaign's folder
REFRESH_S = 60  # while it runs, the page reloads itself this often


@dataclass(frozen=True)
class RoundPoint:
    """One counted round on the campaign's clock: active minutes and cases up to its end, causes seen by then."""

    number: int
    minutes: float
    cases: int
    causes: int
    new_causes: int
    kind: str
    families: str


def round_points(folder: Path) -> list[RoundPoint]:
    from difftest.campaign.rounds import PLAN_FILE, ROUND_DONE, load_seen, rounds_done

    seen = list(load_seen(folder).values())
    points, seconds, cases = [], 0.0, 0
    for number, where in enumerate(rounds_done(folder), 1):
        done = json.loads((where / ROUND_DONE).read_text())
        seconds, cases = seconds + float(done["seconds"]), cases + int(done["cases"])
        plan = json.loads((where / PLAN_FILE).read_text()) if (where / PLAN_FILE).is_file() else {}
        points.append(RoundPoint(number, seconds / 60, cases, sum(s.first_round <= number for s in seen),
                                 sum(s.first_round <= number and s.minimised_here for s in seen),
                                 plan.get("kind", "all"), ", ".join(plan.get("families", ["all"]))))
    return points


def family_rows(folder: Path) -> list[dict[str, object]]:
    """Per setting family, over every counted round: rounds, cases, wall seconds and their share, new causes, near
    misses, not-ok cases; the most time first."""
    from difftest.campaign.rounds import cell_records

    by_family: dict[str, dict[str, float]] = {}
    for cell, record in cell_records(folder).items():
        row = by_family.setdefault(cell.family, dict.fromkeys(
            ("rounds", "cases", "seconds", "new", "near_miss_rounds", "not_ok"), 0.0))
        for name in row:
            row[name] += getattr(record, name)
    total = sum(r["seconds"] for r in by_family.values()) or 1.0
    return sorted(({"family": f, **r, "share": r["seconds"] / total} for f, r in by_family.items()),
                  key=lambda r: -float(r["seconds"]))  # type: ignore[arg-type]


def _saturation(folder: Path, points: list[RoundPoint]) -> str:
    """The figure's markup; plotly's JavaScript is written once beside the page (the page is written every round)."""
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs

    if not (folder / "plotly.min.js").is_file():
        atomic_write_text(get_plotlyjs(), folder / "plotly.min.js")

    figure = go.Figure()
    minutes = [0.0] + [p.minutes for p in points]
    figure.add_trace(go.Scatter(x=minutes, y=[0] + [p.causes for p in points], mode="lines+markers",
                                name="distinct causes", line_shape="hv",
                                text=[""] + [f"round {p.number}: {p.kind} × {p.families}; {p.cases} cases"
                                             for p in points]))
    figure.add_trace(go.Scatter(x=minutes, y=[0] + [p.new_causes for p in points], mode="lines+markers",
                                name="new (no manifest entry)", line_shape="hv"))
    figure.update_layout(xaxis_title="campaign minutes (rounds' own time)", yaxis_title="causes seen", height=360,
                         margin={"t": 30})
    return str(figure.to_html(full_html=False, include_plotlyjs="directory", config={"displaylogo": False}))


def write_live_page(folder: Path, running: bool) -> Path:
    """Write `folder/report.html` from what the campaign has counted so far."""
    from markupsafe import Markup

    from difftest.campaign.rounds import (
        CampaignConfig,
        Universe,
        cell_records,
        disk_used,
        report_rows,
        rounds_done,
        universe,
    )
    from difftest.campaign.sampling import Sampling, chances
    from difftest.reporting.render import render
    from difftest.reporting.report import PAGE_STYLE

    config = CampaignConfig.load(folder) or CampaignConfig()
    points = round_points(folder)
    space: Universe | None
    try:
        space = universe(config, folder)
    except Exception:  # the page is a view: a plugin gone missing must not stop the campaign
        space = None
    next_chances = sorted(chances(space.cells, cell_records(folder), Sampling(config.sampling)).items(),
                          key=lambda item: -item[1])[:15] if space else []
    minutes = points[-1].minutes if points else 0.0
    page = render("campaign.html.j2", folder=str(folder), written=time.strftime("%Y-%m-%d %H:%M:%S"),
                  running=running, refresh=REFRESH_S, style=Markup(PAGE_STYLE), config=config,
                  rounds=len(rounds_done(folder)), cases=points[-1].cases if points else 0, minutes=minutes,
                  per_minute=(points[-1].cases / minutes) if points and minutes else 0.0,
                  disk_mb=disk_used(folder) / 1e6, causes=report_rows(folder), families=family_rows(folder),
                  next_chances=[(cell.label(), p) for cell, p in next_chances],
                  cells=len(space.cells) if space else 0,
                  saturation=Markup(_saturation(folder, points)) if points else "", points=points)
    path = folder / LIVE_PAGE
    atomic_write_text(page, path)
    return path
