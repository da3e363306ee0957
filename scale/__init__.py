"""Past one core and one machine: worker processes on this machine (``processes``), session
ownership across processes, and placement of runtime shards on Ray."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from aalis_agent.events.errors import RuntimeClosed
from aalis_agent.events.schema import Input
from aalis_agent.services.bus import EventBus

__all__ = ["ForwardedBus", "with_input_id"]


class _Follows(Protocol):
    _closed: bool

    def _follow(self, *, wait: bool = True) -> None: ...


class ForwardedBus(EventBus):
    """The bus of a client whose sessions run in other processes (worker processes, Ray
    shards): their events are published on it, and each change of its subscriptions
    calls its owner's ``_follow()`` (the owner held weakly), which tells the shards the
    topics wanted now: a subscription waits (a moment at most) until they follow it, an
    unsubscription does not (this bus calls the function no more already)."""

    def __init__(self, owner: _Follows) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)

    def subscribe(self, topic: str, fn: Callable[[str, Any], None]) -> Callable[[], None]:
        """As :meth:`EventBus.subscribe`; :class:`RuntimeClosed` once the owner is shut
        down (nothing would be published on it any more)."""
        owner = self._owner()
        if owner is None or owner._closed:
            raise RuntimeClosed("subscribe: the shards are shut down")
        del owner
        unsubscribe = super().subscribe(topic, fn)
        self._follow()

        def forwarded_unsubscribe() -> None:
            unsubscribe()
            self._follow(wait=False)

        return forwarded_unsubscribe

    def _follow(self, *, wait: bool = True) -> None:
        owner = self._owner()
        if owner is not None:
            owner._follow(wait=wait)


def with_input_id(inp: Input) -> Input:
    """``inp`` with an id: one it has, else a new random one (``in-`` and 16 hex digits,
    as a runtime gives), so that sending it again to a restarted shard is sending the
    same input, which its session answers instead of running it twice."""
    if inp.id:
        return inp
    return msgspec.structs.replace(inp, id=f"in-{uuid.uuid4().hex[:16]}")
