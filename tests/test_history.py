"""Tests of ``projections.history``: what is kept, what is active, and what is sent.

Example tests pin each rule (FLOW4, SET4) with exact message ids; property tests build
random histories from *units* appended atomically (a plain message, a complete or an
incomplete tool-call group, a stop marker, a control marker, a compaction separator) and
check the window arithmetic, prefix stability, group integrity and control kinds against
an independent reference model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from aalis_agent.events import FixedClock, InMemoryEventStore
from aalis_agent.events.batch import Batch
from aalis_agent.events.schema import (
    CONTROL_KINDS,
    ChatMessage,
    ContextCleared,
    InputReceived,
    MessageMeta,
    MessageSaved,
    ModelCallStarted,
    SessionDeleted,
    SessionEvent,
    StopMarkerSaved,
    ToolCall,
)
from aalis_agent.events.schema import Input as InputValue
from aalis_agent.projections import history
from aalis_agent.projections.history import (
    HistoryState,
    active_history,
    group_tool_calls,
    history_window,
    window_start,
)
from aalis_agent.services.memory import ProjectionMemory
from aalis_agent.testing.sample import write_demo_session
from hypothesis import given, settings
from hypothesis import strategies as st

SID = "s-history"
NOW = 1_767_225_600_000
STOP_KIND = "turn-stopped"


# --- helpers -------------------------------------------------------------------------


def msg(
    mid: str,
    role: str = "user",
    *,
    turn: str | None = None,
    kind: str | None = None,
    calls: Sequence[str] = (),
    result_of: str | None = None,
) -> ChatMessage:
    """A message; ``calls`` makes an assistant tool call, ``result_of`` a tool result."""
    return ChatMessage(
        id=mid,
        role=role,  # type: ignore[arg-type]
        content=f"content of {mid}",
        tool_calls=tuple(ToolCall(id=c, name="lookup", arguments="{}") for c in calls),
        tool_call_id=result_of,
        name="lookup" if result_of is not None else None,
        kind=kind,
        meta=MessageMeta(turn_id=turn, call_id=result_of),
    )


def call(mid: str, *call_ids: str, turn: str | None = None) -> ChatMessage:
    return msg(mid, "assistant", calls=call_ids, turn=turn)


def result(mid: str, call_id: str, turn: str | None = None) -> ChatMessage:
    return msg(mid, "tool", result_of=call_id, turn=turn)


def add_message(batch: Batch, message: ChatMessage) -> None:
    """Archive ``message`` as the session actor would: stop markers have their own event."""
    if message.kind == STOP_KIND:
        batch.add(StopMarkerSaved(turn_id=message.meta.turn_id or "turn-x", message=message))
    else:
        batch.add(MessageSaved(message=message))


def events_of(items: Iterable[ChatMessage | tuple[type, dict[str, Any]]]) -> list[SessionEvent]:
    """Events for messages and ``(EventType, fields)`` pairs, in order, in one batch."""
    batch = Batch(SID, 0, now_ms=NOW)
    for item in items:
        if isinstance(item, ChatMessage):
            add_message(batch, item)
        else:
            kind, fields = item
            batch.add(kind(**fields))
    return batch.events


def fold(*items: ChatMessage | tuple[type, dict[str, Any]]) -> HistoryState:
    return history.project(events_of(items))


def ids(messages: Iterable[ChatMessage]) -> list[str]:
    return [m.id for m in messages]


def encoded(messages: Iterable[ChatMessage]) -> bytes:
    """The messages as the bytes a provider request would carry them, concatenated."""
    return b"".join(msgspec.json.encode(m) for m in messages)


# --- example tests: one per rule ------------------------------------------------------


def test_history_keeps_conversational_messages_in_archive_order() -> None:
    state = fold(
        msg("u1"),
        msg("a1", "assistant"),
        msg("s1", "system"),
        msg("u2"),
        (InputReceived, {"input": InputValue(id="in-9", content="not archived")}),
        (ModelCallStarted, {"turn_id": "t", "index": 1}),
        msg("a2", "assistant"),
    )
    assert ids(state.messages) == ["u1", "a1", "s1", "u2", "a2"]
    assert ids(active_history(state)) == ["u1", "a1", "s1", "u2", "a2"]
    assert ids(history_window(state)) == ["u1", "a1", "s1", "u2", "a2"]


@pytest.mark.parametrize("control", sorted(CONTROL_KINDS - {"compaction"}))
def test_control_kinds_are_never_kept_sent_or_counted(control: str) -> None:
    with_marker = fold(
        msg("u1"), msg("r1", "system", kind=control), msg("a1", "assistant"), msg("u2")
    )
    without = fold(msg("u1"), msg("a1", "assistant"), msg("u2"))
    assert ids(with_marker.messages) == ["u1", "a1", "u2"]
    assert with_marker == without
    # The count the window works on ignores the marker: with N=2 (h=1) and A=3, start=1.
    assert ids(history_window(with_marker, 2)) == ["a1", "u2"]


def test_compaction_marker_moves_the_start_of_the_active_history_after_it() -> None:
    state = fold(
        msg("u1"),
        msg("a1", "assistant"),
        msg("sep", "system", kind="compaction"),
        msg("u2"),
        msg("a2", "assistant"),
    )
    assert ids(state.messages) == ["u1", "a1", "u2", "a2"]  # the marker itself is not kept
    assert state.active_from == 2
    assert ids(active_history(state)) == ["u2", "a2"]
    assert ids(history_window(state)) == ["u2", "a2"]
    assert ids(history_window(state, 1)) == ["a2"]


def test_a_second_compaction_moves_the_start_again() -> None:
    state = fold(
        msg("u1"),
        msg("sep1", "system", kind="compaction"),
        msg("u2"),
        msg("sep2", "system", kind="compaction"),
        msg("u3"),
    )
    assert ids(active_history(state)) == ["u3"]


def test_stop_marker_is_conversational_and_counts() -> None:
    state = fold(
        msg("u1", turn="t1"),
        msg("stop", "system", kind=STOP_KIND, turn="t1"),
        msg("rec", "system", kind="turn-record", turn="t1"),
        msg("u2", turn="t2"),
    )
    assert ids(state.messages) == ["u1", "stop", "u2"]
    assert ids(history_window(state)) == ["u1", "stop", "u2"]
    # It counts: A=3 with N=2 gives start=1, so the window starts at the marker.
    assert ids(history_window(state, 2)) == ["stop", "u2"]


@pytest.mark.parametrize("kinds", [(), ("context",), ("memory", "context")])
def test_context_cleared_empties_the_history(kinds: tuple[str, ...]) -> None:
    state = fold(
        msg("u1"),
        msg("sep", "system", kind="compaction"),
        msg("u2"),
        (ContextCleared, {"kinds": kinds}),
    )
    assert state == HistoryState()
    assert list(state.messages) == []
    assert history_window(state, 4) == []
    # What follows starts a fresh active history (the old compaction does not linger).
    after = history.project(
        events_of([msg("u3"), msg("a3", "assistant")]), state
    )  # seqs restart: the history ignores them
    assert ids(active_history(after)) == ["u3", "a3"]
    assert after.active_from == 0


def test_context_cleared_of_other_kinds_keeps_the_history() -> None:
    before = fold(msg("u1"), msg("a1", "assistant"))
    after = history.project(events_of([(ContextCleared, {"kinds": ("memory",)})]), before)
    assert after == before
    assert ids(history_window(after)) == ["u1", "a1"]


def test_session_deleted_empties_the_history() -> None:
    state = fold(
        msg("u1"),
        msg("sep", "system", kind="compaction"),
        msg("u2"),
        (SessionDeleted, {"generation": 1}),
    )
    assert state == HistoryState()
    after = history.project(events_of([msg("u3")]), state)
    assert ids(history_window(after)) == ["u3"]


def test_group_tool_calls_moves_messages_archived_inside_a_group_after_it() -> None:
    messages = [
        msg("u1"),
        call("call", "c1", "c2"),
        msg("u2"),  # archived between the call and its results
        result("r2", "c2"),
        msg("s", "system"),
        result("r1", "c1"),
        msg("a", "assistant"),
    ]
    assert ids(group_tool_calls(messages)) == ["u1", "call", "r2", "r1", "u2", "s", "a"]


def test_group_tool_calls_skips_a_call_missing_a_result_with_the_results_it_has() -> None:
    messages = [
        msg("u1"),
        call("call", "c1", "c2"),
        result("r1", "c1"),
        msg("a", "assistant"),
    ]
    assert ids(group_tool_calls(messages)) == ["u1", "a"]


def test_group_tool_calls_skips_a_result_without_its_call() -> None:
    messages = [
        result("orphan", "c9"),
        msg("u1"),
        result("early", "c1"),  # before its call: not a result of it
        call("call", "c1"),
        msg("a", "assistant"),
    ]
    assert ids(group_tool_calls(messages)) == ["u1", "a"]


def test_group_tool_calls_keeps_consecutive_and_interleaved_groups() -> None:
    messages = [
        call("g1", "c1"),
        call("g2", "c2"),
        result("r2", "c2"),
        result("r1", "c1"),
    ]
    assert ids(group_tool_calls(messages)) == ["g1", "r1", "g2", "r2"]


@pytest.mark.parametrize(
    ("active", "limit", "start"),
    [
        (0, 4, 0),
        (4, 4, 0),
        (5, 4, 2),
        (6, 4, 2),
        (7, 4, 4),
        (8, 4, 4),
        (9, 4, 6),
        (3, 3, 0),
        (4, 3, 2),
        (5, 3, 2),
        (6, 3, 4),
        (5, 1, 4),
        (100, 0, 0),
        (100, -1, 0),
    ],
)
def test_window_start_examples(active: int, limit: int, start: int) -> None:
    assert window_start(active, limit) == start


def test_history_limit_window_sends_the_tail_dropping_by_half_the_limit() -> None:
    messages = [msg(f"m{i}", "user" if i % 2 == 0 else "assistant") for i in range(7)]
    state = fold(*messages)
    # A=7, N=4, h=2: start = ceil(3/2)*2 = 4.
    assert ids(history_window(state, 4)) == ["m4", "m5", "m6"]
    assert ids(history_window(state, 0)) == [f"m{i}" for i in range(7)]
    assert ids(history_window(state, 7)) == [f"m{i}" for i in range(7)]
    assert len(state.messages) == 7  # dropped messages are only not sent


def test_window_start_inside_a_tool_group_drops_the_group_but_keeps_messages_inside() -> None:
    state = fold(
        msg("u0"),
        msg("a0", "assistant"),
        msg("u1"),
        call("call", "c1"),
        msg("inside"),  # archived between the call and its result
        result("r1", "c1"),
        msg("u2"),
        msg("a2", "assistant"),
    )
    # A=8, N=4, h=2: start = 4, just after the call.
    assert window_start(8, 4) == 4
    assert ids(history_window(state, 4)) == ["inside", "u2", "a2"]
    # With N=5 (h=3): start = 3, the call is in the window and the group goes whole.
    assert ids(history_window(state, 5)) == ["call", "r1", "inside", "u2", "a2"]


def test_window_start_on_a_tool_result_drops_the_call_with_its_results() -> None:  # SET4
    state = fold(
        msg("u0"),
        msg("a0", "assistant"),
        msg("u1"),
        call("call", "c1", "c2"),
        result("r1", "c1"),
        result("r2", "c2"),
        msg("u2"),
        msg("a2", "assistant"),
    )
    # A=8, N=4, h=2: start = 4, on the first result: the group head is not pulled back in.
    expected = ["u2", "a2"]
    assert ids(history_window(state, 4)) == expected
    # The memory a turn reads (FLOW4) gives the same window.
    assert ids(ProjectionMemory().window("s", state, 4, None)) == expected
    assert ProjectionMemory().count_history("s", state, None) == 8


def test_history_window_exclude_turn_leaves_out_that_turns_messages() -> None:
    state = fold(
        msg("u1", turn="t1"),
        msg("a1", "assistant", turn="t1"),
        msg("u2", turn="t2"),
        call("call", "c1", turn="t2"),
        result("r1", "c1", turn="t2"),
        msg("u3"),
    )
    assert ids(history_window(state, exclude_turn="t2")) == ["u1", "a1", "u3"]
    assert ids(history_window(state, exclude_turn="t1")) == ["u2", "call", "r1", "u3"]
    # The window is computed over what remains: A=3, N=2 -> start=1.
    assert ids(history_window(state, 2, exclude_turn="t2")) == ["a1", "u3"]
    assert ids(active_history(state, exclude_turn="t9")) == ids(active_history(state))


def test_demo_session_history_window() -> None:
    events = write_demo_session(InMemoryEventStore(), "demo", FixedClock())
    state = history.project(events)
    expected = [
        "msg-in-1-1",
        "msg-call-1",
        "msg-result-1",
        "msg-in-2-2",
        "msg-reply-1",
        "msg-in-3-3",
        "msg-call-2",
        "msg-result-2",
        "msg-reply-2",
        "msg-in-4-4",
        "msg-stop-3",
        "msg-in-5-5",
        "msg-reply-4",
    ]
    assert ids(history_window(state, 20)) == expected
    assert ids(history_window(state, 20, exclude_turn="turn-4")) == expected[:-2]
    # A=13, N=6, h=3: start=9, after the stop marker's turn opened.
    assert ids(history_window(state, 6)) == expected[9:]


# --- generated histories ----------------------------------------------------------------

TURNS = ("t1", "t2", "t3")
UNIT_KINDS = (
    "plain",
    "plain",
    "plain",
    "group",
    "group",
    "group",
    "incomplete",
    "stop",
    "control",
    "compaction",
)


@dataclass(frozen=True)
class Unit:
    """Messages appended atomically; ``kind`` says what they form."""

    kind: str
    messages: tuple[ChatMessage, ...]
    turn: str | None = None
    between: str | None = None  # id of a plain message archived inside a group

    @property
    def call(self) -> ChatMessage:
        return self.messages[0]

    @property
    def results(self) -> list[ChatMessage]:
        return [m for m in self.messages if m.role == "tool"]


@st.composite
def units(draw: st.DrawFn, index: int) -> Unit:
    """One unit; message and call ids are unique through ``index``."""
    kind = draw(st.sampled_from(UNIT_KINDS))
    turn = draw(st.sampled_from(TURNS))
    p = f"u{index}"
    if kind == "plain":
        role = draw(st.sampled_from(["user", "assistant"]))
        return Unit(kind, (msg(p, role, turn=turn),), turn)
    if kind == "stop":
        return Unit(kind, (msg(f"{p}.stop", "system", kind=STOP_KIND, turn=turn),), turn)
    if kind == "control":
        control = draw(st.sampled_from(["turn-record", "notice"]))
        return Unit(kind, (msg(f"{p}.{control}", "system", kind=control, turn=turn),), turn)
    if kind == "compaction":
        return Unit(kind, (msg(f"{p}.sep", "system", kind="compaction"),))
    n = draw(st.integers(1, 3))
    call_ids = [f"{p}.c{i}" for i in range(n)]
    order = draw(st.permutations(range(n)))
    if kind == "group":
        present = list(order)
    else:
        kept = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda k: not all(k)))
        present = [i for i in order if kept[i]]
    tail: list[ChatMessage] = [result(f"{p}.r{i}", call_ids[i], turn=turn) for i in present]
    between = None
    if draw(st.booleans()):
        # Strictly before at least one result of a complete group.
        top = len(tail) - 1 if kind == "group" else len(tail)
        at = draw(st.integers(0, max(top, 0)))
        role = draw(st.sampled_from(["user", "assistant", "system"]))
        between = f"{p}.mid"
        tail.insert(at, msg(between, role, turn=turn))
    return Unit(kind, (call(f"{p}.call", *call_ids, turn=turn), *tail), turn, between)


@st.composite
def unit_lists(draw: st.DrawFn, max_size: int = 30) -> list[Unit]:
    count = draw(st.integers(0, max_size))
    return [draw(units(i)) for i in range(count)]


def unit_events(unit: Unit, last_seq: int = 0) -> list[SessionEvent]:
    batch = Batch(SID, last_seq, now_ms=NOW)
    for message in unit.messages:
        add_message(batch, message)
    return batch.events


def fold_units(
    unit_list: Sequence[Unit], state: HistoryState | None = None
) -> tuple[HistoryState, list[HistoryState]]:
    """Fold unit by unit; also every state at a unit boundary (the first before any)."""
    state = HistoryState() if state is None else state
    boundaries = [state]
    seq = 0
    for unit in unit_list:
        events = unit_events(unit, seq)
        seq += len(events)
        state = history.project(events, state)
        boundaries.append(state)
    return state, boundaries


def reference_start(active: int, limit: int) -> int:
    """SET4 spelled out with ``math.ceil``."""
    if limit <= 0 or active <= limit:
        return 0
    half = math.ceil(limit / 2)
    return math.ceil((active - limit) / half) * half


def reference_window(
    unit_list: Sequence[Unit], limit: int, exclude_turn: str | None = None
) -> list[ChatMessage]:
    """What FLOW4/SET4 say is sent, computed from the units rather than the messages."""
    last_compaction = max(
        (i for i, u in enumerate(unit_list) if u.kind == "compaction"), default=-1
    )
    active = [
        u
        for u in unit_list[last_compaction + 1 :]
        if u.kind != "control" and (exclude_turn is None or u.turn != exclude_turn)
    ]
    flat = [m for u in active for m in u.messages]
    start = reference_start(len(flat), limit)
    in_window = {m.id for m in flat[start:]}
    sent: list[ChatMessage] = []
    for u in active:
        if u.kind == "group":
            if u.call.id in in_window:
                sent.append(u.call)
                sent.extend(u.results)  # in archive order, right after the call
                sent.extend(m for m in u.messages if m.id == u.between)
            else:
                sent.extend(m for m in u.messages if m.id == u.between and m.id in in_window)
        elif u.kind == "incomplete":
            sent.extend(m for m in u.messages if m.id == u.between and m.id in in_window)
        else:
            sent.extend(m for m in u.messages if m.id in in_window)
    return sent


def check_groups(sent: Sequence[ChatMessage]) -> None:
    """No tool result without its call right before it; every call with all its results."""
    assert not sent or sent[0].role != "tool"
    i = 0
    while i < len(sent):
        message = sent[i]
        assert message.role != "tool", f"tool result {message.id} not right after its call"
        if message.role == "assistant" and message.tool_calls:
            wanted = {c.id for c in message.tool_calls}
            block = sent[i + 1 : i + 1 + len(wanted)]
            assert len(block) == len(wanted), f"call {message.id} is missing results"
            assert all(r.role == "tool" for r in block)
            assert {r.tool_call_id for r in block} == wanted
            i += 1 + len(wanted)
        else:
            i += 1


LIMITS = st.integers(0, 12)


@settings(max_examples=300)
@given(active=st.integers(0, 2_000), limit=st.integers(1, 300))
def test_window_start_keeps_between_half_and_all_of_the_limit(active: int, limit: int) -> None:
    start = window_start(active, limit)
    half = -(-limit // 2)
    assert start == reference_start(active, limit)
    assert start % half == 0
    if active <= limit:
        assert start == 0
    else:
        assert limit - half < active - start <= limit
    # Monotone in A: one more message never moves the start back.
    assert window_start(active + 1, limit) >= start


@settings(max_examples=120)
@given(unit_list=unit_lists(), limit=LIMITS, exclude=st.sampled_from([None, *TURNS]))
def test_history_window_matches_the_reference_model(
    unit_list: list[Unit], limit: int, exclude: str | None
) -> None:
    state, _ = fold_units(unit_list)
    sent = history_window(state, limit, exclude_turn=exclude)
    assert sent == reference_window(unit_list, limit, exclude)
    # The state keeps every non-control message, sent or not.
    kept = [m for u in unit_list if u.kind not in ("control", "compaction") for m in u.messages]
    assert ids(state.messages) == ids(kept)


@settings(max_examples=80)
@given(unit_list=unit_lists(max_size=40), limit=st.integers(1, 12))
def test_sent_prefix_is_stable_while_the_window_start_does_not_move(
    unit_list: list[Unit], limit: int
) -> None:
    _, boundaries = fold_units(unit_list)
    previous: tuple[int, list[ChatMessage]] | None = None
    for state in boundaries:
        active = active_history(state)
        start = state.active_from + window_start(len(active), limit)  # absolute index
        sent = history_window(state, limit)
        if previous is not None:
            before_start, before_sent = previous
            if start == before_start:
                assert sent[: len(before_sent)] == before_sent
                assert encoded(sent).startswith(encoded(before_sent))
            else:
                assert start > before_start  # the window only moves forward
        previous = (start, sent)


@settings(max_examples=120)
@given(unit_list=unit_lists(), limit=LIMITS, exclude=st.sampled_from([None, *TURNS]))
def test_window_never_starts_inside_a_tool_group(
    unit_list: list[Unit], limit: int, exclude: str | None
) -> None:
    state, _ = fold_units(unit_list)
    sent = history_window(state, limit, exclude_turn=exclude)
    check_groups(sent)
    # Nothing incomplete is ever sent, and a complete group goes whole or not at all.
    sent_ids = set(ids(sent))
    for u in unit_list:
        if u.kind == "incomplete":
            assert not sent_ids & set(ids([u.call, *u.results]))
        elif u.kind == "group":
            members = set(ids([u.call, *u.results]))
            assert members <= sent_ids or not members & sent_ids
    # Every sent message is in the active history at or after the window start.
    active = active_history(state, exclude_turn=exclude)
    window = active[window_start(len(active), limit) :]
    assert Counter(ids(sent)) <= Counter(ids(window))


@settings(max_examples=100)
@given(unit_list=unit_lists(), limit=LIMITS)
def test_control_kinds_are_never_sent_and_never_change_the_count(
    unit_list: list[Unit], limit: int
) -> None:
    state, boundaries = fold_units(unit_list)
    plain, _ = fold_units([u for u in unit_list if u.kind != "control"])
    assert state == plain
    assert len(active_history(state)) == len(active_history(plain))
    assert history_window(state, limit) == history_window(plain, limit)
    for s in boundaries:
        assert all(m.kind not in CONTROL_KINDS for m in s.messages)
        assert all(m.kind not in CONTROL_KINDS for m in history_window(s, limit))


@settings(max_examples=80)
@given(unit_list=unit_lists(), limit=LIMITS)
def test_group_tool_calls_of_a_window_is_idempotent(unit_list: list[Unit], limit: int) -> None:
    state, _ = fold_units(unit_list)
    sent = history_window(state, limit)
    assert group_tool_calls(sent) == sent


@st.composite
def loose_messages(draw: st.DrawFn) -> list[ChatMessage]:
    """Arbitrary messages: calls and results over a small id pool, in any order."""
    pool = ["c1", "c2", "c3", "c4"]
    out: list[ChatMessage] = []
    for i in range(draw(st.integers(0, 16))):
        role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "tool", "system"]))
        if role == "assistant" and draw(st.booleans()):
            calls = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
            out.append(call(f"m{i}", *calls))
        elif role == "tool":
            out.append(result(f"m{i}", draw(st.sampled_from(pool))))
        else:
            out.append(msg(f"m{i}", role))
    return out


@settings(max_examples=200)
@given(messages=loose_messages())
def test_group_tool_calls_output_is_an_ordered_sub_multiset(messages: list[ChatMessage]) -> None:
    out = group_tool_calls(messages)
    position = {m.id: i for i, m in enumerate(messages)}
    assert Counter(ids(out)) <= Counter(ids(messages))
    assert len(set(ids(out))) == len(out)  # nothing is sent twice
    non_tool = [position[m.id] for m in out if m.role != "tool"]
    assert non_tool == sorted(non_tool)
    # Plain messages are never dropped, and groups arrive whole.
    plain = [m for m in messages if m.role != "tool" and not m.tool_calls]
    assert [m for m in out if m.role != "tool" and not m.tool_calls] == plain
    check_groups(out)
    # A result is sent only after its own call, and only results archived after the call.
    for i, m in enumerate(out):
        if m.role == "tool":
            owner = next(o for o in reversed(out[:i]) if o.role != "tool")
            assert m.tool_call_id in {c.id for c in owner.tool_calls}
            assert position[m.id] > position[owner.id]
