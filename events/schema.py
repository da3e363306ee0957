"""The session log's vocabulary: every event a session actor appends.

Rules (schema evolution): events are frozen, kw_only msgspec Structs on one base with an
explicit, stable ``tag``; a new field always has a default; a field's type never changes;
a tag is never reused; unknown fields are tolerated on decode. Old logs under
``tests/golden/`` must keep decoding.

Every event carries ``session_id``, its per-session ``seq`` (1, 2, 3, ... with no gaps),
``at`` (milliseconds since the epoch, from the injected clock) and ``v``, the schema
version it was written with. Events are encoded without default values, so ``v`` absent
means version 1; a later version sets ``v`` explicitly and the default stays 1 forever.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

__all__ = [
    "CONTROL_KINDS",
    "SCHEMA_VERSION",
    "ChatMessage",
    "ContextCleared",
    "Event",
    "HostNotice",
    "Input",
    "InputHeld",
    "InputJoined",
    "InputQueued",
    "InputReceived",
    "InputReleased",
    "InputRequeued",
    "MessageMeta",
    "MessageSaved",
    "ModelCallEnded",
    "ModelCallStarted",
    "ModelRef",
    "ReleaseReason",
    "Sender",
    "SessionDeleted",
    "SessionEvent",
    "SettingsChanged",
    "StopMarkerSaved",
    "StopRequested",
    "TokenBreakdown",
    "TokenPart",
    "TokenUsage",
    "ToolCall",
    "ToolFinished",
    "ToolStarted",
    "TurnEntry",
    "TurnOpened",
    "TurnOutcome",
    "TurnRecord",
    "TurnRecorded",
    "TurnSettings",
    "UsageRecorded",
]

SCHEMA_VERSION = 1
"""The version new events are written with."""

TurnEntry: TypeAlias = Literal["opened", "joined"]
TurnOutcome: TypeAlias = Literal["replied", "silent", "aborted", "error"]
TriggerType: TypeAlias = Literal["direct", "immediate", "interval", "idle", "proactive"]
ReleaseReason: TypeAlias = Literal[
    "stop-all", "mute", "shutdown", "delete", "clear", "stale-generation"
]
Role: TypeAlias = Literal["system", "user", "assistant", "tool"]

CONTROL_KINDS: frozenset[str] = frozenset({"turn-record", "compaction", "notice"})
"""Message kinds that are event markers: never sent to the model, never counted as history."""


class _Value(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Base of value objects nested in events.

    Values and events are plain data that never refer back to themselves, so they are
    not tracked by the cyclic garbage collector (msgspec's ``gc=False``): replaying a
    log allocates several per event, and tracked, they made the collector traverse the
    same new events again and again (about a seventh of a replay's instructions). An
    object put in a ``dict`` or ``Any`` field must not refer back to the event holding
    it, or the two are never freed."""


# --- value objects -------------------------------------------------------------------


class Sender(_Value, frozen=True):
    """Who said an input: the platform account and the name shown for it."""

    user_id: str | None = None
    nickname: str | None = None


class HostNotice(_Value, frozen=True):
    """A notice from the host (INS2): its body is archived, the untrusted part never is."""

    kind: str
    id: str
    untrusted: str | None = None
    reply_to: str | None = None


class Input(_Value, frozen=True):
    """One inbound message: a human message, or an injection that carries a ``source``."""

    id: str
    content: str
    sender: Sender = Sender()
    actor: str | None = None
    platform: str = "cli"
    group_id: str | None = None
    group_name: str | None = None
    session_type: str | None = None
    message_id: str | None = None
    trigger_type: TriggerType | None = None
    source: str | None = None
    addressed: bool = True
    mentions: tuple[str, ...] = ()
    timestamp: int | None = None
    gateway_seq: int | None = None
    host_notice: HostNotice | None = None
    from_turn: str | None = None

    @property
    def is_human(self) -> bool:
        """Human messages carry no ``source``; injections do (SCH2, SCH3)."""
        return self.source is None

    @property
    def was_addressed(self) -> bool:
        """``wasAddressed`` (SCH2): a human input whose trigger is ``direct`` or
        ``immediate``, or that had no trigger decision at all, addressed the assistant;
        other triggers (``interval``, ...) and every injection did not. Derived from the
        trigger, not from the ``addressed`` field."""
        if self.source is not None:
            return False
        return self.trigger_type in (None, "direct", "immediate")


class ToolCall(_Value, frozen=True):
    """A tool call as an assistant message carries it; ``arguments`` as stored (FLOW13)."""

    id: str
    name: str
    arguments: str = ""


class TurnRecord(_Value, frozen=True):
    """The record of how a turn ended (SAVE5)."""

    turn_id: str
    outcome: TurnOutcome
    source: str | None = None


