"""A pipeline schedule's default gradient scaling divides the gradients accumulated by earlier steps again.

    python repros/pipelining_scale_grads_accumulation.py

Gradient accumulation under torch.distributed.pipelining: two `schedule.step()` calls (each on half of the batch, the
loss divided by 2, as accumulation divides it) before one optimizer step, with the schedule's `scale_grads` at its
default (True). At the end of each step the schedule divides every gradient of its stages by the micro-batch count
(`_PipelineStageBase.scale_grads`), those the first step accumulated included: the first half's gradients come out
divided by the micro-batch count twice. 2 CPU ranks (gloo), Schedule1F1B, 2 micro-batches, a 2-Linear model cut in
two. Exit 1 while the accumulated gradients differ from one process accumulating the same micro-batches.
torchtitan met it (torchtitan#1733, fixed there by PR #1732 with `scale_grads=False` and the loss scaled instead);
the schedule's default still does it.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICROBATCHES, STEPS = 2, 2  # micro-batches per schedule step; schedule steps accumulated per optimizer step


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target) / STEPS


def rank_main(rank: int, folder: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    whole, halves = model(), []
    for half in range(STEPS):  # the reference: one process accumulating every micro-batch's mean loss, averaged
        whole.zero_grad()
        for micro in range(MICROBATCHES):
            rows = slice(half * 4 + micro * 2, half * 4 + micro * 2 + 2)
            (torch.nn.functional.mse_loss(whole(x[rows]), y[rows]) / (STEPS * MICROBATCHES)).backward()
        halves.append(whole[rank].weight.grad.clone())
    expected = sum(halves)
    # what the default scaling gives: each step's sum divided by the micro-batch count, the first step's twice
    twice = halves[0] / MICROBATCHES + halves[1]
    stage_module = model()[rank]
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)  # scale_grads: its default, True
    for half in range(STEPS):  # no zero_grad between the two: the gradients accumulate
        rows = slice(half * 4, half * 4 + 4)
        if rank == 0:
            schedule.step(x[rows])
        else:
            schedule.step(target=y[rows], losses=[])
    got = stage_module.weight.grad
    off = float((got - expected).abs().max())
    print(f"rank {rank}: weight gradient {got.flatten()[:2].tolist()}, one process {expected.flatten()[:2].tolist()}; "
          f"the first step's share divided twice would give {twice.flatten()[:2].tolist()}")
    with open(os.path.join(folder, f"off{rank}"), "w") as verdict:
        verdict.write(str(off))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_main, args=(folder,), nprocs=2, start_method="fork")
        off = max(float(open(os.path.join(folder, f"off{r}")).read()) for r in range(2))
    print(f"torch {torch.__version__}: largest gradient difference {off:.3g}; "
          + ("BUG PRESENT" if off > 1e-6 else "ok"))
    sys.exit(1 if off > 1e-6 else 0)
