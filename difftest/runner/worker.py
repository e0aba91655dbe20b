"""The body of one rank of a warm worker group.

A rank joins the process group once, imports torch/torchrec and the plugins once, then runs the cases the
parent sends until told to stop (or until its pipe closes, e.g. when the parent was killed).
"""

from __future__ import annotations

import faulthandler
import functools
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftest.contracts.failure import Failure
from difftest.contracts.notes import render_notes
from difftest.contracts.status import Status
from difftest.runner.messages import Broken, RankReply, Ready, Stop, StorePort

_CACHED_MODELS: dict[str, Any] = {}
# The cyclic garbage collector's permanent generation (`gc.freeze`) holds what outlives every case: the imports, frozen
# by the server ranks fork from (`difftest.runner.rank_imports`), and whatever survives the release of a model and a
# collection, frozen then: later imports and the libraries' caches, which grow with the cases (DTensor's sharding and
# redistribution caches: 50 000 objects in a rank by the end of the default sweep, which each case's collection walked
# while only new imports were frozen, 45 ms of CPU a case). A full collection that walks them all costs a rank 0.4-0.8
# s; one that walks the cached model and a case's garbage, milliseconds. The model itself never goes into the permanent
# generation: letting it go would then take a full collection (benchmarks/RESULTS.md has what that cost a sweep's ranks).


@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    world_size: int
    log_path: str
    plugins: tuple[str, ...]
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    collective_timeout_s: float
    local_world_size: int
    # the starting process's environment when the group started: a rank forked from the import server
    # (`difftest.runner.pool.rank_start`) would otherwise have the server's, from the sweep's first group
    environment: dict[str, str] | None = None
    # forked from the import server, which sees no GPU (`rank_imports`): nor does the rank, whatever the environment
    gpus_hidden: bool = False
    # the group's own temporary folder, removed once the group is gone (by the parent, or by the ranks when the parent
    # was killed): what libraries leave in the temporary folder for deletion at exit (TensorFlow's autograph writes a
    # source file per converted function) is never deleted by a rank, which leaves through os._exit or is killed
    temp_dir: str | None = None


def use_temporary_folder(folder: str) -> None:
    """This process's temporary files (and its children's, through TMPDIR) in `folder`, which someone else removes: a
    process that leaves through os._exit never runs what a library registered to delete them at exit. tempfile's
    cached choice is set too: a process forked from the import server inherits the server's."""
    import tempfile

    os.environ["TMPDIR"] = tempfile.tempdir = folder


def redirect_output(log_path: str, append: bool = True) -> None:
    # fd-level, so C++ aborts and gloo messages land in the log the parent quotes on a crash
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # a segfault or abort writes the Python frames it died in to the log, and the crash record quotes them
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a gloo thread has no Python frames


# the first torch release whose store server (libuv's, the default) takes a socket bound to the loopback: 2.6's raises
# NotImplementedError and logs an error line to the rank's log, which a crash record quotes (measured: 2.6 no; 2.11,
# 2.12, 2.13, 2.14 yes). The legacy server would take one, but is a server difftest runs nowhere else.
LOOPBACK_STORE_SINCE = (2, 11)


# Before this torch release, destroying a gloo group joins its threads while holding the GIL, and a thread still
# freeing a finished work's tensors (an AsyncGatherWork) waits for the GIL: both wait for ever (seen on torch 2.6 in 3
# of 4 runs of the oldest release's test, each costing the group and its 60 s wait for ready; fixed by pytorch PR
# #154976, "Release GIL in PG destructor"). The threads have finished the case's work when its result is sent, so a
# moment without the GIL lets them free it.
GIL_FREE_GLOO_DESTRUCTOR_SINCE = (2, 8)


def destroy_process_group() -> None:
    """`torch.distributed.destroy_process_group`, after a moment without the GIL on the releases that need it (above)."""
    import torch.distributed as dist

    if _torch_release() < GIL_FREE_GLOO_DESTRUCTOR_SINCE:
        time.sleep(0.01)  # the GIL to gloo's threads, which may still be freeing the last work
    dist.destroy_process_group()


@functools.cache  # asked at every case's end: parsed once per process
def _torch_release() -> tuple[int, ...]:
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _device_for(config: WorkerConfig) -> str:
    from difftest.contracts.devices import rank_device, visible_gpus

    return rank_device(config.device, config.backend, config.rank, visible_gpus() if config.device == "cuda" else 0)


