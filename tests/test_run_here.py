"""``Runtime.run``: submit and wait, the turn run on the calling thread (no worker woken,
no hand-over between threads); a turn it cannot run there goes to a worker, and a Ctrl-C
while it runs on the main thread stops the turn before the interrupt is raised."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    SequentialIds,
    StopRequested,
    ToolCall,
    TurnRecorded,
)
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry


def _runtime(handler: Any, store: InMemoryEventStore | None = None) -> Runtime:
    """A session whose every turn calls the tool ``t`` once, then replies."""

    def reply(req: Any, n: int) -> ScriptedReply:
        if req.messages[-1].role == "tool":
            return ScriptedReply(text="好")
        return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="t", arguments="{}"),))

    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("t", handler)]))
    return Runtime(
        store or InMemoryEventStore(),
        services,
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )


def test_run_runs_the_turn_on_the_calling_thread_and_wakes_no_worker() -> None:
    ran_on: list[int] = []
    runtime = _runtime(lambda args, ctx: ran_on.append(threading.get_ident()) or "ok")
    try:
        outcomes = [runtime.run("s", Input(id="", content=f"{n}")) for n in range(3)]
        assert [o.outcome for o in outcomes] == ["replied"] * 3
        assert [o.reply for o in outcomes] == ["好"] * 3
        assert ran_on == [threading.get_ident()] * 3
        assert runtime.workers.threads == 0
        # Through submit, the same turn runs on a worker.
        assert runtime.submit("s", Input(id="", content="x")).result(10).outcome == "replied"
        assert ran_on[-1] != threading.get_ident()
    finally:
        runtime.shutdown(timeout=10)


def test_an_input_that_opens_no_turn_is_waited_for() -> None:
    entered, leave = threading.Event(), threading.Event()

    def tool(args: Any, ctx: Any) -> str:
        if not entered.is_set():
            entered.set()
            assert leave.wait(10)
        return "ok"

    runtime = _runtime(tool)
    try:
        first = runtime.submit("s", Input(id="", content="first"))
        assert entered.wait(10)
        got: list[Any] = []
        thread = threading.Thread(
            target=lambda: got.append(runtime.run("s", Input(id="", content="second")))
        )
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and not got  # a turn is running: it waits
        leave.set()
        thread.join(10)
        assert first.result(10).outcome == "replied"
        assert [o.outcome for o in got] == ["replied"]
        # It joined the running turn at its next model call (FLOW8), on that turn's worker.
        assert got[0].turn_id == first.result(10).turn_id
    finally:
        leave.set()
        runtime.shutdown(timeout=10)


def test_run_inside_a_tool_hands_the_other_sessions_turn_to_a_worker() -> None:
    runtime: Runtime
    inner: list[Any] = []
    threads: dict[str, int] = {}

    def tool(args: Any, ctx: Any) -> str:
        threads.setdefault(ctx.session_id, threading.get_ident())
        if ctx.session_id == "outer":
            inner.append(runtime.run("inner", Input(id="", content="from a tool")))
        return "ok"

    runtime = _runtime(tool)
    # The outer turn runs here; the inner one cannot (this thread is in a turn).
    _outer_here_inner_on_a_worker(runtime, inner, threads)


def _outer_here_inner_on_a_worker(
    runtime: Runtime, inner: list[Any], threads: dict[str, int]
) -> None:
    """Run session ``outer`` here, whose turn runs ``inner`` (its outcome appended to
    ``inner``); the outer turn ran on this thread, the inner one on another."""
    try:
        outcome = runtime.run("outer", Input(id="", content="go"))
        assert outcome.outcome == "replied"
        assert [o.outcome for o in inner] == ["replied"]
        assert threads["outer"] == threading.get_ident()
        assert threads["inner"] != threading.get_ident()
    finally:
        runtime.shutdown(timeout=10)


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_ctrl_c_while_run_runs_the_turn_stops_it_then_raises() -> None:
    store = InMemoryEventStore()
    interrupts = 0

    def tool(args: Any, ctx: Any) -> str:
        nonlocal interrupts
        if interrupts == 0:
            interrupts += 1
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while this turn runs
            assert ctx.abort.wait(10)  # the stop reaches the turn
        return "ok"

    runtime = _runtime(tool, store)
    # Python's own handler (an earlier test's library may have installed another).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            runtime.run("s", Input(id="", content="long"))
        events = store.read("s")
        stops = [e for e in events if isinstance(e, StopRequested)]
        ends = [e for e in events if isinstance(e, TurnRecorded)]
        assert len(stops) == 1
        assert [(e.turn_id, e.outcome) for e in ends] == [(stops[0].turn_id, "aborted")]
        # The handler is the caller's again, and the session goes on.
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert runtime.run("s", Input(id="", content="again")).outcome == "replied"
    finally:
        signal.signal(signal.SIGINT, before)
        runtime.shutdown(timeout=10)


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_ctrl_c_goes_to_the_callers_own_handler_once_the_turn_ended() -> None:
    heard: list[int] = []
    ended: list[bool] = []

    def tool(args: Any, ctx: Any) -> str:
        os.kill(os.getpid(), signal.SIGINT)
        assert ctx.abort.wait(10)
        ended.append(not heard)  # the handler has not run yet
        return "ok"

    runtime = _runtime(tool)
    before = signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))
    try:
        outcome = runtime.run("s", Input(id="", content="long"))
        assert outcome.outcome == "aborted"
        assert heard == [signal.SIGINT] and ended == [True]
    finally:
        signal.signal(signal.SIGINT, before)
        runtime.shutdown(timeout=10)


def test_run_from_a_submits_middleware_hands_its_turn_to_a_worker() -> None:
    """A middleware of a submit runs inside that submit's step (the gate held by this
    thread, no task of a worker's): a ``run`` there cannot run its turn here."""
    runtime: Runtime
    inner: list[Any] = []
    threads: dict[str, int] = {}

    def tool(args: Any, ctx: Any) -> str:
        threads.setdefault(ctx.session_id, threading.get_ident())
        return "ok"

    def input_before(ctx: Any, next_: Any) -> Any:
        if ctx.metadata["sessionId"] == "outer" and not inner:
            assert runtime.workers.gate.holder() == threading.get_ident()
            inner.append(runtime.run("inner", Input(id="", content="from a middleware")))
        return next_()

    runtime = _runtime(tool)
    runtime.hooks.use("agent:input:before", input_before)
    _outer_here_inner_on_a_worker(runtime, inner, threads)
