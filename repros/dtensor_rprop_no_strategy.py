"""torch.optim.Rprop cannot step DTensor parameters: neither its foreach nor its single-tensor step has a sharding rule.

    python repros/dtensor_rprop_no_strategy.py

A Linear(6, 4)'s weight and bias sharded on dim 0 over 2 CPU ranks (gloo), as FSDP2 and column-wise tensor parallel
hold them, one backward, then `Rprop(foreach=True).step()` and `Rprop(foreach=False).step()`, against the
same steps on the plain Linear in one process. The foreach step copies the gradients into its `prev` state with
`torch._foreach_copy_`, for which DTensor registers no sharding strategy; the single-tensor step zeroes the gradient
where its sign flipped (`grad[sign.eq(etaminus)] = 0`), a masked in-place `index_put_` that DTensor refuses on a
sharded tensor. Every other torch.optim optimizer difftest runs (Adam, AdamW, SGD, Adagrad, RMSprop, NAdam, RAdam,
Adamax, ASGD) steps the same parameters.
Exit status 1 while either step raises.
"""
import logging
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4)


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)


def worker(rank, world_size, folder):
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    outcome = {}
    for foreach in (True, False):
        weight, bias = (torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
                        for p in (linear().weight, linear().bias))
        optimizer = torch.optim.Rprop([weight, bias], lr=0.01, foreach=foreach)
        x, y = batch()
        try:
            prediction = torch.nn.functional.linear(distribute_tensor(x, mesh, [Replicate()]), weight, bias)
            torch.nn.functional.mse_loss(prediction.full_tensor(), y).backward()
            optimizer.step()
            outcome[foreach] = "stepped"
        except Exception as exc:  # the library's words are the finding
            outcome[foreach] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    if rank == 0:
        torch.save(outcome, f"{folder}/outcome.pt")
    dist.barrier()
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as folder:  # the ranks first: fork before this process starts torch's threads
        mp.start_processes(worker, args=(2, folder), nprocs=2, start_method="fork")
        outcome = torch.load(f"{folder}/outcome.pt", weights_only=True)
    for foreach in (True, False):  # the same step in one process, which works
        module = linear()
        optimizer = torch.optim.Rprop(module.parameters(), lr=0.01, foreach=foreach)
        x, y = batch()
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
    print(f"torch {torch.__version__}; one process: both steps run")
    for foreach, said in outcome.items():
        print(f"Rprop(foreach={foreach}) on DTensor parameters: {said}")
    wrong = any(said != "stepped" for said in outcome.values())
    print("BUG PRESENT" if wrong else "ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
