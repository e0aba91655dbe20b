"""A resume's standalone script (`difftest.scripts.emit`): the resumable program of settings/_resumable.py (SGD with
momentum, a step LR schedule, a loader reshuffling every epoch from torch's RNG, each rank on its contiguous share),
its phases each in new processes (`run_distributed` replaces the runtime's: one group of ranks per phase, the first
saving a torch.distributed.checkpoint the second loads), against the program uninterrupted in one process. The
model's functions (`Generator.standalone_model`) and the program's (`EpochLoader`, `take_samples`, `place`,
`checkpoint_state`, `load_checkpoint`, the RNG's) are defined in the script before these."""

# ruff: noqa: F821 -- the model's and the program's functions are defined in the script, before these

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# what the script defines before these functions (declared here so that this module checks on its own)
CASE: dict[str, Any]
build_model: Callable[..., Any]
model_loss: Callable[..., Any]
model_parameters: Callable[..., dict[str, Any]]
full_parameters: Callable[..., dict[str, Any]]
parameters_after: Callable[..., dict[str, np.ndarray]]
place: Callable[..., Any]
EpochLoader: Callable[..., Any]
take_samples: Callable[..., dict[str, Any]]
seed_everything: Callable[..., None]
checkpoint_state: Callable[..., dict[str, Any]]
load_checkpoint: Callable[..., None]
start_ranks: Callable[..., dict[str, np.ndarray]]


def train_phase(module: Any, data: dict[str, Any], case: dict[str, Any], phase: dict[str, Any], rank: int,
                world_size: int, dtype: Any, group: Any) -> Any:
    """Steps `first`+1..`last` on this rank's share of each batch, placed as `phase` says, after loading a checkpoint
    (`load`: "restore", or "fast-forward" replaying the loader) and before saving one (`save`), as `run_phase` does."""
    import torch.distributed.checkpoint as dcp

    placed = place(module, phase["strategy"], group, "cpu", case["layout"])
    optimizer = torch.optim.SGD([p for p in placed.parameters() if p.requires_grad], lr=case["lr"],
                                momentum=case["momentum"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, case["lr_halving_every"], gamma=0.5)
    loader = EpochLoader(case["batch"], case["batch"] // 2)
    seed_everything(case["seed"])  # once the model is built, as every phase of the program does
    if phase["load"]:
        fast = phase["load"] == "fast-forward"
        load_checkpoint(phase["checkpoint"], placed, optimizer, scheduler, loader,
                        set(case["carried"]) & {"model", "optimizer", "scheduler"} if fast else case["carried"], group)
        for _ in range(phase["first"] if fast else 0):
            loader.next()  # DETrain's fast-forward: replay the loader, skip the step
    for _ in range(phase["first"], phase["last"]):
        batch = take_samples(data, "train", loader.next())
        if (size := len(batch["train.labels"])) % world_size:  # as difftest's program refuses it
            raise ValueError(f"batch of {size} samples does not split over {world_size} ranks")
        share = size // world_size
        optimizer.zero_grad()
        model_loss(placed, batch, rank * share, (rank + 1) * share, dtype).backward()
        optimizer.step()
        scheduler.step()
    if phase["save"]:
        dcp.save(checkpoint_state(placed, optimizer, scheduler, loader), checkpoint_id=phase["checkpoint"],
                 process_group=group)
    return placed


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the program's steps uninterrupted, in one process, in `dtype`."""
    module = build_model(data, case, dtype)
    uninterrupted = {"strategy": "single", "first": 0, "last": case["steps"], "load": "", "save": False}
    train_phase(module, data, case, uninterrupted, 0, 1, dtype, None)
    return parameters_after(model_parameters(module), case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """One phase on this rank; the last one's rank 0 returns every parameter, whole."""
    phase = case["phase"]
    placed = train_phase(build_model(data, case, torch.float32), data, case, phase, rank, world_size, torch.float32,
                         torch.distributed.group.WORLD)
    if phase["last"] < case["steps"]:
        return {} if rank == 0 else None
    whole = full_parameters(placed, model_parameters)  # collective: every rank takes part
    return parameters_after(whole, case) if rank == 0 else None


def run_distributed(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The setting: each phase in a new group of processes of its own size, the checkpoint in a temporary folder."""
    with tempfile.TemporaryDirectory() as checkpoint:
        for phase in CASE["phases"]:
            result = start_ranks(data, {**CASE, "phase": {**phase, "checkpoint": checkpoint}}, phase["world_size"])
    return result
