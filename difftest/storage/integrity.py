"""Integrity of a run folder: what `generate` wrote is what every later step reads, and a damaged store is never
taken for an empty one.

`generate` records the sha256 of every file of every model folder in run.json (`"files"`: path relative to the run
→ digest), and of run.json's own configuration. `sweep`, `analyze`, `repro`, `bisect` and `verify` check them before
they read a model (`check_models`): a damaged or missing file stops the command with one line that names it and the
command that recreates it, so a damaged input never runs as a case and never becomes a finding. `generate` on the same
folder recreates exactly the damaged and missing files (`repair_models`), and says whether they came out byte for byte
as recorded. The store is checked by SQLite's own `quick_check` when it is opened (`check_store`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from difftest.contracts.errors import UserError
from difftest.contracts.spec import RECORDED_KEYS

FILES_KEY = "files"  # in run.json: file path relative to the run folder → sha256 of its bytes
CONFIG_ENTRY = "run.json#config"  # the digest of run.json's configuration (every key but what later steps add)
STORE_FILE = "store.sqlite"
LAST_GOOD_STORE = "store.last-good.sqlite"  # a copy of the store as the last sweep or analysis left it, checked
# in a run folder whose ok cases' outputs were deleted once judged (a campaign's counted round): its judgements stand in
# its CSVs and findings, and nothing is judged from it again
PRUNED_FILE = "pruned.json"


class Problem(enum.Enum):
    MISSING = "missing"
    DIFFERS = "differs from the digest generate recorded"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Damage:
    path: Path
    problem: Problem
    detail: str = ""

    def describe(self) -> str:
        return f"{self.path}: {self.problem.value}" + (f" ({self.detail})" if self.detail else "")


class DamagedRun(UserError):
    """A run folder whose files are not what was written: the message names the first and how to recreate it."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_digest(raw: dict[str, object]) -> str:
    """The digest of run.json's configuration: every key but those later steps record beside it."""
    config = {k: v for k, v in raw.items() if k not in RECORDED_KEYS}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _read_run_file(run_dir: Path) -> dict[str, object]:
    path = run_dir / "run.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir}: not a difftest run (no run.json); create one with "
                        f"`difftest generate --out {run_dir}`") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DamagedRun(f"{path}: damaged, not readable JSON ({exc}); it cannot be recreated from the folder: "
                         "restore it from a copy, or make the run again in a new folder") from None
    if not isinstance(raw, dict):
        raise DamagedRun(f"{path}: damaged, not a JSON object; restore it from a copy, or make the run again in a new "
                         "folder")
    return raw


def recorded_digests(run_dir: Path) -> dict[str, str]:
    """The digests run.json holds (empty for a run made before difftest recorded them)."""
    files = _read_run_file(run_dir).get(FILES_KEY, {})
    return dict(files) if isinstance(files, dict) else {}


