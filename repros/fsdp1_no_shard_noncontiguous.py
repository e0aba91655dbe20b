"""Legacy FSDP with NO_SHARD and use_orig_params=True trains a non-contiguous parameter wrongly.

    python repros/fsdp1_no_shard_noncontiguous.py

torch 2.14.1, CPU, gloo, 2 ranks, each on half of the batch; one SGD step, compared with the same step in
one process on the whole batch. The only change between the rows is whether the first Linear's weight is
a transposed (non-contiguous) tensor, which is what ONNX-converted models hold:

  FULL_SHARD     transposed=False: forward after step off by 7.45e-09, parameters off by 1.49e-08
  FULL_SHARD     transposed=True:  forward after step off by 5.96e-08, parameters off by 1.49e-08
  NO_SHARD       transposed=False: forward after step off by 7.45e-09, parameters off by 1.49e-08
  NO_SHARD       transposed=True:  forward after step off by 4.41e-02, parameters off by 4.45e-02

No error or warning says so (NO_SHARD only warns that it is deprecated). difftest finds it as
`fsdp1/no_shard/ws*` inconsistent on every converted Keras model.
"""
import os
import warnings
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

def worker(rank, ws, port, strategy, transposed):
    warnings.simplefilter("ignore", FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(1); x = torch.randn(8, 4); y = torch.randn(8, 1)
    ref = make()
    if transposed:
        for m in (ref[0],): m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())
    net = make()
    if transposed:
        for m in (net[0],): m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())
    fsdp = FSDP(net, device_id=torch.device("cpu"), sharding_strategy=strategy, use_orig_params=True)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1); ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    share = slice(rank * 8 // ws, (rank + 1) * 8 // ws)
    torch.nn.functional.mse_loss(fsdp(x[share]), y[share]).backward(); opt.step()
    torch.nn.functional.mse_loss(ref(x), y).backward(); ropt.step()
    with torch.no_grad():
        out, rout = fsdp(x), ref(x)
    with FSDP.summon_full_params(fsdp):
        pdiff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    if rank == 0:
        print(f"{strategy.name:14s} transposed={transposed}: forward after step off by {(out - rout).abs().max().item():.2e}, parameters off by {pdiff:.2e}")
    dist.destroy_process_group()

if __name__ == "__main__":
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for transposed in (False, True):
            mp.spawn(worker, (2, 29500 + strategy.value * 2 + transposed, strategy, transposed), nprocs=2)
