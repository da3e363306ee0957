"""Sample session logs: the demo's conversation and synthetic turns for benchmarks.

These write events exactly as a session actor would, batch by batch, so that replay,
tests and benchmarks work on realistic logs before (and besides) live turns.
"""

from __future__ import annotations

from dataclasses import dataclass

from aalis_agent.events import (
    Batch,
    ChatMessage,
    Clock,
    EventStore,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    MessageMeta,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    Sender,
    SessionEvent,
    StopMarkerSaved,
    StopRequested,
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
from aalis_agent.events.schema import TurnEntry
from aalis_agent.request.texts import stop_marker_text

__all__ = ["SampleWriter", "synthetic_turn", "write_demo_session"]

STOP_MARKER_DEMO = stop_marker_text("10001")  # the text a live stop by 10001 writes


@dataclass
class SampleWriter:
    """Appends batches to one session's log, keeping its seq."""

    store: EventStore
    session_id: str
    clock: Clock
    last_seq: int = 0

    def batch(self) -> Batch:
        return Batch(self.session_id, self.last_seq, clock=self.clock)

    def commit(self, batch: Batch) -> None:
        self.last_seq = self.store.append(self.session_id, batch.events, batch.expected_seq)


def _user(inp: Input, turn_id: str | None, entry: TurnEntry | None, n: int) -> ChatMessage:
    return ChatMessage(
        id=f"msg-{inp.id}-{n}",
        role="user",
        content=inp.content,
        meta=MessageMeta(
            turn_id=turn_id,
            entry=entry,
            input_id=inp.id,
            sender=inp.sender,
            platform=inp.platform,
            timestamp=inp.timestamp,
        ),
    )


def _usage(session_id: str, turn_id: str, used: int) -> TokenUsage:
    return TokenUsage(
        session_id=session_id,
        turn_id=turn_id,
        platform="cli",
        context_window=32000,
        max_tokens=4096,
        token_budget=27392,
        used=used,
        usage_ratio=round(used / 27392, 4),
        history_messages=0,
    )


def synthetic_turn(
    batch: Batch,
    n: int,
    *,
    text: str = "你好,帮我查一下明天上海的天气。",
    settings: TurnSettings | None = None,
) -> None:
    """One ordinary turn (a human message, one tool call, a final reply) as 15 events."""
    sid = batch.session_id
    turn = f"turn-{n}"
    inp = Input(id=f"in-{n}", content=text, sender=Sender(user_id="u1", nickname="小明"))
    batch.add(InputReceived(input=inp))
    batch.add(TurnOpened(turn_id=turn, input_ids=(inp.id,), settings=settings or TurnSettings()))
    batch.add(InputJoined(input_id=inp.id, turn_id=turn, entry="opened"))
    batch.add(MessageSaved(message=_user(inp, turn, "opened", n)))
    batch.add(ModelCallStarted(turn_id=turn, index=1, model="demo/scripted"))
    batch.add(ModelCallEnded(turn_id=turn, index=1, tool_calls=1))
    call = ToolCall(id=f"call-{n}", name="weather", arguments='{"city": "上海", "day": "明天"}')
    batch.add(UsageRecorded(usage=_usage(sid, turn, 812 + n)))
    batch.add(ToolStarted(turn_id=turn, call_id=call.id, name=call.name, arguments=call.arguments))
    result = "明天上海多云,14 到 21 度,东南风 3 级。"
    batch.add(ToolFinished(turn_id=turn, call_id=call.id, name=call.name, result=result))
    batch.add(
        MessageSaved(
            message=ChatMessage(
                id=f"msg-{n}-call",
                role="assistant",
                tool_calls=(call,),
                meta=MessageMeta(turn_id=turn),
            )
        )
    )
    batch.add(
        MessageSaved(
            message=ChatMessage(
                id=f"msg-{n}-result",
                role="tool",
                content=result,
                tool_call_id=call.id,
                name=call.name,
                meta=MessageMeta(turn_id=turn, call_id=call.id),
            )
        )
    )
    batch.add(ModelCallStarted(turn_id=turn, index=2, model="demo/scripted"))
    batch.add(ModelCallEnded(turn_id=turn, index=2))
    batch.add(
        MessageSaved(
            message=ChatMessage(
                id=f"msg-{n}-reply",
                role="assistant",
                content="明天上海多云,14 到 21 度,出门带件薄外套就好。",
                meta=MessageMeta(
                    turn_id=turn, turn_record=TurnRecord(turn_id=turn, outcome="replied")
                ),
            )
        )
    )
    batch.add(TurnRecorded(turn_id=turn, outcome="replied", duration_ms=1200))


def write_demo_session(store: EventStore, session_id: str, clock: Clock) -> list[SessionEvent]:
    """Write the demo conversation: a tool call, an insert, a queued injection, a bad tool
    call answered with its error, and a stop whose marker the next turn reads.

    Returns every event written, in order.
    """
    w = SampleWriter(store, session_id, clock)
    settings = TurnSettings(history_limit=20)
    alice = Sender(user_id="10001", nickname="Alice")
    bob = Sender(user_id="10002", nickname="Bob")

    # Turn 1 opens on Alice's message, calls a tool; Bob's message arrives meanwhile and
    # joins before the second model call.
    b = w.batch()
    a1 = Input(
        id="in-1",
        content="帮我查一下明天上海的天气",
        sender=alice,
        platform="qq",
        group_id="g1",
        gateway_seq=1,
    )
    b.add(InputReceived(input=a1))
    b.add(TurnOpened(turn_id="turn-1", input_ids=(a1.id,), platform="qq", settings=settings))
    b.add(InputJoined(input_id=a1.id, turn_id="turn-1", entry="opened"))
    b.add(MessageSaved(message=_user(a1, "turn-1", "opened", 1)))
    b.add(ModelCallStarted(turn_id="turn-1", index=1, model="demo/scripted"))
    w.commit(b)

    b = w.batch()
    b.add(ModelCallEnded(turn_id="turn-1", index=1, tool_calls=1))
    b.add(UsageRecorded(usage=_usage(session_id, "turn-1", 640)))
    call = ToolCall(id="call-1", name="weather", arguments='{"city": "上海"}')
    b.add(ToolStarted(turn_id="turn-1", call_id=call.id, name=call.name, arguments=call.arguments))
    w.commit(b)

    b = w.batch()
    b1 = Input(
        id="in-2", content="顺便看看杭州", sender=bob, platform="qq", group_id="g1", gateway_seq=2
    )
    b.add(InputReceived(input=b1))
    b.add(InputHeld(input_id=b1.id, turn_id="turn-1"))
    w.commit(b)

    b = w.batch()
    result = "明天上海多云,14 到 21 度。"
    b.add(ToolFinished(turn_id="turn-1", call_id=call.id, name=call.name, result=result))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-call-1",
                role="assistant",
                tool_calls=(call,),
                meta=MessageMeta(turn_id="turn-1"),
            )
        )
    )
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-result-1",
                role="tool",
                content=result,
                tool_call_id=call.id,
                name=call.name,
                meta=MessageMeta(turn_id="turn-1", call_id=call.id),
            )
        )
    )
    b.add(InputJoined(input_id=b1.id, turn_id="turn-1", entry="joined"))
    b.add(MessageSaved(message=_user(b1, "turn-1", "joined", 2)))
    b.add(ModelCallStarted(turn_id="turn-1", index=2, model="demo/scripted"))
    w.commit(b)

    # A scheduled injection arrives while turn 1 runs: it queues and runs alone later.
    b = w.batch()
    sched = Input(
        id="in-3",
        content="每日提醒:喝水",
        source="schedule",
        trigger_type="interval",
        platform="qq",
        group_id="g1",
    )
    b.add(InputReceived(input=sched))
    b.add(InputQueued(input_id=sched.id))
    w.commit(b)

    b = w.batch()
    b.add(ModelCallEnded(turn_id="turn-1", index=2))
    b.add(UsageRecorded(usage=_usage(session_id, "turn-1", 702)))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-reply-1",
                role="assistant",
                content="上海明天多云 14-21 度;杭州我再查一下。",
                meta=MessageMeta(
                    turn_id="turn-1", turn_record=TurnRecord(turn_id="turn-1", outcome="replied")
                ),
            )
        )
    )
    b.add(TurnRecorded(turn_id="turn-1", outcome="replied", duration_ms=2310))
    # Turn 2: the queued injection, alone. The model sends malformed tool arguments.
    b.add(
        TurnOpened(
            turn_id="turn-2",
            input_ids=(sched.id,),
            source="schedule",
            platform="qq",
            settings=settings,
            from_queue=True,
        )
    )
    b.add(InputJoined(input_id=sched.id, turn_id="turn-2", entry="opened"))
    b.add(MessageSaved(message=_user(sched, "turn-2", "opened", 3)))
    b.add(ModelCallStarted(turn_id="turn-2", index=1, model="demo/scripted"))
    w.commit(b)

    b = w.batch()
    bad = '{"text": "喝水", "at": '
    b.add(ModelCallEnded(turn_id="turn-2", index=1, tool_calls=1))
    b.add(UsageRecorded(usage=_usage(session_id, "turn-2", 733)))
    b.add(ToolStarted(turn_id="turn-2", call_id="call-2", name="remind", arguments="{}"))
    error = f"参数不是合法的 JSON 对象: {bad[:200]}"
    b.add(ToolFinished(turn_id="turn-2", call_id="call-2", name="remind", error=error))
    stored = ToolCall(id="call-2", name="remind", arguments="{}")
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-call-2",
                role="assistant",
                tool_calls=(stored,),
                meta=MessageMeta(turn_id="turn-2"),
            )
        )
    )
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-result-2",
                role="tool",
                content=error,
                tool_call_id="call-2",
                name="remind",
                meta=MessageMeta(turn_id="turn-2", call_id="call-2"),
            )
        )
    )
    b.add(ModelCallStarted(turn_id="turn-2", index=2, model="demo/scripted"))
    b.add(ModelCallEnded(turn_id="turn-2", index=2))
    b.add(UsageRecorded(usage=_usage(session_id, "turn-2", 790)))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-reply-2",
                role="assistant",
                content="该喝水啦。",
                meta=MessageMeta(
                    turn_id="turn-2",
                    turn_record=TurnRecord(turn_id="turn-2", outcome="replied", source="schedule"),
                ),
            )
        )
    )
    b.add(TurnRecorded(turn_id="turn-2", outcome="replied", source="schedule", duration_ms=1640))
    w.commit(b)

    # Turn 3: Alice asks again; Alice stops it while the model streams.
    b = w.batch()
    a2 = Input(
        id="in-4", content="那后天呢?", sender=alice, platform="qq", group_id="g1", gateway_seq=3
    )
    b.add(InputReceived(input=a2))
    b.add(TurnOpened(turn_id="turn-3", input_ids=(a2.id,), platform="qq", settings=settings))
    b.add(InputJoined(input_id=a2.id, turn_id="turn-3", entry="opened"))
    b.add(MessageSaved(message=_user(a2, "turn-3", "opened", 4)))
    b.add(ModelCallStarted(turn_id="turn-3", index=1, model="demo/scripted"))
    w.commit(b)

    b = w.batch()
    b.add(StopRequested(turn_id="turn-3", by="10001"))
    b.add(ModelCallEnded(turn_id="turn-3", index=1, status="aborted"))
    marker = ChatMessage(
        id="msg-stop-3",
        role="system",
        kind="turn-stopped",
        content=STOP_MARKER_DEMO,
        meta=MessageMeta(turn_id="turn-3"),
    )
    b.add(StopMarkerSaved(turn_id="turn-3", message=marker))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-record-3",
                role="system",
                kind="turn-record",
                meta=MessageMeta(
                    turn_id="turn-3", turn_record=TurnRecord(turn_id="turn-3", outcome="aborted")
                ),
            )
        )
    )
    b.add(TurnRecorded(turn_id="turn-3", outcome="aborted", reason="stop", duration_ms=420))
    w.commit(b)

    # Turn 4: the next turn sees the stop marker in its history.
    b = w.batch()
    a3 = Input(
        id="in-5",
        content="算了,说说杭州吧",
        sender=alice,
        platform="qq",
        group_id="g1",
        gateway_seq=4,
    )
    b.add(InputReceived(input=a3))
    b.add(TurnOpened(turn_id="turn-4", input_ids=(a3.id,), platform="qq", settings=settings))
    b.add(InputJoined(input_id=a3.id, turn_id="turn-4", entry="opened"))
    b.add(MessageSaved(message=_user(a3, "turn-4", "opened", 5)))
    b.add(ModelCallStarted(turn_id="turn-4", index=1, model="demo/scripted"))
    b.add(ModelCallEnded(turn_id="turn-4", index=1))
    b.add(UsageRecorded(usage=_usage(session_id, "turn-4", 815)))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="msg-reply-4",
                role="assistant",
                content="杭州明天小雨,12 到 18 度,记得带伞。",
                meta=MessageMeta(
                    turn_id="turn-4", turn_record=TurnRecord(turn_id="turn-4", outcome="replied")
                ),
            )
        )
    )
    b.add(TurnRecorded(turn_id="turn-4", outcome="replied", duration_ms=980))
    w.commit(b)
    return store.read(session_id)
