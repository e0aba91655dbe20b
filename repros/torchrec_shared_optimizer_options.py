"""Two fused optimizers given one options dict: DistributedModelParallel trains both tables with the first one's.

    python repros/torchrec_shared_optimizer_options.py

Two EmbeddingBagCollection tables, one trained by TorchRec's RowWiseAdagrad and one by torch.optim.Adagrad inside
backward (`apply_optimizer_in_backward`), both given the same options dict `{"lr": 0.1, "eps": 1e-8}` as a user with
shared hyperparameters writes it, sharded table-wise by DistributedModelParallel on one CPU rank (gloo), one step,
against the two optimizers on the unsharded tables. torch's apply_optimizer_in_backward keeps the caller's dict; the
sharder writes `optimizer` (and `learning_rate` for `lr`) into it while sharding the first table, and since
meta-pytorch/torchrec#3865 ("preserve explicit optimizer type") an `optimizer` already in the dict wins over the
parameter's class: the Adagrad table gets fused row-wise Adagrad, silently.
Exit status 1 while the second table's optimizer is not the one it was given.
"""
import logging
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

OPTIONS = {"lr": 0.1, "eps": 1e-8}


def tables():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=6,
                                                             feature_names=[f"f{i}"]) for i in range(2)])


def batch():
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor([0, 1, 2, 1, 3, 4, 1, 1]),
                                               lengths=torch.tensor([2, 1, 1, 2, 1, 1]))


def loss(pooled):  # a gradient that differs from column to column: row-wise and element-wise Adagrad then differ
    return ((pooled.values() * torch.arange(1.0, 9.0)) ** 2).sum()


def main():
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torchrec
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    module = tables()
    initial = {name: value.detach().clone() for name, value in module.state_dict().items()}
    options = dict(OPTIONS)  # one dict, given to both
    apply_optimizer_in_backward(RowWiseAdagrad, [module.embedding_bags["t0"].weight], options)
    apply_optimizer_in_backward(torch.optim.Adagrad, [module.embedding_bags["t1"].weight], options)
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"": construct_module_sharding_plan(module, {"t0": table_wise(rank=0), "t1": table_wise(rank=0)},
                                                            sharder=sharder, local_size=1, world_size=1,
                                                            device_type="cpu")})
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device("cpu"))
    with torch.no_grad():  # DMP initialises the shards anew: the unsharded tables' weights again
        for name, value in dmp.state_dict().items():
            value.local_shards()[0].tensor.copy_(initial[name])
    loss(dmp(batch())).backward()  # the fused optimizers step inside it
    reference = tables()
    steps = [RowWiseAdagrad([reference.embedding_bags["t0"].weight], **OPTIONS),
             torch.optim.Adagrad([reference.embedding_bags["t1"].weight], **OPTIONS)]
    loss(reference(batch())).backward()
    for step in steps:
        step.step()
    print(f"torch {torch.__version__}, torchrec {torchrec.__version__}; the options dict after sharding: {options}")
    states = dmp.fused_optimizer.state_dict()["state"]
    off = {}
    for table, given in (("t0", "RowWiseAdagrad"), ("t1", "Adagrad")):
        name = f"embedding_bags.{table}.weight"
        off[table] = (dmp.state_dict()[name].local_shards()[0].tensor - reference.state_dict()[name]).abs().max().item()
        state = states[name][f"{table}.momentum1"].local_shards()[0].tensor
        print(f"{table} given {given:14}: fused state {tuple(state.shape)}, weights off by {off[table]:.3g}")
    dist.destroy_process_group()
    wrong = off["t1"] > 1e-6 and off["t0"] <= 1e-6
    print("BUG PRESENT" if wrong else "ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
