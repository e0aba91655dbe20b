"""scaled_dot_product_attention on DTensors sharded over the heads raises on the CPU: DTensor has no sharding strategy
for the CPU flash-attention kernel.

    python repros/dtensor_sdpa_cpu_no_strategy.py

Tensor parallelism shards attention over its heads; with the column-wise projections' outputs kept DTensors
(`ColwiseParallel(use_local_output=False)`, the remedy for uneven widths in pytorch#150336), q, k and v reach
`F.scaled_dot_product_attention` as DTensors sharded on the heads. On CUDA, DTensor has strategies for the flash and
memory-efficient kernels (pytorch#120298, #122996); on the CPU the dispatcher picks
`aten._scaled_dot_product_flash_attention_for_cpu`, for which it has none: "NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" (torch 2.14.1,
gloo, and on 2.6.0 and 2.12.1). Exit 1 while it raises, 0 once it runs (its distance to one process printed).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def rank(rank: int, world: int, said: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29521")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))  # (batch, heads, positions, head dim)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh("cpu", (world,))
    try:
        out = F.scaled_dot_product_attention(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)),
                                             is_causal=True)
        if rank == 0:
            said.put(f"runs, {(out.full_tensor() - expected).abs().max().item():.3g} off one process")
    except NotImplementedError as exc:
        if rank == 0:
            said.put(f"NotImplementedError: {str(exc).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    lines = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank, args=(2, lines), nprocs=2)
    line = lines.get()
    broken = line.startswith("NotImplementedError")
    print(line + ("\nBUG PRESENT" if broken else "\nok"))
    sys.exit(1 if broken else 0)
