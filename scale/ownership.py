"""Who may run a session: the port a :class:`~aalis_agent.actors.runtime.Runtime` consults
when it starts a session's actor, and releases when the actor stops or passivates.

    runtime = Runtime(store, services, ownership=PostgresLeases(url, owner="node-1"))

One runtime owns a session at a time. ``acquire`` is called before the session's log is
read; it raises :class:`SessionOwnedElsewhere` (naming the owner) when another runtime
holds the session, so the input is refused rather than run twice. ``release`` is called
once per successful ``acquire``, when that actor leaves the runtime. An implementation
that finds it has lost a session (its lease expired and someone else took it) calls the
``on_lost`` callback, and the runtime stops that session's actor; the store's sequence
check fences whatever the stopped actor still tries to write.

:class:`ShardOwnership` narrows any ownership to the sessions of one shard (placement:
a session hashed to another shard is refused as owned elsewhere).
"""

from __future__ import annotations

import hashlib
import threading

from aalis_agent.actors.ownership import LostCallback, SessionOwnedElsewhere, SessionOwnership

__all__ = [
    "InMemoryOwnership",
    "LostCallback",
    "SessionOwnedElsewhere",
    "SessionOwnership",
    "ShardOwnership",
    "shard_of",
]

_memory_lock = threading.Lock()  # guards every InMemoryOwnership table


def shard_of(session_id: str, shards: int) -> int:
    """The shard of ``session_id`` among ``shards``: a stable hash (the same in every
    process and on every machine, unlike ``hash()``)."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


class ShardOwnership:
    """``inner`` restricted to the sessions hashed to shard ``index`` of ``shards``: the
    others are refused as owned by their shard, so ``Runtime.recover()`` on a shard
    adopts only its own sessions."""

    def __init__(self, inner: SessionOwnership, index: int, shards: int) -> None:
        self.inner = inner
        self.index = index
        self.shards = shards

    @property
    def owner(self) -> str:
        return self.inner.owner

    def acquire(self, session_id: str) -> None:
        home = shard_of(session_id, self.shards)
        if home != self.index:
            raise SessionOwnedElsewhere(session_id, f"shard {home}")
        self.inner.acquire(session_id)

    def release(self, session_id: str) -> None:
        self.inner.release(session_id)

    def confirm(self, session_id: str) -> bool:
        confirm = getattr(self.inner, "confirm", None)
        return True if confirm is None else bool(confirm(session_id))

    def on_lost(self, callback: LostCallback) -> None:
        self.inner.on_lost(callback)

    def close(self) -> None:
        self.inner.close()


class InMemoryOwnership:
    """Ownership within one process (tests, several runtimes in one program): a shared
    ``table`` of session -> owner; no expiry, since a process's runtimes die together."""

    def __init__(self, owner: str, table: dict[str, tuple[str, int]] | None = None) -> None:
        self._owner = owner
        self._table: dict[str, tuple[str, int]] = {} if table is None else table
        self._lock = _memory_lock

    @property
    def owner(self) -> str:
        return self._owner

    def acquire(self, session_id: str) -> None:
        with self._lock:
            holder, count = self._table.get(session_id, (self._owner, 0))
            if holder != self._owner:
                raise SessionOwnedElsewhere(session_id, holder)
            self._table[session_id] = (self._owner, count + 1)

    def release(self, session_id: str) -> None:
        with self._lock:
            holder, count = self._table.get(session_id, ("", 0))
            if holder != self._owner:
                return
            if count > 1:
                self._table[session_id] = (holder, count - 1)
            else:
                del self._table[session_id]

    def on_lost(self, callback: LostCallback) -> None:
        pass  # nothing expires

    def close(self) -> None:
        with self._lock:
            for session_id in [s for s, (o, _) in self._table.items() if o == self._owner]:
                del self._table[session_id]
