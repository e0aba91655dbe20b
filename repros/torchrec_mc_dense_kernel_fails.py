"""A ManagedCollisionEmbeddingBagCollection sharded by DistributedModelParallel under the plan
`construct_module_sharding_plan` builds when no optimizer is fused into the tables (TorchRec's DENSE kernel, which
the collision sharder does not list among its kernels) fails on its first training forward: the sharded module's
eviction resets rows through `reset_embedding_weight_momentum`, which only fbgemm's fused kernel has. One gloo rank,
one table with room for every id. Exit 1 while it fails.

    python repros/torchrec_mc_dense_kernel_fails.py
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
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=16, feature_names=["f0"])]
zch = MCHManagedCollisionModule(zch_size=16, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
                                eviction_interval=1)
module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables),
                                                ManagedCollisionCollection({"t0": zch}, tables))
sharder = ManagedCollisionEmbeddingBagCollectionSharder()
plan = construct_module_sharding_plan(module, {"t0": row_wise()}, sharder=sharder, local_size=1, world_size=1,
                                      device_type="cpu")
dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
sgd = torch.optim.SGD(dmp.parameters(), lr=0.5)
print(f"torch {torch.__version__}, torchrec {__import__('torchrec').__version__}")
print(f"kernel {plan['t0'].compute_kernel!r}; the sharder's kernels: {sharder.compute_kernels('row_wise', 'cpu')}")
kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([3, 5, 7]), lengths=torch.ones(3, dtype=torch.long))
try:
    dmp(kjt)[0]["f0"].sum().backward()
    sgd.step()
except AttributeError as exc:
    print(f"first training step: AttributeError: {exc}\nBUG PRESENT")
    sys.exit(1)
finally:
    dist.destroy_process_group()
print("ok: the first training step ran")
