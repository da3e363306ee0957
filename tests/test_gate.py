"""The runtime's gate (actors/gate.py): a turn's own steps and submits run one at a time,
the model and tools are waited on with it open, and no thread ever waits for it longer
than ``wait_s`` (so a step blocked where the gate is closed cannot stall the others)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from aalis_agent.actors.gate import Gate
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, SequentialIds, ToolCall
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    Tool,
    ToolRegistry,
)


def _hold_in_thread(gate: Gate) -> tuple[threading.Thread, threading.Event]:
    """A thread that takes the gate and keeps it until the returned event is set;
    returns once it holds it."""
    holding, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.held():
            holding.set()
            leave.wait(10)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert holding.wait(5)
    return thread, leave


def test_an_off_gate_is_never_held() -> None:
    gate = Gate(None)
    with gate.held():
        assert gate.holder() is None
        with gate.released():
            assert gate.holder() is None
    assert gate.waited_out == 0


def test_the_gate_is_reentrant_and_released_only_by_the_outermost_exit() -> None:
    gate = Gate(5.0)
    me = threading.get_ident()
    with gate.held():
        with gate.held():
            assert gate.holder() == me
        assert gate.holder() == me
    assert gate.holder() is None


def test_released_lets_another_thread_in_and_takes_the_gate_back_as_deep_as_it_was() -> None:
    gate = Gate(5.0)
    me = threading.get_ident()
    with gate.held(), gate.held():
        with gate.released():
            thread, leave = _hold_in_thread(gate)  # it gets in while this one is outside
            assert gate.holder() == thread.ident
            leave.set()
        # Taken back on the way out of released(), twice deep: one exit keeps it.
        assert gate.holder() == me
        thread.join(5)
    assert gate.holder() is None
    assert gate.waited_out == 0


def test_a_wait_runs_out_and_the_step_goes_on_without_the_gate() -> None:
    gate = Gate(0.05)
    holder, leave = _hold_in_thread(gate)
    ran = False
    with gate.held():
        ran = True
        assert gate.holder() == holder.ident  # went on beside the holder
    assert ran and gate.waited_out == 1
    assert gate.holder() == holder.ident  # leaving did not open someone else's gate
    leave.set()
    holder.join(5)
    assert gate.holder() is None


def test_a_step_that_cannot_take_the_gate_back_does_not_open_it_for_the_taker() -> None:
    gate = Gate(0.05)
    with gate.held():
        with gate.released():
            thread, leave = _hold_in_thread(gate)
        assert gate.waited_out == 1  # it went on without the gate
        with gate.held():  # nested steps behave as ungated too, and leave it closed
            pass
        assert gate.holder() == thread.ident
    assert gate.holder() == thread.ident
    leave.set()
    thread.join(5)
    assert gate.holder() is None


@pytest.mark.parametrize("bad", [-1, True, "0.05", float("nan")])
def test_a_bad_wait_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="wait_s"):
        Gate(bad)
    with pytest.raises(ValueError, match="handoff_s"):
        Gate(0.05, handoff_s=bad)
    with pytest.raises(ValueError, match="quick_s"):
        Gate(0.05, quick_s=bad)


def test_an_outside_call_that_was_quick_three_times_keeps_the_gate_until_one_is_slow() -> None:
    gate = Gate(5.0, quick_s=0.05)
    me = threading.get_ident()
    seen: list[int | None] = []

    def call(key: str, seconds: float = 0.0) -> None:
        with gate.held(), gate.released(key):
            seen.append(gate.holder())
            if seconds:
                threading.Event().wait(seconds)

    for _ in range(4):
        call("tool")
    assert seen == [None, None, None, me]  # opened while its speed was unknown, then kept
    assert gate.kept == 1
    call("model")  # each key on its own
    assert seen[-1] is None
    call("tool", 0.1)  # kept, but slow: opened again for the next three
    assert seen[-1] == me
    for _ in range(4):
        call("tool")
    assert seen[-4:] == [None, None, None, me]
    with gate.released():  # no key: always opened
        assert gate.holder() is None


def test_a_thread_leaving_the_gate_hands_it_to_a_starved_waiter_before_it_comes_back() -> None:
    """Once another thread has waited longer than ``handoff_s``, the thread leaving the
    gate cannot take it straight back (as it otherwise may: the gate is sticky): the
    waiter gets in first."""
    gate = Gate(5.0, handoff_s=0.02)
    order: list[str] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        with gate.held():
            order.append("waiter")
            threading.Event().wait(0.05)

    with gate.held():
        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        assert waiting.wait(5)
        threading.Event().wait(0.1)  # the waiter starves
    with gate.held():  # straight back
        order.append("leaver")
    thread.join(5)
    assert order == ["waiter", "leaver"]
    # Handed twice: the leaver, back at once, then starved as long behind the waiter.
    assert gate.handoffs == 2 and gate.waited_out == 0
    assert gate.holder() is None


def _runtime(model: ScriptedModel, tools: ToolRegistry | None = None, **kw: Any) -> Runtime:
    services = Services(llm=model, tools=tools or ToolRegistry())
    return Runtime(
        InMemoryEventStore(), services, FixedClock(step_ms=5), SequentialIds(), janitor=False, **kw
    )


@pytest.fixture
def seen() -> Iterator[dict[str, list[bool]]]:
    yield {}
    pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize("wait_s", [0.05, None])
def test_a_turns_steps_hold_the_gate_and_the_model_and_tools_run_with_it_open(
    wait_s: float | None, seen: dict[str, list[bool]]
) -> None:
    runtime: Runtime

    def held_here() -> bool:
        return runtime.workers.gate.holder() == threading.get_ident()

    def note(where: str) -> None:
        seen.setdefault(where, []).append(held_here())
        assert runtime.workers.gate.holder() in (None, threading.get_ident())

    def reply(request: object, n: int) -> ScriptedReply:
        note("model")
        if n == 1:
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="look", arguments="{}"),))
        return ScriptedReply(text="好")

    def look(args: dict[str, Any], ctx: object) -> str:
        note("tool")
        return "看到了"

    def before(ctx: Any, next_: Any) -> Any:
        note("llm:before")
        return next_()

    def input_before(ctx: Any, next_: Any) -> Any:
        note("input:before")
        return next_()

    runtime = _runtime(ScriptedModel(reply), ToolRegistry([Tool("look", look)]), gate_wait_s=wait_s)
    runtime.hooks.use("agent:llm:before", before)
    runtime.hooks.use("agent:input:before", input_before)
    try:
        assert runtime.submit("s", Input(id="", content="看看")).result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
    gated = wait_s is not None
    assert seen["input:before"] == [gated]  # the submit's step
    assert seen["llm:before"] == [gated, gated]  # the turn's steps, one per call
    assert seen["model"] == [False, False]  # not yet known to be quick: opened
    assert seen["tool"] == [False]


def test_a_step_blocked_behind_a_closed_gate_delays_other_sessions_only_briefly(
    seen: dict[str, list[bool]],
) -> None:
    """A middleware of one session waits, holding the gate, until another session's
    turn has replied: that turn goes on once its wait for the gate runs out."""
    other_done = threading.Event()
    runtime = _runtime(ScriptedModel(lambda request, n: ScriptedReply(text="好")), gate_wait_s=0.05)
    blocking = threading.Event()

    def wait_for_other(ctx: Any, next_: Any) -> Any:
        if ctx.session_id == "a":
            blocking.set()
            seen.setdefault("other replied first", []).append(other_done.wait(20))
        return next_()

    runtime.hooks.use("agent:turn:before", wait_for_other)
    try:
        first = runtime.submit("a", Input(id="", content="一"))
        assert blocking.wait(10)
        assert runtime.submit("b", Input(id="", content="二")).result(10).outcome == "replied"
        other_done.set()
        assert first.result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
    assert seen["other replied first"] == [True]
    assert runtime.workers.gate.waited_out >= 1


class _InterruptedLock:
    """The gate's lock, where an interrupt lands right after the first acquire has
    taken it (before the gate could record its holder), as a KeyboardInterrupt can."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.armed = True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return taken

    def release(self) -> None:
        self._lock.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("where", ["entering", "taking it back"])
