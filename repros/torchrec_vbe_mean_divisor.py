"""Standalone reproducer (torch + torchrec only): a variable-batch (VBE) KeyedJaggedTensor through an
EmbeddingBagCollection that mixes a SUM and a MEAN table, both sharded row-wise over two gloo ranks on CPU.

  python repros/torchrec_vbe_mean_divisor.py          # features (fa SUM, fm MEAN, fb SUM): IndexError
  python repros/torchrec_vbe_mean_divisor.py control  # the same with fm SUM: pools as the unsharded collection

Each rank sends, for its 3 samples, each feature's distinct bags once (`stride_per_key_per_rank`, `inverse_indices`).
Row-wise sharding puts the SUM features before the MEAN ones (fa, fb, fm), and `_create_mean_pooling_divisor`
(torchrec/distributed/embeddingbag.py) puts the inverse indices in that order only when the number of keys differs:
here it does not, so each feature's inverse indices are offset by another feature's stride and the index goes out of
range. Exit 1 while it raises or the pooled embeddings differ, 0 once they agree.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, case: str, folder: str) -> None:
    try:
        compare(rank, case, folder)
    except Exception as exc:  # anything but the bug: this script could not show it
        print(f"rank {rank}: could not run: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        os._exit(2)


def compare(rank: int, case: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    middle = PoolingType.SUM if case == "control" else PoolingType.MEAN
    tables = [EmbeddingBagConfig(name="a", num_embeddings=8, embedding_dim=4, feature_names=["fa"]),
              EmbeddingBagConfig(name="m", num_embeddings=8, embedding_dim=4, feature_names=["fm"], pooling=middle),
              EmbeddingBagConfig(name="b", num_embeddings=8, embedding_dim=4, feature_names=["fb"])]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables)
    sharder = EmbeddingBagCollectionSharder()
    tables_plan = sp.construct_module_sharding_plan(ebc, {t.name: sp.row_wise() for t in tables}, sharder=sharder,
                                                    local_size=2, world_size=2, device_type="cpu")
    for table in tables_plan.values():  # the lookup TorchRec trains with (fused SGD): the dense one takes no VBE
        table.compute_kernel = "fused"
    plan = ShardingPlan({"": tables_plan})
    sharded = DistributedModelParallel(EmbeddingBagCollection(tables=tables), plan=plan, sharders=[sharder],
                                       env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
    with torch.no_grad():  # the unsharded weights in the shards
        for name, value in sharded.state_dict().items():
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(ebc.state_dict()[name][r:r + h, c:c + w])
    # 3 samples per rank, and per feature as many distinct bags as the rank has (each sample's bag: `inverse`)
    keys = ["fa", "fm", "fb"]
    if rank == 0:
        ids = {"fa": [[1, 6], [5], [2]], "fm": [[2, 7]], "fb": [[0], [3, 4]]}
        inverse = {"fa": [0, 1, 2], "fm": [0, 0, 0], "fb": [0, 1, 1]}
    else:
        ids = {"fa": [[3], [4, 0]], "fm": [[6], [1], [7, 5]], "fb": [[2, 2]]}
        inverse = {"fa": [0, 1, 1], "fm": [0, 1, 2], "fb": [0, 0, 0]}
    vbe = KeyedJaggedTensor(keys=keys, values=torch.tensor([i for f in keys for b in ids[f] for i in b]),
                            lengths=torch.tensor([len(b) for f in keys for b in ids[f]]),
                            stride_per_key_per_rank=[[len(ids[f])] for f in keys],
                            inverse_indices=(keys, torch.tensor([inverse[f] for f in keys])))
    every_bag = KeyedJaggedTensor.from_lengths_sync(  # the same 3 samples, each bag written out
        keys=keys, values=torch.tensor([i for f in keys for s in inverse[f] for i in ids[f][s]]),
        lengths=torch.tensor([len(ids[f][s]) for f in keys for s in inverse[f]]))
    try:
        got = sharded(vbe).to_dict()
    except IndexError as exc:  # the bug; a peer that loses this rank fails otherwise, and only this one says why
        print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    want = ebc(every_bag).to_dict()
    worst = max((got[f] - want[f]).abs().max().item() for f in keys)
    print(f"rank {rank}: max|sharded - unsharded| = {worst:.3g}", flush=True)
    dist.barrier()
    os._exit(1 if worst > 1e-6 else 0)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.start_processes(run, args=(sys.argv[1] if len(sys.argv) > 1 else "mean", folder), nprocs=2,
                               start_method="fork")
        except mp.ProcessExitedException as exc:  # the first rank to exit non-zero: 1 is the bug, 2 anything else
            print("BUG PRESENT" if exc.exit_code == 1 else f"could not run (exit {exc.exit_code})")
            sys.exit(1 if exc.exit_code == 1 else 2)
    print("ok: VBE pools as the unsharded collection")
