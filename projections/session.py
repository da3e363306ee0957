"""All projections of one session folded together, as an actor or a replay keeps them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
from aalis_agent.events.schema import SessionDeleted, SessionEvent, SettingsChanged
from aalis_agent.projections import history, queue, turns
from aalis_agent.projections._dispatch import keep
from aalis_agent.projections.history import HistoryState
from aalis_agent.projections.queue import QueueState
from aalis_agent.projections.turns import TurnsState

__all__ = ["SessionView", "evolve", "project"]

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


def project(events: Iterable[SessionEvent], view: SessionView | None = None) -> SessionView:
    """Fold a whole log (or the rest of one, from ``view``).

    Each projection's handler table is consulted once per event and the projections
    that ignore it are skipped, which keeps a full replay cheap.
    """
    if view is None:
        view = SessionView()
    h, t, q = view.history, view.turns, view.queue
    session_id, seq, settings = view.session_id, view.seq, view.settings
    hh, th, qh = history.HANDLERS, turns.HANDLERS, queue.HANDLERS
    for event in events:
        kind = type(event)
        fh = hh[kind]
        if fh is not keep:
            h = fh(h, event)
        ft = th[kind]
        if ft is not keep:
            t = ft(t, event)
        fq = qh[kind]
        if fq is not keep:
            q = fq(q, event)
        if kind is SettingsChanged or kind is SessionDeleted:
            settings = _settings(settings, event)
        seq = event.seq
        session_id = event.session_id
    return SessionView(session_id, seq, h, t, q, settings)
