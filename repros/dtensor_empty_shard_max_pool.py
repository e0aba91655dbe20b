"""DTensor runs max_pool2d on a rank's empty shard, which ATen refuses: a tensor unevenly sharded over its channels
cannot be pooled.

    python repros/dtensor_empty_shard_max_pool.py

torch 2.14.1, CPU, 3 gloo ranks. A (4, C, 4, 4) tensor sharded on its channels (`Shard(1)`), then `F.max_pool2d`,
against the same pooling of the whole tensor in one process:
    channels 3 (shards 1, 1, 1): equal
    channels 2 (shards 1, 1, 0): BUG PRESENT: rank 2 raised RuntimeError: Expected 3D or 4D (batch mode) tensor with
        optional 0 dim batch size for input, but got:[4, 0, 4, 4]
DTensor shards a dimension that does not divide by the mesh as `torch.chunk` does, so a rank may hold an empty shard
(documented). Pooling is per channel, so DTensor's rule keeps the channel sharding and runs the local kernel on every
rank, the empty one included; ATen's max_pool2d accepts an empty batch dimension only. Found by difftest's
`dtensor/last-sharded/ws3` on a converted Keras model whose 2-channel image input is sharded on its last dimension.
On torch 2.6.0 max_pool2d has no DTensor rule at all (NotImplementedError; exit 2 here).
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

WORLD_SIZE = 3


def rank_main(rank: int, folder: str, channels: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    x = torch.randn(4, channels, 4, 4)
    try:
        pooled = torch.nn.functional.max_pool2d(distribute_tensor(x, mesh, [Shard(1)]), 2).full_tensor()
    except NotImplementedError as exc:  # a release without DTensor's pooling rule (2.6.0): nothing to show there
        print(f"channels {channels}: COULD NOT RUN: {exc}", flush=True)
        raise SystemExit(2) from None
    except RuntimeError as exc:
        if "by peer" in str(exc):  # a peer of the rank that raised, cut loose (closed or reset)
            raise SystemExit(1) from None
        print(f"channels {channels}: BUG PRESENT: rank {rank} raised RuntimeError: {exc}", flush=True)
        raise SystemExit(1) from None
    if rank == 0:
        equal = torch.equal(pooled, torch.nn.functional.max_pool2d(x, 2))
        print(f"channels {channels}: {'equal' if equal else 'DIFFERENT (BUG PRESENT)'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    for channels in (3, 2):
        with tempfile.TemporaryDirectory() as folder:
            try:  # a rank that raised ends them all: its peers wait for its part of the gather
                mp.start_processes(rank_main, args=(folder, channels), nprocs=WORLD_SIZE, start_method="fork")
            except mp.ProcessExitedException as exc:
                sys.exit(exc.exit_code)
