"""A fused-optimizer finding's standalone script: the embedding collections alone, trained one step by the fused
optimizer inside TorchRec's lookup kernel (`apply_optimizer_in_backward`) under DistributedModelParallel on the script's
ranks, against the optimizer's PyTorch class on the unsharded collections in one process (copied into the script as
they are). The loss is the tables' own (`pooled_loss`, the mean over the batch of each sample's pooled embeddings'
dot products with a fixed vector), so the script needs no model around the tables."""

from __future__ import annotations

from typing import Any

import numpy as np

from settings._torchrec_plan import _local_pieces
from settings._torchrec_script import sharded_tables, standalone_features, standalone_tables
from settings.torchrec_vbe import pooled_loss


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def table_optimizer(case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The optimizer's PyTorch class (what TorchRec maps to its fbgemm kernel) and its options."""
    import importlib

    module, name = case["optimizer"]
    return getattr(importlib.import_module(module), name), {"lr": case["lr"], **case["options"]}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections, in `dtype`, one step of the optimizer's PyTorch class on the whole
    batch; every table after it."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    tables = tables.to(dtype)
    optimizer_class, options = table_optimizer(case)
    optimizer = optimizer_class(list(tables.parameters()), **options)
    pooled_loss(tables(standalone_features(data, case, 0, case["batch"], dtype)), case["batch"]).backward()
    optimizer.step()
    return {name: value.detach().cpu().numpy() for name, value in tables.state_dict().items()}


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the collections, the tables trained inside backward by the fused
    optimizer; one step, each rank on its share of the batch (its loss the mean over that share); every
    table after it, whole, on rank 0 (its shards summed into zeros: they do not overlap)."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = standalone_tables(case)
    optimizer_class, options = table_optimizer(case)
    apply_optimizer_in_backward(optimizer_class, list(module.parameters()), options)
    dmp = sharded_tables(module, EmbeddingBagCollectionSharder(), data, case, world_size)
    share = case["batch"] // world_size
    pooled = dmp(standalone_features(data, case, rank * share, (rank + 1) * share, torch.float32))
    # the mean over this rank's share, as DDP's ranks have it: TorchRec divides the pooled embeddings' gradients by the
    # world size in its all-to-all backward (torchrec.distributed.comm_ops.GRADIENT_DIVISION)
    pooled_loss(pooled, share).backward()  # the tables step inside it
    found = whole_tables(dmp)
    return found if rank == 0 else None


def whole_tables(dmp: Any) -> dict[str, np.ndarray]:
    """Every table of `dmp`, whole, on every rank (collective): its shards summed into zeros (they do not overlap)."""
    import torch
    import torch.distributed as dist

    found = {}
    for name, value in dmp.state_dict().items():
        whole = torch.zeros(tuple(value.shape), dtype=torch.float64)
        for offsets, local in _local_pieces(value) or []:
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))] = local.detach().double()
        dist.all_reduce(whole)
        found[name] = whole.numpy()
    return found
