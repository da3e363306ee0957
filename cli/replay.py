"""Replay for debugging: a session's timeline, and its projected state at any event.

Reading is here; rendering is :mod:`aalis_agent.timeline`, shared with scenario
transcripts. A row that does not decode is reported (session and seq) and skipped; the
rest still replays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import msgspec
from aalis_agent.events import (
    CorruptEvent,
    EventStore,
    SessionEvent,
    to_builtins,
)
from aalis_agent.events.codec import clean_value
from aalis_agent.projections import SessionView, project
from aalis_agent.timeline import (
    history_limit_of,
    render_event,
    render_state,
    render_time,
    shown_name,
    state_json,
)

__all__ = [
    "ReplayReport",
    "history_limit_of",
    "render_event",
    "render_state",
    "replay_session",
    "run_replay",
    "state_json",
]


class _Encoder:
    """JSON lines, with text that is not valid Unicode (a session name edited by hand into
    bytes) cleaned to U+FFFD rather than failing the replay."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()

    def encode(self, value: object) -> bytes:
        try:
            return self._encoder.encode(value)
        except UnicodeEncodeError:
            return self._encoder.encode(clean_value(value))


@dataclass
class ReplayReport:
    """What a replay met: events read and rows that did not decode."""

    events: int = 0
    corrupt: list[CorruptEvent] = field(default_factory=list)


def _progress(total: int, out: TextIO) -> Callable[[int], None]:
    """A reporter that prints every 10% of a long replay to ``out``."""
    step = max(total // 10, 1)
    state = {"next": step}

    def report(done: int) -> None:
        if total >= 10_000 and done >= state["next"]:
            out.write(f"replay: {done:,}/{total:,} events ({done * 100 // total}%)\n")
            out.flush()
            state["next"] = done + step

    return report


def replay_session(
    store: EventStore,
    session_id: str,
    *,
    at: int | None = None,
    report: ReplayReport | None = None,
    on_event: Callable[[SessionEvent], None] | None = None,
) -> SessionView:
    """Fold one session's log up to ``at`` (inclusive), calling ``on_event`` per event."""
    report = report if report is not None else ReplayReport()
    events = store.read(session_id, on_corrupt=report.corrupt.append)
    if at is not None:
        events = [e for e in events if e.seq <= at]
    report.events += len(events)
    if on_event is not None:
        for event in events:
            on_event(event)
    return project(events)


def run_replay(
    store: EventStore,
    sessions: list[str],
    *,
    at: int | None,
    as_json: bool,
    out: TextIO | None = None,
    err: TextIO | None = None,
    total: int = 0,
) -> ReplayReport:
    """Print the timeline (or the state at ``at``) of each session."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    report = ReplayReport()
    progress = _progress(total, err)
    encoder = _Encoder()
    for session_id in sessions:
        if at is None:
            lines: list[str] = []

            def show(event: SessionEvent, lines: list[str] = lines) -> None:
                if as_json:
                    lines.append(encoder.encode(to_builtins(event)).decode())
                else:
                    lines.append(f"#{event.seq:<5} {render_time(event.at)}  {render_event(event)}")

            before = len(report.corrupt)
            replay_session(store, session_id, report=report, on_event=show)
            if not as_json:
                out.write(f"== session {shown_name(session_id)} ({len(lines)} events) ==\n")
            for line in lines:
                out.write(line + "\n")
        else:
            before = len(report.corrupt)
            view = replay_session(store, session_id, at=at, report=report)
            if as_json:
                out.write(encoder.encode(state_json(view)).decode() + "\n")
            else:
                out.write(render_state(view) + "\n")
        for bad in report.corrupt[before:]:
            if as_json:
                row = {"error": bad.reason, "session_id": bad.session_id, "seq": bad.seq}
                out.write(encoder.encode(row).decode() + "\n")
            err.write(f"error: {bad}\n")
        progress(report.events)
    return report