class MessageMeta(_Value, frozen=True):
    """Metadata saved with a message (SAVE1-SAVE3)."""

    turn_id: str | None = None
    entry: TurnEntry | None = None
    input_id: str | None = None
    call_id: str | None = None
    visible_content: str | None = None
    injector: str | None = None
    sender: Sender | None = None
    platform: str | None = None
    timestamp: int | None = None
    turn_record: TurnRecord | None = None
    extra: dict[str, Any] = {}


class ChatMessage(_Value, frozen=True):
    """One archived message. ``kind`` marks control markers and stop markers."""

    id: str
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    kind: str | None = None
    meta: MessageMeta = MessageMeta()

    @property
    def is_control(self) -> bool:
        """Event markers never go to the model and never count as history."""
        return self.kind is not None and self.kind in CONTROL_KINDS


class ModelRef(_Value, frozen=True):
    """A model chosen by provider instance id and model id (SET1)."""

    provider: str
    model: str

    def __str__(self) -> str:
        return f"{self.provider}/{self.model}"


class TurnSettings(_Value, frozen=True):
    """Settings read once when a turn opens (SCH5)."""

    model: ModelRef | None = None
    think: str | None = None
    max_tool_iterations: int | None = None
    history_limit: int = 0
    tool_groups: tuple[str, ...] | None = None
    persona: str | None = None
    multi_party: bool = False


class TokenBreakdown(_Value, frozen=True, rename="camel"):
    """The ``breakdown`` of a ``token:usage`` payload (ACC2)."""

    system: int = 0
    persona: int = 0
    memory_summary: int = 0
    memory_vector: int = 0
    skills: int = 0
    platform: int = 0
    subtask: int = 0
    system_other: int = 0
    history: int = 0
    tool_results: int = 0
    tool_defs: int = 0
    reserved_for_reply: int = 0
    injectors: dict[str, int] = {}


class TokenPart(_Value, frozen=True):
    """One labelled row of the ``parts`` table of a ``token:usage`` payload."""

    label: str
    tokens: int
    injectors: dict[str, int] | None = None


class TokenUsage(_Value, frozen=True, rename="camel"):
    """The ``token:usage`` payload (ACC2); camelCase on the wire, as the source has it."""

    session_id: str
    turn_id: str | None = None
    platform: str | None = None
    context_window: int = 0
    max_tokens: int = 0
    token_budget: int = 0
    used: int = 0
    usage_ratio: float = 0.0
    trimmed: bool = False
    untrimmed_history: int = 0
    history_messages: int = 0
    breakdown: TokenBreakdown = TokenBreakdown()
    parts: tuple[TokenPart, ...] = ()


# --- events --------------------------------------------------------------------------


class Event(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", gc=False
):
    """Base of every logged event.

    Code that decides builds an event with its own fields only, e.g.
    ``InputQueued(input_id="in-1")``; the batch it is added to stamps ``session_id``,
    ``seq`` and ``at`` (see :class:`aalis_agent.events.Batch`). A stored event always has
    all three: the store refuses a batch whose events do not name its session and follow
    on without gaps. Not tracked by the cyclic garbage collector (see :class:`_Value`).
    """

    session_id: str = ""
    seq: int = 0
    at: int = 0
    v: int = 1


class InputReceived(Event, frozen=True, tag="input_received"):
    """An input was accepted by the session; ``generation`` is the one it arrived in (DEL2).

    ``sent_digest``: when an input preprocessor or an ``agent:input:before`` middleware
    changed the input, a digest of the input as its submitter sent it
    (:func:`aalis_agent.projections.inputs.sent_digest`), so that the same input sent again
    is recognised as the one received; None when ``input`` is as it was sent."""

    input: Input
    generation: int = 0
    sent_digest: str | None = None


class InputQueued(Event, frozen=True, tag="input_queued"):
    """The input waits in the queue for a later turn (SCH3)."""

    input_id: str


class InputHeld(Event, frozen=True, tag="input_held"):
    """The input waits to join the running turn at its next insertion point (SCH2)."""

    input_id: str
    turn_id: str


class InputJoined(Event, frozen=True, tag="input_joined"):
    """The input entered a turn: it opened it or joined it at an insertion point.

    Entry ``opened`` follows the turn's ``TurnOpened`` in the same batch. ``participants``
    are who the input brings into the turn (``originTurnOf``: a human the speaker, a
    continuation or subtask the participants of the turn it came from, a schedule or
    workflow its authorised identity), as ``(platform, account)``; ``speaker`` is its
    physical speaker (a continuation: the speaker of the turn it came from). Recorded so
    that ``/stop`` and the tool context read them from the log, across restarts.
    """

    input_id: str
    turn_id: str
    entry: TurnEntry
    participants: tuple[tuple[str | None, str], ...] = ()
    speaker: str | None = None


