"""A checkpoint-resharding finding's standalone script: the embedding collections alone, trained by the fused
optimizer inside TorchRec's lookup kernel, the first steps under one plan in a group of processes, a
torch.distributed.checkpoint of the sharded tables and the fused optimizer's state, the other steps under another plan
in a new group that loads it; against the optimizer's PyTorch class on the unsharded collections in one process, the
steps without an interruption. The loss is the tables' own (`pooled_loss`), as in the fused-optimizer family's
script."""

# ruff: noqa: F821 -- CASE and start_ranks are the script runtime's, defined in the script before these

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from settings._torchrec_optim_script import fuse_as_trained, trained_tables, unfused_table_optimizers, whole_tables
from settings._torchrec_script import sharded_tables, standalone_features, standalone_tables
from settings.torchrec_vbe import pooled_loss

# what the script's shared runtime defines (declared here so that this module checks on its own)
CASE: dict[str, Any]
start_ranks: Callable[..., dict[str, np.ndarray]]


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections, in `dtype`, every step of the optimizer's PyTorch class on the whole
    batch without an interruption; every table after them."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    tables = tables.to(dtype)
    optimizers = unfused_table_optimizers(trained_tables(tables, case), case)  # none where every table is frozen
    for _ in range(case["steps"]):
        tables.zero_grad()
        pooled_loss(tables(standalone_features(data, case, 0, case["batch"], dtype)), case["batch"]).backward()
        for optimizer in optimizers:
            optimizer.step()
    return {name: value.detach().cpu().numpy() for name, value in tables.state_dict().items()}


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """One rank of a phase: the collections under the phase's plan (`case["sharding"]`), the checkpoint loaded into
    the model and the fused optimizer where the phase resumes, its steps (each rank on its share of the batch), the
    checkpoint saved where the phase ends before the last step; every table after the phase, whole, on rank 0."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    phase = case["phase"]
    module = standalone_tables(case)
    fuse_as_trained(module, case)
    dmp = sharded_tables(module, EmbeddingBagCollectionSharder(), data, case, world_size)
    if phase["load"]:  # into the state dicts' own tensors, then through load_state_dict, as TorchRec's tests do
        state = {"model": dmp.state_dict(), "optimizer": dmp.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=phase["checkpoint"])
        dmp.load_state_dict(state["model"])
        dmp.fused_optimizer.load_state_dict(state["optimizer"])
    share = case["batch"] // world_size
    for _ in range(phase["steps"]):
        pooled = dmp(standalone_features(data, case, rank * share, (rank + 1) * share, torch.float32))
        # the mean over this rank's share, as DDP's ranks have it: TorchRec divides the pooled embeddings' gradients by
        # the world size in its all-to-all backward (torchrec.distributed.comm_ops.GRADIENT_DIVISION)
        pooled_loss(pooled, share).backward()  # the tables step inside it
    if phase["save"]:
        dcp.save({"model": dmp.state_dict(), "optimizer": dmp.fused_optimizer.state_dict()},
                 checkpoint_id=phase["checkpoint"])
    found = whole_tables(dmp)
    return found if rank == 0 else None


def run_distributed(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The setting: each phase in a new group of processes of its own size under its own plan, the checkpoint in a
    temporary folder; the tables after the last phase."""
    with tempfile.TemporaryDirectory() as folder:
        for phase in CASE["phases"]:
            case = {**CASE, "sharding": phase["sharding"], "local_world_size": phase["world_size"],
                    "phase": {**phase, "checkpoint": f"{folder}/checkpoint"}}
            result = start_ranks(data, case, phase["world_size"])
    return result
