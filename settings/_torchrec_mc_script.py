"""A managed-collision finding's standalone script: the model's tables behind the family's collision modules
(`managed_holder`, copied as it is), sharded row-wise by DistributedModelParallel on the script's ranks and unsharded in
one process; each evaluates the batch, trains its steps and evaluates again, and the pooled embeddings of the phase
the finding diverged in are compared."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from difftest import Unsupported
from settings._torchrec_plan import _load_full_state, embedding_collections, table_configs
from settings._torchrec_script import standalone_features, standalone_tables
from settings.torchrec_vbe import pooled_loss

# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
RAW_ID_BASE = 2**40  # past every table: fbgemm's row-wise bucketing sends such an id to rank id mod ranks
SCARCE_SLOTS = 8
BUCKETS = 4  # the planner wants a table's buckets to divide by the ranks (1, 2 and 4 here)


# per capacity, the torchrec.modules.mc_modules eviction policy that frees its slots
EVICTION = {"ample": "LFU_EvictionPolicy", "scarce": "LRU_EvictionPolicy"}
# how the sharded tables train: SGD fused into their backward (TorchRec's FUSED kernel), or no optimizer fused, so
# that `construct_module_sharding_plan` gives them the DENSE kernel and torch.optim.SGD over DMP's parameters steps them
KERNELS = {"fused": "fused into backward", "dense": "on the DENSE kernel, stepped over DMP's parameters"}
# the tables' optimizer, as (module, class, options): TorchRec maps the class to fbgemm's fused kernel; the same class
# trains the unsharded tables. Adagrad's eps is fbgemm's and the reference's alike (their defaults differ).
OPTIMIZERS = {"sgd": ("torch.optim", "SGD", {}), "adagrad": ("torch.optim", "Adagrad", {"eps": 1e-8})}


def managed_slots(capacity: str, rows: int) -> int:
    """The slots of a managed table over `rows` ids: ample, more than any rank can be sent; scarce, 8."""
    return SCARCE_SLOTS if capacity == "scarce" else 4 * (rows + 1)


def _constant_rows(row: Any) -> Callable[[Any], Any]:
    """An `init_fn` writing `row` into every row of the tensor it is given (in place, as torch.nn.init does)."""
    import torch

    def init(weight: Any) -> Any:
        with torch.no_grad():
            return weight.copy_(row.to(weight.dtype).expand_as(weight))

    return init


def managed_holder(module: Any, capacity: str) -> Any:
    """The model's bag collections, each as a managed-collision collection of its tables under its own path (dots
    as `_`); `features`: path → its features. Its forward takes a KeyedJaggedTensor per path (the model's ids) and
    returns each collection's pooled embeddings by feature."""
    import torch
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.modules import mc_modules
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    class Collections(torch.nn.Module):
        def forward(self, kjts: dict[str, Any]) -> dict[str, dict[str, Any]]:
            pooled = {}
            for path, kjt in kjts.items():
                raw = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() + RAW_ID_BASE, lengths=kjt.lengths(),
                                        weights=kjt.weights_or_none())
                pooled[path] = self.get_submodule(path.replace(".", "_"))(raw)[0].to_dict()  # as held below
            return pooled

    holder = Collections()
    holder.features = {}
    for path, collection in embedding_collections(module).items():
        if not isinstance(collection, EmbeddingBagCollection):
            raise Unsupported(f"{path} is a sequence collection; this family manages bag collections")
        weights = collection.state_dict()
        dtype, device = next(iter(weights.values())).dtype, next(iter(weights.values())).device
        configs = [dataclasses.replace(config, num_embeddings=managed_slots(capacity, config.num_embeddings),
                                       init_fn=_constant_rows(weights[f"embedding_bags.{config.name}.weight"][0]))
                   for config in table_configs(collection)]
        bags = EmbeddingBagCollection(tables=configs, device=device).to(dtype)
        if "forward" in vars(collection):  # pool as the model's collection was made to (the float64 centre's own)
            bags.forward = types.MethodType(vars(collection)["forward"].__func__, bags)
        managers = {config.name: mc_modules.MCHManagedCollisionModule(
            zch_size=config.num_embeddings, device=device, eviction_policy=getattr(mc_modules, EVICTION[capacity])(),
            eviction_interval=1, buckets=BUCKETS) for config in configs}
        name = path.replace(".", "_")
        holder.add_module(name, ManagedCollisionEmbeddingBagCollection(
            bags, mc_modules.ManagedCollisionCollection(managers, configs)))
        holder.features[name] = [f for config in configs for f in config.feature_names]
    return holder


