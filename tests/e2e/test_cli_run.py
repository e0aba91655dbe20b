"""The main job, end to end through the real CLI: generate → sweep a tier of the built-in settings → analyse.

The default tier (what `difftest run` runs, ~10 min) is in the fast test tier; the full tier (every setting) is `slow`.
Both check the same facts, on the settings the tier holds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from difftest.analysis import CSV_COLUMNS
from difftest.registry import load_plugins, tier, traits_of, with_references

CRASHING = {"quant/torchrec/bf16/out-fp32/unsharded", "quant/torchrec/bf16/out-fp16/unsharded"}


def _run(out: Path, *extra: str, timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "difftest.cli", "run", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _check_the_job(out: Path, tier_name: str, result: subprocess.CompletedProcess) -> pd.DataFrame:
    assert result.returncode == 0, result.stderr[-3000:]
    load_plugins()
    in_tier = {s.name for s in with_references(tier(tier_name))}  # with the calibration runs of its roots
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    assert set(cases.index) == in_tier
    # 2 DLRM + 2 Keras sequential models and one of each larger kind, × every setting of the tier
    kinds = pd.Series({d.name: d.name.split("-s0-")[0] for d in (out / "models").iterdir()})
    assert kinds.value_counts().to_dict() == {"dlrm": 2, "sequential": 2, "transformer": 1, "torchrec-dlrm": 1,
                                              "torchrec-deepfm": 1, "keras-dag": 1, "keras-transformer": 1}
    torchrec_models = int(kinds.map(lambda k: "torchrec" in traits_of(k)).sum())
    keras_models = int(kinds.map(lambda k: "keras" in traits_of(k)).sum())
    assert int(cases["cases"].sum()) == len(kinds) * len(in_tier)
    assert cases.loc["reference", "ok"] == len(kinds) and cases.loc["tf/reference", "ok"] == keras_models == 4
    assert cases["timeout"].sum() == 0
    # the only crashes: quantizing bf16 TorchRec tables dies in fbgemm (SIGFPE), on every model with TorchRec tables
    crashed = cases[cases["crash"] > 0]
    assert set(crashed.index) == CRASHING & in_tier and (crashed["crash"] == torchrec_models).all()
    rows = pd.read_csv(out / "inconsistencies.csv")
    assert list(rows.columns) == CSV_COLUMNS
    assert rows[rows.status == "crash"].message.str.contains("SIGFPE").all()
    # errors: converter limitations (onnx2torch lacks ReduceMean-18; ONNX Runtime rejects exact gelu's Erfc), TorchRec
    # failing to shard fp16 and int2 tables, torch's zero-bubble schedules on gloo (eval() of the V schedule,
    # non-contiguous gradient sends, the split backward), FSDP2 unable to reduce a DTensor gradient (finding 11)
    errors = rows[rows.status == "error"]
    converter = errors.setting.str.startswith(("convert/onnx2torch/", "convert/onnxruntime/"))
    assert errors[converter].message.str.contains("ConversionFailed|INVALID_GRAPH").all()
    known = (r"quant/torchrec/(fp16|int2)/out-fp(16|32)/\w+/sim-ws\d|pipeline/(interleaved-zero-bubble|zbv-zero-bubble)/"
             r"|fsdp2-tp/")
    assert errors[~converter].setting.str.match(known).all(), errors[~converter][["model", "setting", "message"]]
    assert errors[errors.setting.str.startswith("fsdp2-tp/")].message.str.contains("chunk_cat").all()
    # each failing case names the rank that failed first, not a peer cut loose by it
    assert not errors.message.str.contains("Connection closed by peer|Read error").any()
    # refusals are kind mismatches, engines refusing fp16 weights, TF-MOT missing, models without the layers a
    # parallelism needs (Linear pairs, positions, a vocabulary projection for loss parallel), each with its reason
    refused = rows[rows.status == "unsupported"]
    assert refused.message.str.contains("kind|refuses float16|tensorflow-model-optimization|layer units|Linear"
                                        "|positions|vocabulary").all(), refused.message.unique()
    assert set(rows.status) <= {"inconsistent", "error", "crash", "unsupported"}
    # DDP, the TF strategies, conversion and every quantized-vs-float setting agree with their references
    inconsistent = rows[rows.status == "inconsistent"]
    assert not inconsistent.setting.str.startswith((
        "ddp/", "tf/", "convert/", "quant/dynamic/", "quant/bf16", "quant/tf", "fsdp2/", "fsdp2-tp/", "tp/",
        "hybrid/", "accumulate/", "resume/", "repartition/", "async-pipeline/", "partial-reduce/", "calib-")).any()
    # finding 10: the interleaved zero-bubble schedule trains TorchRec's models wrongly; other pipelines agree
    pipelines = inconsistent[inconsistent.setting.str.startswith("pipeline/")]
    assert pipelines.setting.str.startswith("pipeline/interleaved-zero-bubble/").all()
    assert pipelines.kind.str.startswith("torchrec-").all()
    inconsistent = inconsistent.setting
    # legacy FSDP's finding: NO_SHARD + use_orig_params trains non-contiguous (converted) weights wrongly
    fsdp1 = rows[(rows.status == "inconsistent") & rows.setting.str.startswith("fsdp1/")]
    assert set(fsdp1.setting) == {f"fsdp1/no_shard/ws{w}" for w in (2, 3, 4)} & in_tier
    assert fsdp1.kind.map(lambda k: "keras" in traits_of(k)).all()
    assert not inconsistent.str.endswith("/unsharded").any()
    # oracle 1's finding: row-wise sharded quantized MEAN bags on 2+ ranks
    quantized = inconsistent[inconsistent.str.startswith("quant/")]
    assert not quantized.empty and quantized.str.contains("/row_wise/sim-ws[234]").all()
    # the two known TorchRec mean-pooling findings are reported; single-type settings other than grid are clean
    assert "torchrec/ebc/grid_shard/ws2" in set(rows.setting)
    clean = {f"torchrec/ebc/{t}/ws{w}" for t in ("table_wise", "row_wise", "column_wise", "table_row_wise",
                                                 "table_column_wise", "data_parallel") for w in (2, 3, 4)}
    assert not clean & set(rows[rows.d3_status == "inconsistent"].setting)
    # TorchRec finding 7 (row-wise output scaled by 1 - 2**-20): D3 passes it, the calibrated oracle does not
    calibrated_only = rows[(rows.status == "inconsistent") & (rows.d3_status == "ok")]
    assert set(calibrated_only.setting) & clean <= {f"torchrec/ebc/{t}/ws{w}" for t in ("row_wise", "table_row_wise")
                                                    for w in (2, 3, 4)}
    assert "torchrec/ebc/row_wise/ws2" in set(calibrated_only.setting)
    # the seeds' oracles: resume (bitwise in one process), re-partitioning, PipeDream, partial reduce all hold
    oracles = cases[cases.index.str.match(r"(resume|tf-resume|repartition|async-pipeline|partial-reduce)/")]
    assert len(oracles) >= 20 and (oracles["ok"] + oracles["unsupported"] == oracles["cases"]).all(), oracles
    unsupported = oracles[oracles["unsupported"] > 0]
    assert set(unsupported.index) == {"tf-resume/uninterrupted", "tf-resume/k3"}  # the PyTorch-only models
    assert (unsupported["unsupported"] == len(kinds) - keras_models).all()
    comparisons = pd.read_csv(out / "comparisons.csv")
    assert (comparisons.status == "ok").sum() > 1000
    # triage: every case that is not ok belongs to exactly one finding, far fewer findings than cases
    findings = pd.read_csv(out / "findings.csv")
    not_ok = int(cases[["inconsistent", "nondeterministic", "error", "crash", "timeout"]].sum().sum())
    assert findings["cases"].sum() == not_ok and len(findings) < not_ok
    assert all((out / "findings" / fid / "repro.py").is_file() for fid in findings["id"])
    assert "distinct findings" in result.stdout
    # each finding's example was shrunk (or it says why not) and the smaller case is what its repro.py runs
    import json

    for fid in findings["id"]:
        saved = json.loads((out / "findings" / fid / "minimize.json").read_text())
        before, after = saved["original"]["size"], saved["minimal"]["size"]
        assert saved["outcome"] and all(after[k] <= before[k] for k in before), saved
        assert f"{saved['minimal']['model']!r}" in (out / "findings" / fid / "repro.py").read_text()
    shrunk = [fid for fid in findings["id"] if "-min" in (out / "findings" / fid / "repro.py").read_text()]
    assert len(shrunk) >= len(findings) // 2
    assert (out / "report.html").stat().st_size > 1_000_000  # plotly's JavaScript is in the page
    return rows


@pytest.mark.timeout(2100)
def test_difftest_run_on_the_default_models_runs_the_default_tier_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = _check_the_job(out, "default", _run(out, timeout=1500))
    # every family of settings ran on the default models
    load_plugins()
    families = {s.family for s in with_references(tier("full"))}
    assert families == {s.family for s in tier("default")}

    # a rerun of the same command resumes: nothing left to run, same verdicts
    again = _run(out, timeout=600)
    assert again.returncode == 0 and not re.search(r"\b0 already done", again.stderr)
    assert "ran 0" in again.stderr.replace("\n", " ")
    assert pd.read_csv(out / "inconsistencies.csv").equals(rows)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_difftest_run_full_tier_on_the_default_models(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _check_the_job(out, "full", _run(out, "--tier", "full", timeout=2400))
