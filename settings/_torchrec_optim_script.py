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
    return getattr(importlib.import_module(module), name), fbgemm_options({"lr": case["lr"], **case["options"]})


def second_tables(names: list[str], case: dict[str, Any]) -> set[str]:
    """Those of the tables `names` that the case's second optimizer trains (`case["second_tables"]`)."""
    return set(case.get("second_tables", ())) & set(names)


def fuse_table_optimizers(tables: dict[str, Any], case: dict[str, Any]) -> None:
    """Fuses the case's optimizer into the tables (name → weight), or, where the case has a second optimizer, that
    one into `second_tables`: both given the one options dict, as a user who shares hyperparameters writes it."""
    import importlib

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    optimizer_class, options = table_optimizer(case)
    second = second_tables(list(tables), case)
    apply_optimizer_in_backward(optimizer_class, [p for n, p in tables.items() if n not in second], options)
    if second:
        module, name = case["second"]
        apply_optimizer_in_backward(getattr(importlib.import_module(module), name), [tables[n] for n in sorted(second)],
                                    options)


def unfused_table_optimizers(tables: dict[str, Any], case: dict[str, Any]) -> list[Any]:
    """The PyTorch optimizers that train the tables (name → weight) as `fuse_table_optimizers` fuses them."""
    import importlib

    optimizer_class, options = table_optimizer(case)
    second = second_tables(list(tables), case)
    first = [p for n, p in tables.items() if n not in second]
    found = [optimizer_class(first, **options)] if first else []  # a frozen model's trainable tables may all be second
    if second:
        module, name = case["second"]
        found.append(getattr(importlib.import_module(module), name)([tables[n] for n in sorted(second)], **options))
    return found


def fuse_as_trained(module: Any, case: dict[str, Any]) -> None:
    """The case's optimizers fused into the collections' trainable tables (`fuse_table_optimizers`) and SGD at lr 0
    into its frozen ones (`case["frozen"]`), as the setting fuses them: a fused table without an optimizer of its own
    gets the sharder's default one and trains; an optimizer that does not move it is TorchRec's way to freeze it
    (torchrec#1990)."""
    import torch
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if trained := trained_tables(module, case):
        fuse_table_optimizers(trained, case)
    if frozen := [p for n, p in module.named_parameters() if table_name(n) in case.get("frozen", ())]:
        apply_optimizer_in_backward(torch.optim.SGD, frozen, {"lr": 0.0})


def trained_tables(module: Any, case: dict[str, Any]) -> dict[str, Any]:
    """The collections' tables (name → weight) that the case trains: all but its frozen ones (`case["frozen"]`)."""
    return {table_name(n): p for n, p in module.named_parameters() if table_name(n) not in case.get("frozen", ())}


def table_name(parameter: str) -> str:
    """A table's name from its weight's qualified name (`….embedding_bags.<table>.weight`)."""
    return parameter.split(".")[-2]


def fbgemm_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options as TorchRec hands them to fbgemm's kernel: a weight-decay mode as fbgemm's `WeightDecayMode`
    member of that name."""
    if "weight_decay_mode" not in options:
        return options
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return {**options, "weight_decay_mode": WeightDecayMode[options["weight_decay_mode"]]}


def step_touched_rows(optimizer: Any) -> None:
    """`optimizer.step()` on the rows a batch looked up (their gradient not all zero), every other row of each
    parameter and of its state kept as it was (a state the step creates: zero there). fbgemm's embedding update is
    sparse: it reads and writes only the rows a batch looks up, its weight decay too (FBGEMM#2516 calls it local)."""
    import torch

    kept = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is None:
                continue
            untouched = (parameter.grad.reshape(parameter.shape[0], -1) == 0).all(dim=1)
            states = optimizer.state.get(parameter, {})
            saved = [(t, t[untouched].clone()) for t in [parameter.data, *states.values()]
                     if torch.is_tensor(t) and t.dim() and t.shape[0] == parameter.shape[0]]
            kept.append((parameter, untouched, saved, set(states)))
    optimizer.step()
    for parameter, untouched, saved, existed in kept:
        for tensor, values in saved:
            tensor[untouched] = values
        for key, state in optimizer.state[parameter].items():
            if key not in existed and torch.is_tensor(state) and state.dim() and state.shape[0] == parameter.shape[0]:
                state[untouched] = 0


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections, in `dtype`, the case's steps of the optimizer's PyTorch class on the
    whole batch (on the rows it looks up, where the case says fbgemm's update is sparse); every table after them."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    tables = tables.to(dtype)
    optimizers = unfused_table_optimizers(trained_tables(tables, case), case)
    for _ in range(case["steps"]):
        tables.zero_grad()
        pooled_loss(tables(standalone_features(data, case, 0, case["batch"], dtype)), case["batch"]).backward()
        for optimizer in optimizers:
            step_touched_rows(optimizer) if case["touched_rows_only"] else optimizer.step()
    return {name: value.detach().cpu().numpy() for name, value in tables.state_dict().items()}


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the collections, the tables trained inside backward by the fused
    optimizer; the case's steps, each rank on its share of the batch (its loss the mean over that share); every
    table after them, whole, on rank 0 (its shards summed into zeros: they do not overlap)."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    module = standalone_tables(case)
    fuse_as_trained(module, case)
    dmp = sharded_tables(module, EmbeddingBagCollectionSharder(), data, case, world_size)
    share = case["batch"] // world_size
    for _ in range(case["steps"]):
        pooled = dmp(standalone_features(data, case, rank * share, (rank + 1) * share, torch.float32))
        # the mean over this rank's share, as DDP's ranks have it: TorchRec divides the pooled embeddings' gradients
        # by the world size in its all-to-all backward (torchrec.distributed.comm_ops.GRADIENT_DIVISION)
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
