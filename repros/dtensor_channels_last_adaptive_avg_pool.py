"""DTensor cannot average-pool a channels-last tensor to 1×1: `adaptive_avg_pool2d` ends in `as_strided_`, which has no
sharding strategy.

    python repros/dtensor_channels_last_adaptive_avg_pool.py

torch 2.14.1 and 2.6.0, CPU, 2 gloo ranks. A (4, 3, 8, 8) tensor sharded on its batch (`Shard(0)`), then
`F.adaptive_avg_pool2d(x, 1)` (the global average pooling of every ResNet/ConvNeXt head), against one process:
    contiguous: equal
    channels_last: BUG PRESENT: NotImplementedError: Operator aten.as_strided_.default does not have a sharding
        strategy registered.
`adaptive_avg_pool2d` is composite: for a 1×1 output it takes the mean over height and width and, where the input
suggests the channels-last memory format, restrides the result in place with `as_strided_` (ATen's
AdaptiveAveragePooling.cpp). DTensor judges the memory format by the DTensor's global strides and has no rule for the
in-place `as_strided_`, so a batch-sharded activation in channels-last layout (timm's ConvNeXt permutes into it)
cannot be pooled at all. Found by difftest's `dtensor/batch-sharded/ws2` on timm's ConvNeXt.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

WORLD_SIZE = 2


def rank_main(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    present = False
    for name, layout in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        x = torch.randn(4, 3, 8, 8).contiguous(memory_format=layout)
        try:
            pooled = F.adaptive_avg_pool2d(distribute_tensor(x, mesh, [Shard(0)]), 1).full_tensor()
        except NotImplementedError as exc:
            present = True
            said = f"BUG PRESENT: NotImplementedError: {exc}"
        else:
            said = "equal" if torch.allclose(pooled, F.adaptive_avg_pool2d(x, 1)) else "DIFFERENT from one process"
        if rank == 0:
            print(f"{name}: {said}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if present else 0)


def main() -> int:
    print(f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(rank_main, args=(folder,), nprocs=WORLD_SIZE, join=False, start_method="fork")
        while not context.join():
            pass
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mp.ProcessExitedException as exc:  # a rank's verdict (1: the bug), or a rank killed (2)
        sys.exit(exc.exit_code if exc.exit_code in (1, 2) else 2)
    except mp.ProcessRaisedException as exc:  # another failure: not this bug
        print(f"COULD NOT RUN: {str(exc).strip().splitlines()[-1]}")
        sys.exit(2)
