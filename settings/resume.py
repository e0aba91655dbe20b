"""DETrain's second promise: training k steps, checkpointing, and resuming in new processes equals training
without the interruption.

`resume/<before>/<after>/k<k>` trains k of the program's steps (settings/_resumable.py) under placement
`before` in fresh processes, saves model, optimizer (momentum), LR schedule, RNG states and the loader's
position with `torch.distributed.checkpoint`, tears the process group down, and resumes under placement
`after` in new processes (a different world size or sharding: DCP reshards on load). `/fast-forward`
restores model and optimizer only and replays the loader from the seed instead (DETrain's fast-forward
mode). Every one is judged against `resume/single/uninterrupted` — bitwise when both phases are a single
process, to the allclose tolerance when either is distributed; `resume/<placement>/uninterrupted` separates
what the placement changes from what the resume does.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from difftest.errors import Unsupported
from difftest.oracle import Tolerance
from difftest.registry import register_settings
from difftest.setting import Outputs, RunContext, Setting
from settings._resumable import CARRIED, TOTAL_STEPS, Phase, Placement, run_in_new_processes, run_phase
from settings.determinism import BITWISE

RESUME_REFERENCE = "resume/single/uninterrupted"


@dataclass(frozen=True)
class Uninterrupted(Setting):
    """The resumable program's TOTAL_STEPS steps in one go, in the sweep's warm worker group."""

    placement: Placement
    family: ClassVar[str] = "resume"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "at_step"})
    deterministic: ClassVar[bool] = True
    reference: ClassVar[str] = RESUME_REFERENCE

    @property
    def name(self) -> str:
        return f"resume/{self.placement.label}/uninterrupted"

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.placement.world_size

    def describe(self) -> str:
        return (f"{TOTAL_STEPS} steps of SGD+momentum, step LR, shuffling loader, {self.placement.label}, "
                "no interruption" + (" (the resume reference)" if self.name == RESUME_REFERENCE else ""))

    @property
    def collectives(self) -> frozenset[str]:
        return self.placement.collectives

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return run_phase(ctx, model, inputs, Phase(self.placement, 0, TOTAL_STEPS), None)


@dataclass(frozen=True)
class Resume(Setting):
    """k steps under one placement, a DCP checkpoint, new processes, the rest under another placement."""

    before: Placement
    after: Placement
    at_step: int = 3
    mode: str = "restore"  # or "fast-forward"
    family: ClassVar[str] = "resume"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "at_step"})
    tier_axes: ClassVar[tuple[str, ...]] = ("before", "after", "mode")
    world_size: int = 1  # the sweep's process only launches the two phases' own process groups
    reference: ClassVar[str] = RESUME_REFERENCE

    @property
    def name(self) -> str:
        suffix = "/fast-forward" if self.mode == "fast-forward" else ""
        return f"resume/{self.before.label}/{self.after.label}/k{self.at_step}{suffix}"

    def describe(self) -> str:
        how = "model+optimizer restored, loader replayed" if self.mode == "fast-forward" else "full state restored"
        return f"{self.at_step} steps on {self.before.label}, checkpoint, resume on {self.after.label} ({how})"

    @property
    def carried(self) -> frozenset[str]:
        """What the checkpoint carries across the restart (a planted fault leaves something out)."""
        return CARRIED

    def tolerance(self, default: Tolerance) -> Tolerance:
        single = self.before.strategy == self.after.strategy == "single"
        return BITWISE if single else default

    @property
    def collectives(self) -> frozenset[str]:  # the phases' own process groups
        return self.before.collectives | self.after.collectives

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if model.model_dir is None:
            raise Unsupported("the model has no folder for new processes to load it from")
        workdir = Path(tempfile.mkdtemp(prefix="difftest-resume-"))  # private (0700), removed below
        checkpoint = workdir / "checkpoint"
        try:
            first = run_in_new_processes(ctx, model.model_dir, Phase(self.before, 0, self.at_step, save=True),
                                         checkpoint, workdir)
            second = run_in_new_processes(
                ctx, model.model_dir,
                Phase(self.after, self.at_step, TOTAL_STEPS, load=self.mode, carried=self.carried), checkpoint, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        ctx.notes["resume"] = f"DCP checkpoint after step {self.at_step}: {self.before.label} -> {self.after.label}"
        return {**first, **second}


# each resume case starts two fresh process groups (~10 s on 2 cores): a few that cover the promises
SINGLE, DDP2, FSDP2, FSDP4 = Placement("single"), Placement("ddp", 2), Placement("fsdp2", 2), Placement("fsdp2", 4)

register_settings(
    [Uninterrupted(p) for p in (SINGLE, DDP2, FSDP2)]
    + [
        Resume(SINGLE, SINGLE, 3),
        Resume(SINGLE, SINGLE, 3, "fast-forward"),
        Resume(DDP2, DDP2, 3),
        Resume(FSDP2, FSDP4, 3),  # DCP reshards 2 -> 4
        Resume(DDP2, FSDP2, 3),  # replicated -> sharded
    ]
)
