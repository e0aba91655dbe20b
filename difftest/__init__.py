"""difftest: differential testing of distributed and quantized training settings.

The public API for writing settings and generators lives here; everything else is internal.
"""

from typing import Any

from difftest.adapter import ModelAdapter
from difftest.errors import Unsupported, UserError
from difftest.registry import register_generator, register_setting, register_settings
from difftest.setting import Outputs, RunContext, Setting
from difftest.spec import ModelSpec

__all__ = [
    "ModelAdapter", "ModelSpec", "Outputs", "Reproduction", "RunContext", "Setting", "Unsupported", "UserError",
    "register_generator", "register_setting", "register_settings", "reproduce",
]


def __getattr__(name: str) -> Any:
    # `reproduce` runs cases (pandas, the runner): imported when asked for, not with every setting module
    if name in ("reproduce", "Reproduction"):
        from difftest import repro

        return getattr(repro, name)
    raise AttributeError(f"module 'difftest' has no attribute {name!r}")
