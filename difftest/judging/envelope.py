"""The calibrated oracle: a result is judged by its distance to the exact one, against how far results that are
legitimately computed at its precision land from it.

For a setting of precision p (`Setting.precision`) whose reference chain ends in the root R (`registry.root_of`):

    c      the float64 run of R (the calibration registered as the centre: `settings/calibration.py`)
    e_i    max over R's legitimate runs at precision p of |r_i - c_i|: for fp32, R itself and R with another sample
           order and another thread count; for bf16, three Monte Carlo runs of R with bf16-sized rounding errors
    allow  K * (max_j e_j + u_p * |c_i|)          (u_p: the unit roundoff of p)
    ok     iff |x_i - c_i| <= allow_i for every element i; the ratio reported is max_i |x_i - c_i| / allow_i

max_j e_j is the tensor's largest legitimate deviation: a few runs cannot hit every element's worst rounding (a
short bag summed in another order may round the same), so the noise measured anywhere in the tensor stands for
all of it; u_p |c_i| is the rounding of the element itself to p. K is one global constant, measured
(`benchmarks/oracle_noise.py`): the largest ratio any clean setting reached over the calibration sweep, with a
margin. Nothing is tuned per setting. Settings the envelope cannot speak for keep the D3 verdict, and say why: a
quantized setting (its scheme's bound judges it), a bitwise one (equality is sharper), one whose root has no
float64 run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from difftest.contracts.tolerance import BOUND_PREFIX
from difftest.judging.oracle import distance

K = 4.0


@dataclass(frozen=True)
class Judgement:
    consistent: bool
    ratio: float  # max |x - c| / allowed
    linf: float  # max |x - c|: the distance to the float64 result
    mismatches: int


@dataclass
class Envelope:
    """One root's float64 result and its legitimate spread at one precision, per tensor."""

    centre: dict[str, np.ndarray]
    spread: dict[str, np.ndarray]
    unit: float
    runs: tuple[str, ...]  # the settings the spread was measured over

    @classmethod
    def measure(cls, centre: dict[str, np.ndarray], runs: dict[str, dict[str, np.ndarray]], unit: float) -> Envelope:
        spread: dict[str, np.ndarray] = {}
        for name, c in centre.items():
            if name.startswith(BOUND_PREFIX):
                continue
            c64 = c.astype(np.float64)
            for outputs in runs.values():
                r = outputs.get(name)
                if r is None or r.shape != c.shape:
                    continue  # an activation one run did not record; the others measure it
                d = distance(r, c64)
                # a run that is not finite where the exact result is (or the other way round, or another infinity)
                # measured nothing there: it cannot widen the envelope to infinity (every verdict would pass) nor
                # poison it with NaN (every verdict would fail)
                d = np.where(np.isfinite(d), d, 0.0)
                spread[name] = d if name not in spread else np.maximum(spread[name], d)
        return cls({n: c.astype(np.float64) for n, c in centre.items() if n in spread}, spread, unit, tuple(runs))

    def judge(self, name: str, actual: np.ndarray) -> Judgement | None:
        """None where the envelope has no such tensor, or the shapes differ (the D3 verdict then stands)."""
        c = self.centre.get(name)
        if c is None or actual.shape != c.shape:
            return None
        e = self.spread[name]
        allowed = K * ((e.max() if e.size else 0.0) + self.unit * np.abs(c))
        diff = distance(actual, c)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(diff == 0, 0.0, diff / allowed)
        ratios = np.nan_to_num(ratios, nan=np.inf)
        mismatches = int((ratios > 1).sum())
        return Judgement(mismatches == 0, float(ratios.max()) if ratios.size else 0.0,
                         float(diff.max()) if diff.size else 0.0, mismatches)
