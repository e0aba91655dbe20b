"""The local executor: warm worker groups on this machine, as many at once as it runs ranks (`ranks_at_once`: one per
core and one more), fed by one queue of cases (`difftest.runner.scheduler`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from difftest.contracts.notes import render_notes
from difftest.contracts.status import Status
from difftest.runner.executor import BucketKey, ExecutorReport, SweepContext
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import CaseResult, GroupBroken, GroupStartError, WorkerGroup
from difftest.runner.scheduler import WorkQueue, ranks_at_once

if TYPE_CHECKING:
    from pathlib import Path

    from difftest.runner.executor import Case

HARNESS_NOTE = "harness"  # the note of what difftest's own processes did to a case (a death not the setting's)

# how much longer than a case's timeout a rank waits in a collective: a rank that waits for a hung peer must not give
# up first (its collective error raced the watchdog and sometimes won), the hang is the finding: a `timeout`
HANG_MARGIN_S = 10.0

# a bucket's key with what else its group was started with: (world size, process affinity, device, backend, plugins,
# case timeout)
WarmKey = tuple[int, str, str, str, tuple[str, ...], float]


class WarmGroups:
    """Worker groups kept warm from one sweep to the next (the minimiser's rounds: many small sweeps in a row): a
    bucket starts on the idle group of its kind, if there is one, and leaves its group here, healthy, when done."""

    def __init__(self) -> None:
        self._idle: dict[WarmKey, WorkerGroup] = {}
        self._lock = threading.Lock()

    def take(self, key: WarmKey) -> WorkerGroup | None:
        with self._lock:
            return self._idle.pop(key, None)

    def give(self, key: WarmKey, group: WorkerGroup) -> None:
        with self._lock:
            previous, self._idle[key] = self._idle.get(key), group
        if previous is not None:
            previous.close()

    def close(self) -> None:
        with self._lock:
            groups, self._idle = list(self._idle.values()), {}
        for group in groups:
            group.close()


class _GroupSupply:
    """Warm groups of one world size: the group in use, and, once a group has had to be replaced (a crash, a hang, a
    rank stuck outside a collective, its case budget spent), a spare started in the background so the next
    replacement is already warm. A supply that never replaces its group pays for no spare."""

    def __init__(self, make: Callable[[], WorkerGroup]) -> None:
        self._make = make
        self._starter = ThreadPoolExecutor(max_workers=1)
        self._spare: Future[WorkerGroup] | None = None
        self.started = 0

    def first(self) -> WorkerGroup:
        self.started += 1
        return self._make()

    def replacement(self) -> WorkerGroup:
        """The spare if one is starting (raises its GroupStartError), else a new group; then a new spare starts."""
        if self._spare is None:
            group = self.first()
        else:
            spare, self._spare = self._spare, None
            self.started += 1
            group = spare.result()
        self._spare = self._starter.submit(self._make)
        return group

    def close(self) -> None:
        if self._spare is not None and self._spare.exception() is None:
            self._spare.result().close()
        self._starter.shutdown()


class GroupRunner:
    """Runs cases of one world size on one warm group at a time, and replaces the group whenever a case leaves it
    untrustworthy. Both executors run cases through it: the local one on this machine, the Ray one inside a gang."""

    def __init__(self, world_size: int, log_dir: Path, plugins: tuple[str, ...], *, device: str, backend: str,
                 timeout_s: float, recycle_after: int, group: WorkerGroup | None = None,
                 gpu_in_ranks: bool = True) -> None:
        self.timeout_s = timeout_s
        self.recycle_after = recycle_after
        self.supply = _GroupSupply(lambda: WorkerGroup(world_size, log_dir, plugins, device=device, backend=backend,
                                                       collective_timeout_s=timeout_s + HANG_MARGIN_S,
                                                       gpu_in_ranks=gpu_in_ranks))
        self.group = group
        self._broken_before = False  # a group was replaced: the next one comes from the spare
        self._start_failure: str | None = None
        self._failed_starts = 0

    def run(self, request: CaseRequest, process_affinity: str) -> CaseResult:
        """The case's result. A rank that dies in a group that has run other cases first (in this sweep or, warm, in
        an earlier one) may have died of what an earlier case left in its process (a failed case's pending receive
        into memory since freed), which no user's program meets, as it ends at its first failure: such a case runs
        again alone, in a fresh group, and that run is its verdict, the first death noted in it (`crashed_after_others`).
        A crash alone too is the setting's, as is any other failure alone; where no fresh group starts, the first death
        stands."""
        result, served = self._run(request, process_affinity)
        if result.status is not Status.CRASH or not served:
            return result
        if self.group is not None:  # alone: on processes that have run nothing else
            self.group.kill()
            self.group, self._broken_before = None, True
        alone, ran = self._run(request, process_affinity)
        if ran is None:
            return result  # no fresh group started (`worker group: …`): the case could not run alone
        if alone.status is not Status.OK:  # its own failure (or refusal), in its own words: what the setting does
            return replace(alone, wall_s=result.wall_s + alone.wall_s)
        return replace(alone, wall_s=result.wall_s + alone.wall_s,
                       message=_with_note(alone.message, crashed_after_others(result, served)))

    def _run(self, request: CaseRequest, process_affinity: str) -> tuple[CaseResult, int | None]:
        """The case on the current group (a new one where needed), and how many cases that group's processes had
        run before it (None: no group could start to run it)."""
        if self.group is not None and self.group.cases_run >= self.recycle_after:  # a warm group's earlier ones too
            # libraries that keep what every case built cannot grow a rank forever
            self.group.close()
            self.group, self._broken_before = None, True
        while True:
            if self.group is None and self._failed_starts >= 2:
                # the group cannot start at all: say so for every remaining case rather than retrying each
                return CaseResult(Status.CRASH, message=f"worker group: {self._start_failure}", reusable=False), None
            if self.group is None:
                try:
                    self.group = self.supply.replacement() if self._broken_before else self.supply.first()
                    self._failed_starts = 0
                except GroupStartError as exc:
                    self._start_failure, self._failed_starts = str(exc), self._failed_starts + 1
                    return CaseResult(Status.CRASH, message=f"worker group: {exc}", reusable=False), None
            try:
                result = self.group.run_case(request, self.timeout_s)
            except GroupBroken:
                self.group, self._broken_before = None, True  # the case never started: it runs on the replacement
                continue
            ran_before = self.group.cases_run - 1
            # a setting with per-process state (a TF strategy and its servers) that failed may have left that state
            # broken, and the case's sockets were cut: its processes are not trusted with the next case
            kept_state_broken = process_affinity and result.status not in (Status.OK, Status.UNSUPPORTED)
            if not result.reusable or kept_state_broken:
                self.group.kill()
                self.group, self._broken_before = None, True
            return result, ran_before

    def release(self) -> WorkerGroup | None:
        """The healthy group, handed over to be kept warm (the caller closes it); None if there is none."""
        group, self.group = self.group, None
        return group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.supply.close()


def crashed_after_others(crash: CaseResult, served: int) -> str:
    """The note a case keeps whose rank died after its group had run `served` other cases, and not when it ran alone."""
    first = crash.message.strip().splitlines()[0] if crash.message.strip() else "a rank died"
    first = first.replace("; ", ", ")  # one note's value: no `; key: ` inside it (`difftest.contracts.notes`)
    return (f"in a worker group that had run {served} case(s) before it, {first}; run again alone in a fresh group, it "
            "did not crash (this result): the death is not the setting's")


def _with_note(message: str, note: str) -> str:
    """An ok case's notes with the harness's note added as a note of its own."""
    return "; ".join(part for part in (message, render_notes({HARNESS_NOTE: note})) if part)


def request_for(sweep: SweepContext, case: Case) -> CaseRequest:
    config = sweep.config
    return CaseRequest(str(case.model_dir), case.setting.name, config.steps, config.lr, config.seed)


class LocalExecutor:
    """`jobs` worker groups at once (default: as many as `ranks_at_once` holds ranks), each running the cases of
    its bucket and then taking over the bucket with the most work left (`difftest.runner.scheduler`)."""

    def __init__(self, warm: WarmGroups | None = None) -> None:
        self.warm = warm

    def run(self, sweep: SweepContext, work: dict[BucketKey, list[Case]],
            report: Callable[[Case, CaseResult], None]) -> ExecutorReport:
        capacity = ranks_at_once()
        queue: WorkQueue[BucketKey, Case] = WorkQueue(work.items(), capacity, model_of=lambda case: case.model_id)
        lock = threading.Lock()
        started = [0]
        failures: list[BaseException] = []

        def serve() -> None:
            held: list[tuple[BucketKey, GroupRunner]] = []  # the group it runs cases on, and its bucket

            def run(key: BucketKey, case: Case) -> None:
                if not held:
                    gpu_in_ranks = any(waiting.setting.computes_on_gpu for waiting in work[key])
                    held.append((key, self._runner(sweep, key, gpu_in_ranks)))
                report(case, held[0][1].run(request_for(sweep, case), case.setting.process_affinity))

            def release() -> None:
                if held:
                    put_away(held.pop())

            try:
                queue.serve(run, release)
            except BaseException as exc:  # a bug of ours (the store, a report): the sweep stops and run() raises it
                failures.append(exc)
            finally:
                if held:
                    put_away(held.pop(), keep=not failures)

        def put_away(held: tuple[BucketKey, GroupRunner], keep: bool = True) -> None:
            """A runner whose bucket is done: its healthy group is kept warm for the next sweep, if there is one."""
            key, runner = held
            if keep and self.warm is not None:
                group = runner.release()
                if group is not None:
                    self.warm.give(self._warm_key(sweep, key), group)
            runner.close()
            with lock:
                started[0] += runner.supply.started

        jobs = sweep.options.jobs or default_jobs(work, capacity)
        threads = [threading.Thread(target=serve, daemon=True) for _ in range(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # short joins keep Ctrl-C responsive
        if failures:
            raise failures[0]
        return ExecutorReport(groups_started=started[0])

    def _warm_key(self, sweep: SweepContext, key: BucketKey) -> WarmKey:
        options = sweep.options
        return (*key, options.device, options.resolved_backend, sweep.plugins, options.timeout_s)

    def _runner(self, sweep: SweepContext, key: BucketKey, gpu_in_ranks: bool) -> GroupRunner:
        options = sweep.options
        warm = self.warm.take(self._warm_key(sweep, key)) if self.warm is not None else None
        return GroupRunner(key[0], sweep.run_dir / "logs", sweep.plugins, device=options.device,
                           backend=options.resolved_backend, timeout_s=options.timeout_s,
                           recycle_after=options.recycle_after, group=warm, gpu_in_ranks=gpu_in_ranks)


def default_jobs(work: dict[BucketKey, list[Case]], capacity: int) -> int:
    """As many groups as `capacity` (ranks at once) holds ranks of the smallest world waiting (the queue keeps the
    ranks running at once within it), and no more than there are cases."""
    waiting = [key[0] for key, cases in work.items() if cases]
    if not waiting:
        return 1
    return max(1, min(capacity // min(waiting), sum(len(cases) for cases in work.values())))
