"""Sessions spread over worker processes on this machine, each shard with a SQLite log of
its own: more than one core's worth of turns with no server and no Ray.

    shards = ProcessShards("agent-shards", make_services, shards=2)
    outcome = shards.run("qq:group:1", Input(id="", content="你好"))
    handle = shards.submit("qq:group:2", Input(id="", content="你好"))  # once accepted
    outcome = handle.result(timeout=60)
    shards.shutdown()

One process runs one thread's Python at a time (the GIL), so a runtime's turns use about
one core however many threads drive them. ``ProcessShards`` starts ``shards`` worker
processes, each an embedded :class:`~aalis_agent.actors.runtime.Runtime` over its own
database in ``directory`` (``shard-<n>.db``), and sends each session's inputs to the shard
``shard_of(session_id, shards)`` names (a stable hash). The directory records the shard
count (``shards.json``) and is refused with another one: the hash would look for the
sessions in the wrong files. Each shard file is an ordinary event database (``replay``
and ``inspect`` read it, while the workers run too), held by its worker for writing
(``StoreInUse`` for any other process that would write it, ``chat --db`` or a second
``ProcessShards`` on the directory).

- ``services`` is a picklable callable (a module-level function) building the shard's
  :class:`~aalis_agent.services.Services`; it runs in each worker, which starts with the
  ``spawn`` method: a script using ``ProcessShards`` keeps its start under
  ``if __name__ == "__main__":``. Logging set up in the parent does not reach the
  workers: set it up in ``services`` too.
- Acknowledgement is the shard's: ``submit`` returns once the worker's ``Runtime.submit``
  returned (the input durably accepted), ``run`` once its ``Runtime.run`` did.
- Calls go over a Unix socket per shard (in a private temporary directory, with a random
  key), one connection per call in flight, kept for the next call. A new connection's
  handshake is bounded (10 s) and made outside the shard's lock, on a thread of its own
  in the worker: a peer that does not answer holds up no other connection, and a worker
  that does not answer (stopped) fails the call with :class:`RunError`. In the worker, one
  thread reads every connection and runs each call itself while the last calls were
  quick (an in-process model, tools that compute): no hand-over between threads. A call
  that is not known quick runs on a thread of its own, and a quick-looking one that runs
  longer than ``inline_s`` (0.02 s) hands the reading to a new thread, so a slow model or
  tool holds up the shard's other sessions for little more than that (the reading
  thread is watched every ``inline_s / 2``, 10 ms at most).
- A worker that dies (killed, crashed) is started again by the next call that finds it
  gone; its runtime's ``recover()`` then finishes the cut turn and runs what was queued,
  as after any crash. A call under way when it died is sent again under the input's id
  (an input without one gets one first): the session answers an input it accepted from
  its log and never runs it twice; one it never received runs once. A shard that dies
  more than ``max_restarts`` times within a minute is not started again:
  :class:`ShardUnavailable` names it and why. A worker that does not start within
  ``start_timeout_s`` is killed and counts as one more death: the call gets
  :class:`ShardUnavailable` saying what the worker was still doing, and a later call
  starts it again.
- A worker whose parent dies (killed too) finds its control pipe closed, shuts its
  runtime down and exits.
- A session's other calls (``command``, ``stop``, ``delete``, ``clear``,
  ``set_setting``...) go to its shard as well; not being inputs, they are not sent again
  when the worker dies during them: :class:`RunError` says they may or may not have taken
  effect. Their arguments cross as msgpack: one it cannot hold is refused with
  :class:`InvalidInput`; text arguments (who, where, a command line) are cleaned of lone
  surrogates first, as a runtime in this process cleans them (a setting's value is
  judged by the setting: ``ConfigError``).
- The workers' bus events reach the parent's subscribers (:meth:`ProcessShards.subscribe`,
  as ``Runtime.subscribe``): each shard's on a connection of its own, read by a thread
  of the shard's in the parent, in the order the worker published them; a worker sends
  only the topics someone subscribed to, from a bounded queue (a slow subscriber holds
  up no turn; past ``event_backlog`` events the next are dropped, and counted in
  ``info()``), and a worker started again is subscribed before the call that started it
  goes on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import json
import multiprocessing
import os
import pickle
import selectors
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
    wait,
)
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.events.codec import checked_input, checked_session_id, clean_text
from aalis_agent.events.errors import InvalidInput, RunError, RuntimeClosed, UsageError
from aalis_agent.events.schema import Input
from aalis_agent.scale import ForwardedBus, with_input_id
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.reshard import (
    MAX_SHARDS,
    hold_directory,
    refuse_if_resharding,
    release_directory,
    write_json_atomically,
)
from aalis_agent.services.bus import EventBus

__all__ = ["ProcessHandle", "ProcessShards", "ShardUnavailable"]

log = structlog.get_logger("aalis.shards")

MANIFEST = "shards.json"
_QUICK_CALLS = 3  # quick calls in a row before the reading thread runs calls itself
_RESTART_WINDOW_S = 60.0
_ATTACH_S = 5.0  # how long a worker may take to acknowledge a change of bus topics
_REATTACH_S = 1.0  # how often a live worker that did not acknowledge them is asked again
_HANDSHAKE_S = 10.0  # how long a new connection's peer may take to answer its handshake


class ShardUnavailable(RunError):
    """The worker process of ``session_id``'s shard died and is not started again: it
    died more than ``max_restarts`` times within a minute, or would not start; or it did
    not start within ``start_timeout_s`` this time (counted as a death: a later call
    starts it again, unless that made one too many). ``reason`` says how.
    ``maybe_accepted``: the input may have been accepted before (send it again under its
    id once the shards run again: it is answered from the log if it was, and runs once if
    not)."""

    def __init__(
        self, session_id: str, shard: int, reason: str, input_id: str, *, maybe_accepted: bool
    ) -> None:
        if maybe_accepted:
            what = (
                f"input {input_id!r} may have been accepted before; send it again under the "
                "same id once the shards run again (it is answered from the log if it was "
                "accepted, and runs once if not)"
            )
        else:
            what = f"input {input_id!r} was not sent to it"
        super().__init__(f"session {session_id!r}: its shard {shard} is down ({reason}); {what}")
        self.session_id = session_id
        self.shard = shard
        self.reason = reason
        self.input_id = input_id
        self.maybe_accepted = maybe_accepted


def _portable(exc: BaseException) -> Any:
    """``exc`` as it crosses to the parent (see :func:`_raised`): its class, args and
    attributes (an error whose ``__init__`` takes other arguments than its message does
    not pickle by itself), or a :class:`RunError` with its type and message when those do
    not pickle."""
    carried = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))
    try:
        pickle.loads(pickle.dumps(carried))
    except Exception:
        return (RunError, (f"{type(exc).__name__}: {exc}",), {})
    return carried


def _raised(carried: Any) -> BaseException:
    """The error :func:`_portable` carried, rebuilt without calling its ``__init__``."""
    cls, args, attrs = carried
    exc: BaseException = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


def _manifest(directory: Path, shards: int) -> None:
    """Record the shard count in ``directory``, or refuse a count other than the one it
    records (and a directory of shard files that records none)."""
    path = directory / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        found = sorted(p.name for p in directory.glob("shard-*.db"))
        if found:
            raise UsageError(
                f"{str(directory)!r} holds shard databases ({', '.join(found[:3])}) but no "
                f"{MANIFEST}: it was not made by ProcessShards, or its {MANIFEST} was removed"
            ) from None
        write_json_atomically(path, {"format": 1, "shards": shards})  # flushed to the disk
        return
    try:
        recorded = json.loads(text)["shards"]
    except (ValueError, KeyError, TypeError):
        recorded = None
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 1:
        raise UsageError(f"{str(path)!r} is not a shard manifest: {text[:80]!r}")
    if recorded != shards:
        raise UsageError(
            f"{str(directory)!r} holds {recorded} shards ({MANIFEST}); open it with "
            f"shards={recorded}: sessions are placed by a hash of the count, so another "
            "count would look for them in the wrong files"
        )


# --- the worker process ---------------------------------------------------------------


# The wire: msgpack arrays. A call is [kind, session id, input or nil, seconds or nil]
# (kinds below); an answer is ["o", input id, turn id, outcome, reason, reply] (how the
# input ended), ["a", input id, where] (a submit accepted; its "o" follows), ["i", idle],
# ["n", pid], ["v", a session method's value] or ["e", the error pickled] (see
# _portable). A session method's call carries [name, args, kwargs] in the input's place.
_RUN, _SUBMIT, _WAIT_IDLE, _INFO, _METHOD = "run", "submit", "wait_idle", "info", "method"
# A connection whose first call is a subscription ([_SUBSCRIBE, "", [seq, topics], nil])
# is the shard's event stream from then on: the worker sends [topic, payload] for each
# bus event and seq (an int) to acknowledge a subscription and each later [seq, topics]
# the parent sends when the topics its subscribers want change.
_SUBSCRIBE = "subscribe"
_EVENT_BACKLOG = 10_000  # events a stream holds for a parent slower than the shard
_DROPPED = None  # an event stream's [None, n]: n events dropped before the next one
_SESSION_METHODS = frozenset(
    ("command", "stop", "stop_command", "stop_all", "mute", "delete", "clear", "set_setting")
)
_encode = msgspec.msgpack.Encoder().encode
_call_decoder = msgspec.msgpack.Decoder(tuple[str, str, msgspec.Raw, float | None])
_input_decoder = msgspec.msgpack.Decoder(Input)
_answer_decoder = msgspec.msgpack.Decoder()
_topics_decoder = msgspec.msgpack.Decoder(tuple[int, list[str]])
_SUBSCRIBE_CALL = _encode((_SUBSCRIBE,))[1:]  # how a subscription's call begins (its kind)


def _bound(fd: int, seconds: float) -> None:
    """Bound the blocking reads and writes (and a Unix socket's connect) of socket ``fd``
    to ``seconds`` (0: unbounded again); past it they raise ``BlockingIOError``."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    finally:
        sock.close()


def _error(exc: BaseException) -> bytes:
    return _encode(("e", pickle.dumps(_portable(exc))))


def _outcome_answer(outcome: InputOutcome) -> bytes:
    o = outcome
    return _encode(("o", o.input_id, o.turn_id, o.outcome, o.reason, o.reply))


class _Server:
    """A worker's calls: one reading thread (see the module docstring)."""

    def __init__(
        self,
        runtime: Any,
        listener: Listener,
        authkey: bytes,
        control: Connection,
        inline_s: float,
        quick_s: float,
        event_backlog: int = _EVENT_BACKLOG,
    ) -> None:
        self.runtime = runtime
        self.listener = listener
        self.authkey = authkey
        self.control = control
        self.inline_s = inline_s
        self.quick_s = quick_s
        self.event_backlog = event_backlog
        self._selector = selectors.DefaultSelector()
        self._accepted: deque[Connection] = deque()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self.control, selectors.EVENT_READ)
        self._mu = threading.Lock()
        self._reader = 0  # which reading thread may read (a newer one takes over)
        self._busy_since: float | None = None
        self._quick = 0
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="shard-call")
        self.closing = threading.Event()
        self.closed = threading.Event()
        self.shutdown_timeout: float | None = 30.0

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="shard-accept", daemon=True).start()
        threading.Thread(target=self._watch, name="shard-watch", daemon=True).start()
        self._read(0)
        self.closed.wait()

    def _accept(self) -> None:
        """Accept connections; each one's handshake runs on a thread of the pool, bounded
        by ``_HANDSHAKE_S``: a peer that does not answer holds up no other connection."""
        while not self.closing.is_set():
            try:
                conn = self.listener.accept()  # no key given to it: no handshake here
            except OSError as exc:
                if self.closing.is_set():
                    return
                log.warning("the shard could not accept a connection", error=repr(exc))
                # Out of file descriptors, say: not a hot loop while it lasts.
                self.closing.wait(0.05)
                continue
            try:
                self._pool.submit(self._admit, conn)
            except RuntimeError:  # the pool is shut down: so is the shard
                conn.close()
                return

    def _admit(self, conn: Connection) -> None:
        """The handshake of a connection accepted (the same as ``Listener`` makes with a
        key), then its calls are read."""
        try:
            _bound(conn.fileno(), _HANDSHAKE_S)
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            _bound(conn.fileno(), 0)
        except (OSError, EOFError, AuthenticationError) as exc:
            log.warning("a connection to the shard failed its handshake", error=repr(exc))
            conn.close()
            return
        self._accepted.append(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"")

    def _watch(self) -> None:
        """Hand the reading to a new thread when a call run by the reading thread takes
        longer than ``inline_s`` (it was quick before: a slow call after quick ones)."""
        while not self.closing.wait(min(self.inline_s / 2, 0.01)):
            with self._mu:
                since = self._busy_since
                if since is None or time.monotonic() - since <= self.inline_s:
                    continue
                self._reader += 1
                self._busy_since = None
                self._quick = 0
                reader = self._reader
            threading.Thread(target=self._read, args=(reader,), name="shard-read").start()

    def _read(self, me: int) -> None:
        selector = self._selector
        while True:
            with self._mu:
                if me != self._reader or self.closing.is_set():
                    return
            for key, _ in selector.select():
                conn = key.fileobj
                if conn is self._wake_r:
                    with contextlib.suppress(EOFError, OSError):
                        self._wake_r.recv_bytes()
                    while self._accepted:
                        selector.register(self._accepted.popleft(), selectors.EVENT_READ)
                    continue
                if conn is self.control:
                    self._control()
                    return
                assert isinstance(conn, Connection)
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):  # the caller went away
                    selector.unregister(conn)
                    conn.close()
                    continue
                if data[1:].startswith(_SUBSCRIBE_CALL):
                    selector.unregister(conn)  # the stream's own threads read it now
                    self._subscribe(conn, data)
                    continue
                if self._quick < _QUICK_CALLS:
                    self._pool.submit(self._timed, conn, data)
                    continue
                self._busy_since = time.monotonic()
                self._timed(conn, data)
                with self._mu:
                    self._busy_since = None
                    if me != self._reader:
                        return  # a slow call: another thread reads now

    def _timed(self, conn: Connection, data: bytes) -> None:
        start = time.perf_counter()
        self._answer(conn, data)
        quick = time.perf_counter() - start < self.quick_s
        self._quick = min(self._quick + 1, _QUICK_CALLS) if quick else 0

    def _answer(self, conn: Connection, data: bytes) -> None:
        try:
            kind, session_id, raw, seconds = _call_decoder.decode(data)
            if kind in (_RUN, _SUBMIT):
                try:
                    inp = _input_decoder.decode(raw)
                except msgspec.ValidationError as exc:
                    raise InvalidInput(f"input: {exc}") from None
                if kind == _RUN:
                    answer = _outcome_answer(self.runtime.run(session_id, inp))
                else:
                    handle = self.runtime.submit(session_id, inp)
                    self._send(conn, _encode(("a", handle.input_id, handle.where)))
                    handle.future.add_done_callback(lambda f: self._send(conn, self._done(f)))
                    return
            elif kind == _METHOD:
                name, args, kwargs = msgspec.msgpack.decode(raw)
                answer = _encode(("v", self._method(session_id, name, args, kwargs)))
            elif kind == _WAIT_IDLE:
                answer = _encode(("i", self.runtime.wait_idle(seconds)))
            elif kind == _INFO:
                answer = _encode(("n", os.getpid()))
            else:
                raise UsageError(f"unknown shard call {kind!r}")
        except Exception as exc:
            answer = _error(exc)
        self._send(conn, answer)

    def _method(self, session_id: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """One of the runtime's session methods (:data:`_SESSION_METHODS`)."""
        if name not in _SESSION_METHODS:
            raise UsageError(f"unknown session method {name!r}")
        if name == "command":
            from aalis_agent.actors.commands import handle_command

            return handle_command(self.runtime, session_id, *args, **kwargs)
        # Tuples arrive as lists, which the runtime takes as it takes tuples (clear's
        # kinds): a bare string stays one, and is refused as it is in one process.
        return getattr(self.runtime, name)(session_id, *args, **kwargs)

    def _subscribe(self, conn: Connection, data: bytes) -> None:
        try:
            raw = _call_decoder.decode(data)[2]
            seq, topics = _topics_decoder.decode(raw)
            _EventStream(self.runtime.services.bus, conn, seq, topics, self.event_backlog)
        except Exception as exc:
            log.warning("a bus subscription from the parent failed", error=repr(exc))
            conn.close()

    @staticmethod
    def _done(future: Any) -> bytes:
        try:
            return _outcome_answer(future.result())
        except Exception as exc:
            return _error(exc)

    @staticmethod
    def _send(conn: Connection, answer: bytes) -> None:
        # A caller gone away sends the input again under its id.
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(answer)

    def _control(self) -> None:
        """The parent asks the worker to shut down, or died (the pipe closed)."""
        try:
            msg = self.control.recv()
            if msg[0] == "shutdown":
                self.shutdown_timeout = msg[1]
        except (EOFError, OSError):
            self.shutdown_timeout = 10.0  # the parent is gone: end soon
        self.closing.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        self.closed.set()


class _EventStream:
    """The worker's bus events on their way to the parent (``ProcessShards.subscribe``),
    on a connection of their own: subscribed to the topics the parent wants and no more
    (the runtime builds an event only when someone wants it), in a queue a thread sends
    from, so that the shard's turns never wait for the parent. A queue of ``backlog``
    events not yet sent (``ProcessShards(event_backlog=)``: a parent subscriber slower
    than the shard) drops the next ones, with a warning in the worker's log; how many is
    logged, and sent to the parent (``[None, n]``), before the next event sent. An event
    whose payload msgpack cannot carry is not sent (a warning), and counted there too."""

    def __init__(
        self,
        bus: Any,
        conn: Connection,
        seq: int,
        topics: list[str],
        backlog: int = _EVENT_BACKLOG,
    ) -> None:
        self.bus = bus
        self.conn = conn
        self.backlog = backlog
        self.cv = threading.Condition()
        self.queue: deque[bytes] = deque()
        self.dropped = 0
        self.unsendable = 0  # events whose payload msgpack cannot carry (not sent)
        self.closed = False
        self.active: frozenset[str] = frozenset()
        self.subscribed: dict[str, Callable[[], None]] = {}
        self.set_topics(topics)
        conn.send_bytes(_encode(seq))  # acknowledged: the parent's calls may follow
        threading.Thread(target=self._send, name="shard-events", daemon=True).start()
        threading.Thread(target=self._listen, name="shard-event-topics", daemon=True).start()

    def set_topics(self, topics: list[str]) -> None:
        """Subscribe to ``topics`` (``*`` alone when it is among them), then end the
        subscriptions no longer wanted: an event comes once, through the subscription
        ``active`` names (both may hold it while they change)."""
        want = frozenset(("*",)) if "*" in topics else frozenset(topics)
        with self.cv:
            if self.closed:
                return
            for topic in want - self.subscribed.keys():
                self.subscribed[topic] = self.bus.subscribe(
                    topic, functools.partial(self._on_event, topic)
                )
            self.active = want
            for topic in self.subscribed.keys() - want:
                self.subscribed.pop(topic)()

    def _on_event(self, subscribed: str, topic: str, payload: Any) -> None:
        """On the publishing thread (a session's, a turn's): encode and queue."""
        active = self.active
        if subscribed not in active:
            return  # a subscription on its way out (or in)
        try:
            data = _encode((topic, payload))
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError, RecursionError) as exc:
            log.warning("a bus event cannot be sent to the parent", topic=topic, error=str(exc))
            with self.cv:
                self.unsendable += 1  # counted with the dropped ones
            return
        with self.cv:
            if self.closed:
                return
            if len(self.queue) >= self.backlog:
                if not self.dropped:
                    log.warning(
                        "the parent's bus subscribers are slower than the shard: dropping "
                        "events until they catch up",
                        backlog=self.backlog,
                    )
                self.dropped += 1
                return
            self.queue.append(data)
            self.cv.notify()

    def _send(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                data = self.queue.popleft()
                dropped, self.dropped = self.dropped, 0
                unsendable, self.unsendable = self.unsendable, 0
            try:
                if dropped:
                    log.warning("bus events dropped for the parent", dropped=dropped)
                if dropped or unsendable:
                    self.conn.send_bytes(_encode((_DROPPED, dropped + unsendable)))
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the parent went away (or stopped following)
                self.close()
                return

    def _listen(self) -> None:
        """The parent's changes of topics; the connection closing ends the stream."""
        while True:
            try:
                seq, topics = _topics_decoder.decode(self.conn.recv_bytes())
            except (EOFError, OSError, msgspec.DecodeError):
                self.close()
                return
            self.set_topics(topics)
            with self.cv:
                self.queue.appendleft(_encode(seq))  # before the events still queued
                self.cv.notify()

    def close(self) -> None:
        with self.cv:
            if self.closed:
                return
            self.closed = True
            self.queue.clear()
            for unsubscribe in self.subscribed.values():
                unsubscribe()
            self.subscribed.clear()
            self.cv.notify_all()
        with contextlib.suppress(OSError):
            self.conn.close()


def _shard_main(
    index: int,
    database: str,
    services: Callable[[], Any],
    options: dict[str, Any],
    address: str,
    authkey: bytes,
    control: Connection,
    inline_s: float,
    quick_s: float,
    event_backlog: int,
) -> None:
    """A worker process: its shard's runtime, answering calls until told to stop."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.events import SqliteEventStore

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    try:
        # What it is doing, for the parent to say if the start takes too long.
        control.send(("starting", "opening its database"))
        store = SqliteEventStore(database)
        try:
            control.send(("starting", "building its services (services())"))
            built = services()
            control.send(("starting", "recovering its sessions (Runtime.recover())"))
            runtime = Runtime(store, built, **options)
            recovered = runtime.recover()
            control.send(("starting", "opening its socket"))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)  # a dead predecessor's socket
            # The handshake with the key is the server's (_Server._admit), off the
            # accepting thread.
            listener = Listener(address, family="AF_UNIX", backlog=64)
        except BaseException:
            store.close()
            raise
    except Exception as exc:
        control.send(("failed", _portable(exc)))
        return
    control.send(("ready", os.getpid(), recovered))
    server = _Server(runtime, listener, authkey, control, inline_s, quick_s, event_backlog)
    code = 0
    try:
        server.serve()
    finally:
        try:
            runtime.shutdown(timeout=server.shutdown_timeout)
            store.close()
        except Exception:
            log.exception("shard shutdown failed", shard=index)
            code = 1
        with contextlib.suppress(OSError):
            control.send(("closed",))
        # The sockets' directory goes with the last worker out (its listener gone, its
        # socket with it): the parent removes it at shutdown, but a parent killed can't.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(address))
        # Threads a stuck tool keeps would hold the process open: the log is closed.
        os._exit(code)


# --- the parent -----------------------------------------------------------------------


class _Shard:
    """One worker process, started (again) on demand, and its idle connections."""

    def __init__(self, owner: ProcessShards, index: int) -> None:
        self.owner = owner
        self.index = index
        self.database = str(owner.directory / f"shard-{index}.db")
        self.address = os.path.join(owner._sockets, f"{index}.sock")
        self.lock = threading.Lock()
        # The live worker and its generation (how many started so far), set together: a
        # thread reading them as another restarts the worker never pairs a new process
        # with an old generation.
        self._current: tuple[int, Any] = (0, None)
        self.control: Connection | None = None
        self.idle: list[tuple[int, Connection]] = []
        self.deaths: deque[float] = deque()
        self.down: str | None = None  # why it is not started again
        self.recovered: list[str] = []
        self.restarts = 0
        self.events_dropped = 0  # bus events its workers dropped, as they said
        self.feed: _EventFeed | None = None  # set (under ``lock``) once someone subscribes

    def start(self) -> None:
        """Start the worker and wait until it serves (under ``lock``)."""
        owner = self.owner
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        process = ctx.Process(
            target=_shard_main,
            args=(
                self.index,
                self.database,
                owner.services,
                owner.runtime_options,
                self.address,
                owner._authkey,
                theirs,
                owner.inline_s,
                owner.quick_s,
                owner.event_backlog,
            ),
            name=f"aalis-shard-{self.index}",
            daemon=True,
        )
        try:
            process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            mine.close()
            raise UsageError(
                "ProcessShards: services must be a picklable callable (a function defined "
                f"at a module's top level), and runtime_options picklable: {exc}"
            ) from exc
        finally:
            theirs.close()
        deadline = time.monotonic() + owner.start_timeout_s
        doing = "starting its process (importing what its services need)"
        while True:
            ready = mine.poll(max(0.0, deadline - time.monotonic()))
            try:
                msg = mine.recv() if ready else None
            except (EOFError, OSError):
                msg = None
            if msg is None or msg[0] != "starting":
                break
            doing = msg[1]
        if msg is None or msg[0] != "ready":
            process.kill()
            process.join(5)
            mine.close()
            if msg is not None and msg[0] == "failed":
                raise _StartFailed(_raised(msg[1]), process)
            why = (
                f"it exited with status {process.exitcode} (its error is on stderr; a "
                "script starting ProcessShards does so under if __name__ == '__main__':, "
                "as each worker imports it)"
                if ready
                else f"it did not start within {owner.start_timeout_s:g} s (start_timeout_s): "
                f"it was still {doing}, and was killed"
            )
            error = f"shard {self.index} ({self.database}) did not start: {why}"
            if not ready:
                raise _StartTimedOut(error, process)
            if process.exitcode is not None and process.exitcode < 0:
                raise _KilledStarting(error, process)  # by a signal (SIGKILL, OOM)
            raise RunError(error)
        self.control = mine
        self.recovered = list(msg[2])
        self._current = (self._current[0] + 1, process)
        self.idle.clear()
        if self.feed is not None:
            self.feed.attach(self.generation)  # before the call that started it goes on

    @property
    def generation(self) -> int:
        return self._current[0]

    @property
    def process(self) -> Any:
        return self._current[1]

    def connection(self) -> tuple[int, Connection]:
        """An idle connection to the live worker, or a new one (starting the worker again
        when it died)."""
        while True:
            try:
                generation, conn = self.idle.pop()
            except IndexError:
                break
            if generation == self.generation:
                return generation, conn
            conn.close()
        # The lock is held to start the worker, not to connect: a connection whose
        # handshake is slow (a worker stopped, or too busy) holds up no other.
        with self.lock:
            if self.owner._closed:
                raise RuntimeClosed("the shards are shut down")
            if not self.alive():
                self.restart()
            generation, process = self._current
        try:
            return generation, self._connect()
        except TimeoutError as exc:  # a worker that lives and does not answer
            raise RunError(f"shard {self.index}: cannot connect: {exc}") from exc
        except (OSError, EOFError) as exc:
            failed = exc
        with self.lock:
            if self.owner._closed:
                raise RuntimeClosed("the shards are shut down")
            if self.generation == generation:  # (another call may have started it since)
                # Refused or cut: a worker dying (killed, its socket closed) is not
                # always reaped yet; once it has ended, start it again.
                if not _ended(process, 5):
                    raise RunError(f"shard {self.index}: cannot connect: {failed}") from failed
                self.restart()
            generation = self.generation
        try:
            return generation, self._connect()
        except TimeoutError as exc:
            raise RunError(f"shard {self.index}: cannot connect: {exc}") from exc

    def _connect(self) -> Connection:
        """A new connection to the worker, after the handshake with the key; a worker
        that does not answer within ``_HANDSHAKE_S`` (stopped, or too busy to accept)
        raises :class:`TimeoutError` rather than hold the caller."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn: Connection | None = None
        try:
            _bound(sock.fileno(), _HANDSHAKE_S)
            sock.connect(self.address)
            conn = Connection(os.dup(sock.fileno()))
            answer_challenge(conn, self.owner._authkey)
            deliver_challenge(conn, self.owner._authkey)
            _bound(sock.fileno(), 0)
            return conn
        except BlockingIOError:
            if conn is not None:
                conn.close()
            raise TimeoutError(
                f"its worker did not answer a new connection within {_HANDSHAKE_S:g} s "
                "(stopped, or too busy to accept it)"
            ) from None
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        finally:
            sock.close()

    def alive(self) -> bool:
        return self.process is not None and not _ended(self.process)

    def restart(self) -> None:
        """Start the worker again after it died (under ``lock``), unless it died too
        often: then :class:`RunError` (turned into :class:`ShardUnavailable`). A worker
        killed while it starts is one more death, and started again the same way; one
        that does not start within ``start_timeout_s`` is one more death too, but fails
        this call (the next call tries again). Any other failure to start gives the
        shard up, except one raised by its ``services()`` or ``Runtime`` (not a
        ``UsageError``): that is one more death too (a configuration service away for a
        moment), the call failing and the next one trying again."""
        if self.down is not None:
            raise _Down(self.down)
        process = self.process
        if process is not None:
            if self.control is not None:
                self.control.close()
            self._died(process)
        while True:
            try:
                self.start()
                return
            except _KilledStarting as exc:
                self._died(exc.process)
            except _StartTimedOut as exc:
                self._current = (self.generation, None)  # its death is counted here
                self._died(exc.process, str(exc))
                raise _Down(f"{exc}; a later call starts it again") from None
            except _StartFailed as failed:  # its services() or Runtime raised
                error = failed.error
                if isinstance(error, UsageError):  # a mistake the next start makes again
                    self.down = f"its worker would not start again: {error}"
                    raise _Down(self.down) from error
                said = f"{type(error).__name__}: {error}"
                self._current = (self.generation, None)  # its death is counted here
                self._died(failed.process, f"its start failed: {said}")
                raise _Down(
                    f"its worker would not start again: {said}; a later call starts it again"
                ) from error
            except Exception as exc:
                self.down = f"its worker would not start again: {exc}"
                raise _Down(self.down) from exc

    def _died(self, process: Any, why: str | None = None) -> None:
        """Count ``process``'s death (under ``lock``): :class:`_Down` when it is one too
        many within a minute. ``why``: how it died, when not by its exit status."""
        _ended(process, 1)
        code = process.exitcode
        if why is None:
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"status {code}"
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > _RESTART_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > self.owner.max_restarts:
            self.down = f"its worker died {len(self.deaths)} times within a minute, last {why}"
            log.error("shard worker died too often; not started again", shard=self.index)
            raise _Down(self.down)
        log.warning("shard worker died; starting it again", shard=self.index, how=why)
        self.restarts += 1

    def give_back(self, generation: int, conn: Connection) -> None:
        if generation == self.generation and not self.owner._closed:
            self.idle.append((generation, conn))
        else:
            conn.close()

    def call(
        self, call: bytes, session_id: str, input_id: str, once: str | None = None
    ) -> list[Any]:
        """Send ``call`` and return the first answer, sending it again to a restarted
        worker when the worker died before answering (with the connection, for an
        accepted submit: its outcome follows on it). ``once``: what the call does, for a
        call that is not sent again once sent (a stop, a deletion: not an input, which a
        session knows by its id): its worker dying raises :class:`RunError` instead."""
        sent = False
        while True:
            try:
                generation, conn = self.connection()
            except RuntimeClosed:
                if not (sent and input_id):
                    raise
                raise RuntimeClosed(
                    f"the shards were shut down during the call: input {input_id!r} of "
                    f"session {session_id!r} may have been accepted; send it again under "
                    "the same id once they run again (it is answered from the log if it "
                    "was, and runs once if not)"
                ) from None
            except _Down as exc:
                if not input_id:  # a session's other call, or one about the shard
                    who = f"session {session_id!r}: its shard" if session_id else "shard"
                    raise RunError(f"{who} {self.index} is down ({exc})") from None
                raise ShardUnavailable(
                    session_id, self.index, str(exc), input_id, maybe_accepted=sent
                ) from None
            try:
                conn.send_bytes(call)
                sent = True
                answer = _answer_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                conn.close()
                self._lost(generation)
                if once is not None and sent:
                    raise RunError(
                        f"session {session_id!r}: its shard {self.index}'s worker died during "
                        f"{once}; it may or may not have taken effect (a deletion or clear "
                        "begun is finished when the worker starts again)"
                    ) from None
                continue
            except BaseException:
                # Cut (Ctrl-C) with half the call sent or its answer unread: closed, the
                # worker does not wait for the rest, and no later call reads that answer.
                conn.close()
                raise
            if answer[0] == "a":
                return [*answer, generation, conn]
            self.give_back(generation, conn)
            return answer  # type: ignore[no-any-return]

    def _lost(self, generation: int) -> None:
        """A connection of ``generation`` broke: when its worker is gone, the next call
        starts it again; a live worker dropping a connection is an error."""
        current, process = self._current
        if process is not None and generation == current and not _ended(process, 5):
            raise RunError(f"shard {self.index}: its worker dropped a call's connection")

    def stop(self, timeout: float | None) -> None:
        with self.lock:
            process, control = self.process, self.control
            for _, conn in self.idle:
                conn.close()
            self.idle.clear()
            if process is None or control is None:
                return
            try:
                control.send(("shutdown", timeout))
                control.poll(None if timeout is None else timeout + 5)
            except (OSError, EOFError):
                pass
            process.join(None if timeout is None else timeout + 5)
            if process.is_alive():
                process.kill()
                process.join(5)
            control.close()


class _EventFeed:
    """A shard's bus events, read on a thread of their own and published on the
    parent's bus in the order the worker sent them (see :meth:`ProcessShards.subscribe`).
    Each worker the shard starts is subscribed as it starts (:meth:`attach`)."""

    def __init__(self, shard: _Shard) -> None:
        self.shard = shard
        self.cv = threading.Condition()
        self.conn: Connection | None = None
        self.generation = 0  # the worker ``conn`` follows
        self.sent = 0  # subscriptions and changes of topics sent ...
        self.acked = 0  # ... and acknowledged
        self.closed = False
        self.finished = False  # shut down: no more events delivered
        self.thread = threading.Thread(
            target=self._run, name=f"aalis-shard-{shard.index}-events", daemon=True
        )
        self.thread.start()

    def _topics(self) -> list[str]:
        return sorted(self.shard.owner.bus._wanted)

    def attach(self, generation: int) -> None:
        """Subscribe the worker of ``generation`` (the live one, under the shard's
        lock) to the topics wanted; return once it acknowledged: events its calls from
        now on publish are forwarded. One that did not (stopped, or not answering
        within ``_HANDSHAKE_S`` and ``_ATTACH_S``) is asked again by this feed's thread
        every ``_REATTACH_S`` while it lives."""
        with self.cv:
            if self.closed or self.generation >= generation:
                return
        try:
            conn = self.shard._connect()
        except (OSError, EOFError) as exc:  # a worker dying already: the next one is
            log.warning("cannot follow the shard's events", shard=self.shard.index, error=repr(exc))
            return
        with self.cv:
            self.sent += 1
            seq = self.sent
            try:
                conn.send_bytes(_encode((_SUBSCRIBE, "", (seq, self._topics()), None)))
                ready = conn.poll(_ATTACH_S)
                answer = _answer_decoder.decode(conn.recv_bytes()) if ready else None
            except (OSError, EOFError, msgspec.DecodeError):
                answer = None
            if answer != seq:
                conn.close()
                log.warning("the shard did not follow its events", shard=self.shard.index)
                return
            if self.closed:  # shut down meanwhile
                conn.close()
                return
            self.acked = max(self.acked, seq)
            self.conn, self.generation = conn, generation
            self.cv.notify_all()

    def update(self) -> tuple[Connection, int] | None:
        """Send the topics wanted now; the connection and the number the worker
        acknowledges them with (see :meth:`wait_acked`), None when no worker follows."""
        with self.cv:
            conn = self.conn
            if conn is None:
                return None  # the next worker is subscribed as it starts
            self.sent += 1
            seq = self.sent
            try:
                conn.send_bytes(_encode((seq, self._topics())))
            except (OSError, ValueError):
                return None
            return conn, seq

    def wait_acked(self, conn: Connection, seq: int, deadline: float) -> None:
        """Wait until the worker acknowledged ``seq`` (until ``deadline`` at most): its
        events of the topics sent are forwarded from then on. This feed's thread reads
        the acknowledgement: not to be called from a feed's thread."""
        with self.cv:
            while self.acked < seq and self.conn is conn and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(left)

    def _run(self) -> None:
        _feed_thread.on = True  # its subscribers' callbacks wait for no worker
        finished: Connection | None = None
        bus = self.shard.owner.bus
        while True:
            with self.cv:
                while not self.closed and (self.conn is None or self.conn is finished):
                    if not self.cv.wait(_REATTACH_S) and self.generation < self.shard.generation:
                        break  # a live worker not followed: it did not answer its attach
                if self.closed:
                    return
                conn = self.conn
            if conn is None or conn is finished:
                with self.shard.lock:  # as a start attaches its worker
                    if self.shard.alive():
                        self.attach(self.shard.generation)
                continue
            try:
                while True:
                    event = _answer_decoder.decode(conn.recv_bytes())
                    if isinstance(event, int):
                        with self.cv:
                            self.acked = max(self.acked, event)
                            self.cv.notify_all()
                        continue
                    if event[0] is _DROPPED:
                        self.shard.events_dropped += event[1]
                        continue
                    if self.finished:
                        return  # shut down: no event after it
                    bus.publish(event[0], event[1])  # a subscriber that raises is logged
            except (EOFError, OSError):
                pass  # the worker ended: the next one is attached as it starts
            except Exception:
                log.exception("a shard's event stream broke", shard=self.shard.index)
            with self.cv:
                if self.conn is conn:
                    self.conn = None
                self.cv.notify_all()
            conn.close()
            finished = conn

    def close(self) -> None:
        """No worker followed from now on: the events read until the last one's
        connection closes are delivered (see :meth:`finish`)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def finish(self, deadline: float | None) -> None:
        """Once its workers ended: wait until the events they sent were delivered
        (until ``deadline`` at most), then deliver none."""
        if threading.current_thread() is not self.thread:
            self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.finished = True


# Set on the feeds' threads: a subscription made there (from a subscriber's callback)
# does not wait for acknowledgements, which that thread, or another feed's waiting as
# well, reads.
_feed_thread = threading.local()


def _ended(process: Any, seconds: float = 0.0) -> bool:
    """Whether the worker ``process`` has ended, waiting up to ``seconds`` for it (a
    worker whose socket closed under a call is dying). Read from its sentinel, which any
    thread may wait on (``is_alive()`` reaps the process, and a thread asking while
    another reaps it could be told it lives); its sockets and sentinel close as it exits,
    a moment before it can be reaped: once the sentinel closed, join waits for that."""
    if not wait([process.sentinel], seconds):
        return False
    process.join()
    return True


class _Down(RunError):
    pass


class _StartTimedOut(RunError):
    """A worker that did not start within ``start_timeout_s`` (killed)."""

    def __init__(self, message: str, process: Any) -> None:
        super().__init__(message)
        self.process = process


def _runtime_options(given: object) -> dict[str, Any]:
    """``runtime_options`` checked against ``Runtime``'s keyword arguments, in the parent:
    a misspelt one is named here, not as a ``TypeError`` from a worker's start."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise UsageError(
            f"ProcessShards: runtime_options must be a dict, not {type(given).__name__}"
        )
    from aalis_agent.actors.runtime import Runtime

    params = inspect.signature(Runtime.__init__).parameters
    own = ("self", "store", "services")  # each worker's: its shard file and services()
    known = sorted(p for p in params if p not in own)
    for key in given:
        if key in own[1:]:
            raise UsageError(
                f"ProcessShards: runtime_options: {key!r} is the shard's own (its file, "
                "and what services() builds): leave it out"
            )
        if key not in known:
            raise UsageError(
                f"ProcessShards: runtime_options: {key!r} is not an argument of Runtime "
                f"(it takes {', '.join(known)})"
            )
    return dict(given)


