"""The ``EventStore`` contract, run against every store, plus SQLite-only behaviour."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import codec
from aalis_agent.events.errors import (
    ConcurrencyConflict,
    CorruptEvent,
    InvalidBatch,
    StoreError,
    StoreInUse,
)
from aalis_agent.events.schema import (
    ChatMessage,
    ContextCleared,
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
    ModelRef,
    Sender,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    StopMarkerSaved,
    StopRequested,
    TokenBreakdown,
    TokenPart,
    TokenUsage,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecord,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
)
from aalis_agent.events.sqlite import SqliteEventStore
from aalis_agent.events.store import EventStore, InMemoryEventStore, Recorded

T0 = 1_767_225_600_000


def queued(session_id: str, seq: int, text: str = "") -> InputQueued:
    return InputQueued(session_id=session_id, seq=seq, at=T0 + seq, input_id=f"in-{seq}{text}")


def said(session_id: str, seq: int, content: str) -> MessageSaved:
    message = ChatMessage(id=f"msg-{seq}", role="user", content=content)
    return MessageSaved(session_id=session_id, seq=seq, at=T0 + seq, message=message)


def batch(session_id: str, first_seq: int, n: int) -> list[SessionEvent]:
    return [said(session_id, first_seq + i, f"第{first_seq + i}条 message") for i in range(n)]


def one_of_every_event(session_id: str) -> list[SessionEvent]:
    """Realistic instances of every event type (two messages), seq 1..20, as a turn logs them."""
    sender = Sender(user_id="u-42", nickname="小明")
    user_input = Input(
        id="in-1",
        content="@bot 今天天气怎么样？",
        sender=sender,
        platform="qq",
        group_id="g-7",
        group_name="测试群",
        session_type="group",
        message_id="qq-msg-9001",
        trigger_type="direct",
        addressed=True,
        mentions=("bot", "u-43"),
        timestamp=T0 - 5,
        gateway_seq=17,
        host_notice=HostNotice(kind="reply", id="n-1", untrusted="<b>hi</b>", reply_to="m-0"),
    )
    settings = TurnSettings(
        model=ModelRef(provider="openai-main", model="gpt-4o"),
        think="medium",
        max_tool_iterations=8,
        history_limit=40,
        tool_groups=("web", "memory"),
        persona="default",
        multi_party=True,
    )
    user_msg = ChatMessage(
        id="msg-1",
        role="user",
        content="@bot 今天天气怎么样？",
        meta=MessageMeta(
            turn_id="turn-1",
            entry="opened",
            input_id="in-1",
            visible_content="今天天气怎么样？",
            sender=sender,
            platform="qq",
            timestamp=T0 - 5,
            extra={"reply_to": "m-0", "flags": [1, 2], "nested": {"ok": True, "x": None}},
        ),
    )
    tool_msg = ChatMessage(
        id="msg-2",
        role="assistant",
        content="",
        tool_calls=(ToolCall(id="call-1", name="weather", arguments='{"city": "北京"}'),),
        reasoning="The user asks about the weather; call the tool.",
        meta=MessageMeta(turn_id="turn-1", call_id="call-1"),
    )
    stop_marker = ChatMessage(
        id="msg-3",
        role="assistant",
        content="[turn stopped]",
        kind="turn-stopped",
        meta=MessageMeta(
            turn_id="turn-1", turn_record=TurnRecord(turn_id="turn-1", outcome="aborted")
        ),
    )
    usage = TokenUsage(
        session_id=session_id,
        turn_id="turn-1",
        platform="qq",
        context_window=128_000,
        max_tokens=4096,
        token_budget=120_000,
        used=3210,
        usage_ratio=0.026_75,
        trimmed=True,
        untrimmed_history=50,
        history_messages=40,
        breakdown=TokenBreakdown(
            system=300, persona=120, history=2500, tool_defs=290, injectors={"memory": 80}
        ),
        parts=(
            TokenPart(label="system", tokens=300),
            TokenPart(label="injectors", tokens=80, injectors={"memory": 80}),
        ),
    )
    s = session_id
    events: list[SessionEvent] = [
        InputReceived(session_id=s, seq=1, at=T0, input=user_input, generation=2),
        InputQueued(session_id=s, seq=2, at=T0 + 1, input_id="in-2"),
        InputHeld(session_id=s, seq=3, at=T0 + 2, input_id="in-3", turn_id="turn-1"),
        InputJoined(
            session_id=s, seq=4, at=T0 + 3, input_id="in-1", turn_id="turn-1", entry="opened"
        ),
        InputReleased(
            session_id=s,
            seq=5,
            at=T0 + 4,
            input_id="in-4",
            reason="stale-generation",
            archived=True,
        ),
        TurnOpened(
            session_id=s,
            seq=6,
            at=T0 + 5,
            turn_id="turn-1",
            input_ids=("in-1", "in-3"),
            source="direct",
            platform="qq",
            settings=settings,
            from_queue=True,
        ),
        ModelCallStarted(
            session_id=s, seq=7, at=T0 + 6, turn_id="turn-1", index=1, model="openai-main/gpt-4o"
        ),
        ModelCallEnded(
            session_id=s, seq=8, at=T0 + 7, turn_id="turn-1", index=1, status="ok", tool_calls=1
        ),
        MessageSaved(session_id=s, seq=9, at=T0 + 8, message=user_msg, v=2),
        ToolStarted(
            session_id=s,
            seq=10,
            at=T0 + 9,
            turn_id="turn-1",
            call_id="call-1",
            name="weather",
            arguments='{"city": "北京"}',
        ),
        ToolFinished(
            session_id=s,
            seq=11,
            at=T0 + 10,
            turn_id="turn-1",
            call_id="call-1",
            name="weather",
            result="晴，25°C",
            metadata={"latency_ms": 120, "cached": False, "source": ["api", "v2"]},
        ),
        UsageRecorded(session_id=s, seq=12, at=T0 + 11, usage=usage),
        StopRequested(session_id=s, seq=13, at=T0 + 12, turn_id="turn-1", by="u-42", reason="mute"),
        StopMarkerSaved(session_id=s, seq=14, at=T0 + 13, turn_id="turn-1", message=stop_marker),
        InputRequeued(session_id=s, seq=0, at=T0 + 13, input_id="in-2", turn_id="turn-1"),
        TurnRecorded(
            session_id=s,
            seq=15,
            at=T0 + 14,
            turn_id="turn-1",
            outcome="aborted",
            source="direct",
            reason="stopped by u-42",
            duration_ms=2345,
        ),
        SessionDeleted(session_id=s, seq=16, at=T0 + 15, generation=3),
        ContextCleared(session_id=s, seq=17, at=T0 + 16, kinds=("history", "notice")),
        SettingsChanged(
            session_id=s,
            seq=18,
            at=T0 + 17,
            key="model",
            value=["openai-main", "gpt-4o"],
            by="u-42",
        ),
    ]
    # The assistant's tool-call message follows the user's message: 20 events in all.
    events.insert(9, MessageSaved(session_id=s, seq=0, at=T0 + 8, message=tool_msg))
    return [codec.restamp(e, seq=i) for i, e in enumerate(events, start=1)]


def snapshot(store: EventStore) -> Any:
    """Everything a reader can observe, to compare before and after a refused append."""
    names = store.sessions()
    return (
        names,
        store.read_all(),
        {name: (store.last_seq(name), store.read(name)) for name in names},
    )


class StoreContract:
    """The behaviour every ``EventStore`` promises. Subclasses provide ``make_store``."""

    def make_store(self, tmp_path: Path) -> EventStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[EventStore]:
        store = self.make_store(tmp_path)
        yield store
        store.close()

    def test_satisfies_protocol(self, store: EventStore) -> None:
        assert isinstance(store, EventStore)

    def test_negative_read_all_limit_is_refused(self, store: EventStore) -> None:
        store.append("s", batch("s", 1, 2), 0)
        with pytest.raises(InvalidBatch, match="limit must be >= 0"):
            store.read_all(0, -1)
        assert len(store.read_all(0, 0)) == 0

    def test_unencodable_value_refuses_the_batch_and_writes_nothing(
        self, store: EventStore
    ) -> None:
        bad = SettingsChanged(session_id="s", seq=1, at=0, key="k", value=2**70)
        with pytest.raises(InvalidBatch, match=r"seq 1 \(SettingsChanged\): cannot encode event"):
            store.append("s", [bad], 0)
        assert store.last_seq("s") == 0 and store.read_all() == []

    @pytest.mark.parametrize(
        ("content", "problem"),
        [
            (
                None,
                r"the row would not read back: Expected `str`, got `None` - at `\$.input.content`",
            ),
            (
                123,
                r"the row would not read back: Expected `str`, got `int` - at `\$.input.content`",
            ),
            ("half an emoji \ud83d", "cannot encode event"),
        ],
    )
    def test_a_row_that_would_not_read_back_refuses_the_batch(
        self, store: EventStore, content: Any, problem: str
    ) -> None:
        """Nothing unreadable is ever written: a wrong type or a lone surrogate is refused
        before it reaches the log, naming the event and the path of the bad value."""
        good = InputQueued(session_id="s", seq=1, at=0, input_id="a")
        bad = InputReceived(session_id="s", seq=2, at=0, input=Input(id="b", content=content))
        with pytest.raises(InvalidBatch, match=rf"seq 2 \(InputReceived\): {problem}"):
            store.append("s", [good, bad], 0)
        assert store.last_seq("s") == 0 and store.read_all() == []

    def test_empty_store(self, store: EventStore) -> None:
        assert store.sessions() == []
        assert store.read_all() == []
        assert store.read("nobody") == []
        assert store.last_seq("nobody") == 0

    def test_append_returns_new_last_seq(self, store: EventStore) -> None:
        assert store.append("s", batch("s", 1, 3), expected_seq=0) == 3
        assert store.last_seq("s") == 3
        assert store.append("s", batch("s", 4, 1), expected_seq=3) == 4
        assert store.append("s", batch("s", 5, 2), expected_seq=4) == 6
        assert store.last_seq("s") == 6

    def test_read_returns_events_in_order(self, store: EventStore) -> None:
        first, second = batch("s", 1, 3), batch("s", 4, 2)
        store.append("s", first, 0)
        store.append("s", second, 3)
        events = store.read("s")
        assert events == first + second
        assert [e.seq for e in events] == [1, 2, 3, 4, 5]

    @pytest.mark.parametrize("after_seq", [-1, 0, 1, 2, 4, 5, 6, 100])
    def test_read_respects_after_seq(self, store: EventStore, after_seq: int) -> None:
        events = batch("s", 1, 5)
        store.append("s", events, 0)
        assert store.read("s", after_seq) == [e for e in events if e.seq > after_seq]
        assert store.read("s", after_seq=after_seq) == store.read("s", after_seq)

    def test_read_range_is_read_cut_at_until_seq(self, store: EventStore) -> None:
        """``read_range`` (an extra of the stores that have it): the events ``read``
        gives, only those up to ``until_seq``, wherever the appends' batches start and
        end."""
        read_range = getattr(store, "read_range", None)
        if read_range is None:
            pytest.skip("this store has no read_range (a reader then reads the rest)")
        last = 0
        for n in (1, 3, 2, 4):
            store.append("s", batch("s", last + 1, n), last)
            last += n
        events = store.read("s")
        for after_seq in range(-1, last + 2):
            for until_seq in range(-1, last + 2):
                expected = [e for e in events if after_seq < e.seq <= until_seq]
                assert read_range("s", after_seq, until_seq) == expected, (after_seq, until_seq)
        assert read_range("t", 0, 5) == []

    def test_read_of_unknown_session_is_empty(self, store: EventStore) -> None:
        store.append("s", batch("s", 1, 2), 0)
        assert store.read("t") == []
        assert store.read("S") == []
        assert store.read("s ") == []
        assert store.read("t", after_seq=5) == []

    def test_sessions_are_kept_apart(self, store: EventStore) -> None:
        store.append("a", batch("a", 1, 2), 0)
        store.append("b", batch("b", 1, 3), 0)
        store.append("a", batch("a", 3, 1), 2)
        assert store.read("a") == batch("a", 1, 3)
        assert store.read("b") == batch("b", 1, 3)
        assert (store.last_seq("a"), store.last_seq("b")) == (3, 3)

    def test_read_all_orders_by_global_position(self, store: EventStore) -> None:
        a1, b1, a2, c1, b2 = (
            batch("a", 1, 2),
            batch("b", 1, 1),
            batch("a", 3, 1),
            batch("会话", 1, 2),
            batch("b", 2, 3),
        )
        store.append("a", a1, 0)
        store.append("b", b1, 0)
        store.append("a", a2, 2)
        store.append("会话", c1, 0)
        store.append("b", b2, 1)
        everything = a1 + b1 + a2 + c1 + b2
        recorded = store.read_all()
        assert all(isinstance(r, Recorded) for r in recorded)
        assert [r.position for r in recorded] == list(range(1, len(everything) + 1))
        assert [r.event for r in recorded] == everything

    def test_read_all_respects_after_position_and_limit(self, store: EventStore) -> None:
        store.append("a", batch("a", 1, 3), 0)
        store.append("b", batch("b", 1, 4), 0)
        store.append("a", batch("a", 4, 2), 3)
        full = store.read_all()
        assert len(full) == 9
        for after in (-1, 0, 1, 4, 8, 9, 20):
            assert store.read_all(after) == full[max(after, 0) :]
            for limit in (0, 1, 3, 9, 50):
                got = store.read_all(after_position=after, limit=limit)
                assert got == full[max(after, 0) :][:limit]
                assert len(got) <= limit
        # Paging with after_position/limit visits every event exactly once.
        pages: list[Recorded] = []
        while page := store.read_all(pages[-1].position if pages else 0, limit=2):
            pages.extend(page)
        assert pages == full

    def test_positions_are_dense_across_refused_appends(self, store: EventStore) -> None:
        store.append("a", batch("a", 1, 2), 0)
        with pytest.raises(ConcurrencyConflict):
            store.append("a", batch("a", 1, 2), 0)
        with pytest.raises(InvalidBatch):
            store.append("b", batch("a", 1, 1), 0)
        store.append("b", batch("b", 1, 2), 0)
        assert [r.position for r in store.read_all()] == [1, 2, 3, 4]

    def test_last_seq(self, store: EventStore) -> None:
        assert store.last_seq("s") == 0
        store.append("s", batch("s", 1, 1), 0)
        assert store.last_seq("s") == 1
        store.append("t", batch("t", 1, 4), 0)
        assert store.last_seq("s") == 1
        assert store.last_seq("t") == 4

    def test_sessions_sorted(self, store: EventStore) -> None:
        names = [
            "zeta",
            "Alpha",
            "alpha",
            "会话",
            "beta",
            "b",
            "10",
            "9",
            "",
            "a\x00",
            "\U0001f600",
        ]
        for name in names:
            store.append(name, batch(name, 1, 1), 0)
        assert store.sessions() == sorted(names)
        store.append("alpha", batch("alpha", 2, 1), 1)
        assert store.sessions() == sorted(names)  # no duplicates

    def test_empty_batch_is_a_noop(self, store: EventStore) -> None:
        assert store.append("s", [], 0) == 0
        assert store.sessions() == []  # an empty batch does not create a session
        assert store.last_seq("s") == 0
        store.append("s", batch("s", 1, 2), 0)
        before = snapshot(store)
        assert store.append("s", [], 2) == 2
        assert snapshot(store) == before

    @pytest.mark.parametrize("expected_seq", [0, 1, 2])
    def test_empty_batch_with_wrong_expected_seq_conflicts(
        self, store: EventStore, expected_seq: int
    ) -> None:
        store.append("s", batch("s", 1, 3), 0)
        with pytest.raises(ConcurrencyConflict):
            store.append("s", [], expected_seq)

    @pytest.mark.parametrize("expected_seq", [0, 1, 2, 4, 5, 10])
    def test_wrong_expected_seq_conflicts_and_writes_nothing(
        self, store: EventStore, expected_seq: int
    ) -> None:
        store.append("s", batch("s", 1, 3), 0)
        store.append("t", batch("t", 1, 1), 0)
        before = snapshot(store)
        with pytest.raises(ConcurrencyConflict) as info:
            store.append("s", batch("s", expected_seq + 1, 2), expected_seq)
        assert info.value.session_id == "s"
        assert info.value.expected_seq == expected_seq
        assert info.value.actual_seq == 3
        assert isinstance(info.value, StoreError)
        assert snapshot(store) == before

    def test_expected_seq_ahead_on_unknown_session_conflicts(self, store: EventStore) -> None:
        with pytest.raises(ConcurrencyConflict) as info:
            store.append("new", batch("new", 2, 1), 1)
        assert (info.value.expected_seq, info.value.actual_seq) == (1, 0)
        assert store.sessions() == [] and store.read_all() == []

    def test_negative_expected_seq_is_invalid(self, store: EventStore) -> None:
        with pytest.raises(InvalidBatch):
            store.append("s", [], -1)
        with pytest.raises(InvalidBatch):
            store.append("s", batch("s", 0, 1), -1)
        assert store.read_all() == []

    def test_event_of_another_session_is_invalid_and_writes_nothing(
        self, store: EventStore
    ) -> None:
        store.append("s", batch("s", 1, 2), 0)
        before = snapshot(store)
        mixed = [*batch("s", 3, 2), said("other", 5, "stray")]
        with pytest.raises(InvalidBatch) as info:
            store.append("s", mixed, 2)
        assert isinstance(info.value, ValueError) and isinstance(info.value, StoreError)
        assert "other" in str(info.value)
        assert snapshot(store) == before
        with pytest.raises(InvalidBatch):
            store.append("other", batch("s", 1, 1), 0)
        assert snapshot(store) == before

    @pytest.mark.parametrize(
        "seqs", [[4, 5], [3, 5], [3, 4, 6], [3, 3], [2, 3], [4], [3, 4, 4]], ids=str
    )
    def test_seq_gap_is_invalid_and_writes_nothing(
        self, store: EventStore, seqs: list[int]
    ) -> None:
        store.append("s", batch("s", 1, 2), 0)
        before = snapshot(store)
        with pytest.raises(InvalidBatch) as info:
            store.append("s", [said("s", n, "x") for n in seqs], 2)
        assert "seq" in str(info.value)
        assert snapshot(store) == before

    def test_a_conflicting_batch_is_written_not_at_all(self, store: EventStore) -> None:
        store.append("s", batch("s", 1, 1), 0)
        # Two writers both saw seq 1; the first wins, the second's batch vanishes whole.
        winner, loser = batch("s", 2, 2), [queued("s", 2, "b"), queued("s", 3, "b")]
        assert store.append("s", winner, 1) == 3
        with pytest.raises(ConcurrencyConflict):
            store.append("s", loser, 1)
        assert store.read("s") == batch("s", 1, 1) + winner
        assert [r.event for r in store.read_all()] == batch("s", 1, 1) + winner
        # The loser retries on top of the winner and succeeds.
        retry = [codec.restamp(e, seq=e.seq + 2) for e in loser]
        assert store.append("s", retry, 3) == 5
        assert store.read("s", 3) == retry

    def test_every_event_type_round_trips(self, store: EventStore) -> None:
        events = one_of_every_event("会话-1")
        assert {type(e) for e in events} == set(typing.get_args(SessionEvent))
        assert store.append("会话-1", events, 0) == len(events)
        back = store.read("会话-1")
        assert back == events
        assert [type(e) for e in back] == [type(e) for e in events]
        assert [r.event for r in store.read_all()] == events
        assert store.read("会话-1", 9) == events[9:]

    def test_stored_events_are_isolated_from_caller_mutation(self, store: EventStore) -> None:
        """The log is append-only: neither the writer nor a reader can rewrite history.

        Events are frozen, but some fields hold dicts (``ToolFinished.metadata``,
        ``MessageMeta.extra``, ``TokenBreakdown.injectors``); mutating such a dict after
        ``append``, or on an event ``read`` returned, must not change what the store holds.
        """
        events = one_of_every_event("s")
        pristine = [codec.encode(e) for e in events]
        store.append("s", events, 0)
        finished = next(e for e in events if isinstance(e, ToolFinished))
        finished.metadata["rewritten"] = "by the writer, after append"
        read_back = store.read("s")
        next(e for e in read_back if isinstance(e, ToolFinished)).metadata["by"] = "a reader"
        saved = next(r.event for r in store.read_all() if isinstance(r.event, MessageSaved))
        saved.message.meta.extra.clear()
        assert [codec.encode(e) for e in store.read("s")] == pristine
        assert [codec.encode(r.event) for r in store.read_all()] == pristine

    def test_unicode_content_round_trips(self, store: EventStore) -> None:
        texts = ["你好，世界", "😀🚀", "a\u0000b", "\u200b", "", "emoji 👍🏽 + 中文 + עברית"]
        events = [said("ü", i + 1, t) for i, t in enumerate(texts)]
        store.append("ü", events, 0)
        assert [e.message.content for e in store.read("ü")] == texts  # type: ignore[union-attr]

    # --- which sessions may have unfinished work (recovery's index) -----------------

    def test_sessions_are_open_until_a_writer_says_idle(self, store: EventStore) -> None:
        store.append("a", [queued("a", 1)], 0)  # the writer did not say: unknown
        store.append("b", [queued("b", 1)], 0, open_work=True)
        store.append("c", [queued("c", 1)], 0, open_work=False)
        assert store.open_sessions() == ["a", "b"]
        store.append("c", [queued("c", 2)], 1, open_work=True)  # work again
        store.append("b", [queued("b", 2)], 1, open_work=False)  # done
        assert store.open_sessions() == ["a", "c"]
        store.append("b", [queued("b", 3)], 2)  # a writer that does not say: unknown again
        assert store.open_sessions() == ["a", "b", "c"]
        assert store.sessions() == ["a", "b", "c"]

    def test_a_page_of_sessions_is_the_listing_cut(self, store: EventStore) -> None:
        """``session_page`` (what the inspector pages with) gives what ``sessions``,
        ``last_seq`` and ``open_sessions`` give, cut at ``offset`` and ``limit``."""
        names = ["b", "a", "会话", "Z", "c", "a b"]
        for i, name in enumerate(names):
            store.append(name, batch(name, 1, i + 1), 0, open_work=i % 2 == 0 if i < 4 else None)
        store.mark_idle([("a b", 6)])
        listed, open_ = store.sessions(), set(store.open_sessions())
        whole = [(n, store.last_seq(n), n in open_) for n in listed]
        assert sorted(n for n, _, o in whole if not o) == ["Z", "a", "a b"]
        page = store.session_page  # type: ignore[attr-defined]
        for offset in range(len(names) + 2):
            for limit in (0, 1, 2, 5, 100):
                assert page(offset, limit) == (6, whole[offset : offset + limit]), (offset, limit)
        assert page(-3, 2) == (6, whole[:2])

    def test_a_refused_append_leaves_the_mark_alone(self, store: EventStore) -> None:
        store.append("a", [queued("a", 1)], 0, open_work=False)
        with pytest.raises(ConcurrencyConflict):
            store.append("a", [queued("a", 5)], 4, open_work=True)
        with pytest.raises(InvalidBatch):
            store.append("a", [queued("a", 3)], 1, open_work=True)
        assert store.open_sessions() == []
        store.append("a", [], 1, open_work=True)  # an empty batch writes nothing at all
        assert store.open_sessions() == []

    def test_mark_idle_only_where_the_log_has_not_moved(self, store: EventStore) -> None:
        store.append("a", batch("a", 1, 2), 0)
        store.append("b", batch("b", 1, 2), 0)
        assert store.mark_idle([("a", 2), ("b", 1), ("nobody", 0), ("nobody", 3)]) == 1
        assert store.open_sessions() == ["b"]
        store.append("a", [queued("a", 3)], 2)  # moved on: unknown again
        assert store.open_sessions() == ["a", "b"]


class TestInMemoryStore(StoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return InMemoryEventStore()


class TestSqliteMemoryStore(StoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return SqliteEventStore(":memory:")


class TestSqliteExclusiveStore(StoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return SqliteEventStore(tmp_path / "events.db", exclusive=True)

    def test_holds_the_file_until_closed(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        events = one_of_every_event("s")
        with SqliteEventStore(path, exclusive=True) as store:
            assert store.append("s", events, 0) == len(events)
            with pytest.raises(StoreError) as info:
                SqliteEventStore(path, timeout_s=0.01)
            assert "locked" in str(info.value)
            assert store.append("s", [queued("s", 21)], 20) == 21  # still ours
        with SqliteEventStore(path, timeout_s=0.01) as store:
            assert store.read("s") == [*events, queued("s", 21)]
            assert store.append("s", [queued("s", 22)], 21) == 22


class TestSqliteStore(StoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return SqliteEventStore(tmp_path / "events.db")

    # --- SQLite-only -----------------------------------------------------------------

    def _raw_insert(self, path: Path, session_id: str, seq: int, data: Any) -> None:
        conn = sqlite3.connect(path)
        try:
            with conn:
                position = conn.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()
                conn.execute(
                    "INSERT INTO events (position, session_id, seq, type, data) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (position[0] + 1, session_id, seq, "message_saved", data),
                )
        finally:
            conn.close()

    def test_idle_marks_survive_reopen_and_other_writers(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as first, SqliteEventStore(path) as second:
            first.append("a", [queued("a", 1)], 0, open_work=False)
            first.append("b", [queued("b", 1)], 0, open_work=False)
            assert second.open_sessions() == []
            second.append("a", [queued("a", 2)], 1)  # another writer, not saying
            assert first.open_sessions() == ["a"]
            # first's memory of "a is idle" must not skip writing the mark again.
            first.append("a", [queued("a", 3)], 2, open_work=False)
            assert second.open_sessions() == []
        with SqliteEventStore(path) as store:
            assert store.open_sessions() == []
            assert store.sessions() == ["a", "b"]

    def _format_1_database(self, path: Path) -> None:
        conn = sqlite3.connect(path)
        conn.executescript(
            "CREATE TABLE events (position INTEGER NOT NULL, session_id TEXT NOT NULL, "
            "seq INTEGER NOT NULL, type TEXT NOT NULL, data BLOB NOT NULL, "
            "PRIMARY KEY (session_id, seq)) WITHOUT ROWID;"
            "CREATE UNIQUE INDEX events_position ON events (position);"
            "PRAGMA user_version=1;"
        )
        conn.close()
        for sid in ("x", "y"):  # two sessions written the old way
            self._raw_insert(path, sid, 1, codec.encode(queued(sid, 1)))

    def test_a_format_1_database_gains_the_index_with_every_session_open(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "v1.db"
        self._format_1_database(path)
        with SqliteEventStore(path) as store:
            assert store.open_sessions() == ["x", "y"]
            assert store.mark_idle([("x", 1)]) == 1
            assert store.open_sessions() == ["y"]
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        finally:
            conn.close()

    def test_read_only_reads_an_old_format_as_it_is_and_refuses_writes(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "v1.db"
        self._format_1_database(path)
        before = path.read_bytes()
        with SqliteEventStore(path, read_only=True) as store:
            assert store.read("x") == [queued("x", 1)]
            assert store.open_sessions() == ["x", "y"]  # no index: every session open
            with pytest.raises(StoreError, match="read-only"):
                store.append("x", [queued("x", 2)], 1)
            with pytest.raises(StoreError, match="read-only"):
                store.mark_idle([("x", 1)])
        assert path.read_bytes() == before  # not migrated, not written

    def _format_2_database(self, path: Path) -> list[SessionEvent]:
        """A database as format 2 left it: one row per event, written the old way (with
        ``type``, session ids in full), a session marked idle; its events."""
        conn = sqlite3.connect(path)
        conn.executescript(
            "CREATE TABLE events (position INTEGER NOT NULL, session_id TEXT NOT NULL, "
            "seq INTEGER NOT NULL, type TEXT NOT NULL, data BLOB NOT NULL, "
            "PRIMARY KEY (session_id, seq)) WITHOUT ROWID;"
            "CREATE UNIQUE INDEX events_position ON events (position);"
            "CREATE TABLE idle_sessions (session_id TEXT PRIMARY KEY) WITHOUT ROWID;"
            "INSERT INTO idle_sessions VALUES ('b');"
            "PRAGMA user_version=2;"
        )
        events = [*one_of_every_event("a"), *batch("b", 1, 3), *batch("会话", 1, 2)]
        with conn:
            conn.executemany(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?)",
                [
                    (n, e.session_id, e.seq, codec.event_tag(e), codec.encode(e))
                    for n, e in enumerate(events, 1)
                ],
            )
        conn.close()
        return events

    def test_a_format_2_database_moves_to_format_3_as_it_is(self, tmp_path: Path) -> None:
        """Its rows keep their bytes (format 1), now in ``log``; new batches are format-2
        rows after them; reads, positions and idle marks go on across both."""
        path = tmp_path / "v2.db"
        old = self._format_2_database(path)
        with SqliteEventStore(path, read_only=True) as reader:  # read as it is
            assert [r.event for r in reader.read_all()] == old
            a = [e for e in old if e.session_id == "a"]
            assert reader.read_range("a", 3, 7) == a[3:7]
        with SqliteEventStore(path) as store:
            assert [r.event for r in store.read_all()] == old
            assert store.sessions() == ["a", "b", "会话"]
            assert store.open_sessions() == ["a", "会话"]
            assert store.count() == len(old) and store.count("a") == 20
            new = batch("b", 4, 3)
            assert store.append("b", new, 3, open_work=False) == 6
            assert store.read("b") == [*batch("b", 1, 3), *new]
            assert store.read("b", 4) == new[1:]
            recorded = store.read_all(len(old) - 1)
            assert [r.position for r in recorded] == list(range(len(old), len(old) + 4))
            assert [r.event for r in recorded] == [old[-1], *new]
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
            kinds = dict(conn.execute("SELECT name, type FROM sqlite_master"))
            assert kinds["events"] == "view" and kinds["log"] == "table"
            rows = conn.execute("SELECT seq, data FROM events WHERE session_id = 'b'").fetchall()
            assert [seq for seq, _ in rows] == [1, 2, 3, 6]  # three old rows, one new
            assert [data for _, data in rows[:3]] == [codec.encode(e) for e in old[20:23]]
            assert rows[3][1][0] == codec.ROW_FORMAT
        finally:
            conn.close()
        with SqliteEventStore(path, read_only=True) as reader:
            assert reader.read("b") == [*batch("b", 1, 3), *new]

    def _rows(self, path: Path, session_id: str) -> list[tuple[int, bytes]]:
        conn = sqlite3.connect(path)
        try:
            return conn.execute(
                "SELECT seq, data FROM events WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        finally:
            conn.close()

    def _depths(self, path: Path, session_id: str) -> list[int]:
        return [codec.row_header(data)[0] for _, data in self._rows(path, session_id)]  # type: ignore[index]

    def test_a_batch_is_one_row_that_continues_its_group(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(codec, "GROUP_ROWS", 3)
        path = tmp_path / "events.db"
        events: list[SessionEvent] = []
        with SqliteEventStore(path) as store:
            for size in (2, 1, 3, 1, 2):
                more = batch("s", len(events) + 1, size)
                store.append("s", more, len(events))
                events += more
            store.append("t", batch("t", 1, 1), 0)  # another session: its own group
        assert [seq for seq, _ in self._rows(path, "s")] == [2, 3, 6, 7, 9]
        assert self._depths(path, "s") == [0, 1, 2, 0, 1]
        assert self._depths(path, "t") == [0]
        with SqliteEventStore(path) as store:
            # A store that did not write the row before starts a new group.
            store.append("s", batch("s", 10, 1), 9)
            store.append("s", batch("s", 11, 1), 10)
            events += batch("s", 10, 2)
            assert self._depths(path, "s") == [0, 1, 2, 0, 1, 0, 1]
            assert store.read("s") == events
            for after in range(-1, len(events) + 2):  # from inside any row and group
                assert store.read("s", after) == events[max(after, 0) :]
            everything = store.read_all()
            for after in range(len(everything) + 1):
                for limit in (None, 1, 2, 5):
                    stop = None if limit is None else after + limit
                    assert store.read_all(after, limit) == everything[after:stop]

    def test_another_writer_between_two_appends_starts_a_new_group(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as first, SqliteEventStore(path) as second:
            first.append("s", batch("s", 1, 1), 0)
            first.append("s", batch("s", 2, 1), 1)
            second.append("s", batch("s", 3, 1), 2)
            first.append("s", batch("s", 4, 1), 3)
            first.append("s", batch("s", 5, 1), 4)
            assert self._depths(path, "s") == [0, 1, 0, 0, 1]
            assert first.read("s") == second.read("s") == batch("s", 1, 5)

    def _corrupt_row(self, path: Path, seq: int) -> None:
        conn = sqlite3.connect(path)
        try:
            with conn:
                (data,) = conn.execute("SELECT data FROM log WHERE seq = ?", (seq,)).fetchone()
                conn.execute(
                    "UPDATE log SET data = ? WHERE seq = ?", (data[:-3] + b"\xff\xff\xff", seq)
                )
        finally:
            conn.close()

    def test_a_corrupt_row_costs_the_rest_of_its_group_and_no_more(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(codec, "GROUP_ROWS", 4)
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as store:
            for n in range(8):
                store.append("s", batch("s", n + 1, 1), n)  # rows 1-4 and 5-8: two groups
            self._corrupt_row(path, 2)
            with pytest.raises(CorruptEvent) as info:
                store.read("s")
            assert (info.value.session_id, info.value.seq) == ("s", 2)
            seen: list[CorruptEvent] = []
            assert store.read("s", on_corrupt=seen.append) == [
                *batch("s", 1, 1),
                *batch("s", 5, 4),
            ]
            assert [c.seq for c in seen] == [2, 3, 4]
            assert "does not inflate" in seen[0].reason or "cut short" in seen[0].reason
            assert all("which was not read" in c.reason for c in seen[1:])
            assert store.read("s", 4) == batch("s", 5, 4)  # past the damaged group
            seen.clear()
            assert store.read("s", 2, on_corrupt=seen.append) == batch("s", 5, 4)
            assert [c.seq for c in seen] == [3, 4]  # the damaged row itself is not asked for
            with pytest.raises(CorruptEvent):
                store.read_all()
            assert [r.position for r in store.read_all(4)] == [5, 6, 7, 8]

    def test_rows_inserted_by_hand_in_format_1_are_read_with_the_others(
        self, tmp_path: Path, store: EventStore
    ) -> None:
        store.append("s", batch("s", 1, 2), 0)
        self._raw_insert(tmp_path / "events.db", "s", 3, codec.encode(queued("s", 3)))
        assert store.append("s", batch("s", 4, 2), 3) == 5
        assert store.read("s") == [*batch("s", 1, 2), queued("s", 3), *batch("s", 4, 2)]
        assert [r.position for r in store.read_all()] == [1, 2, 3, 4, 5]

    def test_read_only_sees_what_a_writer_appends(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as writer:
            writer.append("s", [queued("s", 1)], 0, open_work=False)
            with SqliteEventStore(path, read_only=True) as reader:
                assert reader.open_sessions() == []
                writer.append("s", [queued("s", 2)], 1)
                assert reader.read("s") == [queued("s", 1), queued("s", 2)]
                assert reader.open_sessions() == ["s"]

    def test_read_only_needs_an_event_database(self, tmp_path: Path) -> None:
        with pytest.raises(StoreError, match="must be a file"):
            SqliteEventStore(":memory:", read_only=True)
        with pytest.raises(StoreError, match="cannot open"):
            SqliteEventStore(tmp_path / "absent.db", read_only=True)
        assert not (tmp_path / "absent.db").exists()
        other = tmp_path / "other.db"
        sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
        with pytest.raises(StoreError, match="no event table"):
            SqliteEventStore(other, read_only=True)

    def test_data_survives_close_and_reopen(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        events = one_of_every_event("s")
        with SqliteEventStore(path) as store:
            store.append("s", events, 0)
            store.append("t", batch("t", 1, 2), 0)
            before = snapshot(store)
        with SqliteEventStore(path) as store:
            assert snapshot(store) == before
            assert store.read("s") == events
            assert store.append("s", batch("s", 21, 1), 20) == 21
            assert [r.position for r in store.read_all()] == list(range(1, 24))
        with SqliteEventStore(str(path)) as store:
            assert store.last_seq("s") == 21
            assert store.count() == 23 and store.count("t") == 2

    def test_uses_wal_journal(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as store:
            store.append("s", batch("s", 1, 1), 0)
            conn = sqlite3.connect(path)
            try:
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            finally:
                conn.close()

    def test_second_instance_with_stale_expected_seq_conflicts(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as first, SqliteEventStore(path) as second:
            assert first.last_seq("s") == second.last_seq("s") == 0
            assert first.append("s", batch("s", 1, 2), 0) == 2
            with pytest.raises(ConcurrencyConflict) as info:
                second.append("s", [queued("s", 1, "second")], 0)
            assert (info.value.expected_seq, info.value.actual_seq) == (0, 2)
            assert second.read("s") == first.read("s") == batch("s", 1, 2)
            # Having seen the conflict, the second writer catches up and wins the next round.
            assert second.append("s", [queued("s", 3)], 2) == 3
            with pytest.raises(ConcurrencyConflict):
                first.append("s", batch("s", 3, 1), 2)
            assert first.read("s") == [*batch("s", 1, 2), queued("s", 3)]
            assert [r.position for r in first.read_all()] == [1, 2, 3]

    def test_two_instances_interleave_appends_to_different_sessions(self, tmp_path: Path) -> None:
        """Each instance's cached last position must notice the other's commits."""
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as first, SqliteEventStore(path) as second:
            assert first.append("a", batch("a", 1, 2), 0) == 2
            assert second.append("b", batch("b", 1, 1), 0) == 1
            assert first.append("c", batch("c", 1, 1), 0) == 1
            assert second.append("a", batch("a", 3, 1), 2) == 3
            assert first.append("b", batch("b", 2, 2), 1) == 3
            assert first.append("a", batch("a", 4, 1), 3) == 4
            recorded = second.read_all()
            assert recorded == first.read_all()
            assert [r.position for r in recorded] == list(range(1, 9))
            assert [(r.event.session_id, r.event.seq) for r in recorded] == [
                ("a", 1), ("a", 2), ("b", 1), ("c", 1), ("a", 3), ("b", 2), ("b", 3), ("a", 4),
            ]  # fmt: skip
            # A stale seq cached by the first instance is refused, not written over.
            assert second.append("c", batch("c", 2, 1), 1) == 2
            with pytest.raises(ConcurrencyConflict) as info:
                first.append("c", [queued("c", 2)], 1)
            assert (info.value.expected_seq, info.value.actual_seq) == (1, 2)
            assert first.read("c") == batch("c", 1, 2)

    def test_garbage_row_raises_corrupt_event(self, tmp_path: Path, store: EventStore) -> None:
        store.append("s", batch("s", 1, 1), 0)
        self._raw_insert(tmp_path / "events.db", "s", 2, b"\xc1\x00garbage")
        assert store.append("s", batch("s", 3, 1), 2) == 3  # the bad row still counts
        with pytest.raises(CorruptEvent) as info:
            store.read("s")
        assert (info.value.session_id, info.value.seq) == ("s", 2)
        assert "'s'" in str(info.value) and "seq 2" in str(info.value)
        assert store.read("s", after_seq=2) == batch("s", 3, 1)  # rows past it are fine
        with pytest.raises(CorruptEvent) as info_all:
            store.read_all()
        assert (info_all.value.session_id, info_all.value.seq) == ("s", 2)

    def test_a_page_of_sessions_is_one_state_of_the_file(self, tmp_path: Path) -> None:
        """``session_page`` counts and lists in one read: another process's session
        committed between the count and the list is in neither (it was listed past the
        count, a page holding more sessions than the total said)."""
        from aalis_agent.events import sqlite as sqlite_module

        path = tmp_path / "events.db"
        with SqliteEventStore(path, single_writer=False) as writer:
            writer.append("a", batch("a", 1, 1), 0)
        reader = SqliteEventStore(path, read_only=True)
        other = SqliteEventStore(path, single_writer=False)

        class Between:  # the reader's connection, with a commit between count and list
            def __init__(self, conn: sqlite3.Connection) -> None:
                self.conn = conn

            @property
            def in_transaction(self) -> bool:
                return self.conn.in_transaction

            def execute(self, sql: str, *args: Any) -> Any:
                done = self.conn.execute(sql, *args)
                if sql == sqlite_module._SESSION_COUNT:
                    other.append("b", batch("b", 1, 1), 0)
                return done

        real = reader._conn
        reader._conn = Between(real)  # type: ignore[assignment]
        try:
            total, page = reader.session_page(0, 10)
        finally:
            reader._conn = real
        assert (total, [n for n, _, _ in page]) == (1, ["a"])
        assert reader.session_page(0, 10)[0] == 2  # and the next page sees it
        reader.close()
        other.close()

    def test_rows_deleted_by_hand_are_reported_missing_not_read_past(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        for at in (0, 2, 4):  # each by a writer of its own: each row starts its own group
            with SqliteEventStore(path) as writer:
                writer.append("s", batch("s", at + 1, 2), at)
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM log WHERE seq = 4")
        conn.close()
        with SqliteEventStore(path) as store:
            with pytest.raises(CorruptEvent) as info:
                store.read("s")
            assert info.value.seq == 3 and "seqs 3-4 missing" in str(info.value)
            seen: list[CorruptEvent] = []
            assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2) + batch("s", 5, 2)
            assert [c.seq for c in seen] == [3]
            assert store.read("s", after_seq=4) == batch("s", 5, 2)

    def test_rows_deleted_within_a_group_name_the_missing_seqs(self, tmp_path: Path) -> None:
        """The row after rows deleted by hand continues their group, so it cannot be read
        either: its error says so, and which seqs no row holds."""
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as writer:
            for at in range(0, 10, 2):
                writer.append("s", batch("s", at + 1, 2), at)  # rows ending at 2, 4, .. 10
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM log WHERE seq IN (4, 6)")
        conn.close()
        with SqliteEventStore(path, read_only=True) as store:
            with pytest.raises(CorruptEvent) as info:
                store.read("s")
            assert info.value.seq == 7  # the row it read, as before
            assert info.value.reason == (
                "a row of seqs 7-8: it continues the row before seq 7, which was not read; "
                "seqs 3-6 are missing (rows deleted?)"
            )
            seen: list[CorruptEvent] = []
            assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2)
            assert [c.seq for c in seen] == [7, 9]
            assert seen[0].reason == info.value.reason
            assert "missing" not in seen[1].reason  # seqs 7-8 are held, by a row not read
            seen.clear()
            assert store.read("s", after_seq=5, on_corrupt=seen.append) == []
            assert [c.seq for c in seen] == [7, 9]
            assert seen[0].reason.endswith("; seq 6 is missing (rows deleted?)")

    def test_on_corrupt_receives_bad_rows_and_the_rest_are_returned(
        self, tmp_path: Path, store: EventStore
    ) -> None:
        store.append("s", batch("s", 1, 1), 0)
        self._raw_insert(tmp_path / "events.db", "s", 2, b"\xc1garbage")
        store.append("s", batch("s", 3, 2), 2)
        self._raw_insert(tmp_path / "events.db", "s", 5, codec.encode(queued("s", 5))[:-3])
        seen: list[CorruptEvent] = []
        events = store.read("s", on_corrupt=seen.append)
        assert events == batch("s", 1, 1) + batch("s", 3, 2)
        assert [(c.session_id, c.seq) for c in seen] == [("s", 2), ("s", 5)]
        assert all(isinstance(c, CorruptEvent) and c.reason for c in seen)

    def test_text_data_row_is_a_corrupt_event(self, tmp_path: Path, store: EventStore) -> None:
        """A row whose ``data`` is TEXT rather than a BLOB does not decode either.

        The protocol says a row that does not decode raises CorruptEvent (or goes to
        ``on_corrupt``); a TEXT value must not escape as a bare TypeError.
        """
        store.append("s", batch("s", 1, 1), 0)
        self._raw_insert(tmp_path / "events.db", "s", 2, "garbage written as text")
        store.append("s", batch("s", 3, 1), 2)
        with pytest.raises(CorruptEvent) as info:
            store.read("s")
        assert (info.value.session_id, info.value.seq) == ("s", 2)
        seen: list[CorruptEvent] = []
        assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 1) + batch("s", 3, 1)
        assert [(c.session_id, c.seq) for c in seen] == [("s", 2)]

    def test_a_text_row_that_is_not_utf8_is_a_corrupt_event(
        self, tmp_path: Path, store: EventStore
    ) -> None:
        """TEXT that SQLite cannot hand over as UTF-8 is that row's problem (a
        CorruptEvent naming it), not an error of the whole read."""
        store.append("s", batch("s", 1, 1), 0)
        self._raw_insert(tmp_path / "events.db", "s", 2, b"x")
        conn = sqlite3.connect(tmp_path / "events.db")
        try:
            with conn:
                conn.execute("UPDATE log SET data = CAST(x'ff41fe' AS TEXT) WHERE seq = 2")
        finally:
            conn.close()
        store.append("s", batch("s", 3, 1), 2)
        seen: list[CorruptEvent] = []
        assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 1) + batch("s", 3, 1)
        assert [(c.session_id, c.seq) for c in seen] == [("s", 2)]
        with pytest.raises(CorruptEvent) as info:
            store.read_all()
        assert (info.value.session_id, info.value.seq) == ("s", 2)

    def test_a_damaged_file_or_table_is_a_store_error_naming_it(self, tmp_path: Path) -> None:
        """What SQLite refuses to read (a damaged page, rows of a session the sessions
        table lost, a name stored as a blob) is a StoreError naming the database, never
        a bare sqlite3 or KeyError."""
        path = tmp_path / "events.db"
        with SqliteEventStore(path) as store:
            for n in range(200):  # a few pages
                store.append(f"s{n}", batch(f"s{n}", 1, 2), 0)
        conn = sqlite3.connect(path)
        try:
            with conn:
                conn.execute("UPDATE sessions SET name = CAST('s1' AS BLOB) WHERE name = 's1'")
                conn.execute("DELETE FROM sessions WHERE name = 's2'")
        finally:
            conn.close()
        with SqliteEventStore(path) as store:
            assert "s1" in store.sessions()  # a blob name reads as text
            with pytest.raises(StoreError, match="session number 3, which its sessions"):
                store.read_all()
        with path.open("r+b") as f:  # pages past the header: garbage
            f.seek(2 * 4096)
            f.write(bytes(range(256)) * 32)
        damaged = pytest.raises(StoreError, match=r"events\.db.*cannot read the event database")
        with SqliteEventStore(path, read_only=True) as store, damaged:
            for n in range(200):
                store.read(f"s{n}")
            store.read_all()
            store.count()

    def test_failure_mid_batch_rolls_back_the_whole_batch(
        self, tmp_path: Path, store: EventStore
    ) -> None:
        """The batch's row is written, then the idle mark of the same transaction fails:
        nothing of the batch stays."""
        store.append("s", batch("s", 1, 1), 0)
        conn = sqlite3.connect(tmp_path / "events.db")
        try:
            conn.execute(
                "CREATE TRIGGER refuse_mark BEFORE INSERT ON idle_sessions "
                "BEGIN SELECT RAISE(ABORT, 'refused by test trigger'); END"
            )
            conn.commit()
            before = snapshot(store)
            with pytest.raises(StoreError, match="refused by test trigger"):
                store.append("s", batch("s", 2, 4), 1, open_work=False)
            assert snapshot(store) == before
            assert store.open_sessions() == ["s"]
            conn.execute("DROP TRIGGER refuse_mark")
            conn.commit()
        finally:
            conn.close()
        # No transaction was left open: the same batch now goes through.
        assert store.append("s", batch("s", 2, 4), 1, open_work=False) == 5
        assert [r.position for r in store.read_all()] == [1, 2, 3, 4, 5]
        assert store.open_sessions() == []

    def test_a_refused_row_writes_nothing(self, tmp_path: Path, store: EventStore) -> None:
        store.append("s", batch("s", 1, 1), 0)
        conn = sqlite3.connect(tmp_path / "events.db")
        try:
            conn.execute(
                "CREATE TRIGGER refuse_row BEFORE INSERT ON log WHEN NEW.seq = 5 "
                "BEGIN SELECT RAISE(ABORT, 'refused by test trigger'); END"
            )
            conn.commit()
            before = snapshot(store)
            with pytest.raises(StoreError):
                store.append("s", batch("s", 2, 4), 1)
            assert snapshot(store) == before
            conn.execute("DROP TRIGGER refuse_row")
            conn.commit()
        finally:
            conn.close()
        assert store.append("s", batch("s", 2, 4), 1) == 5
        assert store.read("s") == batch("s", 1, 5)

    def test_append_to_a_locked_database_raises_store_error(self, tmp_path: Path) -> None:
        """Another writer holding the write lock past ``timeout_s`` is a StoreError.

        The constructor already turns sqlite3 errors (``database is locked`` included)
        into StoreError; ``append`` must not leak a bare ``sqlite3.OperationalError``
        through the EventStore protocol either.
        """
        path = tmp_path / "events.db"
        with SqliteEventStore(path, timeout_s=0.01) as store:
            store.append("s", batch("s", 1, 1), 0)
            other = sqlite3.connect(path, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # another process mid-write
                try:
                    with pytest.raises(StoreError) as info:
                        store.append("s", batch("s", 2, 1), 1)
                    assert "locked" in str(info.value)
                finally:
                    other.execute("ROLLBACK")
            finally:
                other.close()
            assert store.read("s") == batch("s", 1, 1)
            assert store.append("s", batch("s", 2, 1), 1) == 2  # usable once released

    @pytest.mark.parametrize(
        "content",
        [b"this is definitely not a sqlite database\n" * 20, b"hello", b"\x00" * 4096],
        ids=["text", "short", "zeros"],
    )
    def test_non_sqlite_file_raises_store_error(self, tmp_path: Path, content: bytes) -> None:
        path = tmp_path / "notes.txt"
        path.write_bytes(content)
        with pytest.raises(StoreError) as info:
            SqliteEventStore(path)
        message = str(info.value)
        assert str(path) in message
        assert "not a usable event database" in message
        assert "not a database" in message
        assert not isinstance(info.value, sqlite3.Error)
        assert path.read_bytes() == content  # the file is left alone

    def test_directory_path_raises_store_error(self, tmp_path: Path) -> None:
        with pytest.raises(StoreError) as info:
            SqliteEventStore(tmp_path)
        assert str(tmp_path) in str(info.value)

    def test_foreign_events_table_format_raises_store_error(self, tmp_path: Path) -> None:
        path = tmp_path / "other.db"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, body TEXT)")
        conn.commit()
        conn.close()
        with pytest.raises(StoreError) as info:
            SqliteEventStore(path)
        assert "format 0" in str(info.value)

    def test_another_programs_database_is_refused_untouched(self, tmp_path: Path) -> None:
        path = tmp_path / "app.db"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
        conn.commit()
        conn.close()
        before = path.read_bytes()
        with pytest.raises(StoreError, match=r"not an event database: .*tables \(users\)"):
            SqliteEventStore(path)
        assert path.read_bytes() == before  # not even its journal mode changed
        assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no lock file left


# --- one writing process per database (events.ownership) ------------------------------

_HOLD = """
import sys, time
from aalis_agent.events import SqliteEventStore
store = SqliteEventStore(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""

_OPEN = """
import sys
from aalis_agent.events import SqliteEventStore, StoreInUse
try:
    SqliteEventStore(sys.argv[1], read_only=sys.argv[2] == "ro").close()
except StoreInUse as exc:
    print("refused:", exc)
else:
    print("opened")
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_a_second_process_cannot_write_the_database_while_one_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "owned.db"
    with SqliteEventStore(path) as store:
        store.append("s", batch("s", 1, 2), 0)
        refused = _python(_OPEN, str(path), "rw")
        assert refused.returncode == 0, refused.stderr
        assert refused.stdout.startswith("refused:")
        assert f"pid {os.getpid()}" in refused.stdout and "one process runs" in refused.stdout
        assert _python(_OPEN, str(path), "ro").stdout.strip() == "opened"  # readers welcome
        with SqliteEventStore(path) as same_process:  # this process shares its own lock
            assert same_process.last_seq("s") == 2
        assert store.append("s", batch("s", 3, 1), 2) == 3  # still ours
    assert _python(_OPEN, str(path), "rw").stdout.strip() == "opened"  # released on close


def test_the_writer_lock_dies_with_its_process(tmp_path: Path) -> None:
    path = tmp_path / "owned.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreInUse, match=f"pid {holder.pid}"):
            SqliteEventStore(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        if holder.stdout is not None:
            holder.stdout.close()
    with SqliteEventStore(path) as store:  # a killed owner never blocks its successor
        assert store.last_seq("s") == 0
