"""TorchRec's fused row-wise Adagrad trains a column-wise sharded table differently from the unsharded table.

    python repros/torchrec_rowwise_adagrad_column_shards.py

One EmbeddingBagCollection table (6 rows × 8 columns), trained one step by fused EXACT_ROWWISE_ADAGRAD
(`apply_optimizer_in_backward(RowWiseAdagrad, ...)`) on 2 CPU ranks (gloo), sharded table-wise and column-wise
(two shards of 4 columns), against TorchRec's own `torchrec.optim.RowWiseAdagrad` on the unsharded table in one
process. Table-wise matches; column-wise keeps one accumulator per row *per column shard*, each the mean of g² over
its 4 columns only (the optimizer state has 12 entries, not 6), so every trained row moves by another amount.
Exit status 1 while the column-wise weights differ.
"""
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS, DIM, LR, EPS = 6, 8, 0.1, 1e-8


def quiet():
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def table():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM,
                                                             feature_names=["f0"])], device=torch.device("cpu"))


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([0, 1, 2, 1, 4]),
                                               lengths=torch.tensor([1, 2, 1, 1]))


def loss(pooled):  # a loss whose gradient differs from column to column
    return (pooled.values() * torch.arange(1.0, DIM + 1)).pow(2).sum()


def worker(rank, world_size, folder, kind):
    quiet()
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv-{kind}", rank=rank, world_size=world_size)
    module = table()
    initial = module.embedding_bags["t0"].weight.detach().clone()
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), {"lr": LR, "eps": EPS})
    sharder = EmbeddingBagCollectionSharder()
    generator = sp.table_wise(rank=0) if kind == "table_wise" else sp.column_wise(ranks=[0, 1])
    plan = ShardingPlan({"": construct_module_sharding_plan(module, {"t0": generator}, sharder=sharder,
                                                            local_size=world_size, world_size=world_size,
                                                            device_type="cpu")})
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device("cpu"))
    with torch.no_grad():  # the same initial weights as the unsharded table, in each rank's shard
        for shard in dmp.state_dict()["embedding_bags.t0.weight"].local_shards():
            rows, cols = shard.metadata.shard_offsets
            shard.tensor.copy_(initial[rows:rows + shard.tensor.shape[0], cols:cols + shard.tensor.shape[1]])
    loss(dmp(batch())).backward()  # every rank the whole batch: the gradient is the same as in one process
    weight = torch.zeros(ROWS, DIM)
    for shard in dmp.state_dict()["embedding_bags.t0.weight"].local_shards():
        rows, cols = shard.metadata.shard_offsets
        weight[rows:rows + shard.tensor.shape[0], cols:cols + shard.tensor.shape[1]] = shard.tensor
    dist.all_reduce(weight)  # the shards do not overlap: their sum is the whole table
    state = dmp.fused_optimizer.state_dict()["state"].get("embedding_bags.t0.weight")  # where the table's rows are
    if rank == 0:
        torch.save({"weight": weight, "state_size": state["t0.momentum1"].size()[0]}, f"{folder}/{kind}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main():
    quiet()
    from torchrec.optim import RowWiseAdagrad

    with tempfile.TemporaryDirectory() as folder:  # the ranks first: fork before this process starts torch's threads
        for kind in ("table_wise", "column_wise"):
            mp.start_processes(worker, args=(2, folder, kind), nprocs=2, start_method="fork")
        results = {kind: torch.load(f"{folder}/{kind}.pt", weights_only=True) for kind in ("table_wise", "column_wise")}
    reference = table()
    optimizer = RowWiseAdagrad(reference.parameters(), lr=LR, eps=EPS)
    loss(reference(batch())).backward()
    optimizer.step()
    expected = reference.embedding_bags["t0"].weight.detach()
    print(f"torch {torch.__version__}; unsharded RowWiseAdagrad state: {ROWS} accumulators")
    wrong = False
    for kind, result in results.items():
        off = (result["weight"] - expected).abs().max().item()
        print(f"{kind:12} fused state: {result['state_size']} accumulators; weights off by {off:.3g}")
        wrong |= kind == "column_wise" and off > 1e-6
    print("BUG PRESENT" if wrong else "ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
