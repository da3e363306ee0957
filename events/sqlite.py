"""``SqliteEventStore``: the durable default store.

Layout (format 3, ``PRAGMA user_version``):

* ``sessions (id, name)`` numbers the sessions, so that a row names its session with a
  small integer rather than the whole id.
* ``log (sid, seq, position, data)`` (WITHOUT ROWID, primary key ``(sid, seq)``, which
  is the concurrency check, and clusters one session's rows for a range scan): one row
  per appended batch. ``seq`` and ``position`` are those of the batch's *last* event (a
  unique index on ``position`` orders ``read_all``); ``data`` holds the events in row
  format 2, compressed against the rows before it in its group (see
  :mod:`aalis_agent.events.codec`). A row in format 1, one event encoded whole, is
  read too: every row an older version wrote is one.
* ``events (position, session_id, seq, type, data)``, a view of ``log`` by session id,
  is the older table's shape, for SQL by hand; inserting into it stores the row as
  given. ``type`` is NULL: a row holds a batch, its tags are inside ``data``.
* ``idle_sessions`` lists the sessions whose last append said they had no unfinished
  work, written in the same transaction, so recovery folds only the others.

Formats 1 and 2 had a table ``events`` with one row per event (format 1 without
``idle_sessions``). Opening one for writing moves its rows into ``log`` as they are, in
one transaction; opened ``read_only`` (as replay does), it is read as it is.

WAL journal with ``synchronous=NORMAL`` (``sync="full"`` for ``FULL``): an append is
acknowledged after its transaction commits. A batch is one transaction. The WAL is
copied back into the database (checkpointed) on a thread of the store's own, about every
``wal_autocheckpoint`` pages written, with a connection of its own: a checkpoint copies
and syncs megabytes (12 to 15 ms here), and run inline, as SQLite does by default, it
fell on whichever append crossed the mark, a turn every few hundred. A checkpoint
(``PASSIVE``) never blocks an append, nor an append a checkpoint. The WAL starts over
only once it has been copied back whole, by a write that begins while no checkpoint
runs; with appends going on meanwhile, the thread copies what they added once more,
what they add during that (a few pages) the next append copies itself, and the append
after it starts the WAL over (the thread waits for that), so that the WAL stays near
the mark while the appends never pause; a checkpoint stalled on the disk lets it grow by
what is appended meanwhile.
A reader holding an old snapshot keeps a checkpoint from finishing, and the WAL grows
meanwhile; once it starts over, the file is cut back to twice the mark
(``journal_size_limit``). Nothing that goes wrong in a checkpoint reaches an append: it
is logged, and the next one tries again.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import quote

import structlog
from aalis_agent.events.codec import RowChain, RowReader, row_header
from aalis_agent.events.errors import ConcurrencyConflict, CorruptEvent, StoreError
from aalis_agent.events.ownership import acquire_writer, release_writer
from aalis_agent.events.schema import SessionEvent
from aalis_agent.events.store import (
    CorruptHandler,
    FollowOn,
    Recorded,
    check_batch,
    check_limit,
    encode_row,
)

__all__ = ["STORE_FORMAT", "SqliteEventStore"]

STORE_FORMAT = 3
"""``PRAGMA user_version`` of a database this code creates."""
_OLD_FORMATS = (1, 2)  # one row per event in ``events``; 1 has no ``idle_sessions``
_CONTEXTS = 1024  # sessions whose last row this store remembers, to continue its group
_COMPRESSORS = 64  # of those with open work, the last written keep their row compressor
_IDLE_COMPRESSORS = 2  # of the idle ones, the last written keep theirs for their next turn
_SESSIONS = 16_384  # sessions whose number, last seq and idle mark are kept in memory
_PAGE = 4096  # SQLite's default page size: a row's pages in the WAL, roughly
_FRAMES = 4  # pages an append writes to the WAL besides its row's (b-tree and index leaves)

log = structlog.get_logger("aalis.store")


def _lenient_text(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def _name(value: object) -> str:
    """A session name as read: text (one stored as a blob by a hand edit is decoded)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value if isinstance(value, str) else str(value)


_R = TypeVar("_R")
_P = ParamSpec("_P")


def _reads(
    method: Callable[Concatenate[SqliteEventStore, _P], _R],
) -> Callable[Concatenate[SqliteEventStore, _P], _R]:
    """A reading method whose SQLite errors (a damaged file, a lost disk) are raised as
    :class:`StoreError` naming the database, as a write's are."""

    def reading(self: SqliteEventStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path!r}: cannot read the event database: {exc}") from None

    reading.__name__ = method.__name__
    reading.__qualname__ = method.__qualname__
    reading.__doc__ = method.__doc__
    return reading


_SID = (
    "SELECT id FROM sessions WHERE name = ?1 UNION ALL "
    "SELECT id FROM sessions WHERE name = ?2 ORDER BY 1 LIMIT 1"
)
"""A session's number by its name, as text or as a blob of the same bytes: the first."""


