"""`python -m benchmarks.faults`: does each oracle catch a fault planted in the libraries, large and small?

For every fault class of `benchmarks.faults.inject` and every magnitude (default 10 % and 0.1 %), the settings whose
path goes through the patched library code are run again with the fault planted, on the default models; their
references and calibration runs come from one clean sweep (the faults do not touch them). A class is caught by an
oracle at a magnitude when a case that oracle judged ok in the clean sweep is not ok with the fault. Prints the
detection table and writes it to <out>/detection.csv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import pandas as pd

from benchmarks.faults.inject import BY_NAME, ENV
from difftest.contracts.registry import generator_kinds, load_plugins, select_settings
from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate
from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store

PLUGIN = "benchmarks.faults.inject"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/faults"))
    parser.add_argument("--classes", default=",".join(BY_NAME), help="comma-separated fault classes")
    parser.add_argument("--magnitudes", default="0.1,0.001", help="relative sizes of the fault")
    parser.add_argument("--models", type=int, default=2, help="models per kind")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    classes = [BY_NAME[name] for name in args.classes.split(",")]
    magnitudes = [float(m) for m in args.magnitudes.split(",")]
    os.environ.pop(ENV, None)
    load_plugins((PLUGIN,))
    kinds = tuple(k for k in ("dlrm", "sequential") if k in generator_kinds())
    targets = ",".join(sorted({glob for c in classes for glob in c.settings.split(",")}))

    clean = args.out / "clean"
    started = time.perf_counter()
    generate(clean, RunConfig(models=args.models, kinds=kinds, plugins=(PLUGIN,)))
    run_sweep(clean, SweepOptions(settings=targets, jobs=args.jobs, plugins=(PLUGIN,)))
    baseline = analyze(clean, plugins=(PLUGIN,)).cases
    print(f"clean sweep: {len(baseline)} cases in {time.perf_counter() - started:.0f}s", flush=True)

    rows = []
    for fault in classes:
        settings = [s.name for s in select_settings(fault.settings, "full")]
        cases = baseline[baseline["setting"].isin(settings)]
        for magnitude in magnitudes:
            run_dir = args.out / f"{fault.name}-{magnitude:g}"
            started = time.perf_counter()
            if not (run_dir / "done").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                shutil.copytree(clean, run_dir, ignore=shutil.ignore_patterns("findings", "*.html", "*.csv"))
                store = Store(run_dir)
                store.forget(list(zip(cases["model"], cases["setting"])))
                store.close()
                os.environ[ENV] = f"{fault.name}:{magnitude}"
                try:
                    run_sweep(run_dir, SweepOptions(settings=fault.settings, jobs=args.jobs, plugins=(PLUGIN,)))
                finally:
                    os.environ.pop(ENV)
                (run_dir / "done").touch()
            faulty = analyze(run_dir, plugins=(PLUGIN,)).cases.set_index(["model", "setting"])
            row = {"class": fault.name, "library": fault.library, "magnitude": magnitude}
            for oracle, column in (("d3", "d3_verdict"), ("calibrated", "verdict")):
                judged = cases[cases[column] == "ok"]  # what this oracle passed without the fault
                after = faulty.loc[list(zip(judged["model"], judged["setting"])), column] if len(judged) else []
                caught = int((pd.Series(after) != "ok").sum())
                row[f"{oracle}_caught"] = caught
                row[f"{oracle}_of"] = len(judged)
            row["wall_s"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(f"{fault.name:24s} {magnitude:<7g} d3 {row['d3_caught']}/{row['d3_of']}  "
                  f"calibrated {row['calibrated_caught']}/{row['calibrated_of']}  ({row['wall_s']}s)", flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "detection.csv", index=False)
    for oracle in ("d3", "calibrated"):
        for magnitude in magnitudes:
            part = table[table["magnitude"] == magnitude]
            print(f"{oracle:10s} at {magnitude:g}: catches {int((part[f'{oracle}_caught'] > 0).sum())} of {len(part)} classes")


if __name__ == "__main__":
    main()
