"""Standalone reproducer (torch only): over gloo, `reduce_scatter_tensor(op=AVG)` returns the SUM on torch 2.7 and
2.8, so FSDP2 (`fully_shard`) on CPU applies world_size times the gradient; torch 2.9.1 and newer average.

    python repros/gloo_reduce_scatter_avg_sums.py          # exits 1 while the bug is present, 0 once gone

Two gloo ranks on CPU. First the collective alone: rank r contributes r + 1 everywhere, so the average is 1.5.
Then what it does to training: a 3-layer MLP sharded with fully_shard, one SGD step (lr 0.1) on a batch split over
the two ranks, against the same step in one process on the whole batch. Upstream: pytorch/pytorch#162338
("Incorrect AVG reduction for GLOO"): gloo emulates reduce-scatter as an all-reduce and kept only this rank's
chunk, but did not pass the requested op on, so the all-reduce summed.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # before torch 2.6 it lived under _composable
    from torch.distributed._composable.fsdp import fully_shard


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


def sgd_step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()


def run(rank: int, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.full((2 * world,), float(rank + 1)), op=dist.ReduceOp.AVG)
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    reference = model()
    sgd_step(reference, x, y)
    sharded = model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    rows = x.shape[0] // world
    sgd_step(sharded, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
    worst = 0.0
    for (name, ours), theirs in zip(sharded.named_parameters(), reference.parameters()):
        full = ours.full_tensor()
        worst = max(worst, (full - theirs).abs().max().item())
        if rank == 0:
            print(f"{name:10s} max |fsdp2 - one process| = {(full - theirs).abs().max().item():.3e}")
    if rank == 0:
        print(f"reduce_scatter_tensor(AVG) of 1 and 2: {out.tolist()} (expected [1.5, 1.5])")
    bug = out[0].item() != 1.5 or worst > 1e-5
    dist.destroy_process_group()
    sys.exit(1 if bug else 0)


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    try:
        mp.spawn(run, args=(port, 2), nprocs=2)
    except mp.ProcessExitedException:
        print("the bug is present: gloo's reduce-scatter AVG summed, and FSDP2's step used the summed gradient")
        sys.exit(1)
    print("ok: gloo's reduce-scatter averaged and FSDP2's step equals one process's")
