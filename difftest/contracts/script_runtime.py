"""The part of every `findings/<id>/standalone.py` that no family changes: start the ranks, judge, report, exit.

Its functions are copied verbatim into each script (`difftest.scripts.emit`), so this module imports only the standard
library, numpy and torch: a script must run where difftest is not installed. A script defines beside them
`single_process(data, case, dtype)` (the reference: the program in one process, in `dtype`) and
`on_rank(rank, world_size, data, case)` (the setting: every rank runs it, rank 0 returns the full tensors), and the
constants `CASE`, `WORLD_SIZE`, `LIBRARIES`, `THE_CASE`, and either `TENSORS`, `SPREAD`, `K`, `ATOL`, `RTOL` (a disagreement),
`TENSORS` alone (a nondeterminism: the setting run twice, compared with itself) or `FAILURE`: for a finding that is a
failure (an exception, a rank killed by a signal), a regex of how the setting fails, and the script shows the bug by
the setting failing that way rather than by its tensors. A setting that runs in several groups of processes one after
another (a resume's phases) defines its own `run_distributed(data)`, which replaces this one and starts each group with
`start_ranks`.
"""

# ruff: noqa: F821 -- pyflakes does not count a bare annotation as a definition; the script gives each a value

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

# what each script defines before these functions (declared here so that this module checks on its own)
WORLD_SIZE: int
TENSORS: tuple[str, ...]
SPREAD: dict[str, float]
K: float
ATOL: float
RTOL: float
LIBRARIES: tuple[str, ...]
THE_CASE: str  # in one line: the setting, the model, its size, the processes
RANK_IMPORTS: tuple[str, ...]
CASE: dict[str, Any]
FAILURE: str
single_process: Callable[[dict[str, np.ndarray], dict[str, Any], Any], dict[str, np.ndarray]]
on_rank: Callable[[int, int, dict[str, np.ndarray], dict[str, Any]], dict[str, np.ndarray] | None]

# copied in this order, less those the script never calls: a failure's script starts at `main_failing`, a
# disagreement's at `main`, a nondeterminism's at `main_twice`
RUNTIME_FUNCTIONS = ("gloo_on_loopback", "rank_main", "run_distributed", "start_ranks", "judge", "load_data",
                     "main_failing", "main", "main_twice")


def gloo_on_loopback() -> None:
    """Gloo binds to the host name's address unless told otherwise: ranks on one machine meet on its loopback."""
    # the user's own choice stays; without an interface list or a loopback in it, gloo's own choice
    with contextlib.suppress(AttributeError, OSError, StopIteration):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", next(n for _, n in socket.if_nameindex() if n in ("lo", "lo0")))


def rank_main(rank: int, world_size: int, folder: str, data: dict[str, np.ndarray], result: str, case: Any) -> None:
    """One rank: a gloo process group that meets through a file in `folder` (no port to race for), the setting,
    rank 0's tensors to `result`."""
    import torch.distributed as dist

    local = case.get("local_world_size", world_size)  # ranks per (simulated) host, as torchrun would say
    os.environ.update(LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local))
    gloo_on_loopback()
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        if (outputs := on_rank(rank, world_size, data, case)) is not None:
            np.savez(result, **outputs)  # type: ignore[arg-type]
        dist.barrier()  # leave together: a rank torn down while a peer still talks to it aborts
    except BaseException:  # every rank's error is reported, not only the one torch.multiprocessing notices first
        Path(folder, f"rank{rank}.error").write_text(traceback.format_exc())
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    # the rank's work is done: out without the interpreter's teardown (gloo aborts in it about 1 run in 20) and without
    # destroy_process_group, which on torch 2.6 now and then never returned after the barrier (pytorch#75097)
    os._exit(0)


