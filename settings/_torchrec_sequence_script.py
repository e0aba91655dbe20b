"""A sequence-embedding finding's standalone script: the EmbeddingCollections alone, sharded by DistributedModelParallel
on the script's ranks and unsharded in one process (copied into the script as they are)."""

from __future__ import annotations

from typing import Any

import numpy as np

from settings._torchrec_script import sharded_tables


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def standalone_sequence_tables(case: dict[str, Any]) -> Any:
    """The model's tables as EmbeddingCollections, one per collection and dim (`CASE["groups"]`)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class Tables(torch.nn.Module):
        def forward(self, features: dict[str, Any]) -> dict[str, Any]:
            found = {}
            for name, kjt in features.items():
                embedded = self.get_submodule(name)(kjt)
                for feature in kjt.keys():
                    found[feature] = embedded[feature]  # indexing waits for a sharded collection's output
            return found

    module = Tables()
    for group in case["groups"]:
        module.add_module(group["name"], EmbeddingCollection(tables=[
            EmbeddingConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=group["dim"],
                            feature_names=list(t["features"])) for t in group["tables"]],
            device=torch.device(case["device"])))
    return module


def standalone_sequence_features(data: dict[str, Any], case: dict[str, Any], start: int, stop: int) -> dict:
    """Samples start..stop of the evaluation batch: one KeyedJaggedTensor of ids per collection."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    features = {}
    for group in case["groups"]:
        keys = [f for t in group["tables"] for f in t["features"]]
        lengths, values = [], []
        for f in keys:
            bags = data[f"eval.{f}.lengths"]
            lo, hi = np.concatenate([[0], np.cumsum(bags)])[[start, stop]]
            lengths.append(bags[start:stop])
            values.append(data[f"eval.{f}.values"][lo:hi])
        features[group["name"]] = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(lengths)))
    return features


def _sequences(found: dict[str, Any]) -> dict[str, np.ndarray]:
    return {f"seq.{f}": jagged.values().detach().cpu().numpy() for f, jagged in found.items()}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the unsharded collections on the whole batch (a lookup copies weights: exact in any dtype)."""
    import torch

    tables = standalone_sequence_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    with torch.no_grad():
        return _sequences(tables.to(dtype)(standalone_sequence_features(data, case, 0, case["batch"])))


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: DistributedModelParallel over the collections; each rank looks up its share of the batch."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module, sharder = standalone_sequence_tables(case), EmbeddingCollectionSharder(use_index_dedup=case["dedup"])
    # the tables trained by fused SGD, as the setting shards them (sharded without an optimizer fused in, TorchRec's
    # sequence output dist on the CPU fails on its own: "Split sizes doesn't match total dim 0 size")
    apply_optimizer_in_backward(torch.optim.SGD, list(module.parameters()), {"lr": case["lr"]})
    dmp = sharded_tables(module, sharder, data, case, world_size)
    share = case["batch"] // world_size
    with torch.no_grad():
        mine = _sequences(dmp(standalone_sequence_features(data, case, rank * share, (rank + 1) * share)))
    shares = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {name: np.concatenate([s[name] for s in shares]) for name in mine} if shares else None
