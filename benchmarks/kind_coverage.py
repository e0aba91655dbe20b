"""Per model kind and setting family: how many cases ran, finished (outputs stored, before any verdict), failed
(error, crash, timeout) or were `unsupported` (and why), from finished runs.

    python -m benchmarks.kind_coverage RUN [RUN ...]

For the kinds of issue 17 it also states the coverage goals: tensor and sequence parallel run on every transformer
model (every transformer has a model on which some tp/colwise and some tp/sequence-parallel case ran), pipelines run
on at least 90 % of DAG models.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pandas as pd


def cases_of(run: Path) -> pd.DataFrame:
    with sqlite3.connect(run / "store.sqlite") as db:
        cases = pd.read_sql("select model, setting, status, message, wall_s from cases", db)
    cases["kind"] = cases.model.str.replace(r"-s\d+-i\d+.*$", "", regex=True)
    cases["family"] = cases.setting.str.split("/").str[0]
    return cases


def main(runs: list[str]) -> None:
    cases = pd.concat([cases_of(Path(r)) for r in runs], ignore_index=True)
    for kind, mine in cases.groupby("kind"):
        models = mine.model.nunique()
        print(f"\n## {kind}: {models} models, {len(mine)} cases, {mine.wall_s.sum():.0f} s of case time")
        table = mine.assign(ran=mine.status != "unsupported").groupby("family").agg(
            cases=("status", "size"), ran=("ran", "sum"), finished=("status", lambda s: (s == "ok").sum()),
            error=("status", lambda s: s.isin(["error", "crash", "timeout"]).sum()))
        table["unsupported"] = table["cases"] - table["ran"]
        print(table.to_string())
        refused = mine[mine.status == "unsupported"].message.str.slice(0, 110).value_counts().head(6)
        if len(refused):
            print("most frequent reasons for unsupported:")
            for reason, count in refused.items():
                print(f"  {count:4d}  {reason}")

        def ran_on(pattern: str) -> int:
            hit = mine[mine.setting.str.match(pattern) & (mine.status != "unsupported")]
            return hit.model.nunique()

        if "transformer" in kind:
            print(f"goal: tensor parallel ran on {ran_on(r'tp/')}/{models} models, sequence parallel on "
                  f"{ran_on(r'tp/sequence-parallel/')}/{models}, loss parallel on {ran_on(r'tp/.*loss-parallel')}"
                  f"/{models}, FSDP2 x TP on {ran_on(r'fsdp2-tp/')}/{models}")
        if kind == "keras-dag":
            print(f"goal: pipelines ran on {ran_on(r'pipeline/')}/{models} models (>= 90 %)")


if __name__ == "__main__":
    main(sys.argv[1:])
