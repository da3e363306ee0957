"""``PostgresEventStore``: session logs in a PostgreSQL database, for several processes or
machines sharing one log.

Layout (created on first use, in the connection's ``search_path`` schema):

* ``aalis_head`` holds one row: the last global ``position`` handed out, and the layout's
  ``format``. Every append updates it, so appends take their positions one after the
  other and commit in that order: positions have no gaps, and a reader never sees a
  position before every smaller one is visible.
* ``aalis_sessions (sid, name, last_seq, idle)``: one row per session that has events.
  ``name`` is the session id in UTF-8 (``bytea``: an id may hold any character, NUL
  included, and sorts by code point). ``last_seq`` is the concurrency check: an append
  updates the row only where it still holds the seq the writer expected, under the
  row's lock. ``idle`` is the writer's word on unfinished work (see ``open_sessions``).
* ``aalis_log (sid, seq, position, data)``: one row per appended batch, keyed by
  ``(sid, seq)``; ``seq`` and ``position`` are those of the batch's last event, ``data``
  the events in row format 2 (see :mod:`aalis_agent.events.codec`), each row starting its
  own group: it reads without the rows before it. A row in format 1 (one event encoded
  whole), or one continuing a group (copied from a SQLite file), is read too.

An append is one call of the function ``aalis_append``, hence one statement and one
transaction: the session row, the head and the log row change together or not at all.

Connections fail: a server restart leaves every idle pooled connection dead, and a cut
can come after the server committed an append but before its answer arrived. A call
whose connection broke runs once more on a fresh one (the pool's idle connections are
checked first). An append whose connection broke is settled before anything is said:
the log is read on a fresh connection, and the batch counts as written when the row at
its last seq holds its bytes; when the log still ends where the writer expected, the
batch is written now (the seq check keeps it from landing twice); only when the server
cannot be reached to settle it is the append a :class:`StoreError` that says its fate
is unknown. After an outage the pool reconnects with a backoff that doubles; until it
has a connection to give again, calls connect for themselves (at most ``max_size`` at
once). Statements are bounded (``statement_timeout_s``) and connections send TCP
keepalives and give up on data unacknowledged for 30 s, so a held lock or a vanished
server ends in an error, not a wait forever; a server that accepts connections but
never answers still makes a call wait.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from aalis_agent.events.codec import RowReader, pack_row, row_header
from aalis_agent.events.errors import (
    ConcurrencyConflict,
    CorruptEvent,
    InvalidBatch,
    StoreError,
)
from aalis_agent.events.schema import SessionEvent
from aalis_agent.events.store import (
    CorruptHandler,
    FollowOn,
    Recorded,
    check_batch,
    check_limit,
    encode_batch,
)
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

__all__ = [
    "PG_FORMAT",
    "PostgresEventStore",
    "error_line",
    "keepalive_options",
    "redact_url",
    "session_key",
]

PG_FORMAT = 1
"""The layout's format, in ``aalis_head.format``."""
_SCHEMA_LOCK = 0x6161_6C69_7300  # advisory lock key: one process creates the tables

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS aalis_head ("
    " id boolean PRIMARY KEY DEFAULT true CHECK (id),"
    " position bigint NOT NULL, format integer NOT NULL)",
    f"INSERT INTO aalis_head (id, position, format) VALUES (true, 0, {PG_FORMAT}) "
    "ON CONFLICT (id) DO NOTHING",
    "CREATE TABLE IF NOT EXISTS aalis_sessions ("
    " sid bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " name bytea NOT NULL UNIQUE,"
    " last_seq bigint NOT NULL CHECK (last_seq > 0),"
    " idle boolean NOT NULL DEFAULT false)",
    "CREATE TABLE IF NOT EXISTS aalis_log ("
    " sid bigint NOT NULL, seq bigint NOT NULL,"
    " position bigint NOT NULL UNIQUE, data bytea NOT NULL,"
    " PRIMARY KEY (sid, seq))",
    # Returns the batch's last position, or -1 - (the session's last seq) when the log
    # is not at p_expected (nothing written). Each statement of a function sees what
    # committed before it, so the seq reported on a conflict is the winner's.
    """CREATE OR REPLACE FUNCTION aalis_append(
        p_name bytea, p_expected bigint, p_count integer, p_idle boolean, p_data bytea)
    RETURNS bigint LANGUAGE plpgsql AS $$
    DECLARE
        v_sid bigint;
        v_position bigint;
        v_last bigint := p_expected + p_count;
    BEGIN
        IF p_expected = 0 THEN
            INSERT INTO aalis_sessions (name, last_seq, idle) VALUES (p_name, v_last, p_idle)
                ON CONFLICT (name) DO NOTHING RETURNING sid INTO v_sid;
        ELSE
            UPDATE aalis_sessions SET last_seq = v_last, idle = p_idle
                WHERE name = p_name AND last_seq = p_expected RETURNING sid INTO v_sid;
        END IF;
        IF v_sid IS NULL THEN
            RETURN -1 - coalesce(
                (SELECT last_seq FROM aalis_sessions WHERE name = p_name), 0);
        END IF;
        UPDATE aalis_head SET position = position + p_count
            RETURNING position INTO v_position;
        INSERT INTO aalis_log (sid, seq, position, data)
            VALUES (v_sid, v_last, v_position, p_data);
        RETURN v_position;
    END $$""",
)
_TABLES = ("aalis_head", "aalis_sessions", "aalis_log")
_APPEND = "SELECT aalis_append(%s, %s, %s, %s, %s)"
_SID = "SELECT sid FROM aalis_sessions WHERE name = %s"
_LAST_SEQ = "SELECT last_seq FROM aalis_sessions WHERE name = %s"
_ROWS = (  # one row of NULLs and the last seq when the session has no rows past after_seq
    "SELECT l.seq, l.data, s.last_seq FROM aalis_sessions s "
    "LEFT JOIN aalis_log l ON l.sid = s.sid AND l.seq > %s WHERE s.name = %s ORDER BY l.seq"
)
_ROWS_UNTIL = (  # as _ROWS, up to the row holding the seq given (a row's seq is its last)
    "SELECT l.seq, l.data, s.last_seq FROM aalis_sessions s "
    "LEFT JOIN aalis_log l ON l.sid = s.sid AND l.seq > %s AND l.seq <= coalesce("
    "(SELECT min(m.seq) FROM aalis_log m WHERE m.sid = s.sid AND m.seq >= %s), %s) "
    "WHERE s.name = %s ORDER BY l.seq"
)
_GROUP_BEFORE = (
    "SELECT seq, data FROM aalis_log WHERE sid = %s AND seq <= %s ORDER BY seq DESC LIMIT %s"
)
_ALL = (
    "SELECT l.position, l.sid, s.name, l.seq, l.data FROM aalis_log l "
    "JOIN aalis_sessions s ON s.sid = l.sid "
    "WHERE l.position > %s ORDER BY l.position LIMIT %s"
)
_SETTLE = (
    "SELECT s.last_seq, l.data FROM aalis_sessions s "
    "LEFT JOIN aalis_log l ON l.sid = s.sid AND l.seq = %s WHERE s.name = %s"
)
_MARK_IDLE = "UPDATE aalis_sessions SET idle = true WHERE name = %s AND last_seq = %s AND %s > 0"

