"""Warm worker groups (one per world size) that stream cases, with a watchdog per case."""

from difftest.runner.pool import CaseRequest, CaseResult, WorkerGroup
from difftest.runner.sweep import SweepOptions, run_sweep

__all__ = ["CaseRequest", "CaseResult", "WorkerGroup", "SweepOptions", "run_sweep"]
