"""DynPipe's promise: moving layers between pipeline stages in the middle of training changes nothing.

`repartition/<schedule>/ws<W>/mb<M>/moved` trains TOTAL_STEPS steps of SGD with momentum on the model's
layer chain split over W pipeline ranks: MOVE_AFTER steps on the balanced split P1, then every rank hands
its units' parameters and momentum buffers over (keyed by unit index and parameter name, the names every
partition shares), the stages are rebuilt on split P2 (one stage boundary moved by one unit) and loaded
strictly, and training continues. Oracles:
- across the move, the set of parameter names is unchanged and every parameter and momentum buffer is
  bitwise equal before and after (checked on every rank; a break is `inconsistent` with the names);
- the run equals `.../uninterrupted` (the same pipeline, never moved) to tolerance — not bitwise: a unit
  that changes stage reads its input from a received (contiguous) buffer instead of its neighbour's output,
  and kernels may round differently on another layout (1F1B on a DLRM model: 7.5e-9 after a move);
- the uninterrupted pipeline equals single-process gradient accumulation with momentum to tolerance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    POINT_TO_POINT,
    ConversionFailed,
    InvariantViolated,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    gather_to_rank0,
    record_training,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    variant_of,
)
from generators.inputs import Batch
from settings._compat import PipelineSchedule
from settings._pipeline_stages import chain_examples, pipeline_script
from settings.pipeline import SCHEDULES, Accumulation, balanced_split

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

TOTAL_STEPS = 4
MOVE_AFTER = 2
MOMENTUM = 0.9


def moved_split(starts: list[int], units: int) -> list[int]:
    """P2: the first stage boundary that can move by one unit (later, else earlier) without emptying a stage."""
    bounds = [*starts, units]
    for i in range(1, len(starts)):
        for shift in (1, -1):
            candidate = starts[i] + shift
            if bounds[i - 1] < candidate < bounds[i + 1]:
                return [*starts[:i], candidate, *starts[i + 1:]]
    raise Unsupported(f"{units} layer units over {len(starts)} stages leave no boundary to move")


class _Stages:
    """This rank's pipeline stage of one split, its schedule and its optimizer."""

    def __init__(self, ctx: RunContext, model: Any, chain: Any, inputs: Any, schedule: str, microbatches: int,
                 starts: list[int]) -> None:
        import torch
        from torch.distributed import pipelining

        from difftest import ChainStage

        stages = ctx.world_size
        self.bounds = [*starts, len(chain.units)]
        self.units = list(range(self.bounds[ctx.rank], self.bounds[ctx.rank + 1]))
        self.module = ChainStage([chain.units[u] for u in self.units])
        examples = chain_examples(chain, inputs.train, microbatches, self.bounds)[ctx.rank]
        device = torch.device(ctx.device)
        stage = pipelining.PipelineStage(self.module, ctx.rank, stages, device, input_args=examples[0],
                                         output_args=examples[1], group=ctx.group)

        def loss_fn(output: Any, target: Any) -> Any:
            return model.loss(output, Batch(labels=target.detach().cpu().numpy()))

        self.schedule = PipelineSchedule(getattr(pipelining.schedules, SCHEDULES[schedule][0]), stage, microbatches,
                                         loss_fn)
        self.parameters = {f"{u}.{n}": p for u in self.units for n, p in chain.units[u].named_parameters()
                           if p.requires_grad}
        self.optimizer = torch.optim.SGD(list(self.parameters.values()), lr=ctx.lr, momentum=MOMENTUM) \
            if self.parameters else None
        self.holds_last = ctx.rank == stages - 1

    def state(self) -> dict[str, Any]:
        """Parameters and momentum buffers under partition-independent names, cloned."""
        state = {f"param/{k}": p.detach().clone() for k, p in self.parameters.items()}
        if self.optimizer is not None:
            for k, p in self.parameters.items():
                buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buffer is not None:
                    state[f"momentum/{k}"] = buffer.detach().clone()
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Strict: every parameter of this stage must be in `state` (a planted fault loosens this)."""
        import torch

        missing = [k for k in self.parameters if f"param/{k}" not in state]
        if missing:
            raise InvariantViolated(f"the moved state lacks {missing}")
        with torch.no_grad():
            for k, p in self.parameters.items():
                p.copy_(state[f"param/{k}"])
                if f"momentum/{k}" in state and self.optimizer is not None:
                    self.optimizer.state[p]["momentum_buffer"] = state[f"momentum/{k}"].clone()


@dataclass(frozen=True)
class Repartition(Setting):
    """torch.distributed.pipelining over a layer chain, SGD with momentum; `moved`: re-split mid-training."""

    schedule: str
    world_size: int
    microbatches: int
    moved: bool = True
    family: ClassVar[str] = "repartition"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "microbatches"})
    tier_axes: ClassVar[tuple[str, ...]] = ("schedule",)
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return f"repartition/{self.schedule}/ws{self.world_size}/mb{self.microbatches}/" + \
            ("moved" if self.moved else "uninterrupted")

    @property
    def reference(self) -> str:  # type: ignore[override]
        if self.moved:
            return variant_of(Repartition, self, moved=False).name
        return Accumulation(self.microbatches, momentum=MOMENTUM, steps=TOTAL_STEPS).name

    def describe(self) -> str:
        what = f"re-split after step {MOVE_AFTER}" if self.moved else "never re-split"
        return f"{SCHEDULES[self.schedule][0]} over {self.world_size} stages, {self.microbatches} micro-batches, {what}"

    def judges(self, tensor_name: str) -> bool:
        return "/pooled." not in tensor_name

    def load_moved(self, stages: _Stages, state: dict[str, Any]) -> None:
        stages.load(state)

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, POINT_TO_POINT)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, Repartition, "load_moved")
        if "InvariantViolated" in case.failure:
            raise Unsupported("it fails difftest's own check of the move (every parameter and momentum buffer "
                              "unchanged across it), which the script does not make")

        def layout(chain: Any) -> dict[str, Any]:  # the splits and the move as `run` makes them
            first = self.first_split(chain)
            moved = {"move_after": MOVE_AFTER, "moved_starts": moved_split(first, len(chain.units))} if self.moved else {}
            return {"schedule_class": SCHEDULES[self.schedule][0], "stages": self.world_size, "starts": first,
                    "per_rank": 1, "placement": "loop", "microbatches": self.microbatches, "momentum": MOMENTUM,
                    **moved}

        moved = (f", every parameter and momentum buffer handed over after step {MOVE_AFTER} to the stages cut anew "
                 "(one boundary moved by one layer)") if self.moved else ""
        return pipeline_script(case, self.describe(), layout, self.world_size, f"SGD with momentum {MOMENTUM}", moved,
                               steps=TOTAL_STEPS if case.failure else None)

    def first_split(self, chain: Any) -> list[int]:
        """P1: the balanced split of the chain, which needs a unit per stage, and one more to move."""
        if len(chain.units) < self.world_size + (1 if self.moved else 0):
            raise Unsupported(f"{len(chain.units)} layer units for {self.world_size} stages and a move")
        return balanced_split(chain.parameter_counts(), self.world_size)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        import torch.distributed as dist

        try:
            chain = model.chain(ctx.device)
        except ConversionFailed as exc:
            raise Unsupported(f"no layer chain: {exc}") from None
        first = self.first_split(chain)
        current = _Stages(ctx, model, chain, inputs, self.schedule, self.microbatches, first)
        ctx.notes["stage starts"] = str(first)
        steps_done = 0

        def everyone(state: dict[str, Any]) -> dict[str, Any]:
            gathered: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(gathered, state, group=ctx.group)
            return {k: v for piece in gathered for k, v in piece.items()}

        def move() -> None:
            nonlocal current, chain
            before = everyone(current.state())
            second = moved_split(first, len(chain.units))
            chain = model.chain(ctx.device)  # the stages are rebuilt from scratch, then loaded
            current = _Stages(ctx, model, chain, inputs, self.schedule, self.microbatches, second)
            self.load_moved(current, before)
            after = everyone(current.state())
            lost, gained = sorted(set(before) - set(after)), sorted(set(after) - set(before))
            changed = sorted(k for k in before.keys() & after.keys() if not torch.equal(before[k], after[k]))
            if lost or gained or changed:
                raise InvariantViolated(f"moving {first} -> {second}: lost {lost[:5]}, gained {gained[:5]}, "
                                        f"changed {changed[:5]}")
            ctx.notes["stage starts"] = f"{first} -> {second} after step {MOVE_AFTER}"

        def run_schedule(batch: Batch, train: bool) -> tuple[Any, list[Any]]:
            chain.feed(batch)
            positions = torch.arange(batch.size, device=torch.device(ctx.device))
            target = torch.from_numpy(batch.labels).to(ctx.device)
            losses: list[Any] = []
            output = current.schedule.step(positions, target=target, losses=losses) if train else \
                current.schedule.eval(positions, target=target)
            return output, losses

        def evaluate(batch: Batch) -> dict | None:
            output, _ = run_schedule(batch, train=False)
            return {chain.output_name: output} if current.holds_last else None

        def train_step(batch: Batch) -> float | None:
            nonlocal steps_done
            if self.moved and steps_done == MOVE_AFTER:
                move()
            if current.optimizer is not None:
                current.optimizer.zero_grad()
            _, losses = run_schedule(batch, train=True)
            if current.optimizer is not None:
                current.optimizer.step()
            steps_done += 1
            return float(torch.stack([l.detach() for l in losses]).mean()) if current.holds_last else None

        def full_parameters() -> dict | None:
            local = {k: to_numpy(v) for k, v in chain.parameters_of([current.module]).items()}
            pieces = gather_to_rank0(ctx, local)
            return None if pieces is None else {k: v for piece in pieces for k, v in piece.items()}

        ctx = dataclasses.replace(ctx, steps=TOTAL_STEPS)
        return record_training(ctx, inputs, evaluate, train_step, full_parameters, data_shard=(0, 1))


REPARTITIONS = [Repartition(schedule, ws, mb, moved) for schedule, ws, mb in
                (("gpipe", 2, 2), ("1f1b", 2, 4), ("gpipe", 3, 3)) for moved in (False, True)]
register_settings(REPARTITIONS + sorted({Accumulation(s.microbatches, momentum=MOMENTUM, steps=TOTAL_STEPS)
                                         for s in REPARTITIONS}, key=lambda s: s.name))
