"""Judging a setting's outputs against the reference's. Kept apart from running, so a finished sweep can be
re-judged under another tolerance without re-running anything.

Two verdicts exist. Most tensors are judged by allclose (a `Tolerance`). A setting that knows how far it may
legitimately be off (a quantized model: the rounding of its weights and activations bounds its error) records,
beside a tensor `phase/name`, a tensor `allowed/phase/name` of the same shape; that tensor is then judged
element-wise by |actual - reference| <= allowed, and the measured error is reported beside the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from difftest.contracts.tolerance import ACTIVATION, BOUND_PREFIX, Tolerance


@dataclass(frozen=True)
class Comparison:
    phase: str
    tensor: str
    linf: float  # max |actual - reference|
    max_rel: float  # max |actual - reference| / |reference| over elements with reference != 0
    mismatches: int  # elements failing |a - r| <= atol + rtol * |r|
    numel: int
    consistent: bool
    message: str = ""
    oracle: str = ""  # "allclose(atol=…, rtol=…)" or "bound"
    bound: float = math.nan  # the allowed error at the element closest to (or furthest past) it
    bound_ratio: float = math.nan  # max |actual - reference| / allowed; > 1 where the bound is exceeded




def split_name(name: str) -> tuple[str, str]:
    phase, _, tensor = name.partition("/")
    return phase, tensor


def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float64, element by element: equal values are 0 apart, an infinity and itself too (inf - inf is NaN)
    and NaN where both have it; NaN on one side only is as far as it gets (inf)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    diff = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, diff)
    return np.where(np.isnan(diff), np.inf, diff)


def compare_tensor(
    name: str, actual: np.ndarray | None, reference: np.ndarray | None, tol: Tolerance,
    allowed: np.ndarray | None = None,
) -> Comparison:
    phase, tensor = split_name(name)
    oracle = "bound" if allowed is not None else f"allclose(atol={tol.atol:g}, rtol={tol.rtol:g})"
    if reference is None:
        return Comparison(phase, tensor, np.nan, np.nan, 0, 0, False, "not produced by the reference", oracle)
    if actual is None:
        return Comparison(phase, tensor, np.nan, np.nan, reference.size, reference.size, False, "missing from the setting's outputs", oracle)
    if actual.shape != reference.shape or (allowed is not None and allowed.shape != reference.shape):
        return Comparison(
            phase, tensor, np.nan, np.nan, reference.size, reference.size, False,
            f"shape {actual.shape} (bound {None if allowed is None else allowed.shape}) differs from the "
            f"reference's {reference.shape}", oracle,
        )
    r = reference.astype(np.float64)
    diff = distance(actual, r)
    bound = bound_ratio = math.nan
    if allowed is None:
        close = diff <= tol.atol + tol.rtol * np.abs(np.nan_to_num(r))
    else:
        limit = np.nan_to_num(allowed.astype(np.float64), nan=0.0)
        close = diff <= limit
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(diff == 0, 0.0, diff / limit)
        if ratios.size:
            worst = int(np.argmax(ratios))
            bound, bound_ratio = float(limit.flat[worst]), float(ratios.flat[worst])
    nonzero = r != 0
    with np.errstate(invalid="ignore"):  # an infinity against the other: inf / inf, as far as it gets
        relative = np.nan_to_num(diff[nonzero] / np.abs(r[nonzero]), nan=np.inf)
    max_rel = float(np.max(relative)) if np.any(nonzero) else (0.0 if not diff.any() else np.inf)
    mismatches = int((~close).sum())
    linf = float(diff.max()) if diff.size else 0.0
    return Comparison(phase, tensor, linf, max_rel, mismatches, int(r.size), mismatches == 0, "", oracle, bound, bound_ratio)


def compare(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], tol: Tolerance) -> list[Comparison]:
    """Every tensor either side recorded; `allowed/…` tensors of the outputs are bounds, not values."""
    bounds = {n[len(BOUND_PREFIX):]: v for n, v in outputs.items() if n.startswith(BOUND_PREFIX)}
    values = {n: v for n, v in outputs.items() if not n.startswith(BOUND_PREFIX)}
    reference = {n: v for n, v in reference.items() if not n.startswith(BOUND_PREFIX)}
    names = sorted(set(values) | set(reference))
    names = [n for n in names if not n.endswith(ACTIVATION)
             or (n in values and n in reference and values[n].shape == reference[n].shape)]
    return [compare_tensor(n, values.get(n), reference.get(n), tol, bounds.get(n)) for n in names]


def uniform_scale(setting: np.ndarray, reference: np.ndarray) -> float | None:
    """The factor R where the setting's tensor is R × the reference's at every element (to float32 rounding: within
    two units in the last place of each value), R not 1, and the reference has a nonzero element; else None. A bug
    that scales (a mean taken twice, a factor 1 − 2⁻²⁰) is told by R, which a maintainer weighs at once."""
    x, s = setting.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    if x.shape != s.shape or not np.isfinite(x).all() or not np.isfinite(s).all():
        return None
    nonzero = s != 0
    if not nonzero.any() or (x[~nonzero] != 0).any():
        return None
    ratio = float(np.median(x[nonzero] / s[nonzero]))
    if ratio == 1.0:
        return None
    ulp = np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)
    return ratio if bool((np.abs(x - ratio * s) <= 2 * ulp).all()) else None


def describe_scale(ratio: float) -> str:
    """`0.999999 (1 − 2⁻²⁰)`: the factor, and the power of two it differs from 1 by where it does to 1 %."""
    text = f"{ratio:.7g}"  # what float32 values carry
    gap = abs(1.0 - ratio)
    if 0 < gap < 0.5:
        power = -np.log2(gap)
        if abs(power - round(power)) < 0.015:
            digits = str(round(power)).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
            text += f" (1 {'−' if ratio < 1 else '+'} 2⁻{digits})"
    return text


def describe_ratio(setting: np.ndarray, reference: np.ndarray, reference_name: str = "the reference") -> str | None:
    """How the setting's tensor relates to the reference's where the relation is one a maintainer reads at a glance:
    one factor at every element (`uniform_scale`), or every nonzero element off on the same side (the range of the
    ratio); None where neither holds (the values scatter both ways, or zeros do not match)."""
    ratio = uniform_scale(setting, reference)
    if ratio is not None:
        return f"is {describe_scale(ratio)} × {reference_name}'s at every element"
    x, s = setting.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    nonzero = s != 0
    if x.shape != s.shape or not nonzero.any() or (x[~nonzero] != 0).any():
        return None
    ratios = x[nonzero] / s[nonzero]
    if not np.isfinite(ratios).all() or not ((ratios < 1).all() or (ratios > 1).all()):
        return None
    side = "smaller" if ratios[0] < 1 else "larger"
    return (f"is {side} in magnitude than {reference_name}'s at every nonzero element: the setting's value ÷ "
            f"{reference_name}'s runs from {ratios.min():.8g} to {ratios.max():.8g} (median {np.median(ratios):.8g})")