class _StartFailed(Exception):
    """The error a worker's start failed with (its ``services()`` or ``Runtime``
    raising), with the process that ended."""

    def __init__(self, error: BaseException, process: Any) -> None:
        super().__init__(str(error))
        self.error = error
        self.process = process


class _KilledStarting(RunError):
    """A worker killed by a signal before it served."""

    def __init__(self, message: str, process: Any) -> None:
        super().__init__(message)
        self.process = process


def _call(kind: str, session_id: str, inp: Input | None, seconds: float | None = None) -> bytes:
    """A call as sent (see the wire above). An input msgpack cannot hold is refused as
    the runtime refuses it (:func:`checked_input` names the field; text with lone
    surrogates is cleaned as it would be)."""
    try:
        return _encode((kind, session_id, inp, seconds))
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError, RecursionError):
        if inp is None:
            raise
        inp = checked_input(inp)
        return _encode((kind, session_id, inp, seconds))


def _outcome(answer: list[Any]) -> InputOutcome:
    """The outcome an answer carries, or the error it carries raised."""
    kind = answer[0]
    if kind == "o":
        return InputOutcome(*answer[1:6])
    if kind == "e":
        raise _raised(pickle.loads(answer[1]))
    raise RunError(f"unexpected answer from a shard: {kind!r}")


