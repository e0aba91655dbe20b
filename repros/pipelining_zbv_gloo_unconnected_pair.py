"""Standalone reproducer (torch only): ScheduleZBVZeroBubble over gloo fails its first training step on torch 2.8 to
2.11 with "Pair is not connected (... <--> [none])" on rank 1; torch 2.12.1, 2.13.0 and 2.14.1 run it.

    python repros/pipelining_zbv_gloo_unconnected_pair.py          # exits 1 while the bug is present, 0 once gone

Two gloo ranks on CPU, four Linear stages in the V layout (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2).
Rank 1 passes activations from its stage 1 to its own stage 2: the pair gloo reports unconnected is rank 1's own.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble


def run(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    stages = [PipelineStage(layers[i], i, 4, torch.device("cpu")) for i in (rank, 3 - rank)]
    schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    try:
        schedule.step(x if rank == 0 else None, target=target, losses=[])
    except RuntimeError as exc:
        print(f"rank {rank}: {exc}", flush=True)
        os._exit(1)  # the peer is cut off too: leave without a teardown that would wait for it
    dist.barrier()
    print(f"rank {rank}: one ZBV training step ran", flush=True)
    os._exit(0)


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    try:
        mp.spawn(run, args=(port,), nprocs=2)
    except mp.ProcessExitedException:
        print("the bug is present: a rank failed its first ZBV step over gloo")
        sys.exit(1)
    print("ok: no rank failed")
