"""DETrain's first promise: a setting run twice computes the same bits.

`rerun/<setting>` runs any registered setting again, with `torch.use_deterministic_algorithms(True)` (the
TensorFlow settings always run with op determinism), in whichever warm worker the sweep gives it, and is
judged against that setting's own stored run with zero tolerance (every recorded tensor equal). A
difference is its own finding, `nondeterministic`, never noise to tolerate. Select them with a glob
(`--settings 'rerun/ddp/*'`) or `--twice`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import Outputs, Repeat, RunContext, Setting, Tolerance, Unsupported, register_derived

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

BITWISE = Tolerance(atol=0.0, rtol=0.0)


@dataclass(frozen=True)
class Rerun(Repeat):
    """The same setting a second time, deterministic algorithms on: must equal the first run bitwise."""

    base: Setting
    family: ClassVar[str] = "rerun"
    deterministic: ClassVar[bool] = True
    mismatch_status: ClassVar[str] = "nondeterministic"

    @property
    def name(self) -> str:
        return f"rerun/{self.base.name}"

    def describe(self) -> str:
        return f"{self.base.name} again, judged bitwise against its first run"

    def judges(self, tensor_name: str) -> bool:
        return True  # everything the first run recorded

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BITWISE

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return self.base.run(ctx, model, inputs)

    def standalone(self, case: StandaloneCase) -> Script | None:
        """The base's script, run twice and its runs compared with each other (the base's emitter, if it has one)."""
        try:
            script = self.base.standalone(replace(case, twice=True))  # its summary says so
        except Unsupported as exc:
            raise Unsupported(f"the emitter of `{self.base.name}`, which this reruns, cannot express it: {exc}") from None
        if script is None:
            raise Unsupported(f"the `{self.base.family}` family has no emitter")
        return replace(script, twice=True)


register_derived("rerun", Rerun)
