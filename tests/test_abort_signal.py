"""``AbortSignal``: set once, read cheaply, and a waiter wakes as soon as it is set."""

from __future__ import annotations

import threading
import time

import pytest
from aalis_agent.services.abort import Aborted, AbortSignal


def test_the_first_reason_wins_and_callbacks_run_once() -> None:
    signal = AbortSignal()
    ran: list[str] = []
    signal.add_callback(lambda: ran.append("early"))
    assert not signal.aborted
    signal.raise_if_aborted()  # not set: nothing happens
    signal.abort("stop", by="alice")
    signal.abort("shutdown", by="host")
    assert signal.aborted and (signal.reason, signal.by) == ("stop", "alice")
    signal.add_callback(lambda: ran.append("late"))  # already set: runs at once
    assert ran == ["early", "late"]
    with pytest.raises(Aborted):
        signal.raise_if_aborted()


def test_wait_returns_at_once_when_already_set_and_times_out_when_not() -> None:
    signal = AbortSignal()
    assert signal.wait(0.01) is False
    signal.abort()
    t0 = time.monotonic()
    assert signal.wait(10) is True
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("waiting_first", [True, False])
def test_a_waiter_wakes_when_another_thread_sets_it(waiting_first: bool) -> None:
    signal = AbortSignal()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(signal.wait(10)))
    if waiting_first:
        waiter.start()
        time.sleep(0.05)  # the waiter made the event and sleeps on it
        signal.abort("stop")
    else:
        signal.abort("stop")
        waiter.start()
    waiter.join(5)
    assert woke == [True]
