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

# ruff: noqa: F821 -- the standalone script's functions call the model's (`build_model`, `model_loss`,
# `model_parameters`), which the script defines before them

from __future__ import annotations

import re
import time
from collections.abc import Callable
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
from settings._training import build_for_training, canonical_parameters, sgd_step
from settings.determinism import BITWISE

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

TOTAL_STEPS = 4
# the model's functions, defined in a standalone script before this module's (declared so that this module checks)
build_model: Callable[..., Any]
model_loss: Callable[..., Any]
model_parameters: Callable[..., dict[str, Any]]


def partner_groups(seed: int, step: int, world_size: int, group: int) -> list[list[int]]:
    order = np.random.default_rng([seed, step]).permutation(world_size)
    return [sorted(int(r) for r in order[i:i + group]) for i in range(0, world_size, group)]


def group_average(members: list[Any]) -> Any:
    """The members' mean: a sum in the given (rank) order, then one division."""
    import torch

    return torch.stack(members).sum(0) / len(members)


def _flat(module: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in module.parameters() if p.requires_grad])


def _assign(module: Any, flat: Any) -> None:
    import torch

    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def average_partners(modules: list[Any], mine: list[int], before: list[Any], seed: int, step: int, group: int,
                     average: Callable[[list[Any]], Any] = group_average) -> None:
    """The replicas `mine` (`modules`, one each) take their partner group's `average` of every replica's flattened
    parameters `before` the step's averaging."""
    for members in partner_groups(seed, step, len(before), group):
        averaged = average([before[r] for r in members])
        for r in set(members) & set(mine):
            _assign(modules[mine.index(r)], averaged)


def all_flat(module: Any, replicas: int, group: Any = None) -> list[Any]:
    """Every replica's flattened parameters, from an all-gather over the ranks (one replica each)."""
    import torch
    import torch.distributed as dist

    local = _flat(module)
    gathered = [torch.empty_like(local) for _ in range(replicas)]
    dist.all_gather(gathered, local, group=group)
    return gathered


def all_average(module: Any, replicas: int, group: Any = None) -> None:
    """A global sync over the ranks: the replicas' sum (an all-reduce; gloo has no AVG) over their count."""
    import torch.distributed as dist

    flat = _flat(module)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    _assign(module, flat / replicas)


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


def train_replicas(modules: list[Any], mine: list[int], data: dict[str, Any], case: dict[str, Any], dtype: Any,
                   every_flat: Callable[[], list[Any]], global_sync: Callable[[list[Any]], None]) -> None:
    """`case["steps"]` steps of the schedule on the replicas `mine` (`modules`, one each): plain SGD on each one's
    contiguous share of the batch, then the average of its partner group, from every replica's flattened parameters
    (`every_flat()`), or at a global sync everyone's (`global_sync(before)` assigns it)."""
    import torch

    setting = case["setting"]
    replicas = setting["replicas"]
    share = case["batch"] // replicas
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=case["lr"]) for m in modules]
    for step in range(1, case["steps"] + 1):
        for module, optimizer, r in zip(modules, optimizers, mine):
            optimizer.zero_grad()
            model_loss(module, data, r * share, (r + 1) * share, dtype).backward()
            optimizer.step()
        before = every_flat()
        if setting["group"] < replicas and step % setting["sync_every"] == 0:
            global_sync(before)
            continue
        average_partners(modules, mine, before, setting["seed"], step, setting["group"])


def replica_tensors(every: list[dict[str, np.ndarray]], case: dict[str, Any]) -> dict[str, np.ndarray]:
    """What the setting records after the last step from every replica's parameters: each one's mean over the
    replicas (summed in float64), and, unless everyone averages every step, each replica's own."""
    setting, step, tensors = case["setting"], case["steps"], {}
    for name in every[0]:
        stack = np.stack([parameters[name] for parameters in every])
        tensors[f"param_after_step{step}/{name}"] = stack.mean(0, dtype=np.float64).astype(stack.dtype)
        if setting["group"] < setting["replicas"]:
            tensors.update({f"replica{r}_after_step{step}/{name}": stack[r] for r in range(setting["replicas"])})
    return tensors


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the same schedule simulated in one process, every replica's model side by side."""
    modules = [build_model(data, case, dtype) for _ in range(case["setting"]["replicas"])]

    def global_sync(before: list[Any]) -> None:
        for module in modules:
            _assign(module, group_average(before))

    train_replicas(modules, list(range(len(modules))), data, case, dtype, lambda: [_flat(m) for m in modules],
                   global_sync)
    return replica_tensors([{n: to_numpy(p) for n, p in model_parameters(m).items()} for m in modules], case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: a replica per rank; a group's average from an all-gather of every replica's parameters, a global
    sync an all-reduce (SUM, then / W: gloo has no AVG); rank 0 gathers every replica's parameters."""
    import torch
    import torch.distributed as dist

    module = build_model(data, case, torch.float32)
    train_replicas([module], [rank], data, case, torch.float32, lambda: all_flat(module, world_size),
                   lambda before: all_average(module, world_size))
    every: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object({n: to_numpy(p) for n, p in model_parameters(module).items()}, every, dst=0)
    return replica_tensors(every, case) if every is not None else None


def _family() -> list[Setting]:
    settings: list[Setting] = []
    for ws, group in ((4, 2), (3, 2)):
        settings += [PartialReduce(ws, group, 2), PartialReduce(ws, group, 2, hetero=True),
                     PartialReduce(1, group, 2, simulate=True, simulated_replicas=ws)]
    return settings + [PartialReduce(ws, ws, 1) for ws in (2, 4)]


register_settings(_family())
