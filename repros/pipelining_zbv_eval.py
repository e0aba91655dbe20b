"""`ScheduleZBVZeroBubble.eval()` fails: forward-only evaluation of the V schedule is impossible.

    python repros/pipelining_zbv_eval.py

torch 2.14.1, CPU, gloo, 2 ranks, 4 Linear stages placed V-wise (rank 0: stages 0 and 3, rank 1: 1 and 2).
`step()` trains; `eval()`, documented as "one forward-only iteration", raises on rank 1, which holds the turn of
the V (stages 1 and 2), while rank 0 returns:
    rank 1: eval() raised AssertionError: can't steal_bwd_input if this stage doesn't have backward
`eval` turns the stages' backward off but runs the same action list, whose local hand-offs between a rank's
two stages include backward ones. GPipe/1F1B/Interleaved1F1B/LoopedBFS evaluate fine in the same harness.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]
    mine = [rank, 3 - rank]
    example = torch.zeros(2, 4, requires_grad=True)
    stages = [PipelineStage(layers[s], s, 4, torch.device("cpu"), input_args=(example,), output_args=(example,))
              for s in mine]
    schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    schedule.step(x, target=y)
    print(f"rank {rank}: step() ran")
    try:
        schedule.eval(x, target=y)
        print(f"rank {rank}: eval() ran")
    except AssertionError as exc:
        print(f"rank {rank}: eval() raised AssertionError: {exc}")
    os._exit(0)  # the other rank may still wait on a peer that gave up


if __name__ == "__main__":
    mp.spawn(worker, (29641,), nprocs=2)
