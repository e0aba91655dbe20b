"""What a person watching a sweep sees: per-family progress, counts so far and an ETA.

On a terminal, a live rich display (one bar for the sweep, one per family of settings); anywhere else (CI logs, a
file), one plain line every `every` cases and one at the end, so a log shows progress without control characters.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from difftest.contracts.errors import UserError
from difftest.contracts.status import NOT_OK


def family_of(setting_name: str) -> str:
    """The family the progress line counts a setting in (`Setting.family_label`: `torchrec`, `rerun/ddp`)."""
    from difftest.contracts.registry import get_setting

    try:
        return get_setting(setting_name).family_label
    except UserError:  # a name no loaded plugin registers
        return setting_name.split("/")[0]


def _format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def status_counts(counts: Mapping[str, int]) -> str:
    """`crash=4 ok=1639 unsupported=832`: how many cases ended in each status, by the status's name."""
    return " ".join(f"{status}={n}" for status, n in sorted(counts.items()))


class SweepProgress:
    def __init__(self, console: Console, every: int | None = None) -> None:
        self.console = console
        self.live = console.is_terminal
        self.every = every
        self.counts: Counter[str] = Counter()
        self.per_family: Counter[tuple[str, str]] = Counter()
        self.family_totals: Counter[str] = Counter()
        self.total = 0
        self.done = 0
        self.started = time.perf_counter()
        self.refused = 0
        self.findings = 0  # distinct signatures of the cases judged not ok so far
        self.running_since: float | None = None
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> SweepProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description:<16}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[detail]}"),
                console=self.console, transient=False,
            )
            self._progress.__enter__()
            self._tasks["sweep"] = self._progress.add_task("sweep", total=None, detail="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
        elif self.total:
            self._line()

    def planned(self, setting_names: list[str], refused: int = 0) -> None:
        """`refused`: how many of them (the first ones) are refused without running; the ETA ignores them."""
        self.total = len(setting_names)
        self.refused = refused
        self.family_totals = Counter(family_of(n) for n in setting_names)
        if self.every is None:
            self.every = max(10, self.total // 20)
        if self._progress is not None:
            self._progress.update(self._tasks["sweep"], total=self.total)
            for family, total in sorted(self.family_totals.items()):
                self._tasks[family] = self._progress.add_task(family, total=total, detail="")
        else:
            self.console.print(f"sweep: {self.total} cases to run ({len(self.family_totals)} families)",
                               highlight=False)

    def _counts(self) -> str:
        found = f" findings so far={self.findings}" if self.findings else ""
        return status_counts(self.counts) + found

    def _eta(self) -> float | None:
        ran = self.done - self.refused
        if self.running_since is None or ran <= 0:
            return None
        return (time.perf_counter() - self.running_since) / ran * (self.total - self.done)

    def _line(self) -> None:
        elapsed = time.perf_counter() - self.started
        eta = self._eta()
        self.console.print(
            f"sweep {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%) {self._counts()} "
            f"elapsed {_format_seconds(elapsed)}" + (f" eta {_format_seconds(eta)}" if eta is not None else ""),
            highlight=False, soft_wrap=True,
        )

    def finding(self, finding: Any) -> None:
        """A case whose signature is new (`difftest.findings.live.LiveFinding`): one line, above the bars on a terminal."""
        line = (f"[{_format_seconds(finding.seconds)}] finding {finding.number} so far: {finding.title} "
                f"({finding.setting} on {finding.model})")
        console = self._progress.console if self._progress is not None else self.console
        console.print(escape(line), highlight=False, soft_wrap=True)

    def result(self, setting_name: str, status: str, findings: int | None = None) -> None:
        if findings is not None:
            self.findings = findings
        self.done += 1
        if self.done == self.refused:
            self.running_since = time.perf_counter()
        elif self.running_since is None and self.done > self.refused:
            self.running_since = self.started
        self.counts[status] += 1
        family = family_of(setting_name)
        self.per_family[(family, status)] += 1
        if self._progress is not None:
            self._progress.update(self._tasks["sweep"], advance=1, detail=self._counts())
            failures = sum(self.per_family[(family, s)] for s in NOT_OK)
            self._progress.update(self._tasks[family], advance=1,
                                  detail=f"[red]{failures} not ok[/red]" if failures else "")
        elif self.done % (self.every or 1) == 0 and self.done < self.total:
            self._line()
