"""DTensor runs a convolution on a channel-sharded input as if it were whole, and fails (or would mislabel it).

    python repros/dtensor_conv_channel_sharded_input.py

A Conv2d whose parameters are replicated DTensors (`distribute_module`) gets an input sharded on its channels
(`Shard(1)`, what a column-wise Linear leaves behind once its output is reshaped into channels) on 2 CPU ranks (gloo).
DTensor has no strategy for it and should redistribute; its convolution handler instead runs the local convolution
on each rank's half of the channels against the whole weight: "Given groups=1, weight of size [8, 8, 1, 2], expected
input[12, 4, 1, 4] to have 8 channels, but got 4 channels instead" (torch 2.12.1, 2.14.1; torch 2.6.0 refuses it in
tp_convolution's spatial check). Upstream: pytorch PR #186129 (open) describes the same mechanism for channel-sharded
depthwise convolutions. Exit status 1 while it fails.
"""
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor


def rank_main(rank, folder, answers):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    conv, x = torch.nn.Conv2d(8, 8, (1, 2)), torch.randn(12, 8, 1, 4)
    expected = conv(x)
    distribute_module(conv, mesh)  # parameters replicated
    try:
        got = conv(distribute_tensor(x, mesh, [Shard(1)])).full_tensor()
        answer = f"ok: {float((got - expected).abs().max()):.3g} off the whole input's result"
    except Exception as exc:  # noqa: BLE001 - the library's error is the finding
        answer = f"BUG PRESENT: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if rank == 0:
        answers.put(answer)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        answers = mp.get_context("fork").SimpleQueue()
        mp.start_processes(rank_main, args=(folder, answers), nprocs=2, start_method="fork")
        answer = answers.get()
    print(f"torch {torch.__version__}: {answer}")
    sys.exit(1 if answer.startswith("BUG PRESENT") else 0)
