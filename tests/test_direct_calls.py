"""A session actor handles the runtime's submits and its turn runner's reports on the
calling thread, under the lock its mailbox thread takes (SessionActor.call): the same
one-at-a-time guarantee as an ask, without the thread hops. These tests pin what that
path must keep: where the work runs, what a callback calling back into its own session
gets, a submit racing the actor's passivation, and the mailbox thread that starts only
when a message is put in the mailbox."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from aalis_agent.actors.messages import Passivate, Submit
from aalis_agent.actors.runtime import Runtime
from aalis_agent.actors.session import SessionActor
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    InputReceived,
    SequentialIds,
    ToolCall,
    TurnRecorded,
)
from aalis_agent.services import (
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    Services,
    Tool,
    ToolRegistry,
)

SID = "user:direct"


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    services = Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text=f"好{n}")))
    rt = Runtime(
        InMemoryEventStore(), services, FixedClock(step_ms=5), SequentialIds(), janitor=False
    )
    yield rt
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def test_submit_commits_on_the_callers_thread_and_the_turn_on_its_runners(
    runtime: Runtime,
) -> None:
    seen: dict[str, list[str]] = {}

    def record(topic: str, payload: Any) -> None:
        seen.setdefault(topic, []).append(threading.current_thread().name)

    runtime.subscribe("turn:opened", record)
    runtime.subscribe("turn:ended", record)
    outcome = runtime.submit(SID, Input(id="", content="你好")).result(10)
    assert outcome.outcome == "replied"
    # The input's commit opened the turn on the submitting thread, not a mailbox thread.
    assert seen["turn:opened"] == [threading.current_thread().name]
    # The turn's end was committed by its runner, on a turn worker.
    assert seen["turn:ended"][0].startswith("turn-")


def test_a_callback_calling_into_its_own_session_gets_an_error_not_a_hang(
    runtime: Runtime,
) -> None:
    errors: list[BaseException] = []

    def submit_again(topic: str, payload: Any) -> None:
        try:
            runtime.submit(SID, Input(id="", content="again"))
        except BaseException as exc:
            errors.append(exc)

    unsubscribe = runtime.subscribe("turn:ended", submit_again)
    started = time.monotonic()
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    unsubscribe()
    assert time.monotonic() - started < runtime.ask_timeout_s  # no wait for itself
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert SID in str(errors[0]) and "another thread" in str(errors[0])
    # The session goes on, and the refused input was never written.
    assert runtime.submit(SID, Input(id="", content="二")).result(10).outcome == "replied"
    contents = [e.input.content for e in runtime.store.read(SID) if isinstance(e, InputReceived)]
    assert contents == ["一", "二"]


def test_a_submit_racing_passivation_keeps_the_actor_live(runtime: Runtime) -> None:
    """A submit that took the session's actor before its passivation began is on its
    way to it: the passivation yields (the actor stays live and takes the input), where
    it used to stop the actor under the caller (who met it stopped, and under heavy
    shedding could meet the next one stopped too and fail with ActorDeadError)."""
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    old = runtime._entries[SID].actor
    reached = threading.Event()
    refused: list[BaseException] = []
    call = old.call

    def watched(message: Any, timeout: float | None = None) -> Any:
        if isinstance(message, Submit):  # passivation calls in too, on its own thread
            reached.set()
        try:
            return call(message, timeout)
        except BaseException as exc:
            refused.append(exc)
            raise

    old.call = watched  # type: ignore[method-assign]
    unregister = runtime.unregister_if_idle

    def slow_unregister(session_id: str, actor: Any) -> bool:
        # The passivating actor holds its lock here; let the submit reach that lock.
        assert reached.wait(10)
        time.sleep(0.05)
        return unregister(session_id, actor)

    runtime.unregister_if_idle = slow_unregister  # type: ignore[method-assign]
    passivated: list[int] = []
    passivating = threading.Thread(target=lambda: passivated.append(runtime.passivate_idle(0)))
    passivating.start()
    while not old._lock.locked():  # the Passivate message is being handled
        time.sleep(0.001)
    handle = runtime.submit(SID, Input(id="", content="二"))
    passivating.join(10)
    assert passivated == [0]
    assert refused == []
    assert handle.result(10).outcome == "replied"
    assert runtime._entries[SID].actor is old
    contents = [e.input.content for e in runtime.store.read(SID) if isinstance(e, InputReceived)]
    assert contents == ["一", "二"]  # written once


def _mailbox_threads(session_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"session {session_id}"]


def test_a_session_reached_only_by_calls_never_starts_a_mailbox_thread(
    runtime: Runtime,
) -> None:
    for text in ("一", "二"):
        assert runtime.submit(SID, Input(id="", content=text)).result(10).outcome == "replied"
    actor = runtime._entries[SID].actor
    assert len(runtime.view(SID).history.messages) == 4
    assert runtime.wait_idle(10)
    runtime.set_setting(SID, "maxToolIterations", 3)
    assert runtime.stop(SID) is None  # nothing running
    assert actor._thread is None and _mailbox_threads(SID) == []
    assert runtime.passivate_idle(0) == 1
    # Stopped the way pykka stops an actor, with no thread ever started for it.
    assert actor.actor_stopped.is_set() and actor._closed
    assert actor._thread is False and _mailbox_threads(SID) == []
    assert pykka.ActorRegistry.get_by_urn(actor.actor_urn) is None
    with pytest.raises(pykka.ActorDeadError):
        actor.actor_ref.tell("anything")
    # The next submit rebuilds the session from its log.
    assert runtime.submit(SID, Input(id="", content="三")).result(10).outcome == "replied"
    assert runtime._entries[SID].actor is not actor


def test_a_told_message_starts_the_mailbox_thread_and_shutdown_ends_it() -> None:
    services = Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text=f"好{n}")))
    rt = Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)
    try:
        assert rt.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
        assert _mailbox_threads(SID) == []
        generation = rt.delete(SID, timeout=10)  # told, with a future: the mailbox handles it
        assert generation == 1
        threads = _mailbox_threads(SID)
        assert len(threads) == 1 and threads[0].is_alive()
        assert rt.submit(SID, Input(id="", content="二")).result(10).outcome == "replied"
    finally:
        rt.shutdown(timeout=10)
    threads[0].join(10)
    assert not threads[0].is_alive() and _mailbox_threads(SID) == []


def test_registry_stop_all_stops_an_actor_that_has_no_thread() -> None:
    services = Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text="好")))
    rt = Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)
    assert rt.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    actor = rt._entries[SID].actor
    assert rt.wait_idle(10)
    pykka.ActorRegistry.stop_all(block=True, timeout=10)  # as tests and hosts clean up
    assert actor.actor_stopped.is_set() and actor._closed
    for thread in _mailbox_threads(SID):
        thread.join(10)
        assert not thread.is_alive()
    rt.shutdown(timeout=10)


def test_recovery_runs_on_the_launching_thread_before_launch_returns() -> None:
    """A turn cut by a crash is recorded by ``on_start``, which runs in ``launch``: by
    the time ``recover`` returns, the cut record is in the log."""
    store = InMemoryEventStore()
    hang = threading.Event()
    services = Services(
        llm=ScriptedModel(lambda request, n: (hang.wait(10), ScriptedReply(text="好"))[1])
    )
    first = Runtime(store, services, FixedClock(), SequentialIds(), janitor=False)
    first.submit(SID, Input(id="", content="一"))
    deadline = time.monotonic() + 10
    while not any(type(e).__name__ == "ModelCallStarted" for e in store.read(SID)):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # The "crash": this runtime is abandoned mid-call; a new one recovers the log.
    second = Runtime(
        store, Services(llm=ScriptedModel()), FixedClock(), SequentialIds(), janitor=False
    )
    try:
        assert second.recover() == [SID]
        records = [e for e in store.read(SID) if isinstance(e, TurnRecorded)]
        assert [r.outcome for r in records] == ["aborted"]  # recorded as cut
        assert isinstance(second._entries[SID].actor, SessionActor)
        assert _mailbox_threads(SID) == []
    finally:
        hang.set()
        second.shutdown(timeout=10)
        first.shutdown(timeout=10)


def _capped(cap: int, model: ScriptedModel | None = None, tools: tuple[Tool, ...] = ()) -> Runtime:
    services = Services(
        llm=model or ScriptedModel(lambda request, n: ScriptedReply(text="好")),
        tools=ToolRegistry(list(tools)),
    )
    return Runtime(
        InMemoryEventStore(),
        services,
        FixedClock(),
        SequentialIds(),
        janitor=False,
        max_live_sessions=cap,
    )


def test_past_max_live_sessions_the_least_recently_used_idle_ones_passivate() -> None:
    rt = _capped(3)
    try:
        for i in range(10):
            assert rt.submit(f"s{i}", Input(id="", content="一")).result(10).outcome == "replied"
            rt.wait_idle(10)
            assert len(rt.active_sessions()) <= 3
        assert rt.active_sessions() == ["s7", "s8", "s9"]
        # s7 used again is the most recent: the next newcomer passivates s8 instead.
        assert rt.submit("s7", Input(id="", content="二")).result(10).outcome == "replied"
        rt.wait_idle(10)
        assert rt.submit("s10", Input(id="", content="一")).result(10).outcome == "replied"
        assert rt.active_sessions() == ["s10", "s7", "s9"]
        # A passivated session comes back from its log, history whole.
        assert rt.submit("s0", Input(id="", content="二")).result(10).outcome == "replied"
        assert len(rt.view("s0").history.messages) == 4
    finally:
        rt.shutdown(timeout=10)


def test_a_session_with_work_is_never_passivated_to_keep_the_cap() -> None:
    release, entered = threading.Event(), threading.Event()

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        if request.messages[-1].content.endswith("忙"):  # the busy session's first call
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="hold", arguments="{}"),))
        return ScriptedReply(text="好")

    def hold(args: Any, ctx: Any) -> str:
        entered.set()
        release.wait(10)  # the busy session's turn is still running
        return "ok"

    rt = _capped(1, ScriptedModel(reply), (Tool("hold", hold),))
    try:
        busy = rt.submit("busy", Input(id="", content="忙"))
        assert entered.wait(10)
        for i in range(3):
            assert rt.submit(f"s{i}", Input(id="", content="一")).result(10).outcome == "replied"
            assert "busy" in rt.active_sessions()
        release.set()
        assert busy.result(10).outcome == "replied"
        assert [e.input.content for e in rt.store.read("busy") if isinstance(e, InputReceived)] == [
            "忙"
        ]
    finally:
        release.set()
        rt.shutdown(timeout=10)


@pytest.mark.parametrize("cap", [0, -1, 2.5, True, "3"])
def test_max_live_sessions_must_be_a_positive_int(cap: Any) -> None:
    with pytest.raises(ValueError, match="max_live_sessions"):
        Runtime(InMemoryEventStore(), janitor=False, max_live_sessions=cap)


def _hold(actor: SessionActor) -> None:
    """Take the actor's lock as a message being handled does (white box)."""
    assert actor._lock.acquire(timeout=10)


