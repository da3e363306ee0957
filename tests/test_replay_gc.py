"""Events and their values are plain data, not tracked by the cyclic garbage collector
(msgspec ``gc=False``): replaying a log then allocates well under one tracked object per
event, so the collector does not traverse the same new events again and again (it cost
about a seventh of a replay's instructions when every event and value was tracked)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from aalis_agent.events import Batch, InMemoryEventStore, SqliteEventStore
from aalis_agent.events.schema import ChatMessage, MessageMeta, MessageSaved, ToolCall
from aalis_agent.projections import project
from aalis_agent.testing.sample import synthetic_turn


@pytest.fixture
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_events_and_their_values_are_not_tracked() -> None:
    message = ChatMessage(
        id="m1",
        role="assistant",
        content="好",
        tool_calls=(ToolCall(id="c1", name="echo", arguments="{}"),),
        meta=MessageMeta(turn_id="turn-1"),
    )
    event = MessageSaved(session_id="s", seq=1, at=0, message=message)
    assert not gc.is_tracked(event)
    assert not gc.is_tracked(message)
    assert not gc.is_tracked(message.meta)
    assert not gc.is_tracked(message.tool_calls[0])


def test_reading_a_log_allocates_under_one_tracked_object_per_event(
    tmp_path: Path, collector_off: None
) -> None:
    store = SqliteEventStore(tmp_path / "log.db")
    seq = 0
    for n in range(60):  # tool turns: inputs, calls, usage, messages, records
        batch = Batch("s", seq, now_ms=1_700_000_000_000 + n)
        synthetic_turn(batch, n)
        store.append("s", batch.events, seq)
        seq = batch.last_seq
    store.close()
    reader = SqliteEventStore(tmp_path / "log.db", read_only=True)
    try:
        before = gc.get_count()[0]  # tracked allocations minus frees, since the collect
        events = reader.read("s")
        tracked = gc.get_count()[0] - before
    finally:
        reader.close()
    assert len(events) == seq > 500
    assert tracked < 0.8 * len(events), f"{tracked} tracked objects for {len(events)} events"
    # Untracked, the events still fold and compare as before.
    memory = InMemoryEventStore()
    memory.append("s", events, 0)
    assert project(memory.read("s")) == project(events)
