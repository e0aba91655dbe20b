from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from difftest.generate import generate
from difftest.spec import RunConfig

PLANTED = "tests.faults.planted"
# what a sweep adds per model to judge settings whose root is `reference` with the calibrated oracle
# (difftest.envelope): calib-{float64,order,threads,microbatch}/reference
REFERENCE_CALIBRATIONS = 4


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
