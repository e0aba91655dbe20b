"""The Ray executor: the sweep's warm worker groups run inside gangs placed on a Ray cluster.

A gang is one placement group with one bundle per rank, STRICT_PACK, so a case's ranks share a node and talk over its
loopback (gloo) or its devices (NCCL); a `GangHost` actor in the gang's first bundle runs the same `GroupRunner` the
local executor runs (warm groups, per-case watchdog, crash and timeout rows). The driver keeps every case in a
queue, the local executor's (`difftest.runner.scheduler`): each gang slot takes the bucket with the most cases left
per gang serving it and pulls its cases one at a time, keeping to its model, so idle gangs steal work instead of
sitting on a static split.

The driver stays the store's only writer: a case's record and output tensors come back as the actor call's result.
Model folders travel through Ray's object store and are written once per node. Infrastructure loss (a node, a raylet,
the host actor) is told apart from a finding: the host actor never runs a setting itself (its ranks do), so the actor
dying means the node went, and the case goes back to the queue to run elsewhere, while a case that kills its own
ranks comes back from the actor as a `crash` row like on the local executor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.contracts.errors import UserError
from difftest.contracts.status import Status
from difftest.runner.executor import BucketKey, ExecutorConfig, ExecutorReport, SweepContext
from difftest.runner.local import GroupRunner
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import CaseResult
from difftest.runner.scheduler import UNBOUNDED, WorkQueue

if TYPE_CHECKING:
    from difftest.runner.executor import Case

# a case whose gang is lost this often is recorded, not retried forever: something about it takes nodes down
MAX_GANG_LOSSES = 3
# beyond the case's own timeout (enforced inside the gang), what a call may take to start or replace a worker
# group (two tries at its start-up timeout) and write its model to the node: past it the host itself is stuck
CALL_ALLOWANCE_S = 2 * 180.0 + 60.0
PLACEMENT_POLL_S = 10.0  # how often a gang waiting for resources checks that some live node can still hold it
# a further gang joins a bucket only while each of its gangs would still have this many cases: a gang's start (its
# placement and a warm group's imports, ~6 s on two cores) costs about as much as that many cases
MIN_CASES_PER_GANG = 8
# a model folder in Ray's object store: (folder name, content digest, [reference to its files])
ModelRef = tuple[str, str, list[Any]]


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install 'difftest[ray]' (or DIFFTEST_EXTRAS=test,tf,ray "
                        "./install.sh) on the driver and on every node of the cluster") from None
    return ray


def probe_address(address: str) -> None:
    """Fail at once on an address nothing listens at (Ray itself retries for minutes before it gives up)."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # `auto` and other forms: Ray resolves them and fails quickly on its own
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise UserError(f"--address {address}: nothing answers there ({exc.strerror or exc}); start the cluster's "
                        "head with `ray start --head` and give the address it prints, or leave --address out to run "
                        "Ray on this machine alone") from None


class GangHost:
    """The process a gang runs on its node: it owns the gang's warm worker group (the ranks are its children)."""

    def __init__(self, world_size: int, plugins: tuple[str, ...], device: str, backend: str, timeout_s: float,
                 recycle_after: int, log_name: str, other_devices: list[str] | None = None) -> None:
        if other_devices is not None:
            import ray

            # rank r uses cuda:r: the ranks must see every GPU the gang's bundles hold, this actor's first
            own = [str(i) for i in ray.get_gpu_ids()]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(own + other_devices)
        self.root = Path(tempfile.gettempdir()) / "difftest-ray"
        self.runner = GroupRunner(world_size, self.root / "logs" / log_name, plugins, device=device, backend=backend,
                                  timeout_s=timeout_s, recycle_after=recycle_after)

    def run_case(self, model: ModelRef, request: dict[str, Any], process_affinity: str) -> tuple[CaseResult, int]:
        name, digest, (files_ref,) = model
        model_dir = self._materialise(name, digest, files_ref)
        result = self.runner.run(CaseRequest(model_dir=str(model_dir), **request), process_affinity)
        return result, self.runner.supply.started

    def _materialise(self, name: str, digest: str, files_ref: Any) -> Path:
        """The model folder on this node's disk, written once per node (gangs on one node share it)."""
        target = self.root / "models" / digest / name
        if (target / ".complete").exists():
            return target
        import ray

        files: dict[str, bytes] = ray.get(files_ref)
        staging = self.root / "models" / f".{uuid.uuid4().hex}"
        for rel, data in files.items():
            path = staging / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (staging / name / ".complete").write_text(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging / name, target)
        except OSError:  # another gang on this node wrote it first
            pass
        shutil.rmtree(staging, ignore_errors=True)
        return target

    def close(self) -> None:
        self.runner.close()


