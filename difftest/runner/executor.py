"""Where a sweep's cases run: the seam between planning (`difftest.runner.sweep`) and the processes that run them.

An executor receives the sweep's runnable cases, bucketed by (world size, process affinity), and reports each case's
result to the sweep through one callback; the sweep alone commits results to the store. Two executors exist: `local`
(warm worker groups on this machine, `difftest.runner.local`) and `ray` (the same groups inside gangs placed on a
Ray cluster, `difftest.runner.ray_executor`, behind the `[ray]` extra). Nothing above this seam knows which ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from difftest.contracts.errors import UserError

if TYPE_CHECKING:
    from difftest.contracts.setting import Setting
    from difftest.contracts.spec import ModelSpec, RunConfig
    from difftest.runner.pool import CaseResult

EXECUTORS = ("local", "ray")
BucketKey = tuple[int, str]  # (world size, process affinity): cases that may share warm rank processes


@dataclass(frozen=True)
class ExecutorConfig:
    kind: str = "local"  # local | ray
    address: str | None = None  # ray: a running cluster (`auto`, HOST:PORT); None starts a Ray instance here
    cpus_per_rank: float = 1.0  # ray: CPUs each rank's bundle reserves

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise UserError(f"--executor {self.kind!r}: use one of {', '.join(EXECUTORS)}")
        if self.address and self.kind != "ray":
            raise UserError(f"--address {self.address}: a cluster address needs --executor ray")


@dataclass(frozen=True)
class SweepOptions:
    settings: str | None = None  # comma-separated globs over setting names
    tier: str | None = None  # default | full; None: `default` without globs, `full` with them
    models: str | None = None  # comma-separated globs over model ids
    jobs: int | None = None  # worker groups running at once (local: as many as the cores hold ranks; ray: the cluster's)
    timeout_s: float = 120.0
    device: str = "cpu"
    backend: str | None = None  # default: gloo on cpu, nccl on cuda
    plugins: tuple[str, ...] = ()
    twice: bool = False  # add `rerun/<name>` of every selected setting (the determinism oracle)
    # a warm group is replaced after this many cases: libraries that keep what every case built (legacy FSDP's
    # FlatParameter cycles, pytorch#183211; ~0.4 MB a case here, ~0.26 MB for TorchRec DMP) cannot grow a rank forever
    recycle_after: int = 2000
    # exactly these (model id, setting name) cases and what they are judged against, instead of globs × globs
    pairs: tuple[tuple[str, str], ...] | None = None
    # of `pairs`, those whose verdict needs the calibrated oracle: only they bring calibration runs (None: all do)
    calibrated_pairs: tuple[tuple[str, str], ...] | None = None
    # of `pairs`, those judged against their references: only they bring reference runs (None: all do); a case that
    # only has to fail the way a finding failed needs none
    referenced_pairs: tuple[tuple[str, str], ...] | None = None
    executor: ExecutorConfig = ExecutorConfig()  # where the cases run: this machine, or a Ray cluster

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


@dataclass(frozen=True)
class Case:
    model_id: str
    model_dir: Path
    spec: ModelSpec
    setting: Setting


@dataclass(frozen=True)
class SweepContext:
    run_dir: Path
    config: RunConfig
    options: SweepOptions
    plugins: tuple[str, ...]


@dataclass
class ExecutorReport:
    groups_started: int = 0  # worker groups (local) or the groups inside gangs (ray)
    cases_rerun: int = 0  # cases started again elsewhere because their node (not the case) went away
    note: str = ""  # one line on where the cases ran


class Executor(Protocol):
    def run(self, sweep: SweepContext, work: dict[BucketKey, list[Case]],
            report: Callable[[Case, CaseResult], None]) -> ExecutorReport:
        """Run every case of `work` and `report` each one's result exactly once."""

