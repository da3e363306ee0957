"""``SqliteEventStore``: the durable default store.

The table ``events`` (WITHOUT ROWID): primary key ``(session_id, seq)`` is the
concurrency check, a unique global ``position`` orders ``read_all``, ``type`` is the
event's tag (handy in SQL), ``data`` the MessagePack-encoded event. Beside it,
``idle_sessions`` lists the sessions whose last append said they had no unfinished work,
written in the same transaction, so recovery folds only the others. WAL journal with
``synchronous=NORMAL``: an append is acknowledged after its transaction commits. A batch
is one transaction.

The schema is made with sqlite-utils; the hot paths use the raw connection, since
sqlite-utils commits every call on its own.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import sqlite_utils
from aalis_agent.events.codec import decode, event_tag
from aalis_agent.events.errors import ConcurrencyConflict, CorruptEvent, StoreError
from aalis_agent.events.ownership import acquire_writer, release_writer
from aalis_agent.events.schema import SessionEvent
from aalis_agent.events.store import (
    CorruptHandler,
    Recorded,
    check_batch,
    check_limit,
    encode_batch,
)

__all__ = ["SqliteEventStore"]

_STORE_FORMAT = 2  # PRAGMA user_version of a database this code created
# Format 1 had no ``idle_sessions``; opening one adds the (empty) table, which is all
# format 2 adds: every session then counts as possibly open until recovery marks it.
# Opened ``read_only`` (as replay does), a format-1 file is read as it is.
_SESSION_IDS = (
    "WITH RECURSIVE s(id) AS ("
    " SELECT (SELECT min(session_id) FROM events)"
    " UNION ALL"
    " SELECT (SELECT min(session_id) FROM events WHERE session_id > s.id)"
    " FROM s WHERE s.id IS NOT NULL) "
    "SELECT id FROM s WHERE id IS NOT NULL"
)
"""Every session id, sorted, by skipping along the primary key: one seek per session
rather than a visit to every event."""
_INSERT = "INSERT INTO events (position, session_id, seq, type, data) VALUES (?, ?, ?, ?, ?)"
_MARK_IDLE = "INSERT OR IGNORE INTO idle_sessions (session_id) VALUES (?)"
_UNMARK_IDLE = "DELETE FROM idle_sessions WHERE session_id = ?"


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
    ) -> None:
        """Open (and create when new) the event database at ``path``.

        ``exclusive`` keeps the file locked by this process for its lifetime: appends
        skip the per-transaction locking (about a third faster here) but no other
        process can read the database meanwhile, ``aalis-agent replay`` included.
        ``wal_autocheckpoint`` is the WAL size, in pages, that triggers a checkpoint.
        ``read_only`` opens an existing file for reading only: nothing is created,
        migrated or written (an older format is read as it is), and writes are refused.
        ``single_writer`` (the default) makes this process the file's only writer until
        :meth:`close` (see :mod:`aalis_agent.events.ownership`): another process opening
        it for writing gets :class:`StoreInUse`. Turn it off only to test concurrent
        writers; the sequence check still refuses a stale append.
        """
        self.path = str(path)
        self.read_only = read_only
        if read_only and self.path == ":memory:":
            raise StoreError("a read-only event database must be a file")
        self._owner: str | None = None
        if single_writer and not read_only and self.path != ":memory:":
            self._owner = acquire_writer(self.path)
        try:
            self._open(path, timeout_s, exclusive, wal_autocheckpoint)
        except BaseException:
            self._release_owner()
            raise

    def _release_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            release_writer(owner)

    def _open(
        self, path: str | Path, timeout_s: float, exclusive: bool, wal_autocheckpoint: int
    ) -> None:
        read_only = self.read_only
        target = f"file:{quote(self.path)}?mode=ro" if read_only else self.path
        try:
            conn = sqlite3.connect(
                target,
                check_same_thread=False,
                isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                timeout=timeout_s,
                uri=read_only,
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None
        self._conn = conn
        self._lock = threading.Lock()
        self._exclusive = exclusive
        # Last seq per session and last position, exact while no other connection writes.
        self._seq_cache: dict[str, int] = {}
        self._idle_cache: dict[str, bool] = {}  # session -> has a row in idle_sessions
        self._position_cache: int | None = None
        self._data_version: int | None = None
        self._has_idle_table = True
        try:
            if read_only:
                self._check_schema_read_only()
                return
            if exclusive:
                conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint={int(wal_autocheckpoint)}")
            self._ensure_schema()
        except sqlite3.OperationalError as exc:
            conn.close()
            raise StoreError(f"cannot open event database {self.path!r}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{self.path!r} is not a usable event database: {exc}") from None

    def _unknown_format(self, version: int) -> StoreError:
        return StoreError(f"{self.path!r}: event table format {version} is not {_STORE_FORMAT}")

    def _check_schema_read_only(self) -> None:
        """The checks of :meth:`_ensure_schema` without its writes: format 1 is read as
        it is (no session index, so every session counts as open)."""
        tables = {
            r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if "events" not in tables:
            raise StoreError(f"{self.path!r} holds no event table")
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (1, _STORE_FORMAT):
            raise self._unknown_format(version)
        self._has_idle_table = "idle_sessions" in tables

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path!r} is opened read-only: nothing can be written")

    def _ensure_schema(self) -> None:
        db = sqlite_utils.Database(self._conn)
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if "events" in db.table_names():
            if version == 1:
                with db.conn:
                    self._create_idle_table()
                    self._conn.execute(f"PRAGMA user_version={_STORE_FORMAT}")
                return
            if version != _STORE_FORMAT:
                raise self._unknown_format(version)
            return
        # sqlite-utils writes the table definition; WITHOUT ROWID (which it has no flag
        # for) clusters rows by (session_id, seq), so reading one session is one range scan.
        sql = db.create_table_sql(
            "events",
            {"position": int, "session_id": str, "seq": int, "type": str, "data": bytes},
            pk=("session_id", "seq"),
            not_null={"position", "session_id", "seq", "type", "data"},
        )
        with db.conn:
            db.execute(sql.rstrip().rstrip(";") + " WITHOUT ROWID")
            db["events"].create_index(  # type: ignore[union-attr]
                ["position"], index_name="events_position", unique=True
            )
            self._create_idle_table()
        self._conn.execute(f"PRAGMA user_version={_STORE_FORMAT}")

    def _create_idle_table(self) -> None:
        # Sessions whose writer said they have no unfinished work (see open_sessions).
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS idle_sessions (session_id TEXT PRIMARY KEY) WITHOUT ROWID"
        )

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
        rows = [(session_id, e.seq, event_tag(e), blob) for e, blob in encode_batch(events)]
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise StoreError(f"{self.path!r}: cannot start a write: {exc}") from None
            try:
                self._refresh_cache()
                actual = self._seq_cache.get(session_id)
                if actual is None:
                    actual = self._last_seq_unlocked(session_id)
                    self._seq_cache[session_id] = actual
                if actual != expected_seq:
                    raise ConcurrencyConflict(session_id, expected_seq, actual)
                position = self._position_cache
                if position is None:
                    position = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
                if len(rows) == 1:
                    conn.execute(_INSERT, (position + 1, *rows[0]))
                elif rows:
                    conn.executemany(
                        _INSERT, [(position + i, *row) for i, row in enumerate(rows, 1)]
                    )
                if rows and self._idle_cache.get(session_id) is not idle:
                    if idle:
                        conn.execute(_MARK_IDLE, (session_id,))
                    else:
                        conn.execute(_UNMARK_IDLE, (session_id,))
                conn.execute("COMMIT")
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
            self._seq_cache[session_id] = expected_seq + len(rows)
            self._position_cache = position + len(rows)
            if rows:
                self._idle_cache[session_id] = idle
        return expected_seq + len(rows)

    def _refresh_cache(self) -> None:
        """Drop the cached last seqs and position if another connection has written.

        ``PRAGMA data_version`` changes only when another connection commits, so while
        it holds still the caches are exact and an append needs no lookups. Called with
        the write lock held (inside BEGIN IMMEDIATE).
        """
        if self._exclusive and self._data_version is not None:
            return  # no other connection can write
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._forget_cache()
            self._data_version = version

    def _forget_cache(self) -> None:
        self._seq_cache.clear()
        self._idle_cache.clear()
        self._position_cache = None

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

    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, data FROM events WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, after_seq),
            ).fetchall()
        out: list[SessionEvent] = []
        append = out.append
        for seq, data in rows:
            try:
                append(decode(data, session_id=session_id, seq=seq))
            except CorruptEvent as exc:
                if on_corrupt is None:
                    raise
                on_corrupt(exc)
        return out

    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        check_limit(limit)
        with self._lock:
            rows = self._conn.execute(
                "SELECT position, session_id, seq, data FROM events "
                "WHERE position > ? ORDER BY position LIMIT ?",
                (after_position, -1 if limit is None else limit),
            ).fetchall()
        return [
            Recorded(position, decode(data, session_id=sid, seq=seq))
            for position, sid, seq, data in rows
        ]

    def last_seq(self, session_id: str) -> int:
        with self._lock:
            return self._last_seq_unlocked(session_id)

    def _last_seq_unlocked(self, session_id: str) -> int:
        row = self._conn.execute(
            "SELECT max(seq) FROM events WHERE session_id = ?", (session_id,)
        ).fetchone()
        return int(row[0] or 0)

    def sessions(self) -> list[str]:
        with self._lock:
            rows = self._conn.execute(_SESSION_IDS).fetchall()
        return [r[0] for r in rows]

    def open_sessions(self) -> list[str]:
        with self._lock:
            rows = self._conn.execute(_SESSION_IDS).fetchall()
            if not self._has_idle_table:  # a format-1 file opened read-only
                return [r[0] for r in rows]
            idle = {r[0] for r in self._conn.execute("SELECT session_id FROM idle_sessions")}
        return [r[0] for r in rows if r[0] not in idle]

    def count(self, session_id: str | None = None) -> int:
        """How many events the store holds (for one session, or all)."""
        with self._lock:
            if session_id is None:
                row = self._conn.execute("SELECT count(*) FROM events").fetchone()
            else:
                row = self._conn.execute(
                    "SELECT count(*) FROM events WHERE session_id = ?", (session_id,)
                ).fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        self._release_owner()

    def __enter__(self) -> SqliteEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
