"""What a setting declares about how its outputs are judged: the allclose tolerance, and the names that mark a
bound or an intermediate activation among the tensors it records (`difftest.judging.oracle` judges by them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """D3's default verdict: numpy.allclose(actual, reference, atol=5e-4, rtol=1e-4)."""

    atol: float = 5e-4
    rtol: float = 1e-4


BOUND_PREFIX = "allowed/"
# an intermediate activation (`eval_before/l3_dense/act`): recorded where a module exposes it (not by a pipeline
# stage, nor by TensorFlow), so compared only where both sides recorded it with one shape; the outputs stay judged
ACTIVATION = "/act"

# the unit roundoff of each precision a setting may compute in (half the spacing of floats just above 1)
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8}
