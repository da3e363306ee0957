"""A stop acknowledged before a tool's start is durable keeps that tool from running, and
``tool:execute`` "start" is published once the start is durable.

A runner checks for a stop before each tool call, then records the call's start
(``ToolStarted``) and runs the tool. A stop can land between the two: acknowledged
(``stop()`` returned, its ``StopRequested`` durable) while the start is not yet written.
The tool used to run anyway, after the stop in the log; the actor now refuses the start
of a stopped turn, so the tool never runs and the log shows no start after the stop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.actors.turn_tools import ToolBatch
from aalis_agent.events import StopRequested, ToolFinished, ToolStarted, TurnRecorded

from aalis_agent import (
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


def _runtime(store: SqliteEventStore, ran: list[str]) -> Runtime:
    def effect(args: Any, ctx: Any) -> str:
        ran.append(ctx.call_id)
        return "done"

    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="effect", arguments="{}"),)),
            ScriptedReply(text="after the tool"),
        ]
    )
    services = Services(llm=model, tools=ToolRegistry([Tool("effect", effect)]))
    return Runtime(store, services, janitor=False)


def test_a_stop_acknowledged_before_the_tools_start_is_durable_keeps_the_tool_from_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqliteEventStore(tmp_path / "log.db")
    ran: list[str] = []
    runtime = _runtime(store, ran)
    stopped: list[str | None] = []
    context = ToolBatch._tool_context

    def stop_in_the_window(self: ToolBatch, call_id: str) -> Any:
        # After the runner's own check for a stop, before the start is reported: the
        # stop is acknowledged (on another thread, as a user's would be) right here.
        thread = threading.Thread(target=lambda: stopped.append(runtime.stop("room")))
        thread.start()
        thread.join(10)
        return context(self, call_id)

    monkeypatch.setattr(ToolBatch, "_tool_context", stop_in_the_window)
    try:
        outcome = runtime.submit("room", Input(id="", content="你好")).result(10)
        assert stopped and stopped[0] == outcome.turn_id  # acknowledged
        assert outcome.outcome == "aborted" and outcome.reason == "stop"
        assert ran == []  # the tool never ran
        events = store.read("room")
        kinds = [type(e) for e in events]
        assert StopRequested in kinds
        assert ToolStarted not in kinds and ToolFinished not in kinds
        record = [e for e in events if isinstance(e, TurnRecorded)]
        assert [r.outcome for r in record] == ["aborted"]
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_tool_execute_start_is_published_once_the_tools_start_is_durable(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    store = SqliteEventStore(path)
    reader = SqliteEventStore(path, read_only=True)  # what another process would read
    ran: list[str] = []
    runtime = _runtime(store, ran)
    seen: list[tuple[str, bool]] = []

    def on_tool(topic: str, payload: dict[str, Any]) -> None:
        started = [e for e in reader.read("room") if isinstance(e, ToolStarted)]
        seen.append((payload["phase"], [e.call_id for e in started] == [payload["callId"]]))

    runtime.subscribe("tool:execute", on_tool)
    try:
        assert runtime.submit("room", Input(id="", content="你好")).result(10).outcome == "replied"
        assert ran == ["c1"]
        assert seen == [("start", True), ("end", True)]
    finally:
        runtime.shutdown(timeout=10)
        reader.close()
        store.close()
