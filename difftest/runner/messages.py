"""What a sweep and its ranks say to each other over their pipes: one dataclass per message, never a positional
tuple. The sweep sends `RunCase` and `Stop`; a rank sends `StorePort` (rank 0, once), `Ready` (joined a fresh world),
`Broken` (could not) and `RankReply` (a case done); the sweep relays rank 0's `StorePort` to the others."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from difftest.contracts.status import Status


@dataclass(frozen=True)
class CaseRequest:
    model_dir: str
    setting: str
    steps: int
    lr: float
    seed: int


@dataclass(frozen=True)
class RunCase:
    request: CaseRequest


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class StorePort:
    port: int  # rank 0's store, on the loopback


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Broken:
    message: str  # why the rank could not open the next case's world


@dataclass(frozen=True)
class RankReply:
    """One rank's answer to a case."""

    status: Status
    outputs: dict[str, np.ndarray] | None  # rank 0's; None elsewhere
    message: str  # a failure as `Failure.stored()` writes it, or the case's notes
    compute_s: float  # the rank's time inside the setting
    failed_at: float | None  # when it failed (time.time()): the first failure is the cause
