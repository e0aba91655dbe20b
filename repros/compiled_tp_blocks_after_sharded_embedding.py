"""Blocks compiled after tensor parallelism, behind a row-wise sharded embedding: the backward raises in DTensor's
redistribute ("'Tensor' object has no attribute '_local_tensor'").

    python repros/compiled_tp_blocks_after_sharded_embedding.py

torch 2.14.1, CPU, 2 gloo ranks. An embedding, two residual feed-forward blocks and an output projection, with
torchtitan's plan (the embedding `RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())`, each
block's `w1` column-wise and `w2` row-wise, the output column-wise with a replicated output), then each block
compiled (`nn.Module.compile()`, Inductor) as torchtitan compiles its blocks; one forward and backward:
    the same program eager: the backward runs
    the embedding left out of the plan, blocks compiled: the backward runs
    blocks compiled behind the sharded embedding: BUG PRESENT: AttributeError: 'Tensor' object has no attribute
        '_local_tensor' (torch/distributed/tensor/_redistribute.py, NestedRedistribute.forward reading
        grad_output._local_tensor)
The gradient reaching the redistribute behind the embedding's output is a plain tensor where the compiled backward
expects a DTensor. On torch 2.11.0 all three run (exit 0); 2.12.1 and 2.13.0 fail as 2.14.1 does. Found by
difftest's `compile/tp/ws2` and `compile/tp-sp/ws2` on its native transformer (three blocks, untied embeddings); on
the model with its embedding frozen the backward runs.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import Replicate, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD_SIZE = 2


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, hidden, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(nn.functional.gelu(self.w1(x)))


class Model(nn.Module):
    def __init__(self, vocab: int = 24, width: int = 8, hidden: int = 24) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([Block(width, hidden) for _ in range(2)])
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def rank_main(rank: int, folder: str, variant: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    torch._inductor.config.compile_threads = 1  # the ranks share the cores
    torch.manual_seed(0)
    model = Model()
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "out": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.w1"] = ColwiseParallel()
        plan[f"layers.{i}.w2"] = RowwiseParallel(output_layouts=Replicate())
    if variant == "the embedding left out of the plan, blocks compiled":
        del plan["tok"]
    parallelize_module(model, init_device_mesh("cpu", (WORLD_SIZE,)), plan)
    if variant != "the same program eager":
        for block in model.layers:
            block.compile()
    ids = torch.randint(0, 24, (4, 4), generator=torch.Generator().manual_seed(1))
    try:
        model(ids).sum().backward()
    except AttributeError as exc:
        if rank == 0:
            print(f"{variant}: BUG PRESENT: AttributeError: {exc}", flush=True)
        raise SystemExit(1) from None
    if rank == 0:
        print(f"{variant}: the backward runs", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    for variant in ("the same program eager", "the embedding left out of the plan, blocks compiled",
                    "blocks compiled behind the sharded embedding"):
        with tempfile.TemporaryDirectory() as folder:
            try:  # every rank raises in its own backward: no peer waits on another
                mp.start_processes(rank_main, args=(folder, variant), nprocs=WORLD_SIZE, start_method="fork")
            except mp.ProcessExitedException as exc:
                sys.exit(exc.exit_code)
