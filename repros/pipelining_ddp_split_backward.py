"""Split-backward schedules never all-reduce a DDP-wrapped stage's weight gradients across its data-parallel replicas.

    python repros/pipelining_ddp_split_backward.py

torch 2.14.1, CPU, gloo, 4 ranks: 2 data-parallel replicas x 2 pipeline ranks, 4 Linear stages (2 per rank, loop
placement), each stage wrapped in DistributedDataParallel over its replica group, each replica fed other data.
After one `step()` every replica of a DDP module must hold the same, averaged gradient. With
ScheduleInterleaved1F1B it does; with ScheduleInterleavedZeroBubble (split input/weight backward) the gradients of
every stage but the first stay each replica's own:
    ScheduleInterleaved1F1B: stage 1 weight gradient, largest difference between replicas 0
    ScheduleInterleavedZeroBubble: stage 1 weight gradient, largest difference between replicas 0.23
`PipelineStage.backward_maybe_with_nosync` prepares DDP's reducer and runs `stage_backward_weight`, which computes
the weight gradients with `torch.autograd.grad` and adds them to `.grad` itself: DDP's reducer hooks (on the
parameters' gradient accumulators) never run, so nothing is all-reduced. FSDP2 stages are reduced explicitly
(`perform_reduce_grad`), DDP ones are not. ScheduleZBVZeroBubble and ScheduleDualPipeV split backward the same way.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
from torch.nn.parallel import DistributedDataParallel


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, pp_rank = divmod(rank, 2)
    for schedule_class in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, 4) for _ in range(4)]
        mine = [pp_rank, pp_rank + 2]
        example = torch.zeros(2, 4, requires_grad=True)
        modules = {s: DistributedDataParallel(layers[s], process_group=mesh["dp"].get_group()) for s in mine}
        stages = [PipelineStage(modules[s], s, 4, torch.device("cpu"), input_args=(example,), output_args=(example,),
                                group=mesh["pp"].get_group()) for s in mine]
        schedule = schedule_class(stages, 2, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
        torch.manual_seed(1 + replica)  # each replica its own share of the batch
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        schedule.step(x, target=y)
        grad = layers[1].weight.grad if pp_rank == 1 else torch.zeros(4, 4)
        replicas = [torch.zeros(4, 4) for _ in range(2)]
        dist.all_gather(replicas, grad, group=mesh["dp"].get_group())
        if rank == 1:
            print(f"{schedule_class.__name__}: stage 1 weight gradient, largest difference between replicas "
                  f"{(replicas[0] - replicas[1]).abs().max().item():.2g}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, (29643,), nprocs=4)
