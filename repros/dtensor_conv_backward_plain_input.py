"""DTensor's convolution backward asserts when a convolution run on plain tensors gets a DTensor output gradient.

Under `implicit_replication()` a plain tensor meets a DTensor (here a sequence-parallel activation, sharded on rows):
the forward runs, and the plain convolution's output gradient comes back a DTensor. Autograd then dispatches
`aten.convolution_backward` with a DTensor grad_output beside the plain input and weight, and DTensor's handler
(`torch/distributed/tensor/_tp_conv.py:convolution_backward_handler`) raises a bare `AssertionError` (it requires
grad_output and input both DTensors). Related: pytorch#142058 (conv backward with replicated inputs raises).

    python repros/dtensor_conv_backward_plain_input.py      # exit 1 while the bug is present, 0 once it is gone
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(4, 2, 6, 6)
    scale = distribute_tensor(torch.randn(4, 2, 6, 6), mesh, [Shard(0)])  # an activation sharded on rows
    with implicit_replication():
        loss = (conv(x) * scale).full_tensor().square().mean()
        loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.start_processes(rank_main, args=(2, folder), nprocs=2, start_method="fork")
        except Exception as exc:  # the ranks' error, with its traceback
            if "convolution_backward_handler" in str(exc) and "AssertionError" in str(exc):
                print("BUG PRESENT: convolution_backward_handler raised AssertionError on a plain input")
                sys.exit(1)
            raise
    print("ok: the convolution's backward ran")
    sys.exit(0)
