"""The engine's layout as plugins and old scripts see it: the public API, the modules' old names, and processes a
setting starts through the runner."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import difftest
from difftest import ProcessesFailed, Unsupported, run_in_processes

_OLD_NAMES = """
import importlib, json, sys, warnings
import difftest
said = {}
for old, new in difftest.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"difftest.{old}")
    said[old] = [module.__name__, [str(w.message) for w in caught if w.category is DeprecationWarning]]
print(json.dumps(said))
"""


def test_every_public_name_resolves_and_the_old_module_names_are_the_new_modules() -> None:
    for name in difftest.__all__:
        assert getattr(difftest, name) is not None, name
    # in a fresh interpreter: in this one a test may have imported an old name already (no second warning)
    done = subprocess.run([sys.executable, "-c", _OLD_NAMES], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1])
    said = json.loads(done.stdout)
    for old, new in difftest.MOVED.items():
        module, warned = said[old]
        if module == f"difftest.{old}":  # a folder now (campaign, releases): the package keeps the module's names
            assert getattr(importlib.import_module(module), "__getattr__", None) is not None, old
            continue
        assert module == f"difftest.{new}" and any(f"difftest.{old} moved to difftest.{new}" in w for w in warned), old
    releases = importlib.import_module("difftest.releases")
    assert releases.release_range is importlib.import_module("difftest.releases.environments").release_range


def _answers(request: Mapping[str, Any], rank: int) -> dict[str, np.ndarray] | None:
    if request["fail"] == "refuse" and rank == 1:
        raise Unsupported("rank 1 has no such layout")
    if request["fail"] == "raise" and rank == 1:
        # words, then more lines than a log's tail shows (Dynamo's "from user code" frames): the words must still show
        raise ValueError("the checkpoint is missing a shard\n" + "\n".join(f"  frame {i}" for i in range(8)))
    return {"rank": np.array([rank, request["value"]]), "parent": np.array(os.getppid())} if rank == 0 else None


def test_run_in_processes_returns_rank0s_tensors_and_carries_a_refusal_as_an_object(tmp_path: Path) -> None:
    outputs = run_in_processes(_answers, {"fail": "", "value": 7}, 2, tmp_path / "ok", "ok")
    assert outputs["rank"].tolist() == [0, 7]
    with pytest.raises(Unsupported, match="^rank 1 has no such layout$"):
        run_in_processes(_answers, {"fail": "refuse", "value": 0}, 2, tmp_path / "refused", "refused")
    with pytest.raises(ProcessesFailed, match=r"^phase raised rank 1 exited 1: ValueError: the checkpoint is missing a "
                                              r"shard \| .*frame 7"):
        run_in_processes(_answers, {"fail": "raise", "value": 0}, 2, tmp_path / "raised", "raised")


def test_processes_that_compute_on_a_gpu_are_spawned_not_forked_from_the_import_server(tmp_path: Path) -> None:
    """A process forked from a server whose imports touched CUDA cannot use it: off the CPU the caller starts the
    processes itself (spawned, its child), on the CPU the import server forks them (its children)."""
    on_cpu = run_in_processes(_answers, {"fail": "", "value": 1}, 1, tmp_path / "cpu", "cpu")
    on_gpu = run_in_processes(_answers, {"fail": "", "value": 2}, 1, tmp_path / "gpu", "gpu", device="cuda")
    assert on_gpu["rank"].tolist() == [0, 2] and int(on_gpu["parent"]) == os.getpid()
    assert int(on_cpu["parent"]) != os.getpid()


def test_a_failure_is_written_and_read_back_in_one_place() -> None:
    from difftest.contracts.failure import Failure
    from difftest.findings.signature import normalise_message

    try:
        raise ValueError("shard 3 of tensor at 0x7f00 is missing")
    except ValueError as exc:
        raised = Failure.of(exc)
    stored = raised.stored()
    assert stored.startswith("ValueError: shard 3 of tensor at 0x7f00 is missing || ") and "\n" not in stored
    assert Failure.parse(stored) == raised and Failure.parse(stored).readable().count("\n") >= 3
    crashed = Failure("rank 1 killed by SIGSEGV", log="Fatal Python error: Segmentation fault | frame")
    assert str(crashed) == "rank 1 killed by SIGSEGV; log: Fatal Python error: Segmentation fault | frame"
    assert Failure.parse(str(crashed)) == crashed
    # a signature is made of the head alone: the traceback and the log vary from run to run
    assert normalise_message(stored) == normalise_message("ValueError: shard 4 of tensor at 0x7f08 is missing")
    assert normalise_message(str(crashed)) == "rank N killed by SIGSEGV"


def _a_models_layer_calls(layer: object) -> None:
    import torch

    layer(torch.ones(2, 5))  # a Linear(3, 4): torch raises three frames deeper, in its own code


def test_a_failure_deep_in_torch_names_the_models_frame_that_reached_it() -> None:
    import torch

    from difftest.contracts.failure import Failure
    from difftest.findings.signature import innermost_library_frame

    try:
        _a_models_layer_calls(torch.nn.Linear(3, 4))
    except RuntimeError as exc:
        raised = Failure.of(exc)
    caller, code, elided, *last = raised.readable().split("\n\nTraceback, innermost frames last:\n")[1].split("\n")
    assert caller == f'File "{__file__}", line {_a_models_layer_calls.__code__.co_firstlineno + 3}, in ' \
                     "_a_models_layer_calls" and code.startswith("layer(torch.ones(2, 5))") and elided == "…"
    assert "torch/nn/modules/linear.py" in "\n".join(last) and last[-1].startswith("RuntimeError: ")
    assert innermost_library_frame(raised.stored()) == "torch/nn/modules/linear.py:forward"  # the signature's frame
    # the calling frame is evidence, never the signature's: a raise in the standard library under a library's call
    from_json = Failure("ValueError: bad", frames='File "/v/site-packages/torchrec/m.py", line 3, in f | decode(x) | … | '
                        'File "/usr/lib/python3.11/json/decoder.py", line 5, in g | raise | ValueError: bad')
    assert innermost_library_frame(from_json.stored()) == ""
    try:
        raise ValueError("raised here")
    except ValueError as exc:
        here = Failure.of(exc)
    assert here.frames.count('File "') == 1  # the innermost frame is the caller: said once


def test_a_cases_notes_are_written_and_read_back_by_key() -> None:
    from difftest.contracts.notes import parse_notes, render_notes

    notes = {"plan": "t0(tf0,tf1)=row_wise@[0,1] t1(wf2)=table_wise@[1]", "graph breaks": "0",
             "layers": "l1: ColwiseParallel, l2: RowwiseParallel(output Replicate())"}
    line = render_notes(notes)
    assert line == ("plan: t0(tf0,tf1)=row_wise@[0,1] t1(wf2)=table_wise@[1]; graph breaks: 0; "
                    "layers: l1: ColwiseParallel, l2: RowwiseParallel(output Replicate())")
    assert parse_notes(line) == notes and parse_notes("") == {}
