"""Cases per minute: the warm engine vs a fresh-processes-per-case launcher (what D3 does).

    python benchmarks/sweep_overhead.py [--cases 12] [--world-size 2]

Both run the same (model, setting) cases: same worker code, same gloo group, same outputs. The per-case
launcher pays process start-up, `import torch/torchrec` and process-group set-up for every case.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from difftest.generate import generate
from difftest.registry import load_plugins, select_settings
from difftest.runner.pool import CaseRequest, WorkerGroup
from difftest.spec import RunConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    plugins = load_plugins()
    run_dir = Path(tempfile.mkdtemp(prefix="difftest-bench-")) / "run"
    generate(run_dir, RunConfig(seed=0, models=2))
    model_dirs = sorted(str(d) for d in (run_dir / "models").iterdir())
    settings = [s.name for s in select_settings(f"torchrec/ebc/*/ws{args.world_size}")]
    cases = list(itertools.islice(itertools.cycle(itertools.product(model_dirs, settings)), args.cases))
    requests = [CaseRequest(m, s, steps=1, lr=0.1, seed=0) for m, s in cases]

    started = time.perf_counter()
    group = WorkerGroup(args.world_size, run_dir / "logs", plugins)
    startup = time.perf_counter() - started
    for request in requests:
        assert group.run_case(request, 300).status == "ok"
    group.close()
    warm = time.perf_counter() - started

    started = time.perf_counter()
    for request in requests:
        fresh = WorkerGroup(args.world_size, run_dir / "logs", plugins)
        assert fresh.run_case(request, 300).status == "ok"
        fresh.close()
    cold = time.perf_counter() - started

    n = len(requests)
    print(f"{n} cases, world size {args.world_size}, settings torchrec/ebc/*/ws{args.world_size}")
    print(f"warm engine:        {warm:7.1f} s  ({60 * n / warm:6.1f} cases/min; group start-up {startup:.1f} s once)")
    print(f"process per case:   {cold:7.1f} s  ({60 * n / cold:6.1f} cases/min)")
    print(f"speed-up: {cold / warm:.1f}x overall; {cold / max(warm - startup, 1e-9):.1f}x per case once the group is up")


if __name__ == "__main__":
    main()
