"""Cases per minute: the warm engine vs a fresh-processes-per-case launcher (what D3 does), and the engine's overhead.

    python benchmarks/sweep_overhead.py [--cases 60] [--world-size 2] [--settings GLOBS]

Both run the same (model, setting) cases — by default every ws2 setting of the torchrec, DDP, FSDP1/2, TP and
pipeline families on 2 DLRM and 2 Keras models (failing and refused cases included, as a sweep has them) — with the
same worker code, gloo group and outputs. The per-case launcher pays process start-up, `import torch/torchrec` and
process-group set-up for every case. The compute floor of a case is the time its slowest rank spends inside the
setting's code, measured in the live group; what the engine adds per case is the warm wall time above it.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path

from difftest.contracts.registry import generator_kinds, get_generator, load_plugins, select_settings
from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import CaseResult, WorkerGroup
from difftest.storage.artifacts import load_spec

FAMILIES = "torchrec/ebc/*/ws{w},ddp/*/ws{w},fsdp1/*/ws{w},fsdp2/*/ws{w},tp/*/ws{w},pipeline/*/ws{w}/*"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--settings", default=None, help=f"globs (default: {FAMILIES.format(w='<ws>')})")
    args = parser.parse_args()

    plugins = load_plugins()
    run_dir = Path(tempfile.mkdtemp(prefix="difftest-bench-")) / "run"
    kinds = tuple(k for k in generator_kinds() if getattr(get_generator(k), "available", lambda: None)() is None)
    generate(run_dir, RunConfig(seed=0, models=2, kinds=kinds))
    models = [d for d in sorted((run_dir / "models").iterdir())]
    settings = select_settings(args.settings or FAMILIES.format(w=args.world_size))
    runnable = [(str(d), s.name) for d in models for s in settings
                if s.world_size == args.world_size and s.supports(load_spec(d)) is None and s.available() is None]
    # interleave families, and draw each family's cases in a seeded order, so a short run still spans its variants
    by_family = itertools.groupby(sorted(runnable, key=lambda c: c[1].split("/")[0]), key=lambda c: c[1].split("/")[0])
    queues = [list(group) for _, group in by_family]
    for queue in queues:
        random.Random(0).shuffle(queue)
    mixed = [c for round_ in itertools.zip_longest(*queues) for c in round_ if c is not None]
    requests = [CaseRequest(m, s, steps=1, lr=0.1, seed=0) for m, s in mixed[: args.cases]]

    started = time.perf_counter()
    group = WorkerGroup(args.world_size, run_dir / "logs", plugins)
    startup = time.perf_counter() - started
    warm_results: list[CaseResult] = []
    replaced = 0
    for request in requests:
        result = group.run_case(request, 300)
        warm_results.append(result)
        if not result.reusable:
            replaced += 1
            group.kill()
            group = WorkerGroup(args.world_size, run_dir / "logs", plugins)
    group.close()
    warm = time.perf_counter() - started

    started = time.perf_counter()
    cold_results = []
    for request in requests:
        fresh = WorkerGroup(args.world_size, run_dir / "logs", plugins)
        cold_results.append(fresh.run_case(request, 300))
        fresh.close()
    cold = time.perf_counter() - started

    n = len(requests)
    statuses = [r.status for r in warm_results]
    assert statuses == [r.status for r in cold_results], "the warm engine and the fresh launcher disagree"
    families = sorted({r.setting.split("/")[0] for r in requests})
    compute = [r.compute_s for r in warm_results]
    overhead = [r.wall_s - r.compute_s for r in warm_results]
    per_case = (warm - startup) / n
    print(f"{n} cases, world size {args.world_size}, families {', '.join(families)}; "
          + ", ".join(f"{s} {statuses.count(s)}" for s in sorted(set(statuses))) + f"; groups replaced: {replaced}")
    print(f"warm engine:        {warm:7.1f} s  ({60 * n / warm:6.1f} cases/min; group start-up {startup:.1f} s once)")
    print(f"process per case:   {cold:7.1f} s  ({60 * n / cold:6.1f} cases/min)")
    print(f"speed-up: {cold / warm:.1f}x overall; {cold / max(warm - startup, 1e-9):.1f}x per case once the group is up")
    print(f"per case, warm: {per_case * 1000:.0f} ms of which compute floor {statistics.mean(compute) * 1000:.0f} ms "
          f"(median {statistics.median(compute) * 1000:.0f} ms); engine overhead in the case's round trip "
          f"{statistics.mean(overhead) * 1000:.1f} ms (median {statistics.median(overhead) * 1000:.1f} ms), "
          f"between cases (commit-free loop, world re-opened) {(per_case - statistics.mean(r.wall_s for r in warm_results)) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
