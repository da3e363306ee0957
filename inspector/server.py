"""The inspector's HTTP server: a read-only page and JSON over one event database.

The standard library's ``ThreadingHTTPServer`` serves it: the inspector is a local,
single-user debugging page with a handful of GET routes and static files, so it needs no
router, no ASGI loop (every answer is a blocking SQLite read and a fold) and no new
dependency. It binds the loopback address only, answers only requests addressed to it by
a loopback name (a page elsewhere cannot reach it through DNS rebinding), answers the API
only to its own page (a browser's request for a page of another origin is refused), and
only reads: the database (a SQLite file, or a ``postgresql://`` URL) is opened read-only.

Routes (``<id>`` is the session id, percent-encoded as one path segment):

* ``/`` the page; ``/static/<file>`` its script, styles and the chart library.
* ``/api/sessions?offset=0&limit=500`` a page of the sessions with their event counts
  (``total``, ``next_offset``).
* ``/api/sessions/<id>/timeline?offset=0&limit=50`` a page of turns (negative offset:
  from the end), with the session's summary; the events after the last turn on the last
  page.
* ``/api/sessions/<id>/events?from=A&to=B&limit=500`` events A..B as lines and as data;
  ``&whole=1``: the first of them alone, whole.
* ``/api/sessions/<id>/request?turn=T&index=K`` one model call as the log records it
  (``ordinal=N`` instead of ``turn``: the turn at that place in the timeline).
* ``/api/sessions/<id>/usage`` the token-usage series, one point per recorded call (past
  ``index.USAGE_POINTS`` calls, each stretch's least, most and first trimmed).
* ``/api/sessions/<id>/state?seq=N`` the fold of the log up to N: history, queue, turn.
* ``/api/session/<what>?id=<id>&...`` each of the five above with the session id in the
  query (what the page asks): a browser takes an id of ``.`` or ``..`` in a path as a
  step of the path, even written ``%2E``.

Every answer is bounded in bytes whatever the log holds (a text of 50 MB, a turn of
30,000 tool calls): long texts come as previews, long lists as their first or newest
entries, and each says what it left out (``cut``, ``..._omitted``, ``next_offset``,
``next_from``); ``index.ANSWER_BOUND`` states the bound. The events page with
``whole=1`` is the way to a whole value: one event, as large as the log made it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import msgspec
from aalis_agent.events import CorruptEvent, SqliteEventStore, StoreError
from aalis_agent.events.codec import clean_value
from aalis_agent.events.open import is_postgres_url, missing_database, open_store
from aalis_agent.events.store import EventStore
from aalis_agent.inspector.index import CORRUPT_SHOWN, PREVIEW, SessionIndex

__all__ = ["LOOPBACK", "Inspector", "InspectorServer", "make_server"]

LOOPBACK = "127.0.0.1"
STATIC = Path(__file__).resolve().parent / "static"
MAX_PAGE = 500  # turns in one timeline page
SESSIONS_PAGE = 500
"""Sessions one ``/api/sessions`` answer lists at most (``?offset=&limit=`` pages on)."""
SESSION_ID_SHOWN = 1_000
"""Characters of a session id the session list shows; a longer one is cut there (such a
session opens from its URL, ``#session=<id>``)."""
MAX_EVENTS = 2000  # events in one events answer
CACHED_SESSIONS = 4  # decoded logs kept in memory
INT_RANGE = range(-(2**63), 2**63)
"""What a number parameter may be: a 64-bit integer, as the database's numbers are."""

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}


class NotFound(Exception):
    """Answered with 404 and its message."""


class BadRequest(Exception):
    """Answered with 400 and its message."""


