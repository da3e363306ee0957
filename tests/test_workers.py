"""The turn threads (actors/workers.py): reused, bounded, daemon, and gone when idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from aalis_agent.actors.workers import Workers


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_sequential_tasks_reuse_one_daemon_thread() -> None:
    workers = Workers(limit=4, idle_s=30)
    seen: list[threading.Thread] = []
    for _ in range(5):
        done = threading.Event()

        def task(done: threading.Event = done) -> None:
            seen.append(threading.current_thread())
            done.set()

        workers.submit(task)
        assert done.wait(5)
        wait_for(lambda: workers._idle == 1)  # back to waiting before the next one
    assert len(set(seen)) == 1 and seen[0].daemon
    assert workers.threads == 1
    workers.release_idle()
    wait_for(lambda: workers.threads == 0)


def test_no_more_than_the_limit_run_at_once_and_the_rest_wait_in_order() -> None:
    workers = Workers(limit=2, idle_s=30)
    gate = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def task(n: int) -> None:
        with lock:
            started.append(n)
        gate.wait(10)

    for n in range(5):
        workers.submit(lambda n=n: task(n))
    wait_for(lambda: len(started) == 2)
    assert workers.threads == 2
    assert sorted(started) == [0, 1]  # 2, 3, 4 wait for a thread
    gate.set()
    wait_for(lambda: len(started) == 5)
    assert started[2:] == [2, 3, 4]
    assert workers.threads <= 2
    workers.release_idle()
    wait_for(lambda: workers.threads == 0)


def test_a_failing_task_keeps_its_worker_and_an_idle_worker_exits_in_time() -> None:
    workers = Workers(limit=1, idle_s=0.2)
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    workers.submit(boom)
    workers.submit(ran.set)
    assert ran.wait(5)
    wait_for(lambda: workers.threads == 0)  # idle past idle_s: gone


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        Workers(limit=0)
