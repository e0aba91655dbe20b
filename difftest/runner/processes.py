"""Processes a setting starts of its own, when the sweep's warm ranks will not do: a checkpoint resumed in fresh
interpreters (`settings/_resumable.py`), TensorFlow restarted with no state of the run that saved it.

`run_in_processes(entry, request, n, workdir, tag)` calls `entry(request, rank)` in `n` new processes and returns
what rank 0's entry returned. The runner does what every such process needs and a setting should not know: the
processes fork from the import server (torch, the plugins and the libraries they name already imported: seconds
per process on a small machine), load the plugins this process loaded, write their output to a log each, keep their
temporary files in `workdir`, and leave their process group cleanly. The first process to fail stops the rest (its
peers would wait for it in a collective), and its exception reaches the caller as an object: `Unsupported` stays
`Unsupported`, anything else is a `ProcessesFailed` that quotes the failing process's last log lines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from difftest.contracts.errors import Unsupported
from difftest.contracts.logs import log_tail

Outputs = dict[str, np.ndarray]
Entry = Callable[[Mapping[str, Any], int], Outputs | None]


class ProcessesFailed(RuntimeError):
    """A process started by `run_in_processes` raised (anything but `Unsupported`) or was killed."""


def run_in_processes(entry: Entry, request: Mapping[str, Any], processes: int, workdir: Path, tag: str,
                     timeout_s: float = 600.0, device: str = "cpu") -> Outputs:
    """`entry(request, rank)` in `processes` new processes (`entry` a module-level function, `request` plain JSON);
    rank 0's returned tensors come back (saved as .npz, read without pickle). Raises `Unsupported` where a process
    refused, `ProcessesFailed` where one failed otherwise, or did not finish within `timeout_s`. `device`: where the
    processes compute; off the CPU they are spawned, as a worker group's ranks are there (`pool.rank_start`): the
    import server's imports may have touched CUDA (torchrec's and fbgemm's can), and a process forked from one that
    did cannot use it."""
    from difftest.contracts.registry import loaded_plugins
    from difftest.runner.pool import import_server, rank_start

    workdir.mkdir(parents=True, exist_ok=True)
    result, request_path = workdir / f"outputs-{tag}.npz", workdir / f"request-{tag}.json"
    # the new processes load what this one did: a plugin's generator kind, or a patch a benchmark injects
    request_path.write_text(json.dumps({"entry": [entry.__module__, entry.__qualname__], "result": str(result),
                                        "plugins": list(loaded_plugins()), "request": dict(request)}))
    logs = [workdir / f"rank{r}-{tag}.log" for r in range(processes)]
    failures = [workdir / f"failure-rank{r}-{tag}.json" for r in range(processes)]
    context = import_server() if device == "cpu" else rank_start(device)
    running = [context.Process(target=_started, args=(str(request_path), r, str(logs[r]), str(failures[r])),
                               daemon=True) for r in range(processes)]
    for process in running:
        process.start()
    deadline, first_failed = time.monotonic() + timeout_s, None
    try:
        # until all are done, one has failed (the failure reported is the first one's), or the deadline
        while time.monotonic() < deadline and any(p.is_alive() for p in running):
            first_failed = next((r for r, p in enumerate(running) if p.exitcode not in (None, 0)), None)
            if first_failed is not None:
                break
            time.sleep(0.02)
    finally:
        for process in running:
            if process.is_alive():
                process.kill()
                process.join()
    codes = [p.exitcode for p in running]
    failed = [first_failed] if first_failed is not None else [r for r, code in enumerate(codes) if code != 0]
    if failed:
        rank = failed[0]
        raised = json.loads(failures[rank].read_text()) if failures[rank].is_file() else None
        if raised and raised["refused"]:
            raise Unsupported(raised["message"])
        # what the process raised first (as a case run in the worker would say it: the manifest's messages match
        # it), then where its log ends (the frames under the exception's words)
        what = [f"{raised['type']}: {raised['message'].strip().splitlines()[0] if raised['message'].strip() else ''}"
                ] if raised else []
        raise ProcessesFailed(f"phase {tag} rank {rank} exited {codes[rank]}: " + " | ".join(what + log_tail(logs[rank], 5)))
    with np.load(result, allow_pickle=False) as stored:
        return {k: stored[k] for k in stored.files}


def _started(request_path: str, rank: int, log_path: str, failure_path: str) -> None:
    """A started process: set up, `entry(request, rank)`, its exception recorded as an object, then out cleanly."""
    import gc
    import importlib
    import os
    import sys
    import traceback

    from difftest.contracts.registry import load_plugins
    from difftest.contracts.script_runtime import gloo_on_loopback
    from difftest.runner.worker import redirect_output, use_temporary_folder

    use_temporary_folder(os.path.dirname(request_path))  # the case's folder, removed after it
    redirect_output(log_path, append=False)
    os.environ["OMP_NUM_THREADS"] = "1"
    gloo_on_loopback()
    started = json.loads(Path(request_path).read_text())
    load_plugins(started["plugins"])
    module, name = started["entry"]
    failed = False
    try:
        outputs = getattr(importlib.import_module(module), name)(started["request"], rank)
        if rank == 0:
            np.savez(started["result"], **(outputs or {}))
    except BaseException as exc:
        failed = True
        Path(failure_path).write_text(json.dumps({"type": type(exc).__name__, "message": str(exc),
                                                  "refused": isinstance(exc, Unsupported)}))
        traceback.print_exc()
    # 3 of 100 distributed resume cases of a 20-model sweep aborted ("terminate called without an active exception",
    # exit -6) when gloo's work was freed during interpreter finalization (pytorch#179291 reports the same): what the
    # entry held (DDP and FSDP state, cycles included) is freed while Python lives, then the group is left
    outputs = None
    gc.collect()
    _leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(1 if failed else 0)


def _leave_process_group() -> None:
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    from difftest.runner.worker import destroy_process_group

    if dist.is_available() and dist.is_initialized():
        destroy_process_group()
