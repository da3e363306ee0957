"""Typed bus events: one frozen msgspec Struct per ``EventBus`` topic, for threaded and
asyncio callers alike.

The runtime publishes plain dicts (camelCase keys) on its :class:`EventBus`;
:func:`typed_event` turns a ``(topic, payload)`` pair into one of the structs below
(snake_case fields), and :func:`subscribe_typed` subscribes a function that receives
them. Every event carries ``session_id``; ``TOPICS`` maps each topic to its struct.

Topics, their fields, and when they fire:

``agent:queue`` -> :class:`QueueChanged`
    ``session_id``, ``items`` (each :class:`QueueItem`: ``input_id``, ``seq`` (the
    gateway's sequence number or None), ``state`` ``"queued"`` or ``"pending"``
    (waiting to join the running turn), ``source`` (None for a human input)). Fires
    after a session batch that queued, held, joined, released or requeued an input:
    the items are everything still waiting, in order.
``turn:opened`` -> :class:`TurnStarted`
    ``session_id``, ``turn_id``, ``input_ids`` (the inputs that opened it), ``source``
    (None for a human-opened turn). Fires when the turn's opening is durable, just
    before its runner starts.
``outbound:stream`` -> :class:`StreamDelta` or :class:`ToolCallStreaming`
    A model call's streamed output, as it arrives (a preview: not yet durable).
    :class:`StreamDelta`: ``session_id``, ``turn_id``, ``content`` (the text delta).
    :class:`ToolCallStreaming`: ``session_id``, ``turn_id``, ``index``, ``name``,
    ``call_id``, ``chars_accumulated`` (a tool call being generated).
``outbound:stream-end`` -> :class:`StreamEnded`
    ``session_id``, ``turn_id``. Fires when an ``agent:turn:before`` middleware kept the
    turn from running: no stream will follow.
``tool:execute`` -> :class:`ToolExecution`
    ``phase`` ``"start"`` (its ``ToolStarted`` is durable, the handler is about to run)
    or ``"end"`` (the handler returned: its result is written with the turn's next
    commit, before the model call that carries it), ``session_id``, ``turn_id``, ``call_id``,
    ``name``, ``error`` (the error the model gets, at ``"end"``; None on success).
``llm:call`` -> :class:`ModelCall`
    ``phase`` ``"start"`` (the call's start is durable and its request, trimmed, is about
    to be sent) or ``"end"`` (the provider's stream ended, or failed, or the call was
    stopped), ``session_id``, ``turn_id``, ``index`` (the call's number in its turn),
    ``model`` (the model's id as the request names it), ``entry`` (``provider/model``);
    at ``"end"``: ``status`` (``"ok"``, ``"error"``, ``"aborted"``), ``error`` (for
    ``"error"``, redacted), ``output_tokens`` (the provider's count, when it gave one).
    A call stopped before its request went out has no ``llm:call`` at all.
``outbound:message`` -> :class:`MessageSent`
    ``session_id``, ``turn_id``, ``content``, ``kind`` (``"reply"``, ``"error"`` or
    ``"system"``), ``platform``, ``host_notice``, ``reply_to``. Fires once the message is
    durable, when no gateway is configured (with one, the gateway receives it instead):
    a turn's reply (kind ``"reply"``, at most one per turn, before ``turn:ended``) or its
    error notice (after ``turn:ended``).
``token:usage`` -> :class:`UsageReported`
    ``session_id``, ``turn_id`` (None for ``Runtime.token_request``), ``usage`` (the
    full :class:`aalis_agent.events.TokenUsage`). Fires after each model call that
    returned, and on ``Runtime.token_request``.
``agent:trim`` -> :class:`TrimApplied`
    ``session_id``, ``turn_id``, ``call`` (the call's index), ``budget``, ``steps``,
    ``trace`` (each :class:`TrimAction`: ``step``, ``action``, ``ids``, ``saved``).
    Fires when a model call's messages were trimmed to the budget.
``turn:ended`` -> :class:`TurnEnded`
    ``session_id``, ``turn_id``, ``outcome`` (``"replied"``, ``"silent"``,
    ``"aborted"``, ``"error"``), ``reason``, ``duration_ms``. Fires once the turn's
    record is durable, after the handles of its inputs resolved.

Any other topic converts to :class:`UnknownEvent` (``topic``, ``session_id`` when the
payload names one, ``payload``), so nothing published is lost.

    from aalis_agent.services.bus_events import MessageSent, subscribe_typed

    def on_event(event):
        if isinstance(event, MessageSent) and event.kind == "reply":
            print(event.session_id, event.content)

    unsubscribe = subscribe_typed(runtime.services.bus, on_event)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, Literal, TypeAlias, cast

import msgspec
import structlog
from aalis_agent.events.schema import TokenUsage, TurnOutcome
from aalis_agent.services.bus import EventBus

__all__ = [
    "TOPICS",
    "BusEvent",
    "MessageSent",
    "ModelCall",
    "QueueChanged",
    "QueueItem",
    "StreamDelta",
    "StreamEnded",
    "ToolCallStreaming",
    "ToolExecution",
    "TrimAction",
    "TrimApplied",
    "TurnEnded",
    "TurnStarted",
    "TypedEvent",
    "UnknownEvent",
    "UsageReported",
    "subscribe_typed",
    "typed_event",
]

log = structlog.get_logger("aalis.bus")


class _Payload(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Base of the structs a payload converts to (camelCase keys on the bus)."""


