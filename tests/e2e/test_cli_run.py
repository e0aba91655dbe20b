"""The main job, end to end through the real CLI: generate → sweep every built-in setting → analyse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from difftest.analysis import CSV_COLUMNS


def test_difftest_run_on_the_default_models(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "difftest.cli", "run", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    assert cases.loc["reference", "ok"] == 2
    assert int(cases["cases"].sum()) == 2 * 31
    # every built-in setting ran: nothing errored, crashed, timed out or was refused on this machine
    assert int(cases[["error", "crash", "timeout", "unsupported"]].to_numpy().sum()) == 0
    rows = pd.read_csv(out / "inconsistencies.csv")
    assert list(rows.columns) == CSV_COLUMNS
    assert set(rows.status) <= {"inconsistent"}
    # the two known TorchRec mean-pooling findings are reported; single-type settings other than grid are clean
    assert "torchrec/ebc/grid_shard/ws2" in set(rows.setting)
    clean = {f"torchrec/ebc/{t}/ws{w}" for t in ("table_wise", "row_wise", "column_wise", "table_row_wise",
                                                 "table_column_wise", "data_parallel") for w in (2, 3, 4)}
    assert not clean & set(rows.setting)
    comparisons = pd.read_csv(out / "comparisons.csv")
    assert (comparisons.status == "ok").sum() > 1000

    # a rerun of the same command resumes: nothing left to run, same verdicts
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 already done" not in again.stderr
    assert "ran 0" in again.stderr.replace("\n", " ")
    assert pd.read_csv(out / "inconsistencies.csv").equals(rows)