Row = tuple[int, bytes]  # (seq, data)
T = TypeVar("T")

# TCP keepalives, unless the URL sets its own: a server that vanished (no RST, no FIN)
# is found out in about 25 s, instead of the system's two hours; and data sent that is
# not acknowledged within 30 s ends the connection (instead of some 15 minutes of
# retransmissions).
_KEEPALIVES = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
               "keepalives_count": "3", "tcp_user_timeout": "30000"}  # fmt: skip


def keepalive_options(url: str) -> dict[str, Any]:
    """The TCP keepalive settings a connection to ``url`` is given: ours, except those the
    URL sets itself (``psycopg.ProgrammingError`` when ``url`` does not parse)."""
    given = conninfo_to_dict(url)
    return {k: v for k, v in _KEEPALIVES.items() if k not in given}


def error_line(exc: BaseException) -> str:
    """A database error's first line: the server's message without its CONTEXT (the
    statements of ``aalis_append`` it ran in), libpq's without its hints ("This probably
    means the server terminated abnormally ..."). The store's and the leases' errors
    carry it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class _OverLimit(Exception):
    """The server refused a statement as past one of its limits (an index row too big):
    nothing was written, and the same would be refused again."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


def _over_limit(session_id: str, name: bytes, error: psycopg.Error) -> InvalidBatch:
    """The refusal of a batch the server cannot hold, naming the id's size when that is
    what is too long (a name is indexed: at most 2,704 bytes a b-tree row, compressed)."""
    first = error_line(error)
    size = f"; its session id is {len(name):,} bytes (UTF-8), too long" if len(name) > 1000 else ""
    return InvalidBatch(
        f"session {session_id!r:.80}: the PostgreSQL store cannot hold this batch "
        f"({first}){size}: nothing was written"
    )


