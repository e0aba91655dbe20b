"""Judging a setting's outputs against the reference's. Kept apart from running, so a finished sweep can be
re-judged under another tolerance without re-running anything."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """D3's default verdict: numpy.allclose(actual, reference, atol=5e-4, rtol=1e-4)."""

    atol: float = 5e-4
    rtol: float = 1e-4


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


def split_name(name: str) -> tuple[str, str]:
    phase, _, tensor = name.partition("/")
    return phase, tensor


def compare_tensor(name: str, actual: np.ndarray | None, reference: np.ndarray | None, tol: Tolerance) -> Comparison:
    phase, tensor = split_name(name)
    if reference is None:
        return Comparison(phase, tensor, np.nan, np.nan, 0, 0, False, "not produced by the reference")
    if actual is None:
        return Comparison(phase, tensor, np.nan, np.nan, reference.size, reference.size, False, "missing from the setting's outputs")
    if actual.shape != reference.shape:
        return Comparison(
            phase, tensor, np.nan, np.nan, reference.size, reference.size, False,
            f"shape {actual.shape} differs from the reference's {reference.shape}",
        )
    a = actual.astype(np.float64)
    r = reference.astype(np.float64)
    diff = np.abs(a - r)
    both_nan = np.isnan(a) & np.isnan(r)
    diff = np.where(both_nan, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only is as far as it gets
    close = diff <= tol.atol + tol.rtol * np.abs(np.nan_to_num(r))
    nonzero = r != 0
    max_rel = float(np.max(diff[nonzero] / np.abs(r[nonzero]))) if np.any(nonzero) else (0.0 if not diff.any() else np.inf)
    mismatches = int((~close).sum())
    linf = float(diff.max()) if diff.size else 0.0
    return Comparison(phase, tensor, linf, max_rel, mismatches, int(r.size), mismatches == 0)


def compare(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], tol: Tolerance) -> list[Comparison]:
    names = sorted(set(outputs) | set(reference))
    return [compare_tensor(n, outputs.get(n), reference.get(n), tol) for n in names]
