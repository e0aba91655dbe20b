"""DTensor spends half a minute (with a mask: minutes) finding the sharding of one CPU attention call: its sharding
propagation through the operator's decomposition tries every combination of its inputs' placements.

    python repros/dtensor_sdpa_decomposition_slow.py

torch 2.14.1, CPU, one gloo rank (the mesh's size does not matter). `F.scaled_dot_product_attention` on q, k, v of
shape (2, 2, 4, 4), each a DTensor sharded on the batch (`Shard(0)`), against the same call on plain tensors:
    plain tensors: 0.009 s
    DTensor, first call: 28.6 s   BUG PRESENT (equal results)
On the CPU the call dispatches to aten._scaled_dot_product_flash_attention_for_cpu, which has no DTensor sharding
rule. Earlier releases raised NotImplementedError ("does not have a sharding strategy registered"; 2.6.0 to 2.12.1);
2.14.1 falls back to `DecompShardingStrategy` (torch/distributed/tensor/_decompositions.py), which runs the op's
decomposition on meta tensors once for every combination of candidate placements of every input. Three 4-D inputs
take tens of seconds; with a boolean attention mask as a fourth DTensor input, 643.5 s (the second call 1.3 s: the
result is cached). Hugging Face BERT under DTensor does not finish one forward in 300 s, which looks like a hang. Found by difftest's `dtensor/*` settings on `hf-bert` (timeout).
"""

import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

SLOW_S = 5.0  # a propagation that takes longer than this for one call, where the computation takes milliseconds

print(f"torch {torch.__version__}")
with tempfile.TemporaryDirectory() as folder:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 4) for _ in range(3))
    started = time.perf_counter()
    expected = F.scaled_dot_product_attention(q, k, v)
    print(f"    plain tensors: {time.perf_counter() - started:.3f} s")
    started = time.perf_counter()
    try:
        got = F.scaled_dot_product_attention(*(distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v)))
    except NotImplementedError as exc:  # the releases without the decomposition fallback
        print(f"    DTensor: COULD NOT RUN: {exc}")
        raise SystemExit(2) from None
    took = time.perf_counter() - started
    equal = torch.allclose(got.full_tensor(), expected)
    slow = took > SLOW_S
    print(f"    DTensor, first call: {took:.1f} s   {'BUG PRESENT' if slow else 'ok'} "
          f"({'equal' if equal else 'DIFFERENT'} results)")
    dist.destroy_process_group()
raise SystemExit(1 if slow else 0)
