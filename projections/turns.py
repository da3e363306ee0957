"""The turns projection: what each turn took in, called and ran, and how it ended."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeAlias

import msgspec
from aalis_agent.events.schema import (
    ContextCleared,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    StopMarkerSaved,
    StopRequested,
    ToolFinished,
    ToolStarted,
    TurnEntry,
    TurnOpened,
    TurnOutcome,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
)
from aalis_agent.projections._dispatch import Handler, check_complete, fold, keep
from aalis_agent.projections.chain import Chain

__all__ = [
    "HANDLERS",
    "ModelCallInfo",
    "Party",
    "ToolCallInfo",
    "TurnInfo",
    "TurnLog",
    "TurnsState",
    "all_turns",
    "evolve",
    "find_turn",
    "input_origin",
    "last_opened",
    "project",
    "turn_info",
    "turn_participants",
    "turn_speaker",
]


@dataclass(frozen=True, slots=True)
class ModelCallInfo:
    """One model call of a turn."""

    index: int
    model: str | None
    purpose: str
    format_retry: bool
    status: str | None = None  # None while it runs; then ok / error / aborted
    tool_calls: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallInfo:
    """One tool call of a turn, by its callId."""

    call_id: str
    name: str
    arguments: str
    started_at: int
    ended_at: int | None = None
    result: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """A turn as the log tells it; ``outcome`` is None while it runs."""

    turn_id: str
    opened_seq: int
    opened_at: int
    source: str | None
    platform: str | None
    settings: TurnSettings
    from_queue: bool
    inputs: tuple[tuple[str, TurnEntry], ...] = ()
    model_calls: tuple[ModelCallInfo, ...] = ()
    tool_calls: tuple[ToolCallInfo, ...] = ()
    stopped_by: str | None = None
    stop_reason: str | None = None
    stop_requested: bool = False
    stop_marker: bool = False
    replies_saved: int = 0
    outcome: TurnOutcome | None = None
    reason: str | None = None
    duration_ms: int | None = None
    recorded_seq: int | None = None

    @property
    def human_opened(self) -> bool:
        """Turns opened by human messages (no source) accept inserts (SCH2)."""
        return self.source is None


class TurnLog(msgspec.Struct, frozen=True):
    """One turn's own events: its opening, what happened in it, and its record."""

    opened: TurnOpened
    events: Chain[SessionEvent] = msgspec.field(default_factory=Chain)
    record: TurnRecorded | None = None

    @property
    def turn_id(self) -> str:
        return self.opened.turn_id


class TurnsState(msgspec.Struct, frozen=True):
    """Finished turns in order, and the turn in flight."""

    finished: Chain[TurnLog] = msgspec.field(default_factory=Chain)
    current: TurnLog | None = None


def _on_opened(state: TurnsState, event: TurnOpened) -> TurnsState:
    finished = state.finished
    if state.current is not None:  # cut off without a record: keep what is known
        finished = finished.append(state.current)
    return TurnsState(finished, TurnLog(event))


def _on_turn_event(
    state: TurnsState,
    event: InputJoined
    | InputRequeued
    | ModelCallStarted
    | ModelCallEnded
    | ToolStarted
    | ToolFinished
    | StopRequested
    | StopMarkerSaved,
) -> TurnsState:
    current = state.current
    if current is None or current.opened.turn_id != event.turn_id:
        return state
    return TurnsState(state.finished, TurnLog(current.opened, current.events.append(event)))


def _on_message(state: TurnsState, event: MessageSaved) -> TurnsState:
    current = state.current
    if current is None or event.message.meta.turn_id != current.opened.turn_id:
        return state
    return TurnsState(state.finished, TurnLog(current.opened, current.events.append(event)))


def _on_recorded(state: TurnsState, event: TurnRecorded) -> TurnsState:
    current = state.current
    if current is None or current.opened.turn_id != event.turn_id:
        return state
    return TurnsState(state.finished.append(TurnLog(current.opened, current.events, event)))


HANDLERS: dict[type, Handler[TurnsState]] = {
    TurnOpened: _on_opened,
    InputJoined: _on_turn_event,
    ModelCallStarted: _on_turn_event,
    ModelCallEnded: _on_turn_event,
    ToolStarted: _on_turn_event,
    ToolFinished: _on_turn_event,
    InputRequeued: _on_turn_event,
    StopRequested: _on_turn_event,
    StopMarkerSaved: _on_turn_event,
    MessageSaved: _on_message,
    TurnRecorded: _on_recorded,
    **dict.fromkeys(
        (
            InputReceived,
            InputQueued,
            InputHeld,
            InputReleased,
            UsageRecorded,
            SessionDeleted,
            ContextCleared,
            SettingsChanged,
        ),
        keep,
    ),
}
check_complete("turns", HANDLERS)


