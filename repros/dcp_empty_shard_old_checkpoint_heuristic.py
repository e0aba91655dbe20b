"""A TorchRec model and its fused optimizer, saved and loaded with torch.distributed.checkpoint under the same plan,
cannot be loaded back on a rank that holds no table.

    python repros/dcp_empty_shard_old_checkpoint_heuristic.py

One EmbeddingBagCollection table (6 rows × 4 columns) sharded table-wise on rank 0 of 2 CPU ranks (gloo), trained by
fused row-wise Adagrad (`apply_optimizer_in_backward`). Every rank saves `{"model": dmp.state_dict(), "optimizer":
dmp.fused_optimizer.state_dict()}` with `dcp.save`, then the same ranks load it back into the same model with
`dcp.load`. Rank 1 holds no shard: its model entry is a ShardedTensor without local shards, which DCP's flattening
drops, and its optimizer entry is `{"state": {}}`. Seeing checkpoint keys its flattened state lacks, DCP's load
planner takes the checkpoint for one written before torch 2.4 (`DefaultLoadPlanner.create_local_plan`), flattens the
state the old way, under which the empty optimizer mapping is a value of its own, and fails: "Missing key in checkpoint
state_dict: optimizer." Exit status 1 while the load fails so, 0 once it succeeds.
"""
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, folder, phase):
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{phase}", rank=rank, world_size=2)
    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=6, embedding_dim=4,
                                                               feature_names=["f0"])], device=torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"": construct_module_sharding_plan(module, {"t0": sp.table_wise(rank=0)}, sharder=sharder,
                                                            local_size=2, world_size=2, device_type="cpu")})
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device("cpu"))
    state = {"model": dmp.state_dict(), "optimizer": dmp.fused_optimizer.state_dict()}
    try:
        if phase == "save":
            dcp.save(state, checkpoint_id=f"{folder}/checkpoint")
        else:
            dcp.load(state, checkpoint_id=f"{folder}/checkpoint")
    except (Exception, dcp.api.CheckpointException) as exc:  # DCP's own is a BaseException: every rank's error
        with open(f"{folder}/{phase}-error-rank{rank}", "w") as out:
            out.write(str(exc).strip().splitlines()[-1])
    dist.barrier()
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as folder:
        for phase in ("save", "load"):
            mp.start_processes(worker, args=(folder, phase), nprocs=2, start_method="fork")
        errors = {f"{phase} rank {rank}": open(f"{folder}/{phase}-error-rank{rank}").read()
                  for phase in ("save", "load") for rank in (0, 1)
                  if os.path.exists(f"{folder}/{phase}-error-rank{rank}")}
    print(f"torch {torch.__version__}; table t0 on rank 0 of 2, saved and loaded under the same plan")
    for where, error in errors.items():
        print(f"{where}: {error}")
    failed = any("Missing key in checkpoint state_dict" in e for e in errors.values())
    print("BUG PRESENT" if failed else "ok: every rank loaded the checkpoint")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
