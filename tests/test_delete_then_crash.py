"""A deletion (or a clear of the context) cut by a crash is finished on restart.

A deletion winds down in two commits: the release of the waiting inputs and the stop of
the running turn first, then, once the turn has settled, ``SessionDeleted`` (a clear:
``ContextCleared``). A process killed between the two left a log whose inputs were
released, unarchived, for a deletion that never happened: on restart the session kept
its history and its generation, the stopped turn was recorded as cut by a crash with its
inputs archived and a stop marker, and nothing told anyone to delete again. Now the
release (or the stop) marks the deletion begun (``QueueState.winding_down``, with a
clear's kinds), and recovery writes the rest as the session would have, before the
session takes anything new: the turn ``aborted`` for the deletion, nothing of it archived
or run again, then ``SessionDeleted`` (``ContextCleared``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import (
    Batch,
    ContextCleared,
    EventStore,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    SessionDeleted,
    SessionEvent,
    SessionFailed,
    StopMarkerSaved,
    StopRequested,
    StoreError,
    TurnOpened,
    TurnRecorded,
)
from aalis_agent.projections import project

from aalis_agent import (
    InMemoryEventStore,
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    SqliteEventStore,
    Tool,
    ToolCall,
    ToolRegistry,
)
from tests.harness import ROOT, GatedModel, GatedTool, settle
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures

SID = "s"
CONTENTS = {"a": "一", "b": "二", "c": "三", "d": "四"}


class KilledAfter:
    """The store as a process killed right after the first commit ``cut`` picks sees it:
    that commit is written whole, and no append after it is (each raises)."""

    def __init__(self, inner: EventStore, cut: Callable[[Sequence[SessionEvent]], bool]) -> None:
        self.inner = inner
        self.cut = cut
        self.killed = threading.Event()

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        if self.killed.is_set():
            raise StoreError("the process was killed")
        seq = self.inner.append(session_id, events, expected_seq, open_work=open_work)
        if self.cut(events):
            self.killed.set()
        return seq

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EventStore]:
    """The log, on each store (PostgreSQL: a real server, skipped when none starts)."""
    if request.param == "memory":
        yield InMemoryEventStore()
        return
    if request.param == "sqlite":
        s: Any = SqliteEventStore(tmp_path / "log.db")
    else:
        from aalis_agent.events.postgres import PostgresEventStore

        s = PostgresEventStore(request.getfixturevalue("pg_url"))
    try:
        yield s
    finally:
        s.close()


def _released_for(kind: str) -> Callable[[Sequence[SessionEvent]], bool]:
    """The deletion's (clear's) first commit: its stop and its releases."""
    return lambda events: any(isinstance(e, InputReleased) and e.reason == kind for e in events)


def _settled_for(kind: str) -> Callable[[Sequence[SessionEvent]], bool]:
    """Its second: the stopped turn's record (the deletion's own is the third)."""
    return lambda events: any(isinstance(e, TurnRecorded) and e.reason == kind for e in events)


def _kill_during(store: EventStore, kind: str, cut: Callable[..., bool]) -> list[SessionEvent]:
    """Run a session to: a replied (turn of a), b's turn at its model call, c pending for
    it; then delete (clear) it in a process killed after the commit ``cut`` picks.
    Returns the log the kill left."""
    killing = KilledAfter(store, cut)
    model = GatedModel()
    runtime = Runtime(killing, Services(llm=model), janitor=False)  # type: ignore[arg-type]
    try:
        first = runtime.submit(SID, Input(id="a", content=CONTENTS["a"]))
        model.answer("答一")
        assert first.result(10).outcome == "replied"
        runtime.submit(SID, Input(id="b", content=CONTENTS["b"]))
        model.wait_call()
        assert runtime.submit(SID, Input(id="c", content=CONTENTS["c"])).where == "pending"
        with pytest.raises(SessionFailed):
            if kind == "delete":
                runtime.delete(SID, timeout=10)
            else:
                runtime.clear(SID, timeout=10)
        assert killing.killed.is_set()
    finally:
        runtime.shutdown(timeout=10)
    log = store.read(SID)
    assert [e.input_id for e in log if isinstance(e, InputReleased)] == ["c"]
    assert not any(isinstance(e, SessionDeleted | ContextCleared) for e in log)
    return log


def _model() -> ScriptedModel:
    return ScriptedModel(lambda request, n: ScriptedReply(text=f"答复 {n}"))


def _assert_deleted_on_restart(store: EventStore, killed: list[SessionEvent]) -> None:
    """A restart's recovery writes the missing ``SessionDeleted``, and nothing else: the
    session is empty, in generation 1."""
    restarted = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        assert restarted.recover() == [SID]
        assert restarted.wait_idle(10)
        view = restarted.view(SID)
    finally:
        restarted.shutdown(timeout=10)
    assert [type(e) for e in store.read(SID)[len(killed) :]] == [SessionDeleted]
    assert view.queue.generation == 1 and view.history.messages.to_list() == []


@pytest.mark.parametrize("cut", ["released", "settled"])
@pytest.mark.parametrize("kind", ["delete", "clear"])
def test_a_deletion_cut_by_a_kill_is_finished_on_restart(
    store: EventStore, kind: str, cut: str
) -> None:
    killed = _kill_during(store, kind, (_released_for if cut == "released" else _settled_for)(kind))
    runtime = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        assert runtime.recover() == [SID]  # begun and not done: it has work
        assert runtime.wait_idle(10)
        log = store.read(SID)
        view = runtime.view(SID)
    finally:
        runtime.shutdown(timeout=10)
    after = log[len(killed) :]
    # Finished as the session finishes a deletion: written once, nothing else run.
    if kind == "delete":
        assert [type(e) for e in after][-1:] == [SessionDeleted]
        assert [e.generation for e in log if isinstance(e, SessionDeleted)] == [1]
        assert view.queue.generation == 1
        assert view.history.messages.to_list() == []
        assert view.settings == {}
    else:
        assert [(type(e), e.kinds) for e in after if isinstance(e, ContextCleared)] == [
            (ContextCleared, ())
        ]
        assert view.queue.generation == 0
        assert view.history.messages.to_list() == []
    assert view.queue.winding_down is None and view.queue.running is None
    # b's turn ends aborted for the deletion, once; b is neither put back nor run, c is
    # not archived, and no stop marker is written for a turn wound down.
    records = [(e.turn_id, e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)]
    turn_b = next(e.turn_id for e in log if isinstance(e, TurnOpened) and e.input_ids == ("b",))
    assert records[1:] == [(turn_b, "aborted", kind)]
    assert not any(isinstance(e, InputRequeued | StopMarkerSaved) for e in log)
    assert [e.input_ids for e in log if isinstance(e, TurnOpened)] == [("a",), ("b",)]
    assert "c" not in [e.message.meta.input_id for e in log if isinstance(e, MessageSaved)]


@pytest.mark.parametrize("kind", ["delete", "clear"])
def test_after_the_finished_deletion_the_session_answers_and_runs_as_a_deleted_one(
    store: EventStore, kind: str
) -> None:
    """Restarted twice: the second start writes nothing. Reached by a submit alone (no
    ``recover``), the session finishes the deletion before it takes the input, which
    runs in the new generation; b and c sent again are answered as the deletion ended
    them."""
    killed = _kill_during(store, kind, _released_for(kind))
    first = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        new = first.submit(SID, Input(id="d", content=CONTENTS["d"]))
        assert new.result(10).outcome == "replied"
        assert first.wait_idle(10)
        b = first.submit(SID, Input(id="b", content=CONTENTS["b"]))
        c = first.submit(SID, Input(id="c", content=CONTENTS["c"]))
        assert (b.where, c.where) == ("handled", "handled")
        assert (b.result(0).outcome, b.result(0).reason) == ("aborted", kind)
        assert (c.result(0).outcome, c.result(0).reason) == ("released", kind)
        log = store.read(SID)
    finally:
        first.shutdown(timeout=10)
    after = log[len(killed) :]
    done = [i for i, e in enumerate(after) if isinstance(e, SessionDeleted | ContextCleared)]
    received = [i for i, e in enumerate(after) if isinstance(e, InputReceived)]
    assert len(done) == 1 and received and done[0] < received[0]  # finished before d came
    d = next(e for e in after if isinstance(e, InputReceived))
    assert (d.input.id, d.generation) == ("d", 1 if kind == "delete" else 0)
    assert not any(isinstance(e, InputReleased) for e in after)  # d was not taken as stale
    # The history holds d's turn only.
    inputs = [m.meta.input_id for m in project(log).history.messages if m.role == "user"]
    assert inputs == ["d"]
    # A second start finds nothing to do and writes nothing.
    second = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        assert second.recover() == []
        assert second.view(SID).seq == len(log)
    finally:
        second.shutdown(timeout=10)
    assert len(store.read(SID)) == len(log)


def test_a_deletion_of_a_turn_stopped_already_is_finished_too() -> None:
    """A turn stopped by the user whose tool ignores the stop, nothing waiting: the
    deletion stops it once more, so its first commit is not empty and the log knows the
    deletion begun; killed after the turn's record (written the deletion's way: no marker,
    nothing archived), the restart finishes it."""
    store = InMemoryEventStore()
    killing = KilledAfter(store, lambda events: any(isinstance(e, TurnRecorded) for e in events))
    model, tool = GatedModel(), GatedTool()
    services = Services(llm=model, tools=ToolRegistry([Tool("slow", tool)]))
    runtime = Runtime(killing, services, janitor=False)  # type: ignore[arg-type]
    try:
        runtime.submit(SID, Input(id="b", content=CONTENTS["b"]))
        model.answer(tool_calls=(ToolCall(id="call-1", name="slow", arguments="{}"),))
        tool.wait_running()
        assert runtime.stop(SID) is not None
        deletion = runtime._begin_delete(SID)
        settle(runtime, model, (tool,))  # the deletion handled: it waits for the tool
        assert not deletion.done()
        tool.release()
        with pytest.raises(SessionFailed):
            deletion.result(10)
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
    killed = store.read(SID)
    assert [e.reason for e in killed if isinstance(e, StopRequested)] == ["stop", "delete"]
    _assert_deleted_on_restart(store, killed)


def _begun_log(kind: str, *, kinds: tuple[str, ...], old: bool) -> list[SessionEvent]:
    """A log cut right after a clear's (a deletion's) first commit, written directly: a
    replied turn, then turn-2 running with c pending; the stop and c's release. ``old``:
    as a writer before the clear's kinds were recorded wrote it (no ``kinds``)."""
    b = Batch(SID, 0, now_ms=1_000)
    b.add(InputReceived(input=Input(id="a", content="一", timestamp=1_000)))
    b.add(TurnOpened(turn_id="turn-1", input_ids=("a",)))
    b.add(InputJoined(input_id="a", turn_id="turn-1", entry="opened"))
    b.add(InputReceived(input=Input(id="b", content="二", timestamp=1_000)))
    b.add(TurnRecorded(turn_id="turn-1", outcome="silent"))
    b.add(TurnOpened(turn_id="turn-2", input_ids=("b",)))
    b.add(InputJoined(input_id="b", turn_id="turn-2", entry="opened"))
    b.add(InputReceived(input=Input(id="c", content="三", timestamp=1_000)))
    b.add(ContextCleared(kinds=("memory",)))  # another clear, of other kinds: not this one
    if old:
        b.add(StopRequested(turn_id="turn-2", reason=kind))
        b.add(InputReleased(input_id="c", reason=kind))  # type: ignore[arg-type]
    else:
        b.add(StopRequested(turn_id="turn-2", reason=kind, kinds=kinds))
        b.add(InputReleased(input_id="c", reason=kind, kinds=kinds))  # type: ignore[arg-type]
    return b.events


