"""Pipeline parallelism with `torch.distributed.pipelining`: the model's layer chain (difftest/contracts/chain.py)
split into stages, trained on micro-batches under one of torch's schedules.

Split points come from a partitioner that balances trainable parameters over the stages (PipeDream balances
profiled time; parameters are this tool's deterministic stand-in) or are drawn at random from the case's
seed. The reference is `accumulate/mb<M>`: one process accumulating the gradients of the same micro-batches,
which is itself judged against full-batch `reference`. The hybrid family runs several such pipelines side
by side as data-parallel replicas, with DDP or FSDP2 inside each stage, on a 2-D (dp, pp) device mesh.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from difftest import (
    DATA_PARALLEL,
    POINT_TO_POINT,
    SHARDED,
    ConversionFailed,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    gather_to_rank0,
    record_training,
    refuse_changed_hooks,
    register_settings,
    register_world_reset,
)
from generators.inputs import Batch
from settings._pipeline_stages import (
    _microbatches,
    _stage_parameters,
    chain_examples,
    pipeline_groups,
    pipeline_schedule,
    pipeline_script,
    stages_of,
    wrap_stage,
)
from settings._training import build_for_training, canonical_parameters

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# schedule name -> (torch class name, stages per rank, stage placement)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped-bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv-zero-bubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


def uncovered_schedules() -> list[str]:
    """The schedule classes the installed torch exports that no entry of SCHEDULES runs: what a new release adds
    (tests/test_parallel.py requires none, so a new schedule is added here or said to be left out)."""
    import inspect

    from torch.distributed.pipelining import schedules

    covered = {class_name for class_name, _, _ in SCHEDULES.values()}
    exported = {name for name, cls in vars(schedules).items() if inspect.isclass(cls) and name.startswith("Schedule")
                and issubclass(cls, schedules._PipelineSchedule) and not inspect.isabstract(cls)}
    return sorted(exported - covered)


def balanced_split(counts: list[int], stages: int) -> list[int]:
    """Stage start indices (first is 0) of contiguous groups of units minimising the largest group's sum."""
    best: tuple[int, list[int]] | None = None
    for inner in itertools.combinations(range(1, len(counts)), stages - 1):
        starts = [0, *inner]
        largest = max(sum(counts[a:b]) for a, b in zip(starts, [*inner, len(counts)]))
        if best is None or largest < best[0]:
            best = (largest, starts)
    assert best is not None
    return best[1]


def random_split(units: int, stages: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [0, *sorted(int(i) for i in rng.choice(np.arange(1, units), size=stages - 1, replace=False))]


@dataclass(frozen=True)
class Accumulation(Setting):
    """One process, the global batch cut into micro-batches whose gradients are accumulated, then one step."""

    microbatches: int
    world_size: int = 1
    momentum: float = 0.0
    steps: int = 0  # 0: the run's steps
    family: ClassVar[str] = "accumulate"
    judged_families: ClassVar[tuple[str, ...]] = ("pipeline",)  # the schedules are judged against it
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "microbatches", "steps"})

    @property
    def name(self) -> str:
        extra = f"/momentum{self.momentum:g}/steps{self.steps}" if self.momentum or self.steps else ""
        return f"accumulate/mb{self.microbatches}{extra}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        # with its own optimizer and step count it is the reference of the settings built on it
        return self.name if self.momentum or self.steps else "reference"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import dataclasses

        import torch

        module = build_for_training(model, ctx.device)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr,
                                    momentum=self.momentum)

        def train_step(batch: Batch) -> float:
            optimizer.zero_grad()
            total = 0.0
            for micro in _microbatches(batch, self.microbatches):
                loss = model.loss(model.forward(module, micro, ctx.device), micro) / self.microbatches
                loss.backward()
                total += loss.item()
            optimizer.step()
            return total

        ctx = dataclasses.replace(ctx, steps=self.steps or ctx.steps)
        return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step,
                               lambda: canonical_parameters(model, module))


