"""Paths as the engine keeps them (absolute, whatever the user typed) and as the terminal shows them (relative to the
current directory where they lie under it, so `results/default/findings.md` reads as the user wrote it)."""

from __future__ import annotations

import os
from pathlib import Path


def absolute(path: Path) -> Path:
    """`path` made absolute against the current directory (`~` expanded, symbolic links kept): a run folder given as
    `results/default`, `./x` or `../x` names the same files from every process, whatever its working directory."""
    return Path(os.path.abspath(path.expanduser()))


def shown(path: Path) -> str:
    """How a path is printed: relative to the current directory when it lies under it, else absolute."""
    full = absolute(path)
    try:
        return str(full.relative_to(Path.cwd()))
    except ValueError:
        return str(full)