class BusEvent(_Payload, frozen=True):
    """Base of every typed bus event; ``topic`` is the bus topic it came from."""

    topic: ClassVar[str] = ""
    session_id: str


class QueueItem(_Payload, frozen=True):
    """One input waiting in a session: queued, or pending to join the running turn."""

    input_id: str
    seq: int | None = None
    state: Literal["queued", "pending"] = "queued"
    source: str | None = None


class QueueChanged(BusEvent, frozen=True):
    """``agent:queue``: what is still waiting in the session, in order."""

    topic: ClassVar[str] = "agent:queue"
    items: tuple[QueueItem, ...] = ()


class TurnStarted(BusEvent, frozen=True):
    """``turn:opened``: a turn opened (durably) with these inputs; its runner starts."""

    topic: ClassVar[str] = "turn:opened"
    turn_id: str
    input_ids: tuple[str, ...] = ()
    source: str | None = None


class TurnEnded(BusEvent, frozen=True):
    """``turn:ended``: the turn's record is durable."""

    topic: ClassVar[str] = "turn:ended"
    turn_id: str
    outcome: TurnOutcome
    reason: str | None = None
    duration_ms: int = 0


class StreamDelta(BusEvent, frozen=True):
    """``outbound:stream`` with text: a streamed piece of a reply (not yet durable)."""

    topic: ClassVar[str] = "outbound:stream"
    turn_id: str
    content: str


class ToolCallStreaming(BusEvent, frozen=True):
    """``outbound:stream`` with tool-call progress: a tool call being generated."""

    topic: ClassVar[str] = "outbound:stream"
    turn_id: str
    index: int
    name: str
    call_id: str
    chars_accumulated: int = 0


class StreamEnded(BusEvent, frozen=True):
    """``outbound:stream-end``: the turn did not run (``agent:turn:before``)."""

    topic: ClassVar[str] = "outbound:stream-end"
    turn_id: str


class ToolExecution(BusEvent, frozen=True):
    """``tool:execute``: a tool call starts (``phase="start"``) or ends (``"end"``)."""

    topic: ClassVar[str] = "tool:execute"
    phase: Literal["start", "end"]
    turn_id: str
    call_id: str
    name: str
    error: str | None = None


class ModelCall(BusEvent, frozen=True):
    """``llm:call``: a model call's request goes out (``phase="start"``) or its stream
    ends (``"end"``, with its ``status``)."""

    topic: ClassVar[str] = "llm:call"
    phase: Literal["start", "end"]
    turn_id: str
    index: int
    model: str
    entry: str
    status: Literal["ok", "error", "aborted"] | None = None
    error: str | None = None
    output_tokens: int | None = None


class MessageSent(BusEvent, frozen=True):
    """``outbound:message``: a durable reply or notice leaving a turn (no gateway)."""

    topic: ClassVar[str] = "outbound:message"
    turn_id: str | None
    content: str
    kind: Literal["reply", "error", "system"] = "reply"
    platform: str | None = None
    host_notice: dict[str, str] | None = None
    reply_to: str | None = None


class UsageReported(BusEvent, frozen=True):
    """``token:usage``: the usage of a model call (or of ``token_request``)."""

    topic: ClassVar[str] = "token:usage"
    turn_id: str | None
    usage: TokenUsage