class DeviceHolder:
    """Holds one GPU of a gang's bundle, so the gang knows which physical device that bundle reserved."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


class _Unplaceable(Exception):
    """No live node of the cluster can hold a gang of this size any more."""


@dataclass
class RayStats:
    gangs_started: int = 0
    groups_started: int = 0  # worker groups inside the gangs (a gang replaces its group after a crash)
    gangs_lost: int = 0
    cases_requeued: int = 0
    nodes: int = 0
    # a gang's start: its placement, then its first call's time outside the case (the worker group starting, the
    # model written to the node) — what a local group's start costs, plus Ray's placement
    gang_start_s: float = 0.0
    # every later case: the driver's wait for the actor call minus the case's time inside its worker group, i.e.
    # what shipping the request and the outputs through Ray costs, and any group replaced after a crash
    cases_after_first: int = 0
    transport_s: float = 0.0


class RayExecutor:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.stats = RayStats()
        self._lock = threading.Lock()
        self._models: dict[str, ModelRef] = {}
        self._losses: Counter[tuple[str, str]] = Counter()
        self._connected = False  # this executor connected the driver to Ray (and disconnects it when done)

    def note(self) -> str:
        s = self.stats
        costs = (f"; gang start {s.gang_start_s / s.gangs_started:.1f} s each, then "
                 f"{1000 * s.transport_s / max(1, s.cases_after_first):.0f} ms per case outside the cases"
                 if s.gangs_started else "")
        return (f"Ray: {s.nodes} node(s), {s.gangs_started} gang(s), {s.gangs_lost} lost with their node, "
                f"{s.cases_requeued} case(s) re-run elsewhere{costs}")

    # -- connection and capacity -------------------------------------------------------------------------------
    def _connect(self, work: dict[BucketKey, list[Case]]) -> Any:
        ray = import_ray()
        if ray.is_initialized():  # the caller's own connection: it stays the caller's to close
            return ray
        self._connected = True
        options = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        if self.config.address:
            probe_address(self.config.address)
            try:
                ray.init(address=self.config.address, **options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(f"--address {self.config.address}: no Ray cluster answers there ({first}); start "
                                "one with `ray start --head` and give its address, or leave --address out to "
                                "start Ray on this machine") from None
        else:
            # a Ray instance of this machine alone: logical CPUs enough for the largest gang, as the local executor
            # oversubscribes its cores the same way
            largest = max((key[0] for key in work), default=1)
            ray.init(num_cpus=max(os.cpu_count() or 1, int(largest * self.config.cpus_per_rank + 0.999)), **options)
        return ray

    def _bundle(self, device: str) -> dict[str, float]:
        bundle = {"CPU": self.config.cpus_per_rank}
        if device == "cuda":
            bundle["GPU"] = 1.0
        return bundle

    @staticmethod
    def _live_nodes(ray: Any) -> list[dict[str, Any]]:
        return [n for n in ray.nodes() if n.get("Alive")]

    def _refusal(self, ray: Any, world_size: int, device: str) -> str | None:
        """Why no live node can hold a gang of `world_size` ranks, or None if one can."""
        need = {k: v * world_size for k, v in self._bundle(device).items()}
        nodes = self._live_nodes(ray)
        if any(all(n["Resources"].get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
            return None
        biggest = max((n["Resources"].get("GPU" if device == "cuda" else "CPU", 0.0) for n in nodes), default=0)
        unit = "GPUs" if device == "cuda" else "CPUs"
        return (f"the Ray cluster has no node with {need.get('GPU', need['CPU']):g} {unit} for a {world_size}-rank "
                f"gang (STRICT_PACK: one node per case; its largest live node has {biggest:g})")

    def _slots(self, ray: Any, jobs: int | None) -> int:
        if jobs:
            return jobs
        nodes = self._live_nodes(ray)
        # as many gangs as the cluster holds at two ranks each (the commonest world size)
        per_gang = 2 * self.config.cpus_per_rank
        return max(1, sum(int(n["Resources"].get("CPU", 0.0) // per_gang) for n in nodes))

    # -- the sweep ---------------------------------------------------------------------------------------------
    def run(self, sweep: SweepContext, work: dict[BucketKey, list[Case]],
            report: Callable[[Case, CaseResult], None]) -> ExecutorReport:
        if not work:
            return ExecutorReport()
        ray = self._connect(work)
        try:
            device = sweep.options.device
            runnable: dict[BucketKey, list[Case]] = {}
            for key, cases in work.items():
                reason = self._refusal(ray, key[0], device)
                if reason:
                    for case in cases:
                        report(case, CaseResult(Status.UNSUPPORTED, message=reason))
                else:
                    runnable[key] = cases
            self.stats.nodes = len(self._live_nodes(ray))
            queue: WorkQueue[BucketKey, Case] = WorkQueue(runnable.items(), UNBOUNDED,
                                                          model_of=lambda case: case.model_id,
                                                          min_to_join=MIN_CASES_PER_GANG)
            slots = self._slots(ray, sweep.options.jobs)
            errors: list[BaseException] = []

            def slot() -> None:
                gangs: list[_Gang] = []  # the gang it runs its bucket's cases on, if it has one

                def run(key: BucketKey, case: Case) -> None:
                    gang = self._serve(ray, sweep, key, case, gangs[0] if gangs else None, queue, report)
                    gangs[:] = [gang] if gang is not None else []  # None: it was lost, and killed

                def release() -> None:  # its gang's resources go before it waits for another bucket
                    while gangs:
                        gangs.pop().close()

                try:
                    queue.serve(run, release)
                except BaseException as exc:  # surfaced by the driver thread below
                    errors.append(exc)
                finally:
                    release()

            threads = [threading.Thread(target=slot, daemon=True) for _ in range(slots)]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.5)
            if errors:
                raise errors[0]
        finally:
            if self._connected:
                ray.shutdown()
        return ExecutorReport(self.stats.groups_started, self.stats.cases_requeued, self.note())

    def _model(self, ray: Any, case: Case) -> ModelRef:
        """The case's model folder in the object store (put once per sweep), named by its content."""
        with self._lock:
            if case.model_id not in self._models:
                files = {str(p.relative_to(case.model_dir)): p.read_bytes()
                         for p in sorted(case.model_dir.rglob("*")) if p.is_file()}
                digest = hashlib.sha256()
                for rel, data in files.items():
                    digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
                # the reference travels inside a list, so the actor fetches it only when its node lacks the folder
                self._models[case.model_id] = (case.model_dir.name, digest.hexdigest()[:20], [ray.put(files)])
            return self._models[case.model_id]

    def _serve(self, ray: Any, sweep: SweepContext, key: BucketKey, case: Case, gang: _Gang | None,
               queue: WorkQueue[BucketKey, Case], report: Callable[[Case, CaseResult], None]) -> _Gang | None:
        """Runs `case` on `gang`, started first if there is none; the gang to run the bucket's next case on (None:
        it was lost, or no live node can place one)."""
        if gang is None:
            placing = time.perf_counter()
            try:
                gang = _Gang.start(ray, self, sweep, key)
            except _Unplaceable as exc:
                for lost in [case, *queue.drain(key)]:
                    report(lost, CaseResult(Status.UNSUPPORTED, message=str(exc)))
                return None
            gang.start_s = time.perf_counter() - placing
        config = sweep.config
        fields = {"setting": case.setting.name, "steps": config.steps, "lr": config.lr, "seed": config.seed}
        called = time.perf_counter()
        try:
            result = gang.run(self._model(ray, case), fields, case.setting.process_affinity,
                              # a case whose rank died after others runs again alone (`GroupRunner.run`): twice
                              2 * (sweep.options.timeout_s + CALL_ALLOWANCE_S))
        except ray.exceptions.RayError as exc:
            gang.kill()
            self._lost(key, case, exc, queue, report)
            return None
        outside = max(0.0, time.perf_counter() - called - result.wall_s)
        with self._lock:
            if gang.cases == 0:
                self.stats.gang_start_s += gang.start_s + outside
            else:
                self.stats.cases_after_first += 1
                self.stats.transport_s += outside
        gang.cases += 1
        report(case, result)
        return gang

    def _lost(self, key: BucketKey, case: Case, exc: BaseException, queue: WorkQueue[BucketKey, Case],
              report: Callable[[Case, CaseResult], None]) -> None:
        """The gang went away under a case: infrastructure, not the case's doing; it runs again on another gang."""
        with self._lock:
            self.stats.gangs_lost += 1
            self._losses[(case.model_id, case.setting.name)] += 1
            losses = self._losses[(case.model_id, case.setting.name)]
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        logging.getLogger("difftest").warning("gang lost under %s on %s (%s): %s", case.setting.name, case.model_id,
                                              type(exc).__name__, first)
        if losses >= MAX_GANG_LOSSES:
            report(case, CaseResult(Status.CRASH, message=f"its gang was lost {losses} times (node or host process gone; "
                                                     f"last: {type(exc).__name__}: {first})"))
            return
        with self._lock:
            self.stats.cases_requeued += 1
        queue.put_back(key, case)


