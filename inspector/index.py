"""What the inspector's JSON endpoints answer, read off one session's log.

A :class:`SessionIndex` holds a session's events once decoded, split into spans that
partition the log: each turn's span runs from the event after the previous turn ended to
its own record (a turn cut off without one ends where the next opens; the running turn at
the log's end), and whatever follows the last record is the tail. Paging the timeline by
turns is then paging by contiguous seq ranges, and a turn's summary is built only when
its page is asked for. The token-usage series is gathered while indexing; the state at a
seq is a fold of the prefix, continued from the nearest checkpoint.

Pure: no I/O. The server feeds it what the store reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aalis_agent.events import (
    InputJoined,
    InputReceived,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SessionEvent,
    StopMarkerSaved,
    StopRequested,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    UsageRecorded,
    to_builtins,
)
from aalis_agent.events.codec import event_tag
from aalis_agent.projections import SessionView, project
from aalis_agent.projections.history import history_window
from aalis_agent.timeline import render_event, state_json

__all__ = [
    "BREAKDOWN_PARTS",
    "CHECKPOINT_EVERY",
    "HISTORY_SHOWN",
    "PREVIEW",
    "SessionIndex",
    "TurnSpan",
]

PREVIEW = 400
"""Characters of a text shown in a timeline page; the events endpoint has it whole."""

HISTORY_SHOWN = 300
"""Messages of a history window sent at most (the newest); the rest are counted."""

CHECKPOINT_EVERY = 2000
"""Events between the folded views kept for the state slider."""

BREAKDOWN_PARTS = (
    "system",
    "persona",
    "memory_summary",
    "memory_vector",
    "skills",
    "platform",
    "subtask",
    "system_other",
    "tool_defs",
    "tool_results",
    "history",
)
"""The disjoint parts of a ``token:usage`` breakdown that make up the prompt, stacked in
this order (the reply's reserve is left out: it is not sent)."""


def _preview(text: str | None, width: int = PREVIEW) -> str | None:
    if text is None or len(text) <= width:
        return text
    return text[: width - 1] + "…"


TAIL_LINES = 500
"""The most events after the last turn a timeline page carries."""


@dataclass
class TurnSpan:
    """One turn's place in the log."""

    ordinal: int  # 0-based, in opening order
    turn_id: str
    first_seq: int  # the first seq of its span (after the previous turn's span)
    opened_seq: int
    last_seq: int | None = None  # None: the span runs to the log's end
    recorded: bool = False


@dataclass
class _Call:
    """One model call as indexed: where it is, and the usage recorded after it."""

    turn_id: str
    index: int
    started_seq: int
    usage_seq: int | None = None


@dataclass
class SessionIndex:
    """One session's decoded log with its turn spans, calls and usage series."""

    session_id: str
    events: list[SessionEvent] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    spans: list[TurnSpan] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    usage_seqs: list[int] = field(default_factory=list)
    received: dict[str, int] = field(default_factory=dict)  # input id -> seq received
    _open: TurnSpan | None = None
    _prev_end: int = 0
    _last_call: dict[str, int] = field(default_factory=dict)  # turn id -> index in calls
    _by_turn: dict[str, int] = field(default_factory=dict)  # turn id -> last span ordinal
    _checkpoints: list[SessionView] = field(default_factory=list)  # view after k*EVERY events

    # --- building ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self.seqs[-1] if self.seqs else 0

    def feed(self, events: Sequence[SessionEvent]) -> None:
        """Index events that follow those already fed (the log only grows)."""
        for event in events:
            if event.seq <= self.last_seq:
                continue
            self.events.append(event)
            self.seqs.append(event.seq)
            self._index(event)

    def _index(self, event: SessionEvent) -> None:
        seq = event.seq
        if isinstance(event, TurnOpened):
            if self._open is not None:  # cut off without a record
                self._open.last_seq = seq - 1
                self._prev_end = seq - 1
            span = TurnSpan(len(self.spans), event.turn_id, self._prev_end + 1, seq)
            self.spans.append(span)
            self._by_turn[event.turn_id] = span.ordinal
            self._open = span
        elif isinstance(event, TurnRecorded):
            if self._open is not None and self._open.turn_id == event.turn_id:
                self._open.last_seq, self._open.recorded = seq, True
                self._open = None
                self._prev_end = seq
        elif isinstance(event, ModelCallStarted):
            self._last_call[event.turn_id] = len(self.calls)
            self.calls.append(_Call(event.turn_id, event.index, seq))
        elif isinstance(event, UsageRecorded):
            self.usage_seqs.append(seq)
            k = self._last_call.get(event.usage.turn_id or "")
            if k is not None and self.calls[k].usage_seq is None:
                self.calls[k].usage_seq = seq
        elif isinstance(event, InputReceived):
            self.received[event.input.id] = seq

    # --- lookups ----------------------------------------------------------------------

    def event_at(self, seq: int) -> SessionEvent | None:
        i = bisect.bisect_left(self.seqs, seq)
        if i < len(self.seqs) and self.seqs[i] == seq:
            return self.events[i]
        return None

    def between(self, first: int, last: int) -> list[SessionEvent]:
        """Events with ``first <= seq <= last``."""
        lo = bisect.bisect_left(self.seqs, first)
        hi = bisect.bisect_right(self.seqs, last)
        return self.events[lo:hi]

    def span_end(self, span: TurnSpan) -> int:
        return self.last_seq if span.last_seq is None else span.last_seq

    def tail(self) -> tuple[int, int] | None:
        """The seq range after the last turn's record, when any event is there."""
        if self._open is not None or self._prev_end >= self.last_seq:
            return None
        return (self._prev_end + 1, self.last_seq)

    def span_of_seq(self, seq: int) -> TurnSpan | None:
        starts = [s.first_seq for s in self.spans]  # cheap next to a fold; spans are few
        i = bisect.bisect_right(starts, seq) - 1
        if i < 0:
            return None
        span = self.spans[i]
        return span if seq <= self.span_end(span) else None

    # --- answers ----------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        first = self.events[0].at if self.events else None
        last = self.events[-1].at if self.events else None
        return {
            "session_id": self.session_id,
            "events": len(self.events),
            "last_seq": self.last_seq,
            "turns": len(self.spans),
            "model_calls": len(self.calls),
            "usage_points": len(self.usage_seqs),
            "first_at": first,
            "last_at": last,
        }

    def timeline(self, offset: int, limit: int) -> dict[str, Any]:
        """A page of turns, ``limit`` from the ``offset``-th (negative: from the end)."""
        total = len(self.spans)
        if offset < 0:
            offset = max(total + offset, 0)
        offset = min(offset, total)
        page = self.spans[offset : offset + limit]
        tail = self.tail()
        return {
            "session_id": self.session_id,
            "last_seq": self.last_seq,
            "turns_total": total,
            "offset": offset,
            "limit": limit,
            "turns": [self.turn_summary(span) for span in page],
            "tail": None if tail is None or offset + limit < total else self._tail(*tail),
        }

    def _tail(self, first: int, last: int) -> dict[str, Any]:
        """The events after the last turn: the latest :data:`TAIL_LINES` of them, and how
        many earlier ones the page leaves to the events API (a session without turns can
        hold its whole log there)."""
        events = self.between(first, last)
        kept = events[-TAIL_LINES:]
        return {
            "first_seq": first,
            "last_seq": last,
            "omitted": len(events) - len(kept),
            "events": [self._line(e) for e in kept],
        }

    def _lines(self, first: int, last: int) -> list[dict[str, Any]]:
        return [self._line(e) for e in self.between(first, last)]

    @staticmethod
    def _line(e: SessionEvent) -> dict[str, Any]:
        return {"seq": e.seq, "at": e.at, "type": event_tag(e), "text": render_event(e).strip()}

    def events_page(self, first: int, last: int, limit: int) -> dict[str, Any]:
        """Events ``first..last`` (at most ``limit``), each as a line and as data."""
        chosen = self.between(first, last)[:limit]
        return {
            "session_id": self.session_id,
            "last_seq": self.last_seq,
            "events": [
                {
                    "seq": e.seq,
                    "at": e.at,
                    "type": event_tag(e),
                    "text": render_event(e).strip(),
                    "data": to_builtins(e),
                }
                for e in chosen
            ],
        }

    def turn_summary(self, span: TurnSpan) -> dict[str, Any]:
        """A turn as the timeline shows it: inputs with their entry mode, model calls
        (with the usage recorded after each), tool calls by callId, stops and markers,
        replies and the outcome."""
        turn_id = span.turn_id
        end = self.span_end(span)
        opened: TurnOpened | None = None
        inputs: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        tools: list[dict[str, Any]] = []
        stops: list[dict[str, Any]] = []
        markers: list[dict[str, Any]] = []
        replies: list[dict[str, Any]] = []
        record: TurnRecorded | None = None
        other = 0
        for e in self.between(span.first_seq, end):
            if isinstance(e, TurnOpened) and e.turn_id == turn_id:
                opened = e
            elif isinstance(e, InputJoined) and e.turn_id == turn_id:
                inputs.append(self._input(e))
            elif isinstance(e, ModelCallStarted) and e.turn_id == turn_id:
                calls.append(
                    {
                        "index": e.index,
                        "model": e.model,
                        "purpose": e.purpose,
                        "format_retry": e.format_retry,
                        "started_seq": e.seq,
                        "started_at": e.at,
                        "ended_seq": None,
                        "status": None,
                        "tool_calls": 0,
                        "error": None,
                        "duration_ms": None,
                        "usage": None,
                    }
                )
            elif isinstance(e, ModelCallEnded) and e.turn_id == turn_id:
                for c in reversed(calls):
                    if c["index"] == e.index and c["status"] is None:
                        c.update(
                            ended_seq=e.seq,
                            status=e.status,
                            tool_calls=e.tool_calls,
                            error=e.error,
                            duration_ms=e.at - c["started_at"],
                        )
                        break
            elif isinstance(e, UsageRecorded) and e.usage.turn_id == turn_id:
                if calls and calls[-1]["usage"] is None:
                    u = e.usage
                    calls[-1]["usage"] = {
                        "seq": e.seq,
                        "used": u.used,
                        "token_budget": u.token_budget,
                        "context_window": u.context_window,
                        "usage_ratio": u.usage_ratio,
                        "trimmed": u.trimmed,
                    }
                else:
                    other += 1
            elif isinstance(e, ToolStarted) and e.turn_id == turn_id:
                tools.append(
                    {
                        "call_id": e.call_id,
                        "name": e.name,
                        "arguments": _preview(e.arguments),
                        "started_seq": e.seq,
                        "started_at": e.at,
                        "finished_seq": None,
                        "result": None,
                        "error": None,
                        "duration_ms": None,
                    }
                )
            elif isinstance(e, ToolFinished) and e.turn_id == turn_id:
                for t in reversed(tools):
                    if t["call_id"] == e.call_id and t["finished_seq"] is None:
                        t.update(
                            finished_seq=e.seq,
                            result=_preview(e.result),
                            error=_preview(e.error),
                            duration_ms=e.at - t["started_at"],
                        )
                        break
            elif isinstance(e, StopRequested) and e.turn_id == turn_id:
                stops.append({"seq": e.seq, "by": e.by, "reason": e.reason})
            elif isinstance(e, StopMarkerSaved) and e.turn_id == turn_id:
                m = e.message
                markers.append({"seq": e.seq, "kind": m.kind, "content": _preview(m.content)})
            elif isinstance(e, MessageSaved) and e.message.meta.turn_id == turn_id:
                m = e.message
                if m.kind is not None:
                    markers.append({"seq": e.seq, "kind": m.kind, "content": _preview(m.content)})
                elif m.role == "assistant" and not m.tool_calls:
                    replies.append({"seq": e.seq, "content": _preview(m.content)})
            elif isinstance(e, TurnRecorded) and e.turn_id == turn_id:
                record = e
            else:
                other += 1
        settings = None if opened is None else msgspec.to_builtins(opened.settings)
        return {
            "ordinal": span.ordinal,
            "turn_id": turn_id,
            "first_seq": span.first_seq,
            "last_seq": end,
            "opened_seq": span.opened_seq,
            "opened_at": None if opened is None else opened.at,
            "source": None if opened is None else opened.source,
            "platform": None if opened is None else opened.platform,
            "from_queue": False if opened is None else opened.from_queue,
            "settings": settings,
            "inputs": inputs,
            "model_calls": calls,
            "tool_calls": tools,
            "stops": stops,
            "markers": markers,
            "replies": replies,
            "outcome": None if record is None else record.outcome,
            "reason": None if record is None else record.reason,
            "duration_ms": None if record is None else record.duration_ms,
            "recorded_seq": None if record is None else record.seq,
            "running": record is None and span.last_seq is None,
            "cut_off": record is None and span.last_seq is not None,
            "other_events": other,
        }

    def _input(self, joined: InputJoined) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input_id": joined.input_id,
            "entry": joined.entry,
            "seq": joined.seq,
            "received_seq": None,
            "content": None,
            "sender": None,
            "source": None,
        }
        seq = self.received.get(joined.input_id)
        received = None if seq is None else self.event_at(seq)
        if isinstance(received, InputReceived):
            inp = received.input
            out.update(
                received_seq=seq,
                content=_preview(inp.content),
                sender=inp.sender.nickname or inp.sender.user_id,
                source=inp.source,
            )
        return out

    def request(self, turn_id: str, index: int) -> dict[str, Any] | None:
        """A model call as the log records it: the call, its end, the usage payload
        recorded after it (breakdown, parts, trim facts), the turn's settings and the
        history window a fold of the log gives as of the call."""
        ordinal = self._by_turn.get(turn_id)
        if ordinal is None:
            return None
        span = self.spans[ordinal]
        opened: TurnOpened | None = None
        started: ModelCallStarted | None = None
        ended: ModelCallEnded | None = None
        usage: UsageRecorded | None = None
        for e in self.between(span.first_seq, self.span_end(span)):
            if isinstance(e, TurnOpened) and e.turn_id == turn_id:
                opened = e
            elif isinstance(e, ModelCallStarted) and e.turn_id == turn_id:
                if started is not None:
                    break  # the next call: what follows is not this one's
                if e.index == index:
                    started = e
            elif started is None:
                continue
            elif isinstance(e, ModelCallEnded) and e.turn_id == turn_id and e.index == index:
                ended = e
            elif isinstance(e, UsageRecorded) and e.usage.turn_id == turn_id and usage is None:
                usage = e
        if started is None:
            return None
        view = self.state_view(started.seq)
        limit = opened.settings.history_limit if opened is not None else 0
        window = history_window(view.history, limit)
        omitted = max(len(window) - HISTORY_SHOWN, 0)
        return {
            "session_id": self.session_id,
            "turn_id": turn_id,
            "index": index,
            "model": started.model,
            "purpose": started.purpose,
            "format_retry": started.format_retry,
            "started_seq": started.seq,
            "started_at": started.at,
            "ended_seq": None if ended is None else ended.seq,
            "status": None if ended is None else ended.status,
            "tool_calls": 0 if ended is None else ended.tool_calls,
            "error": None if ended is None else ended.error,
            "duration_ms": None if ended is None else ended.at - started.at,
            "settings": None if opened is None else msgspec.to_builtins(opened.settings),
            "batch_prefix": None if opened is None else opened.batch_prefix,
            "usage": None if usage is None else msgspec.to_builtins(usage.usage),
            "usage_seq": None if usage is None else usage.seq,
            "history_limit": limit,
            "history": [to_builtins(m) for m in window[omitted:]],
            "history_omitted": omitted,
        }

    def usage_series(self) -> dict[str, Any]:
        """Every recorded ``token:usage`` in order, as columns: one point per model call
        that recorded one (used, budget, the stacked parts, whether trimming cut in)."""
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "seq",
                "turn_id",
                "used",
                "token_budget",
                "context_window",
                "max_tokens",
                "trimmed",
                "untrimmed_history",
                "history_messages",
            )
        }
        parts: dict[str, list[int]] = {k: [] for k in BREAKDOWN_PARTS}
        for seq in self.usage_seqs:
            e = self.event_at(seq)
            assert isinstance(e, UsageRecorded)
            u = e.usage
            cols["seq"].append(seq)
            cols["turn_id"].append(u.turn_id)
            cols["used"].append(u.used)
            cols["token_budget"].append(u.token_budget)
            cols["context_window"].append(u.context_window)
            cols["max_tokens"].append(u.max_tokens)
            cols["trimmed"].append(u.trimmed)
            cols["untrimmed_history"].append(u.untrimmed_history)
            cols["history_messages"].append(u.history_messages)
            b = u.breakdown
            for k in BREAKDOWN_PARTS:
                parts[k].append(getattr(b, k))
        return {
            "session_id": self.session_id,
            "points": len(self.usage_seqs),
            **cols,
            "parts": {k: v for k, v in parts.items() if any(v)},
        }

    def state_view(self, seq: int) -> SessionView:
        """The session folded up to ``seq`` (inclusive), from the nearest checkpoint."""
        n = bisect.bisect_right(self.seqs, seq)  # events with seq <= seq
        every, cps = CHECKPOINT_EVERY, self._checkpoints
        need = n // every
        if not cps:
            cps.append(SessionView())
        while len(cps) <= need:
            k = len(cps)  # the view after k * every events
            cps.append(project(self.events[(k - 1) * every : k * every], cps[-1]))
        return project(self.events[need * every : n], cps[need])

    def state(self, seq: int) -> dict[str, Any]:
        """``state_json`` of the fold up to ``seq``, with the event there and its turn."""
        seq = max(0, min(seq, self.last_seq))
        view = self.state_view(seq)
        data = state_json(view)
        window = data["history_window"]
        omitted = max(len(window) - HISTORY_SHOWN, 0)
        data["history_window"] = window[omitted:]
        data["history_window_omitted"] = omitted
        data["seq"] = seq
        data["session_id"] = self.session_id
        event = self.event_at(seq)
        data["event"] = (
            None
            if event is None
            else {
                "seq": event.seq,
                "at": event.at,
                "type": event_tag(event),
                "text": render_event(event).strip(),
            }
        )
        span = self.span_of_seq(seq)
        data["span"] = None if span is None else {"ordinal": span.ordinal, "turn_id": span.turn_id}
        data["last_seq"] = self.last_seq
        return data
