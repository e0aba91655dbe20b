"""Which case a worker group runs next, for every executor: one queue per bucket (world size × process affinity),
groups that keep to their bucket while it has cases and to the model their ranks have loaded, and an idle group that
moves to the bucket with the most work left per group serving it, as long as the machine has a core for each of its
ranks.

A group's start costs seconds (processes, imports, a process group), so a group moves only to a bucket nobody serves
or to one with at least `min_to_join` cases per group that would then serve it: a bucket's last few cases are not
worth a second group. Loading a model costs about as much as a small case, so within its bucket a group takes the
next case of its own model, else a model no other group is on, else the one with the most cases left.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable

MIN_CASES_TO_JOIN = 4
UNBOUNDED = sys.maxsize  # capacity of an executor whose cluster places the groups itself
Key = TypeVar("Key", bound=tuple[int, str])  # (world size, process affinity): `BucketKey`
Item = TypeVar("Item")


def machine_ranks() -> int:
    """How many processes this machine computes with at once: one per core this process may use (each rank computes
    with one intra-op thread)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# A rank of a case of two or more ranks spends part of it blocked on its peers (the rendezvous, every collective), and
# tiny cases are mostly that: one rank beyond the cores computes in that time, for the same CPU time and a shorter
# sweep (measured on the default job: benchmarks/RESULTS.md, "One rank beyond the cores").
RANKS_BEYOND_CORES = 1


def ranks_at_once() -> int:
    """How many ranks the local executor keeps running: one per core and `RANKS_BEYOND_CORES` more."""
    return machine_ranks() + RANKS_BEYOND_CORES


class WorkQueue(Generic[Key, Item]):
    """Items by key, and within a key by `model_of(item)`. `next(key, last)` hands a worker the next item of its key,
    or moves it to another key. A key's first element is its world size: the ranks a group of it occupies, out of
    `capacity`."""

    def __init__(self, work: Iterable[tuple[Key, list[Item]]], capacity: int,
                 model_of: Callable[[Item], Hashable] = lambda item: None,
                 min_to_join: int = MIN_CASES_TO_JOIN) -> None:
        self._model_of = model_of
        self._min_to_join = min_to_join
        self._left: dict[Key, OrderedDict[Hashable, deque[Item]]] = {}
        self._count: Counter[Key] = Counter()
        for key, items in work:
            for item in items:
                self._left.setdefault(key, OrderedDict()).setdefault(model_of(item), deque()).append(item)
                self._count[key] += 1
        self._on: dict[Key, Counter[Hashable]] = {key: Counter() for key in self._left}  # workers on each model of a key
        self._serving: Counter[Key] = Counter()
        self._capacity = capacity
        self._ranks_busy = 0
        self._changed = threading.Condition()

    def next(self, key: Key | None, last: Item | None = None) -> tuple[Key, Item] | None:
        """The next item for a worker that holds a group of `key` and last ran `last`, or, with `key` None, the first
        item of the bucket the worker should start a group for (waiting while none is worth one).

        None, asked with a key: that bucket has nothing left for it, and the worker no longer counts as serving it; it
        lets its group go and asks again with key None (so no worker waits while holding a group: a cluster's waiting
        gangs would keep the resources another gang needs). None, asked with key None: nothing is left, it stops."""
        with self._changed:
            if key is not None:
                if last is not None:
                    self._on[key][self._model_of(last)] -= 1
                if self._count[key]:
                    return key, self._take(key, last)
                self._leave(key)  # its group's ranks are free again
                return None
            while True:
                chosen = self._best_bucket()
                if chosen is not None:
                    self._serving[chosen] += 1
                    self._ranks_busy += chosen[0]
                    return chosen, self._take(chosen, None)
                if not any(self._count.values()) or not any(self._serving.values()):
                    return None  # all taken, or nothing will free the cores the rest needs
                self._changed.wait()  # a running group will finish or leave

    def serve(self, run: Callable[[Key, Item], None], release: Callable[[], None]) -> None:
        """One worker's loop: `run(key, item)` on its group of `key` for every item the queue hands it, `release()`
        (let its group go) whenever its bucket is done, before it waits for another; returns once nothing is left.
        An error in either leaves its bucket (so no other worker waits for it) and is raised."""
        key: Key | None = None
        last: Item | None = None
        try:
            while True:
                item = self.next(key, last)
                if item is None:
                    finished, key, last = key, None, None
                    release()
                    if finished is None:
                        return
                    continue
                key, last = item
                run(key, last)
        except BaseException:
            if key is not None:
                self.leave(key, last)
            raise

    def _take(self, key: Key, last: Item | None) -> Item:
        models, on = self._left[key], self._on[key]
        model = self._model_of(last) if last is not None else None
        if last is None or not models.get(model):
            nonempty = [m for m, items in models.items() if items]
            free = [m for m in nonempty if not on[m]]
            model = free[0] if free else max(nonempty, key=lambda m: len(models[m]))
        on[model] += 1
        self._count[key] -= 1
        return models[model].popleft()

    def put_back(self, key: Key, item: Item) -> None:
        """An item whose worker went away before finishing it: the next one of its model, for whoever serves `key`."""
        with self._changed:
            self._left[key].setdefault(self._model_of(item), deque()).appendleft(item)
            self._count[key] += 1
            self._changed.notify_all()

    def drain(self, key: Key) -> list[Item]:
        """Every item `key` has left, taken out of the queue (nothing can run them)."""
        with self._changed:
            items = [item for models in self._left.get(key, {}).values() for item in models]
            for models in self._left.get(key, {}).values():
                models.clear()
            self._count[key] = 0
            return items

    @property
    def ranks_busy(self) -> int:
        """Ranks of the groups serving a bucket now (at most `capacity`, unless one world is larger on its own)."""
        with self._changed:
            return self._ranks_busy

    def leave(self, key: Key, last: Item | None = None) -> None:
        """A worker stops serving `key` for good (its thread ends on an error)."""
        with self._changed:
            if last is not None:
                self._on[key][self._model_of(last)] -= 1
            self._leave(key)

    def _leave(self, key: Key) -> None:
        self._serving[key] -= 1
        self._ranks_busy -= key[0]
        self._changed.notify_all()

    def _best_bucket(self) -> Key | None:
        free = self._capacity - self._ranks_busy
        worth: list[tuple[float, Key]] = []
        for key, cases in self._count.items():
            # a world larger than the machine still runs, alone (oversubscribed), rather than never
            fits = key[0] <= free or self._ranks_busy == 0
            joins = self._serving[key] == 0 or cases >= self._min_to_join * (self._serving[key] + 1)
            if cases and fits and joins:
                worth.append((cases * key[0] / (self._serving[key] + 1), key))
        return max(worth, key=lambda w: w[0])[1] if worth else None
