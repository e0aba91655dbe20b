"""How close clean settings come to the calibrated oracle's envelope: the measurement behind `difftest.judging.envelope.K`.

    .venv/bin/python benchmarks/oracle_noise.py RUN_DIR [RUN_DIR ...]

For every case the calibrated oracle judged, its raw ratio is max_i |x_i - c_i| / (max_j e_j + u |c_i|) — the ratio
before K, i.e. how many envelopes away from the float64 result the setting landed. Prints the distribution per family
over the cases, the cases beyond K (what the oracle flags), and for those also flagged or not by D3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from difftest.judging.analysis import analyze
from difftest.judging.envelope import K


def raw_ratios(run_dir: Path) -> pd.DataFrame:
    analysis = analyze(run_dir)
    rows = analysis.comparisons[analysis.comparisons["calibrated_ratio"].notna()]
    per_case = rows.groupby(["model", "setting"]).agg(raw=("calibrated_ratio", lambda r: r.max() * K),
                                                     tensor=("tensor", lambda t: t.iloc[0]))
    worst = rows.loc[rows.groupby(["model", "setting"])["calibrated_ratio"].idxmax(), ["model", "setting", "phase", "tensor"]]
    per_case = per_case.drop(columns="tensor").reset_index().merge(worst, on=["model", "setting"])
    cases = analysis.cases.set_index(["model", "setting"])
    per_case["d3_verdict"] = [cases.loc[(m, s), "d3_verdict"] for m, s in zip(per_case["model"], per_case["setting"])]
    per_case["family"] = per_case["setting"].str.split("/").str[0]
    per_case["run"] = run_dir.name
    return per_case


def main(run_dirs: list[Path]) -> None:
    table = pd.concat([raw_ratios(d) for d in run_dirs], ignore_index=True)
    pd.set_option("display.width", 200)
    print(f"{len(table)} cases judged by the calibrated oracle (K = {K:g}) in {len(run_dirs)} run(s), "
          f"{table['model'].nunique()} models")
    summary = table.groupby("family")["raw"].describe(percentiles=[0.5, 0.99])[["count", "50%", "99%", "max"]]
    print(summary.round(3).to_string())
    flagged = table[table["raw"] > K].sort_values("raw", ascending=False)
    clean = table[table["raw"] <= K]
    print(f"\nbeyond the envelope (raw ratio > K): {len(flagged)} cases; of them D3 also flags "
          f"{int((flagged['d3_verdict'] != 'ok').sum())}")
    print(flagged[["run", "model", "setting", "phase", "tensor", "raw", "d3_verdict"]].to_string(index=False))
    print(f"\nwithin it: {len(clean)} cases, largest raw ratio {clean['raw'].max():.3g} "
          f"({clean.loc[clean['raw'].idxmax(), 'setting']}), 99th percentile {clean['raw'].quantile(0.99):.3g}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: benchmarks/oracle_noise.py RUN_DIR [RUN_DIR ...]")
    main([Path(a) for a in sys.argv[1:]])
