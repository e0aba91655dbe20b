"""The result store of one run: an SQLite index of cases plus one safetensors file of outputs per case.

A case is committed by writing its outputs file atomically and then one SQLite transaction, so a kill at
any moment leaves either a committed case or none; a rerun executes exactly the uncommitted ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from difftest.contracts.errors import UserError
from difftest.storage.artifacts import atomic_save_arrays, load_arrays
from difftest.storage.integrity import STORE_FILE, DamagedRun, check_store, file_digest, last_good_advice


def results_digest(run_dir: Path) -> dict[tuple[str, str], tuple[str, str, int | None, str | None]]:
    """Each committed case's status, message (process ids aside), failing rank and the sha256 of its outputs file:
    two runs with equal digests hold the same results, byte for byte, whatever ran them and in what order."""
    import hashlib
    import re

    store = Store(run_dir)
    try:
        records = store.records()
    finally:
        store.close()
    return {(r.model, r.setting): (r.status, re.sub(r"pid \d+", "pid N", r.message), r.rank,
                                   hashlib.sha256((store.outputs_dir / r.outputs).read_bytes()).hexdigest()
                                   if r.outputs else None)
            for r in records}



_SCHEMA = """
CREATE TABLE IF NOT EXISTS cases (
    model TEXT NOT NULL,
    setting TEXT NOT NULL,
    status TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    rank INTEGER,
    wall_s REAL,
    outputs TEXT,
    finished_at REAL NOT NULL,
    outputs_sha256 TEXT,
    row_sha256 TEXT,
    PRIMARY KEY (model, setting)
);
"""
# added to a store made before them: its rows have no checksums, and are read as they are
_CHECKSUM_COLUMNS = ("outputs_sha256", "row_sha256")


def _row_digest(record: CaseRecord, outputs_sha256: str | None) -> str:
    """The checksum of a committed row: SQLite checks its pages' structure, not the values in them (a flipped bit in
    a status or a message reads back as another value), so each row carries its own."""
    # the status as its plain value: a `Status` member and the string SQLite hands back must sign alike
    fields = (record.model, record.setting, str(record.status), record.message, record.rank, record.wall_s,
              record.outputs, outputs_sha256)
    return hashlib.sha256(repr(fields).encode()).hexdigest()


@dataclass(frozen=True)
class CaseRecord:
    model: str
    setting: str
    status: str  # a run status: ok | inconsistent (a broken invariant) | error | crash | timeout | unsupported
    message: str = ""
    rank: int | None = None
    wall_s: float | None = None
    outputs: str | None = None


def outputs_filename(model: str, setting: str) -> str:
    return f"{model}/{setting.replace('/', '__')}.safetensors"


class Store:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.outputs_dir = run_dir / "outputs"
        self._lock = threading.Lock()
        self._outputs_sha256: dict[str | None, str | None] = {}  # outputs file → its checksum, as `records` read it
        try:
            self._open(run_dir)
        except sqlite3.DatabaseError:
            check_store(run_dir)  # one line saying what is damaged and where the last good results are
            raise

    def _open(self, run_dir: Path) -> None:
        self._db = sqlite3.connect(run_dir / "store.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit is in the write-ahead log the moment it returns, so a killed sweep (kill -9 included)
        # loses nothing; only the operating system's crash can roll back the last commits, and a rerun runs those
        # cases again. FULL synced the log at every commit, under the lock every worker group's results pass
        # through: 1.2 ms a case here.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(cases)")}
        for column in _CHECKSUM_COLUMNS:
            if column not in columns:
                self._db.execute(f"ALTER TABLE cases ADD COLUMN {column} TEXT")

    def close(self) -> None:
        self._db.close()

    def commit(self, record: CaseRecord, outputs: dict[str, np.ndarray] | None) -> CaseRecord:
        """Stores `record` and its outputs; the record as committed (with its outputs file)."""
        rel = digest = None
        if outputs is not None:
            rel = outputs_filename(record.model, record.setting)
            path = self.outputs_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_save_arrays(outputs, path)
            digest = file_digest(path)
        committed = dataclasses.replace(record, outputs=rel)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO cases (model, setting, status, message, rank, wall_s, outputs, finished_at, "
                "outputs_sha256, row_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.model, record.setting, record.status, record.message, record.rank, record.wall_s, rel,
                 time.time(), digest, _row_digest(committed, digest)),
            )
        return committed

    def forget(self, cases: list[tuple[str, str]]) -> None:
        """Uncommit (model, setting) cases, so the next sweep runs them again."""
        with self._lock:
            self._db.executemany("DELETE FROM cases WHERE model = ? AND setting = ?", cases)

    def done(self) -> set[tuple[str, str]]:
        with self._lock:
            return {(m, s) for m, s in self._db.execute("SELECT model, setting FROM cases")}

    def records(self) -> list[CaseRecord]:
        """Every committed case; a row that no longer matches its checksum is one line (`DamagedRun`)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT model, setting, status, message, rank, wall_s, outputs, outputs_sha256, row_sha256 FROM cases "
                "ORDER BY model, setting"
            ).fetchall()
        records = []
        for *fields, outputs_sha256, row_sha256 in rows:
            record = CaseRecord(*fields)
            if row_sha256 is not None and row_sha256 != _row_digest(record, outputs_sha256):
                raise DamagedRun(f"{self.run_dir / STORE_FILE} is damaged: the row of {record.model} × "
                                 f"{record.setting} no longer matches its checksum; nothing was written from it; "
                                 f"{last_good_advice(self.run_dir)}")
            self._outputs_sha256[record.outputs] = outputs_sha256
            records.append(record)
        return records

    def outputs_damage(self, record: CaseRecord) -> str | None:
        """What is wrong with a committed case's outputs file (missing, not its checksum, unreadable), or None."""
        try:
            self.load_outputs(record)
        except DamagedRun:
            path = self.outputs_dir / str(record.outputs)
            if not path.is_file():
                return f"{path}: missing"
            expected = self._outputs_sha256.get(record.outputs)
            return f"{path}: " + ("differs from its checksum" if expected and file_digest(path) != expected
                                  else "unreadable")
        return None

    def load_outputs(self, record: CaseRecord) -> dict[str, np.ndarray]:
        """The case's committed outputs; a damaged or missing file is one line saying how to run the case again."""
        assert record.outputs is not None
        path = self.outputs_dir / record.outputs
        try:
            expected = self._outputs_sha256.get(record.outputs)
            if expected is not None and path.is_file() and file_digest(path) != expected:
                raise UserError(f"{path}: differs from its checksum")
            return load_arrays(path)
        except UserError:
            raise DamagedRun(f"{path}: the committed outputs of {record.model} × {record.setting} are missing or "
                             f"damaged; `difftest verify {self.run_dir} --repair` uncommits every such case, so "
                             "that the next sweep runs it again") from None
