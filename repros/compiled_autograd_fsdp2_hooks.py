"""Compiled Autograd cannot run the backward of a model sharded with FSDP2.

    python repros/compiled_autograd_fsdp2_hooks.py

torch 2.14.1, CPU (Inductor's C++), gloo, 2 ranks. Two Linear units, each compiled and then sharded with
`fully_shard` (torchtitan's order), the root sharded too; one step's forward and backward inside
`torch._dynamo.utils.maybe_enable_compiled_autograd(True)`, as torchtitan enables it. The backward raises on every rank:
    rank 0: backward raised Unsupported: Call to `torch._dynamo.disable()`
Compiled Autograd traces the tensor pre-hook FSDP2 registers on a unit's outputs, which fully_shard wraps in
`torch._dynamo.disable` (unconditionally since pytorch#174863), and Dynamo refuses that call inside a compiled region.
Without FSDP2 (or with DDP's Python reducer) the same step runs under Compiled Autograd.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.utils import maybe_enable_compiled_autograd
from torch.distributed.fsdp import fully_shard


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for unit in (model[2], model[0]):
        unit.compile()
        fully_shard(unit)
    fully_shard(model)
    x = torch.randn(4, 8)
    try:
        with maybe_enable_compiled_autograd(True):
            model(x).sum().backward()
        print(f"rank {rank}: backward ran")
    except Exception as exc:  # the repro shows what the backward raises
        print(f"rank {rank}: backward raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    os._exit(0)  # the other rank may still wait on a peer that gave up


if __name__ == "__main__":
    mp.spawn(worker, (29647,), nprocs=2)