def managed_plan(module: Any, sharder: Any, world_size: int, local_size: int, device: str) -> Any:
    """Every table row-wise, keyed by the managed collection (not the bag collection inside it)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    plans = {}
    for path in module.features:
        managed = getattr(module, path)
        tables = [config.name for config in managed._managed_collision_collection.embedding_configs()]
        plans[path] = construct_module_sharding_plan(managed, {t: row_wise() for t in tables}, sharder=sharder,
                                                     local_size=local_size, world_size=world_size,
                                                     device_type=device.split(":")[0])
    return ShardingPlan(plans)


def table_rows(state: dict) -> set[str]:
    """The names of the tables' rows among a managed holder's state: what is loaded into its shards (the collision
    modules start empty on each rank, as TorchRec builds them for its segment)."""
    return {name for name in state if name.endswith(".weight")}


def managed_tables(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> Any:
    """The case's tables with their initial weights, in `dtype`, behind the family's collision modules."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    return managed_holder(tables.to(dtype), case["capacity"])


def table_optimizer(case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The tables' optimizer class (what TorchRec maps to its fused kernel) and its options."""
    import importlib

    module, name, options = OPTIMIZERS[case["optimizer"]]
    return getattr(importlib.import_module(module), name), {"lr": case["lr"], **options}


def pooled_phases(holder: Any, data: dict[str, Any], case: dict[str, Any], start: int, stop: int, dtype: Any,
                  step: Any) -> dict[str, np.ndarray]:
    """Samples start..stop pooled before the steps, then `case["steps"]` steps on the training batch (its loss the
    mean over those samples, `step` after each backward), then pooled again: `<phase>/pooled.<feature>` → values."""
    import torch

    def pooled(part: str) -> dict[str, Any]:
        found = holder(standalone_features(data, case, start, stop, dtype, part=part))
        return {f"pooled.{f}": v for by_feature in found.values() for f, v in by_feature.items()}

    found = {f"eval_before/{k}": v.detach().cpu().numpy() for k, v in pooled("eval").items()}
    for _ in range(case["steps"]):
        pooled_loss(pooled("train"), stop - start).backward()
        step()
    with torch.no_grad():
        after = pooled("eval")
    return found | {f"eval_after_step{case['steps']}/{k}": v.detach().cpu().numpy() for k, v in after.items()}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the managed tables unsharded, in `dtype`, trained by the case's optimizer on the whole batch."""
    holder = managed_tables(data, case, dtype)
    optimizer_class, options = table_optimizer(case)
    optimizer = optimizer_class(list(holder.parameters()), **options)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return pooled_phases(holder, data, case, 0, case["batch"], dtype, step)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the managed tables, every table row-wise, trained by the case's
    optimizer (fused inside backward, or SGD over DMP's parameters where `case["kernel"]` is dense); each rank on its
    share of the batch; the shares gathered on rank 0."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    holder = managed_tables(data, case, torch.float32)
    state = {name: value.detach().numpy().copy() for name, value in holder.state_dict().items()}
    if case["kernel"] == "fused":
        optimizer_class, options = table_optimizer(case)
        apply_optimizer_in_backward(optimizer_class, list(holder.parameters()), options)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    plan = managed_plan(holder, sharder, world_size, case["local_world_size"], case["device"])
    dmp = DistributedModelParallel(holder, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device(case["device"]))
    _load_full_state(dmp, state, table_rows(state))
    optimizer = torch.optim.SGD(list(dmp.parameters()), lr=case["lr"]) if case["kernel"] == "dense" else None

    def step() -> None:  # a fused kernel updated its rows inside backward
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()

    share = case["batch"] // world_size
    mine = pooled_phases(dmp, data, case, rank * share, (rank + 1) * share, torch.float32, step)
    shares = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {name: np.concatenate([s[name] for s in shares]) for name in mine} if shares else None
