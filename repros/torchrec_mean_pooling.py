"""Standalone reproducer (torch + torchrec only) of three silent TorchRec inconsistencies found by difftest.

  python repros/torchrec_mean_pooling.py grid      # GRID_SHARD + MEAN pooling: per-row-shard means are summed
  python repros/torchrec_mean_pooling.py mixed     # a ROW_WISE MEAN table corrupts a TABLE_WISE SUM table beside it
  python repros/torchrec_mean_pooling.py row       # two ROW_WISE tables (SUM or MEAN) in one collection: every pooled
                                                   # embedding comes out scaled by exactly (1 - 2**-20), a single-id
                                                   # SUM bag included
  python repros/torchrec_mean_pooling.py row1      # the control: only b row-wise (a table-wise) is exact

Two gloo ranks on CPU; prints the max |sharded - unsharded| pooled embedding per feature (expected: ~0).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655", LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=8, embedding_dim=4, feature_names=["fa"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="b", num_embeddings=8, embedding_dim=4, feature_names=["fb"], pooling=PoolingType.SUM),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables)
    plan_of = {"grid": {"a": sp.grid_shard(host_indexes=[0]), "b": sp.grid_shard(host_indexes=[0])},
               "mixed": {"a": sp.row_wise(), "b": sp.table_wise(rank=0)},
               "row": {"a": sp.row_wise(), "b": sp.row_wise()},
               "row1": {"a": sp.table_wise(rank=0), "b": sp.row_wise()}}[case]
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"": sp.construct_module_sharding_plan(ebc, plan_of, sharder=sharder, local_size=2, world_size=2, device_type="cpu")})
    sharded = DistributedModelParallel(EmbeddingBagCollection(tables=tables), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       plan=plan, sharders=[sharder], device=torch.device("cpu"))
    with torch.no_grad():  # give the shards the unsharded weights
        for name, value in sharded.state_dict().items():
            full = ebc.state_dict()[name]
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r:r + h, c:c + w])
    # one bag per feature whose ids live in both row shards (rows 0-3 on rank 0, 4-7 on rank 1)
    # and, last, a bag of the one id 6 of table b: a SUM bag of one row is that row, exactly
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["fa", "fb"], values=torch.tensor([1, 6, 2, 7, 5, 6]),
                                              lengths=torch.tensor([2, 1, 2, 1]))
    got, want = sharded(kjt).to_dict(), ebc(kjt).to_dict()
    if rank == 0:
        for feature in ("fa", "fb"):
            print(f"{case}: feature {feature}: max|sharded - unsharded| = {(got[feature] - want[feature]).abs().max().item():.4g}")
        row = ebc.state_dict()["embedding_bags.b.weight"][6]
        print(f"{case}: bag [6] of b: sharded / row - 1 = {(got['fb'][1] / row - 1).tolist()} "
              f"(unsharded: {(want['fb'][1] / row - 1).tolist()})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1] if len(sys.argv) > 1 else "grid",), nprocs=2)
