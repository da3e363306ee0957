"""Tests of the folds in ``projections``: incremental equals whole, old states stay put,
what the turns and queue projections report, complete handler tables, and ``Chain``.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from itertools import pairwise
from types import ModuleType
from typing import Any

import pytest
from aalis_agent.events import FixedClock, InMemoryEventStore
from aalis_agent.events.batch import Batch
from aalis_agent.events.schema import (
    ChatMessage,
    ContextCleared,
    Event,
    HostNotice,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageMeta,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    StopMarkerSaved,
    StopRequested,
    TokenUsage,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
)
from aalis_agent.projections import SessionView, evolve, history, project, queue, turns
from aalis_agent.projections._dispatch import EVENT_TYPES, check_complete, keep
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.history import HistoryState
from aalis_agent.projections.queue import QueueState, RunningTurn
from aalis_agent.projections.turns import TurnsState, turn_info
from aalis_agent.testing.sample import synthetic_turn, write_demo_session
from hypothesis import given, settings
from hypothesis import strategies as st

SID = "s-proj"
NOW = 1_767_225_600_000
ALL_EVENT_TYPES: frozenset[type] = frozenset(typing.get_args(SessionEvent))
MODULES: tuple[tuple[str, ModuleType, type], ...] = (
    ("history", history, HistoryState),
    ("turns", turns, TurnsState),
    ("queue", queue, QueueState),
)


# --- a random log ---------------------------------------------------------------------


class LogBuilder:
    """Writes a plausible log op by op, in one batch, deterministically."""

    def __init__(self) -> None:
        self.batch = Batch(SID, 0, now_ms=NOW)
        self.k = 0
        self.turn_n = 0
        self.current: str | None = None
        self.call_index = 0
        self.waiting: list[str] = []
        self.known: list[str] = []  # every input id received, in order
        self.generation = 0

    def _next(self, prefix: str) -> str:
        self.k += 1
        return f"{prefix}{self.k}"

    def _turn(self) -> str:
        return self.current or "turn-ghost"

    def _user(self, inp: Input, turn_id: str | None) -> ChatMessage:
        return ChatMessage(
            id=f"msg-{inp.id}",
            role="user",
            content=inp.content,
            meta=MessageMeta(turn_id=turn_id, input_id=inp.id),
        )

    def _receive(self, source: str | None) -> Input:
        inp = Input(id=self._next("x"), content="hello", source=source)
        self.batch.add(InputReceived(input=inp, generation=self.generation))
        self.known.append(inp.id)
        return inp

    def _known(self, n: int) -> str:
        return self.known[n % len(self.known)] if self.known else "x-unknown"

    def apply(self, op: tuple[Any, ...]) -> None:
        b = self.batch
        name = op[0]
        if name == "turn":
            self.turn_n += 1
            synthetic_turn(b, self.turn_n, settings=TurnSettings(history_limit=op[1]))
            self.current = None
        elif name == "open":
            inp = self._receive(op[1])
            turn_id = self._next("o")
            b.add(InputJoined(input_id=inp.id, turn_id=turn_id, entry="opened"))
            b.add(TurnOpened(turn_id=turn_id, input_ids=(inp.id,), source=op[1]))
            b.add(MessageSaved(message=self._user(inp, turn_id)))
            self.current, self.call_index = turn_id, 0
        elif name == "call":
            self.call_index += 1
            b.add(ModelCallStarted(turn_id=self._turn(), index=self.call_index))
            b.add(
                ModelCallEnded(
                    turn_id=self._turn(), index=self.call_index, status=op[2], tool_calls=op[1]
                )
            )
        elif name == "tool":
            call_id = self._next("call-x")
            tc = ToolCall(id=call_id, name="search", arguments='{"q": 1}')
            b.add(ToolStarted(turn_id=self._turn(), call_id=call_id, name="search"))
            b.add(
                ToolFinished(
                    turn_id=self._turn(),
                    call_id=call_id,
                    name="search",
                    result=None if op[1] else "found",
                    error="boom" if op[1] else None,
                )
            )
            meta = MessageMeta(turn_id=self.current)
            b.add(
                MessageSaved(
                    message=ChatMessage(
                        id=f"m-{call_id}", role="assistant", tool_calls=(tc,), meta=meta
                    )
                )
            )
            b.add(
                MessageSaved(
                    message=ChatMessage(
                        id=f"m-{call_id}-r",
                        role="tool",
                        tool_call_id=call_id,
                        content="r",
                        meta=meta,
                    )
                )
            )
        elif name == "stop":
            b.add(StopRequested(turn_id=self._turn(), by=op[1]))
        elif name == "wind":
            # A deletion or clear begun (winding_down): its stop of the running turn, or
            # its release of an input received, with a clear's kinds.
            if op[3]:
                b.add(StopRequested(turn_id=self._turn(), reason=op[1], kinds=op[2]))
            else:
                inp = self._receive(None)
                b.add(InputReleased(input_id=inp.id, reason=op[1], kinds=op[2]))
        elif name == "marker":
            marker = ChatMessage(
                id=self._next("stop"),
                role="system",
                kind="turn-stopped",
                content="[stopped]",
                meta=MessageMeta(turn_id=self.current),
            )
            b.add(StopMarkerSaved(turn_id=self._turn(), message=marker))
        elif name == "record":
            b.add(TurnRecorded(turn_id=self._turn(), outcome=op[1], duration_ms=self.k))
            self.current = None
        elif name == "input":
            fate = op[1]
            inp = self._receive("schedule" if op[2] else None)
            if fate == "queued":
                b.add(InputQueued(input_id=inp.id))
                self.waiting.append(inp.id)
            elif fate == "held":
                b.add(InputHeld(input_id=inp.id, turn_id=self._turn()))
                self.waiting.append(inp.id)
            elif fate == "joined":
                b.add(InputJoined(input_id=inp.id, turn_id=self._turn(), entry="joined"))
                b.add(MessageSaved(message=self._user(inp, self.current)))
            elif fate == "released":
                b.add(InputReleased(input_id=inp.id, reason="mute"))
        elif name == "release_waiting":
            if self.waiting:
                b.add(InputReleased(input_id=self.waiting.pop(0), reason="stop-all", archived=True))
        elif name == "join_waiting":
            for input_id in self.waiting[: op[1]]:
                b.add(InputJoined(input_id=input_id, turn_id=self._turn(), entry="joined"))
                inp = Input(id=input_id, content="hello")
                b.add(MessageSaved(message=self._user(inp, self.current)))
            del self.waiting[: op[1]]
        elif name == "again":
            if self.waiting:
                inp = Input(id=self.waiting[-1 if op[1] else 0], content="again")
                b.add(InputReceived(input=inp, generation=self.generation))
                b.add(InputHeld(input_id=inp.id, turn_id=self._turn()))
        elif name == "flood":
            # A run of inputs submitted while a turn runs, each held for it (or queued):
            # long enough for ``Step.add_all`` to fold it together.
            for _ in range(op[1]):
                inp = self._receive(None)
                if op[2]:
                    b.add(InputHeld(input_id=inp.id, turn_id=self._turn()))
                else:
                    b.add(InputQueued(input_id=inp.id))
                self.waiting.append(inp.id)
        elif name == "release_all":
            # Every waiting input released (a stop-all, a mute, a deletion), archived or
            # not, and (op[2]) the archived ones archived right after, as a turn's end
            # archives them; an id waiting twice is released twice.
            released = list(self.waiting)
            for input_id in released:
                reason = "stop-all" if op[1] else "delete"
                b.add(InputReleased(input_id=input_id, reason=reason, archived=op[1]))
            self.waiting.clear()
            if op[1] and op[2]:
                for input_id in released:
                    inp = Input(id=input_id, content="hello")
                    b.add(MessageSaved(message=self._user(inp, None)))
        elif name == "queue_waiting":
            # Every waiting input queued, in order (a final call's end, a turn settling):
            # a pending one moves to the queue, a queued one to its end.
            for input_id in self.waiting:
                b.add(InputQueued(input_id=input_id))
        elif name == "held_elsewhere":
            # Held for a turn other than the running one (a log written by another
            # version, or a turn cut meanwhile): it joins no turn but its own.
            inp = self._receive(None)
            b.add(InputHeld(input_id=inp.id, turn_id=f"{self._turn()}-other"))
            self.waiting.append(inp.id)
        elif name == "join_known":
            # A run of joins of any inputs ever received (waiting, joined already,
            # released, or under a turn that is not running), some in the arrived list.
            turn_id = self._turn() if op[3] else "turn-ghost"
            if op[4]:
                self._receive(None)
            for k in range(op[2]):
                input_id = self._known(op[1] + k)
                b.add(InputJoined(input_id=input_id, turn_id=turn_id, entry="joined"))
                if op[3]:
                    inp = Input(id=input_id, content="hello")
                    b.add(MessageSaved(message=self._user(inp, self.current)))
        elif name == "requeue":
            # Recovery puts an input of the cut turn back at the head of the queue.
            turn_id = self._turn() if op[2] else "turn-ghost"
            input_id = self._known(op[1])
            b.add(InputRequeued(input_id=input_id, turn_id=turn_id))
            self.waiting.append(input_id)
        elif name == "settings":
            b.add(SettingsChanged(key=op[1], value=op[2], reset=op[3], by="u1"))
        elif name == "deleted":
            self.generation += 1
            b.add(SessionDeleted(generation=self.generation))
        elif name == "cleared":
            b.add(ContextCleared(kinds=op[1]))
        elif name == "control":
            message = ChatMessage(id=self._next("ctl"), role="system", kind=op[1], content="c")
            b.add(MessageSaved(message=message))
        elif name == "message":
            message = ChatMessage(
                id=self._next("plain"),
                role=op[1],
                content="text",
                meta=MessageMeta(turn_id=self.current),
            )
            b.add(MessageSaved(message=message))
        else:  # pragma: no cover - the strategy makes only the ops above
            raise AssertionError(op)


OPS = st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 4)),
    st.tuples(st.just("open"), st.sampled_from([None, None, "schedule"])),
    st.tuples(
        st.just("call"), st.integers(0, 2), st.sampled_from(["ok", "ok", "error", "aborted"])
    ),
    st.tuples(st.just("tool"), st.booleans()),
    st.tuples(st.just("stop"), st.sampled_from([None, "u1"])),
    st.tuples(
        st.just("wind"),
        st.sampled_from(["delete", "clear"]),
        st.sampled_from([(), ("context",), ("memory",), ("context", "memory")]),
        st.booleans(),
    ),
    st.tuples(st.just("marker")),
    st.tuples(st.just("record"), st.sampled_from(["replied", "silent", "aborted", "error"])),
    st.tuples(
        st.just("input"),
        st.sampled_from(["queued", "held", "joined", "released", "none"]),
        st.booleans(),
    ),
    st.tuples(st.just("release_waiting")),
    # Waiting inputs joining the current turn (the first k, as an insertion point takes
    # them), and one received again under a waiting input's id and held (a log written by
    # hand or by another tool: two waiting under one id).
    st.tuples(st.just("join_waiting"), st.integers(1, 20)),
    st.tuples(st.just("again"), st.booleans()),
    st.tuples(st.just("held_elsewhere")),
    st.tuples(st.just("flood"), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("queue_waiting")),
    st.tuples(st.just("release_all"), st.booleans(), st.booleans()),
    st.tuples(
        st.just("join_known"),
        st.integers(0, 50),
        st.integers(1, 20),
        st.booleans(),
        st.booleans(),
    ),
    st.tuples(st.just("requeue"), st.integers(0, 50), st.booleans()),
    st.tuples(
        st.just("settings"),
        st.sampled_from(["model", "historyLimit", "persona"]),
        st.integers(0, 5),
        st.booleans(),
    ),
    st.tuples(st.just("deleted")),
    st.tuples(
        st.just("cleared"), st.sampled_from([(), ("context",), ("memory",), ("memory", "context")])
    ),
    st.tuples(st.just("control"), st.sampled_from(["compaction", "notice", "turn-record"])),
    st.tuples(st.just("message"), st.sampled_from(["user", "assistant"])),
)


def build_log(ops: Sequence[tuple[Any, ...]]) -> list[SessionEvent]:
    builder = LogBuilder()
    for op in ops:
        builder.apply(op)
    return builder.batch.events


def fold_in_chunks(events: Sequence[SessionEvent], bounds: Sequence[int]) -> list[SessionView]:
    """Fold chunk by chunk; the view after each chunk."""
    views = []
    view = SessionView()
    for lo, hi in pairwise(bounds):
        view = project(events[lo:hi], view)
        views.append(view)
    return views


# --- (a, b) incremental folds ---------------------------------------------------------


@settings(max_examples=60)
@given(ops=st.lists(OPS, max_size=30), data=st.data())
def test_incremental_fold_equals_whole_fold(
    ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    events = build_log(ops)
    cuts = data.draw(st.lists(st.integers(0, len(events)), max_size=8), label="cuts")
    bounds = [0, *sorted(set(cuts)), len(events)]
    whole = project(events)
    assert whole.seq == len(events)
    assert whole.session_id == (SID if events else None)

    views = fold_in_chunks(events, bounds)
    assert views[-1] == whole

    one_by_one = SessionView()
    for event in events:
        one_by_one = evolve(one_by_one, event)
    assert one_by_one == whole

    for name, module, _ in MODULES:
        expected = getattr(whole, name)
        assert module.project(events) == expected
        state = None
        for lo, hi in pairwise(bounds):
            state = module.project(events[lo:hi], state)
        assert state == expected
        state = module.project(())
        for event in events:
            state = module.evolve(state, event)
        assert state == expected

    # (b) Later folds never change a view already returned.
    for hi, view in zip(bounds[1:], views, strict=True):
        assert view == project(events[:hi])


@settings(max_examples=50)
@given(
    common=st.lists(OPS, max_size=15),
    left=st.lists(OPS, min_size=1, max_size=10),
    right=st.lists(OPS, min_size=1, max_size=10),
)
def test_folding_two_branches_from_one_view_leaves_both_intact(
    common: list[tuple[Any, ...]], left: list[tuple[Any, ...]], right: list[tuple[Any, ...]]
) -> None:
    cut = len(build_log(common))
    left_log = build_log(common + left)
    right_log = build_log(common + right)
    assert left_log[:cut] == right_log[:cut]

    middle = project(left_log[:cut])
    left_end = project(left_log[cut:], middle)  # extends the shared chains in place
    right_end = project(right_log[cut:], middle)  # must copy, not overwrite
    again = project(left_log[cut:], middle)

    assert middle == project(left_log[:cut])
    assert left_end == project(left_log)
    assert right_end == project(right_log)
    assert again == left_end
    # And a view folded from a *newer* view does not disturb the older branch either.
    further = project(right_log[cut:], left_end)
    assert left_end == project(left_log)
    assert further == project(left_log + right_log[cut:])


def test_old_views_are_unchanged_by_later_folds_of_the_demo() -> None:
    events = write_demo_session(InMemoryEventStore(), "demo", FixedClock())
    views = []
    view = SessionView()
    for event in events:
        view = evolve(view, event)
        views.append(view)
    for i, old in enumerate(views):
        fresh = project(events[: i + 1])
        assert old == fresh
        assert len(old.history.messages) == len(fresh.history.messages)
        assert len(old.turns.finished) == len(fresh.turns.finished)


def test_settings_are_set_reset_and_dropped_by_deletion() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(SettingsChanged(key="historyLimit", value=10))
    b.add(SettingsChanged(key="persona", value="cat"))
    first = project(b.events)
    assert dict(first.settings) == {"historyLimit": 10, "persona": "cat"}
    b2 = Batch(SID, b.last_seq, now_ms=NOW)
    b2.add(SettingsChanged(key="persona", reset=True))
    b2.add(SettingsChanged(key="historyLimit", value=4))
    second = project(b2.events, first)
    assert dict(second.settings) == {"historyLimit": 4}
    assert dict(first.settings) == {"historyLimit": 10, "persona": "cat"}
    with pytest.raises(TypeError):
        second.settings["x"] = 1  # type: ignore[index]
    b3 = Batch(SID, b2.last_seq, now_ms=NOW)
    b3.add(SessionDeleted(generation=1))
    assert dict(project(b3.events, second).settings) == {}
    assert project(b3.events, second).seq == b3.last_seq


# --- (c) turns ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> tuple[list[SessionEvent], SessionView]:
    events = write_demo_session(InMemoryEventStore(), "demo", FixedClock(step_ms=5))
    return events, project(events)


def _event(events: Sequence[SessionEvent], kind: type, **match: Any) -> Any:
    found = [
        e
        for e in events
        if isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items())
    ]
    assert len(found) == 1, (kind, match, found)
    return found[0]


def test_demo_turns_are_listed_in_order(demo: tuple[list[SessionEvent], SessionView]) -> None:
    _, view = demo
    assert view.turns.current is None
    logs = turns.all_turns(view.turns)
    assert [t.turn_id for t in logs] == ["turn-1", "turn-2", "turn-3", "turn-4"]
    found = turns.find_turn(view.turns, "turn-2")
    assert found is not None and found.turn_id == "turn-2"
    assert turns.find_turn(view.turns, "turn-9") is None


def test_demo_turn_inputs_report_entry_modes(demo: tuple[list[SessionEvent], SessionView]) -> None:
    _, view = demo
    inputs = {t.turn_id: turn_info(t).inputs for t in turns.all_turns(view.turns)}
    assert inputs == {
        "turn-1": (("in-1", "opened"), ("in-2", "joined")),
        "turn-2": (("in-3", "opened"),),
        "turn-3": (("in-4", "opened"),),
        "turn-4": (("in-5", "opened"),),
    }


def test_writers_open_a_turn_before_its_opening_input_joins(
    demo: tuple[list[SessionEvent], SessionView],
) -> None:
    # The turns projection attributes an InputJoined only to the turn in flight, so the
    # writers put TurnOpened first; an opening input joined before it would be lost.
    b = Batch(SID, 0, now_ms=NOW)
    synthetic_turn(b, 1)
    logs = [b.events, demo[0]]
    for events in logs:
        opened_at = {e.turn_id: e.seq for e in events if isinstance(e, TurnOpened)}
        joins = [e for e in events if isinstance(e, InputJoined)]
        assert joins
        for join in joins:
            assert opened_at[join.turn_id] < join.seq
    log = turns.project(b.events).finished[0]
    assert turn_info(log).inputs == (("in-1", "opened"),)


def test_demo_turn_model_and_tool_calls(demo: tuple[list[SessionEvent], SessionView]) -> None:
    events, view = demo
    info = {t.turn_id: turn_info(t) for t in turns.all_turns(view.turns)}

    t1 = info["turn-1"]
    assert t1.opened_seq == _event(events, TurnOpened, turn_id="turn-1").seq
    assert t1.source is None and t1.human_opened and not t1.from_queue
    assert t1.platform == "qq"
    assert t1.settings.history_limit == 20
    assert [(c.index, c.status, c.tool_calls, c.model) for c in t1.model_calls] == [
        (1, "ok", 1, "demo/scripted"),
        (2, "ok", 0, "demo/scripted"),
    ]
    [tool] = t1.tool_calls
    assert (tool.call_id, tool.name, tool.arguments) == ("call-1", "weather", '{"city": "上海"}')
    assert tool.result == "明天上海多云,14 到 21 度。" and tool.error is None
    assert tool.started_at == _event(events, ToolStarted, call_id="call-1").at
    assert tool.ended_at == _event(events, ToolFinished, call_id="call-1").at
    assert tool.ended_at > tool.started_at
    assert t1.replies_saved == 1
    assert (t1.outcome, t1.reason, t1.duration_ms) == ("replied", None, 2310)
    assert t1.recorded_seq == _event(events, TurnRecorded, turn_id="turn-1").seq
    assert not t1.stop_requested and not t1.stop_marker

    t2 = info["turn-2"]
    assert t2.source == "schedule" and not t2.human_opened and t2.from_queue
    [bad] = t2.tool_calls
    assert (bad.call_id, bad.name, bad.arguments, bad.result) == ("call-2", "remind", "{}", None)
    assert bad.error is not None and bad.error.startswith("参数不是合法的 JSON 对象")
    assert [c.status for c in t2.model_calls] == ["ok", "ok"]
    assert (t2.outcome, t2.duration_ms, t2.replies_saved) == ("replied", 1640, 1)


def test_demo_stopped_turn(demo: tuple[list[SessionEvent], SessionView]) -> None:
    events, view = demo
    log = turns.find_turn(view.turns, "turn-3")
    assert log is not None
    t3 = turn_info(log)
    assert t3.stop_requested and t3.stop_marker
    assert (t3.stopped_by, t3.stop_reason) == ("10001", "stop")
    assert [(c.index, c.status) for c in t3.model_calls] == [(1, "aborted")]
    assert t3.tool_calls == ()
    assert t3.replies_saved == 0
    assert (t3.outcome, t3.reason, t3.duration_ms) == ("aborted", "stop", 420)
    marker = _event(events, StopMarkerSaved, turn_id="turn-3")
    assert marker in list(log.events)
    # Turn 4 neither stopped nor ran a tool.
    t4 = turn_info(turns.all_turns(view.turns)[3])
    assert not t4.stop_marker and t4.tool_calls == () and t4.duration_ms == 980


def test_a_turn_in_flight_and_a_turn_cut_off_without_a_record() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(TurnOpened(turn_id="t1", input_ids=()))
    b.add(ModelCallStarted(turn_id="t1", index=1))
    b.add(ModelCallStarted(turn_id="other", index=7))  # not the current turn: ignored
    state = turns.project(b.events)
    assert state.current is not None and state.current.turn_id == "t1"
    running = turn_info(state.current)
    assert running.outcome is None and running.duration_ms is None
    assert [(c.index, c.status) for c in running.model_calls] == [(1, None)]

    b2 = Batch(SID, b.last_seq, now_ms=NOW)
    b2.add(TurnOpened(turn_id="t2", input_ids=()))
    b2.add(TurnRecorded(turn_id="t1", outcome="error"))  # t1 is no longer current
    after = turns.project(b2.events, state)
    assert [t.turn_id for t in after.finished] == ["t1"]
    assert after.finished[0].record is None
    assert after.current is not None and after.current.turn_id == "t2"
    assert [t.turn_id for t in turns.all_turns(after)] == ["t1", "t2"]


# --- (d) queue ------------------------------------------------------------------------


def _inp(input_id: str, source: str | None = None) -> Input:
    return Input(id=input_id, content=f"text {input_id}", source=source)


def test_queue_reports_queued_and_pending_inputs_in_arrival_order() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(TurnOpened(turn_id="t1", input_ids=()))
    b.add(InputReceived(input=_inp("q1", "schedule")))
    b.add(InputReceived(input=_inp("h1")))
    b.add(InputHeld(input_id="h1", turn_id="t1"))  # placed before q1 is
    b.add(InputQueued(input_id="q1"))
    b.add(InputReceived(input=_inp("q2")))
    b.add(InputQueued(input_id="q2"))
    b.add(InputReceived(input=_inp("h2")))
    b.add(InputHeld(input_id="h2", turn_id="t1"))
    state = queue.project(b.events)
    waiting = queue.waiting(state)
    assert [w.input.id for w in waiting] == ["q1", "h1", "q2", "h2"]
    assert [w.held_for for w in waiting] == [None, "t1", None, "t1"]
    assert [w.input.id for w in state.queued] == ["q1", "q2"]
    assert [w.input.id for w in state.pending] == ["h1", "h2"]
    assert state.arrived == ()
    assert [w.arrival for w in waiting] == sorted(w.arrival for w in waiting)

    b2 = Batch(SID, b.last_seq, now_ms=NOW)
    b2.add(InputJoined(input_id="h1", turn_id="t1", entry="joined"))
    b2.add(InputReleased(input_id="q2", reason="mute"))
    b2.add(InputQueued(input_id="h2"))  # a pending input moved back to the queue
    after = queue.project(b2.events, state)
    assert [(w.input.id, w.held_for) for w in queue.waiting(after)] == [
        ("q1", None),
        ("h2", None),
    ]
    assert [w.input.id for w in queue.waiting(state)] == ["q1", "h1", "q2", "h2"]


def test_received_inputs_wait_in_arrived_until_placed() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(InputReceived(input=_inp("a"), generation=3))
    state = queue.project(b.events)
    assert [(w.input.id, w.generation) for w in state.arrived] == [("a", 3)]
    assert queue.waiting(state) == []
    b2 = Batch(SID, b.last_seq, now_ms=NOW)
    b2.add(InputJoined(input_id="a", turn_id="t", entry="opened"))
    assert queue.project(b2.events, state).arrived == ()


def _running(*adds: tuple[type, dict[str, Any]], source: str | None = None) -> RunningTurn:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(TurnOpened(turn_id="t1", input_ids=("i1",), source=source))
    for kind, fields in adds:
        b.add(kind(**fields))
    state = queue.project(b.events)
    assert state.running is not None
    return state.running


def test_a_human_turn_accepts_inserts_until_its_final_call_returns() -> None:
    assert _running().accepts_inserts
    assert _running(
        (ModelCallEnded, {"turn_id": "t1", "index": 1, "tool_calls": 2})
    ).accepts_inserts
    final = _running((ModelCallEnded, {"turn_id": "t1", "index": 1, "tool_calls": 0}))
    assert final.final_call_returned and not final.accepts_inserts
    other = _running((ModelCallEnded, {"turn_id": "t0", "index": 1, "tool_calls": 0}))
    assert other.accepts_inserts


def test_a_stop_request_ends_inserts() -> None:
    stopped = _running((StopRequested, {"turn_id": "t1", "by": "u1"}))
    assert stopped.stop_requested and not stopped.accepts_inserts
    assert _running((StopRequested, {"turn_id": "t0"})).accepts_inserts


def test_an_injection_opened_turn_never_accepts_inserts() -> None:
    running = _running(source="schedule")
    assert running.source == "schedule" and not running.accepts_inserts


def test_a_recorded_turn_is_no_longer_running() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    b.add(TurnOpened(turn_id="t1", input_ids=()))
    b.add(TurnRecorded(turn_id="t0", outcome="replied"))
    assert queue.project(b.events).running is not None
    b.add(TurnRecorded(turn_id="t1", outcome="replied"))
    assert queue.project(b.events).running is None


def test_session_deleted_bumps_the_generation() -> None:
    b = Batch(SID, 0, now_ms=NOW)
    assert queue.project(b.events).generation == 0
    b.add(SessionDeleted(generation=1))
    first = queue.project(b.events)
    assert first.generation == 1
    b.add(SessionDeleted(generation=2))
    assert queue.project(b.events).generation == 2
    assert project(b.events).queue.generation == 2
    assert first.generation == 1


def test_demo_queue_while_turn_one_runs(demo: tuple[list[SessionEvent], SessionView]) -> None:
    events, view = demo
    held = _event(events, InputHeld, input_id="in-2")
    at_hold = project(events[: held.seq])
    assert [(w.input.id, w.held_for) for w in queue.waiting(at_hold.queue)] == [("in-2", "turn-1")]
    running = at_hold.queue.running
    assert running is not None and running.turn_id == "turn-1" and running.accepts_inserts
    queued = _event(events, InputQueued, input_id="in-3")
    at_queue = project(events[: queued.seq])
    assert [(w.input.id, w.held_for) for w in queue.waiting(at_queue.queue)] == [("in-3", None)]
    assert queue.waiting(view.queue) == [] and view.queue.running is None


# --- (e) handler tables ---------------------------------------------------------------


def sample_events(turn_id: str = "t1") -> list[Event]:
    """One event of every type, for a turn ``turn_id``."""
    inp = Input(id="i1", content="hi", host_notice=HostNotice(kind="k", id="n1"))
    meta = MessageMeta(turn_id=turn_id)
    b = Batch(SID, 0, now_ms=NOW)
    b.add(InputReceived(input=inp))
    b.add(InputQueued(input_id="i1"))
    b.add(InputHeld(input_id="i1", turn_id=turn_id))
    b.add(InputJoined(input_id="i1", turn_id=turn_id, entry="joined"))
    b.add(InputReleased(input_id="i1", reason="clear"))
    b.add(TurnOpened(turn_id=turn_id, input_ids=("i1",)))
    b.add(ModelCallStarted(turn_id=turn_id, index=1))
    b.add(ModelCallEnded(turn_id=turn_id, index=1, status="error", error="x"))
    b.add(MessageSaved(message=ChatMessage(id="m1", role="user", meta=meta)))
    b.add(ToolStarted(turn_id=turn_id, call_id="c1", name="n"))
    b.add(ToolFinished(turn_id=turn_id, call_id="c1", name="n", result="r"))
    b.add(UsageRecorded(usage=TokenUsage(session_id=SID, turn_id=turn_id)))
    b.add(StopRequested(turn_id=turn_id))
    b.add(InputRequeued(input_id="in-1", turn_id=turn_id))
    b.add(
        StopMarkerSaved(
            turn_id=turn_id,
            message=ChatMessage(id="m2", role="system", kind="turn-stopped", meta=meta),
        )
    )
    b.add(TurnRecorded(turn_id=turn_id, outcome="aborted"))
    b.add(SessionDeleted(generation=1))
    b.add(ContextCleared())
    b.add(SettingsChanged(key="k", value=[1, 2]))
    return list(b.events)


def test_sample_events_cover_every_event_type() -> None:
    assert {type(e) for e in sample_events()} == ALL_EVENT_TYPES
    assert EVENT_TYPES == ALL_EVENT_TYPES


@pytest.mark.parametrize(("name", "module", "state_type"), MODULES)
def test_handler_tables_are_complete(name: str, module: ModuleType, state_type: type) -> None:
    assert set(module.HANDLERS) == ALL_EVENT_TYPES


@pytest.mark.parametrize(("name", "module", "state_type"), MODULES)
def test_evolve_of_every_event_type_does_not_raise(
    name: str, module: ModuleType, state_type: type
) -> None:
    opened = module.project(sample_events()[:6])  # a turn t1 is running in turns/queue
    for start in (state_type(), opened):
        for event in sample_events():
            state = module.evolve(start, event)
            assert isinstance(state, state_type)
        for event in sample_events("t-other"):
            assert isinstance(module.evolve(start, event), state_type)
    view = SessionView()
    for event in sample_events():
        view = evolve(view, event)
    assert view.seq == len(ALL_EVENT_TYPES)


def test_keep_handlers_return_the_state_itself() -> None:
    state = QueueState(generation=4)
    assert queue.evolve(state, sample_events()[6]) is state  # ModelCallStarted
    assert keep(state, object()) is state


def test_check_complete_rejects_missing_and_extra_types() -> None:
    check_complete("ok", dict.fromkeys(ALL_EVENT_TYPES, keep))
    with pytest.raises(TypeError, match="SettingsChanged"):
        check_complete("missing", dict.fromkeys(ALL_EVENT_TYPES - {SettingsChanged}, keep))
    with pytest.raises(TypeError, match="int"):
        check_complete("extra", dict.fromkeys([*ALL_EVENT_TYPES, int], keep))


# --- (f) Chain ------------------------------------------------------------------------


def test_chain_append_leaves_the_original_unchanged() -> None:
    empty: Chain[int] = Chain()
    one = empty.append(1)
    two = one.append(2)
    assert list(empty) == [] and list(one) == [1] and list(two) == [1, 2]
    assert len(empty) == 0 and len(one) == 1 and len(two) == 2


def test_chain_append_to_the_newest_view_shares_the_list() -> None:
    one = Chain.of([1])
    two = one.append(2)
    three = two.append(3)
    assert two._items is one._items and three._items is one._items


def test_chain_append_to_an_older_view_copies_first() -> None:
    base = Chain.of([1, 2])
    newer = base.append(3)
    branch = base.append(30)  # base's list already holds 3: must not overwrite it
    assert list(newer) == [1, 2, 3]
    assert list(branch) == [1, 2, 30]
    assert list(base) == [1, 2]
    assert branch._items is not newer._items
    assert list(newer.append(4)) == [1, 2, 3, 4]
    assert list(branch.append(40)) == [1, 2, 30, 40]
    assert list(newer) == [1, 2, 3] and list(branch) == [1, 2, 30]


def test_chain_of_copies_its_input() -> None:
    source = [1, 2]
    chain = Chain.of(source)
    source.append(3)
    assert list(chain) == [1, 2]


def test_chain_indexing_and_slicing_stay_within_the_view() -> None:
    base = Chain.of([1, 2, 3])
    base.append(4)  # the shared list is longer than the view
    assert base[0] == 1 and base[-1] == 3 and base[-3] == 1
    with pytest.raises(IndexError):
        base[3]
    with pytest.raises(IndexError):
        base[-4]
    assert base[1:] == [2, 3]
    assert base[:] == [1, 2, 3]
    assert base[5:] == []
    assert base[0:3:2] == [1, 3]
    sliced = base[:]
    sliced.append(99)  # a slice is a new list
    assert list(base) == [1, 2, 3]
    assert base.to_list() == [1, 2, 3]
    assert list(reversed(base)) == [3, 2, 1]
    assert 3 in base and 4 not in base
    assert base.index(2) == 1 and base.count(1) == 1


SLICE_BOUNDS = (None, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("step", [None, 1, 2, -1, -2])
def test_chain_slices_match_list_slices(step: int | None) -> None:
    """A chain slices like the list of its items, whatever the step (it is a Sequence)."""
    items = [1, 2, 3, 4]
    chain = Chain.of(items)
    chain.append(5)  # the shared list is longer than the view
    wrong = [
        (start, stop, step, chain[start:stop:step], items[start:stop:step])
        for start in SLICE_BOUNDS
        for stop in SLICE_BOUNDS
        if chain[start:stop:step] != items[start:stop:step]
    ]
    assert wrong == []


def test_chain_equality_and_hash() -> None:
    a = Chain.of([1, 2])
    a_longer = a.append(3)
    b = Chain.of([1]).append(2)
    assert a == b and hash(a) == hash(b)
    assert a != a_longer
    assert a != Chain.of([1, 3])
    assert Chain() == Chain()
    assert a_longer == Chain([1, 2, 3, 4], 3)  # only the view's items count
    # As the tuples a view's sequences were: equal to a tuple or list of its items, and
    # hashed as that tuple.
    assert a == (1, 2) and a == [1, 2] and hash(a) == hash((1, 2))
    assert a != (1,) and a != (1, 3) and a_longer != [1, 2] and Chain() == ()
    assert (a == {1: 2}) is False
    assert repr(a) == "Chain([1, 2])"


@settings(max_examples=100)
@given(ops=st.lists(st.tuples(st.integers(0, 20), st.integers()), max_size=40))
def test_chain_views_behave_like_immutable_lists(ops: list[tuple[int, int]]) -> None:
    """Append to arbitrary earlier views; every view keeps exactly its own items."""
    views: list[tuple[Chain[int], list[int]]] = [(Chain(), [])]
    for pick, item in ops:
        chain, model = views[pick % len(views)]
        views.append((chain.append(item), [*model, item]))
    for chain, model in views:
        assert list(chain) == model
        assert chain.to_list() == model
        assert len(chain) == len(model)
        assert chain == Chain.of(model)


# --- (g) the combined fold -------------------------------------------------------------


def _reference(events: Sequence[SessionEvent], view: SessionView) -> SessionView:
    """What ``project`` must give: each projection's own handler fold, and the settings."""
    settings: dict[str, Any] = dict(view.settings)
    for event in events:
        if isinstance(event, SessionDeleted):
            settings = {}
        elif isinstance(event, SettingsChanged):
            if event.reset:
                settings.pop(event.key, None)
            else:
                settings[event.key] = event.value
    last = events[-1] if events else None
    return SessionView(
        last.session_id if last else view.session_id,
        last.seq if last else view.seq,
        history.project(events, view.history),
        turns.project(events, view.turns),
        queue.project(events, view.queue),
        settings,
    )