def _refuse_foreign(path: str) -> None:
    """StoreError when the file at ``path`` is a database holding tables, but neither
    ``log`` nor ``events``: it is another program's, and none of ours is added to it.
    Read-only; a file that is not a database is left for the open to report."""
    if not os.path.isfile(path):
        return
    try:
        conn = sqlite3.connect(f"file:{quote(os.fsencode(path))}?mode=ro", uri=True)
    except sqlite3.Error:
        return
    try:
        names = [
            r[0]
            for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
        ]
    except sqlite3.Error:
        return  # not a database, or locked: the open says so
    finally:
        conn.close()
    tables = [n for n in names if isinstance(n, str) and not n.startswith("sqlite_")]
    if tables and "log" not in tables and "events" not in tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(
            f"{path!r} is not an event database: it holds another program's tables ({shown})"
        )


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _room(cache: dict[Any, Any]) -> None:
    """Make room in a per-session cache that is full: the older half goes (what is let
    go is read again from the database when it is next needed). A host that serves new
    sessions for weeks keeps no entry for every session it ever wrote."""
    if len(cache) >= _SESSIONS:
        for key in list(itertools.islice(cache, len(cache) // 2 or 1)):
            del cache[key]


_SCHEMA = (
    "CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
    "CREATE TABLE log (sid INTEGER NOT NULL, seq INTEGER NOT NULL, "
    "position INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (sid, seq)) WITHOUT ROWID",
)
_VIEW = (
    "CREATE UNIQUE INDEX log_position ON log (position)",
    "CREATE VIEW events (position, session_id, seq, type, data) AS "
    "SELECT log.position, sessions.name, log.seq, NULL, log.data "
    "FROM log JOIN sessions ON sessions.id = log.sid",
    "CREATE TRIGGER events_insert INSTEAD OF INSERT ON events BEGIN "
    "INSERT OR IGNORE INTO sessions (name) VALUES (NEW.session_id); "
    "INSERT INTO log (sid, seq, position, data) VALUES "
    "((SELECT id FROM sessions WHERE name = NEW.session_id), NEW.seq, NEW.position, NEW.data); "
    "END",
    # Sessions whose writer said they have no unfinished work (see open_sessions).
    "CREATE TABLE IF NOT EXISTS idle_sessions (session_id TEXT PRIMARY KEY) WITHOUT ROWID",
)
_MIGRATE = (
    # Session ids in sorted order, by skipping along the old primary key.
    "INSERT INTO sessions (name) "
    "WITH RECURSIVE s(id) AS ("
    " SELECT (SELECT min(session_id) FROM events)"
    " UNION ALL"
    " SELECT (SELECT min(session_id) FROM events WHERE session_id > s.id)"
    " FROM s WHERE s.id IS NOT NULL) "
    "SELECT id FROM s WHERE id IS NOT NULL",
    "INSERT INTO log (sid, seq, position, data) "
    "SELECT sessions.id, events.seq, events.position, events.data "
    "FROM events JOIN sessions ON sessions.name = events.session_id",
    "DROP TABLE events",
)
_OLD_SESSION_IDS = (
    "WITH RECURSIVE s(id) AS ("
    " SELECT (SELECT min(session_id) FROM events)"
    " UNION ALL"
    " SELECT (SELECT min(session_id) FROM events WHERE session_id > s.id)"
    " FROM s WHERE s.id IS NOT NULL) "
    "SELECT id FROM s WHERE id IS NOT NULL"
)
"""Every session id of an old-format file, sorted, by skipping along the primary key:
one seek per session rather than a visit to every event."""
_SESSION_IDS = (
    "SELECT name FROM sessions WHERE EXISTS (SELECT 1 FROM log WHERE log.sid = sessions.id) "
    "ORDER BY name"
)
_SESSION_COUNT = (
    "SELECT count(*) FROM sessions WHERE EXISTS (SELECT 1 FROM log WHERE log.sid = sessions.id)"
)
_SESSION_PAGE = (
    "SELECT name, (SELECT max(seq) FROM log WHERE log.sid = sessions.id "
    "AND typeof(seq) = 'integer') FROM sessions "
    "WHERE EXISTS (SELECT 1 FROM log WHERE log.sid = sessions.id) ORDER BY name LIMIT ? OFFSET ?"
)
_INSERT = "INSERT INTO log (sid, seq, position, data) VALUES (?, ?, ?, ?)"
_MARK_IDLE = "INSERT OR IGNORE INTO idle_sessions (session_id) VALUES (?)"
_UNMARK_IDLE = "DELETE FROM idle_sessions WHERE session_id = ?"

Row = tuple[int, bytes]  # (seq, data)


class SqliteEventStore:
    """Session logs in one SQLite file (or ``":memory:"``), safe to share between threads."""

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        timeout_s: float = 30.0,
        exclusive: bool = False,
        wal_autocheckpoint: int = 4000,
        read_only: bool = False,
        single_writer: bool = True,
        background_checkpoint: bool = True,
        sync: str = "normal",
    ) -> None:
        """Open (and create when new) the event database at ``path``.

        ``sync`` says what an acknowledged append survives. ``"normal"`` (the default,
        SQLite's ``synchronous=NORMAL`` in WAL mode): the process being killed at any
        point, with nothing lost; an operating-system crash or a power cut may lose the
        last appends before the next checkpoint (never corrupting the file). ``"full"``
        (``synchronous=FULL``): those too, at the price of a flush to the disk per
        append (measured here: a median append of 240-375 us, against 30-37 us).

        ``exclusive`` keeps the file locked by this process for its lifetime: appends
        skip the per-transaction locking (about a third faster here) but no other
        process can read the database meanwhile, ``aalis-agent replay`` included.
        ``wal_autocheckpoint`` is the WAL size, in pages, that triggers a checkpoint:
        on the store's own thread (``background_checkpoint``, the default; see the module
        docstring), or inline in the append that crosses it, as SQLite does (without
        ``background_checkpoint``, and with ``exclusive``, where no second connection can
        open the file).
        ``read_only`` opens an existing file for reading only: nothing is created,
        migrated or written (an older format is read as it is), and writes are refused.
        ``single_writer`` (the default) makes this process the file's only writer until
        :meth:`close` (see :mod:`aalis_agent.events.ownership`): another process opening
        it for writing gets :class:`StoreInUse`. Turn it off only to test concurrent
        writers; the sequence check still refuses a stale append.
        """
        if sync not in ("normal", "full"):
            raise StoreError(f'sync must be "normal" or "full", not {sync!r}')
        self._sync = sync.upper()
        self.path = str(path)
        self.read_only = read_only
        if read_only and self.path == ":memory:":
            raise StoreError("a read-only event database must be a file")
        self._owner: str | None = None
        if not read_only and self.path != ":memory:":
            # Before the writer's lock file is made beside it, or anything is written.
            _refuse_foreign(self.path)
        if single_writer and not read_only and self.path != ":memory:":
            self._owner = acquire_writer(self.path)
        try:
            self._open(path, timeout_s, exclusive, wal_autocheckpoint, background_checkpoint)
        except BaseException:
            self._release_owner()
            raise

    def _release_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            release_writer(owner)

    def _open(
        self,
        path: str | Path,
        timeout_s: float,
        exclusive: bool,
        wal_autocheckpoint: int,
        background_checkpoint: bool,
    ) -> None:
        read_only = self.read_only
        target = f"file:{quote(os.fsencode(self.path))}?mode=ro" if read_only else self.path
        try:
            conn = sqlite3.connect(
                target,
                check_same_thread=False,
                isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                timeout=timeout_s,
                uri=read_only,
            )
        except sqlite3.Error as exc:
            why = "it is a directory" if os.path.isdir(self.path) else str(exc)
            raise StoreError(f"cannot open event database {self.path!r}: {why}") from None
        # A text value that is not UTF-8 (a hand edit, a damaged page) reads as text with
        # its bad bytes escaped, so the row it is in is reported as corrupt, not the read.
        conn.text_factory = _lenient_text
        self._conn = conn
        self._cursor = conn.cursor()  # the writes' statements, under the lock
        self._lock = threading.Lock()
        self._exclusive = exclusive
        # Last seq per session and last position, exact while no other connection writes.
        self._seq_cache: dict[str, int] = {}
        self._idle_cache: dict[str, bool] = {}  # session -> has a row in idle_sessions
        self._position_cache: int | None = None
        self._data_version: int | None = None
        # Session numbers never change once committed: kept for the store's lifetime.
        self._sids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        # The last row this store wrote per session, for the next row to continue.
        self._contexts: OrderedDict[str, RowChain] = OrderedDict()
        self._compressing: OrderedDict[str, RowChain] = OrderedDict()  # keep a compressor
        self._idle_compressing: OrderedDict[str, RowChain] = OrderedDict()  # idle, keep one
        self._has_idle_table = True
        self._old_layout = False  # a format-1 or -2 file opened read-only
        self._checkpointer: _Checkpointer | None = None
        try:
            if read_only:
                try:
                    self._check_schema_read_only()
                except sqlite3.OperationalError as exc:
                    if not self._reopen_immutable(exc):
                        raise
                return
            if exclusive:
                conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self._sync}")
            background = background_checkpoint and not exclusive and self.path != ":memory:"
            if self.path != ":memory:":  # the WAL, once started over, shrinks back to this
                limit = max(int(wal_autocheckpoint), 1) * _PAGE * 2
                conn.execute(f"PRAGMA journal_size_limit={limit}")
            if background and wal_autocheckpoint > 0:
                conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer's work
                self._checkpointer = _Checkpointer(
                    str(Path(self.path).resolve()), timeout_s, int(wal_autocheckpoint)
                )
                # Stop its thread should the store be dropped without close().
                self._finalizer = weakref.finalize(self, self._checkpointer.stop, 0.0)
            else:
                conn.execute(f"PRAGMA wal_autocheckpoint={int(wal_autocheckpoint)}")
            self._ensure_schema()
        except sqlite3.OperationalError as exc:
            conn.close()
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{self.path!r} is not a usable event database: {exc}") from None

    def _reopen_immutable(self, exc: sqlite3.OperationalError) -> bool:
        """Read-only, a WAL database whose folder cannot be written (a read-only mount, a
        folder of another user): SQLite cannot make the shared-memory file it reads a WAL
        database with. When no WAL file holds commits, nothing can write the file either
        (a writer needs that file too): it is read as it is (``immutable``). So is one
        whose WAL file's commits are all in the database file already (copied back by a
        checkpoint, the writer then killed; :func:`wal_adds_nothing`), while no writer
        holds its lock. A WAL file with commits not yet copied back cannot be read
        without that file: StoreError saying so. False when the error is another one."""
        if "unable to open database file" not in str(exc):
            return False
        wal = f"{self.path}-wal"
        if (
            os.path.exists(wal)
            and os.path.getsize(wal) > 0
            and not (_no_writer(self.path) and wal_adds_nothing(self.path, wal))
        ):
            self._conn.close()
            raise StoreError(
                f"cannot open event database {self.path!r} read-only: its folder cannot be "
                "written, and its WAL file holds commits that SQLite reads only with a file "
                "it makes beside it; copy the database and its -wal file to a folder that "
                "can be written, and open the copy"
            )
        self._conn.close()
        target = f"file:{quote(os.fsencode(self.path))}?mode=ro&immutable=1"
        conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None, uri=True)
        conn.text_factory = _lenient_text
        self._conn, self._cursor = conn, conn.cursor()
        self._check_schema_read_only()
        return True

    def _unknown_format(self, version: int) -> StoreError:
        return StoreError(f"{self.path!r}: event table format {version} is not {STORE_FORMAT}")

    def _tables(self) -> dict[str, str]:
        """Names of the tables and views, with their kind."""
        rows = self._conn.execute(
            "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view')"
        ).fetchall()
        return {name: kind for name, kind in rows}

    def _check_schema_read_only(self) -> None:
        """The checks of :meth:`_ensure_schema` without its writes: an older format is
        read as it is (format 1 has no session index, so every session counts as open)."""
        tables = self._tables()
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if "log" in tables and version in (*_OLD_FORMATS, STORE_FORMAT):
            self._old_layout = False
        elif tables.get("events") == "table":
            if version not in _OLD_FORMATS:
                raise self._unknown_format(version)
            self._old_layout = True
        elif "log" in tables:
            raise self._unknown_format(version)
        else:
            raise StoreError(f"{self.path!r} holds no event table")
        self._has_idle_table = "idle_sessions" in tables

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path!r} is opened read-only: nothing can be written")

    def _ensure_schema(self) -> None:
        tables = self._tables()
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if "log" in tables:
            if version != STORE_FORMAT:
                raise self._unknown_format(version)
            return
        if "events" in tables:
            if version not in _OLD_FORMATS or tables["events"] != "table":
                raise self._unknown_format(version)
            self._migrate()
            return
        self._run((*_SCHEMA, *_VIEW, f"PRAGMA user_version={STORE_FORMAT}"))

    def _migrate(self) -> None:
        """Move the rows of a format-1 or -2 file into ``log``, each as it is (format 1);
        the view ``events`` then stands where the table was."""
        self._run((*_SCHEMA, *_MIGRATE, *_VIEW, f"PRAGMA user_version={STORE_FORMAT}"))

    def _run(self, statements: Iterable[str]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sql in statements:
                conn.execute(sql)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

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
        idle = open_work is False
        n = len(events)
        last = expected_seq + n
        contexts = self._contexts
        chain: RowChain | None = None
        row = body = b""
        depth = 0
        deflate: zlib._Compress | None = None
        if n:
            body = encode_row(events)
            # Packed before the lock, continuing the last row this store wrote for the
            # session; checked again under the lock, where another writer shows.
            chain = contexts.get(session_id)
            if chain is None:
                chain = RowChain(session_id)
            row, depth, deflate = chain.pack(body, n, last)
        with self._lock:
            conn = self._conn
            cursor = self._cursor
            try:
                cursor.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise StoreError(f"{self.path!r}: cannot start a write: {exc}") from None
            new_sid: int | None = None
            try:
                self._refresh_cache()
                sid = self._sid_unlocked(session_id)
                actual = self._seq_cache.get(session_id)
                if actual is None:
                    actual = self._last_seq_unlocked(session_id)
                    _room(self._seq_cache)
                    self._seq_cache[session_id] = actual
                if actual != expected_seq:
                    raise ConcurrencyConflict(session_id, expected_seq, actual)
                position = self._position_cache
                if position is None:
                    position = conn.execute("SELECT max(position) FROM log").fetchone()[0] or 0
                if chain is not None:
                    if depth and (
                        contexts.get(session_id) is not chain or chain.seq != expected_seq
                    ):
                        (row, deflate), depth = chain.pack_first(body, n), 0  # a new group
                    if sid is None:
                        cursor.execute("INSERT INTO sessions (name) VALUES (?)", (session_id,))
                        assert cursor.lastrowid is not None
                        sid = new_sid = cursor.lastrowid
                    cursor.execute(_INSERT, (sid, last, position + n, row))
                    if self._idle_cache.get(session_id) is not idle:
                        cursor.execute(_MARK_IDLE if idle else _UNMARK_IDLE, (session_id,))
                cursor.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                self._forget_cache()
                if isinstance(exc, sqlite3.IntegrityError):
                    actual = self._last_seq_unlocked(session_id)
                    if actual != expected_seq:  # another connection won the race
                        raise ConcurrencyConflict(session_id, expected_seq, actual) from None
                    raise StoreError(f"{self.path!r}: append refused: {exc}") from None
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"{self.path!r}: append failed: {exc}") from None
                raise
            # Committed: the caches now hold what the database holds.
            self._seq_cache[session_id] = last
            self._position_cache = position + n
            if new_sid is not None:
                _room(self._sids)
                self._sids[session_id] = new_sid
                _room(self._names)
                self._names[new_sid] = session_id
            if chain is not None:
                if session_id not in self._idle_cache:
                    _room(self._idle_cache)
                self._idle_cache[session_id] = idle
                # A session keeps its row compressor (about 30 KiB) while it has open
                # work: across the appends of a turn, at most the 64 written last. Idle,
                # only the two written last keep it (a host serving one conversation at a
                # time: its next turn's first row goes on from it instead of a new one
                # taking in the whole dictionary, ~68,000 instructions); the others' next
                # row makes a new one, so memory does not grow with sessions passivated
                # and revived.
                compressing = self._compressing
                kept = compressing if not idle else self._idle_compressing
                (self._idle_compressing if not idle else compressing).pop(session_id, None)
                chain.advance(last, depth, body, deflate)
                contexts[session_id] = chain
                contexts.move_to_end(session_id)
                if len(contexts) > _CONTEXTS:
                    contexts.popitem(last=False)
                if deflate is not None:
                    kept[session_id] = chain
                    kept.move_to_end(session_id)
                    if len(kept) > (_COMPRESSORS if kept is compressing else _IDLE_COMPRESSORS):
                        kept.popitem(last=False)[1].drop_compressor()
            if self._checkpointer is not None:
                # Committed: nothing here may make the append look failed.
                with suppress(Exception):  # logged where it can be; a later one tries again
                    self._checkpointer.after_append(conn, len(row))
        return last

    def _refresh_cache(self) -> None:
        """Drop the cached last seqs and position if another connection has written.

        ``PRAGMA data_version`` changes only when another connection commits, so while
        it holds still the caches are exact and an append needs no lookups. Called with
        the write lock held (inside BEGIN IMMEDIATE).
        """
        if self._exclusive and self._data_version is not None:
            return  # no other connection can write
        version = self._cursor.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._forget_cache()
            self._data_version = version

    def _forget_cache(self) -> None:
        self._seq_cache.clear()
        self._idle_cache.clear()
        self._position_cache = None
        self._contexts.clear()
        self._compressing.clear()
        self._idle_compressing.clear()

    def mark_idle(self, sessions: Sequence[tuple[str, int]]) -> int:
        self._refuse_if_read_only()
        marked = 0
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise StoreError(f"{self.path!r}: cannot start a write: {exc}") from None
            try:
                self._refresh_cache()
                for session_id, seq in sessions:
                    if seq > 0 and self._last_seq_unlocked(session_id) == seq:
                        conn.execute(_MARK_IDLE, (session_id,))
                        marked += 1
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                self._forget_cache()
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"{self.path!r}: marking idle failed: {exc}") from None
                raise
            self._idle_cache.clear()  # cheap to rebuild; marks are rare
        return marked

    # --- reading ---------------------------------------------------------------------

    def _sid_unlocked(self, session_id: str) -> int | None:
        """The session's number, if it has one (old-format files have none)."""
        sid = self._sids.get(session_id)
        if sid is None and not self._old_layout:
            # As text or, from a hand edit, as a blob of the same bytes (a name read back
            # with bytes that are not UTF-8 is found by those bytes).
            try:
                key: tuple[object, object] = (session_id, session_id.encode("utf-8"))
            except UnicodeEncodeError:
                raw = session_id.encode("utf-8", "surrogateescape")
                key = (raw, raw)
            # Two lookups in the name index (``name = ? OR name = ?`` sorted its matches
            # in a temporary B-tree: about 4 times as long, on every new session).
            row = self._conn.execute(_SID, key).fetchone()
            if row is not None:
                sid = row[0]
                _room(self._sids)
                self._sids[session_id] = sid
                _room(self._names)
                self._names[sid] = session_id
        return sid

    def _name_unlocked(self, sid: int) -> str:
        """The session id numbered ``sid`` (every number in ``log`` has one)."""
        name = self._names.get(sid)
        if name is None:
            # This one and the next few (a reader in log order meets numbers about in
            # the order they were given), not the whole table.
            names = self._names
            _room(names)
            for number, known in self._conn.execute(
                "SELECT id, name FROM sessions WHERE id >= ? ORDER BY id LIMIT ?",
                (sid, min(4096, _SESSIONS // 4)),
            ):
                names[number] = _name(known)
            name = names.get(sid)
            if name is None:
                raise StoreError(
                    f"{self.path!r}: the log holds rows of session number {sid}, which its "
                    "sessions table does not name"
                )
        return name

    def _rows_unlocked(
        self, session_id: str, after_seq: int, until_seq: int | None = None
    ) -> list[Row]:
        """The session's rows holding events past ``after_seq`` (up to the one holding
        ``until_seq``, when given), in order, led by the earlier rows of the first one's
        group when it continues one (to be read for their context only: their seqs are
        ``after_seq`` or less)."""
        conn = self._conn
        if self._old_layout:
            if until_seq is not None:
                return conn.execute(
                    "SELECT seq, data FROM events WHERE session_id = ? AND seq > ? "
                    "AND seq <= ? ORDER BY seq",
                    (session_id, after_seq, until_seq),
                ).fetchall()
            return conn.execute(
                "SELECT seq, data FROM events WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, after_seq),
            ).fetchall()
        sid = self._sid_unlocked(session_id)
        if sid is None:
            return []
        rows: list[Row]
        if until_seq is None:
            rows = conn.execute(
                "SELECT seq, data FROM log WHERE sid = ? AND seq > ? ORDER BY seq",
                (sid, after_seq),
            ).fetchall()
        else:  # a row's seq is its last event's: the first at or past until_seq holds it
            rows = conn.execute(
                "SELECT seq, data FROM log WHERE sid = ? AND seq > ? AND seq <= coalesce("
                "(SELECT min(seq) FROM log WHERE sid = ? AND seq >= ?), ?) ORDER BY seq",
                (sid, after_seq, sid, until_seq, until_seq),
            ).fetchall()
        if rows:
            before = self._group_before_unlocked(sid, *rows[0])
            if before:
                rows[:0] = before
        return rows

    def _group_before_unlocked(self, sid: int, seq: int, data: bytes) -> list[Row]:
        """The rows before this one in its group, oldest first (none for a row that
        starts its group, or is not a format-2 row)."""
        header = row_header(data)
        if header is None or header[0] == 0:
            return []
        depth, count, _ = header
        if count > seq:  # a damaged header: the row itself is reported when read
            return []
        rows: list[Row] = self._conn.execute(
            "SELECT seq, data FROM log WHERE sid = ? AND seq <= ? ORDER BY seq DESC LIMIT ?",
            (sid, seq - count, depth),
        ).fetchall()
        rows.reverse()
        return rows

    @_reads
    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        return self._read(session_id, after_seq, None, on_corrupt)

    @_reads
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
        with self._lock:
            rows = self._rows_unlocked(session_id, after_seq, until_seq)
        out: list[SessionEvent] = []
        reader = RowReader(session_id)
        read = reader.read
        follow = FollowOn(session_id, after_seq)  # rows deleted or overlapping by hand
        for seq, data in rows:
            if type(seq) is not int:  # edited by hand: no place in the log to read it at
                bad = CorruptEvent(session_id, 0, f"a row whose seq is {seq!r:.40}, not a number")
                if on_corrupt is None:
                    raise bad
                on_corrupt(bad)
                continue
            try:
                if seq <= after_seq:  # an earlier row of the first one's group
                    read(seq, data, events=False)
                    continue
                events = read(seq, data)
            except CorruptEvent as exc:
                if seq <= after_seq:
                    continue  # the row that needs it will say so
                bad = follow.unread(exc, seq, data)
                if on_corrupt is None:
                    raise bad from None
                on_corrupt(bad)
                continue
            if (fault := follow.fault(events[0].seq, seq)) is not None:
                if on_corrupt is None:
                    raise fault
                on_corrupt(fault)
                if fault.seq == events[0].seq:  # the row repeats seqs: not read
                    continue
            if events[0].seq <= after_seq:  # the row holds events from before too
                events = [e for e in events if e.seq > after_seq]
            if until_seq is not None and events and events[-1].seq > until_seq:
                events = [e for e in events if e.seq <= until_seq]
            out += events
        return out

    @_reads
    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        check_limit(limit)
        after_position = max(after_position, 0)
        # Each row holds at least one event past after_position: ``limit`` rows suffice.
        bound = -1 if limit is None else limit
        with self._lock:
            if self._old_layout:
                rows: list[tuple[Any, ...]] = self._conn.execute(
                    "SELECT position, session_id, seq, data FROM events "
                    "WHERE position > ? ORDER BY position LIMIT ?",
                    (after_position, bound),
                ).fetchall()
                return [
                    Recorded(position, RowReader(sid).read(seq, data)[0])
                    for position, sid, seq, data in rows
                ]
            rows = self._conn.execute(
                "SELECT position, sid, seq, data FROM log "
                "WHERE position > ? ORDER BY position LIMIT ?",
                (after_position, bound),
            ).fetchall()
            readers: dict[int, tuple[RowReader, int]] = {}  # sid -> reader, last seq read
            work: list[tuple[int, int, int, bytes, RowReader, list[Row]]] = []
            for position, sid, seq, data in rows:
                state = readers.get(sid)
                if state is None:
                    state = (RowReader(self._name_unlocked(sid)), -1)
                reader, last = state
                header = row_header(data)
                before: list[Row] = []
                if header is not None and header[0] and last != seq - header[1]:
                    before = self._group_before_unlocked(sid, seq, data)
                work.append((position, sid, seq, data, reader, before))
                readers[sid] = (reader, seq)
        out: list[Recorded] = []
        for position, _, seq, data, reader, before in work:
            for earlier_seq, earlier in before:
                with suppress(CorruptEvent):  # the row that needs it will say so
                    reader.read(earlier_seq, earlier, events=False)
            events = reader.read(seq, data)
            for event in events:
                at = position - (seq - event.seq)
                if at > after_position:
                    out.append(Recorded(at, event))
        return out if limit is None else out[:limit]

    @_reads
    def last_seq(self, session_id: str) -> int:
        with self._lock:
            return self._last_seq_unlocked(session_id)

    def _last_seq_unlocked(self, session_id: str) -> int:
        if self._old_layout:
            row = self._conn.execute(
                "SELECT max(seq) FROM events WHERE session_id = ? AND typeof(seq) = 'integer'",
                (session_id,),
            ).fetchone()
            return int(row[0] or 0)
        sid = self._sid_unlocked(session_id)
        if sid is None:
            return 0
        # A seq edited into something else (text) is not a seq: its row reads as corrupt.
        row = self._conn.execute(
            "SELECT max(seq) FROM log WHERE sid = ? AND typeof(seq) = 'integer'", (sid,)
        ).fetchone()
        return int(row[0] or 0)

    @_reads
    def sessions(self) -> list[str]:
        with self._lock:
            return self._sessions_unlocked()

    def _sessions_unlocked(self) -> list[str]:
        sql = _OLD_SESSION_IDS if self._old_layout else _SESSION_IDS
        return [_name(r[0]) for r in self._conn.execute(sql).fetchall()]

    @_reads
    def open_sessions(self) -> list[str]:
        with self._lock:
            names = self._sessions_unlocked()
            if not self._has_idle_table:  # a format-1 file opened read-only
                return names
            idle = {r[0] for r in self._conn.execute("SELECT session_id FROM idle_sessions")}
        return [name for name in names if name not in idle]

    @_reads
    def session_page(self, offset: int, limit: int) -> tuple[int, list[tuple[str, int, bool]]]:
        """A page of :meth:`sessions`, for a listing that pages through many: how many
        sessions there are, and ``limit`` from the ``offset``-th, each as (id, last seq,
        open work as :meth:`open_sessions` says). The database counts, skips and sorts
        (a million sessions: about 0.3 s where listing them all took about 3)."""
        offset, limit = max(offset, 0), max(limit, 0)
        with self._lock, self._read_snapshot():
            if self._old_layout:
                names = self._sessions_unlocked()
                page = [(n, self._last_seq_unlocked(n)) for n in names[offset : offset + limit]]
                total = len(names)
            else:
                total = self._conn.execute(_SESSION_COUNT).fetchone()[0]
                page = [
                    (_name(name), int(last or 0))
                    for name, last in self._conn.execute(_SESSION_PAGE, (limit, offset))
                ]
            idle: set[str] = set()
            if self._has_idle_table:
                # A name that is not valid Unicode (edited by hand) is never marked idle.
                valid = [n for n, _ in page if _encodable(n)]
                for start in range(0, len(valid), 500):
                    names = valid[start : start + 500]
                    marks = ",".join("?" * len(names))
                    idle.update(
                        r[0]
                        for r in self._conn.execute(
                            f"SELECT session_id FROM idle_sessions WHERE session_id IN ({marks})",
                            names,
                        )
                    )
        return total, [(n, last, n not in idle) for n, last in page]

    @contextmanager
    def _read_snapshot(self) -> Iterator[None]:
        """Reads that see one state of the file, whatever another connection commits
        meanwhile (a read transaction). Called with the lock held."""
        conn = self._conn
        if conn.in_transaction:  # the lock keeps writes out of here: never, as a rule
            yield
            return
        conn.execute("BEGIN")
        try:
            yield
        finally:
            conn.execute("COMMIT")

    @_reads
    def count(self, session_id: str | None = None) -> int:
        """How many events the store holds (for one session, or all). A log holds seqs
        1 to its last, so this is the last seq, summed over sessions."""
        with self._lock:
            if session_id is not None:
                return self._last_seq_unlocked(session_id)
            table, key = ("events", "session_id") if self._old_layout else ("log", "sid")
            row = self._conn.execute(
                f"SELECT coalesce(sum(last), 0) FROM "
                f"(SELECT max(seq) AS last FROM {table} WHERE typeof(seq) = 'integer' "
                f"GROUP BY {key})"
            ).fetchone()
        return int(row[0])

    @property
    def checkpoints(self) -> int:
        """How many WAL checkpoints the store's thread has run (0 when inline)."""
        return 0 if self._checkpointer is None else self._checkpointer.done

    def close(self) -> None:
        checkpointer = self._checkpointer
        if checkpointer is not None:
            # First, so that the connection closed next is the file's last here: SQLite
            # then checkpoints what is left and removes the WAL.
            checkpointer.stop(timeout=60.0)
        with self._lock:
            self._conn.close()
        self._release_owner()

    def __enter__(self) -> SqliteEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WAL_MAGIC = {0x377F0682: "<", 0x377F0683: ">"}  # the checksums' word order
_WAL_VERSION = 3007000


def _wal_checksum(data: bytes, s0: int, s1: int, order: str) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (8-byte aligned), continuing ``(s0, s1)``."""
    words = iter(struct.unpack(f"{order}{len(data) // 4}I", data))
    for x0, x1 in zip(words, words, strict=True):
        s0 = (s0 + x0 + s1) & 0xFFFFFFFF
        s1 = (s1 + x1 + s0) & 0xFFFFFFFF
    return s0, s1


def wal_adds_nothing(database: str, wal: str) -> bool:
    """Whether ``wal`` holds no commit that ``database``'s own file lacks, so that the
    file read alone (``immutable``) is the database SQLite would read with the WAL.

    The WAL is read as SQLite recovers it (https://sqlite.org/fileformat2.html, "The
    WAL File Format"): a header that is not valid makes an empty WAL; then frames in
    order, each valid while its salts are the header's and its checksum continues the
    chain, up to the last commit frame. Frames past it (an unfinished transaction) do
    not count; frames of a WAL started over before (other salts) end the valid ones.
    True when no frame is committed, or when the last committed image of every page the
    database has after its last commit is byte for byte the database file's page and the
    file is the size that commit left (a checkpoint that copied it all back; pages past
    that end, left by a commit that shrank it, are not the database's). False otherwise,
    and for a WAL of a version SQLite would not open."""
    try:
        with open(wal, "rb") as w, open(database, "rb") as db:
            header = w.read(32)
            if len(header) < 32:
                return True  # no header: SQLite reads no frame
            magic, version, page_size, _, _, _, c0, c1 = struct.unpack(">8I", header)
            order = _WAL_MAGIC.get(magic)
            if order is None or page_size & (page_size - 1) or not 512 <= page_size <= 65536:
                return True
            if _wal_checksum(header[:24], 0, 0, order) != (c0, c1):
                return True
            if version != _WAL_VERSION:
                return False  # SQLite refuses to open it
            s0, s1 = c0, c1
            salts = header[16:24]
            pending: dict[int, int] = {}  # page -> where its image is, this transaction
            committed: dict[int, int] = {}
            pages = 0  # the database's size in pages after the last commit
            at = 32
            while True:
                frame = w.read(24)
                image = w.read(page_size)
                if len(frame) < 24 or len(image) < page_size or frame[8:16] != salts:
                    break
                number, commit, _, _, f0, f1 = struct.unpack(">6I", frame)
                s0, s1 = _wal_checksum(frame[:8], s0, s1, order)
                s0, s1 = _wal_checksum(image, s0, s1, order)
                if number == 0 or (s0, s1) != (f0, f1):
                    break
                pending[number] = at + 24
                at += 24 + page_size
                if commit:
                    committed.update(pending)
                    pending.clear()
                    pages = commit
            if not committed:
                return True
            if os.fstat(db.fileno()).st_size != pages * page_size:
                return False
            for number, where in committed.items():
                if number > pages:  # past the database's end after the last commit
                    continue
                w.seek(where)
                db.seek((number - 1) * page_size)
                if w.read(page_size) != db.read(page_size):
                    return False
            return True
    except (OSError, struct.error):  # unreadable: not known to add nothing
        return False


def _no_writer(database: str) -> bool:
    """Whether no process holds the writer lock beside ``database`` (its WAL would
    change under a reader of the file alone). A lock file that cannot be opened counts
    as none held (a database no writer of this library made)."""
    try:
        fd = os.open(f"{os.path.realpath(database)}.lock", os.O_RDONLY)
    except OSError:
        return True
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except ImportError:  # pragma: no cover - not a POSIX system: no advisory locks
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class _Checkpointer:
    """Checkpoints one store's WAL on a daemon thread of its own, started at the first
    :meth:`wake`, with a connection of its own (see the module docstring). A checkpoint
    that fails (the disk full, say) is logged; a later one tries again. The appends go on
    either way: the WAL keeps what they committed."""

    def __init__(self, path: str, timeout_s: float, mark: int) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._mark = mark  # pages written to the WAL that wake the thread
        self._pages = 0  # written since it was last woken, roughly
        self._held_back_mark = self._held_back_at = 4 * mark  # WAL pages held back: said
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.done = 0  # checkpoints this thread ran
        self.caught_up = 0  # checkpoints an append ran, to finish one of them
        self.failed = 0
        self.catch_up = False  # the next append checkpoints what is left
        self.restart_due = False  # then the one after it starts the WAL over
        self.missed = False  # woken meanwhile: wake it again once that is done
        self._flags = threading.Lock()  # restart_due and missed change together

    def wake(self) -> None:
        """Checkpoint soon (the appends crossed the mark)."""
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                thread = self._thread
                if (thread is None or not thread.is_alive()) and not self._stopping:
                    thread = threading.Thread(
                        target=self._run, name="aalis-wal-checkpoint", daemon=True
                    )
                    thread.start()
                    self._thread = thread
        self._wake.set()

    def checkpoint(self, conn: sqlite3.Connection, *, inline: bool = False) -> str:
        """One ``PASSIVE`` checkpoint on ``conn``: ``"ran"``, ``"busy"`` (another
        connection was checkpointing) or ``"failed"`` (logged, never raised)."""
        try:
            # fetchall: a statement left unfinished would hold a snapshot, and with it
            # the WAL, as a reader does.
            rows = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            self._failed(exc, inline)
            return "failed"
        if rows and rows[0][0]:
            return "busy"
        if not inline and rows:
            self._held_back(int(rows[0][1]), int(rows[0][2]))
        if inline:
            self.caught_up += 1
        else:
            self.done += 1
        return "ran"

    def after_append(self, conn: sqlite3.Connection, size: int) -> None:
        """The writer's part, after each append of a ``size``-byte row (on its connection,
        with its lock held): copy back what the appends added while the thread
        checkpointed (the append after that starts the WAL over, as long as no checkpoint
        runs as it begins, so the thread waits for it); count the pages written, and wake
        the thread at the mark."""
        if self.restart_due:  # this append began with the WAL copied back whole
            with self._flags:
                self.restart_due = False
                missed, self.missed = self.missed, False
            if missed:
                self.wake()
        if self.catch_up:
            done = self.checkpoint(conn, inline=True)
            if done != "busy":  # busy: after the next append, then
                with self._flags:  # the thread never sees both off in between
                    self.restart_due = done == "ran"
                    self.catch_up = False
        self._pages += _FRAMES + size // _PAGE
        if self._pages >= self._mark:
            self._pages = 0
            self.wake()

    def _held_back(self, frames: int, copied: int) -> None:
        """Say so when a reader holding an old snapshot keeps the WAL from being copied
        back while it grows: at four times the mark, then at each doubling."""
        if frames < 0 or copied >= frames:
            self._held_back_at = self._held_back_mark  # copied back whole: from the start
            return
        if frames >= self._held_back_at:
            self._held_back_at = frames * 2
            with suppress(Exception):
                log.warning(
                    "WAL held back by a reader: it cannot be copied back while that "
                    "reader keeps an older snapshot open",
                    path=self._path,
                    wal_pages=frames,
                    copied_pages=copied,
                )

    def _failed(self, exc: BaseException, inline: bool) -> None:
        self.failed += 1
        with suppress(Exception):  # a logger that fails (its disk full) changes nothing
            log.warning(
                "WAL checkpoint failed; a later one tries again",
                path=self._path,
                error=str(exc),
                inline=inline,
            )

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                if conn is None:
                    try:
                        # The file as it was opened (mode=rw: never a new, empty one).
                        conn = sqlite3.connect(
                            f"file:{quote(os.fsencode(self._path))}?mode=rw",
                            uri=True,
                            isolation_level=None,
                            timeout=self._timeout_s,
                        )
                    except sqlite3.Error as exc:
                        self._failed(exc, inline=False)
                        continue
                with self._flags:
                    if self.catch_up or self.restart_due:
                        self.missed = True  # a checkpoint now would keep it from restarting
                        continue
                # Appends went on meanwhile (this connection's view of the WAL may end
                # before theirs): copy what they added, then leave the rest (a few pages)
                # to the next append, which sees the whole WAL and adds nothing meanwhile.
                try:
                    if self.checkpoint(conn) == "ran" and self.checkpoint(conn) == "ran":
                        self.catch_up = True
                except Exception as exc:  # whatever it is, the next wake tries again
                    self._failed(exc, inline=False)
        finally:
            if conn is not None:
                with suppress(sqlite3.Error):
                    conn.close()

    def stop(self, timeout: float) -> None:
        """End the thread (after the checkpoint it is running, if any)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
