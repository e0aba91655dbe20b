"""torch.distributed.pipelining sends a stage's tensors as they are: a non-contiguous one fails on gloo.

    python repros/pipelining_noncontiguous_send.py

torch 2.14.1, CPU, gloo, 2 ranks, ScheduleGPipe, 2 micro-batches, a model split into two stages:
- "output": stage 0 ends in a transpose, so the activation it sends is a non-contiguous view. Rank 0 raises
  "RuntimeError: input tensor has to be contiguous" from the p2p isend inside `schedule.step()` (rank 1 then
  loses its peer); the same model trains in one process.
- "input-grad" (control): stage 1 begins with a transpose; the gradient it sends back arrives contiguous and
  both ranks train. The converted Keras graphs difftest cuts into layer chains carry such
transposes (ONNX MatMul on a transposed weight), which is how the sweep meets this (pipeline/* error rows).
Making the tensor contiguous before `isend` (as collectives elsewhere in torch.distributed do) would fix it.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe


class Transposed(torch.nn.Module):
    def __init__(self, before: bool) -> None:
        super().__init__()
        self.linear, self.before = torch.nn.Linear(4, 4), before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.t()) if self.before else self.linear(x).t()


def worker(rank: int, port: int, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    # "output": stage 0 = Linear then .t(); "input-grad": stage 1 = .t() then Linear
    stages = [Transposed(before=False), torch.nn.Linear(4, 4)] if case == "output" else \
        [torch.nn.Linear(4, 4), Transposed(before=True)]
    example = torch.zeros(4, 4, requires_grad=True)
    stage = PipelineStage(stages[rank], rank, 2, torch.device("cpu"), input_args=(example,), output_args=(example,))
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    try:
        schedule.step(x, target=y) if rank == 0 else schedule.step(target=y)
        print(f"{case}: rank {rank}: step() ran")
    except RuntimeError as exc:
        print(f"{case}: rank {rank}: step() raised RuntimeError: {str(exc).splitlines()[0]}")
    os._exit(0)  # the other rank may still wait on a peer that gave up


if __name__ == "__main__":
    for port, case in ((29651, "output"), (29652, "input-grad")):
        context = mp.spawn(worker, (port, case), nprocs=2, join=False)
        context.join(60)
