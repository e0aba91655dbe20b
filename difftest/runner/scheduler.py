"""Which case a worker group runs next: one queue per bucket (world size × process affinity), groups that keep to
their bucket while it has cases, and an idle group that moves to the bucket with the most work left per group
serving it, as long as the machine has a core for each of its ranks.

A group's start costs seconds (processes, imports, a process group), so a group moves only to a bucket nobody serves
or to one with at least `MIN_CASES_TO_JOIN` cases per group that would then serve it: a bucket's last few cases are
not worth a second group.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from typing import TYPE_CHECKING, Generic, Hashable, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable

MIN_CASES_TO_JOIN = 4
Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")


def machine_ranks() -> int:
    """How many ranks this machine runs at once: one per core this process may use (each rank computes with one
    intra-op thread)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class WorkQueue(Generic[Key, Item]):
    """Items by key; `next(key)` hands a worker the next item of its key, or moves it to another key. A key's first
    element is its world size: the ranks a group of it occupies, out of `capacity`."""

    def __init__(self, work: Iterable[tuple[Key, list[Item]]], capacity: int) -> None:
        self._queues: dict[Key, deque[Item]] = {key: deque(items) for key, items in work if items}
        self._serving: Counter[Key] = Counter()
        self._capacity = capacity
        self._ranks_busy = 0
        self._changed = threading.Condition()

    def next(self, key: Key | None) -> tuple[Key, Item] | None:
        """The next item for a worker that holds a group of `key` (None: none yet); a different key means the worker
        leaves its group and starts one of that key. None when nothing is left for it: the worker stops."""
        with self._changed:
            while True:
                if key is not None and self._queues.get(key):
                    return key, self._queues[key].popleft()
                if key is not None:  # its own bucket is empty: its group's ranks are free again
                    self._leave(key)
                    key = None
                chosen = self._best_bucket()
                if chosen is not None:
                    self._serving[chosen] += 1
                    self._ranks_busy += chosen[0]
                    return chosen, self._queues[chosen].popleft()
                if not any(self._queues.values()) or not any(self._serving.values()):
                    return None  # all taken, or nothing will free the cores the rest needs
                self._changed.wait()  # a running group will finish or leave

    @property
    def ranks_busy(self) -> int:
        """Ranks of the groups serving a bucket now (at most `capacity`, unless one world is larger on its own)."""
        with self._changed:
            return self._ranks_busy

    def leave(self, key: Key) -> None:
        """A worker stops serving `key` for good (its thread ends on an error)."""
        with self._changed:
            self._leave(key)

    def _leave(self, key: Key) -> None:
        self._serving[key] -= 1
        self._ranks_busy -= key[0]
        self._changed.notify_all()

    def _best_bucket(self) -> Key | None:
        free = self._capacity - self._ranks_busy
        worth: list[tuple[float, Key]] = []
        for key, cases in self._queues.items():
            # a world larger than the machine still runs, alone (oversubscribed), rather than never
            fits = key[0] <= free or self._ranks_busy == 0
            joins = self._serving[key] == 0 or len(cases) >= MIN_CASES_TO_JOIN * (self._serving[key] + 1)
            if cases and fits and joins:
                worth.append((len(cases) * key[0] / (self._serving[key] + 1), key))
        return max(worth, key=lambda w: w[0])[1] if worth else None
