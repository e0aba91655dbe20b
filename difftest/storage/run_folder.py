"""A run folder as every step reads it: its generated models, and whether a sweep is writing it now."""

from __future__ import annotations

import os
from pathlib import Path

from difftest.contracts.errors import UserError
from difftest.contracts.spec import COMMANDS_KEY, ModelSpec
from difftest.storage.artifacts import load_spec

# a finding's minimisation, in its folder (`findings/<id>/`): what `difftest.findings.minimise` found, kept for reruns
MINIMISE_FILE = "minimise.json"
OLD_MINIMISE_FILE = "minimize.json"  # its name in runs made before the spelling was one
SWEEP_MARKER = "sweep.pid"  # present, naming a live process, while a sweep commits cases to the run


def list_models(run_dir: Path) -> list[tuple[Path, ModelSpec]]:
    models_dir = run_dir / "models"
    if not models_dir.is_dir():
        raise UserError(f"{run_dir}: no models/ folder; run `difftest generate --out {run_dir}` first")
    found = [(d, load_spec(d)) for d in sorted(models_dir.iterdir()) if (d / "spec.json").exists()]
    if not found:
        raise UserError(f"{models_dir}: no generated models; run `difftest generate --out {run_dir}` first")
    return found


def record_command(run_dir: Path, argv: list[str]) -> None:
    """Add the command now running on the run (its words, when it started, in which folder) to run.json, the report
    shows the last; and the folders the plugins loaded so far came from, which a command elsewhere imports them from."""
    import json
    import os
    import time

    from difftest.contracts.registry import user_plugin_folders
    from difftest.contracts.spec import PLUGIN_FOLDERS_KEY
    from difftest.storage.artifacts import atomic_write_text

    path = run_dir / "run.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # a missing or damaged run.json is told by the step that needs it
    command = {"argv": argv, "started": time.time(), "cwd": os.getcwd()}
    raw[COMMANDS_KEY] = [*raw.get(COMMANDS_KEY, [])[-19:], command]
    raw[PLUGIN_FOLDERS_KEY] = list(dict.fromkeys([*(raw.get(PLUGIN_FOLDERS_KEY) or []), *user_plugin_folders()]))
    atomic_write_text(json.dumps(raw, indent=1, sort_keys=True), path)


def last_command(run_dir: Path) -> dict[str, object] | None:
    import json

    try:
        commands = json.loads((run_dir / "run.json").read_text()).get(COMMANDS_KEY) or []
    except (OSError, ValueError):
        return None
    return commands[-1] if commands else None


def sweep_in_progress(run_dir: Path) -> bool:
    """Whether a live process holds the run's sweep marker (`SWEEP_MARKER`, which `difftest.runner.sweep` writes)."""
    try:
        pid = int((run_dir / SWEEP_MARKER).read_text().split()[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return False  # no sweep, or one that was killed before it could remove its marker
    except PermissionError:
        return True
    return True