class _Lost(Exception):
    """A call failed on its connection: ``broken`` when the connection broke (else the
    server refused the statement), ``sent`` unless it failed before anything was sent."""

    def __init__(self, error: psycopg.Error, broken: bool, sent: bool = True) -> None:
        super().__init__(str(error))
        self.error = error
        self.broken = broken
        self.sent = sent


def redact_url(url: str) -> str:
    """``url`` (a URL or a conninfo string) with its password, if any, masked."""
    if not url.startswith(("postgresql://", "postgres://")):
        return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<postgresql url>"
    if parts.password is not None:
        user, host = parts.netloc.rsplit("@", 1)
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    query = re.sub(r"(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(query=query))


def _name(session_id: str) -> bytes:
    # surrogatepass: an id no event can carry still looks up (and finds nothing).
    return session_id.encode("utf-8", "surrogatepass")


def session_key(session_id: str) -> bytes:
    """How a session id is stored (``aalis_sessions.name``, ``aalis_leases.session``):
    its UTF-8 bytes."""
    return _name(session_id)


class PostgresEventStore:
    """Session logs in a PostgreSQL database, through a pool of connections; safe to
    share between threads, and between processes and machines writing the same log
    (the seq check refuses a stale append with :class:`ConcurrencyConflict`)."""

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        min_size: int = 1,
        max_size: int = 8,
        timeout_s: float = 30.0,
        statement_timeout_s: float | None = 60.0,
    ) -> None:
        """Connect to the database at ``url`` (a libpq URL or conninfo string) and create
        the tables when they are missing.

        ``read_only`` creates nothing and refuses writes (its sessions run with
        ``default_transaction_read_only``); the tables must exist. ``min_size`` and
        ``max_size`` bound the pool; ``timeout_s`` is how long a call waits for a
        connection (and the first connection is waited for). ``statement_timeout_s``
        bounds each statement on the server (a lock held elsewhere, say); ``None`` leaves
        the server's setting. Connections send TCP keepalives unless ``url`` sets its own.
        """
        self.url = url
        self.path = redact_url(url)  # what messages name, as SqliteEventStore's path
        self.read_only = read_only
        self._timeout_s = timeout_s
        if statement_timeout_s is not None and not statement_timeout_s > 0:
            raise ValueError(f"statement_timeout_s must be positive, not {statement_timeout_s!r}")
        self._statement_ms = (
            None if statement_timeout_s is None else max(int(statement_timeout_s * 1000), 1)
        )
        self._closed = False
        try:
            self._options = keepalive_options(url)
        except psycopg.Error as exc:
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None
        try:
            with self._connect() as conn:
                self._configure(conn)
                if read_only:
                    self._check_schema(conn)
                else:
                    self._ensure_schema(conn)
        except psycopg.Error as exc:
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None
        self._degraded = False  # the pool lost its connections: calls connect directly
        self._direct_slots = threading.BoundedSemaphore(max(max_size, 1))  # at most so many
        self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = ConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True, **self._options},
            configure=self._configure,
            timeout=timeout_s,
            name="aalis-events",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None

    def _connect(self) -> psycopg.Connection[Any]:
        """A connection of its own, outside the pool, as the pool makes them."""
        return psycopg.connect(
            self.url, autocommit=True, connect_timeout=max(int(self._timeout_s), 1), **self._options
        )

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        if self.read_only:
            conn.execute("SET default_transaction_read_only = on")
        if self._statement_ms is not None:
            conn.execute(f"SET statement_timeout = {self._statement_ms}")

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        found = {
            row[0]
            for row in conn.execute(
                "SELECT c.relname FROM pg_class c "
                "WHERE c.relname = ANY(%s) AND pg_table_is_visible(c.oid)",
                (list(_TABLES),),
            )
        }
        if not found:
            raise StoreError(f"{self.path!r} holds no event table")
        if found != set(_TABLES):
            missing = ", ".join(sorted(set(_TABLES) - found))
            raise StoreError(f"{self.path!r}: event tables missing: {missing}")
        row = conn.execute("SELECT format FROM aalis_head").fetchone()
        if row is None or row[0] != PG_FORMAT:
            version = None if row is None else row[0]
            raise StoreError(f"{self.path!r}: event table format {version} is not {PG_FORMAT}")

    def _ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for sql in _SCHEMA:
                conn.execute(sql)
        self._check_schema(conn)

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path!r} is opened read-only: nothing can be written")

    def _fail(self, doing: str, exc: Exception) -> StoreError:
        return StoreError(f"{self.path!r}: {doing} failed: {error_line(exc)}")

    def _call(
        self, doing: str, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True
    ) -> T:
        """``fn`` on a pooled connection. When the connection breaks (a server restart
        or a cut; not a statement the server refused), the pool's idle connections are
        checked and ``fn`` runs once more on a fresh one, with ``retry``; a second break
        is a StoreError. Without ``retry`` a break after the call was sent raises
        :class:`_Lost` (the caller settles what it sent). Other failures are a StoreError.

        After an outage the pool reconnects with a backoff that doubles (1, 2, 4... s):
        it may try again long after the server is back. Until it has a connection to
        give again, each call connects for itself."""
        for attempt in (0, 1):
            try:
                if self._degraded:
                    if self._pool.get_stats().get("pool_available", 0):
                        self._degraded = False
                    elif self._direct_slots.acquire(blocking=False):
                        try:
                            return self._direct(fn)
                        finally:
                            self._direct_slots.release()
                    # else: as many connect directly as the pool may hold; wait for it
                with self._pool.connection() as conn:
                    try:
                        return fn(conn)
                    except psycopg.Error as exc:
                        raise _Lost(exc, conn.broken) from None
            except PoolTimeout as exc:
                self._degraded = True  # no connection came: the server may be away
                raise self._fail(doing, exc) from None
            except _Lost as lost:
                if not lost.broken:  # the server refused it: the same would fail again
                    raise self._fail(doing, lost.error) from None
                if lost.sent and not retry:
                    raise
                if attempt:
                    raise self._fail(doing, lost.error) from None
                self._pool.check()  # a restart leaves every idle connection dead
                self._degraded = True  # the next try goes direct unless one is left
        raise AssertionError("unreachable")

    def _direct(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn`` on a connection of its own, closed after (see :meth:`_call`)."""
        try:
            conn = self._connect()
        except psycopg.Error as exc:  # nothing was sent: it may be tried again
            raise _Lost(exc, broken=True, sent=False) from None
        try:
            self._configure(conn)
            return fn(conn)
        except psycopg.Error as exc:
            raise _Lost(exc, conn.broken) from None
        finally:
            with suppress(psycopg.Error):
                conn.close()

    # --- writing ---------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        self._refuse_if_read_only()
        check_batch(session_id, events, expected_seq)
        name = _name(session_id)
        if not events:
            actual = self.last_seq(session_id)
            if actual != expected_seq:
                raise ConcurrencyConflict(session_id, expected_seq, actual)
            return actual
        n = len(events)
        last = expected_seq + n
        parts = [blob for _, blob in encode_batch(events, keyless=True)]
        data, _ = pack_row(session_id, parts, last, None)
        params = (name, expected_seq, n, open_work is False, data)

        def write(conn: psycopg.Connection[Any]) -> tuple[Any, ...] | None:
            try:
                return conn.execute(_APPEND, params).fetchone()
            except psycopg.errors.ProgramLimitExceeded as exc:
                raise _OverLimit(exc) from None

        try:
            row = self._call("append", write, retry=False)
        except _Lost as lost:
            # It may have committed before the connection broke: settle it, then answer.
            return self._settle(session_id, params, last, lost.error)
        except _OverLimit as over:
            raise _over_limit(session_id, name, over.error) from None
        assert row is not None
        position = int(row[0])
        if position < 0:
            raise ConcurrencyConflict(session_id, expected_seq, -1 - position)
        return last

    def _settle(
        self, session_id: str, params: tuple[bytes, int, int, bool, bytes], last: int,
        error: psycopg.Error,
    ) -> int:  # fmt: skip
        """An append whose connection broke: find out on a fresh connection whether it
        was written, write it when it was not, and return its last seq as ``append``
        does (or raise ``ConcurrencyConflict`` when another writer got there first)."""
        name, expected_seq, _, _, data = params

        def look(conn: psycopg.Connection[Any]) -> tuple[bool, int]:
            """Whether the batch is in the log, and where the log ends."""
            row = conn.execute(_SETTLE, (last, name)).fetchone()
            if row is None:
                return False, 0
            return row[1] is not None and bytes(row[1]) == data, int(row[0])

        def write(conn: psycopg.Connection[Any]) -> bool:
            written = conn.execute(_APPEND, params).fetchone()
            return written is not None and int(written[0]) >= 0

        self._pool.check()  # a restart leaves every idle connection dead: drop them
        self._degraded = True
        later: BaseException = error
        for _ in range(3):  # a read may be repeated; a write is tried once per round
            try:
                found, actual = self._call("append", look)  # once more if it breaks
                if found:
                    return last  # it committed: only its answer was lost
                if actual != expected_seq:
                    raise ConcurrencyConflict(session_id, expected_seq, actual)
                # Not written. Write it now: should the first attempt still commit
                # meanwhile, the seq check turns one of the two away, and the next
                # round's read tells which.
                if self._call("append", write, retry=False):
                    return last
            except _Lost as exc:
                later = exc.error
            except ConcurrencyConflict:
                raise
            except StoreError as exc:
                later = exc
                break
        raise StoreError(
            f"{self.path!r}: append failed: the connection broke ({error_line(error)}) "
            f"and whether the batch of {session_id!r} up to seq {last} was recorded could "
            f"not be settled ({error_line(later)}): read the log to know"
        ) from None

    def mark_idle(self, sessions: Sequence[tuple[str, int]]) -> int:
        self._refuse_if_read_only()
        # In name order, so two callers never wait on each other's rows crosswise.
        ordered = sorted(sessions, key=lambda pair: _name(pair[0]))

        def mark(conn: psycopg.Connection[Any]) -> int:
            marked = 0
            with conn.transaction():  # all or none: it runs again whole when it broke
                for session_id, seq in ordered:
                    cursor = conn.execute(_MARK_IDLE, (_name(session_id), seq, seq))
                    marked += max(cursor.rowcount, 0)
            return marked

        return self._call("marking idle", mark)

    # --- reading ---------------------------------------------------------------------

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._call("reading", lambda conn: conn.execute(sql, params).fetchall())

    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        return self._read(session_id, after_seq, None, on_corrupt)

    def read_range(
        self,
        session_id: str,
        after_seq: int,
        until_seq: int,
        *,
        on_corrupt: CorruptHandler | None = None,
    ) -> list[SessionEvent]:
        """:meth:`read`, only the events with seq up to ``until_seq``: the rows past it are
        not read (an extra of this store, not of the protocol)."""
        return self._read(session_id, after_seq, until_seq, on_corrupt)

    def _read(
        self,
        session_id: str,
        after_seq: int,
        until_seq: int | None,
        on_corrupt: CorruptHandler | None,
    ) -> list[SessionEvent]:
        if until_seq is None:
            found = self._query(_ROWS, (after_seq, _name(session_id)))
        else:
            found = self._query(_ROWS_UNTIL, (after_seq, until_seq, until_seq, _name(session_id)))
        if not found:
            return []  # no such session
        last_seq = int(found[0][2])
        if until_seq is not None:
            last_seq = min(last_seq, until_seq)  # the seqs past it are not read
        rows: list[Row] = [(seq, bytes(data)) for seq, data, _ in found if seq is not None]
        if rows and (header := row_header(rows[0][1])) is not None and header[0]:
            rows[:0] = self._group_before(session_id, rows[0][0], header)
        out: list[SessionEvent] = []
        reader = RowReader(session_id)
        follow = FollowOn(session_id, after_seq)  # rows deleted or overlapping by hand

        def report(exc: CorruptEvent) -> None:
            if on_corrupt is None:
                raise exc
            on_corrupt(exc)

        for seq, data in rows:
            try:
                if seq <= after_seq:  # an earlier row of the first one's group
                    reader.read(seq, data, events=False)
                    continue
                events = reader.read(seq, data)
            except CorruptEvent as exc:
                if seq <= after_seq:
                    continue  # the row that needs it will say so
                report(follow.unread(exc, seq, data))
                continue
            if (fault := follow.fault(events[0].seq, seq)) is not None:
                report(fault)
                if fault.seq == events[0].seq:  # the row repeats seqs: not read
                    continue
            if events[0].seq <= after_seq:  # the row holds events from before too
                events = [e for e in events if e.seq > after_seq]
            if until_seq is not None and events and events[-1].seq > until_seq:
                events = [e for e in events if e.seq <= until_seq]
            out += events
        if (fault := follow.end(last_seq)) is not None:  # the last rows are gone
            report(fault)
        return out

    def _group_before(
        self, session_id: str, seq: int, header: tuple[int, int, int], sid: int | None = None
    ) -> list[Row]:
        """The rows before a row that continues a group (one copied from a SQLite file;
        this store writes none), oldest first."""
        depth, count, _ = header
        if sid is None:
            found = self._query(_SID, (_name(session_id),))
            if not found:
                return []
            sid = int(found[0][0])
        rows = [
            (int(s), bytes(d)) for s, d in self._query(_GROUP_BEFORE, (sid, seq - count, depth))
        ]
        rows.reverse()
        return rows

    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        check_limit(limit)
        after_position = max(after_position, 0)
        # Each row holds at least one event past after_position: ``limit`` rows suffice.
        rows = self._query(_ALL, (after_position, limit))
        readers: dict[int, tuple[RowReader, int]] = {}  # sid -> reader, last seq read
        out: list[Recorded] = []
        for position, sid, name, seq, raw in rows:
            data = bytes(raw)
            state = readers.get(sid)
            if state is None:
                state = (RowReader(bytes(name).decode("utf-8", "surrogatepass")), -1)
            reader, last = state
            header = row_header(data)
            if header is not None and header[0] and last != seq - header[1]:
                for earlier_seq, earlier in self._group_before(reader.session_id, seq, header, sid):
                    with suppress(CorruptEvent):  # the row that needs it will say so
                        reader.read(earlier_seq, earlier, events=False)
            readers[sid] = (reader, seq)
            for event in reader.read(seq, data):
                at = position - (seq - event.seq)
                if at > after_position:
                    out.append(Recorded(at, event))
        return out if limit is None else out[:limit]

    def last_seq(self, session_id: str) -> int:
        rows = self._query(_LAST_SEQ, (_name(session_id),))
        return int(rows[0][0]) if rows else 0

    def sessions(self) -> list[str]:
        rows = self._query("SELECT name FROM aalis_sessions ORDER BY name")
        return [bytes(r[0]).decode("utf-8", "surrogatepass") for r in rows]

    def open_sessions(self) -> list[str]:
        rows = self._query("SELECT name FROM aalis_sessions WHERE NOT idle ORDER BY name")
        return [bytes(r[0]).decode("utf-8", "surrogatepass") for r in rows]

    def session_page(self, offset: int, limit: int) -> tuple[int, list[tuple[str, int, bool]]]:
        """A page of :meth:`sessions`, for a listing that pages through many: how many
        sessions there are, and ``limit`` from the ``offset``-th, each as (id, last seq,
        open work as :meth:`open_sessions` says), counted and sorted by the server."""
        total = int(self._query("SELECT count(*) FROM aalis_sessions")[0][0])
        rows = self._query(
            "SELECT name, last_seq, NOT idle FROM aalis_sessions ORDER BY name LIMIT %s OFFSET %s",
            (max(limit, 0), max(offset, 0)),
        )
        page = [(bytes(n).decode("utf-8", "surrogatepass"), int(s), bool(o)) for n, s, o in rows]
        return total, page

    def count(self, session_id: str | None = None) -> int:
        """How many events the store holds (for one session, or all): a log holds seqs
        1 to its last, so this is the last seq, summed over sessions."""
        if session_id is not None:
            return self.last_seq(session_id)
        rows = self._query("SELECT coalesce(sum(last_seq), 0) FROM aalis_sessions")
        return int(rows[0][0])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.close()

    def __enter__(self) -> PostgresEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
