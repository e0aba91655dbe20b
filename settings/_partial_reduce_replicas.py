"""SD-Pipe's replicas as the partial-reduce setting trains them and its standalone script copies them (these functions
as they are): seeded partner groups averaging after every step, a global average every few steps, the replicas on
the script's ranks or simulated in one process."""

# ruff: noqa: F821 -- the standalone script's functions call the model's (`build_model`, `model_loss`,
# `model_parameters`), which the script defines before them

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from difftest import to_numpy

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