def model_files(model_dir: Path) -> list[Path]:
    """The files `generate` wrote into a model folder (not the hidden ones a write leaves while it is under way)."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def record(run_dir: Path, model_dirs: list[Path]) -> None:
    """Put the digest of each file of `model_dirs` and of the configuration into run.json (atomically)."""
    from difftest.storage.artifacts import atomic_write_text

    raw = _read_run_file(run_dir)
    files = dict(raw.get(FILES_KEY) or {})  # type: ignore[call-overload]
    files[CONFIG_ENTRY] = config_digest(raw)
    for model_dir in model_dirs:
        for path in model_files(model_dir):
            files[path.relative_to(run_dir).as_posix()] = file_digest(path)
    raw[FILES_KEY] = dict(sorted(files.items()))
    atomic_write_text(json.dumps(raw, indent=1, sort_keys=True), run_dir / "run.json")


def damaged_files(run_dir: Path, model_ids: set[str] | None = None) -> list[Damage]:
    """Every recorded file (of `model_ids`' folders, or of all) that is missing or differs from its digest, and
    run.json itself where its configuration does."""
    raw = _read_run_file(run_dir)
    files = raw.get(FILES_KEY) or {}
    if not isinstance(files, dict):
        return [Damage(run_dir / "run.json", Problem.UNREADABLE, f"its {FILES_KEY!r} is not a table")]
    found = []
    if CONFIG_ENTRY in files and files[CONFIG_ENTRY] != config_digest(raw):
        found.append(Damage(run_dir / "run.json", Problem.DIFFERS, "its configuration"))
    for relative, expected in files.items():
        if relative == CONFIG_ENTRY:
            continue
        parts = relative.split("/")
        if model_ids is not None and (len(parts) < 2 or parts[1] not in model_ids):
            continue
        path = run_dir / relative
        if not path.is_file():
            found.append(Damage(path, Problem.MISSING))
        elif file_digest(path) != expected:
            found.append(Damage(path, Problem.DIFFERS))
    return found


# files of a model folder that no second generation writes byte for byte (measured: three exports of one Keras model in
# one process, tf2onnx's name counter reset before each, gave three different files)
_NOT_REPEATABLE = {".onnx": "tf2onnx's exports of one model differ from one export to the next: the names of the "
                            "nodes it inserts and the constants it shares"}


def why_not_repeatable(path: Path) -> str:
    return _NOT_REPEATABLE.get(path.suffix, "this stack writes other bytes for it")


def repair_command(run_dir: Path, path: Path | None = None) -> str:
    if path is not None and path.suffix in _NOT_REPEATABLE:
        return (f"it cannot be made again byte for byte ({_NOT_REPEATABLE[path.suffix]}): restore it from a copy, or "
                "make the run again in a new folder")
    return f"`difftest generate --out {run_dir}` recreates it"


def check_models(run_dir: Path, model_ids: set[str] | None = None) -> None:
    """Raise `DamagedRun` (one line: the first damaged file, how many, how to recreate them) unless every recorded
    file of the run's models (or of `model_ids`) is what generate wrote."""
    damage = damaged_files(run_dir, model_ids)
    if not damage:
        return
    if damage[0].path.name == "run.json":
        raise DamagedRun(f"{damage[0].describe()}; restore it from a copy, or make the run again in a new folder")
    more = f" (and {len(damage) - 1} more file(s): `difftest verify {run_dir}` lists them)" if len(damage) > 1 else ""
    raise DamagedRun(f"{damage[0].describe()}{more}; nothing was run or judged on it: "
                     f"{repair_command(run_dir, damage[0].path)}")


# The store -----------------------------------------------------------------------------------------------------------


def store_damage(run_dir: Path) -> str | None:
    """Why the run's store cannot be trusted, or None: SQLite's quick_check fails, it does not open, or it has lost
    its table of cases while the run holds committed outputs (a store truncated to nothing reads as a new, empty one)."""
    path = run_dir / STORE_FILE
    outputs = run_dir / "outputs"
    if not path.exists():
        if outputs.is_dir() and any(outputs.rglob("*.safetensors")):
            return "it is missing, though outputs/ holds committed cases' files"
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return f"SQLite cannot read it: {exc}"
    if check != "ok":
        return f"SQLite's integrity check says: {check}"
    if "cases" not in tables and outputs.is_dir() and any(outputs.rglob("*.safetensors")):
        return f"it holds no table of cases ({path.stat().st_size} bytes), though outputs/ holds committed cases' files"
    return None


def check_store(run_dir: Path) -> None:
    """Raise `DamagedRun` with one line when the store is damaged, `UserError` when the run's ok outputs were pruned:
    nothing derived from it is written."""
    if (run_dir / PRUNED_FILE).is_file():
        raise UserError(f"{run_dir}: the outputs of its ok cases were deleted once judged ({run_dir / PRUNED_FILE}, "
                        "a campaign's counted round): its verdicts stand in comparisons.csv, findings.md and "
                        "findings/<id>/ (each finding's minimal case runs alone); judge its models again in a new run")
    why = store_damage(run_dir)
    if why is None:
        return
    raise DamagedRun(f"{run_dir / STORE_FILE} is damaged ({why}); nothing was written from it; "
                     f"{last_good_advice(run_dir)}")


def last_good_advice(run_dir: Path) -> str:
    good = run_dir / LAST_GOOD_STORE
    if good.is_file():
        return (f"the last good results are kept in {good}: copy it over {STORE_FILE} to resume from there (the "
                f"cases committed after it run again), or delete {STORE_FILE} and outputs/ to run every case again")
    return f"no good copy was kept: delete {STORE_FILE} and outputs/ to run every case again"


def keep_last_good(run_dir: Path) -> None:
    """Copy the (checked) store to `LAST_GOOD_STORE`, through SQLite's backup, so a later damage loses no result."""
    from difftest.storage.artifacts import atomic_path

    if store_damage(run_dir) is not None or not (run_dir / STORE_FILE).is_file():
        return
    with atomic_path(run_dir / LAST_GOOD_STORE) as target:
        source, copy = sqlite3.connect(run_dir / STORE_FILE), sqlite3.connect(target)
        try:
            source.backup(copy)
        finally:
            copy.close()
            source.close()