def _reset_global_state(seed: int) -> None:
    """Undo what a previous case may have changed, so a case's bytes do not depend on what ran before it."""
    import random

    import numpy as np
    import torch

    torch.use_deterministic_algorithms(False)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    if torch.backends.quantized.engine != _INITIAL_QENGINE:
        torch.backends.quantized.engine = _INITIAL_QENGINE


_INITIAL_QENGINE = ""


def main(config: WorkerConfig, conn: Any) -> None:
    global _INITIAL_QENGINE
    if config.environment is not None:  # before any plugin import reads it (a planted fault is chosen this way)
        os.environ.clear()
        os.environ.update(config.environment)
    if config.gpus_hidden:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    redirect_output(config.log_path)
    # daemonic so the parent's exit takes the ranks along; but a setting may start processes of its own (a resume's
    # new process group) and multiprocessing refuses children to a daemon: this process waits for its children itself
    import multiprocessing

    from difftest.contracts.script_runtime import gloo_on_loopback  # the scripts' ranks call the same

    multiprocessing.current_process().daemon = False
    os.environ["LOCAL_WORLD_SIZE"] = str(config.local_world_size)
    os.environ["LOCAL_RANK"] = str(config.rank % config.local_world_size)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    gloo_on_loopback()
    if config.temp_dir is not None:
        use_temporary_folder(config.temp_dir)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with it, set before init
    print(f"[rank {config.rank}] starting, pid {os.getpid()}", flush=True)
    code = 0
    try:
        _serve(config, _ParentPipe(conn))
    except (_ParentGone, KeyboardInterrupt):
        pass  # parent went away (its pipe closed or reset, as when it is killed): nothing left to report to
    except BaseException:  # the rank's own failure: its traceback to the log the parent quotes, and exit 1
        traceback.print_exc()
        code = 1
    finally:
        # the group is over once a rank leaves: its folder goes, whoever is first (the parent removes it too, unless
        # it was killed)
        if config.temp_dir is not None:
            shutil.rmtree(config.temp_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # leaving through os._exit avoids gloo's occasional abort in interpreter teardown
    os._exit(code)


class _ParentGone(Exception):
    """The pipe to the parent closed or reset: the one failure after which a rank leaves quietly (a plugin or setting
    raising ConnectionError of its own is the rank's error, and its traceback goes to the log the parent quotes)."""


class _ParentPipe:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def send(self, message: Any) -> None:
        try:
            self._conn.send(message)
        except (EOFError, ConnectionError) as exc:
            raise _ParentGone from exc

    def recv(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError) as exc:
            raise _ParentGone from exc


def _serve(config: WorkerConfig, conn: _ParentPipe) -> None:
    global _INITIAL_QENGINE
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it without __all__

    from difftest.contracts.errors import InvariantViolated, Unsupported
    from difftest.contracts.registry import get_setting, load_plugins
    from difftest.contracts.setting import RunContext
    from difftest.storage.artifacts import load_model

    torch.set_num_threads(1)
    _INITIAL_QENGINE = torch.backends.quantized.engine
    timeout = timedelta(seconds=config.collective_timeout_s)
    if config.rank == 0:
        store = _loopback_store(config.world_size, timeout)
        conn.send(StorePort(store.port))
    else:
        port = conn.recv().port
        store = TCPStore("127.0.0.1", port, config.world_size, is_master=False, timeout=timeout)
    if config.device == "cuda":
        torch.cuda.set_device(torch.device(_device_for(config)))
    load_plugins(config.plugins)
    serial = 0
    _open_world(config, store, serial, timeout)
    dist.barrier()
    conn.send(Ready(os.getpid()))

    while True:
        message = conn.recv()
        if isinstance(message, Stop):
            return
        request = message.request
        status, payload, text, ctx, failed_at, compute_s = Status.OK, None, "", None, None, 0.0
        try:
            _reset_global_state(request.seed)
            setting = get_setting(request.setting)
            # every case prefers deterministic kernels, so a rerun (strict: an op without one raises) is compared
            # with a first run that chose the same kernels; elsewhere such an op only warns
            torch.use_deterministic_algorithms(True, warn_only=not setting.deterministic)
            model, inputs = _cached_model(request.model_dir, load_model)
            ctx = RunContext(
                rank=config.rank,
                world_size=config.world_size,
                local_world_size=config.local_world_size,
                device=_device_for(config),
                backend=config.backend,
                group=dist.group.WORLD,
                steps=request.steps,
                lr=request.lr,
                seed=request.seed,
            )
            started = time.perf_counter()
            try:
                payload = setting.run(ctx, model, inputs)
            finally:
                compute_s = time.perf_counter() - started  # the setting's own time: the floor the engine adds to
            text = render_notes(ctx.notes)
        except Unsupported as exc:
            status, text, failed_at = Status.UNSUPPORTED, str(exc), time.time()
        except InvariantViolated as exc:
            status, text, failed_at = Status.INCONSISTENT, f"invariant broken: {exc}"[:4000], time.time()
        except Exception as exc:  # a setting that raises is a finding, recorded with its traceback tail
            status, failed_at, text = Status.ERROR, time.time(), Failure.of(exc).stored()
        conn.send(RankReply(status, payload if config.rank == 0 else None, text, compute_s, failed_at))
        payload = ctx = None
        serial += 1
        try:
            _close_world(failed=status != Status.OK, store_port=store.port)
            _open_world(config, store, serial, timeout)
        except Exception as exc:  # the parent replaces this group; nothing of a case is lost
            conn.send(Broken(f"{type(exc).__name__}: {exc}"[:1000]))
            return
        conn.send(Ready(os.getpid()))


def _loopback_store(world_size: int, timeout: Any) -> Any:
    """Rank 0's store, at a free port the OS picks (reported to the parent for the other ranks). TCPStore's server
    listens on every interface (`::`) whatever host it is given, so it is handed a socket already bound to 127.0.0.1
    where the release can take one (`LOOPBACK_STORE_SINCE`); before, it listens as torch has it."""
    import socket

    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it without __all__

    if _torch_release() < LOOPBACK_STORE_SINCE:
        return TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port, fd = listener.getsockname()[1], listener.detach()
    try:
        return TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                        master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _open_world(config: WorkerConfig, store: Any, serial: int, timeout: Any) -> None:
    """A fresh default process group for one case, over the rank's long-lived store.

    Every case starts on connections no earlier case touched, and a case's failure stays in its own world:
    closing it destroys every group the case made (see `_close_world`).
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    global _SOCKETS_BEFORE_WORLD
    _SOCKETS_BEFORE_WORLD = _open_sockets()
    import torch

    dist.init_process_group(
        config.backend,
        store=PrefixStore(f"case{serial}", store),
        rank=config.rank,
        world_size=config.world_size,
        timeout=timeout,
        # NCCL binds its communicator to the rank's GPU instead of guessing it
        device_id=torch.device(_device_for(config)) if config.backend == "nccl" else None,
    )


def _close_world(failed: bool, store_port: int) -> None:
    """Destroy the case's default group and every subgroup it made.

    After a failure on this rank, its peers may still wait in a collective or a receive with it. NCCL aborts its
    communicators; gloo has no abort that reaches a peer (`ProcessGroupGloo.abort` leaves the sockets open, and a
    pending receive of the failed case keeps them alive), so the sockets the case opened are shut down: every
    peer waiting on this rank fails at once with a read error instead of waiting for the collective timeout.
    """
    import gc

    import torch.distributed as dist

    from difftest.contracts.registry import reset_world_state

    if failed and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        _shut_down_sockets(_open_sockets() - _SOCKETS_BEFORE_WORLD, store_port)
    if dist.is_initialized():
        destroy_process_group()
    reset_world_state()
    gc.collect()  # what is not frozen: the cached model, the case's garbage, the imports since the last freeze


_SOCKETS_BEFORE_WORLD: set[int] = set()


def _open_sockets() -> set[int]:
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: a stuck peer then waits for the parent's grace period and its group is replaced
        return set()
    sockets = set()
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sockets.add(int(fd))
        except OSError:
            pass
    return sockets


def _shut_down_sockets(fds: set[int], store_port: int) -> None:
    import socket

    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as duplicate:
                if duplicate.family not in (socket.AF_INET, socket.AF_INET6):
                    continue  # gloo's pairs are TCP; local sockets (a fork server's) are not the case's to cut
                # a listening socket's owner (gloo's listener thread) aborts the process when accept fails
                if duplicate.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                # the store outlives the case: a group's rendezvous clones its connection, and a peer that moved on
                # already holds a clone for the next case's world, served by rank 0
                ends = (duplicate.getsockname(), duplicate.getpeername())
                if any(isinstance(end, tuple) and end[1] == store_port for end in ends):
                    continue
                duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _cached_model(model_dir: str, loader: Any) -> Any:
    # cases are streamed model by model, so one cached model saves re-reading it for every setting
    if model_dir not in _CACHED_MODELS:
        import gc

        _CACHED_MODELS.clear()
        gc.collect()  # the model let go, and the garbage of the cases since the last freeze
        gc.freeze()  # what survived is no model: imports, the libraries' caches
        _CACHED_MODELS[model_dir] = loader(Path(model_dir))
    return _CACHED_MODELS[model_dir]
