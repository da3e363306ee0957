"""A turn ended by its tool batch leaves no call started without its finish.

A tool whose own code raises ``KeyboardInterrupt`` or ``SystemExit`` ends its turn, and
the exception is passed on (the process is being interrupted, or exits). It used to end
the turn with no reason (recorded ``error``) and its ``ToolStarted`` with no
``ToolFinished``. Now the call's finish (an error naming the interruption) and the turn's
record (``aborted``, reason ``interrupt`` or ``exit``) are committed first, then it is
raised on; when that write fails, the interrupt is still what goes on.

An ``agent:tool:after`` middleware that raises fails its turn after the tool ran: the
call's finish now records what the tool returned before the turn fails.

Either way the batch's calls that ran stay in history, each with its result as recorded
(they were left out, while the interrupted turn's stop marker told the next turn that
executed calls are as recorded).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.actors.turn import TurnRunner
from aalis_agent.events import (
    SessionEvent,
    ToolFinished,
    ToolStarted,
    TurnRecorded,
)

from aalis_agent import (
    Hooks,
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
from tests.faults import FailingStore


@pytest.fixture
def escaped(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """What each turn's thread body raised (its worker logs and drops it)."""
    seen: list[BaseException] = []
    main = TurnRunner._main

    def watched(self: TurnRunner) -> None:
        try:
            main(self)
        except BaseException as exc:
            seen.append(exc)
            raise

    monkeypatch.setattr(TurnRunner, "_main", watched)
    yield seen


def _runtime(store: Any, handler: Callable[[Any, Any], Any], hooks: Hooks | None = None) -> Runtime:
    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="effect", arguments="{}"),)),
            ScriptedReply(text="after the tool"),
        ]
    )
    services = Services(llm=model, tools=ToolRegistry([Tool("effect", handler)]))
    return Runtime(store, services, hooks=hooks, janitor=False)


def _tool_events(events: list[SessionEvent]) -> list[SessionEvent]:
    return [e for e in events if isinstance(e, ToolStarted | ToolFinished | TurnRecorded)]


@pytest.mark.parametrize(
    ("raised", "reason"),
    [(KeyboardInterrupt(), "interrupt"), (SystemExit(3), "exit")],
    ids=["KeyboardInterrupt", "SystemExit"],
)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_interrupt_from_a_tool_records_its_finish_and_the_turns_reason_then_goes_on(
    tmp_path: Path,
    escaped: list[BaseException],
    raised: BaseException,
    reason: str,
    kind: str,
) -> None:
    def sync_tool(args: Any, ctx: Any) -> str:
        raise raised

    async def async_tool(args: Any, ctx: Any) -> str:
        await asyncio.sleep(0)
        raise raised

    store = SqliteEventStore(tmp_path / "log.db")
    runtime = _runtime(store, sync_tool if kind == "sync" else async_tool)
    try:
        outcome = runtime.submit("room", Input(id="", content="hi")).result(30)
        assert (outcome.outcome, outcome.reason) == ("aborted", reason)
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    # Passed on: out of the turn, the very exception the tool raised.
    assert escaped == [raised]
    reopened = SqliteEventStore(tmp_path / "log.db")  # what is durable
    try:
        events = _tool_events(reopened.read("room"))
    finally:
        reopened.close()
    assert [type(e) for e in events] == [ToolStarted, ToolFinished, TurnRecorded]
    started, finished, record = events
    assert isinstance(started, ToolStarted) and isinstance(finished, ToolFinished)
    assert finished.call_id == started.call_id == "c1"
    assert finished.result is None
    assert finished.error is not None
    assert finished.error.startswith(type(raised).__name__)
    assert "interrupted while the tool ran" in finished.error
    assert isinstance(record, TurnRecorded)
    assert (record.outcome, record.reason) == ("aborted", reason)


def test_an_interrupt_whose_record_cannot_be_written_is_still_passed_on(
    tmp_path: Path, escaped: list[BaseException]
) -> None:
    store = FailingStore(SqliteEventStore(tmp_path / "log.db"))

    def tool(args: Any, ctx: Any) -> str:
        store.arm(store.appends + 1)  # the next write: the one recording the turn's end
        raise KeyboardInterrupt

    runtime = _runtime(store, tool)
    try:
        handle = runtime.submit("room", Input(id="", content="hi"))
        with pytest.raises(Exception):  # noqa: B017 - the session's failure, whatever its type
            handle.result(30)
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    assert [type(e) for e in escaped] == [KeyboardInterrupt]
    refused = store.failures
    assert len(refused) == 1
    assert {"ToolFinished", "TurnRecorded"} <= set(refused[0].kinds)