def test_passivation_is_refused_while_a_caller_waits_for_the_session(runtime: Runtime) -> None:
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    assert runtime.wait_idle(10)
    actor = runtime._entries[SID].actor
    _hold(actor)  # as if a message were being handled
    viewer = threading.Thread(target=lambda: runtime.view(SID))
    viewer.start()
    deadline = time.monotonic() + 10
    while not actor._callers:  # the view waits for the lock
        assert time.monotonic() < deadline
        time.sleep(0.001)
    try:
        assert actor._on_passivate(Passivate(0)) is False
    finally:
        actor._lock.release()
    viewer.join(10)
    assert runtime.passivate_idle(0) == 1  # nobody waits now


def test_passivation_is_refused_while_the_mailbox_thread_holds_a_message(
    runtime: Runtime,
) -> None:
    """A told message taken out of the mailbox, waiting for the lock a call holds, is not
    in the mailbox any more: the actor must still not passivate under it (it would be
    handled by an actor already replaced, a second writer of the log)."""
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    assert runtime.wait_idle(10)
    actor = runtime._entries[SID].actor
    _hold(actor)
    clearing = threading.Thread(target=lambda: runtime.clear(SID, timeout=10))
    clearing.start()
    deadline = time.monotonic() + 10
    while not (_mailbox_threads(SID) and actor.actor_inbox.empty()):
        assert time.monotonic() < deadline  # the mailbox thread took the Clear
        time.sleep(0.001)
    try:
        assert not actor.mailbox_idle()
        assert actor._on_passivate(Passivate(0)) is False
    finally:
        actor._lock.release()
    clearing.join(10)
    assert actor.mailbox_idle()
    assert runtime.passivate_idle(0) == 1
    assert len(runtime.view(SID).history.messages) == 0  # cleared, by the one actor


