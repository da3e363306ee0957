"""``Workers``: the threads that run turns, reused from turn to turn.

A turn runs on a thread of its own (it blocks on the model and on tools), but starting a
thread per turn costs more than the rest of a short turn's bookkeeping. Workers are daemon
threads, so a turn stuck in a model call never keeps the process from exiting (the
standard library's ``ThreadPoolExecutor`` joins its threads at exit); at most ``limit``
run at once (later turns wait their turn, in order); a worker idle for ``idle_s`` seconds
exits, so a runtime whose sessions went idle holds no threads. A task runs behind the
workers' :class:`~aalis_agent.actors.gate.Gate` (none unless one is given).

A thread that would only wait for a task's outcome may run the task itself instead
(:meth:`Workers.run_here`, for ``Runtime.run``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from contextlib import nullcontext

import structlog
from aalis_agent.actors.gate import Gate

__all__ = ["Workers"]

log = structlog.get_logger("aalis.runtime")
_NOTHING = nullcontext()  # no gate to enter


class Workers:
    """A bounded set of reusable daemon threads (see the module docstring)."""

    def __init__(
        self, limit: int = 512, idle_s: float = 10.0, name: str = "turn", gate: Gate | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"Workers: limit must be at least 1, got {limit}")
        self.limit = limit
        self.gate = gate if gate is not None else Gate(None)
        self.idle_s = idle_s
        self._name = name
        self._cond = threading.Condition()
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._started = 0
        self._retire = 0  # idle workers asked to exit now
        self._local = threading.local()  # ``busy``: this thread is running a task

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on a worker: an idle one, a new one under the limit, or the first
        one to finish its current task."""
        with self._cond:
            self._tasks.append(task)
            if self._idle > len(self._tasks) - 1:
                self._cond.notify()
                return
            if self._threads >= self.limit:
                return  # waits for a worker
            self._threads += 1
            self._started += 1
            n = self._started
        thread = threading.Thread(target=self._work, name=f"{self._name}-{n}", daemon=True)
        try:
            thread.start()
        except BaseException:
            with self._cond:
                self._threads -= 1
            raise

    def run_here(self, task: Callable[[], None], *, gated: bool = False) -> None:
        """Run ``task`` (never given to :meth:`submit`) on the calling thread, as a worker
        would; or submit it, on a thread already running a task or holding the gate,
        where it would run inside another step. ``gated``: the caller holds the gate
        for this task itself (it took it for the task, not inside a step)."""
        if getattr(self._local, "busy", False) or (
            not gated and self.gate.holder() == threading.get_ident()
        ):
            self.submit(task)
            return
        # Gated: the caller took the gate for it, or its wait ran out and it goes on
        # without (it does not wait a second time for the same turn).
        self._run(task, gate=not gated)

    @property
    def threads(self) -> int:
        """Worker threads alive now (busy or idle)."""
        with self._cond:
            return self._threads

    def release_idle(self) -> None:
        """Let every worker idle now exit (passivation frees the turn threads)."""
        with self._cond:
            self._retire = self._idle
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._tasks:
                    self._idle += 1
                    woke = self._cond.wait(self.idle_s)
                    self._idle -= 1
                    if self._tasks:
                        break
                    if self._retire > 0 or not woke:
                        self._retire = max(self._retire - 1, 0)
                        self._threads -= 1
                        return
                task = self._tasks.popleft()
            self._run(task)
            del task  # an idle worker holds nothing of the turn it ran (its session's state)

    def _run(self, task: Callable[[], None], *, gate: bool = True) -> None:
        local = self._local
        local.busy = True
        try:
            with self.gate.held() if gate else _NOTHING:
                task()
        except BaseException:  # a task reports its own failures; never lose the worker
            # (a KeyboardInterrupt or SystemExit a tool raised ends here too, once its
            # turn is recorded ``aborted``: the turn's caller has that outcome)
            log.exception("a turn's thread ended on an exception it raised on")
        finally:
            local.busy = False
