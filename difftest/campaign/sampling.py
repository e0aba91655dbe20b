"""Where a campaign spends its rounds: cells of (setting family × model kind), drawn uniformly or guided.

A round runs one model kind under a few setting families (`RoundPlan`); the cells are every (family, kind) pair the
campaign's settings and kinds make. Uniform sampling draws every cell alike. Guided sampling scores each cell by what
its earlier rounds gave (`CellRecord`): a cause the campaign had not seen counts most, a round with a near miss (an ok
case whose worst tensor came within `NEAR_MISS` of its calibrated envelope: the area is close to breaking) counts too,
and the score is a rate per round tried, with
an optimistic prior, so a cell never tried scores as well as one that gave something once in a while and a cell tried
often with nothing to show sinks. A share `EXPLORE` of the probability is spread over every cell whatever the scores:
the floor of uniform exploration. A cell whose cases were all unsupported gives nothing to find and is left out of
guided draws. Everything here is a pure function of the records: a resumed campaign draws what it would have drawn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

EXPLORE = 0.3  # guided: the share of the probability spread uniformly over every cell
# an ok case whose worst calibrated ratio reaches this (≤ 1 is within the envelope) is a near miss; a ratio to a fixed
# bound (D3's allclose, a quantization scheme's error bound) is no envelope of the model's own noise and counts not
NEAR_MISS = 0.5
NEW_WEIGHT = 4.0  # a cause not seen before counts as this many rounds with a near miss
PRIOR = 1.0  # the optimistic prior: a cell never tried scores PRIOR / PRIOR
# a round's batch size: multiples of the default 24, so every share a setting takes of it splits as the default's does
# (a resumable run serves half the batch per step, over up to 4 ranks; pipelines cut a rank's share in micro-batches)
BATCH_SIZES = (24, 48)
INDEX_CYCLE = 3  # model variants repeat every 3 indices (index % 3 == 2: uneven widths): rounds step through them


class Sampling(StrEnum):
    UNIFORM = "uniform"
    GUIDED = "guided"


@dataclass(frozen=True, order=True)
class Cell:
    family: str
    kind: str

    def label(self) -> str:
        return f"{self.family} × {self.kind}"


@dataclass
class CellRecord:
    """What one cell's rounds gave (summed over rounds)."""

    rounds: int = 0
    cases: int = 0
    runnable: int = 0  # cases that were not unsupported
    seconds: float = 0.0  # the cases' wall time
    new: int = 0  # causes the campaign had not seen before, whose cases fell in the cell
    near_miss_rounds: int = 0  # rounds in which one of its ok cases came within NEAR_MISS of its envelope
    not_ok: int = 0

    def add(self, other: CellRecord) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass(frozen=True)
class RoundPlan:
    """What one round runs: `models` models of `kind` from indices `first_index`…, batch `batch_size`, under every
    selected setting of `families`; `chances` are the draw's probabilities per cell (for the report)."""

    sampling: Sampling
    kind: str
    families: tuple[str, ...]
    settings: tuple[str, ...]
    batch_size: int
    first_index: int
    chances: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sampling": str(self.sampling)}, indent=1)

    @classmethod
    def load(cls, path: Path) -> RoundPlan:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "sampling": Sampling(raw["sampling"]), "families": tuple(raw["families"]),
                      "settings": tuple(raw["settings"])})


def score(record: CellRecord) -> float:
    """What guided sampling expects of one more round of a cell: causes not seen before and rounds that came near, per round tried."""
    if record.rounds and not record.runnable:
        return 0.0  # every case it ran was unsupported: nothing to find there
    return (PRIOR + NEW_WEIGHT * record.new + record.near_miss_rounds) / (PRIOR + record.rounds)


def chances(cells: list[Cell], records: dict[Cell, CellRecord], sampling: Sampling) -> dict[Cell, float]:
    """Each cell's probability of being drawn (they sum to 1)."""
    if not cells:
        return {}
    uniform = 1.0 / len(cells)
    if sampling is Sampling.UNIFORM:
        return dict.fromkeys(cells, uniform)
    scores = {c: score(records.get(c, CellRecord())) for c in cells}
    total = sum(scores.values())
    if total == 0:
        return dict.fromkeys(cells, uniform)
    return {c: EXPLORE * uniform + (1 - EXPLORE) * scores[c] / total for c in cells}


