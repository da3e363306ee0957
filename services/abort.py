"""``AbortSignal``: how a stop reaches a streaming model call and a running tool."""

from __future__ import annotations

import threading
from collections.abc import Callable

from aalis_agent.events.errors import Aborted

__all__ = ["AbortSignal", "Aborted"]


class AbortSignal:
    """Set once when the turn is stopped; carries who stopped it and why.

    Model streams wait on it between chunks and tools may watch it (SCH6); waiting with
    :meth:`wait` wakes at once when the signal is set.
    """

    __slots__ = ("_aborted", "_callbacks", "_event", "_lock", "by", "reason")

    def __init__(self) -> None:
        # ``aborted`` is read many times a turn: a plain flag, set once under the lock.
        # The event for :meth:`wait` is made only when someone waits.
        self._aborted = False
        self._event: threading.Event | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.by: str | None = None
        self.reason: str | None = None

    def abort(self, reason: str = "stop", by: str | None = None) -> None:
        """Set the signal (the first reason wins) and run the registered callbacks."""
        with self._lock:
            if self._aborted:
                return
            self.reason = reason
            self.by = by
            self._aborted = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the signal is set (at once if it is already)."""
        with self._lock:
            if not self._aborted:
                self._callbacks.append(fn)
                return
        fn()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when aborted; True if aborted."""
        with self._lock:
            if self._aborted:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def raise_if_aborted(self) -> None:
        if self._aborted:
            raise Aborted(self.reason or "stop")