class Inspector:
    """The JSON answers over one read-only store, with the last few sessions indexed."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[threading.Lock, SessionIndex, list[Any]]] = (
            OrderedDict()
        )
        self._read_to: dict[str, int] = {}

    def sessions(self, offset: int = 0, limit: int = SESSIONS_PAGE) -> dict[str, Any]:
        """A page of the sessions, in the store's order, each with its event count and
        whether it has open work: ``limit`` from the ``offset``-th; ``total`` counts all,
        ``next_offset`` is where the next page starts (None after the last). An id longer
        than :data:`SESSION_ID_SHOWN` characters is cut (its whole length in ``cut``)."""
        offset = max(offset, 0)
        paged = getattr(self.store, "session_page", None)  # the stores here have it
        if paged is not None:
            total, page = paged(offset, limit)
            if offset > total:  # past the end: the last place there is
                offset = total
        else:  # another store: every name, then the page
            names = self.store.sessions()
            total = len(names)
            offset = min(offset, total)
            try:
                open_ = set(self.store.open_sessions())
            except StoreError:
                open_ = set(names)
            page = [(n, self.store.last_seq(n), n in open_) for n in names[offset : offset + limit]]
        listed: list[dict[str, Any]] = []
        for n, last, is_open in page:
            entry: dict[str, Any] = {"session_id": n, "events": last, "open": is_open}
            if len(n) > SESSION_ID_SHOWN:
                entry["session_id"] = n[: SESSION_ID_SHOWN - 1] + "…"
                entry["cut"] = {"session_id": len(n)}
            listed.append(entry)
        end = offset + len(page)
        return {
            "sessions": listed,
            "total": total,
            "offset": offset,
            "next_offset": end if end < total else None,
        }

    def session(self, session_id: str) -> tuple[threading.Lock, SessionIndex, list[Any]]:
        """The session's index, brought up to the log's end (a live writer may append)."""
        last = self.store.last_seq(session_id)
        if last == 0:
            raise NotFound(f"no session {session_id!r}")
        with self._lock:
            entry = self._cache.get(session_id)
            if entry is None:
                entry = (threading.Lock(), SessionIndex(session_id), [])
                self._cache[session_id] = entry
                self._read_to[session_id] = 0
                while len(self._cache) > CACHED_SESSIONS:
                    gone, _ = self._cache.popitem(last=False)
                    self._read_to.pop(gone, None)
            self._cache.move_to_end(session_id)
        lock, index, corrupt = entry
        with lock:
            read_to = self._read_to.get(session_id, 0)
            if last > read_to:
                bad: list[CorruptEvent] = []
                index.feed(self.store.read(session_id, read_to, on_corrupt=bad.append))
                corrupt.extend({"seq": b.seq, "reason": _cut(b.reason)} for b in bad)
                self._read_to[session_id] = last
        return entry

    def call(
        self, session_id: str, answer: Callable[[SessionIndex], dict[str, Any] | None]
    ) -> dict[str, Any]:
        lock, index, corrupt = self.session(session_id)
        with lock:  # folds extend shared lists: one at a time per session
            data = answer(index)
            if data is not None and "summary" in data:
                data["summary"]["corrupt"] = corrupt[:CORRUPT_SHOWN]
                data["summary"]["corrupt_omitted"] = max(len(corrupt) - CORRUPT_SHOWN, 0)
        if data is None:
            raise NotFound("no such record in this session")
        return data


def _cut(reason: str) -> str:
    """Why a row does not decode, cut to :data:`PREVIEW` characters (a decoder's message
    may quote a whole value of the row)."""
    return reason if len(reason) <= PREVIEW else reason[: PREVIEW - 1] + "…"


def _int(query: dict[str, list[str]], name: str, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise BadRequest(f"missing parameter {name!r}")
        return default
    try:
        number = int(values[0])
    except ValueError:
        raise BadRequest(f"parameter {name!r} must be an integer, got {values[0][:40]!r}") from None
    if number not in INT_RANGE:
        raise BadRequest(f"parameter {name!r} is out of range, got {values[0][:40]!r}")
    return number


def route(inspector: Inspector, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
    """The JSON answer for an ``/api/...`` path (raw, still percent-encoded)."""
    parts = path.strip("/").split("/")
    if parts == ["api", "sessions"]:
        offset = _int(query, "offset", 0)
        limit = min(max(_int(query, "limit", SESSIONS_PAGE), 1), SESSIONS_PAGE)
        return inspector.sessions(offset, limit)
    if len(parts) == 3 and parts[:2] == ["api", "session"]:
        # The session named in the query (``/api/session/timeline?id=...``), as the page
        # asks: an id in the path that is "." or ".." is taken by browsers as a step of
        # the path (even written %2E), and never reaches the server.
        ids = query.get("id")
        if not ids:
            raise BadRequest("missing parameter 'id'")
        session_id, what = ids[0], parts[2]
    elif len(parts) == 4 and parts[:2] == ["api", "sessions"]:
        session_id, what = unquote(parts[2]), parts[3]
    else:
        raise NotFound(f"no route {path!r}")
    if what == "timeline":
        offset = _int(query, "offset", 0)
        limit = min(max(_int(query, "limit", 50), 1), MAX_PAGE)

        def timeline(ix: SessionIndex) -> dict[str, Any]:
            data = ix.timeline(offset, limit)
            data["summary"] = ix.summary()
            return data

        return inspector.call(session_id, timeline)
    if what == "events":
        first = _int(query, "from", 1)
        last = _int(query, "to", first + MAX_EVENTS - 1)
        limit = min(max(_int(query, "limit", MAX_EVENTS), 1), MAX_EVENTS)
        whole = _int(query, "whole", 0) == 1
        return inspector.call(
            session_id, lambda ix: ix.events_page(first, last, limit, whole=whole)
        )
    if what == "request":
        index = _int(query, "index")
        if query.get("ordinal"):  # the turn by its place in the timeline
            ordinal = _int(query, "ordinal")

            def at(ix: SessionIndex) -> dict[str, Any]:
                found = ix.request_at(ordinal, index)
                if found is None:
                    raise NotFound(ix.no_call(index, ordinal=ordinal))
                return found

            return inspector.call(session_id, at)
        turn = (query.get("turn") or [""])[0]
        if not turn:
            raise BadRequest("missing parameter 'turn' (or 'ordinal')")

        def of(ix: SessionIndex) -> dict[str, Any]:
            found = ix.request(turn, index)
            if found is None:
                raise NotFound(ix.no_call(index, turn_id=turn))
            return found

        return inspector.call(session_id, of)
    if what == "usage":
        return inspector.call(session_id, lambda ix: ix.usage_series())
    if what == "state":
        seq = _int(query, "seq")
        if seq < 0:
            raise BadRequest("seq must be 0 or more")
        return inspector.call(session_id, lambda ix: ix.state(seq))
    raise NotFound(f"no route {path!r}")


class _Handler(BaseHTTPRequestHandler):
    server: InspectorServer
    protocol_version = "HTTP/1.1"
    server_version = "aalis-inspector"
    sys_version = ""
    # A client that sends nothing for this long is let go (an idle or slow connection
    # held a thread for good).
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(format % args)

    def _close_after_a_body(self) -> None:
        """A request announcing a body is answered, then its connection closed: the body
        is never read (no route takes one), and kept open its bytes would be taken for
        the next request (a request smuggled in a body, Host header and all)."""
        length = (self.headers.get("Content-Length") or "").strip()
        if self.headers.get("Transfer-Encoding") is not None or length not in ("", "0"):
            self.send_header("Connection", "close")  # and sets close_connection

    def _send(self, status: int, body: bytes, content_type: str, cache: bool = False) -> None:
        self.send_response(status)
        self._close_after_a_body()
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=300" if cache else "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
            "connect-src 'self'; frame-ancestors 'none'",
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any) -> None:
        try:
            body = msgspec.json.encode(data)
        except UnicodeEncodeError:  # text that is not valid Unicode (a name edited by hand)
            body = msgspec.json.encode(clean_value(data))
        self._send(status, body, "application/json; charset=utf-8")

    def _host_ok(self) -> bool:
        """Exactly one Host header naming this loopback server, and no other host in an
        absolute-form request target (which would take precedence over it)."""
        hosts = self.headers.get_all("Host") or []
        port = self.server.server_address[1]
        ours = {f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"}
        if port == 80:  # the default port: browsers leave it out of the Host header
            ours |= {"127.0.0.1", "localhost", "[::1]"}
        if len(hosts) != 1 or hosts[0].lower() not in ours:
            return False
        target = urlsplit(self.path)
        return not target.netloc or target.netloc.lower() in ours

    def _from_our_page(self) -> bool:
        """Not a request a browser sends for a page of another origin (another site, or
        another port here): no ``Origin`` but this server's, and no ``Sec-Fetch-Site`` of
        ``cross-site`` or ``same-site``. The browser would keep such a page from reading
        the answer, but not the server from doing the work, nor the page from timing it.
        Clients that are not browsers send neither header."""
        origins = self.headers.get_all("Origin") or []
        own = "http://" + (self.headers.get("Host") or "").lower()
        if any(origin.lower() != own for origin in origins):
            return False
        return self.headers.get("Sec-Fetch-Site", "").lower() not in ("cross-site", "same-site")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _read_only(self) -> None:
        """Any other method: 405, naming the two this read-only server answers."""
        body = msgspec.json.encode({"error": f"{self.command} is not served: read only"})
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self._close_after_a_body()
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = _read_only

    def do_GET(self) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.FORBIDDEN, {"error": "only loopback hosts are served"})
            return
        url = urlsplit(self.path)
        path = url.path
        try:
            if path.startswith("/api/"):
                if not self._from_our_page():
                    self._json(HTTPStatus.FORBIDDEN, {"error": "only this server's page is served"})
                    return
                query = parse_qs(url.query)
                self._json(HTTPStatus.OK, route(self.server.inspector, path, query))
                return
            name = "index.html" if path in ("/", "/index.html") else None
            if path.startswith("/static/"):
                name = path[len("/static/") :]
            if name is None or name not in self.server.static_files:
                raise NotFound(f"no page {path!r}")
            file = STATIC / name
            self._send(HTTPStatus.OK, file.read_bytes(), _TYPES[file.suffix], cache=False)
        except NotFound as exc:
            self._json(HTTPStatus.NOT_FOUND, {"error": str(exc)})
        except BadRequest as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except (StoreError, CorruptEvent) as exc:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a database no check foresaw: an answer, not a dropped line
            self.log_error("inspector: %r", exc)
            with contextlib.suppress(OSError):
                self._json(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"error": f"cannot answer {path!r}: {type(exc).__name__}: {exc}"[:500]},
                )


class InspectorServer(ThreadingHTTPServer):
    """The inspector bound to a loopback port; ``url`` is where the page is."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(
        self,
        store: EventStore,
        port: int = 0,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.inspector = Inspector(store)
        self.store = store
        self.log = log
        self.static_files = frozenset(
            p.name for p in STATIC.iterdir() if p.is_file() and p.suffix in _TYPES
        )
        super().__init__((LOOPBACK, port), _Handler)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.server_address[1]}/"

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests, benchmarks); ``stop`` ends it."""
        thread = threading.Thread(target=self.serve_forever, name="inspector", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.store.close()


def make_server(
    db: str | Path, port: int = 0, *, log: Callable[[str], None] | None = None
) -> InspectorServer:
    """Open ``db`` (a SQLite file, or a ``postgresql://`` URL) read-only and bind the
    inspector to ``127.0.0.1:port`` (0: any free)."""
    store: EventStore
    missing = missing_database(db)
    if missing is not None:
        raise StoreError(missing)
    if is_postgres_url(db):
        store = open_store(db, read_only=True)
    else:
        store = SqliteEventStore(db, read_only=True)
    try:
        return InspectorServer(store, port, log=log)
    except BaseException:
        store.close()
        raise
