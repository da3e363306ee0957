"""The ``EventStore`` protocol and the in-memory reference store.

A store keeps one append-only log per session. ``append`` is atomic per batch and checks
optimistic concurrency: the caller says which seq it believes is last (``expected_seq``,
0 for an empty log) and the batch must continue it without gaps. A global ``position``
(1, 2, 3, ... across all sessions) orders ``read_all``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import msgspec
from aalis_agent.events.codec import (
    decode,
    decode_rows,
    encode,
    encode_keyless,
    encode_rows,
    row_header,
)
from aalis_agent.events.errors import ConcurrencyConflict, CorruptEvent, InvalidBatch
from aalis_agent.events.schema import Event, SessionEvent

__all__ = [
    "CorruptHandler",
    "EventStore",
    "FollowOn",
    "InMemoryEventStore",
    "Recorded",
    "check_batch",
    "check_limit",
    "encode_batch",
    "encode_row",
]

CorruptHandler = Callable[[CorruptEvent], None]
"""Called with each row that does not decode; the row is then skipped."""


class Recorded(msgspec.Struct, frozen=True):
    """An event with its global position, as ``read_all`` returns it."""

    position: int
    event: SessionEvent


@runtime_checkable
class EventStore(Protocol):
    """Per-session append-only logs with a global order."""

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        """Append ``events`` atomically after ``expected_seq``; return the new last seq.

        ``open_work`` is the writer's word, stored in the same transaction, on whether the
        session has unfinished work after this batch (a running turn, inputs waiting);
        None (a writer that does not say) makes it unknown. See :meth:`open_sessions`.

        Raises :class:`ConcurrencyConflict` when the log's last seq is not
        ``expected_seq`` (nothing is written), and :class:`InvalidBatch` when an event
        names another session or its seq does not follow on.
        """
        ...

    def open_sessions(self) -> list[str]:
        """Sessions that may have unfinished work, sorted: all but those whose last
        append said ``open_work=False`` or that :meth:`mark_idle` marked. Recovery folds
        only these."""
        ...

    def mark_idle(self, sessions: Sequence[tuple[str, int]]) -> int:
        """Record ``(session, seq)`` pairs found idle when folded up to ``seq``; a session
        whose log has moved past ``seq`` is left as it is. Returns how many were marked."""
        ...

    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        """The session's events with seq > ``after_seq``, in order.

        A row that does not decode raises :class:`CorruptEvent`, or, when ``on_corrupt``
        is given, is passed to it and skipped.
        """
        ...

    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        """Events of every session with position > ``after_position``, in position order."""
        ...

    def last_seq(self, session_id: str) -> int:
        """The session's last seq (0 for an empty log)."""
        ...

    def sessions(self) -> list[str]:
        """Every session that has at least one event, sorted."""
        ...

    def close(self) -> None:
        """Release resources; the store is not used afterwards."""
        ...


def encode_batch(
    events: Iterable[SessionEvent], *, keyless: bool = False
) -> list[tuple[SessionEvent, bytes]]:
    """Encode a batch for storage, each event whole (format 1) or, with ``keyless``,
    without its session and seq (as a format-2 row holds it). Nothing unreadable is ever
    written: a value the codec cannot store, or an event that would not decode back (a
    wrong type, say ``None`` where the schema wants text), refuses the whole batch with
    :class:`InvalidBatch` naming the session, seq, event type and the problem."""
    out = []
    pack = encode_keyless if keyless else encode
    for event in events:
        where = f"session {event.session_id!r} seq {event.seq} ({type(event).__name__})"
        try:
            data = pack(event)
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise InvalidBatch(f"{where}: cannot encode event: {exc}") from None
        try:
            decode(data, session_id=event.session_id, seq=event.seq)
        except CorruptEvent as exc:
            raise InvalidBatch(f"{where}: the row would not read back: {exc.reason}") from None
        out.append((event, data))
    return out


_ROW_ERRORS = (
    msgspec.EncodeError,
    msgspec.DecodeError,  # ValidationError is one
    OverflowError,
    TypeError,
    ValueError,
)


