"""Split backward (zero-bubble schedules) fails on a stage that applies its weights more than once.

    python repros/pipelining_split_backward_reused_weights.py

torch 2.14.1 (and 2.6.0), CPU, one process: a block of two Linear layers applied twice in a row (weights shared
across depth: ALBERT, Universal Transformers, looped models). `stage_backward_input` then `stage_backward_weight`,
what ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV run for a stage's I and W actions,
against `backward()`:
    loops 1: weight gradients equal
    loops 2: stage_backward_weight raised RuntimeError: Trying to backward through the graph a second time
Each parameter group's `autograd.grad` (retain_graph=False) walks from the second application's use of its weight back
to the first one's, through the part of the graph the other group walks too, and frees it. One weight reused (one
group) trains right since pytorch#181365 (the fix of #180952, double-counted gradients); two do not. On 2.6.0 one
reused weight gets double-counted gradients as #180952 says.
"""

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def weight_gradients(loops: int, split: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 4, requires_grad=True)  # a later stage's input: received activations require grad
    h = x
    for _ in range(loops):
        h = block(h)
    grad = torch.randn_like(h)
    if split:
        _, groups = stage_backward_input([h], [grad], [x], block.parameters())
        stage_backward_weight(block.parameters(), groups)
    else:
        h.backward(grad)
    return {name: p.grad for name, p in block.named_parameters()}


print(f"torch {torch.__version__}")
for loops in (1, 2):
    expected = weight_gradients(loops, split=False)
    try:
        got = weight_gradients(loops, split=True)
    except RuntimeError as exc:
        print(f"loops {loops}: BUG PRESENT: stage_backward_weight raised RuntimeError: {str(exc).split('(')[0].strip()}")
        raise SystemExit(1) from None
    equal = all(torch.allclose(got[n], expected[n]) for n in expected)
    print(f"loops {loops}: weight gradients {'equal' if equal else 'DIFFER (BUG PRESENT)'}")
    if not equal:
        raise SystemExit(1)
