"""Injected time and ids, so logs, tests and replays are deterministic."""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Protocol

__all__ = ["Clock", "FixedClock", "IdSource", "SequentialIds", "SystemClock", "UuidIds"]


class Clock(Protocol):
    """Milliseconds since the epoch."""

    def now_ms(self) -> int: ...


class SystemClock:
    """The wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class FixedClock:
    """A clock that moves only when told (tests, demos, benchmarks)."""

    def __init__(self, start_ms: int = 1_767_225_600_000, step_ms: int = 0) -> None:
        self._now = start_ms
        self._step = step_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            now = self._now
            self._now += self._step
            return now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms


class IdSource(Protocol):
    """New unique ids with a readable prefix (``turn``, ``in``, ``msg``)."""

    def new(self, prefix: str) -> str: ...


class UuidIds:
    """Random ids for production."""

    def new(self, prefix: str) -> str:
        # 64 random bits as 16 hex digits (what uuid4's hex began with, without
        # building the UUID): ids are made several times a turn.
        return f"{prefix}-{os.urandom(8).hex()}"


class SequentialIds:
    """``turn-1``, ``turn-2``, ...: deterministic ids for tests and demos."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()

    def new(self, prefix: str) -> str:
        with self._lock:
            counter = self._counters.setdefault(prefix, itertools.count(1))
            return f"{prefix}-{next(counter)}"
