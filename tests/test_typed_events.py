"""Typed bus events (services/bus_events.py): every topic the runtime publishes converts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import InMemoryEventStore, Input, Sender, TokenUsage, ToolCall
from aalis_agent.services import (
    AbortSignal,
    ChatRequest,
    Services,
    StreamChunk,
    Tool,
    ToolRegistry,
)
from aalis_agent.services.bus import EventBus
from aalis_agent.services.bus_events import (
    TOPICS,
    MessageSent,
    ModelCall,
    QueueChanged,
    StreamDelta,
    StreamEnded,
    ToolCallStreaming,
    ToolExecution,
    TrimApplied,
    TurnEnded,
    TurnStarted,
    TypedEvent,
    UnknownEvent,
    UsageReported,
    subscribe_typed,
    typed_event,
)
from aalis_agent.services.llm import ToolCallProgress

from tests.harness import GatedModel, GatedTool, settle

ROOT = Path(__file__).resolve().parent.parent
SID = "qq:group:7"


class ProgressModel(GatedModel):
    """The gated model, announcing each tool call while it is generated."""

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        for chunk in super().chat_stream(request, abort):
            for i, tc in enumerate(chunk.tool_calls):
                yield StreamChunk(
                    tool_call_progress=ToolCallProgress(
                        index=i, name=tc.name, call_id=tc.id, chars_accumulated=len(tc.arguments)
                    )
                )
            yield chunk


def published_topics() -> set[str]:
    """Every topic literal passed to ``bus.publish`` in actors/ and services/."""
    found: set[str] = set()
    for folder in ("actors", "services"):
        for path in (ROOT / folder).glob("*.py"):
            text = path.read_text(encoding="utf-8")
            found.update(re.findall(r"bus\.publish\(\s*\"([^\"]+)\"", text))
    return found


def test_every_published_topic_has_a_typed_event() -> None:
    topics = published_topics()
    assert {"agent:queue", "turn:opened", "turn:ended", "outbound:message"} <= topics
    assert topics <= set(TOPICS), f"topics without a typed event: {topics - set(TOPICS)}"


def test_a_turn_with_a_tool_an_insert_and_a_stop_converts_every_event() -> None:
    model = ProgressModel()
    tool = GatedTool()
    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=model, tools=ToolRegistry([Tool("slow", tool)])),
        janitor=False,
    )
    raw: list[tuple[str, Any]] = []
    typed: list[TypedEvent] = []
    runtime.subscribe("*", lambda topic, payload: raw.append((topic, payload)))
    unsubscribe = subscribe_typed(runtime.services.bus, typed.append)
    others: list[TypedEvent] = []
    subscribe_typed(runtime.services.bus, others.append, session_id="elsewhere")
    user = {"sender": Sender(user_id="u1", nickname="u1"), "platform": "qq"}
    try:
        first = runtime.submit(SID, Input(id="", content="查一下", **user))
        model.answer(tool_calls=(ToolCall(id="call-1", name="slow", arguments="{}"),))
        tool.wait_running()
        inserted = runtime.submit(SID, Input(id="", content="顺便", **user))
        assert inserted.where == "pending"
        tool.release()
        model.answer(text="查好了")
        assert first.result(10).outcome == "replied"
        assert inserted.result(10).turn_id == first.result(10).turn_id
        settle(runtime, model, (tool,))
        stopped = runtime.submit(SID, Input(id="", content="再来", **user))
        model.wait_call()
        assert runtime.stop(SID) is not None
        assert stopped.result(10).outcome == "aborted"
        runtime.token_request(SID)
        runtime.wait_idle(10)
    finally:
        runtime.shutdown(timeout=10)
    unsubscribe()

    assert len(raw) == len(typed)
    for (topic, payload), event in zip(raw, typed, strict=True):
        assert not isinstance(event, UnknownEvent), (topic, payload)
        assert typed_event(topic, payload, strict=True) == event
        assert type(event) in TOPICS[topic]
        assert event.topic == topic
        assert event.session_id == SID
    assert others == []
    kinds = {type(e) for e in typed}
    assert {
        QueueChanged,
        TurnStarted,
        StreamDelta,
        ToolCallStreaming,
        ToolExecution,
        MessageSent,
        UsageReported,
        TurnEnded,
    } <= kinds
    queued = [e for e in typed if isinstance(e, QueueChanged)]
    assert any(i.state == "pending" for e in queued for i in e.items)
    tools = [e for e in typed if isinstance(e, ToolExecution)]
    assert [(t.phase, t.call_id, t.name, t.error) for t in tools] == [
        ("start", "call-1", "slow", None),
        ("end", "call-1", "slow", None),
    ]
    calls = [e for e in typed if isinstance(e, ModelCall)]
    # Each call's request going out, then its end: the tool call, the reply (the insert
    # joined it), and the stopped turn's call.
    assert [(c.phase, c.index, c.status, c.error) for c in calls] == [
        ("start", 1, None, None),
        ("end", 1, "ok", None),
        ("start", 2, None, None),
        ("end", 2, "ok", None),
        ("start", 1, None, None),
        ("end", 1, "aborted", None),
    ]
    assert {(c.model, c.entry) for c in calls} == {(model.id, f"{model.provider_id}/{model.id}")}
    replies = [e for e in typed if isinstance(e, MessageSent)]
    assert [(r.kind, r.content) for r in replies] == [("reply", "查好了")]
    ended = [e for e in typed if isinstance(e, TurnEnded)]
    assert [e.outcome for e in ended] == ["replied", "aborted"]
    usages = [e for e in typed if isinstance(e, UsageReported)]
    assert usages[-1].turn_id is None  # token_request
    assert all(isinstance(u.usage, TokenUsage) and u.usage.used > 0 for u in usages)


def test_payloads_of_rarer_topics() -> None:
    trim = typed_event(
        "agent:trim",
        {
            "sessionId": "s",
            "turnId": "t",
            "call": 1,
            "budget": 900,
            "steps": [1, 3],
            "trace": [{"step": 1, "action": "dropped", "ids": ["m1", "m2"], "saved": 40}],
        },
        strict=True,
    )
    assert isinstance(trim, TrimApplied)
    assert trim.trace[0].ids == ("m1", "m2") and trim.steps == (1, 3)
    end = typed_event("outbound:stream-end", {"sessionId": "s", "turnId": "t"}, strict=True)
    assert end == StreamEnded(session_id="s", turn_id="t")


def test_unknown_topics_and_bad_payloads() -> None:
    unknown = typed_event("plugin:thing", {"sessionId": "s", "x": 1})
    assert unknown == UnknownEvent(
        topic="plugin:thing", session_id="s", payload={"sessionId": "s", "x": 1}
    )
    bad = typed_event("turn:ended", {"sessionId": "s", "outcome": "exploded"})
    assert isinstance(bad, UnknownEvent) and bad.topic == "turn:ended"
    with pytest.raises(msgspec.ValidationError):
        typed_event("turn:ended", {"sessionId": "s", "outcome": "exploded"}, strict=True)
    # Fields added to a payload later are ignored, not refused.
    later = typed_event(
        "turn:opened", {"sessionId": "s", "turnId": "t", "inputIds": ["i"], "new": 1}
    )
    assert later == TurnStarted(session_id="s", turn_id="t", input_ids=("i",))


def test_subscribe_typed_filters_by_topic_and_session() -> None:
    bus = EventBus()
    seen: list[TypedEvent] = []
    unsubscribe = subscribe_typed(bus, seen.append, session_id="a", topics={"turn:ended"})
    ended = {"sessionId": "a", "turnId": "t", "outcome": "silent", "durationMs": 5}
    bus.publish("turn:ended", ended)
    bus.publish("turn:ended", {**ended, "sessionId": "b"})
    bus.publish("turn:opened", {"sessionId": "a", "turnId": "t"})
    unsubscribe()
    bus.publish("turn:ended", ended)
    assert seen == [TurnEnded(session_id="a", turn_id="t", outcome="silent", duration_ms=5)]


def test_an_unsubscribe_called_twice_ends_only_its_own_subscription() -> None:
    """One function subscribed twice (two consumers sharing a handler): each remover
    ends its own subscription once; calling one again must not end the other's."""
    bus = EventBus()
    got: list[Any] = []

    def handler(topic: str, payload: Any) -> None:
        got.append(payload)

    first = bus.subscribe("turn:ended", handler)
    bus.subscribe("turn:ended", handler)
    first()
    first()  # again: a no-op
    bus.publish("turn:ended", 1)
    assert got == [1]
