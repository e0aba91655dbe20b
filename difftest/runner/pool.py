"""A warm group of `world_size` rank processes joined in one process group, and its per-case watchdog."""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from difftest.contracts.failure import Failure
from difftest.contracts.logs import log_tail
from difftest.contracts.status import Status
from difftest.runner import worker
from difftest.runner.messages import Broken, CaseRequest, RankReply, Ready, RunCase, Stop, StorePort

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from difftest.contracts.setting import Outputs

_SPAWN = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")
RANK_PRELOAD = ["difftest.runner.rank_imports"]  # what the CPU ranks' fork server imports before it forks one
ERROR_GRACE_S = 3.0  # how long the other ranks may take to report after one rank raised
READY_TIMEOUT_S = 60.0  # how long the ranks may take to close a case's world and open the next one
# how long a rank whose pipe closed may take to be reaped: on a loaded host, one killed by a signal can take seconds
# (faulthandler writes every thread's stack first), and 2 s once recorded a SIGFPE as "vanished"
EXIT_WAIT_S = 30.0
# faulthandler's words for the fatal signals it reports ("Fatal Python error: Floating point exception"); it then
# raises the signal again, so the rank's exit status is that signal's
_FAULTHANDLER_SIGNALS = {"Segmentation fault": signal.SIGSEGV, "Floating point exception": signal.SIGFPE,
                         "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS, "Illegal instruction": signal.SIGILL}
_FATAL = re.compile(r"^Fatal Python error: (" + "|".join(_FAULTHANDLER_SIGNALS) + r")$", re.MULTILINE)


@dataclass
class CaseResult:
    status: Status
    outputs: Outputs | None = None
    message: str = ""
    rank: int | None = None
    wall_s: float = 0.0
    reusable: bool = True  # False: the group must be replaced before the next case
    compute_s: float = 0.0  # the slowest rank's time inside the setting: what the case costs without the engine


def simulated_local_size(world_size: int) -> int:
    """Ranks per simulated host. Four ranks are two hosts of two, so host-aware sharding really spans hosts."""
    return 2 if world_size % 2 == 0 and world_size > 2 else world_size


_Message = TypeVar("_Message", StorePort, Ready)


class GroupStartError(RuntimeError):
    pass


class GroupBroken(RuntimeError):
    """The ranks could not open a fresh world for the next case: the group must be replaced, and the case
    it was about to run goes to the new group (it never started, so it is not a finding)."""


_GROUPS_MADE = itertools.count()  # in this process: with its pid, each group's own log files


def _tail(path: Path, lines: int = 6) -> str:
    return " | ".join(log_tail(path, lines))


def _describe_exit(code: int | None, log_path: Path | None = None) -> str:
    """How a rank ended. One not yet reaped, or whose status was lost (multiprocessing's forkserver answers 255 when
    it cannot read it: seen once for one of two ranks that died of SIGFPE within 4 ms), is described by the signal its
    log's faulthandler report names, the signal the rank then dies of: one bug, one description."""
    if (code is None or code >= 0) and log_path is not None and log_path.exists():
        if fatal := _FATAL.search(log_path.read_text(errors="replace")):
            code = -_FAULTHANDLER_SIGNALS[fatal[1]]
    if code is None:
        return "vanished"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@functools.cache  # decided once per process, not at every group start
def rank_start(device: str, gpu_in_ranks: bool = True) -> Any:
    """How a group's ranks start. On CPU, forked from one server per sweep process that has imported what every rank
    needs (`difftest.runner.rank_imports`): a group then starts in a tenth of a second rather than seconds of imports
    per rank (each bucket's group, a crash's replacement, each minimisation round's groups), and each rank is still a
    process that has run nothing. Spawned where its ranks may use a GPU that is in reach: a process forked from one
    that touched CUDA (an import that asks for the device count can) cannot use it. `gpu_in_ranks` False: the
    group's settings compute on the CPU alone (`Setting.computes_on_gpu`), so a GPU machine forks them too."""
    if forks_from_import_server(device, gpu_in_ranks):
        _FORKSERVER.set_forkserver_preload(RANK_PRELOAD)
        return _FORKSERVER
    return _SPAWN


def forks_from_import_server(device: str, gpu_in_ranks: bool) -> bool:
    """Whether ranks on `device` whose settings may (`gpu_in_ranks`) or may not put tensors on a GPU are forked from
    the import server rather than spawned (`rank_start`)."""
    if device != "cpu":
        return False
    if not gpu_in_ranks:
        return True
    from difftest.contracts.devices import visible_gpus

    return visible_gpus() == 0


def import_server() -> Any:
    """The forkserver context whose server has imported what every rank imports (`RANK_PRELOAD`), for processes a
    case starts of its own (a resume's phases): they have run nothing. In a process forked from such a server (a
    sweep's CPU rank) its children fork from that same server. CPython knows the server's address there but would
    start one of its own, seconds of imports for every rank that starts processes."""
    from multiprocessing import forkserver, resource_tracker

    server: Any = forkserver._forkserver  # its private state: what CPython offers no way to ask
    if server._forkserver_pid is None and None not in (server._forkserver_address, server._forkserver_alive_fd):
        # inherited: the server lives while a process holds the write end of its "alive" pipe, as this one does
        server.ensure_running = resource_tracker.ensure_running
    else:
        _FORKSERVER.set_forkserver_preload(RANK_PRELOAD)
    return _FORKSERVER


def start_rank_server(device: str) -> None:
    """Start the import server now, where ranks are forked from one: it imports in a process of its own (seconds on
    a small machine) while this one does other work (`difftest run` generates the models meanwhile)."""
    if rank_start(device, gpu_in_ranks=False) is _FORKSERVER:
        from multiprocessing import forkserver

        forkserver.ensure_running()


class WorkerGroup:
    """World-size ranks that import everything and join the process group once, then run cases."""

    def __init__(
        self,
        world_size: int,
        log_dir: Path,
        plugins: tuple[str, ...],
        device: str = "cpu",
        backend: str = "gloo",
        collective_timeout_s: float = 60.0,
        start_timeout_s: float = 180.0,
        local_world_size: int | None = None,
        gpu_in_ranks: bool = True,
    ) -> None:
        self.world_size = world_size
        self.cases_run = 0  # by these processes, over every runner and sweep that used the group (warm ones too)
        log_dir.mkdir(parents=True, exist_ok=True)
        # the process and its count of groups, not id(self): a group made in the same second at a freed one's address
        # (or in a Ray host process laid out as another) took its log file, and a timeout quoted both groups' lines
        stamp = f"{time.strftime('%H%M%S')}-{os.getpid()}-{next(_GROUPS_MADE)}"
        self.log_paths = [log_dir / f"ws{world_size}-{stamp}-rank{r}.log" for r in range(world_size)]
        if local_world_size is None:
            local_world_size = simulated_local_size(world_size)
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.temp_dir = tempfile.mkdtemp(prefix=f"difftest-ws{world_size}-")
        start = rank_start(device, gpu_in_ranks)
        for rank in range(world_size):
            parent_end, child_end = start.Pipe()
            config = worker.WorkerConfig(
                rank=rank,
                world_size=world_size,
                log_path=str(self.log_paths[rank]),
                plugins=plugins,
                device=device,
                backend=backend,
                collective_timeout_s=collective_timeout_s,
                local_world_size=local_world_size,
                environment=dict(os.environ),
                gpus_hidden=start is _FORKSERVER,
                temp_dir=self.temp_dir,
            )
            process = start.Process(target=worker.main, args=(config, child_end), daemon=True)
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        try:
            port = self._expect(0, StorePort, start_timeout_s)
            for conn in self.conns[1:]:
                conn.send(port)
            for rank in range(world_size):
                self._expect(rank, Ready, start_timeout_s)
        except GroupStartError:
            self.kill()
            raise
        self._ready = True

    def _await_ready(self) -> None:
        """Every rank closed the last case's world and joined the next one: the group is in step again."""
        if self._ready:
            return
        try:
            for rank in range(self.world_size):
                self._expect(rank, Ready, READY_TIMEOUT_S)
        except GroupStartError as exc:
            self.kill()
            raise GroupBroken(str(exc)) from None
        self._ready = True

    def _expect(self, rank: int, kind: type[_Message], timeout_s: float) -> _Message:
        conn, process = self.conns[rank], self.processes[rank]
        ready = wait([conn, process.sentinel], timeout=timeout_s)
        if conn in ready:
            try:
                message = conn.recv()
                if isinstance(message, kind):
                    return message
                if isinstance(message, Broken):
                    raise GroupStartError(f"rank {rank} could not join its group: {message.message}")
            except EOFError:
                pass
        if not ready:
            raise GroupStartError(str(Failure(f"rank {rank} did not start within {timeout_s:.0f}s", log=_tail(self.log_paths[rank]))))
        process.join(EXIT_WAIT_S)
        raise GroupStartError(str(Failure(f"rank {rank} {_describe_exit(process.exitcode, self.log_paths[rank])} while starting",
                                          log=_tail(self.log_paths[rank]))))

    def run_case(self, request: CaseRequest, timeout_s: float) -> CaseResult:
        self._await_ready()
        self.cases_run += 1
        started = time.perf_counter()
        for conn in self.conns:
            conn.send(RunCase(request))
        self._ready = False
        replies: dict[int, RankReply] = {}
        deadline = started + timeout_s
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while len(replies) < self.world_size:
            pending = {self.conns[r]: r for r in range(self.world_size) if r not in replies}
            ready = wait(list(pending) + list(sentinels), timeout=max(0.0, deadline - time.perf_counter()))
            if not ready and any(reply.status != Status.OK for reply in replies.values()):
                # the others are still stuck in something the failed rank will never join (not a collective with
                # it: closing its world has cut those): the failure is the finding, the group is replaced
                self.kill()
                return self._combine(replies, started, reusable=False)
            if not ready:
                self.kill()
                silent = sorted(set(range(self.world_size)) - set(replies))
                return CaseResult(
                    Status.TIMEOUT,
                    message=f"no answer from rank(s) {silent} after {timeout_s:.0f}s; rank {silent[0]} log: "
                    f"{_tail(self.log_paths[silent[0]])}",
                    rank=silent[0],
                    wall_s=time.perf_counter() - started,
                    reusable=False,
                )
            for handle in ready:
                if handle in pending:
                    rank = pending[handle]
                    try:
                        replies[rank] = self.conns[rank].recv()  # `handle` itself
                        if replies[rank].status != Status.OK:
                            deadline = min(deadline, time.perf_counter() + ERROR_GRACE_S)
                        continue
                    except EOFError:
                        pass
                else:
                    rank = sentinels[handle]
                return self._crash(rank, started)
        return self._combine(replies, started)

    def _crash(self, rank: int, started: float) -> CaseResult:
        process = self.processes[rank]
        process.join(EXIT_WAIT_S)
        message = str(Failure(f"rank {rank} {_describe_exit(process.exitcode, self.log_paths[rank])}",
                              log=_tail(self.log_paths[rank])))
        self.kill()
        return CaseResult(Status.CRASH, message=message, rank=rank, wall_s=time.perf_counter() - started, reusable=False)

    def _combine(self, replies: dict[int, RankReply], started: float, reusable: bool = True) -> CaseResult:
        wall = time.perf_counter() - started
        compute = max(reply.compute_s for reply in replies.values())
        # every rank answered: the ranks are back in their serving loop, and each opens a fresh world before the
        # next case, so a failed case leaves nothing behind (`_await_ready` proves it or replaces the group)
        reusable = reusable and len(replies) == self.world_size
        failed = [r for r, reply in replies.items() if reply.status != Status.OK]  # error, unsupported, inconsistent (invariant)
        if failed:
            # the rank that failed first is the cause, whatever its status; later ones were cut off by it (a closed
            # connection), so a refusal on one rank is not reported as the read error it left its peer
            rank = min(failed, key=lambda r: (replies[r].failed_at or 0.0, r))
            return CaseResult(replies[rank].status, message=replies[rank].message, rank=rank, wall_s=wall, reusable=reusable,
                              compute_s=compute)
        outputs = replies[0].outputs
        if outputs is None:
            return CaseResult(Status.ERROR, message="rank 0 returned no outputs", rank=0, wall_s=wall, reusable=reusable,
                              compute_s=compute)
        return CaseResult(Status.OK, outputs=outputs, message=replies[0].message, wall_s=wall, compute_s=compute)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop politely (final barrier inside the ranks), kill whatever does not leave in time."""
        try:
            for conn in self.conns:
                conn.send(Stop())
        except (BrokenPipeError, OSError):
            pass
        deadline = time.perf_counter() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.perf_counter()))
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)
        for conn in self.conns:
            conn.close()
        # every way a healthy or broken group goes passes here, close included; where its ranks outlive the parent,
        # they remove it themselves (`worker.main`)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