@pytest.mark.parametrize("old", [False, True])
def test_a_clear_cut_by_a_kill_is_finished_with_the_kinds_it_was_asked_for(old: bool) -> None:
    """The kinds a clear of the context and more was asked for are recorded with its
    release, and its finished ``ContextCleared`` carries them; a log written before they
    were recorded still decodes and finishes as a clear of the context."""
    store = InMemoryEventStore()
    kinds = ("context", "memory")
    cut = _begun_log("clear", kinds=kinds, old=old)
    store.append(SID, cut, 0)
    runtime = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        assert runtime.recover() == [SID]
        assert runtime.wait_idle(10)
        log = store.read(SID)
    finally:
        runtime.shutdown(timeout=10)
    after = log[len(cut) :]
    # The clear of memory alone before it did not finish it: the clear is written.
    assert [type(e) for e in after] == [TurnRecorded, ContextCleared]
    assert after[-1].kinds == (() if old else kinds)  # type: ignore[union-attr]
    assert project(log).history.messages.to_list() == []


def test_the_wind_down_records_the_clear_s_kinds_with_its_release() -> None:
    """The live path: ``clear(("context", "memory"))`` of a session with a turn running
    and an input pending writes the kinds with its stop and its release."""
    store = InMemoryEventStore()
    model = GatedModel()
    runtime = Runtime(store, Services(llm=model), janitor=False)
    try:
        runtime.submit(SID, Input(id="b", content="二"))
        model.wait_call()
        runtime.submit(SID, Input(id="c", content="三"))
        runtime.clear(SID, ("context", "memory"), timeout=10)
        log = store.read(SID)
    finally:
        runtime.shutdown(timeout=10)
    begun = [e for e in log if isinstance(e, StopRequested | InputReleased)]
    assert [(type(e), e.reason, e.kinds) for e in begun] == [
        (StopRequested, "clear", ("context", "memory")),
        (InputReleased, "clear", ("context", "memory")),
    ]
    assert [e.kinds for e in log if isinstance(e, ContextCleared)] == [("context", "memory")]


