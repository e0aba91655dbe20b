"""torch.nn.utils.clip_grad_norm_ with the infinity norm raises under FSDP2 when a rank's shard of a gradient is empty.

    python repros/clip_grad_norm_inf_empty_shard.py

FSDP2 shards each parameter on dim 0; a Linear(4, 1) has a weight of 1 row and a bias of 1 element, so on 2 ranks one
rank's local shards are empty. torchtitan and FSDP2's docs clip with torch.nn.utils.clip_grad_norm_ on the DTensor
gradients. With norm_type=2 it works; with norm_type=inf the rank whose shards are empty raises
"RuntimeError: _foreach_norm cannot compute the infinity norm on an empty tensor because the operation does not have
an identity" (torch 2.14.1, CPU, gloo). TorchRec filters empty gradients before clipping (torchrec PRs 3809, 3891);
torch's own clip_grad_norm_ does not. Exit 1 while it raises, 0 once both norms clip.
"""

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def rank(rank: int, world: int, norm: float, failed: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 1), mesh=init_device_mesh("cpu", (world,)))
    model(torch.randn(8, 4)).pow(2).mean().backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm)
    except RuntimeError as exc:
        failed.put(f"rank {rank}, norm {norm}: {exc}")
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    failures = mp.get_context("spawn").SimpleQueue()
    raised = False
    for norm in (2.0, math.inf):
        mp.spawn(rank, args=(2, norm, failures), nprocs=2)
        said = []
        while not failures.empty():
            said.append(failures.get())
        raised |= bool(said)
        print(f"norm_type={norm}: " + ("raises" if said else "clips") + "".join(f"\n  {line}" for line in said))
    sys.exit(1 if raised else 0)
