"""A TorchRec sharding finding's standalone script: the embedding collections alone, sharded by
DistributedModelParallel on the script's ranks and unsharded in one process (copied into the script as they are)."""

from __future__ import annotations

from typing import Any

import numpy as np

from difftest import StandaloneCase
from settings._torchrec_plan import _load_full_state, sharding_plan


def embedding_script_data(case: StandaloneCase, tables: list[Any],
                          parts: tuple[str, ...] = ("eval",)) -> tuple[dict[str, np.ndarray], list[dict]]:
    """What a script of embedding collections ships: the tables' initial weights and the bags of the batches `parts`
    names (its data file), and each table as a literal (its `CASE["tables"]`)."""
    data = {f"state.{t.state_key}": case.init_state[t.state_key] for t in tables}
    for part in parts:
        for feature, bags in case.inputs[part].sparse.items():
            data |= {f"{part}.{feature}.lengths": bags.lengths, f"{part}.{feature}.values": bags.values}
            if bags.weights is not None:
                data[f"{part}.{feature}.weights"] = bags.weights
    return data, [{"collection": t.collection, "name": t.name, "num_embeddings": t.num_embeddings,
                   "embedding_dim": t.embedding_dim, "pooling": t.pooling, "features": list(t.features),
                   "weighted": t.weighted, "outputs": list(t.outputs)} for t in tables]


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def standalone_tables(case: dict[str, Any]) -> Any:
    """The model's embedding collections alone, each under the path the model gives it (a collection nested inside
    the model, `sparse_arch.embedding_bag_collection`, under empty modules of those names)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Tables(torch.nn.Module):
        def forward(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
            return {k: v for path, kjt in features.items() for k, v in self.get_submodule(path)(kjt).to_dict().items()}

    module = Tables()
    for path in dict.fromkeys(t["collection"] for t in case["tables"]):
        mine = [t for t in case["tables"] if t["collection"] == path]
        configs = [EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                                      feature_names=list(t["features"]), pooling=PoolingType[t["pooling"]]) for t in mine]
        *outer, name = path.split(".")
        parent = module
        for part in outer:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent.get_submodule(part)
        parent.add_module(name, EmbeddingBagCollection(tables=configs, is_weighted=mine[0]["weighted"],
                                                       device=torch.device(case["device"])))
    return module


def standalone_features(data: dict[str, Any], case: dict[str, Any], start: int, stop: int, dtype: Any,
                        variable: bool = False, part: str = "eval") -> dict:
    """Samples start..stop of the evaluation batch (or the `part` named so in the data): one KeyedJaggedTensor per
    collection, keyed in table order, every bag written out or (`variable`) each feature's runs of equal bags once
    (`bag_runs_kjt`)."""
    features = {}
    for path in dict.fromkeys(t["collection"] for t in case["tables"]):
        bags = {}
        for f in [f for t in case["tables"] if t["collection"] == path for f in t["features"]]:
            lengths = data[f"{part}.{f}.lengths"]
            lo, hi = np.concatenate([[0], np.cumsum(lengths)])[[start, stop]]
            weights = data.get(f"{part}.{f}.weights")
            bags[f] = (lengths[start:stop], data[f"{part}.{f}.values"][lo:hi], None if weights is None else weights[lo:hi])
        features[path] = bag_runs_kjt(bags, variable, dtype)
    return features


def bag_runs_kjt(bags: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]], variable: bool, dtype: Any) -> Any:
    """One KeyedJaggedTensor of `bags` (feature → its samples' bags: lengths, values, weights or None): every bag
    written out, or (`variable`: TorchRec's variable batch per feature) each run of equal consecutive bags once, its
    `stride_per_key_per_rank` the runs' count and every sample's run its inverse index."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values, weights, strides, inverse = [], [], [], [], []
    for bag_lengths, bag_values, bag_weights in bags.values():
        starts = np.concatenate([[0], np.cumsum(bag_lengths)])
        bag = [(bag_values[starts[i]:starts[i + 1]], None if bag_weights is None else bag_weights[starts[i]:starts[i + 1]])
               for i in range(len(bag_lengths))]
        runs = [i for i in range(len(bag)) if not variable or i == 0 or not (
            np.array_equal(bag[i][0], bag[i - 1][0]) and (bag_weights is None or np.array_equal(bag[i][1], bag[i - 1][1])))]
        lengths.append(bag_lengths[runs])
        values += [bag[i][0] for i in runs]
        weights += [bag[i][1] for i in runs] if bag_weights is not None else []
        strides.append([len(runs)])
        inverse.append(np.searchsorted(runs, np.arange(len(bag)), side="right") - 1)
    keys, options = list(bags), {"weights": torch.from_numpy(np.concatenate(weights)).to(dtype)} if weights else {}
    if not variable:
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                                                   lengths=torch.from_numpy(np.concatenate(lengths)), **options)
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                             lengths=torch.from_numpy(np.concatenate(lengths)), stride_per_key_per_rank=strides,
                             inverse_indices=(keys, torch.from_numpy(np.stack(inverse))), **options)


