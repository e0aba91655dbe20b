"""Which family of settings grows a warm rank: each family's cases replayed in one group, RSS after every pass.

    python benchmarks/memory_by_family.py RUN_DIR [--world-size 2] [--passes 3] [FAMILY_GLOB ...]

RUN_DIR holds generated models (`difftest generate --models 10`). For each glob (default: every family with
settings of that world size), one warm group runs every supported case of the family on every model, `--passes`
times over, and rank 0's RSS is read after each pass: the first pass warms up (imports, first-time allocations);
what later passes add is what the family's cases leave behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from difftest.contracts.registry import all_settings, load_plugins, select_settings
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import WorkerGroup
from difftest.storage.artifacts import load_spec


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("globs", nargs="*")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()

    plugins = load_plugins()
    ws = args.world_size
    globs = args.globs or sorted({f"{s.name.split('/')[0]}/*" for s in all_settings() if s.world_size == ws})
    models = [(d, load_spec(d)) for d in sorted((args.run_dir / "models").iterdir())]
    logs = args.run_dir / "logs"
    print(f"{'family':<20} {'cases/pass':>10}  rank 0 RSS after each pass (MiB)   growth per 100 cases after the first")
    for glob in globs:
        settings = [s for s in select_settings(glob, "full") if s.world_size == ws and not s.process_affinity]
        cases = [(d, s) for d, spec in models for s in settings if s.supports(spec) is None and s.available() is None]
        if not cases:
            continue
        group = WorkerGroup(ws, logs, plugins)
        after = []
        for _ in range(args.passes):
            for model_dir, setting in cases:
                if not group.run_case(CaseRequest(str(model_dir), setting.name, 1, 0.1, 0), 120).reusable:
                    group.kill()
                    group = WorkerGroup(ws, logs, plugins)
            after.append(_rss_mib(group.processes[0].pid))
        group.close()
        growth = (after[-1] - after[0]) * 100 / (len(cases) * (args.passes - 1)) if args.passes > 1 else 0.0
        print(f"{glob:<20} {len(cases):>10}  {after!s:<34} {growth:+.1f}")


if __name__ == "__main__":
    main()
