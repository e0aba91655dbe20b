"""PipeDream's asynchronous 1F1B pipeline with weight stashing, written here (no mainstream library has it),
and an exact single-process simulator of the staleness it promises.

Every micro-batch is PipeDream's minibatch: each stage updates its weights (plain SGD on the micro-batch's
mean loss) as soon as that micro-batch's backward pass is done. Stage s of S runs min(S-1-s, M) forwards,
then alternates one forward and one backward, then drains; the pipeline drains at the end of every
training step. A forward runs on a snapshot of the weights it uses, pushed on the stage's stash queue with
its version; the backward of that micro-batch pops it, recomputes the forward on the stashed weights and
its saved inputs, and applies the gradient to the live weights. Modes:
- `stash`: a forward uses the live weights: stage s's updates are computed on weights S-1-s updates old;
- `vertical-sync`: every stage uses the version stage 0 used (max(0, m-(S-1)) updates into the step);
- `flush`: one version per step, gradients accumulated and applied once — synchronous, judged against
  `accumulate/mb<M>`.
Oracles: each micro-batch's forward and backward on a stage see the same weight version (checked on every
rank; a break is `inconsistent`); the distributed run equals `async-pipeline/simulator/...`, which computes
micro-batch m at stage s directly on version `max(0, m-(S-1-s))` (or the vertical/flush rule) with no
schedule, queue or messages at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
    register_settings,
    to_numpy,
    variant_of,
)
from generators.inputs import Batch
from settings._pipedream import _run, _StashedStage, forward_version, one_f_one_b
from settings._pipeline_stages import _microbatches, chain_examples
from settings.pipeline import balanced_split

MODES = ("stash", "vertical-sync", "flush")


@dataclass(frozen=True)
class AsyncPipeline(Setting):
    """PipeDream 1F1B over gloo/nccl p2p with per-stage weight versions; `simulate`: the staleness formula."""

    mode: str
    world_size: int
    microbatches: int
    simulate: bool = False
    stages_simulated: int = 0
    family: ClassVar[str] = "async-pipeline"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "microbatches", "stages_simulated"})
    tier_axes: ClassVar[tuple[str, ...]] = ("mode",)
    deterministic: ClassVar[bool] = True

    @property
    def stages(self) -> int:
        return self.stages_simulated if self.simulate else self.world_size

    @property
    def judge_only(self) -> bool:
        return self.simulate

    @property
    def name(self) -> str:
        prefix = "async-pipeline/simulator" if self.simulate else "async-pipeline"
        return f"{prefix}/{self.mode}/stages{self.stages}/mb{self.microbatches}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        if self.mode == "flush":
            return f"accumulate/mb{self.microbatches}"
        if self.simulate:
            return self.name
        return variant_of(AsyncPipeline, self, simulate=True, world_size=1, stages_simulated=self.world_size).name

    def describe(self) -> str:
        how = "simulated from the staleness rule in one process" if self.simulate else "over p2p"
        return f"PipeDream 1F1B, {self.mode}, {self.stages} stages, {self.microbatches} micro-batches, {how}"

    def judges(self, tensor_name: str) -> bool:
        return "/pooled." not in tensor_name

    def stash_capacity(self, stage: int) -> int:
        """Micro-batches in flight on `stage` (a planted fault makes the queue one short)."""
        return min(self.stages - stage, self.microbatches)

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, POINT_TO_POINT)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from difftest import ChainStage

        try:
            chain = model.chain(ctx.device)
        except ConversionFailed as exc:
            raise Unsupported(f"no layer chain: {exc}") from None
        if len(chain.units) < self.stages:
            raise Unsupported(f"{len(chain.units)} layer units for {self.stages} stages")
        bounds = [*balanced_split(chain.parameter_counts(), self.stages), len(chain.units)]
        ctx.notes["stage starts"] = str(bounds[:-1])
        modules = [ChainStage(chain.units[bounds[s]:bounds[s + 1]]) for s in range(self.stages)]
        run_step = self._simulated_step if self.simulate else self._distributed_step
        state: dict[str, Any] = {"updates": 0}
        if not self.simulate:
            s = ctx.rank
            state["stage"] = _StashedStage(modules[s], ctx.lr, self.mode, self.stash_capacity(s))
            state["examples"] = chain_examples(chain, inputs.train, self.microbatches, bounds)[s]

        def train_step(batch: Batch) -> float | None:
            return run_step(ctx, model, chain, modules, batch, state)

        def full_parameters() -> dict | None:
            own = modules if self.simulate else [modules[ctx.rank]]
            pieces = gather_to_rank0(ctx, {k: to_numpy(v) for k, v in chain.parameters_of(own).items()})
            return None if pieces is None else {k: v for piece in pieces for k, v in piece.items()}

        def evaluate(batch: Batch) -> dict | None:
            import torch

            full = full_parameters()  # every stage's live weights, into rank 0's copy of the whole chain
            if ctx.rank != 0:
                return None
            assert full is not None
            with torch.no_grad():
                for name, view in chain.canonical().items():
                    view.copy_(torch.from_numpy(full[name]))
                chain.feed(batch)
                return {chain.output_name: ChainStage(chain.units)(torch.arange(batch.size))}

        outputs = record_training(ctx, inputs, evaluate, train_step, full_parameters, data_shard=(0, 1))
        if not self.simulate:
            found = gather_to_rank0(ctx, state["stage"].violations)
            import torch.distributed as dist

            everyone = [None]
            if ctx.rank == 0:
                everyone = [[f"stage {s}: {v}" for s, vs in enumerate(found or []) for v in vs]]
            dist.broadcast_object_list(everyone, src=0, group=ctx.group)
            if everyone[0]:
                raise InvariantViolated("; ".join(everyone[0][:4]))
        return outputs

    def _distributed_step(self, ctx: RunContext, model: Any, chain: Any, modules: list, batch: Batch,
                          state: dict) -> float | None:
        import torch
        import torch.distributed as dist

        s, last = ctx.rank, self.stages - 1
        stage: _StashedStage = state["stage"]
        examples_in, examples_out = state["examples"]
        micros = _microbatches(batch, self.microbatches)
        sends: list[Any] = []
        losses: list[float] = []
        scale = 1.0 / self.microbatches if self.mode == "flush" else 1.0

        def receive(templates: tuple, source: int, tag: int) -> tuple:
            received = []
            for t in templates:
                buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # contiguous, whatever t's strides
                dist.recv(buffer, src=source, group=ctx.group, tag=tag)
                received.append(buffer.requires_grad_(t.requires_grad))
            return tuple(received)

        def send(tensors: tuple, target: int, tag: int) -> None:
            for t in tensors:
                sends.append(dist.isend(t.detach().contiguous(), dst=target, group=ctx.group, tag=tag))

        def feed(micro: int) -> tuple:
            chain.feed(micros[micro])
            return (torch.arange(micros[micro].size, device=torch.device(ctx.device)),)

        for op, m in one_f_one_b(s, self.stages, self.microbatches):
            if op == "F":
                args = feed(m) if s == 0 else receive(examples_in, s - 1, 2 * m)
                version = forward_version(self.mode, state["updates"], m, s, self.stages)
                stage.forward_versions[m] = version
                out = stage.forward(m, version, args)
                if s < last:
                    send(out, s + 1, 2 * m)
            else:
                if s == 0:
                    feed(m)  # the recomputed forward reads the micro-batch again
                grads_in = None if s == last else receive(
                    tuple(t for t in examples_out if t.requires_grad), s + 1, 2 * m + 1)
                if grads_in is not None:  # one per output that requires grad; expand to all outputs
                    it = iter(grads_in)
                    grads_in = tuple(next(it) if t.requires_grad else None for t in examples_out)
                labels = micros[m]
                grads_out, loss = stage.backward(m, lambda out: model.loss(out, labels), grads_in, scale)
                if s == last:
                    losses.append(float(loss))
                if s > 0:
                    send(grads_out, s - 1, 2 * m + 1)
        for handle in sends:
            handle.wait()
        state["updates"] += 1 if self.mode == "flush" else self.microbatches
        stage.end_step(oldest_needed=state["updates"])  # drained: the next step starts on the newest version
        stage.forward_versions.clear()
        return sum(losses) / len(losses) if s == last else None

    def _simulated_step(self, ctx: RunContext, model: Any, chain: Any, modules: list, batch: Batch,
                        state: dict) -> float:
        import torch

        if "versions" not in state:
            state["versions"] = [[{n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}]
                                 for m in modules]
        versions: list[list[dict]] = state["versions"]
        start = state["updates"]
        micros = _microbatches(batch, self.microbatches)
        accumulated: list[dict] = [{} for _ in modules]
        losses = []
        for m, micro in enumerate(micros):
            chain.feed(micro)
            value: tuple = (torch.arange(micro.size),)
            leaves = []
            for s, module in enumerate(modules):
                used = versions[s][forward_version(self.mode, start, m, s, self.stages)]
                weights = {n: w.detach().requires_grad_(True) for n, w in used.items()}
                leaves.append(weights)
                value = _run(module, weights, value)
            loss = model.loss(value[0], micro)
            (loss / self.microbatches if self.mode == "flush" else loss).backward()
            losses.append(loss.item())
            for s, weights in enumerate(leaves):
                grads = {n: (w.grad if w.grad is not None else torch.zeros_like(w)) for n, w in weights.items()}
                if self.mode == "flush":
                    for n, g in grads.items():
                        accumulated[s][n] = g.clone() if n not in accumulated[s] else accumulated[s][n].add_(g)
                else:
                    versions[s].append({n: versions[s][-1][n].clone().add_(g, alpha=-ctx.lr) for n, g in grads.items()})
        if self.mode == "flush":
            for s, grads in enumerate(accumulated):
                versions[s].append({n: versions[s][-1][n].clone().add_(grads[n], alpha=-ctx.lr) for n in versions[s][-1]})
        state["updates"] = len(versions[0]) - 1
        with torch.no_grad():  # the newest version into the modules, where parameters and eval read them
            for s, module in enumerate(modules):
                for n, p in module.named_parameters():
                    if n in versions[s][-1]:
                        p.copy_(versions[s][-1][n])
        return sum(losses) / len(losses)


def _family() -> list[Setting]:
    settings: list[Setting] = []
    for mode in MODES:
        for stages, mb in ((2, 4), (3, 6)):
            settings.append(AsyncPipeline(mode, stages, mb))
            settings.append(AsyncPipeline(mode, 1, mb, simulate=True, stages_simulated=stages))
    return settings


register_settings(_family())
