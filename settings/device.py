"""CPU versus GPU (D3's device comparison): a setting run on CUDA, judged against the same setting run on the CPU.

* `cuda/<setting>` — the setting's own code on CUDA with TF32 off for matrix products and convolutions (strict fp32,
  what the CPU computes): judged against its CPU run with the calibrated fp32 envelope of its root, whose float64
  centre stays on the CPU. Rank r computes on GPU r mod the GPUs there are; a sweep on the CPU uses gloo, which moves
  CUDA tensors through host memory, so several ranks may share one GPU.
* `cuda-tf32/<setting>` — the same with TF32 on for both (10-bit mantissas in the tensor cores, fp32 sums): judged
  against the envelope of legitimate TF32 results, Monte Carlo runs of the root at TF32's unit roundoff 2⁻¹¹
  (`calib-tf32-{a,b,c}`, `settings.calibration`). TF32 is a switch users flip for speed; its bound is derived, not
  tuned.

`cuda/reference` and `cuda-tf32/reference` are registered, so the default tier has them; any other setting on CUDA is
`--settings 'cuda/<glob>'`, and `--twice` adds `rerun/cuda/…`: cuBLAS and cuDNN determinism, judged bitwise. Where no
CUDA device exists they are `unsupported`, with the reason; in a `--device cuda` sweep their reference already ran on
the GPU, so they say that instead of comparing a GPU with itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import (
    UNIT_ROUNDOFF,
    Outputs,
    Repeat,
    RunContext,
    Setting,
    Tolerance,
    Unsupported,
    collective_refusal,
    get_setting,
    rank_device,
    register_derived,
    register_setting,
    visible_gpus,
)

# D3's fixed allclose for TF32, the multiple of its unit roundoff that bf16's is of bf16's (`settings.fsdp`); the
# calibrated oracle's envelope is the verdict that counts
TF32_TOLERANCE = Tolerance(atol=18 * UNIT_ROUNDOFF["tf32"], rtol=18 * UNIT_ROUNDOFF["tf32"])


@dataclass(frozen=True)
class OnCuda(Repeat):
    """The same setting on a CUDA device, judged against its run on the CPU."""

    base: Setting
    tf32: bool = False
    family: ClassVar[str] = "device"
    tier_axes: ClassVar[tuple[str, ...]] = ("tf32",)

    @property
    def name(self) -> str:
        return f"{'cuda-tf32' if self.tf32 else 'cuda'}/{self.base.name}"

    @property
    def precision(self) -> str:  # type: ignore[override]
        return "tf32" if self.tf32 and self.base.precision == "fp32" else self.base.precision

    @property
    def computes_on_gpu(self) -> bool:
        return True

    @property
    def process_affinity(self) -> str:
        # ranks of their own, spawned where the others are forked from the import server (`computes_on_gpu`)
        return "cuda" + (f"+{self.base.process_affinity}" if self.base.process_affinity else "")

    def describe(self) -> str:
        return f"{self.base.name} on CUDA, TF32 {'on' if self.tf32 else 'off'}, judged against its CPU run"

    def tolerance(self, default: Tolerance) -> Tolerance:
        return TF32_TOLERANCE if self.precision == "tf32" else self.base.tolerance(default)

    def judges(self, tensor_name: str) -> bool:
        return self.base.judges(tensor_name)

    def supports(self, spec: Any) -> str | None:
        if self.base.framework != "torch":
            return f"{self.base.name} runs TensorFlow, whose CUDA build difftest does not install"
        return self.base.supports(spec)

    def available(self) -> str | None:
        if not visible_gpus():
            return "needs a CUDA device, this machine has none"
        # a CPU sweep's group is gloo's (a --device cuda sweep refuses these settings when they run)
        return collective_refusal("cuda", "gloo", self.world_size, self.base.collectives) or self.base.available()

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if ctx.device.startswith("cuda"):
            raise Unsupported(f"its reference {self.base.name} ran on CUDA too (--device cuda): CPU versus GPU needs "
                              "a --device cpu sweep")
        device = rank_device("cuda", ctx.backend, ctx.rank, visible_gpus())
        import torch

        torch.cuda.set_device(torch.device(device))
        with _tf32(self.tf32):
            return self.base.run(dataclasses.replace(ctx, device=device), model, inputs)


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """TF32 on or off for CUDA matrix products and cuDNN convolutions, restored afterwards. Torch 2.9 replaced the
    `allow_tf32` flags by `fp32_precision` ("tf32" | "ieee") and refuses reads that mix the two, so the newer API is
    used where it exists."""
    import torch

    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        switches = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
        attribute, value = "fp32_precision", "tf32" if enabled else "ieee"
    else:
        switches = [torch.backends.cuda.matmul, torch.backends.cudnn]
        attribute, value = "allow_tf32", enabled
    before = [getattr(switch, attribute) for switch in switches]
    for switch in switches:
        setattr(switch, attribute, value)
    try:
        yield
    finally:
        for switch, old in zip(switches, before):
            setattr(switch, attribute, old)


register_derived("cuda", lambda base: OnCuda(base))
register_derived("cuda-tf32", lambda base: OnCuda(base, tf32=True))
for _tf32_on in (False, True):
    register_setting(OnCuda(get_setting("reference"), tf32=_tf32_on))
