"""``PostgresLeases``: session ownership as lease rows in the shared PostgreSQL database.

    leases = PostgresLeases(url, owner="node-1", ttl_s=15)
    runtime = Runtime(PostgresEventStore(url), services, ownership=leases)

Table (created on first use, in the URL's ``search_path`` schema, beside the event log):
``aalis_leases (session bytea PRIMARY KEY, owner text, expires_at timestamptz)``.

- ``acquire`` inserts the row, or takes it over when it is this owner's or has expired;
  otherwise it raises :class:`SessionOwnedElsewhere` naming the holder. One statement,
  so two runtimes racing for a session cannot both win.
- A background thread renews every lease held here every ``renew_s`` (one statement
  for all of them). A lease no longer found under this owner was taken over: the
  ``on_lost`` callbacks run (the runtime stops that session's actor). When renewing
  fails for longer than ``ttl_s`` (the database unreachable), every lease is treated as
  lost, since another runtime may have it by now.
- ``release`` deletes the row (the last of this process's acquisitions of it).
- ``confirm`` is asked before each model call and tool run: after a pause past half the
  ttl without a renewal it renews at once, so a runtime that was stopped (SIGSTOP, a
  stalled VM) finds out it lost a session before it acts for it, not after.

Expiry is read on the database's clock (``clock_timestamp()``), so the machines' clocks
need not agree. A holder that dies (SIGKILL, power loss, a partition) stops renewing:
``ttl_s`` later its sessions can be taken over. A holder that was merely paused and
comes back finds its leases gone at its next renewal, or at once when one of its turns
is about to act (``confirm``); whatever it appends meanwhile is refused by the store's
sequence check (``ConcurrencyConflict``), which fences its actor. Only an action already
under way when the pause began goes on after it: a lease cannot stop that.

Why rows and not ``pg_advisory_lock`` on a held connection: the lease and its holder
are visible in a table (the refusal names the owner; operators can read and clear it),
nothing depends on one connection staying up (a reconnect or a transaction-pooling
proxy such as PgBouncer keeps working), and the takeover delay is ``ttl_s``, not the
server's TCP keepalive for a machine that vanished. The price: after a crash a session
waits up to ``ttl_s`` for its next owner, where an advisory lock of a process killed on
a live machine is freed at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import structlog
from aalis_agent.events.errors import InvalidInput, StoreError
from aalis_agent.events.postgres import (
    PostgresEventStore,
    error_line,
    keepalive_options,
    redact_url,
    session_key,
)
from aalis_agent.scale.ownership import LostCallback, SessionOwnedElsewhere

__all__ = ["PostgresLeases", "default_owner"]

log = structlog.get_logger("aalis.leases")

T = TypeVar("T")

_LOCK = 0x6161_6C69_7301  # advisory lock key: one process creates the table
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS aalis_leases ("
    " session bytea PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL)"
)
_ACQUIRE = (
    "INSERT INTO aalis_leases AS l (session, owner, expires_at)"
    " VALUES (%(s)s, %(o)s, clock_timestamp() + make_interval(secs => %(ttl)s))"
    " ON CONFLICT (session) DO UPDATE SET owner = excluded.owner,"
    " expires_at = excluded.expires_at"
    " WHERE l.owner = excluded.owner OR l.expires_at <= clock_timestamp()"
    " RETURNING l.owner"
)
_HOLDER = (
    "SELECT owner, extract(epoch FROM expires_at - clock_timestamp())::float8"
    " FROM aalis_leases WHERE session = %s"
)
_RENEW = (
    "UPDATE aalis_leases SET expires_at = clock_timestamp() + make_interval(secs => %s)"
    " WHERE owner = %s AND session = ANY(%s) RETURNING session"
)
_RELEASE = "DELETE FROM aalis_leases WHERE session = %s AND owner = %s"
_RELEASE_ALL = "DELETE FROM aalis_leases WHERE owner = %s AND session = ANY(%s)"


def default_owner() -> str:
    """``host/pid/random``: unique per process, readable in a refusal."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


