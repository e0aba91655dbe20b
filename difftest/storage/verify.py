"""`difftest verify RUN`: every check of a run folder (`difftest.storage.integrity`: run.json, the models' digests, the store)
and each committed case's outputs, each problem one line with its repair."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from difftest.storage.integrity import (
    CONFIG_ENTRY,
    STORE_FILE,
    DamagedRun,
    check_store,
    damaged_files,
    recorded_digests,
    repair_command,
    store_damage,
)
from difftest.storage.store import Store


@dataclass(frozen=True)
class Verification:
    problems: list[str]  # one line each: what is wrong and how to repair it
    checked: list[str]  # one line each: what was checked and found sound

    @property
    def sound(self) -> bool:
        return not self.problems


def verify(run_dir: Path, repair_outputs: bool = False) -> Verification:
    """Every check of a run folder: run.json, the models' digests, the store, each committed case's outputs. With
    `repair_outputs`, the cases whose outputs are damaged are uncommitted (the next sweep runs them again)."""
    problems: list[str] = []
    checked: list[str] = []
    files = recorded_digests(run_dir)  # run.json unreadable: one line, from the caller
    damage = damaged_files(run_dir)
    if not files:
        problems.append(f"{run_dir / 'run.json'}: no digests recorded (a run made before difftest recorded them): "
                        f"`difftest generate --out {run_dir}` records them")
    for d in damage:
        fix = ("restore it from a copy" if d.path.name == "run.json" else repair_command(run_dir, d.path))
        problems.append(f"{d.describe()}: {fix}")
    if files and not damage:
        checked.append(f"{len(files) - (CONFIG_ENTRY in files)} model files and run.json's configuration match the "
                       "digests generate recorded")
    why = store_damage(run_dir)
    if why is not None:
        try:
            check_store(run_dir)
        except DamagedRun as exc:
            problems.append(str(exc))
        return Verification(problems, checked)  # the cases' outputs are known only through a sound store
    if not (run_dir / STORE_FILE).is_file():
        checked.append("no store yet (nothing swept)")
        return Verification(problems, checked)
    store = Store(run_dir)  # one pass: every row against its checksum, every outputs file against its own
    try:
        records = store.records()
        outputs = [(r.model, r.setting, why) for r in records
                   if r.outputs is not None and (why := store.outputs_damage(r)) is not None]
        if outputs and repair_outputs:
            store.forget([(model, setting) for model, setting, _ in outputs])
    except DamagedRun as exc:  # a row no longer matching its checksum
        problems.append(str(exc))
        return Verification(problems, checked)
    finally:
        store.close()
    if outputs and repair_outputs:
        checked.append(f"{len(outputs)} case(s) with damaged outputs uncommitted: the next sweep runs them again")
    else:
        problems += [f"{model} × {setting}: {what}: `difftest verify {run_dir} --repair` uncommits it, so that "
                     "the next sweep runs it again" for model, setting, what in outputs]
    checked.append(f"the store passes SQLite's integrity check; {len(records)} committed case(s), "
                   f"{len(records) - len(outputs)} with sound outputs")
    return Verification(problems, checked)
