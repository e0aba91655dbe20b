from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate

PLANTED = "tests.faults.planted"


def _reference_calibrations() -> int:
    from difftest.contracts.registry import calibrations_of, get_setting, load_plugins

    load_plugins()
    centre, runs = calibrations_of(get_setting("reference"), "fp32")
    return (centre is not None) + len(runs) - 1  # the root is one of its own runs


# what a sweep adds per model to judge settings whose root is `reference` with the calibrated oracle
# (difftest.judging.envelope): calib-{float64,order,threads,microbatch,fp32-a,fp32-b,fp32-c}/reference
REFERENCE_CALIBRATIONS = _reference_calibrations()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`heavy` tests first, so that pytest-xdist's workers end on short tests, not one waiting out another's minute;
    `needs_tf` tests skip, saying why, where the [tf] extra is not installed (DIFFTEST_EXTRAS=test)."""
    from generators import _tf

    items.sort(key=lambda item: "heavy" not in item.keywords)  # stable: every worker collects the same order
    missing = _tf.missing()
    if missing is None:
        return
    skip = pytest.mark.skip(reason=f"the TF stack {missing}")
    for item in items:
        if "needs_tf" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def generated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two generated DLRM models (one plain, one with a frozen parameter), never swept."""
    run_dir = tmp_path_factory.mktemp("generated") / "run"
    generate(run_dir, RunConfig(seed=0, models=2, plugins=(PLANTED,)))
    return run_dir


@pytest.fixture
def fresh_run(generated_run: Path, tmp_path: Path) -> Path:
    """A private copy of the generated run, so each test sweeps into an empty store."""
    target = tmp_path / "run"
    shutil.copytree(generated_run, target)
    return target


@pytest.fixture(scope="session")
def sequential_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six generated Keras sequential models (odd indices frozen), exported to ONNX, never swept."""
    run_dir = tmp_path_factory.mktemp("sequential") / "run"
    generate(run_dir, RunConfig(seed=0, models=6, kinds=("sequential",), plugins=(PLANTED,)))
    return run_dir


@pytest.fixture
def fresh_sequential_run(sequential_run: Path, tmp_path: Path) -> Path:
    """A private copy of the generated Keras run, so each test sweeps into an empty store."""
    target = tmp_path / "run"
    shutil.copytree(sequential_run, target)
    return target


def committed_cases(run_dir: Path) -> dict[tuple[str, str], float]:
    """(model, setting) → commit time of every case the run's store holds (read beside a live sweep)."""
    try:
        with sqlite3.connect(run_dir / "store.sqlite") as db:
            return {(m, s): t for m, s, t in db.execute("SELECT model, setting, finished_at FROM cases")}
    except sqlite3.OperationalError:
        return {}


def sigkill_sweep_after(command: list[str], run_dir: Path, commits: int, deadline_s: float = 600,
                        env: dict[str, str] | None = None, before_kill: Callable[[], None] | None = None) -> None:
    """Start a sweep command and kill -9 it once `commits` cases are committed (it must still be running);
    `before_kill` looks at what the running sweep has made."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + deadline_s
    while len(committed_cases(run_dir)) < commits and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert process.poll() is None, "the sweep finished before it could be killed"
    if before_kill is not None:
        before_kill()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
