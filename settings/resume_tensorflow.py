"""DETrain's resume on the TensorFlow side: `tf.train.Checkpoint` of model, optimizer, step and the tf.data
iterator itself.

The program (Keras models only): SGD with momentum 0.9 and a staircase learning rate halved every 2 steps,
fed by a tf.data pipeline that reshuffles the training samples every epoch (seeded) and serves half of them
per step. `tf-resume/k3` trains 3 of 5 steps where `tf-resume/uninterrupted` trains all 5 (in the sweep's worker),
saves, and resumes in a fresh process, which knows only the checkpoint; it must equal `tf-resume/uninterrupted`
bitwise (TF runs with op determinism). Only the resume needs a new process: a first phase in one too would cost the
case a second TensorFlow import (seconds) and prove nothing more.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from difftest import Outputs, RunContext, Setting, Tolerance, register_settings, run_in_processes, traits_of
from generators import _tf
from settings._resumable_tf import TOTAL_STEPS, phase_main, run_phase
from settings.determinism import BITWISE

TF_RESUME_REFERENCE = "tf-resume/uninterrupted"


class _KerasOnly:
    def supports(self, spec: Any) -> str | None:
        return None if "keras" in traits_of(spec.kind) else f"TensorFlow settings run Keras models; kind {spec.kind!r} is PyTorch-only"

    def available(self) -> str | None:
        return _tf.missing()


@dataclass(frozen=True)
class TfUninterrupted(_KerasOnly, Setting):
    """The TF program's 5 steps in one go (the TF resume reference)."""

    world_size: int = 1
    family: ClassVar[str] = "tf-resume"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "at_step"})
    framework: ClassVar[str] = "tensorflow"
    reference: ClassVar[str] = TF_RESUME_REFERENCE

    @property
    def name(self) -> str:
        return TF_RESUME_REFERENCE

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return run_phase(model, inputs, ctx.seed, ctx.lr, 0, TOTAL_STEPS, None, False)


@dataclass(frozen=True)
class TfResume(_KerasOnly, Setting):
    """k steps, tf.train.Checkpoint (model, optimizer, iterator), the rest in a new process."""

    at_step: int = 3
    world_size: int = 1
    family: ClassVar[str] = "tf-resume"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "at_step"})
    framework: ClassVar[str] = "tensorflow"
    reference: ClassVar[str] = TF_RESUME_REFERENCE

    @property
    def name(self) -> str:
        return f"tf-resume/k{self.at_step}"

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BITWISE

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        workdir = Path(tempfile.mkdtemp(prefix="difftest-tf-resume-"))
        request = {"model_dir": str(model.model_dir), "checkpoint": str(workdir / "checkpoint"), "seed": ctx.seed,
                   "lr": ctx.lr}
        try:
            first = run_phase(model, inputs, ctx.seed, ctx.lr, 0, self.at_step, workdir / "checkpoint", save=True)
            second = run_in_processes(phase_main, {**request, "first": self.at_step, "last": TOTAL_STEPS}, 1,
                                      workdir, "second")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return {**first, **second}


register_settings([TfUninterrupted(), TfResume()])
