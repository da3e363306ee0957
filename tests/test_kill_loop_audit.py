"""The kill loop's audit (``tests/faults.py`` ``audit_log``) finds what it looks for.

A real session runs a tool turn, a turn held by its tool while inputs wait (pending and
queued) that a stop-all then releases, and each input is sent again under its id. The
log this leaves passes every check; each check is then shown to fire on a log or an
answer that breaks its rule (an answer differing from the log, an input received twice
or run by two turns, a released input archived twice or not at all, a model call with
neither its end nor its turn's record, a tool call never finished in a turn no crash
cut, an input put back from a stopped turn, a deletion or clear begun and never
finished). Without this, a check that can never fire
would pass the kill loop as well as a sound runtime does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from aalis_agent.events import (
    ContextCleared,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    SessionDeleted,
    SessionEvent,
    StopRequested,
    ToolFinished,
    TurnOpened,
    TurnRecorded,
)

from aalis_agent import (
    Hooks,
    InMemoryEventStore,
    Input,
    Runtime,
    ScriptedModel,
    Services,
    ToolRegistry,
)
from tests.faults import RecordingTool, audit_log, tool_then_reply, wait_until

SID = "room"


def _answer(outcome: Any) -> dict[str, Any]:
    return {
        "outcome": outcome.outcome,
        "reason": outcome.reason,
        "turn": outcome.turn_id,
        "reply": outcome.reply,
    }


@pytest.fixture(scope="module")
def session() -> tuple[list[SessionEvent], list[dict[str, Any]]]:
    """The log of a session that ran a tool turn and a stop-all over waiting inputs, and
    the answers to each of its inputs sent again (as the kill loop's worker records
    them)."""
    store = InMemoryEventStore()
    tool = RecordingTool(store, gated=True, blocking=0)
    services = Services(llm=ScriptedModel(tool_then_reply("t")), tools=ToolRegistry([tool.tool()]))
    runtime = Runtime(store, services, janitor=False)
    inputs = [
        Input(id="a", content="first"),
        Input(id="b", content="held"),
        Input(id="c", content="pending"),
        Input(id="d", content="queued", source="schedule"),
    ]
    resends: list[dict[str, Any]] = []
    try:
        assert runtime.submit(SID, inputs[0]).result(10).outcome == "replied"
        tool.block_next(1)
        held = runtime.submit(SID, inputs[1])
        assert tool.started.wait(10)
        assert [runtime.submit(SID, i).where for i in inputs[2:]] == ["pending", "queued"]
        again = runtime.submit(SID, inputs[2])  # live: follows it
        assert again.where == "pending"
        runtime.stop_all(SID)
        tool.release()
        assert held.result(10).outcome == "aborted"
        assert again.result(10).outcome == "released"
        resends.append({"id": "c", "where": "pending", "followed": True, **_answer(again.result())})
        assert runtime.wait_idle(10)
        for inp in inputs:
            handle = runtime.submit(SID, inp)
            assert handle.where == "handled"
            resends.append({"id": inp.id, "where": "handled", **_answer(handle.result(0))})
        events = store.read(SID)
    finally:
        runtime.shutdown(timeout=10)
    return events, resends


def _findings(events: list[SessionEvent], resends: list[dict[str, Any]]) -> dict[str, list[str]]:
    return audit_log(events, acked=["a", "b", "c", "d"], resends=resends)


def test_a_sound_log_and_right_answers_pass_every_check(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, resends = session
    assert {r["outcome"] for r in resends} == {"replied", "aborted", "released"}
    assert _findings(events, resends) == {k: [] for k in _findings(events, resends)}
    assert set(_findings(events, resends)) >= {
        "entered_twice",
        "release_archive",
        "call_unended",
        "resend_wrong",
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [("reply", "another text"), ("outcome", "aborted"), ("reason", "stop"), ("turn", "turn-x")],
)
def test_an_answer_that_differs_from_the_log_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]], field: str, value: str
) -> None:
    events, resends = session
    wrong = [{**r, field: value} if r["id"] == "a" else r for r in resends]
    found = _findings(events, wrong)["resend_wrong"]
    assert len(found) == 1 and found[0].startswith("a sent again"), found


def test_a_refused_resend_and_one_the_log_never_received_are_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, resends = session
    extra = [{"id": "a", "error": "InvalidInput: taken"}, {"id": "zz", "where": "opened"}]
    found = _findings(events, resends + extra)["resend_wrong"]
    assert len(found) == 2 and "refused" in found[0] and "not in the log" in found[1], found


def test_a_followed_answer_that_differs_from_the_log_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, resends = session
    wrong = [{**r, "reason": "mute"} if r.get("followed") else r for r in resends]
    found = _findings(events, wrong)["resend_wrong"]
    assert len(found) == 1 and "followed to its end" in found[0], found


def _renumbered(events: list[SessionEvent]) -> list[SessionEvent]:
    return [msgspec.structs.replace(e, seq=n) for n, e in enumerate(events, 1)]


def test_an_input_received_twice_or_run_by_two_turns_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, _ = session
    received = next(e for e in events if isinstance(e, InputReceived) and e.input.id == "a")
    twice = _renumbered([*events, received])
    assert len(_findings(twice, [])["entered_twice"]) == 1
    opened = next(e for e in events if isinstance(e, TurnOpened) and "a" in e.input_ids)
    rerun = [
        TurnOpened(turn_id="turn-again", input_ids=("a",)),
        InputJoined(input_id="a", turn_id="turn-again", entry="opened"),
        TurnRecorded(turn_id="turn-again", outcome="aborted"),
    ]
    found = _findings(_renumbered([*events, *rerun]), [])["entered_twice"]
    assert len(found) == 1 and opened.turn_id in found[0] and "turn-again" in found[0], found


def test_a_released_input_archived_twice_or_never_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, _ = session
    released = {e.input_id for e in events if isinstance(e, InputReleased)}
    assert released == {"c", "d"}

    def loose(e: SessionEvent) -> bool:  # a released input's archive: no turn id
        return (
            isinstance(e, MessageSaved)
            and e.message.meta.input_id == "c"
            and e.message.meta.turn_id is None
        )

    archive = next(e for e in events if loose(e))
    never = _renumbered([e for e in events if not loose(e)])
    twice = _renumbered([*events, archive])
    again = _renumbered([*events, InputReleased(input_id="c", reason="mute", archived=True)])
    for log in (never, twice, again):
        found = _findings(log, [])["release_archive"]
        assert len(found) == 1 and found[0].startswith("c:"), found


def test_a_model_call_with_neither_its_end_nor_its_turns_record_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, _ = session
    first = next(e for e in events if isinstance(e, TurnOpened)).turn_id

    def cut(e: SessionEvent) -> bool:
        return isinstance(e, ModelCallEnded | TurnRecorded) and e.turn_id == first

    cut_log = _renumbered([e for e in events if not cut(e)])
    found = audit_log(cut_log, settled=True)["call_unended"]
    assert found and all(first in f for f in found), found
    assert audit_log(cut_log, settled=False)["call_unended"] == []


def test_a_tool_call_left_unfinished_by_a_turn_not_cut_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, _ = session
    first = next(e for e in events if isinstance(e, ToolFinished))
    unfinished = _renumbered([e for e in events if e is not first])
    found = audit_log(unfinished)["call_unended"]
    assert len(found) == 1 and first.call_id in found[0], found
    # A turn a crash cut may leave it so: not a finding.
    cut = [
        msgspec.structs.replace(e, reason="crash")
        if isinstance(e, TurnRecorded) and e.turn_id == first.turn_id
        else e
        for e in unfinished
    ]
    assert audit_log(cut)["call_unended"] == []


def test_inputs_of_a_turn_deleted_before_it_archived_them_are_answered_not_lost() -> None:
    """A turn whose inputs are archived by its runner (an ``agent:turn:before``
    middleware runs first), deleted while that middleware runs: the deletion writes
    nothing more for it (DEL1), so its input is never archived; the turn's record
    (aborted, reason delete) answers it, and sent again it is answered so. The audit
    counted such an input lost (seed 303 of the kill loop, 3 of 442 inputs)."""
    store = InMemoryEventStore()
    entered, go = threading.Event(), threading.Event()

    def before(ctx: Any, next_: Callable[[], Any]) -> Any:
        entered.set()
        go.wait(10)
        return next_()

    hooks = Hooks()
    hooks.use("agent:turn:before", before)
    services = Services(llm=ScriptedModel(tool_then_reply("t")), tools=ToolRegistry([]))
    runtime = Runtime(store, services, hooks=hooks, janitor=False)
    try:
        handle = runtime.submit(SID, Input(id="a", content="hi"))
        assert entered.wait(10)
        deleting = threading.Thread(target=runtime.delete, args=(SID,), kwargs={"timeout": 10})
        deleting.start()
        assert wait_until(lambda: any(isinstance(e, StopRequested) for e in store.read(SID)), 10)
        go.set()
        deleting.join(10)
        outcome = handle.result(10)
        again = runtime.submit(SID, Input(id="a", content="hi"))
        events = store.read(SID)
    finally:
        go.set()
        runtime.shutdown(timeout=10)
    assert (outcome.outcome, outcome.reason) == ("aborted", "delete")
    assert again.where == "handled" and again.result(0) == outcome
    assert not any(isinstance(e, MessageSaved) for e in events)  # never archived
    resent = [{"id": "a", "where": "handled", **_answer(outcome)}]
    report = audit_log(events, acked=["a"], resends=resent)
    assert report == {k: [] for k in report}


def test_an_input_put_back_from_a_stopped_turn_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]],
) -> None:
    events, _ = session
    stopped = next(e for e in events if isinstance(e, StopRequested)).turn_id
    undone = _renumbered([*events, InputRequeued(input_id="b", turn_id=stopped, reason="crash")])
    found = audit_log(undone)["stop_undone"]
    assert found == [f"b: put back from {stopped}, which was stopped"]


@pytest.mark.parametrize("kind", ["delete", "clear"])
def test_a_deletion_or_clear_begun_and_never_finished_is_found(
    session: tuple[list[SessionEvent], list[dict[str, Any]]], kind: str
) -> None:
    """A log that ends with a deletion's (a clear's) release and not its
    ``SessionDeleted`` (``ContextCleared`` of the context) after the last start: the
    next start would delete (clear) the session again. A clear of other kinds does not
    finish a clear of the context; an unsettled log (a kill may land between the two
    commits) is not judged."""
    events, _ = session
    begun = [
        InputReceived(input=Input(id="e", content="late")),
        InputReleased(input_id="e", reason=kind),  # type: ignore[arg-type]
    ]
    cut = _renumbered([*events, *begun])
    assert _findings(cut, []) == {
        **{k: [] for k in _findings(events, [])},
        "wind_down_unfinished": [f"a {kind} (kinds []) begun in the log, never finished"],
    }
    assert audit_log(cut, settled=False)["wind_down_unfinished"] == []
    if kind == "clear":
        other = _renumbered([*cut, ContextCleared(kinds=("memory",))])
        assert len(audit_log(other)["wind_down_unfinished"]) == 1
    end = ContextCleared(kinds=("context",)) if kind == "clear" else SessionDeleted(generation=1)
    assert audit_log(_renumbered([*cut, end]))["wind_down_unfinished"] == []
