"""A TorchRec clipping finding's standalone script: the whole model (`Generator.standalone_model`), its tables fused
with SGD and sharded by DistributedModelParallel under the case's plan, its other parameters clipped by TorchRec's
`GradientClippingOptimizer` before each SGD step, against the unsharded model in one process clipped by
`torch.nn.utils.clip_grad_norm_` (the family's root). `settings._training_script.training_script` assembles it; these
functions replace its wrapper, its step and its reading of the parameters (copied into the script as they are)."""

# ruff: noqa: F821 -- the model's functions, MAX_NORM and CLIP_NORM are defined in the script, before these

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from settings._torchrec_plan import _load_full_state, sharding_plan
from settings.torchrec_optimizers import _is_table

# what the script defines before these functions (declared here so that this module checks on its own)
model_loss: Callable[..., Any]
MAX_NORM: float
CLIP_NORM: float


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The model as the setting shards it (`sharded_with_fused_sgd`)."""
    return sharded_with_fused_sgd(module, group, device, setting)


def sharded_with_fused_sgd(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """Every table of `module` fused with SGD at the case's learning rate (a frozen one at 0, TorchRec's way to keep
    a fused table still), then DistributedModelParallel under the case's plan, each shard holding the model's initial
    weights (TorchRec initialises shards afresh)."""
    import torch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    initial = {name: value.detach().numpy().copy() for name, value in module.state_dict().items()}
    tables = [p for name, p in module.named_parameters() if _is_table(name)]
    apply_optimizer_in_backward(torch.optim.SGD, [p for p in tables if p.requires_grad], {"lr": setting["lr"]})
    frozen = [p.requires_grad_(True) for p in tables if not p.requires_grad]
    if frozen:
        apply_optimizer_in_backward(torch.optim.SGD, frozen, {"lr": 0.0})
    sharder = EmbeddingBagCollectionSharder()
    plan = sharding_plan(module, sharder, setting["sharding"], setting["plan_seed"], group.size(),
                         setting["local_world_size"], device, group)
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(group), plan=plan, sharders=[sharder],
                                   device=torch.device(device))
    _load_full_state(dmp, initial)
    return dmp


def sgd_on_share(module: Any, data: dict[str, Any], case: dict[str, Any], rank: int, world_size: int,
                 dtype: Any) -> None:
    """`case["steps"]` steps on this rank's contiguous share of the training batch: the gradients outside the tables
    clipped to MAX_NORM before each SGD step, by TorchRec's GradientClippingOptimizer on the ranks (as the setting
    clips) and by clip_grad_norm_ in one process (as the family's root); the fused tables step inside the backward,
    a data-parallel table by plain SGD beside the clipped optimizer."""
    import torch
    from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    frozen = set(case["frozen"])
    named = [(n, p) for n, p in in_backward_optimizer_filter(module.named_parameters()) if p.requires_grad
             and not any(n == f or n.endswith("." + f) for f in frozen)]
    dense = {n: p for n, p in named if not _is_table(n)}
    tables = [p for n, p in named if _is_table(n)]
    if world_size == 1:
        optimizers = [torch.optim.SGD([p for _, p in named], lr=case["lr"])]
    else:
        optimizers = [o for o in (
            GradientClippingOptimizer(KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=case["lr"])),
                                      clipping=GradientClipping.NORM, max_gradient=MAX_NORM, norm_type=CLIP_NORM)
            if dense else None, torch.optim.SGD(tables, lr=case["lr"]) if tables else None) if o is not None]
    share = case["batch"] // world_size
    for _ in range(case["steps"]):
        for optimizer in optimizers:
            optimizer.zero_grad()
        model_loss(module, data, rank * share, (rank + 1) * share, dtype).backward()
        if world_size == 1 and dense:
            torch.nn.utils.clip_grad_norm_(list(dense.values()), MAX_NORM, CLIP_NORM)
        for optimizer in optimizers:
            optimizer.step()


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """The parameters outside the tables, which DMP's data-parallel wrapper replicates: this rank's copy is whole."""
    return {name: t.detach().clone() for name, t in read(wrapped).items() if not _is_table(name)}