def test_submits_passivation_and_told_messages_racing_keep_one_writer_per_session(
    tmp_path: Any,
) -> None:
    """A short stress run: submitting threads, and another passivating, viewing,
    deleting and clearing at random, over a few sessions and a small live cap. Every
    submit is accepted and resolves, no session is fenced by a second writer, every log
    reads back, and no mailbox thread outlives the runtime."""
    from aalis_agent.events import SqliteEventStore
    from aalis_agent.projections import project
    from structlog.testing import capture_logs

    store = SqliteEventStore(tmp_path / "stress.db")
    services = Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text=f"好{n}")))
    rt = Runtime(store, services, janitor=False, max_live_sessions=4)
    stop = time.monotonic() + 3.0
    handles: list[Any] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def submitter(k: int) -> None:
        rnd = random.Random(k)
        while time.monotonic() < stop:
            try:
                handle = rt.submit(f"s{rnd.randrange(12)}", Input(id="", content=str(k)))
            except BaseException as exc:
                errors.append(exc)
                return
            with guard:
                handles.append(handle)

    def chaos() -> None:
        rnd = random.Random(99)
        while time.monotonic() < stop:
            session = f"s{rnd.randrange(12)}"
            op = rnd.random()
            try:
                if op < 0.5:
                    rt.passivate_idle(0)
                elif op < 0.7:
                    rt.view(session)
                elif op < 0.8:
                    rt.delete(session, timeout=10)
                else:
                    rt.clear(session, timeout=10)
            except BaseException as exc:
                errors.append(exc)
                return
            time.sleep(0.001)

    with capture_logs() as logs:
        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        threads.append(threading.Thread(target=chaos))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        outcomes = [h.result(30).outcome for h in handles]
        rt.shutdown(timeout=30)
    assert errors == []
    assert len(outcomes) > 50 and set(outcomes) <= {"replied", "aborted", "released"}
    assert not [e for e in logs if e["log_level"] == "error"], logs[:3]
    for session in store.sessions():
        project(store.read(session))  # reads back whole
    store.close()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("session ") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