def test_a_failing_tool_after_middleware_records_what_the_tool_returned(
    tmp_path: Path, escaped: list[BaseException]
) -> None:
    ran: list[str] = []

    def tool(args: Any, ctx: Any) -> str:
        ran.append(ctx.call_id)
        return "the tool's result"

    def failing(ctx: Any, next_: Callable[[], Any]) -> Any:
        next_()
        ctx.result = "half changed"  # left by the middleware that then fails
        ctx.metadata["approval"] = "never stored"
        raise RuntimeError("after failed")

    hooks = Hooks()
    hooks.use("agent:tool:after", failing)
    store = SqliteEventStore(tmp_path / "log.db")
    runtime = _runtime(store, tool, hooks)
    try:
        outcome = runtime.submit("room", Input(id="", content="hi")).result(30)
        events = _tool_events(store.read("room"))
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    assert ran == ["c1"]
    assert escaped == []  # an exception: the turn's failure, not passed on
    # The turn fails as before (outcome error, reason the exception's type).
    assert (outcome.outcome, outcome.reason) == ("error", "RuntimeError")
    assert [type(e) for e in events] == [ToolStarted, ToolFinished, TurnRecorded]
    finished = events[1]
    assert isinstance(finished, ToolFinished)
    assert (finished.call_id, finished.result, finished.error) == ("c1", "the tool's result", None)
    assert finished.metadata == {}
    record = events[2]
    assert isinstance(record, TurnRecorded)
    assert (record.outcome, record.reason) == ("error", "RuntimeError")


@pytest.mark.parametrize(
    "ending",
    ["KeyboardInterrupt", "SystemExit", "agent:tool:after"],
)
def test_the_calls_that_ran_before_the_turn_ended_stay_in_history(
    escaped: list[BaseException], ending: str
) -> None:
    """A batch of two calls: the first ran (an effect: an email sent), the second ended
    the turn (an interrupt or an exit from the tool, or its agent:tool:after failing).
    The group of calls that ran stays in history, each with its result as recorded, as a
    stopped turn's finished groups do (SCH6, SAVE2): the next turn's model sees the email
    was sent. The interrupted turn's stop marker tells it "executed tool calls are as
    recorded"; the history held none of them, so it was told nothing ran."""
    from aalis_agent import InMemoryEventStore

    def send(args: Any, ctx: Any) -> str:
        return "the email was sent"

    def second(args: Any, ctx: Any) -> str:
        if ending == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if ending == "SystemExit":
            raise SystemExit(3)
        return "second's result"

    def failing(ctx: Any, next_: Callable[[], Any]) -> Any:
        next_()
        if ctx.name == "second":
            raise RuntimeError("after failed")

    hooks = Hooks()
    if ending == "agent:tool:after":
        hooks.use("agent:tool:after", failing)
    requests: list[Any] = []

    def reply(request: Any, n: int) -> ScriptedReply:
        requests.append(request)
        if n == 1:
            return ScriptedReply(
                tool_calls=(
                    ToolCall(id="c1", name="send", arguments="{}"),
                    ToolCall(id="c2", name="second", arguments="{}"),
                )
            )
        return ScriptedReply(text="it was sent")

    services = Services(
        llm=ScriptedModel(reply), tools=ToolRegistry([Tool("send", send), Tool("second", second)])
    )
    runtime = Runtime(InMemoryEventStore(), services, hooks=hooks, janitor=False)
    try:
        first = runtime.submit("room", Input(id="a", content="send it")).result(30)
        assert first.outcome == ("error" if ending == "agent:tool:after" else "aborted")
        runtime.submit("room", Input(id="b", content="was it sent?")).result(30)
    finally:
        runtime.shutdown(timeout=10)
    seen = requests[-1].messages
    calls = [m for m in seen if m.tool_calls]
    assert [[c.id for c in m.tool_calls] for m in calls] == [["c1", "c2"]]
    results = {m.tool_call_id: m.content for m in seen if m.role == "tool"}
    assert results["c1"] == "the email was sent"
    if ending == "agent:tool:after":
        assert results["c2"] == "second's result"  # what the tool returned
    else:
        assert results["c2"].startswith(ending)
        assert "interrupted while the tool ran" in results["c2"]
    # in order: the input, the group (the call, then its results), then the next input
    roles = [m.role for m in seen if m.role != "system"]
    assert roles == ["user", "assistant", "tool", "tool", "user"]


class _UnprintableInterrupt(KeyboardInterrupt):
    """An interrupt whose ``str()`` itself fails."""

    def __str__(self) -> str:
        raise RuntimeError("its message cannot be built")


def test_an_interrupt_whose_message_cannot_be_built_is_recorded_and_passed_on(
    tmp_path: Path, escaped: list[BaseException]
) -> None:
    """Building the call's error from the interrupt's message raised in its place: the
    turn was recorded ``error`` with the call left without its finish, and the interrupt
    was lost."""
    raised = _UnprintableInterrupt()

    def tool(args: Any, ctx: Any) -> str:
        raise raised

    store = SqliteEventStore(tmp_path / "log.db")
    runtime = _runtime(store, tool)
    try:
        outcome = runtime.submit("room", Input(id="", content="hi")).result(30)
        assert (outcome.outcome, outcome.reason) == ("aborted", "interrupt")
        events = _tool_events(store.read("room"))
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    assert escaped == [raised]
    assert [type(e) for e in events] == [ToolStarted, ToolFinished, TurnRecorded]
    finished = events[1]
    assert isinstance(finished, ToolFinished) and finished.error is not None
    assert finished.error.startswith("_UnprintableInterrupt(<exception str() failed>)")
