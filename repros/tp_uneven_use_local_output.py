"""Tensor parallel's default ColwiseParallel → RowwiseParallel pair fails when the hidden width does not divide by the
ranks.

    python repros/tp_uneven_use_local_output.py

A feed-forward of hidden width 5 on 2 ranks: ColwiseParallel shards w1's output features 3 + 2 and, by default
(`use_local_output=True`), hands the next layer plain local tensors; RowwiseParallel turns each back into a DTensor
assuming even shards (global width 6 on rank 0, 4 on rank 1), and the matmul with w2's 5 input features raises "a and
b must have same reduction dim" (torch 2.14.1, CPU, gloo). torchtitan's plan for a Llama block is exactly this pair.
With width 4 it runs and matches one process. Exit 1 while width 5 raises, 0 once both widths match one process.
"""

import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def rank(rank: int, world: int, hidden: int, said: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29519")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # it logs the error it raises
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 4))
    x = torch.randn(3, 4)
    expected = model(x)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
    try:
        off = (model(x) - expected).abs().max().item()
        if rank == 0:
            said.put(f"hidden {hidden}: runs, {off:.3g} off one process")
    except RuntimeError as exc:
        said.put(f"hidden {hidden}, rank {rank}: {str(exc).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    lines = mp.get_context("spawn").SimpleQueue()
    for width in (4, 5):
        mp.spawn(rank, args=(2, width, lines), nprocs=2)
    printed = []
    while not lines.empty():
        printed.append(lines.get())
    print("\n".join(printed))
    broken = any("reduction dim" in line for line in printed)
    print("BUG PRESENT" if broken else "ok")
    sys.exit(1 if broken else 0)