def test_an_interrupt_while_taking_the_gate_never_leaves_it_locked(where: str) -> None:
    gate = Gate(5.0)  # a leaked gate would show as a 5 s wait below
    lock = _InterruptedLock()
    if where == "entering":
        gate._lock = lock  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt), gate.held():
            pass
    else:
        gate._lock = lock  # type: ignore[assignment]
        lock.armed = False
        with gate.held(), pytest.raises(KeyboardInterrupt), gate.released():
            lock.armed = True  # lands as the gate is taken back
    assert not lock.armed and gate.holder() is None
    holder, leave = _hold_in_thread(gate)  # another thread takes it at once
    assert gate.holder() == holder.ident and gate.waited_out == 0
    leave.set()
    holder.join(5)


def test_a_gate_left_for_a_waiter_whose_wait_ran_out_is_taken_by_that_waiter() -> None:
    """The holder keeps the GIL in one native call past the waiter's wait: the waiter's
    acquire has timed out, but it is still listed as waiting when the holder leaves, so
    the gate is left for it. Waking, it takes that gate instead of going on without it
    (before, the gate stayed free and closed to all for ``handoff_s``)."""
    gate = Gate(0.05)
    got: dict[str, bool] = {}

    def waiter() -> None:
        with gate.held():
            got["held"] = gate.holder() == threading.get_ident()

    start = time.perf_counter()
    sum(range(10**5))
    per = (time.perf_counter() - start) / 10**5
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)  # the waiter is not handed the GIL while the holder runs
    try:
        with gate.held():
            thread = threading.Thread(target=waiter)
            thread.start()
            while not gate._waiting:
                time.sleep(0.0005)
            sum(range(int(0.15 / per)))  # one call, holding the GIL past the waiter's wait
        thread.join(5)
    finally:
        sys.setswitchinterval(interval)
    assert gate.handoffs == 1 and got == {"held": True}
    assert gate.waited_out == 0 and not gate._handoff and gate.holder() is None