@settings(max_examples=80)
@given(ops=st.lists(OPS, max_size=30), data=st.data())
def test_project_folds_as_the_handler_tables_do(
    ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    """``project`` folds history and turns in one pass of its own: it must agree with the
    projections' handler tables from any view, and leave that view as it was."""
    events = build_log(ops)
    cut = data.draw(st.integers(0, len(events)), label="cut")
    start = project(events[:cut])
    before = project(events[:cut])
    got = project(events[cut:], start)
    want = _reference(events[cut:], start)
    assert (got.session_id, got.seq) == (want.session_id, want.seq)
    assert got.history == want.history
    assert got.turns == want.turns
    assert got.queue == want.queue
    assert dict(got.settings) == dict(want.settings)
    assert start == before  # the view folded from is untouched
    assert project((), start) is start


@settings(max_examples=60)
@given(ops=st.lists(OPS, max_size=30))
def test_the_head_of_the_queue_is_the_first_waiting(ops: list[tuple[Any, ...]]) -> None:
    """``queue.head`` (what opens the next turn) is the very input ``queue.waiting``
    puts first, however the inputs were queued, held and taken."""
    state = project(build_log(ops)).queue
    ordered = queue.waiting(state)
    assert queue.head(state) == (ordered[0] if ordered else None)
    assert queue.head(state) is (ordered[0] if ordered else None)


@settings(max_examples=80)
@given(ops=st.lists(OPS, max_size=40), data=st.data())
def test_a_step_adding_a_run_together_folds_as_adding_each(
    ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    """``Step.add_all`` (a run folded by ``project``) leaves the view and the batch that
    adding the events one by one (``evolve``) leaves, from any view: runs long enough to
    be folded together (16 and more) included."""
    from aalis_agent.actors.scheduler import Step

    events = build_log(ops)
    cut = data.draw(st.integers(0, len(events)), label="cut")
    start = project(events[:cut])
    rest = events[cut:]
    together = Step(start, Batch(SID, cut, now_ms=NOW))
    together.add_all(list(rest))
    each = Step(start, Batch(SID, cut, now_ms=NOW))
    for event in rest:
        each.add(event)
    assert together.events == each.events == rest
    assert together.view == each.view == project(events)


@given(
    st.lists(
        st.tuples(st.booleans(), st.booleans()),  # pending, put back by recovery
        max_size=40,
    ),
    st.randoms(use_true_random=False),
)
@settings(max_examples=200, deadline=None)
def test_waiting_lists_recovered_inputs_first_then_by_arrival(
    flags: list[tuple[bool, bool]], rnd: Any
) -> None:
    """``queue.waiting`` (what ``agent:queue`` reports) is the queued and pending inputs
    ordered by (put back by recovery first, then arrival), however each is stored."""
    from aalis_agent.events import Input
    from aalis_agent.projections.queue import Waiting

    arrivals = rnd.sample(range(1, 1000), len(flags))
    items = [
        Waiting(Input(id=f"in-{n}", content="x"), arrival, 0, "t" if held else None, front)
        for n, ((held, front), arrival) in enumerate(zip(flags, arrivals, strict=True))
    ]
    pending = [w for w in items if w.held_for]
    queued = [w for w in items if not w.held_for]
    rnd.shuffle(pending)
    rnd.shuffle(queued)
    state = QueueState(queued=tuple(queued), pending=tuple(pending))
    expected = sorted(items, key=lambda w: (not w.front, w.arrival))
    assert queue.waiting(state) == expected
    assert queue.head(state) == (expected[0] if expected else None)