def _at_exit(ref: weakref.ref[ProcessShards]) -> None:
    shards = ref()
    if shards is not None and not shards._closed:
        shards.shutdown(timeout=10)


class ProcessHandle:
    """An input accepted by its shard: ``where`` it went, and its outcome by
    :meth:`result` (or ``await handle``)."""

    def __init__(
        self,
        shard: _Shard,
        session_id: str,
        inp: Input,
        where: str,
        generation: int,
        conn: Connection,
    ) -> None:
        self.session_id = session_id
        self.input_id = inp.id
        self.where = where
        self._shard = shard
        self._input = inp
        self._generation = generation
        self._conn: Connection | None = conn
        self._lock = threading.Lock()
        self._outcome: InputOutcome | None = None

    def result(self, timeout: float | None = None) -> InputOutcome:
        """The input's outcome; TimeoutError when it has none within ``timeout`` seconds
        (ask again later). When the worker died meanwhile, the input is sent again to the
        restarted one under its id, which answers it from the log (or follows it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise TimeoutError(f"input {self.input_id!r} has no outcome yet after {timeout} s")
        try:
            while self._outcome is None:
                if self._conn is None:
                    # The worker died: its restarted self follows the input sent again
                    # (or answers it from its log), on a connection of its own.
                    self._resend()
                    continue
                conn = self._conn
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    ready = conn.poll(left)
                except (EOFError, OSError):
                    ready = True  # recv_bytes finds the connection broken
                if not ready:  # (TimeoutError is an OSError: raised out of the try)
                    raise TimeoutError(
                        f"input {self.input_id!r} has no outcome yet after {timeout} s"
                    )
                try:
                    answer = _answer_decoder.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    conn.close()
                    self._conn = None
                    self._shard._lost(self._generation)
                    continue
                except BaseException:
                    # Cut (Ctrl-C) with the answer read in part or whole: asked again,
                    # the handle sends the input again rather than wait on this.
                    conn.close()
                    self._conn = None
                    raise
                self._conn = None
                self._shard.give_back(self._generation, conn)
                self._outcome = _outcome(answer)
            return self._outcome
        finally:
            self._lock.release()

    def _resend(self) -> None:
        """Send the input again as a submit (under ``_lock``): the new connection its
        outcome comes on, or the outcome when the answer is one."""
        call = _call(_SUBMIT, self.session_id, self._input)
        answer = self._shard.call(call, self.session_id, self.input_id)
        if answer[0] == "a":
            self._generation, self._conn = answer[3], answer[4]
        else:
            self._outcome = _outcome(answer)

    async def aresult(self, timeout: float | None = None) -> InputOutcome:
        return await asyncio.to_thread(self.result, timeout)

    def __await__(self) -> Any:
        return self.aresult().__await__()

    def done(self) -> bool:
        """Whether :meth:`result` has the outcome at hand (False while another thread
        waits in it)."""
        if not self._lock.acquire(blocking=False):
            return self._outcome is not None
        try:
            return self._outcome is not None or (self._conn is not None and self._conn.poll(0))
        finally:
            self._lock.release()


class ProcessShards:
    """``shards`` worker processes on this machine, each a runtime over its own SQLite
    log in ``directory``; see the module docstring.

    ``services`` builds each worker's services (picklable: a module-level function);
    ``runtime_options`` are keyword arguments for each worker's ``Runtime`` (say
    ``max_live_sessions``). ``max_restarts``: how often a shard's worker may die within a
    minute and be started again. ``inline_s`` and ``quick_s``: a call quicker than
    ``quick_s`` three times in a row is then run by the worker's reading thread, until one
    takes longer than ``inline_s``. ``event_backlog``: how many bus events a worker holds
    for the parent's subscribers (:meth:`subscribe`) before it drops the next ones."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        services: Callable[[], Any],
        shards: int = 2,
        *,
        runtime_options: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        max_restarts: int = 3,
        inline_s: float = 0.02,
        quick_s: float = 0.005,
        event_backlog: int = _EVENT_BACKLOG,
    ) -> None:
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
            raise UsageError(
                f"ProcessShards: shards must be an integer from 1 to {MAX_SHARDS:,}, not {shards!r}"
            )
        if not callable(services):
            raise UsageError(f"ProcessShards: services must be callable, not {services!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise UsageError(
                f"ProcessShards: max_restarts must be an integer >= 0, not {max_restarts!r}"
            )
        backlog = event_backlog
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 1:
            raise UsageError(
                f"ProcessShards: event_backlog must be an integer >= 1, not {event_backlog!r}"
            )
        for name, value in (
            ("inline_s", inline_s),
            ("quick_s", quick_s),
            ("start_timeout_s", start_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise UsageError(f"ProcessShards: {name} must be a number > 0, not {value!r}")
        options = _runtime_options(runtime_options)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise UsageError(f"{str(self.directory)!r} is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        # Held while the workers run: a reshard of the directory (or a second
        # ProcessShards) is refused meanwhile, and one cut half-way is refused here.
        self._held: str | None = hold_directory(self.directory)
        try:
            refuse_if_resharding(self.directory)
            _manifest(self.directory, shards)
        except BaseException:
            self._let_go()
            raise
        self.services = services
        self.runtime_options = options
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.inline_s = float(inline_s)
        self.quick_s = float(quick_s)
        self.event_backlog = event_backlog
        self._closed = False
        self.bus: EventBus = ForwardedBus(self)
        self._feeds_lock = threading.Lock()
        self._authkey = os.urandom(32)
        self._sockets = tempfile.mkdtemp(prefix="aalis-shards-")  # mode 0700
        self._shards = [_Shard(self, i) for i in range(shards)]
        atexit.register(_at_exit, weakref.ref(self))  # before multiprocessing ends them
        try:
            for shard in self._shards:
                with shard.lock:
                    shard.start()
        except _StartFailed as failed:  # the worker's own error, as its class
            self.shutdown(timeout=10)
            raise failed.error from None
        except BaseException:
            self.shutdown(timeout=10)
            raise

    @property
    def shards(self) -> int:
        return len(self._shards)

    def shard_of(self, session_id: str) -> int:
        """The index of the shard that runs ``session_id``."""
        return shard_of(checked_session_id(session_id), len(self._shards))

    def _route(self, session_id: str, inp: Input) -> tuple[_Shard, str, Input]:
        if self._closed:
            raise RuntimeClosed("the shards are shut down")
        session_id = checked_session_id(session_id)
        if not isinstance(inp, Input):
            raise InvalidInput(f"input must be an Input, not {type(inp).__name__}")
        inp = with_input_id(inp)
        return self._shards[shard_of(session_id, len(self._shards))], session_id, inp

    def run(self, session_id: str, inp: Input) -> InputOutcome:
        """``Runtime.run`` on the session's shard: the input's outcome once its turn
        ended (or it was released). Refusals (``InvalidInput``...) are raised here."""
        shard, session_id, inp = self._route(session_id, inp)
        return _outcome(shard.call(_call(_RUN, session_id, inp), session_id, inp.id))

    def submit(self, session_id: str, inp: Input) -> ProcessHandle:
        """``Runtime.submit`` on the session's shard: returns once the input is durably
        accepted there; the handle gives its outcome."""
        shard, session_id, inp = self._route(session_id, inp)
        answer = shard.call(_call(_SUBMIT, session_id, inp), session_id, inp.id)
        if answer[0] != "a":
            _outcome(answer)  # raises the refusal
        _, _input_id, where, generation, conn = answer
        return ProcessHandle(shard, session_id, inp, where, generation, conn)

    async def arun(self, session_id: str, inp: Input) -> InputOutcome:
        """:meth:`run` from an event loop (on a thread of its own)."""
        return await asyncio.to_thread(self.run, session_id, inp)

    async def asubmit(self, session_id: str, inp: Input) -> ProcessHandle:
        """:meth:`submit` from an event loop; ``await`` the handle for the outcome."""
        return await asyncio.to_thread(self.submit, session_id, inp)

    def _session_method(self, session_id: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeClosed("the shards are shut down")
        session_id = checked_session_id(session_id)
        # Text arguments (who, where, a command line) cleaned of lone surrogates as a
        # runtime cleans them; a setting's value is the setting's to judge.
        args = tuple(
            clean_text(a) if isinstance(a, str) and not (name == "set_setting" and i == 1) else a
            for i, a in enumerate(args)
        )
        kwargs = {k: clean_text(v) if isinstance(v, str) else v for k, v in kwargs.items()}
        try:
            call = _encode((_METHOD, session_id, (name, args, kwargs), None))
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError, RecursionError) as exc:
            raise InvalidInput(f"{name}: an argument cannot be sent to a worker: {exc}") from None
        shard = self._shards[shard_of(session_id, len(self._shards))]
        answer = shard.call(call, session_id, "", once=name)
        if answer[0] != "v":
            _outcome(answer)  # raises the error
        return answer[1]

    def command(
        self,
        session_id: str,
        text: str,
        *,
        platform: str | None,
        user_id: str | None,
        venue: str | None = None,
    ) -> str | None:
        """A slash command (``/stop``, ``/session``, ...; ``actors/commands.py``) on the
        session's shard: the reply, or None (not a command, or ``/stop`` stopped the
        turn). Like every call below, not sent again when the worker dies during it (the
        input calls are: a session knows an input by its id): that raises RunError saying
        it may or may not have taken effect."""
        return self._session_method(  # type: ignore[no-any-return]
            session_id, "command", text, platform=platform, user_id=user_id, venue=venue
        )

    def stop(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        """``Runtime.stop``: stop the running turn; its id, if one ran."""
        return self._session_method(  # type: ignore[no-any-return]
            session_id, "stop", platform=platform, user_id=user_id
        )

    def stop_command(
        self,
        session_id: str,
        platform: str | None,
        user_id: str | None,
        venue: str | None = None,
    ) -> str | None:
        """``Runtime.stop_command`` (``/stop``): None when stopped, else the reply."""
        return self._session_method(  # type: ignore[no-any-return]
            session_id, "stop_command", platform, user_id, venue
        )

    def stop_all(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        """``Runtime.stop_all``: stop the turn and release what waits (archived)."""
        return self._session_method(  # type: ignore[no-any-return]
            session_id, "stop_all", platform=platform, user_id=user_id
        )

    def mute(self, session_id: str) -> str | None:
        """``Runtime.mute``."""
        return self._session_method(session_id, "mute")  # type: ignore[no-any-return]

    def delete(self, session_id: str, timeout: float | None = None) -> int:
        """``Runtime.delete`` on the session's shard: the new generation."""
        return self._session_method(session_id, "delete", timeout)  # type: ignore[no-any-return]

    def clear(
        self, session_id: str, kinds: tuple[str, ...] = (), timeout: float | None = None
    ) -> None:
        """``Runtime.clear`` (``/clear``) on the session's shard."""
        self._session_method(session_id, "clear", kinds, timeout)

    def set_setting(
        self,
        session_id: str,
        key: str,
        value: Any = None,
        *,
        reset: bool = False,
        by: str | None = None,
    ) -> None:
        """``Runtime.set_setting`` (SET3) on the session's shard: ``ConfigError`` naming
        the key for an unknown key (a reset too) or a value of the wrong type or range."""
        self._session_method(session_id, "set_setting", key, value, reset=reset, by=by)

    def subscribe(self, topic: str, fn: Callable[[str, Any], None]) -> Callable[[], None]:
        """``Runtime.subscribe`` over the shards: ``fn(topic, payload)`` for each event
        the workers' runtimes publish on ``topic`` (``*``: all; the topics of
        ``services.bus_events.TOPICS``); returns the unsubscribe function. ``bus`` is the
        parent's bus they are published on (``subscribe_typed(shards.bus, fn)`` gives
        typed events).

        The payload is the runtime's, carried as msgpack: tuples arrive as lists. ``fn``
        runs on the shard's event thread in this process (one a shard), so the events of
        a shard (of a session) come in the order its worker published them; events of
        different shards in no given order. A worker publishes only the topics someone
        subscribed to (nothing with no subscriber); it sends them from a queue, so that a
        subscriber that is slow holds up no turn: past ``event_backlog`` (10,000) events
        not yet delivered the worker drops the next ones, with a warning in its log;
        :meth:`info` counts them (``events_dropped``) once the shard's next event reached
        this process. An event whose payload msgpack cannot carry (an object of a class
        of its own a hook published, an integer past 64 bits) is not sent, with a
        warning in the worker's log, and counted there too. A subscriber that raises is
        logged, and the others still get the event.

        The first subscription returns once every live worker follows its events, and a
        worker started again (after it died) is subscribed before the call that started
        it goes on: events of calls made after that are delivered. A worker's death
        loses what it had not sent yet, and what the new worker publishes while it
        starts (``recover()`` finishing the cut turns) is not forwarded. A later
        subscription returns once the live workers follow its topic, or after 5 s for
        a worker that does not answer (stopped: its events are forwarded once it
        answers again, asked each second); ending one waits for no worker (this
        bus stops calling ``fn`` at once). A subscription made, or ended, from a
        subscriber's callback returns without waiting for any worker (the event threads
        read their answers): the new topic's events come from each worker's next events
        on."""
        if not isinstance(topic, str) or not topic:
            raise InvalidInput(f"subscribe: topic must be a non-empty str, not {topic!r:.80}")
        if not callable(fn):
            raise InvalidInput(f"subscribe: fn must be callable, not {type(fn).__name__}")
        if self._closed:
            raise RuntimeClosed("the shards are shut down")
        return self.bus.subscribe(topic, fn)

    def _follow(self, *, wait: bool = True) -> None:
        """The subscriptions changed: the workers follow the topics wanted now (the
        first time, each shard gets its event thread). ``wait``: until they acknowledged
        them (``_ATTACH_S`` at most), outside the lock (a subscriber's callback may
        change its subscriptions meanwhile) and not on a feed's thread (which reads
        acknowledgements)."""
        sent: list[tuple[_EventFeed, Connection, int]] = []
        with self._feeds_lock:
            if self._closed:
                return
            for shard in self._shards:
                if shard.feed is not None:
                    update = shard.feed.update()
                    if update is not None:
                        sent.append((shard.feed, *update))
                    continue
                if not self.bus._wanted:
                    continue
                with shard.lock:
                    shard.feed = _EventFeed(shard)
                    if shard.alive():
                        shard.feed.attach(shard.generation)
        if not wait or getattr(_feed_thread, "on", False):
            return
        deadline = time.monotonic() + _ATTACH_S
        for feed, conn, seq in sent:
            feed.wait_acked(conn, seq, deadline)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every shard had no turn running or queued within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for shard in self._shards:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            answer = shard.call(_call(_WAIT_IDLE, "", None, left), "", "")
            if answer[0] != "i":
                _outcome(answer)  # raises the error
            if not answer[1]:
                return False
        return True

    def info(self) -> list[dict[str, Any]]:
        """Per shard: its index, database, worker pid, whether the worker is alive, its
        restarts, the sessions its worker recovered when it last started, why it is not
        started again (``down``; None until it is given up), and how many bus events its
        workers dropped, for subscribers too slow or as msgpack cannot carry them
        (``events_dropped``, see :meth:`subscribe`)."""
        return [
            {
                "index": s.index,
                "database": s.database,
                "pid": s.process.pid if s.process is not None else None,
                "alive": s.alive(),
                "restarts": s.restarts,
                "recovered": list(s.recovered),
                "down": s.down,
                "events_dropped": s.events_dropped,
            }
            for s in self._shards
        ]

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Shut every worker's runtime down (waiting up to ``timeout`` for turns) and end
        the workers. Calls after it raise ``RuntimeClosed``. The bus events the workers
        sent before they ended are delivered to the subscribers before it returns
        (waiting up to ``timeout`` more for them), and none after it."""
        with self._feeds_lock:  # no feed is made after it (see _follow)
            self._closed = True
        shards = getattr(self, "_shards", ())
        for shard in shards:
            if shard.feed is not None:
                shard.feed.close()
            shard.stop(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for shard in shards:
            if shard.feed is not None:
                shard.feed.finish(deadline)
        shutil.rmtree(self._sockets, ignore_errors=True)
        self._let_go()

    def _let_go(self) -> None:
        """Release the directory (once)."""
        held, self._held = getattr(self, "_held", None), None
        if held is not None:
            release_directory(held)

    def __enter__(self) -> ProcessShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
