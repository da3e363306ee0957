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

import base64
import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aalis_agent.events import (
    ChatMessage,
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
from aalis_agent.events.codec import clean_text, clean_value, event_tag
from aalis_agent.projections import SessionView, project
from aalis_agent.projections.history import history_window
from aalis_agent.timeline import render_event, state_json

__all__ = [
    "BREAKDOWN_PARTS",
    "CHECKPOINT_EVERY",
    "CORRUPT_SHOWN",
    "CUT_PLACES",
    "DEPTH",
    "EVENTS_BYTES",
    "EVENT_BYTES",
    "EVENT_TEXT",
    "HISTORY_BYTES",
    "HISTORY_SHOWN",
    "PAGE_BYTES",
    "PATH_CHARS",
    "PREVIEW",
    "QUEUE_SHOWN",
    "TAIL_LINES",
    "TURN_ITEMS",
    "TURN_LIST_BYTES",
    "USAGE_ID",
    "USAGE_POINTS",
    "VALUE_BYTES",
    "SessionIndex",
    "TurnSpan",
    "clip",
]

PREVIEW = 400
"""Characters of a text shown in a timeline page, a history window, a request's settings
or a state's queue; a longer one is cut there, its whole length in the answer's ``cut``.
The events endpoint has it whole."""

HISTORY_SHOWN = 300
"""Messages of a history window sent at most (the newest); the rest are counted."""

HISTORY_BYTES = 1_000_000
"""JSON bytes of the history window's messages in a state or request answer: the newest
that fit (always at least one); the rest are counted with those past
:data:`HISTORY_SHOWN`."""

VALUE_BYTES = 64_000
"""JSON bytes of one value from the log as an answer shows it (a turn's settings, a
message, a usage payload, the running turn, one entry of a turn's list): once its texts
and numbers have spent this, the rest of each list or mapping in it is left out and
counted in ``cut``."""

DEPTH = 16
"""Levels of nesting of a value from the log an answer shows; deeper lists and mappings
are shown empty, their size in ``cut``."""

TURN_ITEMS = 50
"""Entries of each of a turn's lists (inputs, model calls, tool calls, stops, markers,
replies) a timeline page shows at most: the first, in log order; ``<list>_omitted`` counts
the rest, which the events API has."""

TURN_LIST_BYTES = 64_000
"""JSON bytes of each of a turn's lists in a timeline page: the first entries that fit
(always at least one), counted in ``<list>_omitted`` past that."""

PAGE_BYTES = 1_000_000
"""JSON bytes of the turns of one timeline page: a page holds fewer turns than asked for
once they pass this (always at least one); ``next_offset`` says where the next one starts."""

QUEUE_SHOWN = 100
"""Input ids of the queue (and of the pending inserts) a state answer lists at most: the
first, in queue order; ``queued_omitted`` and ``pending_omitted`` count the rest."""

EVENT_TEXT = 20_000
"""Characters of a text in an events page's event data; a longer one is cut, its length in
the event's ``cut``, and ``whole=1`` fetches that one event whole."""

EVENT_BYTES = 256_000
"""JSON bytes of one event's data in an events page (as :data:`VALUE_BYTES` is for the
other answers)."""

EVENTS_BYTES = 2_000_000
"""JSON bytes of the events of one events page: the first that fit (always at least one);
``next_from`` says where the next page starts."""

USAGE_ID = 100
"""Characters of a turn id in the token-usage series."""

USAGE_POINTS = 6_000
"""Points of the token-usage series an answer carries at most. Past it, the recorded
calls are split into ``USAGE_POINTS // 3`` stretches of equal length and each stretch
keeps its points of least and most ``used`` and its first trimmed one, in log order: the
chart keeps its peaks, troughs and trims. ``points_total`` counts every call and
``index`` numbers the calls shown (1 is the first recorded)."""

CUT_PLACES = 100
"""Cut places one value's ``cut`` map names at most; past them, its ``"…"`` entry counts
the others."""

PATH_CHARS = 200
"""Characters of a path in a ``cut`` map (keys in it are cut to 40 each)."""

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


CORRUPT_SHOWN = 100
"""Rows that do not decode a timeline page's summary lists at most (the first, in seq
order), each reason cut to :data:`PREVIEW` characters; ``corrupt_omitted`` counts the
rest."""

TAIL_LINES = 500
"""The most events after the last turn a timeline page carries (each line cut to
:data:`PREVIEW` characters)."""

ANSWER_BOUND = 4_000_000
"""What the caps above hold every answer to, in JSON bytes, whatever the log holds.

A timeline page is at most :data:`PAGE_BYTES` and one more turn (each of its six lists
at most :data:`TURN_LIST_BYTES` and one entry, its own fields a :data:`VALUE_BYTES` each:
about 0.5 MB) and :data:`TAIL_LINES` lines of :data:`PREVIEW` characters (0.8 MB at 4
bytes a character); a state or request answer at most :data:`HISTORY_BYTES` and one
message, a few values of :data:`VALUE_BYTES` and the queues' :data:`QUEUE_SHOWN` ids; an
events page :data:`EVENTS_BYTES` and one event of :data:`EVENT_BYTES`: about 2.5 MB at
most (a timeline page's summary adds :data:`CORRUPT_SHOWN` rows that do not decode, each
reason :data:`PREVIEW` characters: 0.16 MB). On logs built to hit every cap (every text
of control characters, six JSON bytes each; every list long) the largest answers
measured are an events page of 1.99 MB, a timeline page with its tail of 1.5 MB, a state
of 1.25 MB and a request of 1.07 MB.

The token-usage series carries at most :data:`USAGE_POINTS` points of about 20 numbers
and a turn id cut to :data:`USAGE_ID` characters: about 1 MB, 4 MB if every turn id were
100 control characters. One answer is left out: the events page with ``whole=1`` carries
one event whole, as large as the log made it (the way to a whole value)."""


def _preview(text: str | None, width: int = PREVIEW) -> str | None:
    if text is None or len(text) <= width:
        return text
    return text[: width - 1] + "…"


def _json_len(value: Any) -> int:
    """Bytes of ``value`` as JSON (cleaned of lone surrogates as the server cleans it)."""
    try:
        return len(msgspec.json.encode(value))
    except UnicodeEncodeError:
        return len(msgspec.json.encode(clean_value(value)))


def clip(
    value: Any,
    *,
    text: int = PREVIEW,
    budget: int = VALUE_BYTES,
    depth: int = DEPTH,
) -> tuple[Any, dict[str, int]]:
    """``value`` (plain data: dicts, lists, texts, numbers) as an answer shows it, and
    what was cut of it.

    Every text longer than ``text`` characters is cut to a preview ending in "…". The
    value is walked breadth first (its own fields before what is nested in them, so one
    long list cannot crowd out the fields after it) until the texts, keys and numbers
    shown (and the cut map) have spent ``budget`` JSON bytes: each list or mapping then
    keeps the entries it has so far. Lists and mappings nested deeper than ``depth`` are
    shown empty. ``cut`` maps the path of each cut place (``a.b[2]``, as
    :func:`~aalis_agent.request.limits.show_path` writes one; ``""`` is the value itself)
    to its whole size: characters for a text, entries for a list or mapping; at most
    :data:`CUT_PLACES` of them. Texts are cleaned of lone surrogates, so the answer always
    encodes. The work is bounded by ``budget`` too, however large the value."""
    cut: dict[str, int] = {}
    spent = 0
    nodes = budget // 3 + 1  # every entry spends at least 3 bytes: none past this is shown
    top: dict[str, Any] = {}

    def mark(path: str, size: int) -> None:
        """A cut place, spending its bytes too; past :data:`CUT_PLACES` only counted."""
        nonlocal spent
        if path in cut:
            return
        if len(cut) >= CUT_PLACES:
            cut["…"] = cut.get("…", 0) + 1
            return
        cut[path] = size
        spent += _json_len(path) + 12

    # (value, where it goes, its key there, its path, its level, the parent's path, size)
    todo: deque[tuple[Any, Any, Any, str, int, str, int]] = deque([(value, top, "", "", 0, "", 0)])
    while todo:
        v, into, key, path, level, parent, size = todo.popleft()
        if spent >= budget and level > 0:
            mark(parent, size)  # this entry and all after it are left out of its parent
            continue
        spent += 1  # the comma before it
        if isinstance(into, dict) and level > 0:
            spent += _json_len(key) + 1
        shown: Any
        if not isinstance(v, str | dict | list | tuple):
            v = _plain(v)
        if isinstance(v, str):
            shown = clean_text(v if len(v) <= text else v[: text - 1] + "…")
            spent += _json_len(shown)
            if len(v) > text:
                mark(path, len(v))
        elif isinstance(v, dict | list | tuple):
            mapping = isinstance(v, dict)
            shown = {} if mapping else []
            spent += 2
            n = len(v)
            room = 0 if level >= depth else min(n, nodes)
            nodes -= room
            if room < n:
                mark(path, n)
            pairs: Iterable[tuple[Any, Any]] = v.items() if isinstance(v, dict) else enumerate(v)
            taken: set[str] = set()
            for k, x in itertools.islice(pairs, room):
                if mapping:
                    # A key is shown as a text is (cut past ``text`` characters, its whole
                    # length in ``cut``); two that come out the same are told apart by
                    # " #2", " #3"..., so no entry is lost. Paths cut keys to 40.
                    whole = k if isinstance(k, str) else _key_text(k)
                    k = clean_text(whole if len(whole) <= text else whole[: text - 1] + "…")
                    if k in taken:
                        base = k
                        k = next(
                            f"{base} #{i}"
                            for i in itertools.count(2)
                            if f"{base} #{i}" not in taken
                        )
                    taken.add(k)
                    label = _preview(k, 40) or ""
                    name = f"{path}.{label}" if path else label
                    if len(whole) > text:
                        mark(f"{name} (key)", len(whole))
                else:
                    name = f"{path}[{k}]"
                if len(name) > PATH_CHARS:
                    name = name[: PATH_CHARS - 1] + "…"
                todo.append((x, shown, k, name, level + 1, path, n))
        else:
            shown = v  # None, a bool or a number of at most 32 JSON bytes (see _plain)
            spent += _json_len(v)
        if isinstance(into, list):
            into.append(shown)
        else:
            into[key] = shown
    return top[""], cut


def _plain(v: Any) -> Any:
    """A value neither text nor a list or mapping as :func:`clip` shows it: None, a bool or
    a number whose JSON is at most 32 bytes as it is; anything else as text, cut as a
    text is: bytes in base64 (as the JSON encoder writes them), a longer number as its
    digits, another type as its JSON text, or its ``repr`` when it has none."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(v)).decode("ascii")
    try:
        encoded = msgspec.json.encode(v)
    except (TypeError, ValueError, OverflowError):
        try:
            return repr(v)
        except ValueError:  # an int past the interpreter's digit limit
            return f"<{type(v).__name__}>"
    if isinstance(v, int | float):
        return v if len(encoded) <= 32 else encoded.decode()
    return msgspec.json.decode(encoded)


def _key_text(key: Any) -> str:
    """A mapping's key that is not text, as JSON writes it (a key must be text there)."""
    plain = _plain(key)
    return plain if isinstance(plain, str) else msgspec.json.encode(plain).decode()


def _clip_fields(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """Each of an answer's own fields clipped on its own (each with the whole
    :data:`VALUE_BYTES`), and what was cut, by path from the answer (``settings.persona``)."""
    out: dict[str, Any] = {}
    cut: dict[str, int] = {}
    for name, value in fields.items():
        out[name], inner = clip(value)
        cut.update({f"{name}.{k}" if k else name: n for k, n in inner.items()})
    return out, cut


def _entry(value: dict[str, Any], **limits: int) -> dict[str, Any]:
    """A dict the answer lists, clipped, with its ``cut`` inside when anything was cut."""
    shown: dict[str, Any]
    shown, cut = clip(value, **limits)
    if cut:
        shown["cut"] = cut
    return shown


def _fit(
    entries: Sequence[dict[str, Any]], most: int, budget: int, **limits: int
) -> list[dict[str, Any]]:
    """The first entries, clipped, while there are at most ``most`` and their JSON is
    within ``budget`` bytes (at least one, when any)."""
    out: list[dict[str, Any]] = []
    spent = 0
    for raw in entries[:most]:
        shown = _entry(raw, **limits)
        spent += _json_len(shown) + 1
        if out and spent > budget:
            break
        out.append(shown)
    return out


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
    saved: dict[str, list[int]] = field(default_factory=dict)  # message id -> seqs saved
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
        elif isinstance(event, MessageSaved | StopMarkerSaved):
            self.saved.setdefault(event.message.id, []).append(seq)

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
        """A page of turns, ``limit`` from the ``offset``-th (negative: from the end),
        fewer once their JSON passes :data:`PAGE_BYTES` (at least one): ``next_offset``
        is where the next page starts (None after the last turn)."""
        total = len(self.spans)
        if offset < 0:
            offset = max(total + offset, 0)
        offset = min(offset, total)
        turns: list[dict[str, Any]] = []
        spent = 0
        for span in self.spans[offset : offset + limit]:
            summary = self.turn_summary(span)
            spent += _json_len(summary) + 1
            if turns and spent > PAGE_BYTES:
                break
            turns.append(summary)
        end = offset + len(turns)
        tail = self.tail()
        return {
            "session_id": self.session_id,
            "last_seq": self.last_seq,
            "turns_total": total,
            "offset": offset,
            "limit": limit,
            "next_offset": end if end < total else None,
            "turns": turns,
            "tail": None if tail is None or end < total else self._tail(*tail),
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

    @staticmethod
    def _line(e: SessionEvent) -> dict[str, Any]:
        """An event as one line of text, cut to :data:`PREVIEW` characters (its ids and a
        setting's value come from the log as they are), the whole length in ``cut``."""
        text = render_event(e).strip()
        line: dict[str, Any] = {"seq": e.seq, "at": e.at, "type": event_tag(e)}
        line["text"] = clean_text(_preview(text) or "")
        if len(text) > PREVIEW:
            line["cut"] = {"text": len(text)}
        return line

    def events_page(
        self, first: int, last: int, limit: int, *, whole: bool = False
    ) -> dict[str, Any]:
        """Events ``first..last`` (at most ``limit``), each as a line and as data, the
        first that fit in :data:`EVENTS_BYTES` (at least one); each event's data cut as
        :func:`clip` cuts (texts to :data:`EVENT_TEXT` characters, the event to
        :data:`EVENT_BYTES`), what was cut in its ``cut`` (``data.message.content``).
        ``next_from`` is the seq the next page starts at (None when the range is done).
        With ``whole``, only the first event of the range, its line and data whole: the
        one answer as large as the log made it."""
        chosen = self.between(first, last)[: 1 if whole else limit]
        events: list[dict[str, Any]] = []
        spent = 0
        for e in chosen:
            line = self._line(e)
            if whole:
                line.pop("cut", None)
                line.update(text=render_event(e).strip(), data=to_builtins(e))
            else:
                line["data"], cut = clip(to_builtins(e), text=EVENT_TEXT, budget=EVENT_BYTES)
                if cut:
                    cuts: dict[str, int] = line.setdefault("cut", {})
                    cuts.update({f"data.{k}" if k else "data": n for k, n in cut.items()})
            spent += _json_len(line) + 1
            if events and spent > EVENTS_BYTES:
                break
            events.append(line)
        following = self.between(events[-1]["seq"] + 1, last)[:1] if events else []
        return {
            "session_id": self.session_id,
            "last_seq": self.last_seq,
            "next_from": following[0].seq if following else None,
            "events": events,
        }

    def turn_summary(self, span: TurnSpan) -> dict[str, Any]:
        """A turn as the timeline shows it: inputs with their entry mode, model calls
        (with the usage recorded after each), tool calls by callId, stops and markers,
        replies and the outcome.

        Each list holds its first :data:`TURN_ITEMS` entries that fit in
        :data:`TURN_LIST_BYTES` (``<list>_omitted`` counts the rest); texts are cut to
        :data:`PREVIEW` characters, an entry's ``cut`` giving their whole lengths, and the
        turn's ``cut`` does the same for its own fields (``settings.persona``, say)."""
        turn_id = span.turn_id
        end = self.span_end(span)
        opened: TurnOpened | None = None
        inputs: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        tools: list[dict[str, Any]] = []
        open_tools: dict[str, list[dict[str, Any]]] = {}  # callId -> started, not finished
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
                tool = {
                    "call_id": e.call_id,
                    "name": e.name,
                    "arguments": e.arguments,
                    "started_seq": e.seq,
                    "started_at": e.at,
                    "finished_seq": None,
                    "result": None,
                    "error": None,
                    "duration_ms": None,
                }
                tools.append(tool)
                open_tools.setdefault(e.call_id, []).append(tool)
            elif isinstance(e, ToolFinished) and e.turn_id == turn_id:
                waiting = open_tools.get(e.call_id)
                if waiting:  # the latest started with this callId and not finished
                    t = waiting.pop()
                    t.update(
                        finished_seq=e.seq,
                        result=e.result,
                        error=e.error,
                        duration_ms=e.at - t["started_at"],
                    )
            elif isinstance(e, StopRequested) and e.turn_id == turn_id:
                stops.append({"seq": e.seq, "by": e.by, "reason": e.reason})
            elif isinstance(e, StopMarkerSaved) and e.turn_id == turn_id:
                m = e.message
                markers.append({"seq": e.seq, "kind": m.kind, "content": m.content})
            elif isinstance(e, MessageSaved) and e.message.meta.turn_id == turn_id:
                m = e.message
                if m.kind is not None:
                    markers.append({"seq": e.seq, "kind": m.kind, "content": m.content})
                elif m.role == "assistant" and not m.tool_calls:
                    replies.append({"seq": e.seq, "content": m.content})
            elif isinstance(e, TurnRecorded) and e.turn_id == turn_id:
                record = e
            else:
                other += 1
        own, cut = _clip_fields(
            {
                "turn_id": turn_id,
                "source": None if opened is None else opened.source,
                "platform": None if opened is None else opened.platform,
                "reason": None if record is None else record.reason,
                "settings": None if opened is None else msgspec.to_builtins(opened.settings),
            }
        )
        out: dict[str, Any] = {
            "ordinal": span.ordinal,
            "turn_id": own["turn_id"],
            "first_seq": span.first_seq,
            "last_seq": end,
            "opened_seq": span.opened_seq,
            "opened_at": None if opened is None else opened.at,
            "source": own["source"],
            "platform": own["platform"],
            "from_queue": False if opened is None else opened.from_queue,
            "settings": own["settings"],
        }
        for name, entries in (
            ("inputs", inputs),
            ("model_calls", calls),
            ("tool_calls", tools),
            ("stops", stops),
            ("markers", markers),
            ("replies", replies),
        ):
            shown = _fit(entries, TURN_ITEMS, TURN_LIST_BYTES)
            out[name] = shown
            out[f"{name}_omitted"] = len(entries) - len(shown)
        out.update(
            {
                "outcome": None if record is None else record.outcome,
                "reason": own["reason"],
                "duration_ms": None if record is None else record.duration_ms,
                "recorded_seq": None if record is None else record.seq,
                "running": record is None and span.last_seq is None,
                "cut_off": record is None and span.last_seq is not None,
                "other_events": other,
                "cut": cut,
            }
        )
        return out

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
                content=inp.content,
                sender=inp.sender.nickname or inp.sender.user_id,
                source=inp.source,
            )
        return out

    def _history(self, window: Sequence[ChatMessage], seq: int) -> tuple[list[Any], int]:
        """The newest messages of a history window an answer shows: at most
        :data:`HISTORY_SHOWN`, within :data:`HISTORY_BYTES` (at least one), each cut as
        :func:`clip` cuts; a message with something cut has its ``cut`` and the
        ``saved_seq`` of the event that holds it whole. And how many are left out."""
        shown: list[dict[str, Any]] = []
        spent = 0
        for m in reversed(window[-HISTORY_SHOWN:]):
            data, cut = clip(to_builtins(m))
            if cut:
                data["cut"] = cut
                seqs = self.saved.get(m.id, [])
                i = bisect.bisect_right(seqs, seq)
                data["saved_seq"] = seqs[i - 1] if i else None
            spent += _json_len(data) + 1
            if shown and spent > HISTORY_BYTES:
                break
            shown.append(data)
        shown.reverse()
        return shown, len(window) - len(shown)

    def request(self, turn_id: str, index: int) -> dict[str, Any] | None:
        """A model call as the log records it: the call, its end, the usage payload
        recorded after it (breakdown, parts, trim facts), the turn's settings and the
        history window a fold of the log gives as of the call.

        Bounded as the timeline is: the history is its newest messages (see
        :meth:`_history`; ``history_omitted`` counts the rest), and the call's own
        texts, the settings and the usage payload are cut as :func:`clip` cuts, their
        whole sizes in ``cut`` (``settings.persona``, ``usage.breakdown.injectors``)."""
        ordinal = self._by_turn.get(turn_id)
        if ordinal is None:
            return None
        return self.request_at(ordinal, index)

    def no_call(self, index: int, *, turn_id: str | None = None, ordinal: int = 0) -> str:
        """Why :meth:`request` (by ``turn_id``) or :meth:`request_at` (by ``ordinal``)
        found no call: the answer's message, naming what is not there."""
        if turn_id is not None:
            if turn_id not in self._by_turn:
                return f"no turn {turn_id[:80]!r} in this session"
        elif not 0 <= ordinal < len(self.spans):
            turns = len(self.spans)
            have = f"ordinals 0 to {turns - 1}" if turns else "none"
            return f"no turn at ordinal {ordinal}: the session has {turns} turn(s) ({have})"
        else:
            turn_id = self.spans[ordinal].turn_id
        return f"turn {turn_id[:80]!r} has no model call {index} (calls count from 1)"

    def request_at(self, ordinal: int, index: int) -> dict[str, Any] | None:
        """:meth:`request` of the turn at ``ordinal`` (its place in the timeline, as
        ``ordinal`` there says): the page asks this way, since an id too long to be
        shown whole is cut in the timeline and could not be asked for by it."""
        if not 0 <= ordinal < len(self.spans):
            return None
        span = self.spans[ordinal]
        turn_id = span.turn_id
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
        history, omitted = self._history(window, started.seq)
        own, cut = _clip_fields(
            {
                "turn_id": turn_id,
                "model": started.model,
                "purpose": started.purpose,
                "error": None if ended is None else ended.error,
                "batch_prefix": None if opened is None else opened.batch_prefix,
                "settings": None if opened is None else msgspec.to_builtins(opened.settings),
                "usage": None if usage is None else to_builtins(usage.usage),
            }
        )
        return {
            "session_id": self.session_id,
            "turn_id": own["turn_id"],
            "index": index,
            "model": own["model"],
            "purpose": own["purpose"],
            "format_retry": started.format_retry,
            "started_seq": started.seq,
            "started_at": started.at,
            "ended_seq": None if ended is None else ended.seq,
            "status": None if ended is None else ended.status,
            "tool_calls": 0 if ended is None else ended.tool_calls,
            "error": own["error"],
            "duration_ms": None if ended is None else ended.at - started.at,
            "settings": own["settings"],
            "batch_prefix": own["batch_prefix"],
            "usage": own["usage"],
            "usage_seq": None if usage is None else usage.seq,
            "history_limit": limit,
            "history": history,
            "history_omitted": omitted,
            "cut": cut,
        }

    def _usage_shown(self) -> list[int]:
        """Which recorded usages the series shows (positions in :attr:`usage_seqs`): all
        of them, or past :data:`USAGE_POINTS` each stretch's least, most and first
        trimmed (see there)."""
        n = len(self.usage_seqs)
        if n <= USAGE_POINTS:
            return list(range(n))
        usages: list[Any] = []
        for seq in self.usage_seqs:
            e = self.event_at(seq)
            assert isinstance(e, UsageRecorded)
            usages.append(e.usage)
        stretches = USAGE_POINTS // 3
        shown: list[int] = []
        for k in range(stretches):
            lo, hi = k * n // stretches, (k + 1) * n // stretches
            least = most = lo
            trimmed = -1
            for i in range(lo, hi):
                used = usages[i].used
                if used < usages[least].used:
                    least = i
                if used > usages[most].used:
                    most = i
                if trimmed < 0 and usages[i].trimmed:
                    trimmed = i
            shown.extend(sorted({least, most, *([trimmed] if trimmed >= 0 else [])}))
        return shown

    def usage_series(self) -> dict[str, Any]:
        """The recorded ``token:usage`` points in order, as columns: one point per model
        call that recorded one (used, budget, the stacked parts, whether trimming cut
        in), at most :data:`USAGE_POINTS` of them (see there: ``points_total``,
        ``index``). Turn ids are cut to :data:`USAGE_ID` characters."""
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
        shown = self._usage_shown()
        for i in shown:
            seq = self.usage_seqs[i]
            e = self.event_at(seq)
            assert isinstance(e, UsageRecorded)
            u = e.usage
            cols["seq"].append(seq)
            cols["turn_id"].append(
                u.turn_id if u.turn_id is None else clean_text(_preview(u.turn_id, USAGE_ID) or "")
            )
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
            "points": len(shown),
            "points_total": len(self.usage_seqs),
            "index": [i + 1 for i in shown],
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
        """``state_json`` of the fold up to ``seq``, with the event there and its turn.

        Bounded as the timeline is: the history window is its newest messages (see
        :meth:`_history`; ``history_window_omitted`` counts the rest), the queue and the
        pending inserts their first :data:`QUEUE_SHOWN` ids (``queued_omitted``,
        ``pending_omitted``), and the running turn, the settings and the event's line are
        cut as :func:`clip` cuts, their whole sizes in ``cut`` (``settings.persona``,
        ``running_turn.joined``), and so is a deletion or clear begun and not finished
        (``winding_down``: its kind and a clear's kinds)."""
        seq = max(0, min(seq, self.last_seq))
        view = self.state_view(seq)
        data = state_json(view)
        window = history_window(view.history, data["history_limit"])
        data["history_window"], data["history_window_omitted"] = self._history(window, seq)
        for name in ("queued", "pending"):
            ids = data[name]
            data[name] = [clean_text(_preview(i) or "") for i in ids[:QUEUE_SHOWN]]
            data[f"{name}_omitted"] = max(len(ids) - QUEUE_SHOWN, 0)
        event = self.event_at(seq)
        span = self.span_of_seq(seq)
        own, cut = _clip_fields(
            {
                "text": None if event is None else render_event(event).strip(),
                "turn_id": None if span is None else span.turn_id,
                "settings": data["settings"],
                "running_turn": data["running_turn"],
                "winding_down": data["winding_down"],
            }
        )
        data["running_turn"], data["settings"] = own["running_turn"], own["settings"]
        data["winding_down"] = own["winding_down"]
        data["seq"] = seq
        data["session_id"] = self.session_id
        data["event"] = (
            None
            if event is None
            else {"seq": event.seq, "at": event.at, "type": event_tag(event), "text": own["text"]}
        )
        data["span"] = (
            None if span is None else {"ordinal": span.ordinal, "turn_id": own["turn_id"]}
        )
        data["last_seq"] = self.last_seq
        data["cut"] = {
            ("event.text" if k == "text" else "span.turn_id" if k == "turn_id" else k): n
            for k, n in cut.items()
        }
        return data
