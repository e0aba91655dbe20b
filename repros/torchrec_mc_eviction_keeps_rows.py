"""An id admitted by a managed-collision table into an evicted row inherits the evicted id's trained embedding when
the ManagedCollisionEmbeddingBagCollection is unsharded (its `evict()` is a stub), and gets the table's `init_fn`
row when DistributedModelParallel shards it (one gloo rank here). Exit 1 while they differ.

    python repros/torchrec_mc_eviction_keeps_rows.py
"""

import sys
import tempfile

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import LRU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

ROW = torch.tensor([0.5, -0.25, 1.0, 0.125])
BATCHES = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]]  # 8 rows: 7 ids and the miss row


def init(weight):
    with torch.no_grad():
        return weight.copy_(ROW.expand_as(weight))


def managed():
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8, feature_names=["f0"], init_fn=init)]
    zch = MCHManagedCollisionModule(zch_size=8, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
                                    eviction_interval=1)
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables),
                                                  ManagedCollisionCollection({"t0": zch}, tables))


def train(module, step):
    """SGD (lr 0.5) on the sum of the pooled embeddings of each batch; the first id's embedding in the last one."""
    for ids in BATCHES:
        kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.long))
        pooled = module(kjt)[0]["f0"]
        pooled.sum().backward()
        step()
    return pooled[0].detach()


unsharded = managed()
sgd = torch.optim.SGD(unsharded.parameters(), lr=0.5)
plain = train(unsharded, lambda: (sgd.step(), sgd.zero_grad()))

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
module = managed()
apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.5})
sharder = ManagedCollisionEmbeddingBagCollectionSharder()
plan = ShardingPlan({"": construct_module_sharding_plan(module, {"t0": row_wise()}, sharder=sharder, local_size=1,
                                                        world_size=1, device_type="cpu")})
dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=[sharder])
for name, value in dmp.state_dict().items():  # DMP initialises the kernel's rows afresh
    if name.endswith("embedding_bags.t0.weight"):
        for shard in value.local_shards():
            init(shard.tensor)
sharded = train(dmp, lambda: None)
dist.destroy_process_group()

print(f"torch {torch.__version__}, torchrec {__import__('torchrec').__version__}")
print("id 21, admitted into the row id 11 trained in, embedding before its first update:")
print(f"  unsharded: {plain.tolist()}\n  sharded:   {sharded.tolist()}\n  init row:  {ROW.tolist()}")
differ = not torch.equal(plain, sharded)
print("BUG PRESENT" if differ else "ok")
sys.exit(1 if differ else 0)
