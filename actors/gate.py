"""``Gate``: one runtime's CPU-bound steps run one at a time.

A process runs one thread's Python at a time (the GIL). When several turns are in
flight, each thread hands the GIL over at every call that releases it (each SQLite
statement, zlib and tiktoken call) and at every lock another thread holds; on two
cores a turn then made about 26 voluntary context switches instead of 4, and used 40%
more CPU (``scripts/bench many_sessions``). The gate makes a turn's own steps, and a
submit, run one at a time, so a step keeps the GIL through its short native calls.
A turn opens the gate while it waits on the outside: around the model call and around
each tool's handler (see :meth:`Gate.released`); those run concurrently as before.

The gate never deadlocks and never stalls the runtime for long: a thread waits for it
at most ``wait_s`` seconds, then goes on without it (as with no gate at all). So a
step that blocks where the gate is still closed (a middleware waiting on the network,
say) delays other steps by at most ``wait_s``, once each.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from threading import get_ident

__all__ = ["Gate"]


class Gate:
    """A reentrant lock with a bounded wait (see the module docstring). ``wait_s``
    ``None`` turns it off: every step goes straight on."""

    __slots__ = ("_depth", "_held", "_lock", "_owner", "_waited_out", "wait_s")

    def __init__(self, wait_s: float | None = 0.05) -> None:
        if wait_s is not None and (
            isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not wait_s >= 0
        ):
            raise ValueError(
                f"Gate: wait_s must be a number of seconds >= 0 or None, not {wait_s!r}"
            )
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding the gate
        self._depth = 0  # how many times it entered
        self._waited_out = 0
        self._held = _Held(self)

    @property
    def waited_out(self) -> int:
        """How many times a thread gave up waiting and went on without the gate."""
        return self._waited_out

    def holder(self) -> int | None:
        """The ident of the thread holding the gate, if any."""
        return self._owner

    def held(self) -> AbstractContextManager[None]:
        """Run the block behind the gate (or without it once ``wait_s`` ran out)."""
        return self._held

    def released(self) -> AbstractContextManager[None]:
        """Open the gate for the block, if this thread holds it: a wait on the outside
        (a model call, a tool). The gate is taken again after it, as far as it was."""
        if self._owner != get_ident():
            return _NOTHING
        return _Released(self)


class _Held:
    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        gate = self._gate
        wait_s = gate.wait_s
        if wait_s is None:
            return
        me = get_ident()
        if gate._owner == me:
            gate._depth += 1
            return
        lock = gate._lock
        if lock.acquire(False) or lock.acquire(True, wait_s):
            gate._owner, gate._depth = me, 1
        else:
            gate._waited_out += 1

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        # Not the holder: the wait ran out (on entering, or on taking the gate back
        # after released()), so this thread went on without it.
        if gate._owner == get_ident():
            gate._depth -= 1
            if not gate._depth:
                gate._owner = None
                gate._lock.release()


class _Released:
    __slots__ = ("_depth", "_gate")

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._depth = 0

    def __enter__(self) -> None:
        gate = self._gate
        self._depth, gate._owner, gate._depth = gate._depth, None, 0
        gate._lock.release()

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        lock = gate._lock
        wait_s = gate.wait_s or 0.0
        if lock.acquire(False) or lock.acquire(True, wait_s):
            gate._owner, gate._depth = get_ident(), self._depth
        else:
            gate._waited_out += 1


_NOTHING = nullcontext()