def encode_row(events: Sequence[SessionEvent]) -> bytes:
    """The plaintext of the format-2 row holding ``events`` (:func:`codec.encode_rows
    <aalis_agent.events.codec.encode_rows>`), checked as :func:`encode_batch` checks a
    batch, with one encode and one decode for the whole row: it is decoded back as a
    reader decodes it and must give as many events. A batch that fails is refused with
    the :class:`InvalidBatch` of :func:`encode_batch` naming the event at fault (found by
    encoding the events one by one, which only a refused batch pays for)."""
    try:
        body = encode_rows(events)
        if len(decode_rows(body)) == len(events):
            return body
    except _ROW_ERRORS:
        pass
    encode_batch(events, keyless=True)  # raises, naming the event
    first = events[0]  # not empty: an empty batch encodes and reads back
    raise InvalidBatch(f"session {first.session_id!r} seq {first.seq}: the row would not read back")


def check_limit(limit: int | None) -> None:
    """Refuse a negative ``read_all`` limit."""
    if limit is not None and limit < 0:
        raise InvalidBatch(f"limit must be >= 0 or None, got {limit}")


def check_batch(session_id: str, events: Iterable[Event], expected_seq: int) -> None:
    """Refuse a batch that names another session or does not continue ``expected_seq``."""
    if expected_seq < 0:
        raise InvalidBatch(f"expected_seq must be >= 0, got {expected_seq}")
    want = expected_seq
    for event in events:
        want += 1
        if event.session_id != session_id:
            raise InvalidBatch(
                f"event seq {event.seq} belongs to session {event.session_id!r}, not {session_id!r}"
            )
        if event.seq != want:
            raise InvalidBatch(
                f"session {session_id!r}: event seq {event.seq} does not follow on; "
                f"expected seq {want}"
            )


class FollowOn:
    """Checks that the rows of one read follow on from each other, as appends leave them:
    a row deleted by hand leaves seqs no row holds, a row whose count says more than its
    place allows repeats seqs read before. Either is a :class:`CorruptEvent`."""

    __slots__ = ("_leading", "_next", "session_id")

    def __init__(self, session_id: str, after_seq: int) -> None:
        self.session_id = session_id
        self._next = max(after_seq, 0) + 1
        self._leading = True  # the read's first row may hold seqs from before, too

    def fault(self, first: int, last: int) -> CorruptEvent | None:
        """What is wrong with the row of seqs ``first`` to ``last`` read next, None when
        it follows on. A fault at a seq before ``first`` says seqs are missing before the
        row (its events are good); one at ``first`` is the row itself, which repeats seqs
        read before (its events are not to be read)."""
        expected, leading = self._next, self._leading
        self.skip(last)
        if first > expected:
            return self.missing(expected, first - 1)
        if first < expected and not leading:
            return CorruptEvent(
                self.session_id,
                first,
                f"a row of seqs {first}-{last} repeats seqs up to {expected - 1}, read before",
            )
        return None

    def skip(self, last: int) -> None:
        """A row ending at ``last`` that could not be read (reported as corrupt)."""
        self._next = max(self._next, last + 1)
        self._leading = False

    def unread(self, exc: CorruptEvent, last: int, data: object) -> CorruptEvent:
        """:meth:`skip` of the row ``data`` ending at ``last``, which raised ``exc``; the
        error to report for it. When no row holds the seqs just before it (rows deleted
        by hand, the next one continuing their group, so it cannot be read either), that
        is ``exc`` saying which seqs are missing too; else ``exc`` itself."""
        expected = self._next
        self.skip(last)
        header = row_header(data)
        if header is None:
            first = last  # a row of one event
        elif 1 <= header[1] <= last:
            first = last - header[1] + 1
        else:
            return exc  # a damaged count: where the row starts is not known
        if first <= expected:
            return exc
        span = f"seqs {expected}-{first - 1} are" if first - 1 > expected else f"seq {expected} is"
        reason = f"{exc.reason}; {span} missing (rows deleted?)"
        return CorruptEvent(exc.session_id, exc.seq, reason)

    def end(self, last_seq: int) -> CorruptEvent | None:
        """Seqs missing at the end when the log says it ends at ``last_seq``."""
        if last_seq < self._next:
            return None
        return self.missing(self._next, last_seq)

    def missing(self, first: int, last: int) -> CorruptEvent:
        span = f"seq {first} missing: no row holds it"
        if last > first:
            span = f"seqs {first}-{last} missing: no row holds them"
        return CorruptEvent(self.session_id, first, span)


