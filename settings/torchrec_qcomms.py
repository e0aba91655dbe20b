"""TorchRec's quantized communication: the pooled embeddings' all-to-all (and reduce-scatter) in forward, and their
gradients' in backward, sent in fp16 by fbgemm's codecs (`QCommsConfig` through `get_qcomm_codecs_registry`, handed to
the sharder), against the same sharding plan's reference computed in one process.

On gloo TorchRec turns a bf16 request into fp16 itself (`get_qcomm_codecs_registry` on a CPU device, with a warning),
so the CPU family runs fp16 in both directions, and fp16 forward with fp32 backward. Rounding a pooled embedding or
its gradient to fp16 costs at most fp16's unit roundoff (2⁻¹¹) relative on each value sent; the family is judged by
the fp16 envelope (`calib-fp16-*`: Monte Carlo errors of 2⁻¹¹ on every module tensor and gradient of the root,
which rounds more than the codecs do), so a codec that scales, drops or misplaces values is outside it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import UNIT_ROUNDOFF, Tolerance, refuse_changed_hooks, register_settings
from settings._torchrec_plan import SHARDING_TYPES
from settings._torchrec_script import script_sharder
from settings.torchrec_sharding import TorchRecSharding

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

# (forward, backward) precisions of the embeddings' collectives, as QCommsConfig names them
PRECISIONS = {"fp16-fp16": ("FP16", "FP16"), "fp16-fp32": ("FP16", "FP32")}
WORLD_SIZES = (2, 4)
# D3's fixed oracle for fp16 arithmetic, as the TF32 settings' for theirs: 18 unit roundoffs
FP16_TOLERANCE = Tolerance(atol=18 * UNIT_ROUNDOFF["fp16"], rtol=18 * UNIT_ROUNDOFF["fp16"])


@dataclass(frozen=True)
class TorchRecQComms(TorchRecSharding):
    """TorchRec DMP with an explicit sharding plan, the embeddings' collectives quantized by fbgemm's codecs."""

    family: ClassVar[str] = "torchrec-qcomms"
    # the default tier runs one case of the family (fp16 both ways, column-wise, two ranks)
    tier_axes: ClassVar[tuple[str, ...]] = ()
    comms: str = "fp16-fp16"

    @property
    def name(self) -> str:
        return f"torchrec-qcomms/{self.comms}/{self.sharding}/ws{self.world_size}"

    @property
    def precision(self) -> str:  # type: ignore[override]
        return "fp16"  # the envelope that bounds fp16 rounding of what is sent (module docstring)

    def tolerance(self, default: Tolerance) -> Tolerance:
        return FP16_TOLERANCE

    def describe(self) -> str:
        forward, backward = PRECISIONS[self.comms]
        return (f"TorchRec DMP, every table {self.sharding}, {self.world_size} ranks, pooled embeddings sent in "
                f"{forward.lower()} and their gradients in {backward.lower()} (QCommsConfig)")

    def sharder(self) -> Any:
        return script_sharder({"qcomms": self.script_comms()})  # the one its standalone script builds

    def script_comms(self) -> tuple[str, str] | None:
        return PRECISIONS[self.comms]

    def standalone(self, case: StandaloneCase) -> Script:
        # the script builds its sharder with `script_sharder`: a variant whose sharder differs is not what it runs
        refuse_changed_hooks(self, TorchRecQComms, "sharder", "script_comms")
        return super().standalone(case)


# data-parallel tables send no embeddings through the codecs: `torchrec/ebc/data_parallel/*` judges them at fp32
register_settings([TorchRecQComms(sharding=s, world_size=ws, comms=c)
                   for c, s, ws in itertools.product(PRECISIONS, SHARDING_TYPES, WORLD_SIZES) if s != "data_parallel"])
