"""A pipeline setting's standalone script (`difftest.scripts.emit`): the reference and the ranks' part, copied into it
beside the model's functions (`Generator.standalone_model`: `build_model`, `model_loss`, `model_parameters`, and its
`chain`: `model_chain`, `prediction_loss`) and the pipeline module's (`stages_of`, `stage_examples`,
`pipeline_schedule`, `ChainStage`; a hybrid's `pipeline_groups`, `wrap_stage`; a re-partitioning's `gather_state`,
`load_state`, below; a clipped pipeline's `clip_stages`; a checkpointed pipeline's `checkpoint_stages`), which the
script defines before these. The steps are the
setting's: evaluate once, then SGD under the schedule on the whole batch, or each replica on its share
(`settings._training.record_training`); with momentum where the layout says so, the gradients clipped where it says
`clipping`, and, for a re-partitioning, the stages cut anew after `move_after` steps."""

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
clip_stages: Callable[..., float]
checkpoint_stages: Callable[..., None]


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference (`accumulate`): each step accumulates the gradients of every pipeline's micro-batches."""
    layout = case["setting"]
    count = layout["microbatches"] * layout.get("data_parallel", 1) * layout.get("accumulate", 1)
    module = build_model(data, case, dtype)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=case["lr"],
                                momentum=layout.get("momentum", 0.0))
    size = case["batch"] // count
    for _ in range(case["steps"]):
        optimizer.zero_grad()
        for i in range(count):
            (model_loss(module, data, i * size, (i + 1) * size, dtype) / count).backward()
        if "clipping" in layout:  # a clipped pipeline's (only its script defines clip_stages)
            clip_stages([module], layout["clipping"], None)
        optimizer.step()
    return parameters_after(model_parameters(module), case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: this rank's stages (of one of `data_parallel` pipelines) evaluated, trained, evaluated again."""
    layout, fed = case["setting"], {"split": "train"}
    dp = layout.get("data_parallel", 1)
    replica, pp_rank = divmod(rank, pp := world_size // dp)
    share, accumulate = case["batch"] // dp, layout.get("accumulate", 1)  # schedule steps per optimizer step
    groups = pipeline_groups("cpu", dp, pp) if dp > 1 else {"pp": torch.distributed.group.WORLD}

    def loss_fn(output: Any, target: Any) -> Any:  # divided as gradient accumulation divides it
        return prediction_loss(output, target) / layout.get("loss_divisor", 1)

    def place(starts: list[int]) -> tuple[Any, dict[int, Any], dict[int, Any], Any, Any]:  # the model cut at `starts`
        module, fed["split"] = build_model(data, case, torch.float32), "train"
        bounds = [*starts, len(units := model_chain(module, data, fed, torch.float32))]
        every = [ChainStage(units[a:b]) for a, b in zip(bounds, bounds[1:])]
        modules = {s: every[s] for s in stages_of(pp_rank, pp, layout)}
        examples = stage_examples(every, share // (layout["microbatches"] * accumulate), replica * share)
        if "checkpointing" in layout:  # a checkpointed pipeline's (only its script defines checkpoint_stages)
            checkpoint_stages(modules.values(), layout["checkpointing"])
        wrapped = {s: wrap_stage(m, layout["inner"], groups, "cpu") for s, m in modules.items()} if dp > 1 else modules
        schedule = pipeline_schedule(wrapped, layout, groups["pp"], "cpu", examples, loss_fn,
                                     layout.get("scale_grads", True))
        trainable = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
        return module, modules, wrapped, schedule, torch.optim.SGD(
            trainable, lr=case["lr"], momentum=layout.get("momentum", 0.0)) if trainable else None

    def held() -> dict[str, Any]:  # this rank's parameters, by the names the whole model gives them
        mine = {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}
        return {n: t for n, t in model_parameters(module).items() if t.untyped_storage().data_ptr() in mine}

    def run(split: str) -> None:  # on this replica's share of the batch `split`: evaluating it, or a step
        size = len(data[f"{split}.labels"]) // dp
        fed["split"], positions = split, torch.arange(replica * size, (replica + 1) * size)
        target = torch.from_numpy(data[f"{split}.labels"][replica * size:(replica + 1) * size])
        if size % (accumulate * layout["microbatches"]):  # the setting refuses it before any script is written
            raise ValueError(f"{size} samples do not split into {accumulate} x {layout['microbatches']} micro-batches")
        for chunk, rows in zip(positions.chunk(accumulate), target.chunk(accumulate)):  # a schedule step each
            if split == "eval":
                with torch.no_grad():
                    schedule.eval(chunk, target=rows)
            else:
                schedule.step(chunk, target=rows, losses=[])

    module, modules, wrapped, schedule, optimizer = place(layout["starts"])
    evaluates = layout.get("evaluates", True)  # a setting trained without the schedule's eval() has it False
    if evaluates:
        run("eval")  # before the first step and after the last, as the setting does
    for step in range(case["steps"]):
        if step == layout.get("move_after"):  # a re-partitioning (only its script defines these): cut anew, reloaded
            handed = gather_state(held(), optimizer, world_size)
            module, modules, wrapped, schedule, optimizer = place(layout["moved_starts"])
            load_state(held(), optimizer, handed)
        run("train")
        if "clipping" in layout:  # across the pipeline's ranks, before the step
            clip_stages(modules.values(), layout["clipping"], groups["pp"])
        if optimizer is not None:  # a step, and the gradients gone before the next
            optimizer.step()
            optimizer.zero_grad()
    if evaluates:
        run("eval")
    for stage in wrapped.values():  # FSDP2 holds a shard of each parameter: the whole of it, to read
        getattr(stage, "unshard", lambda: None)()
    pieces = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(parameters_after(held(), case) if replica == 0 else {}, pieces, dst=0)
    return {k: v for piece in pieces for k, v in piece.items()} if pieces else None


def gather_state(parameters: dict[str, Any], optimizer: Any, world_size: int) -> dict[str, tuple[Any, Any]]:
    """A re-partitioning's hand-over: every rank's trainable parameters and their momentum buffers, on every rank,
    by the names every split shares."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, {n: (p.detach().clone(), optimizer.state.get(p, {}).get("momentum_buffer"))
                                      for n, p in parameters.items() if p.requires_grad})
    return {n: value for piece in everyone for n, value in piece.items()}


def load_state(parameters: dict[str, Any], optimizer: Any, handed: dict[str, tuple[Any, Any]]) -> None:
    """The stages cut anew take every trainable parameter and momentum buffer they hold from the hand-over (keyed by
    the tensors `model_parameters` returns: a kind's chain must read its parameters themselves, not views of them)."""
    with torch.no_grad():
        for n, p in parameters.items():
            if p.requires_grad:
                p.copy_(handed[n][0])
                if handed[n][1] is not None:
                    optimizer.state[p]["momentum_buffer"] = handed[n][1].clone()