@dataclass(frozen=True)
class Pipeline(Setting):
    """torch.distributed.pipelining: PipelineStage per stage, one schedule, plain SGD."""

    schedule: str
    world_size: int
    microbatches: int
    split: str = "balanced"  # or "random"
    data_parallel: int = 1  # pipelines side by side (hybrid); the world is data_parallel x pipeline ranks
    inner: str = ""  # hybrid only: "ddp" or "fsdp2" around each stage
    accumulate: int = 1  # schedule steps whose gradients one optimizer step takes (gradient accumulation)
    # torchtitan's way: the schedule's scale_grads off, the loss divided by micro-batches × accumulated steps instead
    loss_scaled: bool = False
    family: ClassVar[str] = "pipeline"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "microbatches", "steps"})
    tier_axes: ClassVar[tuple[str, ...]] = ("schedule", "split", "inner")

    @property
    def name(self) -> str:
        stages = self.pipeline_ranks * SCHEDULES[self.schedule][1]
        shape = f"ws{self.world_size}" if self.data_parallel == 1 else \
            f"dp{self.data_parallel}x{self.inner}/pp{self.pipeline_ranks}"
        prefix = "pipeline" if self.data_parallel == 1 else "hybrid"
        accumulate = (f"/accumulate{self.accumulate}{'/loss-scaled' if self.loss_scaled else ''}"
                      if self.accumulate > 1 else "")
        return f"{prefix}/{self.schedule}/{shape}/stages{stages}/mb{self.microbatches}/{self.split}{accumulate}"

    def __post_init__(self) -> None:
        if self.loss_scaled and self.accumulate == 1:  # the name says neither: it would pass for the plain pipeline
            raise ValueError(f"{type(self).__name__}: loss_scaled needs accumulate > 1")

    @property
    def pipeline_ranks(self) -> int:
        return self.world_size // self.data_parallel

    def available(self) -> str | None:
        import torch
        from torch.distributed.pipelining import schedules

        class_name = SCHEDULES[self.schedule][0]
        if not hasattr(schedules, class_name):  # DualPipeV from 2.8, say
            return f"torch {torch.__version__} has no {class_name} (torch.distributed.pipelining.schedules)"
        return None

    @property
    def reference(self) -> str:  # type: ignore[override]
        return f"accumulate/mb{self.accumulated_microbatches}"

    @property
    def accumulated_microbatches(self) -> int:
        """The micro-batches one optimizer step takes: every pipeline's, over every accumulated schedule step."""
        return self.microbatches * self.data_parallel * self.accumulate

    def describe(self) -> str:
        replicas = f", {self.data_parallel} replicas with {self.inner} in each stage" if self.data_parallel > 1 else ""
        accumulate = (f", the gradients of {self.accumulate} schedule steps accumulated before each optimizer step "
                      f"(the loss divided by {self.loss_divisor}{', scale_grads off' if self.loss_scaled else ''})"
                      if self.accumulate > 1 else "")
        return (f"{SCHEDULES[self.schedule][0]} over {self.pipeline_ranks} ranks, {self.microbatches} "
                f"micro-batches, {self.split} split{replicas}{accumulate}")

    def judges(self, tensor_name: str) -> bool:
        return "/pooled." not in tensor_name  # a pipeline returns the prediction, not the embedding stage's outputs

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, POINT_TO_POINT | (DATA_PARALLEL | SHARDED if self.data_parallel > 1 else frozenset()))

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return self.trained(ctx, model, inputs)

    def trained(self, ctx: RunContext, model: Any, inputs: Any,
                before_step: Callable[[dict[int, Any], Any], None] | None = None,
                prepare_stages: Callable[[dict[int, Any]], None] | None = None) -> Outputs | None:
        """The model cut into stages and trained under the schedule as this setting does; `before_step(stages,
        pp_group)` runs on each rank between each step's schedule and its optimizer step, with the rank's own stage
        modules and the group of its pipeline (a composing setting's gradient clipping); `prepare_stages(stages)`
        changes the rank's stage modules in place before the schedule is built (a composing setting's activation
        checkpointing)."""
        import torch

        try:
            chain = model.chain(ctx.device)
        except ConversionFailed as exc:
            raise Unsupported(f"no layer chain: {exc}") from None
        layout = self.layout(chain, ctx.seed)
        ctx.notes["stage starts"] = str(layout["starts"])
        pp = self.pipeline_ranks
        groups = _groups(ctx, self.data_parallel, pp)
        dp_index, pp_rank = ctx.rank // pp, ctx.rank % pp
        mine = stages_of(pp_rank, pp, layout)
        from difftest import ChainStage

        bounds = [*layout["starts"], len(chain.units)]
        modules = {s: ChainStage(chain.units[bounds[s]:bounds[s + 1]]) for s in mine}
        examples = chain_examples(chain, inputs.train.shard(dp_index, self.data_parallel),
                                  self.microbatches * self.accumulate, bounds)
        if prepare_stages is not None:
            prepare_stages(modules)
        # read before wrapping: afterwards canonical() all-gathers FSDP2's shards, a collective only rank 0 would join
        canonical_names = set(chain.canonical())
        wrapped = {s: wrap_stage(m, self.inner, groups, ctx.device) for s, m in modules.items()}
        device = torch.device(ctx.device)

        def loss_fn(output: Any, target: Any) -> Any:  # divided as gradient accumulation divides it
            return model.loss(output, Batch(labels=target.detach().cpu().numpy())) / self.loss_divisor

        schedule = pipeline_schedule(wrapped, layout, groups["pp"], ctx.device, examples, loss_fn,
                                     self.scale_grads and not self.loss_scaled)
        holds_last = layout["stages"] - 1 in mine
        trainable = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=ctx.lr) if trainable else None

        def run_schedule(batch: Batch, train: bool) -> Any:
            chain.feed(batch)
            positions = torch.arange(batch.size, device=device)
            target = torch.from_numpy(batch.labels).to(device)
            losses: list[Any] = []
            if train:
                output = schedule.step(positions, target=target, losses=losses)
            else:
                output = schedule.eval(positions, target=target)
            return output, losses

        def evaluate(batch: Batch) -> dict | None:  # in the training's micro-batches, the shapes the stages expect
            outputs = [run_schedule(batch.shard(chunk, self.accumulate), train=False)[0]
                       for chunk in range(self.accumulate)]
            return {chain.output_name: torch.cat(outputs)} if holds_last else None

        def train_step(batch: Batch) -> float | None:
            if optimizer is not None:
                optimizer.zero_grad()
            losses = [loss for chunk in range(self.accumulate)  # each schedule step on its share of the batch
                      for loss in run_schedule(batch.shard(chunk, self.accumulate), train=True)[1]]
            self.after_backward(ctx, modules)
            if before_step is not None:
                before_step(modules, groups["pp"])
            if optimizer is not None:
                optimizer.step()
            return float(torch.stack([l.detach() for l in losses]).mean() * self.loss_divisor) if holds_last else None

        def full_parameters() -> dict | None:
            local = _stage_parameters(chain, modules, wrapped, self.inner)
            pieces = gather_to_rank0(ctx, local if dp_index == 0 else {})
            if pieces is None:
                return None
            merged = {k: v for piece in pieces for k, v in piece.items()}
            missing = canonical_names - set(merged)
            if missing:
                raise RuntimeError(f"no stage holds {sorted(missing)}")
            return merged

        return record_training(ctx, inputs, evaluate if self.evaluates else None, train_step, full_parameters,
                               data_shard=(dp_index, self.data_parallel))

    def layout(self, chain: Any, seed: int) -> dict[str, Any]:
        """How the chain is cut and placed: the schedule's class, the stages, where each starts (balanced, or drawn
        from the run's seed), how many a rank holds and where (`stages_of`), the micro-batches."""
        class_name, per_rank, placement = SCHEDULES[self.schedule]
        stages = self.pipeline_ranks * per_rank
        if len(chain.units) < stages:
            raise Unsupported(f"{len(chain.units)} layer units (cuts at layer boundaries) for {stages} stages")
        if self.split == "balanced":
            starts = balanced_split(chain.parameter_counts(), stages)
        else:
            starts = random_split(len(chain.units), stages, zlib.crc32(f"{seed}/{self.name}".encode()))
        return {"schedule_class": class_name, "stages": stages, "starts": starts, "per_rank": per_rank,
                "placement": placement, "microbatches": self.microbatches,
                **({} if self.evaluates else {"evaluates": False}),
                **({"data_parallel": self.data_parallel, "inner": self.inner} if self.data_parallel > 1 else {}),
                **({"accumulate": self.accumulate, "loss_divisor": self.loss_divisor,
                    "scale_grads": not self.loss_scaled} if self.accumulate > 1 else {})}

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, Pipeline, "after_backward", "trained")
        if type(self).scale_grads is not Pipeline.scale_grads:
            raise Unsupported("a changed scale_grads has no emitter")
        return pipeline_script(case, self.describe(), lambda chain: self.layout(chain, case.seed),
                               self.world_size, "plain SGD", self.replicas())

    @property
    def loss_divisor(self) -> int:
        """What each micro-batch's loss is divided by: the accumulated steps, and the micro-batches where the schedule
        does not divide the gradients by them itself."""
        return self.accumulate * (self.microbatches if self.loss_scaled else 1)

    def replicas(self) -> str:
        """A hybrid's pipelines, as its script's summary says them."""
        return f", each of {self.data_parallel} pipelines on its share of the batch" if self.data_parallel > 1 else ""

    # whether the schedule's eval() runs before and after training (`PipelineTrainedOnly`: not)
    evaluates: ClassVar[bool] = True
    # hooks for planted faults
    scale_grads: ClassVar[bool] = True

    def after_backward(self, ctx: RunContext, modules: dict[int, Any]) -> None:
        pass


