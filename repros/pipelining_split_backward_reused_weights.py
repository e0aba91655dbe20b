"""Split backward (zero-bubble schedules) fails where two parameter groups' weight passes walk the same nodes.

    python repros/pipelining_split_backward_reused_weights.py

torch 2.14.1 (and 2.6.0), CPU, one process: a block of two Linear layers applied twice in a row (weights shared
across depth: ALBERT, Universal Transformers, looped models). `stage_backward_input` then `stage_backward_weight`,
what ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV run for a stage's I and W actions,
against `backward()`:
    loops 1: weight gradients equal
    loops 2: BUG PRESENT: stage_backward_weight raised RuntimeError: Trying to backward through the graph a second time
    dense branch: BUG PRESENT: stage_backward_weight raised RuntimeError: Trying to backward through the graph a second time
Each parameter group's `autograd.grad` (retain_graph=False) walks from the second application's use of its weight back
to the first one's, through the part of the graph the other group walks too, and frees it. One weight reused (one
group) trains right since pytorch#181365 (the fix of #180952, double-counted gradients); two do not. On 2.6.0 one
reused weight gets double-counted gradients as #180952 says.
The same walk fails without any reused weight: a stage whose dense branch (weights on an input that needs no
gradient, DeepFM's dense arch) feeds both its deep layer and its output. The dense arch's group starts at the
output's concatenation and walks through the deep layer's matmul, freeing it before the deep layer's own group runs.
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


class DenseBranch(nn.Module):
    """DeepFM's dense arch and interaction in one stage: the dense branch, computed from weights and an input that
    needs no gradient, feeds the deep layer and the output both."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_arch = nn.Linear(3, 4)
        self.deep = nn.Linear(8, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        d = self.dense_arch(dense)
        return torch.cat([d, self.deep(torch.cat([d, sparse], dim=1))], dim=1)


def dense_branch_gradients(split: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    stage = DenseBranch()
    dense, sparse = torch.randn(5, 3), torch.randn(5, 4, requires_grad=True)
    out = stage(dense, sparse)
    grad = torch.randn_like(out)
    if split:
        _, groups = stage_backward_input([out], [grad], [sparse], stage.parameters())
        stage_backward_weight(stage.parameters(), groups)
    else:
        out.backward(grad)
    return {name: p.grad for name, p in stage.named_parameters()}


print(f"torch {torch.__version__}")
cases = {f"loops {loops}": lambda loops=loops: (weight_gradients(loops, False), weight_gradients(loops, True))
         for loops in (1, 2)}
cases["dense branch"] = lambda: (dense_branch_gradients(False), dense_branch_gradients(True))
present = False
for case, gradients in cases.items():
    try:
        expected, got = gradients()
    except RuntimeError as exc:
        print(f"{case}: BUG PRESENT: stage_backward_weight raised RuntimeError: {str(exc).split('(')[0].strip()}")
        present = True
        continue
    equal = all(torch.allclose(got[n], expected[n]) for n in expected)
    print(f"{case}: weight gradients {'equal' if equal else 'DIFFER (BUG PRESENT)'}")
    present |= not equal
raise SystemExit(1 if present else 0)
