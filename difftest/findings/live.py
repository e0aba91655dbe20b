"""Findings while the sweep runs: each case is judged as soon as what judges it (its reference, its root's
calibrations) is committed, and each new signature is told at once, so the first finding shows within a minute of the
start instead of after the sweep and its minimisation. Triage after the sweep has the whole run's contrast and the
known-issue manifest, and groups these cases for good; the live signatures are its first draft."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from difftest.contracts.status import DISAGREEMENTS, FAILURES
from difftest.contracts.tolerance import Tolerance
from difftest.findings.signature import case_signature, first_divergence
from difftest.judging.analysis import Judge, Judged, Judgement
from difftest.storage.store import CaseRecord, Store

if TYPE_CHECKING:
    from difftest.contracts.spec import ModelSpec
    from difftest.runner.executor import Case


@dataclass(frozen=True)
class LiveFinding:
    number: int  # 1 for the sweep's first
    seconds: float  # since the tracker started
    signature: str
    title: str
    model: str
    setting: str


class LiveFindings:
    """Fed every committed case of a sweep (`result`); calls `on_new` for each case whose signature is new."""

    def __init__(self, run_dir: Path, tol: Tolerance = Tolerance(), oracle: str = "calibrated",
                 on_new: Callable[[LiveFinding], None] = lambda finding: None) -> None:
        self._store = Store(run_dir)
        self._planned: set[tuple[str, str]] = set()
        self._left: Counter[str] = Counter()  # cases of each model still to be judged
        self._specs: dict[str, ModelSpec] = {}
        self._judge = Judge(self._store, tol, oracle, will_run=lambda model, setting: (model, setting) in self._planned)
        for record in self._store.records():  # a resumed run: what earlier sweeps committed judges the new cases
            self._judge.add(record)
        self._waiting: dict[str, list[CaseRecord]] = {}
        self._lock = threading.Lock()
        self._on_new = on_new
        self._started = time.perf_counter()
        self.found: dict[str, LiveFinding] = {}
        # each case judged so far: its judgement with the record it judged (`verdicts`; `judged` for the analysis)
        self._judged: dict[tuple[str, str], tuple[CaseRecord, Judgement]] = {}
        self._committed_again: set[str] = set()  # models a case of which was committed twice
        self.cases_not_ok = 0

    def planned(self, cases: list[Case]) -> None:
        with self._lock:
            self._planned = {(c.model_id, c.setting.name) for c in cases}
            self._left = Counter(c.model_id for c in cases)
            self._specs = {c.model_id: c.spec for c in cases}

    def result(self, case: Case, record: CaseRecord) -> None:
        with self._lock:
            if (record.model, record.setting) in self._judge.records:  # what judged its peers may have changed
                self._committed_again.add(record.model)
            self._judge.add(record)
            waiting = self._waiting.setdefault(record.model, [])
            waiting.append(record)
            still: list[CaseRecord] = []
            for pending in waiting:  # this case, and those that waited for it
                judged = self._judge.judge(pending, self._specs[pending.model])
                if judged is None:
                    still.append(pending)
                else:
                    self._left[pending.model] -= 1
                    self._judged[(pending.model, pending.setting)] = (pending, judged)
                    self._tell(pending, judged)
            self._waiting[record.model] = still
            if self._left[record.model] <= 0:
                self._judge.forget(record.model)  # every case of it judged: its references need not stay in memory

    def _tell(self, record: CaseRecord, judged: Judgement) -> None:
        if judged.verdict not in FAILURES + DISAGREEMENTS:
            return
        self.cases_not_ok += 1
        message = next((r["message"] for r in judged.rows if r.get("message")), record.message)
        signature, title = case_signature(judged.verdict, self._specs[record.model].kind, record.setting, str(message or ""),
                                          first_divergence(judged.rows), {})
        if signature in self.found:
            return
        finding = LiveFinding(len(self.found) + 1, time.perf_counter() - self._started, signature, title,
                              record.model, record.setting)
        self.found[signature] = finding
        self._on_new(finding)

    @property
    def verdicts(self) -> dict[tuple[str, str], str]:
        """Every case judged so far, by (model, setting): its verdict."""
        with self._lock:
            return {key: judgement.verdict for key, (_, judgement) in self._judged.items()}

    def judged(self) -> Judged:
        """Every case judged during the sweep, with the record judged: what the analysis after it need not judge
        again (it judges anew a case whose record has changed since). None of a model one of whose cases was
        committed twice: its references may have changed under judgements already made."""
        with self._lock:
            return {key: value for key, value in self._judged.items() if key[0] not in self._committed_again}

    @property
    def waiting(self) -> int:
        """Cases committed and not judged yet: what judges them has still to run."""
        with self._lock:
            return sum(len(records) for records in self._waiting.values())

    def close(self) -> None:
        self._store.close()
