"""A stop that is durable holds across a crash.

A turn whose stop (``stop``, stop-all, mute) was committed, cut by a kill before it
settled, with inputs no model call had carried yet (its runner archives them after an
``agent:turn:before`` middleware, or an inserted input before its call): recovery put
those inputs back at the head of the queue and ran them in a new turn, model call, tool
and reply included, so the input the user had stopped ran anyway, as if the stop had
never been pressed. Without the crash the same turn ends ``aborted`` with its inputs
archived and nothing more run (SCH6). Now recovery records the cut turn the same way:
its uncarried inputs archived in it, ``aborted``, a stop marker; the inputs waiting for
the next turn still open it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from aalis_agent.events import (
    Batch,
    InputHeld,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SessionEvent,
    StopMarkerSaved,
    StopRequested,
    TurnOpened,
    TurnRecorded,
)
from aalis_agent.services import ChatRequest

from aalis_agent import (
    Hooks,
    InMemoryEventStore,
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    ToolRegistry,
)
from tests.faults import audit_log

SID = "s"


def _model(calls: list[tuple[str, ...]]) -> ScriptedModel:
    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        calls.append(tuple(m.meta.input_id for m in request.messages if m.meta.input_id))
        return ScriptedReply(text=f"答复 {n}")

    return ScriptedModel(reply)


def _user_archive(events: list[SessionEvent]) -> list[tuple[str | None, str | None]]:
    return [
        (e.message.meta.input_id, e.message.meta.turn_id)
        for e in events
        if isinstance(e, MessageSaved) and e.message.role == "user"
    ]


def _cut_log(reason: str, *, inserted: bool) -> list[SessionEvent]:
    """A kill left turn-1 stopped and unsettled: opened for a (not yet archived: a
    middleware ran first), maybe b inserted (joined, not yet carried), then the stop;
    c pending for turn-1 (or, after a stop-all or mute, released with it)."""
    b = Batch(SID, 0, now_ms=1_000)
    b.add(InputReceived(input=Input(id="a", content="一", timestamp=1_000)))
    b.add(TurnOpened(turn_id="turn-1", input_ids=("a",)))
    b.add(InputJoined(input_id="a", turn_id="turn-1", entry="opened"))
    if inserted:
        b.add(InputReceived(input=Input(id="b", content="二", timestamp=1_000)))
        b.add(InputHeld(input_id="b", turn_id="turn-1"))
        b.add(InputJoined(input_id="b", turn_id="turn-1", entry="joined"))
    b.add(InputReceived(input=Input(id="c", content="三", timestamp=1_000)))
    b.add(InputHeld(input_id="c", turn_id="turn-1"))
    b.add(StopRequested(turn_id="turn-1", reason=reason))
    if reason != "stop":
        b.add(InputReleased(input_id="c", reason=reason, archived=True))  # type: ignore[arg-type]
    return b.events


@pytest.mark.parametrize("inserted", [False, True])
@pytest.mark.parametrize("reason", ["stop", "stop-all", "mute"])
def test_a_stopped_turn_cut_by_a_crash_does_not_run_its_inputs_again(
    reason: str, inserted: bool
) -> None:
    store = InMemoryEventStore()
    cut = _cut_log(reason, inserted=inserted)
    store.append(SID, cut, 0)
    calls: list[tuple[str, ...]] = []
    runtime = Runtime(store, Services(llm=_model(calls)), janitor=False)
    try:
        assert runtime.recover() == [SID]
        assert runtime.wait_idle(10)
        stopped = ["a", "b"] if inserted else ["a"]
        contents = {"a": "一", "b": "二"}
        answers = [runtime.submit(SID, Input(id=i, content=contents[i])) for i in stopped]
        log = store.read(SID)
    finally:
        runtime.shutdown(timeout=10)
    after = log[len(cut) :]
    assert [e for e in after if isinstance(e, InputRequeued)] == []
    # Only c may open a turn (after a plain stop: it waited for the next one).
    opened = [e.input_ids for e in after if isinstance(e, TurnOpened)]
    assert opened == ([("c",)] if reason == "stop" else [])
    # No model call carried a stopped input as a new input of its own turn.
    assert [call for call in calls if call[-1:] and call[-1] in stopped] == []
    # The stopped turn: its inputs archived in it, once; aborted; its stop marker.
    archive = _user_archive(log)
    for input_id in stopped:
        assert archive.count((input_id, "turn-1")) == 1
    assert [i for i, t in archive if i in stopped and t != "turn-1"] == []
    records = [(e.turn_id, e.outcome) for e in after if isinstance(e, TurnRecorded)]
    assert records[0] == ("turn-1", "aborted")
    assert [e.turn_id for e in after if isinstance(e, StopMarkerSaved)] == ["turn-1"]
    # Sent again, each is answered by the stopped turn.
    for handle in answers:
        assert handle.where == "handled"
        assert (handle.result(0).turn_id, handle.result(0).outcome) == ("turn-1", "aborted")
    report = audit_log(log, acked=[*stopped, "c"])
    assert report == {k: [] for k in report}


def test_a_cut_turn_that_was_not_stopped_still_puts_back_what_never_reached_the_model() -> None:
    """The rule the fix keeps: no stop, so the uncarried input runs in a new turn."""
    store = InMemoryEventStore()
    cut = [e for e in _cut_log("stop", inserted=False) if not isinstance(e, StopRequested)]
    store.append(SID, cut, 0)
    calls: list[tuple[str, ...]] = []
    runtime = Runtime(store, Services(llm=_model(calls)), janitor=False)
    try:
        runtime.recover()
        assert runtime.wait_idle(10)
        log = store.read(SID)
    finally:
        runtime.shutdown(timeout=10)
    after = log[len(cut) :]
    assert [e.input_id for e in after if isinstance(e, InputRequeued)] == ["a"]
    assert [e.input_ids for e in after if isinstance(e, TurnOpened)] == [("a", "c")]


def test_the_same_stop_without_a_crash_ends_the_turn_as_recovery_now_does() -> None:
    """The live path the recovery now matches: a stop while ``agent:turn:before`` runs
    (its inputs not yet archived) ends the turn aborted, its input archived in it, and
    no model call is made."""
    store = InMemoryEventStore()
    entered, go = threading.Event(), threading.Event()

    def before(ctx: Any, next_: Callable[[], Any]) -> Any:
        entered.set()
        go.wait(10)
        return next_()

    hooks = Hooks()
    hooks.use("agent:turn:before", before)
    calls: list[tuple[str, ...]] = []
    runtime = Runtime(store, Services(llm=_model(calls), tools=ToolRegistry([])), hooks=hooks)
    try:
        handle = runtime.submit(SID, Input(id="a", content="一"))
        assert entered.wait(10)
        runtime.stop(SID)
        go.set()
        outcome = handle.result(10)
        log = store.read(SID)
    finally:
        go.set()
        runtime.shutdown(timeout=10)
    turn = outcome.turn_id
    assert outcome.outcome == "aborted" and calls == []
    assert _user_archive(log) == [("a", turn)]
    assert [e.turn_id for e in log if isinstance(e, StopMarkerSaved)] == [turn]
    assert not any(isinstance(e, ModelCallStarted | ModelCallEnded) for e in log)
