"""Under `implicit_replication`, the backward of `DTensor.to_local()` receives a DTensor gradient and raises.

    python repros/dtensor_implicit_replication_to_local_backward.py

torch 2.14.1, CPU, 2 gloo ranks. A plain tensor that came out of a DTensor (`RowwiseParallel`'s default
`use_local_output=True` hands on `to_local()` of its output) meets a DTensor in one operation inside
`torch.distributed.tensor.experimental.implicit_replication()`, which treats the plain tensor as replicated; then
backward, against the same program in one process:
    with it: BUG PRESENT: "the local_tensor argument only accepts torch.Tensor but got <class
        'torch.distributed.tensor.DTensor'> value." from `to_local`'s backward (`DTensor.from_local` of the gradient)
A plain tensor alone (no implicit replication) trains right; so do the same operations on DTensors throughout.
The operation's gradient for its plain input is a DTensor (the operation ran on DTensors), and autograd hands it to
`to_local`'s backward, which wraps its incoming gradient with `DTensor.from_local`. Since 2.12 `from_local` refuses
a DTensor (the error above); on 2.6.0, 2.10.0 and 2.11.0 it wraps it, and the parameter's gradient is a DTensor whose
local tensor is a DTensor, which the next collective on it cannot take (exit 1 on every release from 2.6.0).
Found by difftest's `tp/colwise-rowwise/ws2` on a converted Keras DAG whose row-wise output meets a column-wise
branch's DTensor (the setting runs the converted graph under implicit replication, for its plain constants).
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication

WORLD_SIZE = 2


def train(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor, mesh: object | None) -> None:
    """linear(x, w) made whole and plain (as a row-wise layer hands it on), plus linear(x, v) inside implicit
    replication: the loss's backward, there too (as a training step that needs it runs)."""
    if mesh is None:
        (torch.nn.functional.linear(x, w) + torch.nn.functional.linear(x, v)).sum().backward()
        return
    x = distribute_tensor(x, mesh, [Replicate()])
    plain = torch.nn.functional.linear(x, w).redistribute(mesh, [Replicate()]).to_local()
    with implicit_replication():
        (torch.nn.functional.linear(x, v) + plain).full_tensor().sum().backward()


def rank_main(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    x, w, v = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4, 4)
    single = [t.clone().requires_grad_() for t in (w, v)]
    train(x, *single, None)
    sharded = [distribute_tensor(w, mesh, [Shard(0)]).requires_grad_(),
               distribute_tensor(v, mesh, [Replicate()]).requires_grad_()]
    try:
        train(x, *sharded, mesh)
    except RuntimeError as exc:
        if rank == 0:
            print(f"with implicit_replication: BUG PRESENT: {exc}", flush=True)
        raise SystemExit(1) from None
    if any(isinstance(d.grad.to_local(), DTensor) for d in sharded):  # what from_local made of a DTensor before 2.12
        if rank == 0:
            print("with implicit_replication: BUG PRESENT: a parameter's gradient is a DTensor whose local tensor is a "
                  "DTensor", flush=True)
        raise SystemExit(1)
    worst = max((d.grad.full_tensor() - s.grad).abs().max().item() for d, s in zip(sharded, single))
    if rank == 0:
        print(f"with implicit_replication: gradients at most {worst:.3g} from the single process", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if worst > 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        try:  # every rank raises in its own backward: no peer waits on another
            mp.start_processes(rank_main, args=(folder,), nprocs=WORLD_SIZE, start_method="fork")
        except mp.ProcessExitedException as exc:
            sys.exit(exc.exit_code)
