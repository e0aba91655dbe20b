"""DTensor's width-sharded convolution backward drops the input gradient: every layer before the convolution gets none.

    python repros/dtensor_conv_halo_backward_drops_input_grad.py

Two Conv2d(padding=1) in a row with replicated DTensor parameters, run on an input sharded on its width (`Shard(3)`,
2 gloo ranks), against the same model on the whole input in one process. torch 2.6.0, CPU:
    0.weight: one process |grad| 296.34, DTensor None
    BUG PRESENT: the first convolution got no gradient (its output's gradient came back as None)
DTensor runs a width-sharded convolution with padding through its halo exchange (torch/distributed/tensor/_tp_conv.py).
In the backward, `tp_convolution_backward` passes the local input gradient to `_ring_send_recv_aggregate`, which adds
the neighbours' edge columns to it and has no `return`: the input gradient becomes None, and autograd treats it as
zero. Training is silently wrong for every parameter upstream of such a convolution. The function is unchanged in
torch 2.14.1, but there DTensor's convolution strategy never keeps width sharding with padding (exit 0 here: the
halo exchange is not taken; what 2.14.1 does instead is `dtensor-conv-channel-sharded-input`'s entry). Found by
difftest's `dtensor/last-sharded/*` settings on image models.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor, init_device_mesh

WORLD_SIZE = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1))


def rank_main(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, 8)
    alone = model()
    alone(x).sum().backward()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    sharded = distribute_module(model(), mesh)
    out = sharded(distribute_tensor(x, mesh, [Shard(3)]))
    if out.placements != (Shard(3),):  # 2.14.1: no strategy keeps width sharding with padding
        if rank == 0:
            print(f"the convolutions' output is {out.placements}, not width-sharded: the halo exchange is not taken on "
                  f"torch {torch.__version__}")
        raise SystemExit(0)
    out.sum().backward()
    grads = [p.grad.full_tensor() if p.grad is not None else None for p in sharded.parameters()]
    if rank == 0:
        first = grads[0]
        print(f"0.weight: one process |grad| {float(alone[0].weight.grad.abs().sum()):.2f}, DTensor "
              + ("None" if first is None else f"{float(first.abs().sum()):.2f}"))
        if first is None:
            print("BUG PRESENT: the first convolution got no gradient (its output's gradient came back as None)")
            raise SystemExit(1)
        worst = max(float((g - p.grad).abs().max()) for g, p in zip(grads, alone.parameters()))
        print(f"every gradient within {worst:.1e} of one process")
        raise SystemExit(0 if worst < 1e-4 else 1)


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(rank_main, args=(folder,), nprocs=WORLD_SIZE, join=False, start_method="fork")
        while not context.join():
            pass
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mp.ProcessExitedException as exc:  # rank 0's verdict (1: the bug), or a rank killed (2)
        sys.exit(exc.exit_code if exc.exit_code in (1, 2) else 2)
    except mp.ProcessRaisedException as exc:  # another failure: not this bug
        print(f"COULD NOT RUN: {str(exc).strip().splitlines()[-1]}")
        sys.exit(2)
