"""Warm worker groups (one per world size) that stream cases, with a watchdog per case."""

from difftest.runner.executor import SweepOptions
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import CaseResult, WorkerGroup
from difftest.runner.sweep import run_sweep

__all__ = ["CaseRequest", "CaseResult", "SweepOptions", "WorkerGroup", "run_sweep"]
