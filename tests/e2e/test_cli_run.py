"""The main job, end to end through the real CLI: generate → sweep every built-in setting → analyse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from difftest.analysis import CSV_COLUMNS
from difftest.registry import all_settings, load_plugins


def test_difftest_run_on_the_default_models(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "difftest.cli", "run", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    load_plugins()
    assert int(cases["cases"].sum()) == 4 * len(all_settings())  # 2 DLRM + 2 Keras models × every setting
    assert cases.loc["reference", "ok"] == 4 and cases.loc["tf/reference", "ok"] == 2
    assert int(cases[["crash", "timeout"]].to_numpy().sum()) == 0
    rows = pd.read_csv(out / "inconsistencies.csv")
    assert list(rows.columns) == CSV_COLUMNS
    # errors are converter limitations only (onnx2torch lacks ReduceMean-18 for the first model's LayerNorm)
    errors = rows[rows.status == "error"]
    assert set(errors.setting) <= {"convert/onnx2torch/eval", "convert/onnx2torch/train"}
    assert errors.message.str.startswith("ConversionFailed").all()
    # refusals are kind mismatches, each with its reason
    refused = rows[rows.status == "unsupported"]
    assert len(refused) == 2 * (cases.index.str.startswith(("tf/", "convert/")).sum() + cases.index.str.startswith("torchrec/").sum())
    assert refused.message.str.contains("kind").all()
    assert set(rows.status) <= {"inconsistent", "error", "unsupported"}
    # DDP, the TF strategies and conversion agree with their references on the default models
    assert not rows[rows.status == "inconsistent"].setting.str.startswith(("ddp/", "tf/", "convert/")).any()
    # the two known TorchRec mean-pooling findings are reported; single-type settings other than grid are clean
    assert "torchrec/ebc/grid_shard/ws2" in set(rows.setting)
    clean = {f"torchrec/ebc/{t}/ws{w}" for t in ("table_wise", "row_wise", "column_wise", "table_row_wise",
                                                 "table_column_wise", "data_parallel") for w in (2, 3, 4)}
    assert not clean & set(rows[rows.status == "inconsistent"].setting)
    comparisons = pd.read_csv(out / "comparisons.csv")
    assert (comparisons.status == "ok").sum() > 1000

    # a rerun of the same command resumes: nothing left to run, same verdicts
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 already done" not in again.stderr
    assert "ran 0" in again.stderr.replace("\n", " ")
    assert pd.read_csv(out / "inconsistencies.csv").equals(rows)
