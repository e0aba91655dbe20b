"""Cases per minute: the local executor vs the Ray executor on a cluster of two worker nodes simulated on this machine.

    python -m benchmarks.ray_overhead [--models 2] [--settings GLOBS] [--slots 1,4] [--repeat 3]

The same sweep (by default every DDP, row-wise TorchRec and FSDP2 setting at two and four ranks on two DLRM models,
with their references and calibration runs) runs once on the local executor (`--jobs 1`) and then on the Ray
executor against a `ray.cluster_utils.Cluster` (a head without CPUs, two nodes of four logical CPUs), once per
number of gang slots, each `--repeat` times (medians compared: on two cores one sweep's wall time varies by tens of
per cent). Both share the machine's cores, so one slot against one local group measures what Ray adds, not what more
machines would gain. The results must be byte-equal (`difftest.storage.store.results_digest`).

Then Ray's own per-case costs, apart from any setting: placing a gang (a placement group of two bundles,
STRICT_PACK, and an actor in it) and one actor call that returns a real case's outputs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate
from difftest.runner.executor import ExecutorConfig
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store, results_digest

SETTINGS = "ddp/*/ws2,torchrec/ebc/row_wise/ws2,fsdp2/*/ws4"


def _sweep(source: Path, target: Path, options: SweepOptions) -> tuple[float, int, str]:
    shutil.copytree(source, target)
    started = time.perf_counter()
    report = run_sweep(target, options)
    wall = time.perf_counter() - started
    store = Store(target)
    inside = sum(r.wall_s or 0.0 for r in store.records())
    store.close()
    note = f"{report.executor_note}; " if report.executor_note else ""
    return wall, sum(report.statuses.values()), f"{note}{inside:.1f} s inside the worker groups"


def _scheduling_costs(ray, outputs: dict, calls: int = 30, placements: int = 5) -> tuple[list[float], list[float]]:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Echo:  # defined here, so Ray ships it by value to nodes that cannot import this benchmark
        def outputs(self, payload_ref: list) -> dict:
            return ray.get(payload_ref[0])

        def ready(self) -> bool:
            return True

    echo = ray.remote(Echo)
    placed = []
    for _ in range(placements):
        started = time.perf_counter()
        pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="STRICT_PACK")
        ray.get(pg.ready())
        actor = echo.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
        ray.get(actor.ready.remote())
        placed.append(time.perf_counter() - started)
        ray.kill(actor)
        remove_placement_group(pg)
    pg = placement_group([{"CPU": 1.0}], strategy="STRICT_PACK")
    ray.get(pg.ready())
    actor = echo.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    payload = [ray.put(outputs)]  # the outputs live in the driver's store, as a case's come back from its gang
    ray.get(actor.outputs.remote(payload))
    roundtrips = []
    for _ in range(calls):
        started = time.perf_counter()
        ray.get(actor.outputs.remote(payload))
        roundtrips.append(time.perf_counter() - started)
    ray.kill(actor)
    remove_placement_group(pg)
    return placed, roundtrips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--settings", default=SETTINGS)
    parser.add_argument("--slots", default="1,4", help="gang slots of each Ray sweep (--jobs), comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="sweeps per configuration; medians are compared")
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="difftest-ray-bench-"))
    generated = work / "generated"
    generate(generated, RunConfig(seed=0, models=args.models))

    local_walls = []
    for attempt in range(args.repeat):
        target = work / f"local-{attempt}"
        local_s, cases, inside = _sweep(generated, target, SweepOptions(settings=args.settings, jobs=1))
        local_walls.append(local_s)
        print(f"local executor, 1 group at a time: {cases} cases in {local_s:.1f} s = {60 * cases / local_s:.1f} "
              f"cases/min [{inside}]", flush=True)
    local_s = statistics.median(local_walls)
    print(f"local median: {local_s:.1f} s = {60 * cases / local_s:.1f} cases/min", flush=True)
    local_digest = results_digest(work / "local-0")

    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    print(f"simulated cluster (head + 2 nodes of 4 CPUs) up in {time.perf_counter() - started:.1f} s (not counted)")
    try:
        for slots in (int(s) for s in args.slots.split(",")):
            walls = []
            for attempt in range(args.repeat):
                options = SweepOptions(settings=args.settings, jobs=slots,
                                       executor=ExecutorConfig("ray", cluster.address))
                target = work / f"ray-{slots}-{attempt}"
                ray_s, ray_cases, note = _sweep(generated, target, options)
                walls.append(ray_s)
                equal = results_digest(target) == local_digest
                print(f"ray executor, {slots} gang slot(s): {ray_cases} cases in {ray_s:.1f} s = "
                      f"{60 * ray_cases / ray_s:.1f} cases/min (results byte-equal to local: {equal}) [{note}]",
                      flush=True)
                assert equal, "the Ray executor's results differ from the local executor's"
            ray_s = statistics.median(walls)
            print(f"ray median, {slots} gang slot(s): {ray_s:.1f} s = {60 * ray_cases / ray_s:.1f} cases/min, "
                  f"{100 * (ray_s / local_s - 1):+.1f} % wall against the local median", flush=True)

        store = Store(work / "local-0")
        records = [r for r in store.records() if r.outputs]
        biggest = max(records, key=lambda r: (store.outputs_dir / r.outputs).stat().st_size)
        outputs = store.load_outputs(biggest)
        size = (store.outputs_dir / biggest.outputs).stat().st_size
        store.close()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        placed, roundtrips = _scheduling_costs(ray, outputs)
        ray.shutdown()
        print(f"placing a gang (2 bundles STRICT_PACK + its actor): mean {1000 * statistics.mean(placed):.0f} ms, "
              f"min {1000 * min(placed):.0f} ms over {len(placed)}")
        print(f"one actor call returning a case's outputs ({size / 1e3:.0f} kB, {biggest.setting}): median "
              f"{1000 * statistics.median(roundtrips):.1f} ms, max {1000 * max(roundtrips):.1f} ms over {len(roundtrips)}")
    finally:
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
