"""A pipeline setting's standalone script (`difftest.standalone`): the reference and the ranks' part, copied into it
beside the model's functions (`Generator.standalone_model`: `build_model`, `model_loss`, `model_parameters`, and its
`chain`: `model_chain`, `prediction_loss`) and the pipeline module's (`stages_of`, `stage_examples`,
`pipeline_schedule`, `ChainStage`; a hybrid's `pipeline_groups`, `wrap_stage`), which the script defines before
these. The steps are the setting's: evaluate once, then plain SGD under the schedule on the whole batch, or each
replica on its share (`settings._training.record_training`)."""

# ruff: noqa: F821 -- the model's and the pipeline's functions are defined in the script, before these

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# what the script defines before these functions (declared here so that this module checks on its own)
build_model: Callable[..., Any]
model_loss: Callable[..., Any]
model_parameters: Callable[..., dict[str, Any]]
model_chain: Callable[..., list[Any]]
prediction_loss: Callable[..., Any]
parameters_after: Callable[..., dict[str, np.ndarray]]
ChainStage: Callable[..., Any]
stages_of: Callable[..., list[int]]
stage_examples: Callable[..., dict[int, tuple]]
pipeline_schedule: Callable[..., Any]
pipeline_groups: Callable[..., dict[str, Any]]
wrap_stage: Callable[..., Any]


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference (`accumulate`): each step accumulates the gradients of every pipeline's micro-batches."""
    layout = case["setting"]
    module, count = build_model(data, case, dtype), layout["microbatches"] * layout.get("data_parallel", 1)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=case["lr"])
    size = case["batch"] // count
    for _ in range(case["steps"]):
        optimizer.zero_grad()
        for i in range(count):
            (model_loss(module, data, i * size, (i + 1) * size, dtype) / count).backward()
        optimizer.step()
    return parameters_after(model_parameters(module), case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: the chain's stages on their ranks under the schedule (a hybrid: `data_parallel` such pipelines,
    each on its share of the batches), evaluated, trained, evaluated again; rank 0 gathers every stage's parameters."""
    import torch.distributed as dist

    layout, fed = case["setting"], {"split": "train"}
    dp = layout.get("data_parallel", 1)
    replica, pp_rank = divmod(rank, pp := world_size // dp)
    module = build_model(data, case, torch.float32)
    bounds = [*layout["starts"], len(units := model_chain(module, data, fed, torch.float32))]
    every = [ChainStage(units[a:b]) for a, b in zip(bounds, bounds[1:])]
    modules = {s: every[s] for s in stages_of(pp_rank, pp, layout)}
    share = case["batch"] // dp
    examples = stage_examples(every, share // layout["microbatches"], replica * share)
    groups, wrapped = {"pp": dist.group.WORLD}, modules
    if dp > 1:  # a hybrid (only its script defines these): the (dp, pp) mesh, DDP or FSDP2 over each stage's replicas
        groups = pipeline_groups("cpu", dp, pp)
        wrapped = {s: wrap_stage(m, layout["inner"], groups, "cpu") for s, m in modules.items()}
    schedule = pipeline_schedule(wrapped, layout, groups["pp"], "cpu", examples, prediction_loss)
    trainable = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=case["lr"]) if trainable else None

    def run(split: str) -> None:  # the schedule on this replica's share of a batch: evaluating it, or a step
        size = len(data[f"{split}.labels"]) // dp
        fed["split"], positions = split, torch.arange(replica * size, (replica + 1) * size)
        target = torch.from_numpy(data[f"{split}.labels"][replica * size:(replica + 1) * size])
        if split == "eval":
            with torch.no_grad():
                schedule.eval(positions, target=target)
        else:
            schedule.step(positions, target=target, losses=[])

    run("eval")  # before the first step and after the last, as the setting does
    for _ in range(case["steps"]):
        if optimizer is not None:
            optimizer.zero_grad()
        run("train")
        if optimizer is not None:
            optimizer.step()
    run("eval")
    for stage in wrapped.values():  # FSDP2 holds a shard of each parameter: the whole of it, to read
        getattr(stage, "unshard", lambda: None)()
    held = {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}
    mine = {n: t for n, t in model_parameters(module).items() if t.untyped_storage().data_ptr() in held}
    pieces = [None] * world_size if rank == 0 else None
    dist.gather_object(parameters_after(mine, case) if replica == 0 else {}, pieces, dst=0)
    return {k: v for piece in pieces for k, v in piece.items()} if pieces else None
