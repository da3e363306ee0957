"""Who may run a session: the port a :class:`~aalis_agent.actors.runtime.Runtime` consults
when it starts a session's actor, and releases when the actor stops or passivates
(``Runtime(..., ownership=...)``; implementations live in :mod:`aalis_agent.scale`).

One runtime owns a session at a time. ``acquire`` is called before the session's log is
read; it raises :class:`SessionOwnedElsewhere` (naming the owner) when another runtime
holds the session, so the input is refused rather than run twice. ``release`` is called
once per successful ``acquire``, when that actor leaves the runtime. An implementation
that finds it has lost a session calls the ``on_lost`` callback, and the runtime stops
that session's actor; the store's sequence check fences whatever it still tries to write.
An implementation may also offer ``confirm(session_id) -> bool``: asked by a turn before
each model call and tool run, whether the session is still held here (for leases: renewed
recently, else renewed now), so that a runtime paused past its lease does not act on a
session another runtime has taken meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aalis_agent.events.errors import RunError

__all__ = ["LostCallback", "SessionOwnedElsewhere", "SessionOwnership"]

LostCallback = Callable[[str], None]


class SessionOwnedElsewhere(RunError):
    """Another runtime owns this session now: the input was not accepted (nothing was
    written). Send it to ``owner``, or retry once its lease has expired
    (``expires_in_s``, when known)."""

    def __init__(self, session_id: str, owner: str, expires_in_s: float | None = None) -> None:
        when = f"; its lease expires in {expires_in_s:.1f}s" if expires_in_s is not None else ""
        super().__init__(
            f"session {session_id!r} is owned by {owner!r}{when}: the input was not "
            "accepted here (send it to its owner, or retry once the lease expires)"
        )
        self.session_id = session_id
        self.owner = owner
        self.expires_in_s = expires_in_s


class SessionOwnership(Protocol):
    """Exclusive ownership of sessions by one runtime at a time."""

    @property
    def owner(self) -> str:
        """This runtime's name, as other runtimes' errors show it."""
        ...

    def acquire(self, session_id: str) -> None:
        """Own ``session_id`` (again), or raise :class:`SessionOwnedElsewhere`."""
        ...

    def release(self, session_id: str) -> None:
        """Give back one ``acquire``: the last one frees the session for others."""
        ...

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(session_id)`` when a session held here was lost."""
        ...

    def close(self) -> None:
        """Release everything held and stop any background work."""
        ...