def run_distributed(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return start_ranks(data, CASE, WORLD_SIZE)  # the setting, on WORLD_SIZE ranks


def start_ranks(data: dict[str, np.ndarray], case: dict[str, Any], world_size: int) -> dict[str, np.ndarray]:
    """`on_rank` on `world_size` processes forked from this one before it has computed anything, after it has imported
    what they import (so each starts in a fraction of a second); torch.multiprocessing ends them all when one fails."""
    import importlib

    import torch.multiprocessing as mp

    for name in RANK_IMPORTS:  # imported once here, not once per rank (TorchRec: seconds each on a small machine)
        with contextlib.suppress(ImportError):  # a release without it: the code that imports it says what it does then
            importlib.import_module(name)

    with tempfile.TemporaryDirectory() as folder:
        result, tempfile.tempdir = str(Path(folder) / "rank0.npz"), folder  # torch leaves failed ranks' files there
        try:
            mp.start_processes(rank_main, args=(world_size, folder, data, result, case), nprocs=world_size,  # type: ignore[attr-defined,no-untyped-call]
                               start_method="fork" if sys.platform == "linux" else "spawn")
        except Exception as exc:  # it may be a peer's lost connection, the rank that failed first having exited
            raise RuntimeError("\n".join([str(exc), *(p.read_text() for p in Path(folder).glob("rank*.error"))])) from exc
        finally:
            tempfile.tempdir = None  # the default again
        # none where the ranks returned none: a failure's reduced script keeps only what ran before the failure
        return dict(np.load(result)) if Path(result).exists() else {}


def judge(name: str, x: np.ndarray, s: np.ndarray, c: np.ndarray) -> tuple[bool, str]:
    """Whether the setting's `x` is further from the float64 result `c` than float32 rounding explains (K times
    SPREAD[name] plus its own rounding); a tensor without a SPREAD, by allclose with the float32 one `s`."""
    if x.shape != s.shape:
        return True, f"{name}: the setting gives shape {x.shape}, not {s.shape}"
    x, s, c = x.astype(np.float64), s.astype(np.float64), c.astype(np.float64)
    if name in SPREAD:
        d, allowed = np.abs(x - c), K * (SPREAD[name] + 2.0**-24 * np.abs(c))
        bad = ~((d <= allowed) | (x == c) | (np.isnan(x) & np.isnan(c)))  # an infinity is its own value, so is NaN
        rule = f"{np.divide(d, allowed, out=np.zeros_like(d), where=d > 0).max(initial=0.0):.3g}x what rounding explains"
    else:
        bad = ~np.isclose(x, s, atol=ATOL, rtol=RTOL, equal_nan=True)
        rule = f"beyond allclose(atol={ATOL}, rtol={RTOL})"
    worst = np.unravel_index(int(np.argmax(np.nan_to_num(np.abs(x - s), nan=np.inf))), x.shape) if x.size else ()
    return bool(bad.any()), (f"{name}: {int(bad.sum())} of {x.size} elements off, {rule}; at {tuple(map(int, worst))}"
                             f" single process {float(s[worst])!r}, setting {float(x[worst])!r}, float64 {float(c[worst])!r}")


def load_data() -> dict[str, np.ndarray]:
    """The case's tensors (the .npz beside the script), once the installed release of every library involved is shown."""
    found = [f"python {sys.version.split()[0]}"]
    for name in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):  # fbgemm-gpu is one of fbgemm-gpu and fbgemm-gpu-cpu
            found.append(f"{name} {metadata.version(name)}")
    print(", ".join(found))
    print(f"case: {THE_CASE}")
    return dict(np.load(Path(__file__).resolve().parent / "standalone.npz"))  # the reduced and the full script's


def main_failing() -> int:
    """A failure finding: exit 1 while the setting fails as FAILURE says, how its ranks raise (their traceback) or
    the signal that ends one."""
    try:
        run_distributed(load_data())
    except Exception as exc:
        if (found := re.search(FAILURE, failure := f"{type(exc).__name__}: {exc}")) is None:
            print(f"COULD NOT RUN the setting, not as this script shows: {failure}")
            return 2
        print(failure[failure.rfind("\n", 0, found.start()) + 1:].split("\n")[0])  # the line that shows it
        print("BUG PRESENT: the setting fails as it did when difftest found it")
        return 1
    print("ok: the setting runs through (the failure is gone)")
    return 0


def main() -> int:
    """A disagreement: exit 1 while a tensor of the setting is further from the single-process program's than
    rounding explains."""
    import torch

    data = load_data()
    SPREAD.update({name[len("spread."):]: float(v) for name, v in data.items() if name.startswith("spread.")})
    try:  # first: its ranks fork from this process, which must not have started torch's threads yet
        actual, present = run_distributed(data), False
        if not actual:  # its ranks returned no tensors to judge
            raise RuntimeError("rank 0 returned no tensors")
    except Exception as exc:  # the setting could not run at all: not the bug this script shows
        print(f"COULD NOT RUN the setting: {type(exc).__name__}: {exc}")
        return 2
    exact, single = single_process(data, CASE, torch.float64), single_process(data, CASE, torch.float32)
    for name in TENSORS:
        wrong, line = judge(name, actual.get(name, np.zeros(0)), single[name], exact[name])
        present |= wrong
        print(line)
    print("BUG PRESENT: the setting disagrees with the single-process program" if present else
          "ok: the setting agrees with the single-process program (the bug is gone)")
    return 1 if present else 0


def main_twice() -> int:
    """A nondeterminism: exit 1 while two runs of the setting, deterministic algorithms on, differ at all (zero
    tolerance, as difftest judges a rerun: NaN equals NaN, -0.0 equals 0.0)."""
    data = load_data()
    try:  # deterministic algorithms on, in this process and every rank: the script sets them where it starts
        first, second = run_distributed(data), run_distributed(data)
    except Exception as exc:
        print(f"COULD NOT RUN the setting: {type(exc).__name__}: {exc}")
        return 2
    present = False
    for name in TENSORS:
        if name not in first or name not in second:  # the setting gave less than it gave difftest: not this bug
            print(f"COULD NOT RUN the setting as difftest did: {name} is missing from a run's tensors")
            return 2
        a, b = first[name], second[name]
        if a.shape != b.shape:
            differ, line = True, f"shape {a.shape} in the first run, {b.shape} in the second"
        elif differ := bool((bad := ~np.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)).any()):
            at = np.unravel_index(int(np.argmax(bad)), a.shape)
            line = (f"{int(bad.sum())} of {a.size} elements differ; at {tuple(map(int, at))} first run "
                    f"{float(a[at])!r}, second {float(b[at])!r}")
        else:
            line = "the same in both runs"
        print(f"{name}: {line}")
        present |= differ
    print("BUG PRESENT: two runs of the setting differ" if present else
          "ok: two runs of the setting agree exactly (the bug is gone)")
    return 1 if present else 0
