"""DTensor's losses with a fused backward (mse_loss, smooth_l1_loss, huber_loss, binary_cross_entropy,
soft_margin_loss) give a batch-sharded input a gradient as many times too large as there are ranks.

    python repros/dtensor_loss_backward_local_numel.py

A (4, 3) prediction sharded Shard(0) over 2 ranks, its target likewise, `F.mse_loss(..., reduction="mean")`: the
loss is right, but each rank's gradient is 2 (x - y) / 6, its shard's element count, not / 12 — twice the gradient of
the same loss in one process (torch 2.14.1, CPU, gloo; 3 ranks: 3 times). Such ops have no sharding strategy of their
own; DTensor derives one from the op's decomposition (pytorch#171652) and runs the fused backward on each shard,
where `mse_loss_backward`'s `2 / input.numel()` counts the local elements. With 5 rows (shards of 3 and 2) the loss is
wrong too: the mean of the two shards' means. `(x - y).pow(2).mean()` and `F.l1_loss` are right. Exit 1 while any of
these losses is off one process beyond rounding; 0 once they all agree (or, as on 2.6.0, raise for want of a
sharding strategy).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

LOSSES = {"mse_loss": F.mse_loss, "smooth_l1_loss": F.smooth_l1_loss, "huber_loss": F.huber_loss,
          "binary_cross_entropy": F.binary_cross_entropy, "soft_margin_loss": F.soft_margin_loss,
          "(x - y).pow(2).mean()": lambda x, y: (x - y).pow(2).mean()}


def rank(rank: int, world: int, rows: int, folder: str, said: "mp.SimpleQueue") -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous{rows}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x, y = torch.rand(rows, 3, dtype=torch.float64) * 0.9 + 0.05, torch.rand(rows, 3, dtype=torch.float64)
    for name, loss in LOSSES.items():
        alone = x.clone().requires_grad_(True)
        expected = loss(alone, y)
        expected.backward()
        sharded = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(True)
        try:
            got = loss(sharded, distribute_tensor(y, mesh, [Shard(0)]))
            got.backward()
            value, gradient = got.full_tensor(), sharded.grad.full_tensor()
        except Exception as exc:  # a release without a sharding strategy for it, or gloo's AVG (2.6.0): not this bug
            if rank == 0:
                said.put((False, f"{rows} rows on {world} ranks, {name}: raises {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0]}"))
            continue
        if rank == 0:
            ratio = (gradient / alone.grad).flatten()
            off = not (torch.allclose(value, expected) and torch.allclose(gradient, alone.grad))
            said.put((off, f"{rows} rows on {world} ranks, {name}: loss {value.item():.6f} (one process "
                           f"{expected.item():.6f}), gradient {ratio.min().item():.3g}..{ratio.max().item():.3g} "
                           f"times one process's"))
    dist.barrier()
    os._exit(0)  # without gloo's teardown, which now and then aborts a rank after the work is done


if __name__ == "__main__":
    print("torch", torch.__version__)
    lines = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:  # the ranks meet in a file: no port to share with anything
        for rows in (4, 5):
            mp.spawn(rank, args=(2, rows, folder, lines), nprocs=2)
    printed = []
    while not lines.empty():
        printed.append(lines.get())
    print("\n".join(line for _, line in printed))
    broken = any(off for off, _ in printed)
    print("BUG PRESENT" if broken else "ok")
    sys.exit(1 if broken else 0)
