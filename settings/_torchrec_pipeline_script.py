"""A train-pipeline finding's standalone script: the whole model (`Generator.standalone_model`) inside the batch model a
TorchRec train pipeline drives (`settings.torchrec_pipelines.batch_model`), its tables fused with SGD and sharded by
DistributedModelParallel under the case's plan (`sharded_with_fused_sgd`), trained by the case's pipeline class, against
the plain loop on the unsharded model in one process. `settings._training_script.training_script` assembles it; these
functions replace its wrapper, its steps and its reading of the parameters (copied into the script as they are)."""

# ruff: noqa: F821 -- the model's and the family's functions and constants are defined in the script, before these

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# what the script defines before these functions (declared here so that this module checks on its own)
model_inputs: Callable[..., tuple[Any, ...]]
model_prediction: Callable[..., Any]
prediction_loss: Callable[..., Any]
model_loss: Callable[..., Any]
batch_model: Callable[..., Any]
pipeline_batch: Callable[..., Any]
sharded_with_fused_sgd: Callable[..., Any]
_local_pieces: Callable[..., Any]
NoDenseParameters: type
WRAPPED: str


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The model inside the batch model the pipeline drives (its inputs read from a batch's fields, its loss a module
    of its own), then sharded as the sharding family shards it."""
    wrapped = batch_model(module, model_prediction, prediction_loss, setting["inputs"])
    return sharded_with_fused_sgd(wrapped, group, device, setting)


def sgd_on_share(module: Any, data: dict[str, Any], case: dict[str, Any], rank: int, world_size: int,
                 dtype: Any) -> None:
    """`case["steps"]` steps on this rank's contiguous share of the training batch. In one process the plain loop
    (SGD over every parameter); on the ranks, the case's train pipeline, filled from one iterator of the same share
    for every step the run took (so it runs a batch ahead, the last step compared too), the tables stepped inside the
    backward and the rest (a data-parallel table too) by SGD."""
    import torch

    share = case["batch"] // world_size
    start, stop = rank * share, (rank + 1) * share
    if world_size == 1:
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=case["lr"])
        for _ in range(case["steps"]):
            optimizer.zero_grad()
            model_loss(module, data, start, stop, dtype).backward()
            optimizer.step()
        return
    from torchrec.distributed.train_pipeline import train_pipelines
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    frozen = set(case["frozen"])
    dense = [p for n, p in in_backward_optimizer_filter(module.named_parameters()) if p.requires_grad
             and not any(n == f or n.endswith("." + f) for f in frozen)]
    optimizer = torch.optim.SGD(dense, lr=case["lr"]) if dense else NoDenseParameters()
    inner = getattr(module.module, WRAPPED)  # the model itself, whose tables the batch's features are read for
    labels = torch.from_numpy(data["train.labels"][start:stop])
    batches = (pipeline_batch(model_inputs(inner, data, "train", start, stop, dtype), labels)
               for _ in range(case["setting"]["batches"]))
    pipeline = getattr(train_pipelines, case["setting"]["pipeline"])(module, optimizer, torch.device(case["device"]))
    for _ in range(case["steps"]):
        pipeline.progress(batches)
    # the next batch's input distribution may still be in flight: the pipeline lives until the parameters are read
    module.train_pipeline = pipeline


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """Every tensor of the model inside the batch model, whole on every rank, under the model's names: a sharded
    table's shards summed into zeros (they do not overlap), the rest as this rank holds it (replicated)."""
    import torch
    import torch.distributed as dist

    found = {}
    for name, value in wrapped.state_dict().items():
        pieces = _local_pieces(value)
        whole = value.detach().clone() if pieces is None else torch.zeros(tuple(value.shape), dtype=torch.float64)
        for offsets, local in pieces or []:
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))] = local.detach().double()
        if pieces is not None:
            dist.all_reduce(whole)
        found[name.removeprefix(f"{WRAPPED}.")] = whole
    return found
