"""``Gate``: one runtime's CPU-bound steps run one at a time.

A process runs one thread's Python at a time (the GIL). When several turns are in
flight, each thread hands the GIL over at every call that releases it (each SQLite
statement, zlib and tiktoken call) and at every lock another thread holds; on two
cores a turn then made about 26 voluntary context switches instead of 4, and used 40%
more CPU (``scripts/bench many_sessions``). The gate makes a turn's own steps, and a
submit, run one at a time, so a step keeps the GIL through its short native calls.

A turn opens the gate while it waits on the outside: around the model call and around
each tool's handler (see :meth:`Gate.released`); those run concurrently as before.
Opening it costs a hand-over when another thread is waiting (it takes the gate, and the
turn waits for it back), which only pays when the wait is long: a model or a tool whose
last few calls each returned within ``quick_s`` (an in-process scripted model, a tool
that computes) is called with the gate kept, until one of its calls is slow again.

The gate is sticky: a thread that leaves it and comes straight back (its next step,
its next turn) usually takes it again, which keeps its caches warm. So that the others
are not starved, a thread leaving the gate while another has waited longer than
``handoff_s`` hands it over: it does not take it back before a waiter has.

The gate never deadlocks and never stalls the runtime for long: a thread waits for it
at most ``wait_s`` seconds, then goes on without it (as with no gate at all). So a
step that blocks where the gate is still closed (a middleware waiting on the network,
say) delays other steps by at most ``wait_s``, once each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from contextlib import AbstractContextManager, nullcontext
from threading import get_ident

__all__ = ["Gate"]

_QUICK_CALLS = 3  # calls in a row within quick_s before the gate is kept around the next
_KEYS = 4096  # outside calls remembered (model entries, tool names); then forgotten


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"Gate: {name} must be a number of seconds >= 0, not {value!r}")
    return float(value)


class Gate:
    """A reentrant lock with a bounded wait (see the module docstring). ``wait_s``
    ``None`` turns it off: every step goes straight on."""

    __slots__ = (
        "_depth",
        "_handed",
        "_handoff",
        "_handoffs",
        "_held",
        "_kept",
        "_lock",
        "_owner",
        "_quick",
        "_waited_out",
        "_waiting",
        "handoff_s",
        "quick_s",
        "wait_s",
    )

    def __init__(
        self,
        wait_s: float | None = 0.05,
        *,
        handoff_s: float | None = None,
        quick_s: float = 0.0002,
    ) -> None:
        self.wait_s = None if wait_s is None else _seconds("wait_s", wait_s)
        # By default 0.4 of wait_s (20 ms of 50): a starved waiter is handed the gate
        # well before its wait runs out. Shorter hands it round at almost every turn's
        # end (with 4 threads busy, 0.005 s cut the throughput by a fifth).
        if handoff_s is None:
            handoff_s = 0.4 * (self.wait_s or 0.0)
        self.handoff_s = _seconds("handoff_s", handoff_s)
        self.quick_s = _seconds("quick_s", quick_s)
        # Used one level deep (the gate counts its own depth): an RLock only so that a
        # thread interrupted between taking it and recording that it did can tell it
        # holds it, and give it back (see _acquire).
        self._lock = threading.RLock()
        self._owner: int | None = None  # the thread holding the gate
        self._depth = 0  # how many times it entered
        self._waited_out = 0
        self._handoffs = 0
        self._kept = 0
        # Threads blocked on the lock, with when they began (a dict's single operations
        # are atomic under the GIL).
        self._waiting: dict[int, float] = {}
        self._handoff = False  # the gate was left for a waiter: no one else takes it
        self._handed = threading.Event()  # set once a waiter has taken it
        self._quick: dict[Hashable, int] = {}  # outside calls: quick calls in a row
        self._held = _Held(self)

    @property
    def waited_out(self) -> int:
        """How many times a thread gave up waiting and went on without the gate."""
        return self._waited_out

    @property
    def handoffs(self) -> int:
        """How many times a thread leaving the gate left it to a starved waiter."""
        return self._handoffs

    @property
    def kept(self) -> int:
        """How many outside calls ran with the gate kept (they had been quick)."""
        return self._kept

    def holder(self) -> int | None:
        """The ident of the thread holding the gate, if any."""
        return self._owner

    def held(self) -> AbstractContextManager[None]:
        """Run the block behind the gate (or without it once ``wait_s`` ran out)."""
        return self._held

    def released(self, key: Hashable | None = None) -> AbstractContextManager[None]:
        """Open the gate for the block, if this thread holds it: a wait on the outside
        (a model call, a tool). The gate is taken again after it, as far as it was.

        With a ``key`` (the model's entry, the tool's name), the gate stays closed when
        that key's last calls were each quicker than ``quick_s``: opening it would only
        hand this thread's work to another and back."""
        if self._owner != get_ident():
            return _NOTHING
        return _Released(self, key)

    def _acquire(self, depth: int, wait: float | None = None) -> bool:
        """Take the lock (waiting up to ``wait`` seconds, or not at all) and record this
        thread as the holder, ``depth`` deep; whether it was taken. An exception raised
        in between (a KeyboardInterrupt lands after any call) gives the lock back, so the
        gate is never left locked with no holder."""
        lock = self._lock
        try:
            taken = lock.acquire(False) if wait is None else lock.acquire(True, wait)
            if taken:
                self._owner, self._depth = get_ident(), depth
                if self._handoff:  # this thread is the one it was left for, or in its place
                    self._handoff = False
                    self._handed.set()
            return taken
        except BaseException:
            if lock._is_owned():  # type: ignore[attr-defined]
                self._owner = None
                lock.release()
            raise

    def _take(self, depth: int) -> None:
        """Take the gate ``depth`` deep, waiting at most ``wait_s`` (the slow path)."""
        wait_s = self.wait_s or 0.0
        me = get_ident()
        if self._handoff and self._waiting:  # left for a waiter: let it land, briefly
            self._handed.wait(min(wait_s, self.handoff_s))
            if not self._handoff and self._acquire(depth):
                return
        waiting = self._waiting
        waiting[me] = time.monotonic()
        try:
            taken = self._acquire(depth, wait_s)
        finally:
            del waiting[me]
        # Its wait ran out as the gate was left to it (or to another waiter that gave up
        # too): nobody takes a gate left for someone else, so it takes it now.
        if not taken and not (self._handoff and self._acquire(depth)):
            self._waited_out += 1

    def _leave(self) -> None:
        """Open the gate (held by this thread, at depth 0 now); to a starved waiter
        only, if one has waited longer than ``handoff_s``. The lock is let go whatever
        happens meanwhile (an interrupt included)."""
        try:
            self._owner = None
            waiting = self._waiting
            if (
                waiting
                and not self._handoff
                and time.monotonic() - min(waiting.values(), default=float("inf")) > self.handoff_s
            ):
                self._handed.clear()
                self._handoff = True
                self._handoffs += 1
        finally:
            self._lock.release()
        if self._handoff and not self._waiting:  # the one it was left for gave up
            self._handoff = False
            self._handed.set()