@dataclass(frozen=True)
class PipelineTrainedOnly(Pipeline):
    """A schedule trained without its eval(): on torch 2.12-2.14 ScheduleZBVZeroBubble.eval() and
    ScheduleDualPipeV.eval() raise before any step (known issue `pipelining-zbv-eval`), which left every training
    bug of the V schedules' split backward behind that error. Judged on the losses and the parameters after each
    step; the evaluating settings keep reporting the eval() failure."""

    evaluates: ClassVar[bool] = False
    tier_axes: ClassVar[tuple[str, ...]] = ("schedule", "inner")

    @property
    def name(self) -> str:
        return f"{super().name}/train-only"

    def describe(self) -> str:
        return f"{super().describe()}, trained without evaluating"

    def judges(self, tensor_name: str) -> bool:
        return super().judges(tensor_name) and not tensor_name.startswith("eval_")


@dataclass(frozen=True)
class PipelineAccumulation(Pipeline):
    """Gradient accumulation under a schedule: `accumulate` schedule steps, each on its share of the batch with the
    loss divided by `accumulate`, before each optimizer step, the schedule's `scale_grads` left at its default
    (on); or, `loss_scaled`, as torchtitan accumulates: `scale_grads` off and the loss divided by the micro-batches
    too. Judged against one process accumulating the same micro-batches; in the full tier."""

    in_default_tier: ClassVar[bool] = False


