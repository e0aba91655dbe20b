"""The CPU kernels of the fused optimizers read a gradient whose strides differ from its parameter's as if they were
the parameter's: `fused=True` steps silently update each element with another element's gradient.

    python repros/fused_optimizer_cpu_grad_strides.py

One process, CPU, torch 2.14.1 and 2.6.0. A (3, 5) parameter (row-major) whose gradient holds the same values in
column-major storage (a transposed tensor: what DTensor hands a tensor-parallel weight of a converted Keras MatMul as
its local gradient), one step of Adam, AdamW, SGD with momentum and Adagrad, `fused=True` against the same optimizer's
for-loop implementation on the same tensors:
    BUG PRESENT: Adam(fused=True) differs by 0.02 (2 x lr) ...
The foreach implementation agrees with the for-loop one; so does the fused one once the gradient is made contiguous.
The CUDA kernels refuse the mismatch ("params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and
layout", pytorch/pytorch#106951); the CPU ones compute with it. Found by difftest's `optim/adamw-fused/tp/ws2` on
converted Keras models.
"""

import sys

import torch

OPTIMIZERS = {"Adam": {}, "AdamW": {}, "SGD": {"momentum": 0.9}, "Adagrad": {}}


def stepped(cls: str, options: dict, implementation: dict, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    parameter = torch.nn.Parameter(weight.clone())
    parameter.grad = grad.clone(memory_format=torch.preserve_format)
    getattr(torch.optim, cls)([parameter], lr=0.01, **options, **implementation).step()
    return parameter.detach()


def main() -> int:
    torch.manual_seed(0)
    weight = torch.randn(3, 5)
    grad = torch.randn(5, 3).t()  # the values of a (3, 5) gradient, stored column-major
    print(f"torch {torch.__version__}: parameter strides {weight.stride()}, gradient strides {grad.stride()}")
    wrong = []
    for cls, options in OPTIMIZERS.items():
        loop = stepped(cls, options, {"foreach": False}, weight, grad)
        fused = stepped(cls, options, {"fused": True}, weight, grad)
        fused_contiguous = stepped(cls, options, {"fused": True}, weight, grad.contiguous())
        off = (fused - loop).abs().max().item()
        print(f"{cls}(fused=True) against the for-loop step: max |difference| {off:.3g} "
              f"(with the gradient made contiguous: {(fused_contiguous - loop).abs().max().item():.3g})")
        if off > 1e-6:
            wrong.append(f"{cls}(fused=True) differs by {off:.3g}")
    if wrong:
        print("BUG PRESENT: " + "; ".join(wrong))
        return 1
    print("fixed: every fused step matches the for-loop step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
