"""The history projection: the archived conversation, and the part of it sent to the model.

State: every archived conversational message since the last clear, in archive order, and
where the *active* history starts (after the last compaction separator). Control kinds
(turn records, compaction separators, notices) are never kept as messages: they never go
to the model and never count (SET4). Stop markers (SAVE6) are conversational.

Reading for the model (FLOW4, SET4): :func:`history_window` takes the active history, the
window of the ``historyLimit``, then :func:`group_tool_calls`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from aalis_agent.events.schema import (
    CONTROL_KINDS,
    ChatMessage,
    ContextCleared,
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
    TurnOpened,
    TurnRecorded,
    UsageRecorded,
)
from aalis_agent.projections._dispatch import Handler, check_complete, fold, keep
from aalis_agent.projections.chain import Chain

__all__ = [
    "COMPACTION_KIND",
    "HANDLERS",
    "HistoryState",
    "active_history",
    "evolve",
    "group_tool_calls",
    "history_window",
    "project",
    "window_start",
]

COMPACTION_KIND = "compaction"
"""The control kind of a compaction separator: the active history starts after it."""


class HistoryState(msgspec.Struct, frozen=True):
    """Archived conversational messages and where the active history starts."""

    messages: Chain[ChatMessage] = msgspec.field(default_factory=Chain)
    active_from: int = 0


def _on_message(state: HistoryState, event: MessageSaved) -> HistoryState:
    message = event.message
    kind = message.kind
    if kind is None or kind not in CONTROL_KINDS:
        return HistoryState(state.messages.append(message), state.active_from)
    if kind == COMPACTION_KIND:
        return HistoryState(state.messages, len(state.messages))
    return state


def _on_stop_marker(state: HistoryState, event: StopMarkerSaved) -> HistoryState:
    return HistoryState(state.messages.append(event.message), state.active_from)


def _on_cleared(state: HistoryState, event: ContextCleared) -> HistoryState:
    if not event.kinds or "context" in event.kinds:
        return HistoryState()
    return state


def _on_deleted(state: HistoryState, event: SessionDeleted) -> HistoryState:
    return HistoryState()


HANDLERS: dict[type, Handler[HistoryState]] = {
    MessageSaved: _on_message,
    StopMarkerSaved: _on_stop_marker,
    ContextCleared: _on_cleared,
    SessionDeleted: _on_deleted,
    **dict.fromkeys(
        (
            InputReceived,
            InputQueued,
            InputHeld,
            InputJoined,
            InputReleased,
            InputRequeued,
            TurnOpened,
            ModelCallStarted,
            ModelCallEnded,
            ToolStarted,
            ToolFinished,
            UsageRecorded,
            StopRequested,
            TurnRecorded,
            SettingsChanged,
        ),
        keep,
    ),
}
check_complete("history", HANDLERS)


def evolve(state: HistoryState, event: SessionEvent) -> HistoryState:
    """Fold one event into the history."""
    return HANDLERS[type(event)](state, event)


def project(events: Iterable[SessionEvent], state: HistoryState | None = None) -> HistoryState:
    """Fold a whole log (or the rest of one, from ``state``)."""
    return fold(HANDLERS, HistoryState() if state is None else state, events)


def active_history(
    state: HistoryState, *, exclude_turn: str | None = None
) -> Sequence[ChatMessage]:
    """The active history in archive order.

    ``exclude_turn`` leaves out the messages of the turn in flight, which the archive
    already holds but which the turn sends as its own part, not as history.
    """
    msgs = state.messages[state.active_from :]
    if exclude_turn is not None:
        msgs = [m for m in msgs if m.meta.turn_id != exclude_turn]
    return msgs


def window_start(active_count: int, limit: int) -> int:
    """Index of the first message sent under ``historyLimit`` = ``limit`` (SET4).

    With A = ``active_count`` and N = ``limit`` > 0: 0 when A <= N, else
    ``ceil((A - N) / h) * h`` with ``h = ceil(N / 2)``. It depends only on A and N, so the
    sent prefix stays byte-identical between two drops.
    """
    if limit <= 0 or active_count <= limit:
        return 0
    half = -(-limit // 2)
    return -(-(active_count - limit) // half) * half


def group_tool_calls(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Order tool calls with their results and skip what cannot be sent (FLOW4).

    A result answers the latest earlier assistant call with its id that is still
    unanswered: results follow their call, and ids are matched per call, never looked up
    across the history (servers number calls per response, ``call_0`` in every one, and
    two parallel calls may share an id: each takes one result). An assistant message
    whose every call is answered is a group: its results follow it at once, and the other
    messages archived between the call and its results move after the group. A call
    missing any result is skipped with the results it has; a result without its call is
    skipped.
    """
    open_calls: dict[str, list[int]] = {}  # call id -> its unanswered calls' messages
    waiting: dict[int, int] = {}  # assistant message -> calls not answered yet
    answers: dict[int, list[int]] = {}  # assistant message -> its results, in order
    for i, message in enumerate(messages):
        if message.role == "tool":
            stack = open_calls.get(message.tool_call_id or "")
            if stack:
                owner = stack.pop()
                answers[owner].append(i)
                waiting[owner] -= 1
        elif message.role == "assistant" and message.tool_calls:
            waiting[i] = len(message.tool_calls)
            answers[i] = []
            for call in message.tool_calls:
                open_calls.setdefault(call.id, []).append(i)
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            continue  # sent with its call, or an orphan
        left = waiting.get(i)
        if left is None:
            out.append(message)
        elif left == 0:
            out.append(message)
            out.extend(messages[j] for j in answers[i])
        # else: incomplete group, skipped whole
    return out


def history_window(
    state: HistoryState, limit: int = 0, *, exclude_turn: str | None = None
) -> list[ChatMessage]:
    """The history sent to the model under ``historyLimit`` = ``limit`` (FLOW4, SET4).

    The window starts at :func:`window_start`; a start inside a tool-call group leaves
    that group's results without their call, so the group goes whole while the messages
    archived inside it stay. Dropped messages are only not sent: the state keeps them.
    """
    active = active_history(state, exclude_turn=exclude_turn)
    start = window_start(len(active), limit)
    return group_tool_calls(active[start:])
