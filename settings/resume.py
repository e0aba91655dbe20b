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
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import Outputs, RunContext, Setting, Tolerance, Unsupported, refuse_changed_hooks, register_settings
from settings._resumable import CARRIED, TOTAL_STEPS, Phase, Placement, run_in_new_processes, run_phase
from settings.determinism import BITWISE

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

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

    @property
    def phases(self) -> tuple[Phase, ...]:
        return (Phase(self.placement, 0, TOTAL_STEPS),)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return run_phase(ctx, model, inputs, self.phases[0], None)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, Uninterrupted, "phases")
        return resume_script(case, f"The resumable program under {self.placement.label}, never interrupted",
                             self.phases)


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

    @property
    def phases(self) -> tuple[Phase, ...]:
        """k steps saving a checkpoint, then the rest loading it, each in new processes."""
        return (Phase(self.before, 0, self.at_step, save=True),
                Phase(self.after, self.at_step, TOTAL_STEPS, load=self.mode, carried=self.carried))

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, Resume, "carried", "phases")
        how = ("model, optimizer and LR schedule restored, the loader replayed from the seed" if self.mode ==
               "fast-forward" else "model, optimizer, LR schedule, RNG states and loader position restored")
        return resume_script(case, f"{self.at_step} steps under {self.before.label}, a torch.distributed.checkpoint, "
                             f"new processes resuming under {self.after.label} ({how})", self.phases)

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
            first, second = (run_in_new_processes(ctx, model.model_dir, phase, checkpoint, workdir)
                             for phase in self.phases)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        ctx.notes["resume"] = f"DCP checkpoint after step {self.at_step}: {self.before.label} -> {self.after.label}"
        return {**first, **second}


def resume_script(case: StandaloneCase, described: str, phases: tuple[Phase, ...]) -> Script:
    """The script of the resumable program in `phases` (settings/_resume_script.py): the steps the case took to diverge
    (a failure: all of them), each phase in a new group of processes, against the program uninterrupted in one
    process; it compares the parameters after those steps."""
    from difftest import LoadedModel, Script, to_numpy
    from settings import _resumable as program
    from settings._resume_script import on_rank, run_distributed, single_process, train_phase
    from settings._training import full_parameters
    from settings._training_script import parameters_after, trained_parameters
    from settings.fsdp import distribute_functions

    model, diverged_at, tensors = trained_parameters(case)
    steps = TOTAL_STEPS if case.failure else diverged_at
    sharded = any(p.placement.strategy == "fsdp2" for p in phases)
    loaded = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
    ran = [{"strategy": p.placement.strategy, "world_size": p.placement.world_size, "first": p.first_step,
            "last": min(p.last_step, steps), "load": p.load, "save": p.save and p.last_step < steps}
           for p in phases if p.first_step < steps]
    resumed = f", the checkpoint after step {ran[0]['last']}" if len(ran) > 1 else \
        f" (it diverges at step {steps}, before the interruption)" if len(phases) > 1 else ""
    return Script(
        summary=f"{described}: {steps} step(s) of SGD with momentum {program.MOMENTUM} and a step LR schedule (lr "
                f"{case.lr:g}, halved every {program.LR_HALVING_EVERY}), a loader reshuffling every epoch from torch's "
                f"RNG, each CPU rank (gloo) on its share of the batch{resumed}"
                + case.against("the same program uninterrupted in one process: the parameters after the steps")
                + f". {model.summary}",
        libraries=("torch", *model.libraries, "numpy"),
        preamble=(*model.preamble, "import random"),
        case={**model.case, "lr": case.lr, "steps": steps, "batch": case.inputs["train"].size, "seed": case.seed,
              "momentum": program.MOMENTUM, "lr_halving_every": program.LR_HALVING_EVERY,
              "carried": sorted(phases[-1].carried), "phases": ran,  # what the last phase loads
              "layout": program.sharded_layout(loaded, loaded.build("cpu")) if sharded else {}},
        functions=(*model.functions, *(distribute_functions() if sharded else ()),
                   full_parameters, to_numpy, parameters_after, program.EpochLoader, program.take_samples,
                   program.rng_state, program.set_rng_state, program.seed_everything, program.place,
                   program.checkpoint_state, program.load_checkpoint, train_phase, single_process, on_rank,
                   run_distributed),
        tensors=tensors, data=model.data, world_size=max(p["world_size"] for p in ran))


@dataclass(frozen=True)
class FullTierResume(Resume):
    """A resume whose promise the default tier's ones already hold in part (the same placement again, a world size
    that divides every dimension): a class of its own so that these run in the full tier."""

    in_default_tier: ClassVar[bool] = False


# each resume case starts two fresh process groups (2-5 s each on 2 cores): the default tier takes the fast-forward
# and the one that changes strategy and world size at once, onto shards of uneven size (3 ranks)
SINGLE, DDP2 = Placement("single"), Placement("ddp", 2)
FSDP2, FSDP3, FSDP4 = Placement("fsdp2", 2), Placement("fsdp2", 3), Placement("fsdp2", 4)

register_settings(
    [Uninterrupted(p) for p in (SINGLE, DDP2, FSDP2)]
    + [
        Resume(SINGLE, SINGLE, 3, "fast-forward"),
        Resume(DDP2, FSDP3, 3),  # replicated -> sharded unevenly over another world size
        FullTierResume(SINGLE, SINGLE, 3),
        FullTierResume(DDP2, DDP2, 3),
        FullTierResume(FSDP2, FSDP4, 3),  # DCP reshards 2 -> 4
        FullTierResume(DDP2, FSDP2, 3),  # replicated -> sharded
        FullTierResume(FSDP2, FSDP3, 3),  # evenly -> unevenly sharded
    ]
)
