"""A small in-process event bus: ``agent:queue``, turn lifecycle, ``outbound:message``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["EventBus", "Subscriber"]

Subscriber = Callable[[str, Any], None]
log = structlog.get_logger("aalis.bus")


class EventBus:
    """Topic subscriptions; a subscriber that raises is logged and the rest still run.

    A payload is read-only: every subscriber of an event gets the same object, and parts
    of it may be shared with later events (``agent:queue``'s items are).

    The runtime builds an event's payload only when :meth:`wants` says someone listens
    to its topic, and publishes it only then: a subclass that forwards events on its own
    says so in ``wants`` too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, list[Subscriber]] = {}
        # The topics someone listens to now ("*" among them when someone listens to all):
        # made anew under the lock at each change, read without it by ``wants``.
        self._wanted: frozenset[str] = frozenset()

    def _changed(self) -> None:
        """Called under the lock after a subscription changed."""
        self._wanted = frozenset(topic for topic, fns in self._subs.items() if fns)

    def subscribe(self, topic: str, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn(topic, payload)`` for each event on ``topic`` (``*`` = all topics)."""
        with self._lock:
            self._subs.setdefault(topic, []).append(fn)
            self._changed()
        subscribed = [True]

        def unsubscribe() -> None:
            """Ends this subscription; called again, it does nothing (it must not end
            another subscription of the same function)."""
            with self._lock:
                subs = self._subs.get(topic, [])
                if subscribed[0] and fn in subs:
                    subs.remove(fn)
                    self._changed()
                subscribed[0] = False

        return unsubscribe

    def wants(self, topic: str) -> bool:
        """Whether anyone listens to ``topic``: a payload costly to build is built only
        then."""
        wanted = self._wanted  # (a turn asks a dozen times: no dict lookups)
        return topic in wanted or "*" in wanted

    def publish(self, topic: str, payload: Any) -> None:
        if not self.wants(topic):
            return  # no one listens (read without the lock, as ``wants`` is)
        with self._lock:
            subs = [*self._subs.get(topic, ()), *self._subs.get("*", ())]
        for fn in subs:
            try:
                fn(topic, payload)
            except Exception:
                log.exception("subscriber failed", topic=topic)