class PostgresLeases:
    """Session leases in PostgreSQL, renewed in the background (see the module)."""

    def __init__(
        self,
        target: str | PostgresEventStore,
        *,
        owner: str | None = None,
        ttl_s: float = 15.0,
        renew_s: float | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        """``target``: the database's URL, or the event store on it (its URL is used; the
        leases have a connection of their own, so renewals never wait behind appends).
        ``owner`` names this runtime (default :func:`default_owner`); ``ttl_s`` is how
        long a lease lasts without renewal; ``renew_s`` (default a third of it) how often
        it is renewed."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.url = target.url if isinstance(target, PostgresEventStore) else target
        self.path = redact_url(self.url)
        self._owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.renew_s = renew_s if renew_s is not None else ttl_s / 3
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # the connection and _held
        self._conn: psycopg.Connection[Any] | None = None
        self._held: dict[str, int] = {}  # session -> acquisitions not yet released
        self._callbacks: list[LostCallback] = []
        self._last_renewed = self._last_attempt = time.monotonic()
        self._stop = threading.Event()
        self._closed = False
        with self._lock:
            self._run(self._create)
        self._renewer = threading.Thread(target=self._renew_loop, name="leases", daemon=True)
        self._renewer.start()

    @property
    def owner(self) -> str:
        return self._owner

    # --- the connection --------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=max(int(self._timeout_s), 1),
                **keepalive_options(self.url),
            )
            try:  # a statement that waits (a lock held elsewhere) ends within timeout_s
                conn.execute(f"SET statement_timeout = {max(int(self._timeout_s * 1000), 1)}")
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn`` on the connection (called with ``_lock`` held), reconnecting once when
        the connection broke. A failure is a :class:`StoreError` giving the error's first
        line (:func:`error_line`), as the event store's do."""
        for attempt in (1, 2):
            try:
                return fn(self._connection())
            except psycopg.OperationalError as exc:
                conn = self._conn
                if conn is not None and not conn.broken and not conn.closed:
                    # The server refused the statement (its timeout, say): the same
                    # again would wait as long once more.
                    raise StoreError(f"{self.path!r}: leases failed: {error_line(exc)}") from None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                self._conn = None
                if attempt == 2:
                    raise StoreError(f"{self.path!r}: leases failed: {error_line(exc)}") from None
            except psycopg.Error as exc:
                raise StoreError(f"{self.path!r}: leases failed: {error_line(exc)}") from None
        raise AssertionError("unreachable")

    @staticmethod
    def _create(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
            conn.execute(_SCHEMA)

    # --- owning ----------------------------------------------------------------------

    def acquire(self, session_id: str) -> None:
        key = session_key(session_id)
        params = {"s": key, "o": self._owner, "ttl": self.ttl_s}

        def take(conn: psycopg.Connection[Any]) -> tuple[str, float | None] | None:
            for _ in range(3):  # the holder may release between the two statements
                try:
                    taken = conn.execute(_ACQUIRE, params).fetchone()
                except psycopg.errors.ProgramLimitExceeded as exc:  # an index row too big
                    raise InvalidInput(
                        f"session {session_id!r:.80}: no lease can be taken on it "
                        f"({error_line(exc)}); "
                        f"its session id is {len(key):,} bytes (UTF-8), too long"
                    ) from None
                if taken is not None:
                    return None
                row = conn.execute(_HOLDER, (key,)).fetchone()
                if row is not None:
                    return str(row[0]), max(float(row[1]), 0.0)
            return "?", None

        with self._lock:
            if self._closed:
                raise StoreError(f"{self.path!r}: the leases are closed")
            try:
                held_by = self._run(take)
            except StoreError as exc:  # named for the session whose start it refuses
                raise StoreError(
                    f"session {session_id!r:.80}: no lease could be taken ({exc}): the "
                    "session is not started here, and nothing was written for it"
                ) from None
            if held_by is None:
                self._held[session_id] = self._held.get(session_id, 0) + 1
                return
        raise SessionOwnedElsewhere(session_id, held_by[0], held_by[1])

    def release(self, session_id: str) -> None:
        with self._lock:
            count = self._held.get(session_id, 0)
            if count > 1:
                self._held[session_id] = count - 1
                return
            if count == 0:
                return  # lost meanwhile, or never held
            del self._held[session_id]
            if self._closed:
                return
            try:
                self._run(lambda c: c.execute(_RELEASE, (session_key(session_id), self._owner)))
            except StoreError as exc:  # it expires by itself
                log.warning("lease not released", session=session_id, error=str(exc))

    def on_lost(self, callback: LostCallback) -> None:
        self._callbacks.append(callback)

    def held(self) -> list[str]:
        """The sessions held here."""
        with self._lock:
            return sorted(self._held)

    def holders(self) -> dict[str, tuple[str, float]]:
        """Every lease in the table: session -> (owner, seconds left; negative when it
        has expired)."""
        sql = (
            "SELECT session, owner, extract(epoch FROM expires_at - clock_timestamp())::float8"
            " FROM aalis_leases"
        )
        with self._lock:
            rows = self._run(lambda c: c.execute(sql).fetchall())
        return {bytes(s).decode("utf-8", "surrogatepass"): (str(o), float(t)) for s, o, t in rows}

    # --- renewing --------------------------------------------------------------------

    def confirm(self, session_id: str) -> bool:
        """Whether the session is still held here, asked before a turn acts (a model call,
        a tool): yes when the leases were renewed less than half a ttl ago (the renewals
        come every ``renew_s``, a third of it by default); else they are renewed now, as
        after a pause (a stopped process, a stalled machine) the lease may have expired
        and another runtime taken the session, and the answer is whether it was kept."""
        now = time.monotonic()
        if (
            now - self._last_renewed >= self.ttl_s / 2
            and now - self._last_attempt >= min(1.0, self.renew_s)  # not on every call
        ):  # while the database does not answer
            self.renew()
        return session_id in self._held and time.monotonic() - self._last_renewed < self.ttl_s

    def renew(self) -> list[str]:
        """Renew every lease held here now; returns the sessions found lost (their
        callbacks have run)."""
        lost: list[str] = []
        with self._lock:
            if self._closed or not self._held:
                self._last_renewed = time.monotonic()
                return []
            sessions = list(self._held)
            started = self._last_attempt = time.monotonic()
            keys = [session_key(s) for s in sessions]
            try:
                rows = self._run(
                    lambda c: c.execute(_RENEW, (self.ttl_s, self._owner, keys)).fetchall()
                )
            except StoreError as exc:
                if time.monotonic() - self._last_renewed < self.ttl_s:
                    log.warning("leases not renewed", error=str(exc))
                    return []
                log.error("leases not renewed for longer than their ttl: lost", error=str(exc))
                lost = sessions
            else:
                self._last_renewed = started
                kept = {bytes(r[0]) for r in rows}
                lost = [s for s, k in zip(sessions, keys, strict=True) if k not in kept]
            for session_id in lost:
                self._held.pop(session_id, None)
        for session_id in lost:
            log.warning("lease lost: another runtime took the session", session=session_id)
            for callback in list(self._callbacks):
                try:
                    callback(session_id)
                except Exception:
                    log.exception("lease-lost callback failed", session=session_id)
        return lost

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except Exception:
                log.exception("lease renewal failed")

    def close(self) -> None:
        """Stop renewing and release every lease held here."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions, self._held = list(self._held), {}
        self._stop.set()
        if self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        with self._lock:
            try:
                if sessions:
                    keys = [session_key(s) for s in sessions]
                    self._run(lambda c: c.execute(_RELEASE_ALL, (self._owner, keys)))
            except StoreError as exc:
                log.warning("leases not released at close", error=str(exc))
            finally:
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                    self._conn = None

    def __enter__(self) -> PostgresLeases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
