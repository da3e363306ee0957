"""A turn cut by a failed write whose tool ignores the stop still runs after its actor is
fenced: until it ends, the session stays owned by this runtime (another runtime is
refused it) and a new turn of the session here waits for it. One session never acts
twice at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from aalis_agent.actors.ownership import SessionOwnedElsewhere
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import InMemoryEventStore, Input, SessionFailed, ToolCall
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    Tool,
    ToolRegistry,
)

from tests.faults import FailingStore


class _CountingLeases:
    """Leases as ``PostgresLeases`` keeps them: one row a session, this process's
    acquisitions counted, the row given up with the last of them."""

    def __init__(self, table: dict[str, str], owner: str) -> None:
        self.table, self.owner = table, owner
        self.count: dict[str, int] = {}
        self.released: list[str] = []

    def acquire(self, session_id: str) -> None:
        holder = self.table.setdefault(session_id, self.owner)
        if holder != self.owner:
            raise SessionOwnedElsewhere(session_id, holder)
        self.count[session_id] = self.count.get(session_id, 0) + 1

    def release(self, session_id: str) -> None:
        self.released.append(session_id)
        self.count[session_id] -= 1
        if not self.count[session_id]:
            del self.count[session_id], self.table[session_id]

    def on_lost(self, callback: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_fenced_turn_still_running_keeps_its_session_until_it_ends() -> None:
    acts: list[str] = []  # what reached the outside, in order
    tool_running, go = threading.Event(), threading.Event()

    def reply(request: Any, n: int) -> ScriptedReply:
        acts.append(f"model call {n}")
        if n == 1:
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),))
        return ScriptedReply(text=f"好{n}")

    def slow(args: Any, ctx: Any) -> str:  # ignores the stop, as a blocking call would
        acts.append("tool start")
        tool_running.set()
        go.wait(30)
        acts.append("tool end")
        return "done"

    store = FailingStore(InMemoryEventStore())
    table: dict[str, str] = {}
    leases_a, leases_b = _CountingLeases(table, "a"), _CountingLeases(table, "b")

    def runtime(leases: _CountingLeases) -> Runtime:
        services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("slow", slow)]))
        return Runtime(store, services, janitor=False, ownership=leases)

    a, b = runtime(leases_a), runtime(leases_b)
    try:
        first = a.submit("s", Input(id="", content="一"))
        assert tool_running.wait(10)
        store.fail_at = store.appends + 1  # the next write fails: the actor is fenced
        with pytest.raises(SessionFailed):
            a.submit("s", Input(id="", content="二"))
        # Its tool still runs: the session is still this runtime's.
        assert table == {"s": "a"} and leases_a.released == []
        with pytest.raises(SessionOwnedElsewhere, match="'a'"):
            b.submit("s", Input(id="", content="从 b"))
        # A new turn here (the session rebuilt from its log) waits for the cut one.
        third = a.submit("s", Input(id="", content="三"))
        time.sleep(0.3)
        assert acts == ["model call 1", "tool start"]
        go.set()
        assert third.result(10).outcome == "replied"
        with pytest.raises(SessionFailed):  # the fenced turn's waiters hear of the failure
            first.result(10)
        assert acts[:3] == ["model call 1", "tool start", "tool end"]
        assert acts[3:] == ["model call 2"]  # the new turn's call, after the tool's end
        # The cut turn's acquisition was given back when it ended; the new actor holds
        # its own until it passivates.
        assert leases_a.released == ["s"] and table == {"s": "a"}
        assert a.passivate_idle(0) == 1
        assert table == {}
    finally:
        go.set()
        a.shutdown(timeout=10)
        b.shutdown(timeout=10)


class _LosableLeases(_CountingLeases):
    """Counting leases that can be lost; ``confirm`` (asked before a turn acts) finds the
    loss as a renewal would, telling the runtime first."""

    def __init__(self, table: dict[str, str], owner: str) -> None:
        super().__init__(table, owner)
        self.lost_callbacks: list[Any] = []
        self.confirmed: list[str] = []

    def on_lost(self, callback: Any) -> None:
        self.lost_callbacks.append(callback)

    def confirm(self, session_id: str) -> bool:
        self.confirmed.append(session_id)
        if self.table.get(session_id) == self.owner:
            return True
        self.count.pop(session_id, None)
        for callback in self.lost_callbacks:
            callback(session_id)
        return False


def test_a_tool_is_not_run_for_a_session_whose_ownership_went_meanwhile() -> None:
    ran: list[str] = []
    table: dict[str, str] = {}
    leases = _LosableLeases(table, "a")

    def reply(request: Any, n: int) -> ScriptedReply:
        table["s"] = "b"  # taken over while the model answered
        return ScriptedReply(tool_calls=(ToolCall(id="c1", name="act", arguments="{}"),))

    def act(args: Any, ctx: Any) -> str:
        ran.append("act")
        return "done"

    store = FailingStore(InMemoryEventStore())
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("act", act)]))
    runtime = Runtime(store, services, janitor=False, ownership=leases)
    try:
        handle = runtime.submit("s", Input(id="", content="一"))
        with pytest.raises(RuntimeError, match="moved to another owner"):
            handle.result(10)
        assert ran == []  # asked before the tool ran: no longer ours
        assert leases.confirmed == ["s", "s"]  # before the model call, before the tool
        assert runtime.active_sessions() == []
    finally:
        runtime.shutdown(timeout=10)


def test_an_outliving_turn_gives_back_nothing_once_its_lease_was_lost() -> None:
    """Its acquisition went with the lease: when it ends, it must not give up the one a
    new actor of the session holds since (the session would be free to another runtime
    while served here)."""
    running, go = threading.Event(), threading.Event()

    def reply(request: Any, n: int) -> ScriptedReply:
        if n == 1:
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),))
        return ScriptedReply(text="好")

    def slow(args: Any, ctx: Any) -> str:  # ignores the stop
        running.set()
        go.wait(30)
        return "done"

    table: dict[str, str] = {}
    leases = _LosableLeases(table, "a")
    store = FailingStore(InMemoryEventStore())
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("slow", slow)]))
    runtime = Runtime(store, services, janitor=False, ownership=leases)
    try:
        runtime.submit("s", Input(id="", content="一"))
        assert running.wait(10)
        store.fail_at = store.appends + 1
        with pytest.raises(SessionFailed):
            runtime.submit("s", Input(id="", content="二"))
        table["s"] = "b"  # the lease is lost, as a renewal finds it: the count goes whole
        assert not leases.confirm("s")
        del table["s"]  # b lets it go, and this runtime takes the session again
        handle = runtime.submit("s", Input(id="", content="三"))
        go.set()
        assert handle.result(10).outcome == "replied"
        assert runtime.wait_idle(10)
        assert table == {"s": "a"} and leases.count == {"s": 1}  # the new actor's, kept
    finally:
        go.set()
        runtime.shutdown(timeout=10)
