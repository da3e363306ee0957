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

    __slots__ = ("_callbacks", "_event", "_lock", "by", "reason")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.by: str | None = None
        self.reason: str | None = None

    def abort(self, reason: str = "stop", by: str | None = None) -> None:
        """Set the signal (the first reason wins) and run the registered callbacks."""
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self.by = by
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the signal is set (at once if it is already)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    @property
    def aborted(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when aborted; True if aborted."""
        return self._event.wait(timeout)

    def raise_if_aborted(self) -> None:
        if self._event.is_set():
            raise Aborted(self.reason or "stop")
