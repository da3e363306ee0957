"""Crash recovery: kill a worker with SIGKILL mid-turn, restart on the same database."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pykka
import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    Batch,
    ChatMessage,
    FixedClock,
    InMemoryEventStore,
    Input,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageMeta,
    MessageSaved,
    ModelCallStarted,
    SequentialIds,
    SessionEvent,
    SessionFailed,
    SettingsChanged,
    SqliteEventStore,
    StopMarkerSaved,
    ToolCall,
    TurnOpened,
    TurnRecord,
    TurnRecorded,
)
from aalis_agent.projections import project
from aalis_agent.services import ScriptedModel, Services, Tool, ToolRegistry

from tests.harness import GatedModel, GatedTool, settle

ROOT = Path(__file__).resolve().parent.parent


def test_a_turn_cut_by_a_crash_is_recorded_and_the_queue_runs() -> None:
    store = InMemoryEventStore()
    model = GatedModel()
    first = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    first.submit("s", Input(id="a", content="一"))
    first.submit("s", Input(id="b", content="二"))  # pending
    first.submit("s", Input(id="c", content="通知", source="schedule"))  # queued
    settle(first, model)
    # "Crash": the actors vanish without a word; their runner can no longer write.
    for ref in pykka.ActorRegistry.get_all():
        ref.stop()
    for call in model.parked:
        call.abort.abort("crash")
    second_model = ScriptedModel()
    second = Runtime(
        store, Services(llm=second_model), FixedClock(), SequentialIds(), janitor=False
    )
    try:
        assert second.recover() == ["s"]
        assert second.wait_idle(10)
        log = store.read("s")
        records = [(e.turn_id, e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)]
        assert records[0] == ("turn-1", "aborted", "crash")
        opened = [e.input_ids for e in log if isinstance(e, TurnOpened)]
        assert opened == [("a",), ("b",), ("c",)]  # b pending, c queued: each runs once
        markers = [
            e for e in log if isinstance(e, MessageSaved) and e.message.kind == "turn-stopped"
        ]
        assert markers == []  # StopMarkerSaved is its own event
        assert project(log).queue.running is None
    finally:
        second.shutdown(timeout=10)
        first.shutdown(timeout=10)


def test_a_cut_turn_is_recorded_with_the_time_it_ran_not_the_time_the_process_was_down() -> None:
    """The record of a turn cut by a crash says how long it ran (to its last durable
    event: here its tool's start), not how long until the restart: a process down for a
    day made it 86,400 s."""
    store = InMemoryEventStore()
    model, tool = GatedModel(), GatedTool()
    clock = FixedClock()
    services = Services(llm=model, tools=ToolRegistry([Tool("slow", tool)]))
    first = Runtime(store, services, clock, SequentialIds(), janitor=False)
    first.submit("s", Input(id="a", content="一"))
    settle(first, model)
    clock.advance(700)
    model.answer(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),))
    settle(first, model, (tool,))
    for ref in pykka.ActorRegistry.get_all():
        ref.stop()
    tool.release()
    clock.advance(86_400_000)  # down for a day
    second = Runtime(store, Services(llm=ScriptedModel()), clock, SequentialIds(), janitor=False)
    try:
        assert second.recover() == ["s"]
        assert second.wait_idle(10)
        cut = next(e for e in store.read("s") if isinstance(e, TurnRecorded))
        assert (cut.turn_id, cut.outcome, cut.reason) == ("turn-1", "aborted", "crash")
        assert cut.duration_ms == 700
    finally:
        second.shutdown(timeout=10)
        first.shutdown(timeout=10)


@pytest.mark.slow
def test_sigkill_mid_turn_loses_nothing_and_runs_nothing_twice(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "crash_worker.py"), str(db), "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    acked: list[tuple[str, str]] = []
    assert worker.stdout is not None
    # A worker that hangs without a word would block the read below for good: killed
    # after 120 s, its output ends and the count of acknowledgements fails the test.
    watchdog = threading.Timer(120, worker.kill)
    watchdog.start()
    try:
        for line in worker.stdout:
            if line.startswith("ACK "):
                _, session, input_id = line.split()
                acked.append((session, input_id))
            if len(acked) >= 40:
                break
    finally:
        watchdog.cancel()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        worker.stdout.close()
    assert len(acked) >= 40
    store = SqliteEventStore(db)
    runtime = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    crashed = 0
    try:
        runtime.recover()
        assert runtime.wait_idle(60)
        for session in {s for s, _ in acked}:
            log = store.read(session)
            received = {e.input.id for e in log if isinstance(e, InputReceived)}
            # An input runs when it is archived with its turn (before the model sees it);
            # one put back by recovery joins twice but runs once.
            ran = Counter(
                e.message.meta.input_id
                for e in log
                if isinstance(e, MessageSaved)
                and e.message.meta.turn_id is not None
                and e.message.meta.input_id is not None
            )
            requeued = {e.input_id for e in log if isinstance(e, InputRequeued)}
            joined = Counter(e.input_id for e in log if isinstance(e, InputJoined))
            released = {e.input_id for e in log if isinstance(e, InputReleased)}
            for s, input_id in acked:
                if s != session:
                    continue
                assert input_id in received, f"{input_id} acknowledged but not in the log"
                assert ran[input_id] == 1 or input_id in released, (
                    f"{input_id} ran {ran[input_id]} times"
                )
                assert joined[input_id] == 1 + (input_id in requeued) or input_id in released
            assert all(n == 1 for n in ran.values())  # nothing ran twice
            opened = [e.turn_id for e in log if isinstance(e, TurnOpened)]
            recorded = [e.turn_id for e in log if isinstance(e, TurnRecorded)]
            assert opened == recorded  # every turn, the cut one included, has its record
            assert project(log).queue.running is None
            crashed += sum(1 for e in log if isinstance(e, TurnRecorded) and e.reason == "crash")
        assert crashed >= 1  # the kill did land in the middle of a turn
    finally:
        runtime.shutdown(timeout=30)
        store.close()


class CountingStore(InMemoryEventStore):
    """Counts which sessions' logs were read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def read(self, session_id: str, after_seq: int = 0, **kw: Any) -> list[SessionEvent]:
        self.reads[session_id] += 1
        return super().read(session_id, after_seq, **kw)


def test_recovery_folds_only_sessions_that_may_have_work() -> None:
    """ES4: the runtime marks each batch with whether work is left, so a restart reads
    only the sessions cut mid-work (and, once, those written without the mark)."""
    store = CountingStore()
    model = GatedModel()
    first = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    for n in range(5):  # five sessions that finished their turns
        sid = f"done-{n}"
        handle = first.submit(sid, Input(id=f"i{n}", content="你好"))
        settle(first, model)
        model.answer("好")
        assert handle.result(10).outcome == "replied"
    first.submit("busy", Input(id="b", content="在吗"))  # cut mid-turn
    settle(first, model)
    assert store.open_sessions() == ["busy"]
    # A session written by a writer that does not mark its batches: folded once.
    setting = SettingsChanged(session_id="legacy", seq=1, at=0, key="historyLimit", value=3)
    store.append("legacy", [setting], 0)
    for ref in pykka.ActorRegistry.get_all():
        ref.stop()
    for call in model.parked:
        call.abort.abort("crash")
    store.reads.clear()
    second = Runtime(
        store, Services(llm=ScriptedModel()), FixedClock(), SequentialIds(), janitor=False
    )
    try:
        assert second.recover() == ["busy"]
        assert set(store.reads) == {"busy", "legacy"}
        assert second.wait_idle(10)
        assert store.open_sessions() == []  # legacy was marked idle; busy finished
        assert [e.outcome for e in store.read("busy") if isinstance(e, TurnRecorded)] == ["aborted"]
    finally:
        second.shutdown(timeout=10)
        first.shutdown(timeout=10)


def test_recovery_limited_to_some_sessions_leaves_the_others_for_their_owner(
    tmp_path: Path,
) -> None:
    """``recover(sessions=...)`` (a chat restarted on a shared database) records the cut
    turn and runs the queue of the sessions named, and no other: the others' work is
    left, unread, for the runtime that runs them (it would run with the wrong model)."""
    store = CountingSqlite(tmp_path / "shared.db")
    model = GatedModel()
    first = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    for sid in ("mine", "theirs"):
        first.submit(sid, Input(id=f"{sid}-a", content="一"))
        first.submit(sid, Input(id=f"{sid}-b", content="二", source="schedule"))  # queued
    settle(first, model)
    for ref in pykka.ActorRegistry.get_all():
        ref.stop()
    for call in model.parked:
        call.abort.abort("crash")
    store.reads.clear()
    second = Runtime(
        store, Services(llm=ScriptedModel()), FixedClock(), SequentialIds(), janitor=False
    )
    try:
        assert second.recover(sessions=["mine", "absent"]) == ["mine"]
        assert second.wait_idle(10)
        assert set(store.reads) == {"mine"}  # the other session's log is not even read
        mine = [(e.outcome, e.reason) for e in store.read("mine") if isinstance(e, TurnRecorded)]
        assert mine == [("aborted", "crash"), ("replied", None)]
        assert [e for e in store.read("theirs") if isinstance(e, TurnRecorded)] == []
        assert store.open_sessions() == ["theirs"]  # still waiting for its owner
        assert second.recover(sessions=[]) == []
        assert second.recover() == ["theirs"]  # unlimited: as before, every session
    finally:
        second.shutdown(timeout=10)
        first.shutdown(timeout=10)
        store.close()


class CountingSqlite(SqliteEventStore):
    """A SQLite log that counts which sessions' logs were read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: Counter[str] = Counter()

    def read(self, session_id: str, after_seq: int = 0, **kw: Any) -> list[SessionEvent]:
        self.reads[session_id] += 1
        return super().read(session_id, after_seq, **kw)


def _cut_log(*, archived: bool, reply_saved: bool, session: str = "s") -> list[SessionEvent]:
    """A log a kill left behind: turn-1 opened with input a; then, maybe, a's archive and
    the model call; maybe the reply saved; never the turn's record."""
    b = Batch(session, 0, now_ms=1_000)
    b.add(InputReceived(input=Input(id="a", content="一", timestamp=1_000)))
    b.add(TurnOpened(turn_id="turn-1", input_ids=("a",)))
    b.add(InputJoined(input_id="a", turn_id="turn-1", entry="opened"))
    b.add(InputReceived(input=Input(id="b", content="二", timestamp=1_000)))
    b.add(InputQueued(input_id="b"))
    if archived:
        meta = MessageMeta(turn_id="turn-1", entry="opened", input_id="a")
        b.add(MessageSaved(message=ChatMessage(id="m-a", role="user", content="一", meta=meta)))
        b.add(ModelCallStarted(turn_id="turn-1", index=1))
    if reply_saved:
        record = TurnRecord(turn_id="turn-1", outcome="replied")
        meta = MessageMeta(turn_id="turn-1", turn_record=record)
        b.add(
            MessageSaved(message=ChatMessage(id="m-r", role="assistant", content="好", meta=meta))
        )
    return b.events


@pytest.mark.parametrize(("archived", "reply_saved"), [(False, False), (True, False), (True, True)])
def test_recovery_puts_back_what_never_reached_the_model(archived: bool, reply_saved: bool) -> None:
    """An acknowledged input is never silently dropped: cut before its archive, it never
    reached the model, so recovery puts it back at the head of the queue (ahead of b, which
    was queued later) and it runs. Archived and carried, it is not run again. A cut turn
    whose reply was durable is recorded replied, with no stop marker."""
    store = InMemoryEventStore()
    events = _cut_log(archived=archived, reply_saved=reply_saved)
    store.append("s", events, 0)
    model = ScriptedModel()
    runtime = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    try:
        assert runtime.recover() == ["s"]
        assert runtime.wait_idle(10)
        log = store.read("s")[len(events) :]
        requeued = [e.input_id for e in log if isinstance(e, InputRequeued)]
        assert requeued == ([] if archived else ["a"])
        records = [(e.turn_id, e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)]
        cut = ("turn-1", "replied" if reply_saved else "aborted", "crash")
        assert records[0] == cut and all(r[1] == "replied" for r in records[1:])
        opened = [e.input_ids for e in log if isinstance(e, TurnOpened)]
        assert opened == ([("a", "b")] if not archived else [("b",)])
        user = [
            e.message.content
            for e in store.read("s")
            if isinstance(e, MessageSaved) and e.message.role == "user"
        ]
        assert user == ["一", "二"]  # each archived exactly once, a first
        markers = [e for e in log if isinstance(e, StopMarkerSaved)]
        assert len(markers) == (1 if archived and not reply_saved else 0)
        assert not project(store.read("s")).queue.queued
    finally:
        runtime.shutdown(timeout=10)


def test_a_corrupt_log_is_quarantined_and_every_other_session_recovers(tmp_path: Path) -> None:
    """Recovery isolates damage: one session whose log does not decode is quarantined and
    reported (session, seq, reason); a healthy session cut by the same crash is recorded
    and runs its queue; new sessions are served."""
    path = tmp_path / "agent.db"
    with SqliteEventStore(path) as store:
        store.append("bad", _cut_log(archived=True, reply_saved=False, session="bad")[:2], 0)
        store.append("good", _cut_log(archived=True, reply_saved=False, session="good"), 0)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "INSERT INTO events (position, session_id, seq, type, data) VALUES (?, ?, ?, ?, ?)",
            (1000, "bad", 3, "message_saved", b"\xc1 not msgpack"),
        )
    conn.close()
    store = SqliteEventStore(path)
    runtime = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    try:
        assert runtime.recover() == ["good"]
        assert runtime.wait_idle(10)
        [bad] = runtime.quarantined()
        assert (bad.session_id, bad.seq) == ("bad", 3) and bad.reason
        records = [
            (e.turn_id, e.outcome) for e in store.read("good") if isinstance(e, TurnRecorded)
        ]
        assert records[0] == ("turn-1", "aborted") and len(records) == 2  # cut, then b ran
        with pytest.raises(SessionFailed, match=r"'bad' is quarantined.*seq 3"):
            runtime.submit("bad", Input(id="", content="还在吗"))
        assert runtime.submit("new", Input(id="", content="你好")).result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


_FAILING_WRITES = """
import sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from aalis_agent import Input, InMemoryEventStore, Runtime, Services, SessionFailed
from aalis_agent.services import ScriptedModel

class Failing(InMemoryEventStore):
    def append(self, session_id, events, expected_seq, *, open_work=None):
        if self.last_seq(session_id) > 0:
            raise OSError("disk full")
        return super().append(session_id, events, expected_seq, open_work=open_work)

runtime = Runtime(Failing(), Services(llm=ScriptedModel()))
handle = runtime.submit("s", Input(id="", content="hi"))
try:
    handle.result(10)
except SessionFailed as exc:
    print("failed:", exc.reason)
runtime.shutdown()
print("shut down", flush=True)
"""


def test_shutdown_returns_and_the_process_exits_while_writes_fail() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_WRITES],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["failed: OSError: disk full", "shut down"]
