"""The work queue both executors run on: groups keep to their bucket and their model, move to the bucket with most
work left, never run more ranks at once than the machine has cores, and each case is handed out once."""

from __future__ import annotations

import threading
import time

from difftest.runner.scheduler import MIN_CASES_TO_JOIN, UNBOUNDED, WorkQueue


def _drain(queue: WorkQueue, workers: int, hold_s: float = 0.0) -> tuple[list[tuple], int]:
    """Run `workers` threads over the queue; (every (key, item) handed out, the most ranks busy at a hand-out)."""
    handed: list[tuple] = []
    most = [0]
    lock = threading.Lock()

    def worker() -> None:
        key = None
        while True:
            item = queue.next(key)
            if item is None and key is None:
                return
            if item is None:  # its bucket is done: it lets its group go and asks for another
                key = None
                continue
            busy = queue.ranks_busy
            with lock:
                key = item[0]
                handed.append(item)
                most[0] = max(most[0], busy)
            time.sleep(hold_s)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads), "a worker never got its None"
    return handed, most[0]


def test_every_case_is_handed_out_once_and_ranks_stay_within_the_cores() -> None:
    work = {(1, ""): list(range(40)), (2, ""): list(range(100, 130)), (4, ""): list(range(200, 206)),
            (2, "tf"): list(range(300, 303))}
    handed, most = _drain(WorkQueue(work.items(), capacity=4), workers=4, hold_s=0.002)
    assert sorted(i for _, i in handed) == sorted(i for items in work.values() for i in items)
    assert all(i in work[key] for key, i in handed)  # an item comes with its own bucket's key
    assert 2 <= most <= 4  # groups ran side by side, never more ranks than cores


def test_a_world_larger_than_the_machine_still_runs_alone() -> None:
    handed, _ = _drain(WorkQueue([((8, ""), [1, 2]), ((1, ""), [3])], capacity=2), workers=2)
    assert sorted(i for _, i in handed) == [1, 2, 3]


def test_an_idle_group_joins_a_busy_bucket_only_when_enough_cases_are_left() -> None:
    queue: WorkQueue = WorkQueue([((1, ""), list(range(MIN_CASES_TO_JOIN * 2 + 1)))], capacity=4)
    first = queue.next(None)
    second = queue.next(None)  # 2·MIN left, MIN per group once two serve it: worth a second group
    assert first is not None and second is not None and first[0] == second[0]
    small: WorkQueue = WorkQueue([((1, ""), list(range(MIN_CASES_TO_JOIN)))], capacity=4)
    assert small.next(None) is not None
    joined: list = []
    waiter = threading.Thread(target=lambda: joined.append(small.next(None)))
    waiter.start()
    time.sleep(0.1)
    assert not joined  # too few left to pay for a group's start: it waits for the serving one to finish
    key = (1, "")
    while small.next(key) is not None:
        pass  # the serving worker takes the rest, then leaves
    assert small.next(None) is None  # and nothing is left for it either
    waiter.join(2)
    assert joined == [None]


def test_a_group_keeps_to_its_model_and_the_next_group_starts_on_another() -> None:
    ws2 = [(model, i) for model in "ab" for i in range(8)]
    queue: WorkQueue = WorkQueue([((2, ""), ws2), ((4, ""), [("a", 99)])], UNBOUNDED, model_of=lambda case: case[0],
                                 min_to_join=6)
    key = (2, "")
    assert queue.next(None) == (key, ("a", 0))  # 32 rank-cases against 4
    assert queue.next(None) == (key, ("b", 0))  # still 15 per group: a second group, on the model nobody is on
    assert queue.next(None) == ((4, ""), ("a", 99))  # 14 cases: fewer than 6 for each of three groups
    assert queue.next(key, ("a", 0)) == (key, ("a", 1))  # each keeps to the model its ranks have loaded
    queue.put_back(key, ("a", 1))  # its group went away under it: it is the next case of its model
    assert queue.next(key, ("a", 1)) == (key, ("a", 1))
    last, taken = ("a", 1), []
    while (item := queue.next(key, last)) is not None:
        last = item[1]
        taken.append(last[0])
    assert taken == ["a"] * 6 + ["b"] * 7  # its model done, the group takes what the other group has left
    assert queue.drain((4, "")) == []


def test_a_worker_whose_bucket_is_done_lets_its_group_go_before_it_waits() -> None:
    """On a cluster a waiting gang would hold the resources the gang it waits for needs: the queue tells a worker
    its bucket is done (None) before it can wait, and only a worker without a group waits."""
    queue: WorkQueue = WorkQueue([((2, ""), [1]), ((4, ""), list(range(10, 10 + MIN_CASES_TO_JOIN)))], capacity=8)
    first, second = queue.next(None), queue.next(None)
    assert {first[0], second[0]} == {(2, ""), (4, "")}
    assert queue.next((2, "")) is None  # done: no item, and no wait, while it still holds its group
    assert queue.ranks_busy == 4  # its ranks are free again
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(queue.next(None)))
    waiter.start()
    time.sleep(0.1)
    assert not waited  # 3 cases left for a second group of 4: it waits, without a group
    while queue.next((4, "")) is not None:
        pass
    waiter.join(2)
    assert waited == [None]
