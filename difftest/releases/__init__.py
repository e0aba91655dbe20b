"""Releases: an environment per supported torch release (`environments`), bisecting a finding over them (`bisect`), two runs compared (`diff`)."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # `difftest.releases` was one module before the engine moved into folders: its names stay reachable for one release
    return getattr(importlib.import_module("difftest.releases.environments"), name)
