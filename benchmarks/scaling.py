"""How the local executor scales with --jobs on this machine: cases per minute at 1, 2, … N worker groups.

    python -m benchmarks.scaling [--kind transformer] [--models 8] [--settings GLOBS] [--jobs 1,2,4,8] [--spawned]

One run folder is generated once; each --jobs value sweeps a fresh copy of it (same models, same cases) and the
table gives, per value: wall time, cases per minute, speed-up and efficiency against --jobs 1 times the jobs, the
groups started, where the wall time went — the cases' own compute (the sum of every case's time in its worker)
against the wall time times the groups, the rest being start-up, rendezvous and idle groups waiting for work —, the
sweep process's own CPU per case (queueing, storing and judging results: work no added group shares), and when
results came (the first, half, nine tenths and the last: before the first is the groups' start, after nine tenths the
stragglers).
`--spawned` starts every rank as a fresh process that imports torch and the plugins itself, as GPU machines started
CPU ranks before 2026-11-26: the rows then show what the import server saves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import shutil
import tempfile
import time
from pathlib import Path

# one- and two-rank settings of the PyTorch families every model kind has
DEFAULT_SETTINGS = "reference,accumulate/mb2,ddp/default/ws2,ddp/no-sync/ws2,fsdp2/per-layer/reshard/fp32/ws2,rerun/reference"


def main() -> None:
    from difftest.contracts.registry import load_plugins
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.reporting.progress import status_counts
    from difftest.runner import pool
    from difftest.runner.scheduler import machine_ranks, ranks_at_once
    from difftest.runner.sweep import SweepOptions, run_sweep
    from difftest.storage.store import Store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="transformer")
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--jobs", default="", help="comma-separated; default 1, 2, 4, … up to the machine's cores")
    parser.add_argument("--spawned", action="store_true", help="every rank a fresh process paying its own imports")
    args = parser.parse_args()
    ranks = machine_ranks()
    # ascending: the first row is the unit of the speed-up and efficiency columns
    jobs = sorted({int(j) for j in args.jobs.split(",")}) if args.jobs else [1 << i for i in range(ranks.bit_length())]
    load_plugins()
    work = Path(tempfile.mkdtemp(prefix="difftest-scaling-"))
    try:
        generated = work / "generated"
        generate(generated, RunConfig(seed=0, models=args.models, kinds=(args.kind,)))
        print(f"{args.models} {args.kind} models, settings {args.settings}; this machine has {ranks} cores and runs "
              f"{ranks_at_once()} ranks at once")
        # the ranks' import server starts once per sweep process: outside the rows, or the first would pay it alone
        # (it made --jobs 1 look 3.6 times slower than --jobs 2 on 2 cores, where 2 groups can only double the speed)
        if args.spawned:
            spawn = multiprocessing.get_context("spawn")
            pool.rank_start = lambda *_: spawn
            print("ranks are spawned (--spawned): each pays its imports, in every row alike")
        else:
            started, start = time.perf_counter(), pool.rank_start("cpu", gpu_in_ranks=False)
            warm = start.Process(target=time.sleep, args=(0,))
            warm.start()
            warm.join()
            print(f"the ranks' import server ready in {time.perf_counter() - started:.1f} s, before the rows")
        print(f"{'jobs':>4} {'cases':>6} {'wall s':>7} {'cases/min':>9} {'speed-up':>8} {'efficiency':>10} "
              f"{'groups':>6} {'compute/(wall×jobs)':>19} {'sweep CPU ms/case':>17} {'results at s: first/50%/90%/last':>33}"
              f"  statuses", flush=True)
        first_per_min = None
        for j in jobs:
            run = work / f"jobs{j}"
            shutil.copytree(generated, run)
            started, own_cpu = time.perf_counter(), _own_cpu_s()
            arrivals: list[float] = []
            report = run_sweep(run, SweepOptions(settings=args.settings, jobs=j),
                               on_result=lambda case, record: arrivals.append(time.perf_counter() - started))
            wall, own_cpu = time.perf_counter() - started, _own_cpu_s() - own_cpu
            store = Store(run)
            try:
                compute = sum(r.wall_s or 0.0 for r in store.records())
            finally:
                store.close()
            cases = sum(report.statuses.values())
            per_min = 60 * cases / wall
            first_per_min = first_per_min or per_min / j  # the first row's rate per job is the ideal's unit
            print(f"{j:>4} {cases:>6} {wall:>7.1f} {per_min:>9.1f} {per_min / (first_per_min * jobs[0]):>8.2f} "
                  f"{per_min / (first_per_min * j):>10.2f} {report.groups_started:>6} {compute / (wall * j):>19.2f}"
                  f" {1000 * own_cpu / cases:>17.1f} {_timeline(arrivals):>33}  {status_counts(report.statuses)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _timeline(arrivals: list[float]) -> str:
    """When the first result, half, nine tenths and the last came, in seconds from the sweep's start."""
    if not arrivals:
        return "-"
    ordered = sorted(arrivals)
    return "/".join(f"{ordered[round(q * (len(ordered) - 1))]:.1f}" for q in (0, 0.5, 0.9, 1))


def _own_cpu_s() -> float:
    """CPU seconds of this process, the sweep's, all its threads: what it spends per case (queueing, storing and
    judging results) is work no added group shares, and bounds the rate however many groups run."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