def _pooled(pooled: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: pooled[f].detach().cpu().numpy() for t in case["tables"] for f, name in zip(t["features"], t["outputs"])}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections on the whole batch, in `dtype`."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    with torch.no_grad():
        return _pooled(tables.to(dtype)(standalone_features(data, case, 0, case["batch"], dtype)), case)


def script_sharder(case: dict[str, Any]) -> Any:
    """What shards the collections: TorchRec's bag sharder, its pooled embeddings' collectives (and their gradients')
    quantized by fbgemm's codecs where the case names their precisions (`CASE["qcomms"]`: forward, backward)."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    if not case.get("qcomms"):
        return EmbeddingBagCollectionSharder()
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    forward, backward = case["qcomms"]
    config = QCommsConfig(forward_precision=CommType[forward], backward_precision=CommType[backward])
    # the device only decides TorchRec's bf16 fallback to fp16 (gloo has no bf16 codec), which fp16 and fp32 never take
    return EmbeddingBagCollectionSharder(
        qcomm_codecs_registry=get_qcomm_codecs_registry(config, device=torch.device("cpu")))


def sharded_tables(module: Any, sharder: Any, data: dict[str, Any], case: dict[str, Any], world_size: int) -> Any:
    """`module`'s collections sharded by DistributedModelParallel under the case's plan over the script's ranks, each
    rank's shards holding the case's initial weights (TorchRec initialises shards afresh)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    plan = sharding_plan(module, sharder, case["sharding"], case.get("plan_seed", 0), world_size,
                         case["local_world_size"], case["device"], dist.group.WORLD)
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device(case["device"]))
    _load_full_state(dmp, {k[len("state."):]: v for k, v in data.items() if k.startswith("state.")})
    return dmp


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the collections; each rank pools its share of the batch."""
    import torch
    import torch.distributed as dist

    module = standalone_tables(case)
    # the tables trained by fused SGD at the run's learning rate, a frozen one at 0, as the setting shards them
    # (sharded without an optimizer fused in, a variable batch's output dist on the CPU fails on its own: "Split sizes
    # doesn't match")
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    frozen = set(case.get("frozen", ()))
    for lr, tables in ((case["lr"], [p for n, p in module.named_parameters() if n not in frozen]),
                       (0.0, [p for n, p in module.named_parameters() if n in frozen])):
        if tables:
            apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": lr})
    dmp = sharded_tables(module, script_sharder(case), data, case, world_size)
    share = case["batch"] // world_size
    with torch.no_grad():
        mine = _pooled(dmp(standalone_features(data, case, rank * share, (rank + 1) * share, torch.float32,
                                               variable=case.get("variable_batch", False))), case)
    shares = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {name: np.concatenate([s[name] for s in shares]) for name in mine} if shares else None
