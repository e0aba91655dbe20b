"""What starting a worker group costs: ranks spawned (each imports torch, TorchRec and the plugins) against ranks
forked from the import server (`difftest.runner.pool.rank_start`, what CPU sweeps use).

    python -m benchmarks.group_start [--world-size 2] [--groups 4]

Each method starts `--groups` groups one after the other, each joined in its process group and ready for a case, and
closes it; per start, the wall time and the CPU time the whole machine spent (every process, from /proc/stat). The
fork server's first start includes the server's own imports.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _machine_cpu_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def main() -> None:
    import multiprocessing

    from difftest.contracts.registry import load_plugins
    from difftest.runner import pool

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    args = parser.parse_args()
    plugins = load_plugins()
    forked = pool.rank_start("cpu", gpu_in_ranks=False)
    print("| method | start | wall s | CPU s (machine) |\n|---|---|---|---|")
    for method, context in (("spawn", multiprocessing.get_context("spawn")), ("fork server", forked)):
        for number in range(1, args.groups + 1):
            pool_start, pool.rank_start = pool.rank_start, lambda *_, c=context: c
            cpu, wall = _machine_cpu_s(), time.perf_counter()
            try:
                with tempfile.TemporaryDirectory() as logs:
                    group = pool.WorkerGroup(args.world_size, Path(logs), plugins)
                    wall, cpu = time.perf_counter() - wall, _machine_cpu_s() - cpu
                    group.close()
            finally:
                pool.rank_start = pool_start
            print(f"| {method} | {number} | {wall:.2f} | {cpu:.1f} |", flush=True)


if __name__ == "__main__":
    main()