class _Held:
    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        gate = self._gate
        if gate.wait_s is None:
            return
        if gate._owner == get_ident():
            gate._depth += 1
        elif gate._handoff or not gate._acquire(1):
            gate._take(1)

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        # Not the holder: the wait ran out (on entering, or on taking the gate back
        # after released()), so this thread went on without it.
        if gate._owner == get_ident():
            gate._depth -= 1
            if not gate._depth:
                gate._leave()


class _Released:
    __slots__ = ("_depth", "_gate", "_key", "_since")

    def __init__(self, gate: Gate, key: Hashable | None) -> None:
        self._gate = gate
        self._key = key
        self._depth = 0  # 0: the gate was kept
        self._since = 0.0

    def __enter__(self) -> None:
        gate = self._gate
        key = self._key
        if key is not None:
            self._since = time.perf_counter()
            if gate._quick.get(key, 0) >= _QUICK_CALLS:
                gate._kept += 1
                return  # quick lately: keep the gate
        self._depth, gate._depth = gate._depth, 0
        gate._leave()

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        key = self._key
        if key is not None:
            quick = gate._quick
            if time.perf_counter() - self._since < gate.quick_s:
                if len(quick) >= _KEYS and key not in quick:
                    quick.clear()
                quick[key] = min(quick.get(key, 0) + 1, _QUICK_CALLS)
            else:
                quick.pop(key, None)
        depth = self._depth
        if not depth:
            return  # kept
        if gate._handoff or not gate._acquire(depth):
            gate._take(depth)


_NOTHING = nullcontext()