def test_run_waits_for_a_closed_gate_once() -> None:
    # The submit and the turn of one run share one wait: when it runs out, the turn goes
    # on without the gate at once instead of waiting a second time.
    runtime = _runtime(ScriptedModel(lambda request, n: ScriptedReply(text="好")), gate_wait_s=0.05)
    gate = runtime.workers.gate
    holder, leave = _hold_in_thread(gate)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        assert gate.waited_out == 1
    finally:
        leave.set()
        holder.join(5)
        runtime.shutdown(timeout=10)


@pytest.mark.parametrize("call", ["submit", "run"])
@pytest.mark.parametrize("where", ["__enter__", "__exit__", "_leave"])
def test_a_ctrl_c_as_the_main_thread_enters_or_leaves_the_gate_never_leaves_it_held(
    call: str, where: str
) -> None:
    """A Ctrl-C (SIGINT, simulated with ``_thread.interrupt_main``) arriving just as
    ``submit`` or ``run`` enters or leaves the gate on the main thread is raised once the
    gate is left: it used to land inside the gate's own bookkeeping and leave the gate
    held by the main thread for good (every other thread's steps then waited it out)."""
    import _thread

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupts reach the main thread only")
    from aalis_agent.actors import gate as gate_module

    runtime = _runtime(ScriptedModel(lambda request, n: ScriptedReply(text="好")), gate_wait_s=0.05)
    gate = runtime.workers.gate
    code = {
        "__enter__": gate_module._Held.__enter__,
        "__exit__": gate_module._Held.__exit__,
        "_leave": Gate._leave,
    }[where].__code__
    fired: list[bool] = []

    def signal_there(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code and not fired:
            fired.append(True)
            _thread.interrupt_main()  # handled at the gate's next instruction
        return None

    # Python's own handler (a process started in the background may have SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.settrace(signal_there)
        try:
            with pytest.raises(KeyboardInterrupt):
                getattr(runtime, call)("main", Input(id="", content="你好"))
        finally:
            sys.settrace(None)
            signal.signal(signal.SIGINT, previous)
        assert fired and gate.holder() is None
        other = threading.Thread(
            target=lambda: runtime.submit("other", Input(id="", content="二")).result(10)
        )
        other.start()
        other.join(10)
        assert gate.waited_out == 0  # the gate was free for the other thread
        assert runtime.run("main", Input(id="", content="再来")).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)


def _enter_and_leave(gate: Gate) -> None:
    with gate.held():
        pass


def test_a_hand_off_whose_waiter_gave_up_meanwhile_is_not_left_set() -> None:
    """The leaving holder sees a starved waiter; while it decides (here: a slow clear of
    the hand-off event, where the GIL passes), the waiter's wait runs out and it goes on.
    The hand-off it was left is then withdrawn: a newcomer takes the free gate at once
    instead of waiting ``handoff_s`` for a waiter that is gone."""

    class SlowClear(threading.Event):
        armed = True

        def clear(self) -> None:
            if self.armed:
                self.armed = False
                time.sleep(0.03)  # the waiter's wait runs out meanwhile
            super().clear()

    gate = Gate(0.05)
    gate._handed = SlowClear()
    with gate.held():
        waiter = threading.Thread(target=_enter_and_leave, args=(gate,))
        waiter.start()
        while not gate._waiting:
            time.sleep(0.0005)
        time.sleep(0.045)  # it has waited past handoff_s, and nearly all of wait_s
    waiter.join(5)
    assert gate.handoffs == 1 and not gate._handoff and not gate._waiting
    holder, leave = _hold_in_thread(gate)
    assert gate.holder() == holder.ident and gate.waited_out <= 1
    leave.set()
    holder.join(5)