def test_sigkill_between_a_deletion_s_two_commits(tmp_path: Path) -> None:
    """A real kill: a worker deletes a session whose turn runs, on SQLite, and is killed
    (SIGKILL) once the release is durable and the deletion's last commit is on its way."""
    db = tmp_path / "kill.db"
    # A PYTHONPATH already set (a tree laid out as installed) comes first.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "delete_crash_worker.py"), str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])},
    )
    assert worker.stdout is not None
    watchdog = threading.Timer(60, worker.kill)
    watchdog.start()
    try:
        line = worker.stdout.readline()
    finally:
        watchdog.cancel()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        worker.stdout.close()
    assert line.strip() == "CUT"
    store = SqliteEventStore(db)
    try:
        killed = store.read(SID)
        assert [e.reason for e in killed if isinstance(e, InputReleased)] == ["delete"]
        assert not any(isinstance(e, SessionDeleted) for e in killed)
        runtime = Runtime(store, Services(llm=_model()), janitor=False)
        try:
            assert runtime.recover() == [SID]
            assert runtime.wait_idle(10)
            view = runtime.view(SID)
        finally:
            runtime.shutdown(timeout=10)
        assert view.queue.generation == 1 and view.history.messages.to_list() == []
        assert [type(e) for e in store.read(SID)[len(killed) :]][-1] is SessionDeleted
    finally:
        store.close()


