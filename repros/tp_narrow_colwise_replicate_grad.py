"""A column-wise sharded layer narrower than the tensor-parallel mesh gets a replicated gradient: the optimizer's
in-place step then raises.

    python repros/tp_narrow_colwise_replicate_grad.py

torch 2.14.1, CPU, 4 gloo ranks. `Linear(5, width)` column-wise (`ColwiseParallel(use_local_output=False)`, the
remedy pytorch#150336 proposes for uneven widths), ReLU, `Linear(width, 2)` row-wise; one backward of a mean loss,
then one step of plain SGD, against the same step in one process:
    width 5 (shards 2, 2, 1, 0): gradients Shard(0) / Shard(1), the step matches the single process
    width 3 (shards 1, 1, 1, 0): BUG PRESENT: the weights' gradients are Replicate(), and SGD's `param.add_(grad)`
        raises "aten.add_.Tensor: in-place operations that require placement changes are not supported"
DTensor's matmul strategies do not shard a dimension smaller than the mesh, so the weight-gradient matmul of the
narrow layer returns a replicated tensor, which autograd accumulates as the gradient of a Shard(0) parameter. The
forward runs (its output is replicated, not sharded). On torch 2.6.0 the same gradients are replicated too, but the
in-place add redistributes them and the step is right (exit 0 there). Found by difftest's `tp/colwise-rowwise/ws4`
on a converted Keras DAG with a 3-unit Dense layer.
"""

import copy
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD_SIZE = 4


def rank_main(rank: int, folder: str, width: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 2))
    single = copy.deepcopy(model)
    parallelize_module(model, init_device_mesh("cpu", (WORLD_SIZE,)),
                       {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    placements = f"weight gradients {model[0].weight.grad.placements} / {model[2].weight.grad.placements}"
    try:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    except RuntimeError as exc:
        if rank == 0:
            print(f"width {width}: BUG PRESENT: {placements}; the SGD step raised: {str(exc).splitlines()[0]}",
                  flush=True)
        raise SystemExit(1) from None
    single(x).pow(2).mean().backward()
    torch.optim.SGD(single.parameters(), lr=0.1).step()
    worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    if rank == 0:
        print(f"width {width}: {placements}; after the step, at most {worst:.3g} from the single process", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if worst > 1e-6:
        raise SystemExit(1)


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    for width in (5, 3):
        with tempfile.TemporaryDirectory() as folder:
            try:  # every rank raises at its own step: no peer waits on another
                mp.start_processes(rank_main, args=(folder, width), nprocs=WORLD_SIZE, start_method="fork")
            except mp.ProcessExitedException as exc:
                sys.exit(exc.exit_code)
