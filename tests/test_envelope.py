"""The calibrated oracle: calibration runs of the root, the envelope rule, and a fault D3 misses that it catches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from difftest.contracts.registry import get_setting, load_plugins, root_of, tier
from difftest.judging.analysis import analyze
from difftest.judging.envelope import Envelope, K
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store

INJECT = "benchmarks.faults.inject"


def test_envelope_rule_is_distance_to_float64_against_the_largest_legitimate_deviation() -> None:
    centre = {"eval_before/prediction": np.array([1.0, 0.5, 0.0, -2.0])}
    runs = {"reference": {"eval_before/prediction": np.array([1.0, 0.5 + 1e-7, 0.0, -2.0], np.float32)},
            "calib-order/reference": {"eval_before/prediction": np.array([1.0 - 2e-7, 0.5, 0.0, -2.0], np.float32)}}
    envelope = Envelope.measure(centre, runs, unit=2.0**-24)
    noise = float(np.float32(1.0 - 2e-7)) - 1.0  # the largest legitimate deviation, at element 0
    allowed = K * (abs(noise) + 2.0**-24 * np.abs(centre["eval_before/prediction"]))
    inside = centre["eval_before/prediction"] + 0.9 * allowed
    outside = centre["eval_before/prediction"] + np.array([0, 0, 1.1, 0]) * allowed
    assert envelope.judge("eval_before/prediction", inside).consistent
    judged = envelope.judge("eval_before/prediction", outside)
    assert not judged.consistent and judged.mismatches == 1 and judged.ratio == pytest.approx(1.1)
    assert not envelope.judge("eval_before/prediction", np.array([1.0, 0.5, np.nan, -2.0])).consistent
    assert envelope.judge("eval_before/missing", inside) is None  # the D3 verdict stands there
    # an exact result that overflows: the setting's same infinity is no distance, the other sign's is
    overflowed = Envelope.measure({"a/b": np.array([np.inf, 1.0])},
                                  {"reference": {"a/b": np.array([np.inf, 1.0], np.float32)}}, unit=2.0**-24)
    assert overflowed.judge("a/b", np.array([np.inf, 1.0 + 2.0**-23], np.float32)).consistent  # its neighbour: rounding
    assert not overflowed.judge("a/b", np.array([-np.inf, 1.0], np.float32)).consistent
    # a calibration run that broke (NaN where the exact result is finite) measures nothing there: the envelope is
    # the other runs', not NaN (every verdict inconsistent) nor infinite (every verdict ok)
    broken = {**runs, "calib-fp32-a/reference": {"eval_before/prediction": np.array([np.nan, 0.5, np.inf, -2.0])}}
    assert Envelope.measure(centre, broken, unit=2.0**-24).judge("eval_before/prediction", inside).consistent
    assert not Envelope.measure(centre, broken, unit=2.0**-24).judge("eval_before/prediction", outside).consistent


def test_monte_carlo_rounding_leaves_a_programs_scalar_constants_alone() -> None:
    """x ** 3 with the exponent perturbed to 2.9999998 is NaN for x < 0 (tanh-gelu's Pow): constants are exact."""
    import torch

    from difftest.contracts.tolerance import UNIT_ROUNDOFF
    from settings.calibration import _monte_carlo_rounding

    class Cube(torch.nn.Module):
        def forward(self, x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
            return torch.pow(x, exponent)

    x = -torch.linspace(1, 2, 16, dtype=torch.float64)
    with _monte_carlo_rounding(UNIT_ROUNDOFF["fp32"], seed=1):
        y = Cube()(x, torch.tensor(3.0, dtype=torch.float64))
    assert torch.isfinite(y).all() and not torch.equal(y, x ** 3)  # the data is perturbed, the exponent is not
    assert torch.allclose(y, x ** 3, rtol=1e-6, atol=0)


def test_every_root_a_tier_judges_down_to_is_calibrated() -> None:
    load_plugins(())
    names = {s.name for s in tier("default")}
    for name in ("calib-float64/reference", "calib-order/reference", "calib-threads/reference",
                 "calib-bf16-a/reference", "calib-float64/tf/reference", "calib-order/tf/reference"):
        assert name in names
    assert "calib-threads/tf/reference" not in names  # TensorFlow fixes its thread pools at start
    assert root_of(get_setting("pipeline/gpipe/ws2/stages2/mb2/random")).name == "reference"


def test_calibrated_oracle_catches_a_small_library_fault_that_d3_passes(fresh_run: Path, monkeypatch) -> None:
    """FSDP2's all-gathered parameters off by 0.01 %, planted in torch itself: inside D3's allclose, dozens of
    envelopes away from the float64 result."""
    settings = "reference,fsdp2/per-layer/no-reshard/fp32/ws2"
    run_sweep(fresh_run, SweepOptions(settings=settings, plugins=(INJECT,)))
    clean = analyze(fresh_run, plugins=(INJECT,)).cases.set_index(["model", "setting"])
    store = Store(fresh_run)
    centre = [r for r in store.records() if r.setting == "calib-float64/reference"]
    assert centre and all(v.dtype == np.float64 for r in centre for v in store.load_outputs(r).values())
    faulty = [(r.model, r.setting) for r in store.records() if r.setting.startswith("fsdp2/")]
    store.forget(faulty)
    store.close()
    monkeypatch.setenv("DIFFTEST_FAULT", "fsdp2-all-gather:0.0001")
    run_sweep(fresh_run, SweepOptions(settings=settings, plugins=(INJECT,)))
    planted = analyze(fresh_run, plugins=(INJECT,)).cases.set_index(["model", "setting"])
    for case in faulty:
        assert clean.loc[case, "verdict"] == "ok" and clean.loc[case, "calibrated"]
        assert planted.loc[case, "d3_verdict"] == "ok"
        assert planted.loc[case, "verdict"] == "inconsistent"


@pytest.mark.needs_tf
def test_both_frameworks_calibrate_in_float64_and_leave_later_cases_in_float32(fresh_sequential_run: Path) -> None:
    """A Keras float64 build must not leak its dtype policy into the next case of the same worker (Keras fixes the
    global policy once), and a converted PyTorch model must compute its float64 run in float64 throughout."""
    settings = "tf/reference,calib-float64/tf/reference,calib-float64/reference,tf/mirrored/r2"
    run_sweep(fresh_sequential_run, SweepOptions(settings=settings, models="*-i0,*-i1-frozen"))
    store = Store(fresh_sequential_run)
    records = [r for r in store.records() if r.status == "ok"]
    outputs = {(r.model, r.setting): store.load_outputs(r) for r in records}
    store.close()
    centres = [o for (_, s), o in outputs.items() if s.startswith("calib-float64/")]
    assert len(centres) == 4 and all(v.dtype == np.float64 for o in centres for v in o.values())
    fp32 = [o for (_, s), o in outputs.items() if s in ("tf/reference", "tf/mirrored/r2")]
    assert len(fp32) == 4 and all(v.dtype == np.float32 for o in fp32 for n, v in o.items() if "/loss" not in n)
    cases = analyze(fresh_sequential_run).cases.set_index("setting")
    assert cases.loc["tf/mirrored/r2", "calibrated"].all()
