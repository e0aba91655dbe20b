"""Campaigns: rounds of fresh models for hours (`rounds`), where to sample next (`sampling`), the live page (`page`)."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # `difftest.campaign` was one module before the engine moved into folders: its names stay reachable for one release
    return getattr(importlib.import_module("difftest.campaign.rounds"), name)
