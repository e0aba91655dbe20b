"""Resident memory of the driver and of every worker rank over a sweep: does anything grow with the cases run?

    python benchmarks/memory.py [--models 10] [--tier default] [--settings GLOBS] [--out DIR]

Generates `--models` models of each available kind, sweeps them, and samples the RSS of the driver and of each of
its descendant processes (warm ranks, fork servers, phase processes) once a second from /proc. For every process
that lives at least `--min-life` seconds (the driver, each worker group's ranks, fork servers) it prints the RSS once warm (a quarter into its life), at its end,
and the largest; a leak shows as growth from the first to the second.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from difftest.contracts.registry import generator_kinds, get_generator, load_plugins
from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate
from difftest.reporting.progress import status_counts
from difftest.runner.sweep import SweepOptions, run_sweep


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _label(pid: int, cmdline: str) -> str:
    """A rank says which it is through the log its stdout goes to (`ws2-<stamp>-rank0.log`)."""
    try:
        stdout = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return cmdline
    if stdout.endswith(".log"):
        return Path(stdout).name[: -len(".log")]
    return "fork server" if "forkserver" in cmdline else cmdline


def _descendants(root: int) -> dict[int, str]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
            except OSError:
                continue
            found[child] = cmdline
            stack.append(child)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10, help="models per kind")
    parser.add_argument("--tier", default="default")
    parser.add_argument("--settings", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--min-life", type=float, default=60.0, help="report processes that lived this long (s)")
    args = parser.parse_args()

    load_plugins()
    run_dir = args.out or Path(tempfile.mkdtemp(prefix="difftest-memory-")) / "run"
    kinds = tuple(k for k in generator_kinds() if getattr(get_generator(k), "available", lambda: None)() is None)
    if not (run_dir / "run.json").exists():
        generate(run_dir, RunConfig(seed=0, models=args.models, kinds=kinds))
    samples: dict[int, list[tuple[float, float]]] = defaultdict(list)
    names: dict[int, str] = {}
    done = threading.Event()
    me = os.getpid()

    def sample() -> None:
        while not done.is_set():
            now = time.perf_counter()
            for pid, cmdline in {me: "driver", **_descendants(me)}.items():
                rss = _rss_mib(pid)
                if rss is not None:
                    samples[pid].append((now, rss))
                    if pid not in names or names[pid] == cmdline:
                        names[pid] = _label(pid, cmdline) if pid != me else "driver"
            done.wait(1.0)

    cases = [0]
    sampler = threading.Thread(target=sample, daemon=True)
    started = time.perf_counter()
    sampler.start()
    report = run_sweep(run_dir, SweepOptions(settings=args.settings, tier=args.tier, timeout_s=120),
                       on_result=lambda case, record: cases.__setitem__(0, cases[0] + 1))
    done.set()
    sampler.join()
    total = time.perf_counter() - started
    print(f"{len(kinds) * args.models} models, {report.total} cases ({status_counts(report.statuses)}), "
          f"{report.groups_started} worker groups, {total:.0f} s")
    print(f"{'process':<40} {'lived s':>8} {'RSS at 25%':>10} {'50%':>6} {'75%':>6} {'end':>6} {'max':>6} "
          f"{'25%→end':>8}  (MiB)")
    for pid, series in sorted(samples.items(), key=lambda item: item[1][0][0]):
        lived = series[-1][0] - series[0][0]
        if lived < args.min_life:
            continue
        at = [series[min(len(series) - 1, len(series) * q // 4)][1] for q in (1, 2, 3)]
        end, peak = series[-1][1], max(r for _, r in series)
        print(f"{names[pid][:32] + f' {pid}':<40} {lived:8.0f} {at[0]:10.0f} {at[1]:6.0f} {at[2]:6.0f} {end:6.0f} "
              f"{peak:6.0f} {end - at[0]:+8.0f}")


if __name__ == "__main__":
    main()