def draw(cells: list[Cell], records: dict[Cell, CellRecord], sampling: Sampling, settings_of: dict[str, list[str]],
         families_per_round: int, number: int, seed: int) -> RoundPlan:
    """Round `number`'s plan: a kind drawn by its cells' summed chances, then up to `families_per_round` of its
    families drawn by their chances without replacement; batch size and first model index vary by round. Seeded by
    (seed, number): the same records give the same plan."""
    rng = random.Random(seed * 100_003 + number)
    p = chances(cells, records, sampling)
    kinds = sorted({c.kind for c in cells})
    kind = rng.choices(kinds, weights=[sum(v for c, v in p.items() if c.kind == k) for k in kinds])[0]
    pool = {c.family: p[c] for c in cells if c.kind == kind}
    families: list[str] = []
    while pool and len(families) < families_per_round:
        chosen = rng.choices(list(pool), weights=list(pool.values()))[0]
        families.append(chosen)
        del pool[chosen]
    families.sort()
    return RoundPlan(sampling, kind, tuple(families),
                     tuple(s for f in families for s in settings_of[f]), rng.choice(BATCH_SIZES),
                     number % INDEX_CYCLE, {c.label(): round(v, 4) for c, v in sorted(p.items())})


def round_cells(cases: pd.DataFrame, comparisons: pd.DataFrame, kind: str, new_cases: list[list[str]],
                family_of: Callable[[str], str]) -> dict[Cell, CellRecord]:
    """What a finished round gave, per cell, from its analysis: its cases (`cases`: model, setting, verdict, wall_s),
    their wall time, whether it came near (`comparisons`: a case whose every tensor is ok, the worst calibrated ratio
    within `NEAR_MISS` of its envelope) and the cells its new causes fell in (`new_cases`: per new cause, the settings of its cases; a cause
    counts once per cell). A setting outside the plan (a reference or calibration the sweep added) counts under its
    own family."""
    import pandas as pd

    from difftest.contracts.status import Status

    records: dict[Cell, CellRecord] = {}

    def cell(family: str) -> CellRecord:
        return records.setdefault(Cell(family, kind), CellRecord(rounds=1))

    for setting, verdict, wall_s in zip(cases["setting"], cases["verdict"], cases["wall_s"], strict=True):
        record = cell(family_of(setting))
        record.cases += 1
        record.runnable += verdict != Status.UNSUPPORTED
        record.seconds += 0.0 if pd.isna(wall_s) else float(wall_s)
        record.not_ok += verdict not in (Status.OK, Status.UNSUPPORTED)
    if len(comparisons):
        by_case = pd.DataFrame({"agrees": comparisons["status"] == str(Status.OK),
                                "ratio": comparisons["calibrated_ratio"]}).groupby(
            [comparisons["model"], comparisons["setting"]])
        worst = by_case["ratio"].max()[by_case["agrees"].all()]
        for (_, setting), value in worst.items():
            if NEAR_MISS <= value <= 1.0:
                cell(family_of(setting)).near_miss_rounds = 1  # a round came near, however many cases did
    for settings in new_cases:
        for family in {family_of(setting) for setting in settings}:
            cell(family).new += 1
    return records


def cell_totals(per_round: list[dict[Cell, CellRecord]]) -> dict[Cell, CellRecord]:
    total: dict[Cell, CellRecord] = {}
    for records in per_round:
        for c, r in records.items():
            total.setdefault(c, CellRecord()).add(r)
    return total


def records_to_json(records: dict[Cell, CellRecord]) -> str:
    return json.dumps([{"family": c.family, "kind": c.kind, **asdict(r)} for c, r in sorted(records.items())],
                      indent=1)


def records_from_json(text: str) -> dict[Cell, CellRecord]:
    rows: list[dict[str, Any]] = json.loads(text)
    return {Cell(row.pop("family"), row.pop("kind")): CellRecord(**row) for row in rows}
