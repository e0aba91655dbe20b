"""SequenceParallel makes a frozen norm weight trainable again.

    python repros/tp_sequence_parallel_unfreezes.py

torch 2.14.1, one gloo rank is enough. `parallelize_module(..., SequenceParallel())` re-registers each parameter of
the module as `nn.Parameter(DTensor.from_local(param, ...))`, which requires grad whatever the original did, so an
optimizer built from `requires_grad` parameters trains a norm weight the user froze. ColwiseParallel and
RowwiseParallel keep `requires_grad` (the fix of pytorch#171523, PR #171709); SequenceParallel's
`_replicate_module_fn` was left out. In difftest's sweep: `tp/sequence-parallel/ws2` and the 2-D
`fsdp2-tp/.../sequence-parallel` move a transformer's frozen `attention_norm.weight` (0.105 after one SGD step).
Prints requires_grad after each style; exits 1 while SequenceParallel unfreezes.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

results = {}
for style, module in (("SequenceParallel", nn.LayerNorm(8)), ("ColwiseParallel", nn.Linear(8, 8))):
    module.weight.requires_grad_(False)
    parallelize_module(module, mesh, SequenceParallel() if style == "SequenceParallel" else ColwiseParallel())
    results[style] = module.weight.requires_grad
    print(f"{style}: frozen weight requires_grad after parallelize_module = {module.weight.requires_grad}")
dist.destroy_process_group()
sys.exit(1 if results["SequenceParallel"] else 0)