class InputReleased(Event, frozen=True, tag="input_released"):
    """The input left without entering a turn (SCH6, DEL1-DEL2).

    Released for a deletion or a clear of the context (``reason`` ``delete``, ``clear``),
    it begins that deletion or clear in the log: ``SessionDeleted`` (``ContextCleared``)
    follows once the running turn has settled, and recovery writes it when a crash came
    between the two. ``kinds``: a clear's kinds (what its ``ContextCleared`` records);
    empty otherwise."""

    input_id: str
    reason: ReleaseReason
    archived: bool = False
    kinds: tuple[str, ...] = ()


class InputRequeued(Event, frozen=True, tag="input_requeued"):
    """An input of a turn cut by a crash (or a failed write) before any model call carried
    it goes back to the head of the queue: it never reached the model, so it runs again
    rather than being lost. Written by recovery, before the cut turn's record."""

    input_id: str
    turn_id: str
    reason: str = "crash"


class TurnOpened(Event, frozen=True, tag="turn_opened"):
    """A turn opened for ``input_ids`` (in arrival order) with its settings read once.

    ``batch_prefix`` is the text placed before a batch of queued human inputs (SCH4).
    """

    turn_id: str
    input_ids: tuple[str, ...]
    source: str | None = None
    platform: str | None = None
    settings: TurnSettings = TurnSettings()
    from_queue: bool = False
    batch_prefix: str | None = None
    venue: str | None = None  # the venue settings layer's key the settings were read for


class ModelCallStarted(Event, frozen=True, tag="model_call_started"):
    """The turn called the model; ``index`` counts calls within the turn from 1."""

    turn_id: str
    index: int
    model: str | None = None
    purpose: str = "对话"
    format_retry: bool = False


class ModelCallEnded(Event, frozen=True, tag="model_call_ended"):
    """The model call returned (``ok``), threw (``error``) or was abandoned (``aborted``)."""

    turn_id: str
    index: int
    status: Literal["ok", "error", "aborted"] = "ok"
    tool_calls: int = 0
    error: str | None = None


class MessageSaved(Event, frozen=True, tag="message_saved"):
    """A message was archived: an input, a tool-call group member, a reply or a marker."""

    message: ChatMessage


class ToolStarted(Event, frozen=True, tag="tool_started"):
    """``tool:execute`` start: the call with its arguments as stored (FLOW13)."""

    turn_id: str
    call_id: str
    name: str
    arguments: str = ""


class ToolFinished(Event, frozen=True, tag="tool_finished"):
    """``tool:execute`` end: the result or the error returned to the model."""

    turn_id: str
    call_id: str
    name: str
    result: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = {}


class UsageRecorded(Event, frozen=True, tag="usage_recorded"):
    """A ``token:usage`` payload emitted after a model call (ACC2)."""

    usage: TokenUsage


class StopRequested(Event, frozen=True, tag="stop_requested"):
    """Someone asked the running turn to stop; ``by`` is who, when anyone (SCH6).

    With ``reason`` ``delete`` or ``clear`` it begins a deletion or a clear of the
    context, as an :class:`InputReleased` for one does; ``kinds``: that clear's kinds."""

    turn_id: str
    by: str | None = None
    reason: str = "stop"
    kinds: tuple[str, ...] = ()


class StopMarkerSaved(Event, frozen=True, tag="stop_marker_saved"):
    """The ``turn-stopped`` marker written before an aborted turn's record (SAVE6)."""

    turn_id: str
    message: ChatMessage


class TurnRecorded(Event, frozen=True, tag="turn_recorded"):
    """The turn ended; written before ``agent:turn:after`` (SAVE5)."""

    turn_id: str
    outcome: TurnOutcome
    source: str | None = None
    reason: str | None = None
    duration_ms: int = 0


class SessionDeleted(Event, frozen=True, tag="session_deleted"):
    """The session was deleted; inputs of an older generation are dropped (DEL2)."""

    generation: int


class ContextCleared(Event, frozen=True, tag="context_cleared"):
    """``/clear`` of the message history: the active history starts empty again."""

    kinds: tuple[str, ...] = ()


class SettingsChanged(Event, frozen=True, tag="settings_changed"):
    """A session-layer setting was set (``value``) or reset (``reset``)."""

    key: str
    value: Any = None
    reset: bool = False
    by: str | None = None


SessionEvent: TypeAlias = (
    InputReceived
    | InputQueued
    | InputHeld
    | InputJoined
    | InputReleased
    | InputRequeued
    | TurnOpened
    | ModelCallStarted
    | ModelCallEnded
    | MessageSaved
    | ToolStarted
    | ToolFinished
    | UsageRecorded
    | StopRequested
    | StopMarkerSaved
    | TurnRecorded
    | SessionDeleted
    | ContextCleared
    | SettingsChanged
)
"""Every event a session log may hold."""
