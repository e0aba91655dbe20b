"""Split backward (zero-bubble schedules, DualPipeV) never trains a later stage's weights that act only on an input
needing no gradient.

    python repros/pipelining_split_backward_untrained_weights.py

torch 2.14.1 (and 2.6.0), CPU, one process. A stage after the first receives two inputs: dense features that need no
gradient (passed along from the first stage, as a DLRM or DeepFM pipeline does) and activations that do. Its
`dense_arch` acts on the dense features only. `stage_backward_input` then `stage_backward_weight`, what
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV run for the stage's I and W actions,
against `backward()`:
    parameter groups: []
    dense_arch.weight: BUG PRESENT: no gradient (backward() gives one, max 2.6)
    dense_arch.bias: BUG PRESENT: no gradient (backward() gives one, max 1.5)
`get_param_groups` keeps only the parameters whose forward path meets the inputs that need a gradient, so these
belong to no group, and the W action never computes their gradients: the optimizer step leaves them as they were,
silently. `PipelineStage.backward_weight_one_chunk` falls back to a full backward for this case on stage 0 only
(its TODO: "if inputs does not require gradient, then the parameter group will not be fully captured").
"""

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


class DenseArch(nn.Module):  # a middle stage of a DLRM-like pipeline
    def __init__(self) -> None:
        super().__init__()
        self.dense_arch = nn.Linear(3, 4)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dense_arch(dense), pooled.clone()


torch.manual_seed(0)
stage = DenseArch()
dense = torch.randn(5, 3)  # needs no gradient
pooled = torch.randn(5, 4, requires_grad=True)  # received activations: they need one
output_grads = [torch.randn(5, 4), torch.randn(5, 4)]

torch.autograd.backward(stage(dense, pooled), output_grads)
expected = {name: p.grad.clone() for name, p in stage.named_parameters()}
stage.zero_grad(set_to_none=True)

outputs = stage(dense, pooled)
_, groups = stage_backward_input(list(outputs), output_grads, [pooled], stage.parameters())
stage_backward_weight(stage.parameters(), groups)
print(f"torch {torch.__version__}\n    parameter groups: {[len(g['params']) for g in groups]}")
present = False
for name, p in stage.named_parameters():
    if p.grad is None or not torch.allclose(p.grad, expected[name]):
        present = True
        got = "no gradient" if p.grad is None else f"max |difference| {(p.grad - expected[name]).abs().max():.3g}"
        print(f"    {name}: BUG PRESENT: {got} (backward() gives one, max {expected[name].abs().max():.2g})")
    else:
        print(f"    {name}: gradient equal")
raise SystemExit(1 if present else 0)
