"""FSDP2 over parameters that are DTensors on its own mesh (`fully_shard(..., dp_mesh_dims=...)`, and
`replicate_with_fsdp.replicate`) averages a gradient DTensor has left as a pending sum over the data-parallel
dimension: with the batch sharded on that dimension, every gradient is 1/ranks of the loss's.

    python repros/fsdp2_dp_mesh_dims_partial_grad_averaged.py

A 4-8-2 MLP whose parameters `distribute_module` made replicated DTensors on a 1-D mesh "dp" of 2 ranks, wrapped by
`fully_shard(mlp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))`; the batch of 12 distributed
`Shard(0)` on "dp", the loss `((mlp(x) - y) ** 2).mean()` computed on the DTensors. The loss equals one process's;
each parameter's gradient is 0.5x one process's (3 ranks: 1/3). DTensor computes the weight gradients of a
batch-sharded matmul as `Partial` sums over "dp"; FSDP keeps Partial on its data-parallel dimensions "so FSDP's
reduce-scatter handles them directly" (`FSDPParam._get_grad_inner_tensor`,
torch/distributed/fsdp/_fully_shard/_fsdp_param.py) and then reduces them as it reduces per-rank gradients: an
average, which divides the pending sum by the ranks again. The same batch given to each rank as its own share,
declared `Replicate` (what torch's own test does), trains right. Exit 1 while the gradients are off one process
beyond rounding; 0 once they agree (a release without `DataParallelMeshDims` cannot run it: exit 0 with its words).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def rank(rank: int, world: int, wrap: str, folder: str, said: "mp.SimpleQueue") -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{wrap}-{world}", rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    torch.manual_seed(1)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    alone = model()
    ((alone(x) - y) ** 2).mean().backward()
    try:
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        sharded = model()
        distribute_module(sharded, mesh)  # every parameter a replicated DTensor on the mesh
        if wrap == "fully_shard":
            fully_shard(sharded, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(sharded, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
        loss = ((sharded(distribute_tensor(x, mesh, [Shard(0)])) - distribute_tensor(y, mesh, [Shard(0)])) ** 2).mean()
        loss.backward()
        value = loss.full_tensor()
        gradients = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    except ImportError as exc:  # a release without DataParallelMeshDims: not this bug
        if rank == 0:
            said.put((False, f"{wrap} on {world} ranks cannot run here: {exc}"))
        os._exit(0)
    if rank == 0:
        ratios = [(gradients[name] / p.grad).mean().item() for name, p in alone.named_parameters()]
        off = any(not torch.allclose(gradients[name], p.grad, rtol=1e-5, atol=1e-7)
                  for name, p in alone.named_parameters())
        said.put((off, f"{wrap} on {world} ranks: loss {value.item():.6f} (one process "
                       f"{((alone(x) - y) ** 2).mean().item():.6f}), gradients "
                       f"{min(ratios):.4g}..{max(ratios):.4g} times one process's"))
    dist.barrier()
    os._exit(0)  # without gloo's teardown, which now and then aborts a rank after the work is done


if __name__ == "__main__":
    print("torch", torch.__version__)
    lines = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:  # the ranks meet in a file: no port to share with anything
        for wrap, world in (("fully_shard", 2), ("fully_shard", 3), ("replicate", 2)):
            mp.spawn(rank, args=(world, wrap, folder, lines), nprocs=world)
    printed = []
    while not lines.empty():
        printed.append(lines.get())
    print("\n".join(line for _, line in printed))
    broken = any(off for off, _ in printed)
    print("BUG PRESENT" if broken else "ok")
    sys.exit(1 if broken else 0)
