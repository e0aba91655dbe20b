"""The CUDA path, where a GPU exists (marker `gpu`; skipped with its reason elsewhere, as in CI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU path is not run")]


def _failures(run_dir: Path, also: tuple[str, ...] = ()) -> list[str]:
    """The cases that ended error, crash or timeout (or one of `also`), with their messages."""
    from difftest.storage.store import Store

    store = Store(run_dir)
    try:
        return [f"{r.setting} on {r.model}: {r.status}: {r.message[:600]}" for r in store.records()
                if r.status in ("error", "crash", "timeout", *also)]
    finally:
        store.close()


def test_several_ranks_share_one_gpu_with_gloo_and_nothing_errors_of_our_making(tmp_path: Path) -> None:
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.judging.analysis import analyze
    from difftest.runner.sweep import SweepOptions, run_sweep

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    runs = ["reference", "ddp/default/ws2", "quant/dynamic/qint8/x86", "resume/ddp-ws2/ddp-ws2/k3"]
    # collectives gloo does not carry on CUDA tensors (all_gather, reduce_scatter, send/recv): refused, not run
    refused = ["fsdp2/per-layer/reshard/fp32/ws2", "tp/colwise-rowwise/ws2", "pipeline/1f1b/ws2/stages2/mb2/balanced",
               "resume/ddp-ws2/fsdp2-ws2/k3"]
    run_sweep(run_dir, SweepOptions(settings=",".join(runs + refused), device="cuda", backend="gloo", timeout_s=180))
    assert not _failures(run_dir)
    cases = analyze(run_dir).cases.set_index("setting")
    assert (cases.loc[runs, "verdict"] == "ok").all(), cases.loc[runs, "verdict"]
    assert (cases.loc[refused, "verdict"] == "unsupported").all(), cases.loc[refused, "verdict"]
    rows = pd.read_csv(run_dir / "inconsistencies.csv")
    assert rows.empty or not rows.status.isin(["error", "crash", "timeout"]).any()


def test_cpu_versus_gpu_strict_fp32_lies_in_the_cpu_envelope_and_a_cuda_rerun_is_bitwise(tmp_path: Path) -> None:
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.judging.analysis import analyze
    from difftest.runner.sweep import SweepOptions, run_sweep

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=2, kinds=("transformer",)))
    settings = ["cuda/reference", "cuda-tf32/reference", "rerun/cuda/reference", "cuda/ddp/default/ws2"]
    run_sweep(run_dir, SweepOptions(settings=",".join(settings), device="cpu", timeout_s=180))
    assert not _failures(run_dir, also=("unsupported",))
    cases = analyze(run_dir).cases.set_index("setting")
    strict = cases.loc[["cuda/reference", "cuda/ddp/default/ws2"]]
    assert (strict.verdict == "ok").all() and strict.calibrated.all(), strict
    assert cases.loc["cuda-tf32/reference", "calibrated"].all()  # judged by the TF32 envelope
    assert (cases.loc["rerun/cuda/reference", "verdict"] == "ok").all()  # cuBLAS with CUBLAS_WORKSPACE_CONFIG


def test_a_cuda_setting_in_a_cuda_sweep_says_it_has_no_cpu_run_to_compare_with(tmp_path: Path) -> None:
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.runner.sweep import SweepOptions, run_sweep
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    run_sweep(run_dir, SweepOptions(settings="cuda/reference", device="cuda", timeout_s=180))
    store = Store(run_dir)
    records = {r.setting: r for r in store.records()}
    store.close()
    assert records["cuda/reference"].status == "unsupported" and "--device cpu" in records["cuda/reference"].message


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm over NCCL needs a GPU per rank: 2 or more")
@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="the [zoo] extra is not installed")
def test_sync_batchnorm_makes_ddp_train_a_resnet_as_one_process_does(tmp_path: Path) -> None:
    """The fix the BatchNorm finding names, run where torch runs it: DDP with SyncBatchNorm over NCCL trains timm's
    ResNet as one process does (statistics of the global batch), while plain DDP keeps per-rank statistics."""
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.judging.analysis import analyze
    from difftest.runner.sweep import SweepOptions, run_sweep

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("timm-resnet",)))
    run_sweep(run_dir, SweepOptions(settings="reference,ddp/default/ws2,ddp/sync-batchnorm/ws2", device="cuda",
                                    backend="nccl", timeout_s=300))
    assert not _failures(run_dir, also=("unsupported",))
    cases = analyze(run_dir).cases.set_index("setting")
    assert cases.loc["ddp/sync-batchnorm/ws2", "verdict"] == "ok", cases["verdict"]
    assert cases.loc["ddp/default/ws2", "verdict"] == "inconsistent", cases["verdict"]