def test_a_deletion_of_a_turn_past_its_reply_is_finished_too() -> None:
    """A turn whose reply is durable is past stopping (its ``agent:turn:after`` still
    runs), and with nothing waiting the deletion had no stop and no release to write: its
    first commit was empty, the log never knew it begun, and a kill before
    ``SessionDeleted`` left the session undeleted. Now the deletion's stop is written for
    such a turn too (the turn is not cut: it ends replied), and the restart finishes it."""
    from aalis_agent.actors.hooks import Hooks
    from aalis_agent.actors.messages import Ping

    store = InMemoryEventStore()
    killing = KilledAfter(store, lambda events: any(isinstance(e, TurnRecorded) for e in events))
    inside, go = threading.Event(), threading.Event()

    def after(ctx: Any, next_: Any) -> Any:
        result = next_()
        inside.set()
        assert go.wait(10)
        return result

    hooks = Hooks()
    hooks.use("agent:turn:after", after)
    runtime = Runtime(killing, Services(llm=_model()), janitor=False, hooks=hooks)  # type: ignore[arg-type]
    try:
        handle = runtime.submit(SID, Input(id="a", content=CONTENTS["a"]))
        assert inside.wait(10)
        deletion = runtime._begin_delete(SID)
        runtime._entries[SID].ref.ask(Ping(), timeout=10)  # the deletion handled
        assert not deletion.done()
        go.set()
        with pytest.raises(SessionFailed):
            deletion.result(10)
        assert handle.result(10).outcome == "replied"
    finally:
        go.set()
        runtime.shutdown(timeout=10)
    killed = store.read(SID)
    assert not any(isinstance(e, SessionDeleted) for e in killed)
    assert [e.reason for e in killed if isinstance(e, StopRequested)] == ["delete"]
    # Not cut by that stop: recorded once, as it ended.
    assert [e.outcome for e in killed if isinstance(e, TurnRecorded)] == ["replied"]
    _assert_deleted_on_restart(store, killed)


@pytest.mark.parametrize("kind", ["delete", "clear"])
def test_a_wind_down_a_recovery_before_it_was_finished_abandoned_is_not_finished_later(
    kind: str,
) -> None:
    """A log written before recovery finished a cut deletion: the deletion's release, a
    kill, then a restart that recorded the turn cut by the crash and went on; the session
    took new inputs and ran them. The deletion was abandoned then; finishing it at a later
    restart would wipe what came since. A session that received an input after a wind-down
    began (never done while one winds down: those inputs are held back in memory) has
    none pending."""
    cut = _begun_log(kind, kinds=(), old=True)
    b = Batch(SID, len(cut), now_ms=2_000)
    b.add(TurnRecorded(turn_id="turn-2", outcome="aborted", reason="crash"))
    b.add(InputReceived(input=Input(id="d", content="四", timestamp=2_000)))
    b.add(TurnOpened(turn_id="turn-3", input_ids=("d",)))
    b.add(InputJoined(input_id="d", turn_id="turn-3", entry="opened"))
    b.add(TurnRecorded(turn_id="turn-3", outcome="silent"))
    log = [*cut, *b.events]
    assert project(log).queue.winding_down is None
    store = InMemoryEventStore()
    store.append(SID, log, 0)
    runtime = Runtime(store, Services(llm=_model()), janitor=False)
    try:
        assert runtime.recover() == []
        assert runtime.view(SID).seq == len(log)
    finally:
        runtime.shutdown(timeout=10)
    assert len(store.read(SID)) == len(log)