_GROUPS: dict[tuple[int, int], dict[str, Any]] = {}
register_world_reset(_GROUPS.clear)  # the groups die with the case's world


def _groups(ctx: RunContext, dp: int, pp: int) -> dict[str, Any]:
    """`pipeline_groups` of this rank, made once per case and shape, since every rank must create every subgroup in
    the same order."""
    if dp == 1:
        return {"pp": ctx.group, "dp": None}
    if (dp, pp) not in _GROUPS:
        _GROUPS[(dp, pp)] = pipeline_groups(ctx.device, dp, pp)
    return _GROUPS[(dp, pp)]


def microbatch_counts(schedule: str, pipeline_ranks: int) -> tuple[int, int]:
    stages = pipeline_ranks * SCHEDULES[schedule][1]  # DualPipeV refuses fewer micro-batches than stages (documented)
    return (stages, 2 * stages) if schedule == "dualpipev" else (pipeline_ranks, 2 * pipeline_ranks)


def _pipeline_settings(kind: type[Pipeline] = Pipeline, schedules: tuple[str, ...] = tuple(SCHEDULES)) -> list[Setting]:
    return [kind(schedule, ws, mb, split) for schedule in schedules for ws in (2, 3, 4)
            for mb in microbatch_counts(schedule, ws) for split in ("balanced", "random")]


# the V schedules, whose eval() raises on the releases that have them, trained without it
V_SCHEDULES = ("zbv-zero-bubble", "dualpipev")
HYBRID = [Pipeline(schedule, 4, mb, "balanced", data_parallel=2, inner=inner)
          for inner in ("ddp", "fsdp2") for schedule in ("gpipe", "1f1b", "interleaved-1f1b") for mb in (2, 4)]
# split input/weight backward inside DDP or FSDP2 replicas of each stage
HYBRID += [PipelineTrainedOnly(schedule, 4, mb, "balanced", data_parallel=2, inner=inner)
           for inner in ("ddp", "fsdp2") for schedule in V_SCHEDULES for mb in microbatch_counts(schedule, 2)]
HYBRID += [Pipeline("interleaved-zero-bubble", 4, mb, "balanced", data_parallel=2, inner=inner)
           for inner in ("ddp", "fsdp2") for mb in microbatch_counts("interleaved-zero-bubble", 2)]
# gradient accumulation over two schedule steps, alone and in the hybrid
ACCUMULATING = [PipelineAccumulation(schedule, 2, 2, "balanced", accumulate=2, loss_scaled=scaled)
                for schedule in ("gpipe", "1f1b", "interleaved-1f1b") for scaled in (False, True)]
ACCUMULATING += [PipelineAccumulation("1f1b", 4, 2, "balanced", data_parallel=2, inner=inner, accumulate=2,
                                      loss_scaled=scaled) for inner in ("ddp", "fsdp2") for scaled in (False, True)]
PIPELINES = _pipeline_settings() + _pipeline_settings(PipelineTrainedOnly, V_SCHEDULES) + HYBRID + ACCUMULATING
register_settings([Accumulation(mb) for mb in sorted({s.accumulated_microbatches for s in PIPELINES})])
register_settings(PIPELINES)