class InMemoryEventStore:
    """The reference store: encoded events in dicts and lists behind one lock. Not durable.

    Events are kept encoded (one by one, in row format 1), as the SQLite store keeps
    them encoded (a batch per row, in row format 2), so that a caller changing a dict
    inside an event it appended or read cannot rewrite history, and so that both stores
    give back exactly the same values.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: dict[str, list[bytes]] = {}
        self._all: list[tuple[str, int, bytes]] = []
        self._idle: set[str] = set()

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        check_batch(session_id, events, expected_seq)
        encoded = encode_batch(events)
        with self._lock:
            log = self._logs.get(session_id)
            actual = len(log) if log else 0
            if actual != expected_seq:
                raise ConcurrencyConflict(session_id, expected_seq, actual)
            if not encoded:
                return actual
            if log is None:
                log = self._logs[session_id] = []
            log.extend(blob for _, blob in encoded)
            self._all.extend((session_id, e.seq, blob) for e, blob in encoded)
            if open_work is False:
                self._idle.add(session_id)
            else:
                self._idle.discard(session_id)
            return len(log)

    def open_sessions(self) -> list[str]:
        with self._lock:
            return sorted(s for s in self._logs if s not in self._idle)

    def mark_idle(self, sessions: Sequence[tuple[str, int]]) -> int:
        marked = 0
        with self._lock:
            for session_id, seq in sessions:
                log = self._logs.get(session_id)
                if log and len(log) == seq:
                    self._idle.add(session_id)
                    marked += 1
        return marked

    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        with self._lock:
            log = self._logs.get(session_id)
            blobs: list[bytes] = log[max(after_seq, 0) :] if log else []
        first = max(after_seq, 0) + 1
        return [decode(b, session_id=session_id, seq=first + i) for i, b in enumerate(blobs)]

    def read_range(
        self,
        session_id: str,
        after_seq: int,
        until_seq: int,
        *,
        on_corrupt: CorruptHandler | None = None,
    ) -> list[SessionEvent]:
        """:meth:`read`, only the events with seq up to ``until_seq`` (an extra of the
        stores here, not of the protocol: a reader of one event need not read the rest)."""
        with self._lock:
            log = self._logs.get(session_id)
            blobs: list[bytes] = log[max(after_seq, 0) : max(until_seq, 0)] if log else []
        first = max(after_seq, 0) + 1
        return [decode(b, session_id=session_id, seq=first + i) for i, b in enumerate(blobs)]

    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        check_limit(limit)
        with self._lock:
            start = max(after_position, 0)
            stop = len(self._all) if limit is None else min(len(self._all), start + limit)
            rows = self._all[start:stop]
        return [
            Recorded(start + i + 1, decode(blob, session_id=sid, seq=seq))
            for i, (sid, seq, blob) in enumerate(rows)
        ]

    def last_seq(self, session_id: str) -> int:
        with self._lock:
            log = self._logs.get(session_id)
            return len(log) if log else 0

    def sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._logs)

    def session_page(self, offset: int, limit: int) -> tuple[int, list[tuple[str, int, bool]]]:
        """A page of :meth:`sessions`: how many there are, and ``limit`` from the
        ``offset``-th, each as (id, last seq, open work as :meth:`open_sessions` says)."""
        offset, limit = max(offset, 0), max(limit, 0)
        with self._lock:
            names = sorted(self._logs)
            return len(names), [
                (n, len(self._logs[n]), n not in self._idle) for n in names[offset : offset + limit]
            ]

    def close(self) -> None:
        """Nothing to release."""
