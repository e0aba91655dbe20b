"""SD-Pipe's partial reduce: data-parallel replicas that average their parameters with a few partners per
step and with everyone every `sync_every` steps, after each local SGD step on their share of the batch.

The partner schedule is seeded: at step t the ranks are permuted by `numpy.random.default_rng([seed, t])`
and cut into groups of `group` (the last may be smaller). A group average is the sum of the members'
flattened parameters in rank order over the group's size, computed by every member from an all-gather, so
it is the same arithmetic on every rank and in the simulator. A global sync is an all-reduce (SUM) / W.
Oracles:
- `partial-reduce/...` equals `partial-reduce/simulator/...`, the same schedule over W replicas in one
  process (every replica's parameters after every step, and their mean);
- every partial average preserves the mean of the replicas, and after every global sync the replicas are
  bitwise identical (both checked on every rank; a break is `inconsistent`);
- `.../hetero` (seeded sleeps before each reduce, ranks arriving at different times) equals the run without
  them bitwise;
- with everyone in one group every step (`group` = W), plain SGD equals DDP (`ddp/default/ws<W>`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from difftest import (
    InvariantViolated,
    Outputs,
    RunContext,
    Setting,
    Tolerance,
    Unsupported,
    across,
    gather_to_rank0,
    loss_record,
    register_settings,
    to_numpy,
    variant_of,
)
from settings._partial_reduce_replicas import (
    _assign,
    _flat,
    all_average,
    all_flat,
    average_partners,
    group_average,
    on_rank,
    partner_groups,
    replica_tensors,
    single_process,
    train_replicas,
)
from settings._training import build_for_training, canonical_parameters, sgd_step
from settings.determinism import BITWISE

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

TOTAL_STEPS = 4


@dataclass(frozen=True)
class PartialReduce(Setting):
    """Replicas with seeded partial averaging and periodic global syncs (SD-Pipe), plain SGD."""

    world_size: int
    group: int
    sync_every: int
    hetero: bool = False
    simulate: bool = False  # the single-process simulator of the same schedule
    simulated_replicas: int = 0  # the simulator's replicas (its world size is 1)
    family: ClassVar[str] = "partial-reduce"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "simulated_replicas"})
    tier_axes: ClassVar[tuple[str, ...]] = ("sync_every", "hetero")

    @property
    def replicas(self) -> int:
        return self.simulated_replicas if self.simulate else self.world_size

    @property
    def everyone(self) -> bool:
        return self.group >= self.replicas

    @property
    def judge_only(self) -> bool:
        return self.simulate

    @property
    def name(self) -> str:
        shape = f"ws{self.replicas}/group{self.group}/" + ("every-step" if self.everyone else f"sync{self.sync_every}")
        prefix = "partial-reduce/simulator" if self.simulate else "partial-reduce"
        return f"{prefix}/{shape}" + ("/hetero" if self.hetero else "")

    @property
    def reference(self) -> str:  # type: ignore[override]
        if self.everyone:
            return f"ddp/default/ws{self.replicas}"
        if self.hetero:
            return variant_of(PartialReduce, self, hetero=False).name
        if self.simulate:
            return self.name
        return PartialReduce(1, self.group, self.sync_every, simulate=True, simulated_replicas=self.world_size).name

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BITWISE if self.hetero else default

    def describe(self) -> str:
        where = "simulated in one process" if self.simulate else "over gloo/nccl"
        delays = ", seeded delays" if self.hetero else ""
        return f"{self.replicas} replicas averaging in groups of {self.group}, all every {self.sync_every} steps, {where}{delays}"

    def steps(self, ctx: RunContext) -> int:
        return ctx.steps if self.everyone else TOTAL_STEPS  # against DDP: the same steps as DDP

    def average(self, members: list[Any]) -> Any:
        """A group's average (a planted fault forgets a member)."""
        return group_average(members)

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, frozenset({"all_reduce", "all_gather"}))

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        modules = [build_for_training(model, ctx.device) for _ in range(self.replicas if self.simulate else 1)]
        if not any(p.requires_grad for p in modules[0].parameters()):
            raise Unsupported("every parameter is frozen: nothing to average")
        optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=ctx.lr) for m in modules]
        mine = list(range(self.replicas)) if self.simulate else [ctx.rank]
        shards = {r: inputs.train.shard(r, self.replicas) for r in mine}
        outputs: Outputs = {}

        def every_replica_flat() -> list[Any]:
            if self.simulate:
                return [_flat(m) for m in modules]
            return all_flat(modules[0], self.replicas, ctx.group)

        def global_sync(before: list[Any]) -> None:
            if self.simulate:
                total = group_average(before)
                for m in modules:
                    _assign(m, total)
                return
            all_average(modules[0], self.replicas, ctx.group)

        def check(step: int, before: list[Any], after: list[Any], synced: bool) -> None:
            mean_before = torch.stack(before).double().mean(0)
            mean_after = torch.stack(after).double().mean(0)
            if not torch.allclose(mean_after, mean_before, rtol=1e-5, atol=1e-6):
                drift = float((mean_after - mean_before).abs().max())
                raise InvariantViolated(f"step {step}: the partial average moved the replicas' mean by {drift:.3g}")
            if synced and not all(torch.equal(after[0], a) for a in after[1:]):
                raise InvariantViolated(f"step {step}: replicas differ after a global sync")

        def record_eval(phase: str) -> None:
            with torch.no_grad():
                local = {r: {k: to_numpy(v) for k, v in model.evaluate(modules[mine.index(r)], inputs.eval.shard(r, self.replicas), ctx.device).items()} for r in mine}
            pieces = [local[r] for r in mine] if self.simulate else gather_to_rank0(ctx, local[ctx.rank])
            if pieces is not None:
                outputs.update({f"{phase}/{k}": np.concatenate([p[k] for p in pieces]) for k in pieces[0]})

        record_eval("eval_before")
        steps = self.steps(ctx)
        for step in range(1, steps + 1):
            losses = [sgd_step(model, modules[i], optimizers[i], shards[r], ctx.device) for i, r in enumerate(mine)]
            if self.hetero:
                delay = np.random.default_rng([ctx.seed, step, ctx.rank]).uniform(0, 0.05)
                time.sleep(float(delay))
            before = every_replica_flat()
            synced = self.everyone or step % self.sync_every == 0
            if synced and not self.everyone:
                global_sync(before)
            else:
                average_partners(modules, mine, before, ctx.seed, step, self.group, self.average)
            after = every_replica_flat()
            check(step, before, after, synced)
            replica_params = [canonical_parameters(model, m) for m in modules]
            gathered = ({"loss": losses, "params": replica_params} if self.simulate
                        else gather_to_rank0(ctx, {"loss": losses, "params": replica_params}))
            if gathered is None:
                continue
            if not self.simulate:
                gathered = {"loss": [l for g in gathered for l in g["loss"]],
                            "params": [p for g in gathered for p in g["params"]]}
            outputs[f"train_step{step}/loss"] = loss_record(gathered["loss"])
            for name in gathered["params"][0]:
                stack = np.stack([p[name] for p in gathered["params"]])
                outputs[f"param_after_step{step}/{name}"] = stack.mean(0, dtype=np.float64).astype(stack.dtype)
                if not self.everyone:
                    outputs.update({f"replica{r}_after_step{step}/{name}": stack[r] for r in range(self.replicas)})
        record_eval(f"eval_after_step{steps}")
        return outputs if ctx.rank == 0 else None

    def standalone(self, case: StandaloneCase) -> Script:
        from difftest import Script, refuse_changed_hooks

        refuse_changed_hooks(self, PartialReduce, "average")
        if self.simulate:
            raise Unsupported("the simulator is the reference the distributed replicas are judged against")
        if self.hetero:
            raise Unsupported("its oracle is bitwise equality with the same run without delays, not the single "
                              "process a script compares with")
        model = case.generator.standalone_model(case.spec, case.init_state, case.model_dir, case.inputs["train"])
        if model is None:
            raise Unsupported(f"{case.spec.kind} models have no standalone form (Generator.standalone_model)")
        after = re.fullmatch(r"(?:param|replica\d+)_after_step(\d+)", case.first_divergence.split("/")[0])
        if not case.failure and after is None:  # an invariant's break, the loss, a prediction: not what it compares
            raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a parameter after "
                              "a step")
        steps = int(after[1]) if after else case.steps if self.everyone else TOTAL_STEPS  # a failure: the setting's
        phases = ["param"] + ([] if self.everyone else [f"replica{r}" for r in range(self.world_size)])
        tensors = [f"{phase}_after_step{steps}/{name}" for phase in phases for name in model.parameters]
        schedule = ("everyone every step" if self.everyone else
                    f"partners in seeded groups of {self.group}, everyone every {self.sync_every} steps")
        return Script(
            summary=f"SD-Pipe's partial reduce: {self.world_size} data-parallel replicas over CPU ranks (gloo), each "
                    f"taking plain SGD steps (lr {case.lr:g}) on its contiguous share of the batch, then averaging "
                    f"its parameters with {schedule} (all-gather; all-reduce), {steps} step(s)"
                    + case.against("the same schedule simulated in one process: every replica's parameters and "
                                   "their mean after the last step")
                    + (" (everyone averaging every step is plain data-parallel SGD: what the DDP reference difftest "
                       "judged it against computes)" if self.everyone and not (case.twice or case.failure) else "")
                    + f". {model.summary}",
            libraries=("torch", *model.libraries, "numpy"), preamble=model.preamble,
            case={**model.case, "setting": {"replicas": self.world_size, "group": self.group,
                                            "sync_every": self.sync_every, "seed": case.seed},
                  "lr": case.lr, "steps": steps, "batch": case.inputs["train"].size},
            functions=(*model.functions, to_numpy, partner_groups, group_average, _flat, _assign, average_partners,
                       all_flat, all_average, train_replicas, replica_tensors, single_process, on_rank),
            tensors={t: t for t in tensors}, data=model.data, world_size=self.world_size)


def _family() -> list[Setting]:
    settings: list[Setting] = []
    for ws, group in ((4, 2), (3, 2)):
        settings += [PartialReduce(ws, group, 2), PartialReduce(ws, group, 2, hetero=True),
                     PartialReduce(1, group, 2, simulate=True, simulated_replicas=ws)]
    return settings + [PartialReduce(ws, ws, 1) for ws in (2, 4)]


register_settings(_family())