class _Gang:
    """One placement group (a bundle per rank, STRICT_PACK) and the host actor running its warm worker group."""

    def __init__(self, ray: Any, pg: Any, host: Any, holders: list[Any], executor: RayExecutor) -> None:
        self.ray, self.pg, self.host, self.holders, self.executor = ray, pg, host, holders, executor
        self.groups_started = 0  # the worker groups its host has started, as of its last answer
        self.cases = 0
        self.start_s = 0.0  # its placement and host actor's creation

    @classmethod
    def start(cls, ray: Any, executor: RayExecutor, sweep: SweepContext, key: BucketKey) -> _Gang:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = key[0]
        options = sweep.options
        bundle = executor._bundle(options.device)
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="STRICT_PACK")
        while True:
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_POLL_S)
            if ready:
                break
            reason = executor._refusal(ray, world_size, options.device)
            if reason:  # the nodes that could hold it are gone
                remove_placement_group(pg)
                raise _Unplaceable(reason)

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

        gpus = 1 if options.device == "cuda" else 0
        holders, others = [], None
        if gpus:  # the host holds bundle 0's GPU; an idle holder per other bundle says which GPU that one reserved
            remote_holder = ray.remote(DeviceHolder)
            holders = [remote_holder.options(num_cpus=0, num_gpus=1, scheduling_strategy=in_bundle(i)).remote()
                       for i in range(1, world_size)]
            others = [i for h in holders for i in ray.get(h.gpu_ids.remote())]
        remote_host = ray.remote(GangHost).options(
            num_cpus=bundle["CPU"], num_gpus=gpus, scheduling_strategy=in_bundle(0), max_restarts=0,
            max_task_retries=0)
        log_name = f"{sweep.run_dir.name}-ws{world_size}-{uuid.uuid4().hex[:8]}"
        host = remote_host.remote(world_size, sweep.plugins, options.device, options.resolved_backend,
                                  options.timeout_s, options.recycle_after, log_name, others)
        with executor._lock:
            executor.stats.gangs_started += 1
        return cls(ray, pg, host, holders, executor)

    def run(self, model: ModelRef, request: dict[str, Any], process_affinity: str, timeout_s: float) -> CaseResult:
        answer: tuple[CaseResult, int] = self.ray.get(self.host.run_case.remote(model, request, process_affinity),
                                                      timeout=timeout_s)
        result, self.groups_started = answer
        return result

    def close(self) -> None:
        try:
            self.ray.get(self.host.close.remote(), timeout=60)
        except self.ray.exceptions.RayError:
            pass
        self.kill()

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with self.executor._lock:
            self.executor.stats.groups_started += self.groups_started
            self.groups_started = 0
        for actor in [self.host, *self.holders]:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone with its node
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
