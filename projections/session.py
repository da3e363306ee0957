"""All projections of one session folded together, as an actor or a replay keeps them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import msgspec
from aalis_agent.events.schema import (
    CONTROL_KINDS,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    TurnOpened,
)
from aalis_agent.projections import history, queue, turns
from aalis_agent.projections._dispatch import EVENT_TYPES, Handler, keep
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.history import COMPACTION_KIND, HistoryState
from aalis_agent.projections.queue import QueueState
from aalis_agent.projections.turns import TurnLog, TurnsState

__all__ = ["SessionView", "evolve", "project"]

T = TypeVar("T")

_NO_SETTINGS: Mapping[str, Any] = MappingProxyType({})


class SessionView(msgspec.Struct, frozen=True):
    """History, turns, queue and session-layer settings as of ``seq``."""

    session_id: str | None = None
    seq: int = 0
    history: HistoryState = msgspec.field(default_factory=HistoryState)
    turns: TurnsState = msgspec.field(default_factory=TurnsState)
    queue: QueueState = msgspec.field(default_factory=QueueState)
    settings: Mapping[str, Any] = _NO_SETTINGS


def _settings(current: Mapping[str, Any], event: SessionEvent) -> Mapping[str, Any]:
    if isinstance(event, SessionDeleted):
        return _NO_SETTINGS
    assert isinstance(event, SettingsChanged)
    updated = dict(current)
    if event.reset:
        updated.pop(event.key, None)
    else:
        updated[event.key] = event.value
    return MappingProxyType(updated)


def evolve(view: SessionView, event: SessionEvent) -> SessionView:
    """Fold one event into every projection."""
    return project((event,), view)


# What ``project`` does for each event type to the history and the turns, read off those
# projections' own handler tables: a pair of handlers without a step here fails at import.
_KEEP, _OPENED, _TURN_EVENT, _MESSAGE, _RECORDED, _MARKER, _CLEARED, _DELETED = range(8)
_STEPS: dict[tuple[Callable[..., Any], Callable[..., Any]], int] = {
    (keep, keep): _KEEP,
    (keep, turns._on_opened): _OPENED,
    (keep, turns._on_turn_event): _TURN_EVENT,
    (history._on_message, turns._on_message): _MESSAGE,
    (keep, turns._on_recorded): _RECORDED,
    (history._on_stop_marker, turns._on_turn_event): _MARKER,
    (history._on_cleared, keep): _CLEARED,
    (history._on_deleted, keep): _DELETED,
}
_PLANS: dict[type, tuple[int, Handler[QueueState] | None, bool]] = {
    kind: (
        _STEPS[history.HANDLERS[kind], turns.HANDLERS[kind]],
        None if queue.HANDLERS[kind] is keep else queue.HANDLERS[kind],
        kind is SettingsChanged or kind is SessionDeleted,
    )
    for kind in EVENT_TYPES
}


def _own_list(chain: Chain[T]) -> list[T]:
    """The list to extend ``chain`` in: its own, shared, when ``chain`` is the newest view
    of it (appending then leaves every older view as it was), else a copy."""
    items = chain._items
    return items if len(items) == chain._n else items[: chain._n]


def project(events: Iterable[SessionEvent], view: SessionView | None = None) -> SessionView:
    """Fold a whole log (or the rest of one, from ``view``).

    The result is what folding each projection's handlers gives (``history.project``,
    ``turns.project``, ``queue.project`` and the settings), but the history and the turns
    are folded here in one pass over plain lists, wrapped in their ``Chain`` views once
    at the end: a long replay then builds no state per event that it throws away. As
    ``Chain.append`` does, a list shared with ``view`` is extended in place only while
    ``view`` holds its newest items, and copied first otherwise.
    """
    if view is None:
        view = SessionView()
    plans = _PLANS
    control_kinds = CONTROL_KINDS
    q, settings = view.queue, view.settings
    # The history's messages, the finished turns and the current turn's events, as lists.
    h_start = view.history.messages
    h_list = _own_list(h_start)
    h_append = h_list.append
    h_from = view.history.active_from
    f_start = view.turns.finished
    f_list = _own_list(f_start)
    current = view.turns.current
    c_opened: TurnOpened | None = None
    c_id: str | None = None
    c_list: list[SessionEvent] = []
    if current is not None:
        c_opened = current.opened
        c_id = c_opened.turn_id
        c_list = _own_list(current.events)
    c_append = c_list.append
    event: SessionEvent | None = None
    for event in events:
        step, fq, sc = plans[type(event)]
        if step == _TURN_EVENT:
            if event.turn_id == c_id:  # type: ignore[union-attr]
                c_append(event)
        elif step == _MESSAGE:
            message = event.message  # type: ignore[union-attr]
            kind = message.kind
            if kind is None or kind not in control_kinds:
                h_append(message)
            elif kind == COMPACTION_KIND:
                h_from = len(h_list)
            if c_id is not None and message.meta.turn_id == c_id:
                c_append(event)
        elif step:
            if step == _OPENED:
                if c_opened is not None:  # cut off without a record: keep what is known
                    f_list.append(TurnLog(c_opened, Chain(c_list)))
                c_opened = event  # type: ignore[assignment]
                c_id = event.turn_id  # type: ignore[union-attr]
                c_list = []
                c_append = c_list.append
            elif step == _RECORDED:
                if c_opened is not None and event.turn_id == c_id:  # type: ignore[union-attr]
                    f_list.append(TurnLog(c_opened, Chain(c_list), event))  # type: ignore[arg-type]
                    c_opened = c_id = None
                    c_list = []
                    c_append = c_list.append
            elif step == _MARKER:
                h_append(event.message)  # type: ignore[union-attr]
                if event.turn_id == c_id:  # type: ignore[union-attr]
                    c_append(event)
            elif step == _DELETED or (
                not event.kinds or "context" in event.kinds  # type: ignore[union-attr]
            ):
                h_list, h_from = [], 0
                h_append = h_list.append
        if fq is not None:
            q = fq(q, event)
        if sc:
            settings = _settings(settings, event)
    if event is None:
        return view
    hist = view.history
    if h_list is not h_start._items or len(h_list) != h_start._n or h_from != hist.active_from:
        hist = HistoryState(Chain(h_list), h_from)
    turns_state = view.turns
    if (
        c_opened is not (current.opened if current is not None else None)
        or len(f_list) != f_start._n
        or (current is not None and len(c_list) != current.events._n)
    ):
        finished = Chain(f_list) if len(f_list) != f_start._n else f_start
        if c_opened is None:
            turns_state = TurnsState(finished, None)
        elif (
            current is not None and c_opened is current.opened and len(c_list) == current.events._n
        ):
            turns_state = TurnsState(finished, current)
        else:
            turns_state = TurnsState(finished, TurnLog(c_opened, Chain(c_list)))
    return SessionView(event.session_id, event.seq, hist, turns_state, q, settings)
