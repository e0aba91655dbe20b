"""Where the installed torch lacks an API a setting calls: the older way of doing the same thing, or `Unsupported`
with the release that has it. Detected by the API itself, never by a version string (a nightly or a local build
carries whatever it carries). A setting that errors because difftest called an API its torch does not have would be
reported as that library's bug; these keep such errors out of the findings (difftest/releases/releases.toml lists the
releases difftest supports)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from difftest import Unsupported


def fully_shard_for(device: str) -> Callable[..., Any]:
    """FSDP2's `fully_shard`, where it can run on `device`: on the CPU it records events on `torch.cpu.Stream`,
    which has `record_event` from torch 2.7 on (2.6 raises "'Stream' object has no attribute 'record_event'")."""
    import torch
    from torch.distributed.fsdp import fully_shard

    if device.split(":")[0] == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):
        raise Unsupported(f"FSDP2 on the CPU needs torch >= 2.7 (torch {torch.__version__}'s CPU stream has no "
                          "record_event, which fully_shard calls); it runs on CUDA (difftest: --device cuda)")
    return fully_shard


class PipelineSchedule:
    """A `torch.distributed.pipelining` schedule called as each release documents it: with `scale_grads` where the
    release has it (2.7 on); before, without, and the gradients stay summed over the micro-batches as that release
    computes them (PR #144352 made their mean the default: the manifest's `pipelining-grads-summed-over-microbatches`).
    `eval` where the release has it (2.9 on); before, a rank of one stage evaluates through GPipe, the only schedule
    that ran forward alone, and a forward pass does not depend on the micro-batches' order."""

    def __init__(self, schedule_class: type, stage_arg: Any, microbatches: int, loss_fn: Callable[..., Any],
                 scale_grads: bool = True) -> None:
        self.stages = stage_arg if isinstance(stage_arg, list) else [stage_arg]
        self._stage_arg, self._microbatches = stage_arg, microbatches
        options = {"scale_grads": scale_grads} if "scale_grads" in inspect.signature(schedule_class.__init__).parameters \
            else {}
        try:
            self.schedule = schedule_class(stage_arg, microbatches, loss_fn=loss_fn, **options)
        except ValueError as exc:  # the schedule's own check of its micro-batch count (DualPipeV: ≥ stages)
            if "microbatch" not in str(exc).lower():
                raise
            raise Unsupported(f"{schedule_class.__name__} refuses this layout: {exc}") from exc

    def step(self, *args: Any, target: Any, losses: list[Any]) -> Any:
        return self.schedule.step(*args, target=target, losses=losses)

    def eval(self, *args: Any, target: Any) -> Any:
        if hasattr(self.schedule, "eval"):
            return self.schedule.eval(*args, target=target)
        import torch
        from torch.distributed.pipelining.schedules import ScheduleGPipe

        if len(self.stages) > 1:
            raise Unsupported(f"evaluating through a schedule of several stages per rank needs torch >= 2.9 "
                              f"(PipelineSchedule.eval); torch {torch.__version__} has none")
        forward = ScheduleGPipe(self._stage_arg, self._microbatches)  # marks the stage forward-only: given back below
        try:
            with torch.no_grad():
                return forward.step(*args)
        finally:
            for stage in self.stages:
                stage.has_backward = True
            # GPipe re-made the stage's receive buffers without requires_grad: the training schedule makes them
            # again, for backward, at its next step (the flag of these frozen releases, 2.6 to 2.8)
            self.schedule._stage_initialized = False
