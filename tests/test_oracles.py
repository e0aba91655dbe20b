"""The seeds' oracles of issue 6 on real process groups: determinism, checkpoint/resume, re-partitioning,
asynchronous pipelines, partial reduce. Clean settings give zero findings; each planted fault is reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store
from generators.inputs import Batch, JaggedFeature
from settings._partial_reduce_replicas import partner_groups
from settings._pipedream import forward_version, one_f_one_b
from settings.repartition import moved_split
from tests.conftest import PLANTED

CLEAN = [
    "reference", "accumulate/mb4", "ddp/default/ws2",
    "resume/single/uninterrupted", "resume/single/single/k3", "resume/single/single/k3/fast-forward",
    "resume/fsdp2-ws2/fsdp2-ws4/k3",
    "accumulate/mb2/momentum0.9/steps4", "repartition/gpipe/ws2/mb2/uninterrupted", "repartition/gpipe/ws2/mb2/moved",
    "async-pipeline/stash/stages2/mb4", "async-pipeline/simulator/stash/stages2/mb4",
    "async-pipeline/vertical-sync/stages2/mb4", "async-pipeline/simulator/vertical-sync/stages2/mb4",
    "async-pipeline/flush/stages2/mb4",
    "partial-reduce/ws4/group2/sync2", "partial-reduce/ws4/group2/sync2/hetero",
    "partial-reduce/simulator/ws4/group2/sync2", "partial-reduce/ws2/group2/every-step",
]
TWICE = ["rerun/reference", "rerun/ddp/default/ws2", "rerun/async-pipeline/stash/stages2/mb4"]
FAULTS = {
    "faults/resume_forgets_optimizer": "inconsistent", "faults/resume_forgets_rng": "inconsistent",
    "faults/resume_forgets_loader": "inconsistent", "faults/repartition_loses_key/ws2": "inconsistent",
    "faults/stash_queue_one_short/stages2": "inconsistent",
    "faults/partial_average_forgets_replica/ws4": "inconsistent",
    "rerun/faults/unseeded_lr": "nondeterministic",
}


def test_oracles_hold_on_clean_settings_and_catch_planted_faults(fresh_run: Path) -> None:
    selected = CLEAN + TWICE + list(FAULTS) + ["faults/unseeded_lr"]
    run_sweep(fresh_run, SweepOptions(settings=",".join(selected), plugins=(PLANTED,), timeout_s=120))
    analysis = analyze(fresh_run, plugins=(PLANTED,))
    cases = analysis.cases
    verdict = {(c.model, c.setting): c.verdict for c in cases.itertuples()}
    models = sorted({m for m, _ in verdict})
    assert len(models) == 2
    for model in models:
        for setting in CLEAN + TWICE:
            assert verdict[(model, setting)] == "ok", (model, setting)
        for setting, expected in FAULTS.items():
            assert verdict[(model, setting)] == expected, (model, setting)
    # the asynchronous schedules really are asynchronous: stashing and vertical sync train differently
    store = Store(fresh_run)
    try:
        records = {(r.model, r.setting): r for r in store.records()}
        stash = store.load_outputs(records[(models[0], "async-pipeline/simulator/stash/stages2/mb4")])
        vertical = store.load_outputs(records[(models[0], "async-pipeline/simulator/vertical-sync/stages2/mb4")])
    finally:
        store.close()
    params = [k for k in stash if k.startswith("param_after_step")]
    assert any(not np.array_equal(stash[k], vertical[k]) for k in params)
    # a nondeterminism is filed as one: the setting against its own first run, not against one process
    from difftest.findings.triage import triage
    from difftest.reporting.issue_report import write_issues

    findings = triage(fresh_run, analysis)
    write_issues(fresh_run, analysis, findings, [])
    twice = next(f for f in findings if f.status == "nondeterministic")
    prose = " ".join((fresh_run / "findings" / twice.id / "ISSUE.md").read_text().split())
    assert "run a second time, deterministic algorithms on, computes different numbers from its first run" in prose
    assert "At its worst element the first run gives `" in prose, prose
    assert "single process" not in prose and "single-process" not in prose, prose


def test_pipedream_schedule_and_staleness_rule() -> None:
    assert one_f_one_b(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # stage s of S computes on weights S-1-s updates old; vertical sync uses stage 0's version everywhere
    assert [forward_version("stash", 0, m, 0, 3) for m in range(5)] == [0, 0, 0, 1, 2]
    assert [forward_version("stash", 8, m, 2, 3) for m in range(3)] == [8, 9, 10]
    assert forward_version("vertical-sync", 0, 4, 2, 3) == 2 and forward_version("flush", 5, 3, 0, 3) == 5


def test_partner_schedule_and_moved_split() -> None:
    groups = partner_groups(7, 1, 4, 2)
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3] and all(len(g) == 2 for g in groups)
    assert groups == partner_groups(7, 1, 4, 2)
    assert sorted(len(g) for g in partner_groups(0, 3, 3, 2)) == [1, 2]
    assert moved_split([0, 1], 4) == [0, 2] and moved_split([0, 3], 4) == [0, 2]


def test_batch_take_keeps_bags_with_their_samples() -> None:
    feature = JaggedFeature(np.array([2, 0, 1]), np.array([10, 11, 12]), np.array([0.5, 1.5, 2.5], np.float32))
    batch = Batch(np.array([0.0, 1.0, 2.0], np.float32), np.arange(6, dtype=np.float32).reshape(3, 2), {"f": feature})
    taken = batch.take(np.array([2, 0]))
    assert taken.labels.tolist() == [2.0, 0.0] and taken.dense.tolist() == [[4, 5], [0, 1]]
    assert taken.sparse["f"].lengths.tolist() == [1, 2] and taken.sparse["f"].values.tolist() == [12, 10, 11]
    assert taken.sparse["f"].weights.tolist() == [2.5, 0.5, 1.5]


def test_every_case_prefers_deterministic_kernels_and_a_rerun_insists(fresh_run: Path) -> None:
    """A rerun is compared with a first run that chose the same kernels: both run in deterministic mode, the
    first only warning where an op has no deterministic kernel, the rerun raising."""
    run_sweep(fresh_run, SweepOptions(settings="probes/determinism_mode,rerun/probes/determinism_mode",
                                      models="*-i0", plugins=(PLANTED,)))
    store = Store(fresh_run)
    modes = {r.setting: store.load_outputs(r)["mode/deterministic_warn_only"].tolist() for r in store.records()
             if r.setting.endswith("probes/determinism_mode")}  # the sweep also brings `reference`
    store.close()
    assert modes == {"probes/determinism_mode": [1, 1], "rerun/probes/determinism_mode": [1, 0]}


@pytest.mark.timeout(150)  # its peer sleeps WAIT_S = 300 s: a phase that waited for it would be stopped here
def test_a_phase_whose_rank_fails_stops_its_waiting_peers_at_once(tmp_path: Path) -> None:
    """A resume phase's processes: the first failure ends the phase (its peers are stopped, not waited for), and the
    error names the rank that failed, not a peer that was cut loose."""
    from difftest import ProcessesFailed, run_in_processes
    from tests.faults.failing_phase import main

    with pytest.raises(ProcessesFailed, match="rank 1 exited 1.*planted: rank 1 fails at once"):
        run_in_processes(main, {}, 2, tmp_path / "work", "0-3")


def test_ranks_map_onto_the_gpus_there_are_and_too_few_is_a_reason() -> None:
    from difftest.contracts.devices import device_refusal, rank_device

    assert [rank_device("cuda", "nccl", r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [rank_device("cuda", "gloo", r, 1) for r in range(3)] == ["cuda:0"] * 3  # gloo: ranks share a GPU
    assert rank_device("cpu", "gloo", 3, 0) == "cpu"
    assert device_refusal("cuda", "nccl", 2, 1) == ("needs 2 CUDA devices (NCCL runs one rank per GPU), this machine "
                                                    "has 1; --backend gloo lets ranks share a GPU")
    assert device_refusal("cuda", "gloo", 4, 1) is None and device_refusal("cpu", "gloo", 4, 0) is None
    assert device_refusal("cuda", "gloo", 2, 0) == "needs a CUDA device, this machine has none"


def test_a_scaled_tensor_is_told_by_its_factor_and_a_one_sided_one_by_its_ratio_range() -> None:
    from difftest.judging.oracle import describe_ratio, describe_scale, uniform_scale

    rng = np.random.default_rng(0)
    reference = rng.uniform(-1, 1, 96).astype(np.float32)
    scaled = (reference.astype(np.float64) * (1 - 2**-20)).astype(np.float32)
    assert uniform_scale(scaled, reference) == pytest.approx(1 - 2**-20, rel=1e-8)  # to float32 rounding
    assert describe_scale(1 - 2**-20) == "0.999999 (1 − 2⁻²⁰)" and describe_scale(2.0) == "2"
    assert describe_ratio(scaled, reference, "x").startswith("is 0.999999 (1 − 2⁻²⁰) × x's at every element")
    # a scale plus noise beyond rounding is no uniform factor, but every value still shrinks
    shrunk = (reference * rng.uniform(0.5, 0.9, 96)).astype(np.float32)
    assert uniform_scale(shrunk, reference) is None
    assert "smaller in magnitude than x's at every nonzero element" in (describe_ratio(shrunk, reference, "x") or "")
    # values off both ways, or a zero where the reference has none: no such statement
    assert describe_ratio(reference + np.float32(0.01) * np.sign(rng.uniform(-1, 1, 96)), reference) is None
    assert uniform_scale(np.zeros(96, np.float32), np.zeros(96, np.float32)) is None
    assert uniform_scale(reference, reference) is None  # equal: no scale to tell