class TrimAction(_Payload, frozen=True):
    """One action of a trim trace."""

    step: int
    action: str
    ids: tuple[str, ...] = ()
    saved: int = 0


class TrimApplied(BusEvent, frozen=True):
    """``agent:trim``: a model call's messages were trimmed to the budget."""

    topic: ClassVar[str] = "agent:trim"
    turn_id: str
    call: int
    budget: int
    steps: tuple[int, ...] = ()
    trace: tuple[TrimAction, ...] = ()


class UnknownEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A topic this module does not know (or a payload that did not convert)."""

    topic: str
    session_id: str | None = None
    payload: Any = None


TypedEvent: TypeAlias = (
    QueueChanged
    | TurnStarted
    | TurnEnded
    | StreamDelta
    | ToolCallStreaming
    | StreamEnded
    | ToolExecution
    | ModelCall
    | MessageSent
    | UsageReported
    | TrimApplied
    | UnknownEvent
)
"""What :func:`typed_event` returns."""

TOPICS: Mapping[str, tuple[type[BusEvent], ...]] = {
    "agent:queue": (QueueChanged,),
    "turn:opened": (TurnStarted,),
    "turn:ended": (TurnEnded,),
    "outbound:stream": (StreamDelta, ToolCallStreaming),
    "outbound:stream-end": (StreamEnded,),
    "tool:execute": (ToolExecution,),
    "llm:call": (ModelCall,),
    "outbound:message": (MessageSent,),
    "token:usage": (UsageReported,),
    "agent:trim": (TrimApplied,),
}
"""Every topic the runtime publishes, and the struct(s) its payload converts to."""


def typed_event(topic: str, payload: Any, *, strict: bool = False) -> TypedEvent:
    """The typed event for ``(topic, payload)``. An unknown topic gives an
    :class:`UnknownEvent`; so does a payload that does not fit its topic's struct, unless
    ``strict`` (then ``msgspec.ValidationError`` is raised)."""
    try:
        return _convert(topic, payload)
    except (msgspec.ValidationError, TypeError, KeyError):
        if strict:
            raise
        sid = payload.get("sessionId") if isinstance(payload, dict) else None
        return UnknownEvent(
            topic=topic, session_id=sid if isinstance(sid, str) else None, payload=payload
        )


def _convert(topic: str, payload: Any) -> TypedEvent:
    if topic == "outbound:stream":
        progress = payload.get("toolCallProgress")
        if progress is not None:
            return ToolCallStreaming(
                session_id=payload["sessionId"],
                turn_id=payload["turnId"],
                index=progress["index"],
                name=progress["name"],
                call_id=progress["callId"],
                chars_accumulated=progress.get("charsAccumulated", 0),
            )
        return StreamDelta(
            session_id=payload["sessionId"],
            turn_id=payload["turnId"],
            content=payload["contentDelta"],
        )
    if topic == "token:usage":
        usage = msgspec.convert(payload, TokenUsage)
        return UsageReported(session_id=usage.session_id, turn_id=usage.turn_id, usage=usage)
    kinds = TOPICS.get(topic)
    if kinds is None:
        sid = payload.get("sessionId") if isinstance(payload, dict) else None
        return UnknownEvent(
            topic=topic, session_id=sid if isinstance(sid, str) else None, payload=payload
        )
    return cast("TypedEvent", msgspec.convert(payload, kinds[0]))


def subscribe_typed(
    bus: EventBus,
    fn: Callable[[TypedEvent], None],
    *,
    session_id: str | None = None,
    topics: Collection[str] | None = None,
) -> Callable[[], None]:
    """Call ``fn(event)`` with the typed event of everything published on ``bus`` (only
    ``session_id``'s, only ``topics``, when given); returns the unsubscribe function.

    ``fn`` runs on the publishing thread (a session actor's or a turn's), as any bus
    subscriber does: it should be quick and must not call back into the runtime and
    wait (hand work to another thread). An exception it raises is logged by the bus.
    """
    wanted = None if topics is None else frozenset(topics)

    def on_event(topic: str, payload: Any) -> None:
        if wanted is not None and topic not in wanted:
            return
        if session_id is not None and (
            not isinstance(payload, dict) or payload.get("sessionId") != session_id
        ):
            return
        fn(typed_event(topic, payload))

    return bus.subscribe("*", on_event)