def evolve(state: TurnsState, event: SessionEvent) -> TurnsState:
    """Fold one event into the turns."""
    return HANDLERS[type(event)](state, event)


def project(events: Iterable[SessionEvent], state: TurnsState | None = None) -> TurnsState:
    """Fold a whole log (or the rest of one, from ``state``)."""
    return fold(HANDLERS, TurnsState() if state is None else state, events)


def turn_info(log: TurnLog) -> TurnInfo:
    """Summarise one turn's events (computed when asked, not on every fold)."""
    opened = log.opened
    inputs: list[tuple[str, TurnEntry]] = []
    calls: list[ModelCallInfo] = []
    tools: list[ToolCallInfo] = []
    stop: StopRequested | None = None
    marker = False
    replies = 0
    for event in log.events:
        match event:
            case InputJoined():
                inputs.append((event.input_id, event.entry))
            case ModelCallStarted():
                calls.append(
                    ModelCallInfo(event.index, event.model, event.purpose, event.format_retry)
                )
            case ModelCallEnded():
                for i, c in enumerate(calls):
                    if c.index == event.index and c.status is None:
                        calls[i] = replace(
                            c, status=event.status, tool_calls=event.tool_calls, error=event.error
                        )
            case ToolStarted():
                tools.append(ToolCallInfo(event.call_id, event.name, event.arguments, event.at))
            case ToolFinished():
                for i, t in enumerate(tools):
                    if t.call_id == event.call_id and t.ended_at is None:
                        tools[i] = replace(
                            t, ended_at=event.at, result=event.result, error=event.error
                        )
            case StopRequested():
                stop = event
            case StopMarkerSaved():
                marker = True
            case MessageSaved(message=m):
                if m.role == "assistant" and not m.tool_calls and m.kind is None:
                    replies += 1
            case _:
                pass
    record = log.record
    return TurnInfo(
        turn_id=opened.turn_id,
        opened_seq=opened.seq,
        opened_at=opened.at,
        source=opened.source,
        platform=opened.platform,
        settings=opened.settings,
        from_queue=opened.from_queue,
        inputs=tuple(inputs),
        model_calls=tuple(calls),
        tool_calls=tuple(tools),
        stopped_by=stop.by if stop else None,
        stop_reason=stop.reason if stop else None,
        stop_requested=stop is not None,
        stop_marker=marker,
        replies_saved=replies,
        outcome=record.outcome if record else None,
        reason=record.reason if record else None,
        duration_ms=record.duration_ms if record else None,
        recorded_seq=record.seq if record else None,
    )


def all_turns(state: TurnsState) -> list[TurnLog]:
    """Every turn in opening order, the one in flight last."""
    turns = state.finished.to_list()
    if state.current is not None:
        turns.append(state.current)
    return turns


def find_turn(state: TurnsState, turn_id: str) -> TurnLog | None:
    """The turn with this id, if the log has it."""
    if state.current is not None and state.current.turn_id == turn_id:
        return state.current
    for turn in reversed(state.finished):
        if turn.turn_id == turn_id:
            return turn
    return None


Party: TypeAlias = tuple[str | None, str]
"""A participant: ``(platform, account)``."""


def input_origin(state: TurnsState, inp: Input) -> tuple[tuple[Party, ...], str | None]:
    """``originTurnOf`` for one input: the participants it brings into a turn and its
    physical speaker. A human brings the speaker; a schedule or workflow its authorised
    identity (``actor``) and no speaker; a continuation or subtask (``from_turn``) the
    participants and speaker of the turn it came from, as that turn's log recorded them.
    A sender without an account is nobody. The one derivation behind ``/stop`` (CMD3) and
    the tool context (TCX1)."""
    if inp.from_turn is not None:
        origin = find_turn(state, inp.from_turn)
        if origin is not None:
            return turn_participants(origin), turn_speaker(origin)
    if inp.source is None:
        who = speaker = inp.sender.user_id
    else:
        who, speaker = inp.actor, None
    return (((inp.platform, who),) if who else ()), speaker


def turn_participants(turn: TurnLog) -> tuple[Party, ...]:
    """Everyone the turn's inputs brought, in the order they came (CMD3)."""
    seen: dict[Party, None] = {}
    for event in turn.events:
        if isinstance(event, InputJoined):
            seen.update(dict.fromkeys(event.participants))
    return tuple(seen)


def turn_speaker(turn: TurnLog) -> str | None:
    """The physical speaker of the turn's inputs when they all have the same one."""
    speakers = {e.speaker for e in turn.events if isinstance(e, InputJoined)}
    return next(iter(speakers)) if len(speakers) == 1 else None


def last_opened(state: TurnsState) -> TurnOpened | None:
    """How the latest turn opened (its platform, venue and settings), if any did."""
    if state.current is not None:
        return state.current.opened
    return state.finished[-1].opened if state.finished else None
