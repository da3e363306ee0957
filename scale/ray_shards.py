"""Runtime shards placed on Ray (extra ``ray``): each shard is a Ray actor hosting an
embedded :class:`~aalis_agent.actors.runtime.Runtime` over the shared PostgreSQL log.

    client = ShardedRuntime(url, shards=4, services=make_services)   # ray.init() first
    handle = client.submit("qq:group:1", Input(id="", content="你好"))
    outcome = handle.result(timeout=60)            # or: outcome = await handle

- Placement: a session belongs to shard ``shard_of(session_id, shards)`` (a stable hash);
  the client routes by it, and each shard's ownership (:class:`ShardOwnership` over
  :class:`PostgresLeases`, owner ``shard-<n>``) refuses any other session, so only one
  shard ever runs a session.
- Failure: Ray restarts a shard whose process died (``max_restarts``). The new
  incarnation takes its shard's leases at once (same owner name; the old process is
  gone, and a zombie would be fenced by the store's sequence check, though an action it
  had under way may run twice: see docs/scaling.md) and
  ``Runtime.recover()`` resumes its sessions from the log: a cut turn is recorded, its
  inputs that no model call carried run again, queued inputs run. With
  ``incarnation_owners=True`` each incarnation owns under a name of its own
  (``shard-<n>@<random>``): it takes a session of its predecessor only once that lease
  has expired (up to ``ttl_s`` after the crash; a submit meanwhile waits for it), so a
  process Ray took for dead but still running keeps what it holds and nothing runs twice.
- Handles: ``submit`` returns once the input is durably accepted (as ``Runtime.submit``);
  ``result`` waits for the input's outcome, and when the shard died meanwhile it asks the
  restarted shard, which reads the outcome (its reply included) from the log. The same
  input sent again (under its id) is not run twice: its handle answers as the first's.
  So the client sends an input again by itself when its shard is lost or restarting
  (Ray's error says it may or may not have been accepted): an input without an id gets
  one in the client first, and the restarted shard answers the retry as the first
  attempt if that was accepted (``ShardedRuntime.submit``, bounded by its timeout, past
  which :class:`ShardUnavailable` names the session, the shard and the input id).
- A shard Ray will not restart (its ``max_restarts`` used up, killed with
  ``no_restart=True``, its creation failing) is not waited for: Ray raises
  ``ActorDiedError`` for it (``ActorUnavailableError`` for one it is restarting), the GCS
  confirms it DEAD (one query per failure, by the shard's actor id), and the client
  raises :class:`ShardDead` at once, naming the session, the shard and Ray's reason, and
  whether the input may have been accepted (when the GCS cannot be asked, the error's
  type decides for that call alone: the shard is not taken as dead for the next). Its
  sessions are not moved to another shard (each shard's ownership
  refuses the others' sessions): they wait for a new placement, a new
  ``ShardedRuntime``, whose shard of the same index takes their leases (at once, or
  once they expire with ``incarnation_owners``) and answers an input sent again under
  its id from the log if it was accepted.
- An error a shard's runtime raises (``SessionOwnedElsewhere``, ``SessionFailed``,
  ``InvalidInput``...) reaches the caller of ``submit``, ``outcome`` and
  ``handle.result`` as itself, its class and attributes kept (one that does not pickle
  is left out, named in the message), its message followed by ``(raised by shard <n>)``
  and its ``shard`` attribute set; Ray's error, with the shard's traceback, is its
  ``__cause__``.

- The shards' bus events reach the driver's subscribers (:meth:`ShardedRuntime.subscribe`,
  as ``Runtime.subscribe``; ``client.bus`` for ``subscribe_typed``): a shard subscribes
  only to the topics someone here wants (nothing with no subscriber) and holds their
  events in a bounded buffer, which a thread of the driver's, one a shard, fetches by
  long polls and publishes on ``client.bus`` in the shard's publishing order. A
  subscriber slower than the shard holds up no turn: past ``event_backlog`` events not
  fetched the shard drops the next ones, counting and logging them (both ends). A shard
  Ray restarted is followed again from its first call: see ``subscribe`` for what a
  restart loses.

``services`` is a picklable callable building the shard's :class:`Services` (a model,
tools, gateway), called in the shard's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import pickle
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import structlog
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.actors.ownership import SessionOwnedElsewhere
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import (
    Input,
    InputJoined,
    InputReleased,
    InputRequeued,
    MessageSaved,
    SessionEvent,
    TurnRecorded,
)
from aalis_agent.events.errors import InvalidInput, RunError, RuntimeClosed
from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.scale import ForwardedBus, with_input_id
from aalis_agent.scale.leases import PostgresLeases
from aalis_agent.scale.ownership import ShardOwnership, shard_of
from aalis_agent.services import Services
from aalis_agent.services.bus import EventBus
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)

__all__ = [
    "RayHandle",
    "RuntimeShard",
    "ShardDead",
    "ShardUnavailable",
    "ShardedRuntime",
    "logged_outcome",
]

_RETRYABLE = (RayActorError, ActorUnavailableError)
log = structlog.get_logger("aalis.ray")

EVENT_BACKLOG = 10_000  # bus events a shard holds for the driver before it drops
_EVENT_BATCH = 1_000  # events one fetch returns at most
_POLL_S = 5.0  # how long a fetch waits in the shard for an event
_FOLLOW_S = 5.0  # how long subscribe waits for the live shards to follow its topics
_SHUTDOWN_S = 60.0  # how long shutdown waits for its shards (all together)


class ShardDead(RunError):
    """The shard of ``session_id`` is dead and Ray will not restart it (its restarts used
    up, killed with ``no_restart=True``, its creation failing): ``reason`` is what Ray
    says. ``maybe_accepted``: the input may have reached the shard before it died (False
    when the client knew the shard dead and did not send it this time). Sent again under its id
    once the session is placed on a live shard (a new :class:`ShardedRuntime`), it is
    answered from the log if it was accepted, and runs once if it was not."""

    def __init__(
        self,
        session_id: str,
        shard: int,
        reason: str,
        input_id: str,
        *,
        maybe_accepted: bool,
        asking: str = "submit",
    ) -> None:
        if asking == "outcome":
            what = (
                f"the outcome of input {input_id!r} cannot be asked of it; ask again under "
                "the same id once the session is placed on a live shard (what its log "
                "recorded is kept)"
            )
        elif maybe_accepted:
            what = (
                f"input {input_id!r} may have been accepted before it died; send it again "
                "under the same id once the session is placed on a live shard (it is "
                "answered from the log if it was accepted, and runs once if not)"
            )
        else:
            what = (
                f"input {input_id!r} was not sent to it, found dead before (it holds the "
                "input only if an earlier send under this id reached it); send it again "
                "under the same id once the session is placed on a live shard"
            )
        super().__init__(
            f"session {session_id!r}: its shard {shard} is dead and will not be "
            f"restarted ({reason}); {what}"
        )
        self.session_id = session_id
        self.shard = shard
        self.reason = reason
        self.input_id = input_id
        self.maybe_accepted = maybe_accepted


class ShardUnavailable(RunError, TimeoutError):
    """The shard of ``session_id`` was lost or restarting for the whole of a submit's
    ``timeout``: each attempt failed with Ray's error (``reason``, the last one), so the
    input may have been accepted. Sent again under its id (``input_id``), it is answered
    from the log if it was, and runs once if not."""

    def __init__(
        self, session_id: str, shard: int, reason: str, input_id: str, timeout: float
    ) -> None:
        super().__init__(
            f"session {session_id!r}: its shard {shard} did not answer within {timeout:g} s "
            f"(lost or restarting: {reason}); input {input_id!r} may have been accepted: "
            "send it again under the same id (it is answered from the log if it was "
            "accepted, and runs once if not)"
        )
        self.session_id = session_id
        self.shard = shard
        self.reason = reason
        self.input_id = input_id


class _Raised(RunError):
    """An error a shard raised, as the Ray actor sends it back: its class, message and
    attributes (``carried``), those that pickle (the others named in the message; an
    error whose class does not pickle is sent as a ``RunError`` with its class's name
    and message). Ray pickles an error by its ``args``, from which an error whose
    ``__init__`` takes other arguments (``SessionOwnedElsewhere``, ``SessionFailed``)
    cannot be rebuilt: the client would get Ray's ``UnserializableException`` instead of
    it."""

    def __init__(self, carried: tuple[type[BaseException], str, dict[str, Any]]) -> None:
        super().__init__(carried)
        self.carried = carried

    def __str__(self) -> str:
        return f"{self.carried[0].__name__}: {self.carried[1]}"

    @classmethod
    def of(cls, exc: Exception) -> _Raised:
        attrs: dict[str, Any] = {}
        left_out: list[str] = []
        for name, value in getattr(exc, "__dict__", {}).items():
            try:
                pickle.loads(pickle.dumps(value))
            except Exception:  # (a lock, a connection): named in the message instead
                left_out.append(name)
            else:
                attrs[name] = value
        message = str(exc)
        if left_out:
            message += f" [attributes not sent, as they do not pickle: {', '.join(left_out)}]"
        carried = (type(exc), message, attrs)
        try:
            pickle.loads(pickle.dumps(carried))
        except Exception:  # its class does not pickle (a local class): its text does
            carried = (RunError, f"{type(exc).__name__}: {message}", {})
        return cls(carried)


def _raise_from_shard(exc: RayTaskError, index: int) -> NoReturn:
    """Raise the error shard ``index`` raised, of its own class and attributes, its
    message followed by ``(raised by shard <index>)``, with a ``shard`` attribute unless
    it had one of its own, from Ray's error (the shard's traceback, for a log); Ray's
    error itself when it carries no such error."""
    cause = getattr(exc, "cause", None)
    if not isinstance(cause, _Raised):
        raise exc
    cls, message, attrs = cause.carried
    try:
        error = cls.__new__(cls)
        error.args = (f"{message} (raised by shard {index})",)
        error.__dict__.update(attrs)
    except Exception:  # a class that cannot be made so: its text is kept
        error = RunError(f"{cls.__name__}: {message} (raised by shard {index})")
    error.__dict__.setdefault("shard", index)
    raise error from exc


def _ray_reason(exc: BaseException) -> str:
    """Ray's error in one line: its first line that is not indented."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _actor_state(actor_id: str | None) -> dict[str, Any] | None:
    """The GCS's record of actor ``actor_id`` (its ``State``: ALIVE, RESTARTING, DEAD...;
    ``NumRestarts``), in one query; None when it cannot be had."""
    if not actor_id:
        return None
    try:
        from ray._private import state

        found = state.actors(actor_id=actor_id)
    except Exception:  # an API of Ray's own: the error's type decides alone
        log.warning("the actor's state could not be read", actor_id=actor_id, exc_info=True)
        return None
    return found if isinstance(found, dict) and "State" in found else None


def _dead_for_good(exc: BaseException, actor: Any = None) -> tuple[str, bool] | None:
    """Why the shard behind ``exc`` will not come back (Ray's words), and whether the GCS
    confirmed it; None when it may come back: Ray raises ``ActorUnavailableError`` for an
    actor it is restarting and ``ActorDiedError`` for one it will not restart. The GCS
    confirms the latter (one query, by the id of ``actor``, the shard the call went to,
    or else the error's: an actor it still lists as restarting or alive is waited for);
    when it cannot be asked, the error's type decides, unconfirmed."""
    if not isinstance(exc, ActorDiedError):
        return None
    own = getattr(actor, "_actor_id", None)  # an ActorDiedError may come without one
    state = _actor_state(own.hex() if own is not None else exc.actor_id)
    if state is not None and state["State"] != "DEAD":
        return None
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.startswith("\t") and line != ActorDiedError.BASE_ERROR_MSG
    ]
    reason = " ".join(lines) or str(exc) or type(exc).__name__
    if state is not None and state.get("NumRestarts"):
        reason += f" (after {state['NumRestarts']} restart(s))"
    return reason, state is not None


def logged_outcome(events: Sequence[SessionEvent], input_id: str) -> InputOutcome | None:
    """How ``input_id`` ended, read from its session's log: the record of the last turn
    it joined (an input requeued by recovery waits for its next turn) with the reply
    that turn saved, or its release; None while it waits or runs. The same outcome the
    input's handle gives (and a handle of it sent again)."""
    turn: str | None = None
    reply: str | None = None
    for e in events:
        if isinstance(e, InputJoined) and e.input_id == input_id:
            turn, reply = e.turn_id, None
        elif isinstance(e, InputRequeued) and e.input_id == input_id:
            turn = None
        elif isinstance(e, InputReleased) and e.input_id == input_id:
            return InputOutcome(input_id, None, "released", e.reason)
        elif turn is None:
            continue
        elif isinstance(e, MessageSaved):
            m = e.message
            if m.role == "assistant" and m.meta.turn_record is not None and m.meta.turn_id == turn:
                shown = m.meta.visible_content  # the turn's reply, as it was sent
                reply = shown if shown is not None else m.content
        elif isinstance(e, TurnRecorded) and e.turn_id == turn:
            return InputOutcome(input_id, turn, e.outcome, e.reason, reply)
    return None


class _EventBuffer:
    """A shard's bus events on their way to the driver (:meth:`ShardedRuntime.subscribe`):
    subscribed to the topics the driver wants and no more (the runtime builds an event
    only when someone wants it), each pickled on the publishing thread and held, numbered
    in publishing order, until the driver's fetch after it (:meth:`fetch`) says it was
    received. Past ``backlog`` events held (a driver slower than the shard) the next ones
    are dropped, with a warning in the shard's log, and counted for the driver: the
    shard's turns never wait for it."""

    def __init__(self, bus: EventBus, index: int, backlog: int = EVENT_BACKLOG) -> None:
        self.bus = bus
        self.index = index
        self.backlog = backlog
        # Which incarnation of the shard the driver's fetches are numbered against: a
        # restarted shard numbers its events from 1 again.
        self.incarnation = uuid.uuid4().hex
        self.cv = threading.Condition()
        self.queue: deque[tuple[int, str, bytes]] = deque()
        self.seq = 0
        self.version = 0  # of the topics followed: the driver numbers its changes
        self.active: frozenset[str] = frozenset()
        self.subscribed: dict[str, Callable[[], None]] = {}
        self.dropped = 0  # since the driver last fetched ...
        self.dropped_total = 0  # ... and since the shard started
        self.closed = False

    def follow(self, version: int, topics: Sequence[str]) -> None:
        """Subscribe to ``topics`` (``*`` alone when it is among them) unless a later
        version was followed already, then end the subscriptions no longer wanted (an
        event comes once, through the subscription ``active`` names) and forget the
        events held of topics no longer wanted."""
        want = frozenset(("*",)) if "*" in topics else frozenset(topics)
        with self.cv:
            if self.closed or version <= self.version:
                return
            self.version = version
            for topic in want - self.subscribed.keys():
                self.subscribed[topic] = self.bus.subscribe(
                    topic, functools.partial(self._on_event, topic)
                )
            self.active = want
            for topic in self.subscribed.keys() - want:
                self.subscribed.pop(topic)()
            if "*" not in want:
                self.queue = deque(e for e in self.queue if e[1] in want)

    def topics(self) -> list[str]:
        return sorted(self.subscribed)

    def _on_event(self, subscribed: str, topic: str, payload: Any) -> None:
        """On the publishing thread (a session's, a turn's): pickle and hold."""
        if subscribed not in self.active:
            return  # a subscription on its way out (or in)
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            log.warning("a bus event cannot be sent to the driver", topic=topic, error=repr(exc))
            with self.cv:  # counted for the driver, as ProcessShards counts its own kind
                self.dropped += 1
                self.dropped_total += 1
            return
        with self.cv:
            if self.closed:
                return
            if len(self.queue) >= self.backlog:
                if not self.dropped:
                    log.warning(
                        "the driver's bus subscribers are slower than the shard: dropping "
                        "events until they catch up",
                        shard=self.index,
                        backlog=self.backlog,
                    )
                self.dropped += 1
                self.dropped_total += 1
                return
            self.seq += 1
            self.queue.append((self.seq, topic, data))
            self.cv.notify_all()

    def fetch(
        self, incarnation: str, after: int, wait_s: float
    ) -> tuple[str, list[tuple[int, str, bytes]], int]:
        """The events held after number ``after`` (those up to it were received: they
        are let go), waiting up to ``wait_s`` for one: (this incarnation, up to
        ``_EVENT_BATCH`` events (number, topic, pickled payload), events dropped since
        the last fetch). ``after`` counts for the ``incarnation`` named only: the
        driver's first fetch from a restarted shard gets all it holds."""
        deadline = time.monotonic() + wait_s
        with self.cv:
            if incarnation == self.incarnation:
                while self.queue and self.queue[0][0] <= after:
                    self.queue.popleft()
            while not self.queue and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(left)
            items = list(itertools.islice(self.queue, _EVENT_BATCH))
            dropped, self.dropped = self.dropped, 0
        if dropped:
            log.warning("bus events dropped for the driver", shard=self.index, dropped=dropped)
        return self.incarnation, items, dropped

    def close(self) -> None:
        """No more events: what is held stays for the driver's last fetch, which
        returns at once."""
        with self.cv:
            if self.closed:
                return
            self.closed = True
            for unsubscribe in self.subscribed.values():
                unsubscribe()
            self.subscribed.clear()
            self.cv.notify_all()


class RuntimeShard:
    """One shard: a Runtime over the shared log, owning the sessions hashed to it. Made a
    Ray actor by :class:`ShardedRuntime` (threaded: ``max_concurrency`` calls at once)."""

    def __init__(
        self,
        index: int,
        shards: int,
        url: str,
        services: Callable[[], Services],
        *,
        ttl_s: float = 15.0,
        runtime_options: dict[str, Any] | None = None,
        incarnation_owner: bool = False,
        event_backlog: int = EVENT_BACKLOG,
    ) -> None:
        self.index = index
        self.ttl_s = ttl_s
        # The owner name of this shard's incarnations: all the same (``shard-<n>``), or
        # one each (``shard-<n>@<random>``), which waits out a predecessor's leases.
        self._mine = f"shard-{index}@"
        own = f"{self._mine}{uuid.uuid4().hex[:12]}"
        self.owner = own if incarnation_owner else f"shard-{index}"
        self.store = PostgresEventStore(url)
        self.leases = PostgresLeases(self.store, owner=self.owner, ttl_s=ttl_s)
        ownership = ShardOwnership(self.leases, index, shards)
        self.runtime = Runtime(
            self.store, services(), ownership=ownership, **(runtime_options or {})
        )
        self._handles: dict[str, SubmitHandle] = {}
        self._closed = threading.Event()
        self.bus_events = _EventBuffer(self.runtime.services.bus, index, event_backlog)
        self.recovered = self.runtime.recover()
        if incarnation_owner:
            # A predecessor's sessions with work open are refused until their leases
            # expire: recovered again once they can have (twice: a renewal may have
            # landed just before the crash).
            threading.Thread(
                target=self._recover_later, name=f"shard-{index}-recover", daemon=True
            ).start()

    def _recover_later(self) -> None:
        for _ in range(2):
            if self._closed.wait(self.ttl_s + 1.0):
                return
            try:
                found = self.runtime.recover()
            except Exception:  # the next round, or the next submit, tries again
                log.exception("recovering the shard's sessions again failed", shard=self.index)
                continue
            self.recovered.extend(s for s in found if s not in self.recovered)

    def info(self) -> dict[str, Any]:
        """The shard's index, owner name, process id, the sessions it recovered since
        it started, the bus topics it forwards to the driver and the bus events it
        dropped since it started (the driver's subscribers slower than it)."""
        import os

        return {
            "index": self.index,
            "owner": self.owner,
            "pid": os.getpid(),
            "recovered": list(self.recovered),
            "bus_topics": self.bus_events.topics(),
            "events_dropped": self.bus_events.dropped_total,
        }

    def follow(self, version: int, topics: list[str]) -> None:
        """Forward the bus events of ``topics`` to the driver (version ``version`` of
        the driver's subscriptions; an older one than followed is ignored)."""
        self.bus_events.follow(version, topics)

    def events(
        self, incarnation: str, after: int, version: int, topics: list[str], wait_s: float
    ) -> tuple[str, list[tuple[int, str, bytes]], int]:
        """The driver's fetch of the shard's bus events (see :class:`_EventBuffer`),
        following ``topics`` first (a restarted shard learns them so)."""
        self.bus_events.follow(version, topics)
        return self.bus_events.fetch(incarnation, after, wait_s)

    def submit(
        self, session_id: str, inp: Input, follow: tuple[int, list[str]] | None = None
    ) -> tuple[str, str]:
        """``Runtime.submit``: (input id, where), once the input is durably accepted. A
        session an earlier incarnation of this shard still holds (``incarnation_owner``)
        is waited for until its lease expires (at most twice ``ttl_s``); one held by
        another name is refused at once (``SessionOwnedElsewhere``). ``follow``: the
        driver's bus topics (:meth:`follow`), followed before the input is taken, so
        that a restarted shard forwards the events of the first input it takes."""
        if follow is not None:
            self.bus_events.follow(*follow)
        deadline = time.monotonic() + 2 * self.ttl_s + 1.0
        while True:
            try:
                handle = self.runtime.submit(session_id, inp)
                break
            except SessionOwnedElsewhere as exc:
                earlier = exc.owner.startswith(self._mine) and exc.owner != self.owner
                left = deadline - time.monotonic()
                if not earlier or left <= 0:
                    raise
                wait = exc.expires_in_s if exc.expires_in_s is not None else 0.2
                if self._closed.wait(min(max(wait, 0.05) + 0.05, left)):
                    raise
        self._handles[handle.input_id] = handle
        return handle.input_id, handle.where

    def outcome(self, session_id: str, input_id: str, timeout: float) -> InputOutcome | None:
        """The input's outcome, waiting up to ``timeout`` (None on timeout): from its
        handle when this incarnation accepted it, else from the log."""
        handle = self._handles.get(input_id)
        if handle is not None:
            try:
                result = handle.result(timeout)
            except TimeoutError:
                return None
            self._handles.pop(input_id, None)
            return result
        deadline = time.monotonic() + timeout
        while True:
            found = logged_outcome(self.store.read(session_id), input_id)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def wait_idle(self, timeout: float) -> bool:
        return self.runtime.wait_idle(timeout)

    def shutdown(self) -> None:
        self._closed.set()
        self.runtime.shutdown(timeout=30)  # the turns' last events are held for the driver
        self.bus_events.close()  # a fetch returns what is held at once, no more comes
        self.leases.close()
        self.store.close()


class _RayShard(RuntimeShard):
    """:class:`RuntimeShard` as the Ray actor: an error its calls raise is sent back as
    :class:`_Raised`, which the client turns into the error itself (naming the shard)."""

    def submit(
        self, session_id: str, inp: Input, follow: tuple[int, list[str]] | None = None
    ) -> tuple[str, str]:
        try:
            return super().submit(session_id, inp, follow)
        except Exception as exc:
            raise _Raised.of(exc) from exc

    def outcome(self, session_id: str, input_id: str, timeout: float) -> InputOutcome | None:
        try:
            return super().outcome(session_id, input_id, timeout)
        except Exception as exc:
            raise _Raised.of(exc) from exc

    # The driver's long polls of the bus events run on threads of their own (two: one
    # under way and one the driver gave up waiting for), never taking one of the
    # ``max_concurrency`` its other calls run on.
    @ray.method(concurrency_group="bus")
    def events(  # type: ignore[override]  # (Ray types it as its remote method)
        self, incarnation: str, after: int, version: int, topics: list[str], wait_s: float
    ) -> tuple[str, list[tuple[int, str, bytes]], int]:
        return super().events(incarnation, after, version, topics, wait_s)


@dataclass
class RayHandle:
    """An accepted input on a shard: ``where`` it went, and its outcome by ``result()``
    (or ``await handle``)."""

    client: ShardedRuntime
    session_id: str
    input_id: str
    where: str

    def result(self, timeout: float | None = 60.0) -> InputOutcome:
        return self.client.outcome(self.session_id, self.input_id, timeout)

    async def aresult(self, timeout: float | None = 60.0) -> InputOutcome:
        return await self.client.aoutcome(self.session_id, self.input_id, timeout)

    def __await__(self) -> Generator[Any, None, InputOutcome]:
        return self.aresult().__await__()


class _EventFeed:
    """Shard ``index``'s bus events, fetched by a thread of the driver's (long polls of
    :meth:`RuntimeShard.events`) and published on the client's bus in the shard's
    publishing order. Each fetch names the topics wanted, so a shard Ray restarted
    follows them from its first fetch on; the feed ends with the client (it holds it
    weakly), at its shutdown, or once its shard is confirmed dead for good."""

    def __init__(self, owner: ShardedRuntime, index: int) -> None:
        self.owner = weakref.ref(owner)
        self.index = index
        self.incarnation = ""  # the shard's incarnation the feed read last ...
        self.after = 0  # ... and the number of the last event it received from it
        self.closed = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"aalis-ray-shard-{index}-events", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while True:
            # Closed (the client shut its shards down): one more fetch, which gets what
            # the shard published until its runtime was down, then the feed ends.
            last = self.closed.is_set()
            owner = self.owner()
            if owner is None or not ray.is_initialized():
                return
            version, topics = owner._following
            if not topics:  # nobody subscribes: no fetches until someone does
                if last:
                    return
                wake = owner._wake
                del owner
                wake.wait(1.0)
                continue
            actor, bus = owner.actors[self.index], owner.bus
            dead = owner._dead.get(self.index)
            del owner  # not kept alive by a fetch under way
            if dead is not None and dead[0] is actor:
                log.error("the shard is dead for good: no bus events from it", shard=self.index)
                return
            try:
                ref = actor.events.remote(self.incarnation, self.after, version, topics, _POLL_S)
                incarnation, items, dropped = ray.get(ref, timeout=_POLL_S + 30.0)
            except GetTimeoutError:
                if last:
                    return
                continue
            except _RETRYABLE as exc:
                if self.closed.is_set():
                    return
                gone = _dead_for_good(exc, actor)
                if gone is not None and gone[1]:
                    log.error(
                        "the shard is dead for good: no bus events from it",
                        shard=self.index,
                        reason=gone[0],
                    )
                    return
                self.closed.wait(0.2)  # the shard is restarting
                continue
            except Exception:
                if self.closed.is_set() or not ray.is_initialized():
                    return
                log.exception("fetching a shard's bus events failed", shard=self.index)
                self.closed.wait(1.0)
                continue
            self._deliver(bus, incarnation, items, dropped)
            if last:
                return

    def _deliver(
        self, bus: EventBus, incarnation: str, items: list[tuple[int, str, bytes]], dropped: int
    ) -> None:
        if incarnation != self.incarnation:
            if self.incarnation:
                log.info("following the bus events of a restarted shard", shard=self.index)
            self.incarnation, self.after = incarnation, 0
        if dropped:
            log.warning(
                "the shard dropped bus events: the subscribers here were slower than it",
                shard=self.index,
                dropped=dropped,
            )
        for seq, topic, data in items:
            self.after = seq
            try:
                payload = pickle.loads(data)
            except Exception:
                log.exception("a shard's bus event cannot be read", shard=self.index, topic=topic)
                continue
            bus.publish(topic, payload)  # a subscriber that raises is logged

    def close(self) -> None:
        """End the feed after one more fetch (its shard shut down: it returns at once)."""
        self.closed.set()


class ShardedRuntime:
    """Starts ``shards`` :class:`RuntimeShard` actors on the connected Ray cluster and
    routes each session to its shard."""

    # The topics the driver's subscribers want, numbered by change: (version, topics).
    _following: tuple[int, list[str]] = (0, [])
    _feeds: tuple[_EventFeed, ...] = ()  # one a shard, from the first subscription on

    def __init__(
        self,
        url: str,
        shards: int,
        services: Callable[[], Services],
        *,
        ttl_s: float = 15.0,
        max_restarts: int = -1,
        num_cpus: float = 0.5,
        max_concurrency: int = 64,
        runtime_options: dict[str, Any] | None = None,
        incarnation_owners: bool = False,
        event_backlog: int = EVENT_BACKLOG,
    ) -> None:
        """``incarnation_owners``: each incarnation of a shard owns under a name of its
        own and waits out its predecessor's leases (see the module docstring).
        ``event_backlog``: the bus events a shard holds for the driver's subscribers
        before it drops the next ones (see :meth:`subscribe`). Each shard runs up to
        ``max_concurrency`` calls at once (its bus events are fetched besides)."""
        if isinstance(event_backlog, bool) or not isinstance(event_backlog, int):
            raise InvalidInput(f"event_backlog must be an int, not {event_backlog!r:.80}")
        if event_backlog < 1:
            raise InvalidInput(f"event_backlog must be at least 1, not {event_backlog}")
        # (Ray's stubs do not name the options it takes here.)
        as_actor: Any = ray.remote
        shard_class: Any = as_actor(concurrency_groups={"bus": 2})(_RayShard)
        remote = shard_class.options(
            max_restarts=max_restarts,
            max_task_retries=0,  # a submit is never run twice by Ray
            max_concurrency=max_concurrency,
            num_cpus=num_cpus,
        )
        self.shards = shards
        self.actors: list[Any] = [
            remote.remote(
                i,
                shards,
                url,
                services,
                ttl_s=ttl_s,
                runtime_options=runtime_options,
                incarnation_owner=incarnation_owners,
                event_backlog=event_backlog,
            )
            for i in range(shards)
        ]
        self.bus: EventBus = ForwardedBus(self)
        self._follow_lock = threading.Lock()
        self._wake = threading.Event()  # set while someone subscribes: the feeds fetch
        # Shards found dead for good: index -> (that actor, Ray's reason). DEAD is final
        # in Ray, so later calls to the same actor are refused without being sent.
        self._dead: dict[int, tuple[Any, str]] = {}
        self._closed = False  # shut down: every call is refused (RuntimeClosed)

    def shard(self, session_id: str) -> Any:
        """The Ray actor that runs ``session_id``."""
        return self.actors[shard_of(session_id, self.shards)]

    def info(self) -> list[dict[str, Any]]:
        self._refuse_if_closed("info")
        return list(ray.get([a.info.remote() for a in self.actors]))

    def subscribe(self, topic: str, fn: Callable[[str, Any], None]) -> Callable[[], None]:
        """``Runtime.subscribe`` over the shards: ``fn(topic, payload)`` for each event
        the shards' runtimes publish on ``topic`` (``*``: all; the topics of
        ``services.bus_events.TOPICS``); returns the unsubscribe function (after which
        ``fn`` is called no more; a second call does nothing). ``bus`` is the driver's
        bus they are published on (``subscribe_typed(client.bus, fn)`` gives typed
        events).

        The payload is the runtime's, pickled in the shard as it is published (one that does
        not pickle, as a hook's lambda, is not sent: a warning in the shard's log names its
        topic, and ``info()`` counts it among ``events_dropped``). ``fn`` runs on the
        shard's event thread in this process (one a shard,
        started by the first subscription), so the events of a shard (of a session) come in
        the order the shard published them; events of different shards in no given order. A
        shard subscribes only to the topics someone here subscribed to (nothing with no
        subscriber, and no fetches then) and holds their events until this process has
        fetched them, so that a subscriber that is slow holds up no turn: past
        ``event_backlog`` (10,000) events not fetched the shard drops the next ones, with a
        warning in its log and in this process's (``info()``'s ``events_dropped`` counts
        them). A subscriber that raises is logged, and the others still get the event. The
        first subscription returns once the live shards follow its topics (5 s at most: a
        shard restarting follows them from its next call).

        A shard Ray restarted is followed again: each fetch and each submit names the
        topics wanted, and the shard follows them before it answers, so the events of an
        input submitted after the restart are delivered. Lost across a restart: the
        events the dead incarnation held that this process had not fetched yet (those of
        the last moments before it died), and what the new incarnation publishes before
        the first call from here reaches it (its next fetch, within a fraction of a
        second, or a submit): ``recover()`` finishing the cut turns as it starts, and the
        beginning of the turns it resumes. A shard dead for good sends nothing more."""
        if not isinstance(topic, str) or not topic:
            raise InvalidInput(f"subscribe: topic must be a non-empty str, not {topic!r:.80}")
        if not callable(fn):
            raise InvalidInput(f"subscribe: fn must be callable, not {type(fn).__name__}")
        self._refuse_if_closed("subscribe")
        return self.bus.subscribe(topic, fn)

    def _follow(self, *, wait: bool = True) -> None:
        """The subscriptions changed: tell the live shards the topics wanted now (the
        first time, each shard gets its feed) and wait (a moment at most; not with
        ``wait`` false, for an unsubscription) until they follow them."""
        with self._follow_lock:
            if self._closed:
                return
            topics = sorted(self.bus._wanted)
            if topics == self._following[1]:
                return
            version = self._following[0] + 1
            self._following = (version, topics)
            if topics and not self._feeds:
                self._feeds = tuple(_EventFeed(self, i) for i in range(self.shards))
            if topics:
                self._wake.set()
            else:
                self._wake.clear()
            refs = []
            for index, actor in enumerate(self.actors):
                dead = self._dead.get(index)
                if dead is None or dead[0] is not actor:
                    refs.append(actor.follow.remote(version, topics))
        if not wait:
            return
        deadline = time.monotonic() + _FOLLOW_S
        for ref in refs:
            with contextlib.suppress(Exception):  # dead or restarting: its next call follows
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))

    def _follow_args(self) -> dict[str, Any]:
        """What a submit carries for the shard to follow the topics wanted (nothing when
        nobody subscribes)."""
        return {"follow": self._following} if self._following[1] else {}

    def _refuse_if_closed(self, asking: str) -> None:
        if self._closed:
            raise RuntimeClosed(
                f"the sharded runtime is shut down (its shards were stopped): {asking} "
                "needs a new ShardedRuntime"
            )

    def _live_shard(self, session_id: str, input_id: str, asking: str) -> tuple[int, Any]:
        """The index and actor of the session's shard; ShardDead when that actor was
        found dead for good before (nothing is sent to it); RuntimeClosed once
        :meth:`shutdown` was called."""
        self._refuse_if_closed(asking)
        index = shard_of(session_id, self.shards)
        actor = self.actors[index]
        dead = self._dead.get(index)
        if dead is not None and dead[0] is actor:
            raise ShardDead(
                session_id, index, dead[1], input_id, maybe_accepted=False, asking=asking
            )
        return index, actor

    def _shard_died(
        self,
        session_id: str,
        index: int,
        actor: Any,
        input_id: str,
        dead: tuple[str, bool],
        asking: str,
    ) -> ShardDead:
        reason, confirmed = dead
        if confirmed:  # DEAD in the GCS is final; a guess from the error's type is not kept
            self._dead[index] = (actor, reason)
        log.error("shard dead for good", shard=index, session_id=session_id, reason=reason)
        return ShardDead(session_id, index, reason, input_id, maybe_accepted=True, asking=asking)

    def submit(self, session_id: str, inp: Input, timeout: float | None = 60.0) -> RayHandle:
        """Hand the input to its session's shard; returns once it is durably accepted.

        A shard lost or restarting meanwhile (Ray's ``ActorUnavailableError``, or
        another ``RayActorError``: the input may or may not have been accepted) is asked
        again once Ray has restarted it, the input sent again under its id (given here
        when it has none): the restarted shard answers it as the earlier attempt if that
        was accepted, else takes it; it never runs twice. Once ``timeout`` seconds have
        passed, :class:`ShardUnavailable` (a ``TimeoutError``) names the session, the
        shard, Ray's last error and the input id to send again. A shard Ray will not
        restart (``ActorDiedError``, the GCS listing it DEAD) raises :class:`ShardDead`
        at once, naming the session, the shard and Ray's reason, and whether the input
        may have been accepted."""
        inp = with_input_id(inp)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            index, actor = self._live_shard(session_id, inp.id, "submit")
            try:
                ref = actor.submit.remote(session_id, inp, **self._follow_args())
                input_id, where = ray.get(ref)
                return RayHandle(self, session_id, input_id, where)
            except RayTaskError as exc:
                _raise_from_shard(exc, index)
            except _RETRYABLE as exc:
                dead = _dead_for_good(exc, actor)
                if dead is not None:
                    raise self._shard_died(
                        session_id, index, actor, inp.id, dead, "submit"
                    ) from exc
                if deadline is not None and time.monotonic() >= deadline:
                    raise ShardUnavailable(
                        session_id, index, _ray_reason(exc), inp.id, timeout or 0.0
                    ) from exc
                time.sleep(0.2)  # the shard is restarting

    async def asubmit(self, session_id: str, inp: Input, timeout: float | None = 60.0) -> RayHandle:
        """:meth:`submit` for asyncio."""
        inp = with_input_id(inp)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            index, actor = self._live_shard(session_id, inp.id, "submit")
            try:
                input_id, where = await actor.submit.remote(session_id, inp, **self._follow_args())
                return RayHandle(self, session_id, input_id, where)
            except RayTaskError as exc:
                _raise_from_shard(exc, index)
            except _RETRYABLE as exc:
                dead = await asyncio.to_thread(_dead_for_good, exc, actor)
                if dead is not None:
                    raise self._shard_died(
                        session_id, index, actor, inp.id, dead, "submit"
                    ) from exc
                if deadline is not None and time.monotonic() >= deadline:
                    raise ShardUnavailable(
                        session_id, index, _ray_reason(exc), inp.id, timeout or 0.0
                    ) from exc
                await asyncio.sleep(0.2)

    def outcome(self, session_id: str, input_id: str, timeout: float | None = 60.0) -> InputOutcome:
        """How the input ended; a shard that dies meanwhile is asked again once Ray has
        restarted it. TimeoutError after ``timeout``; :class:`ShardDead` at once when
        the shard is dead for good."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            index, actor = self._live_shard(session_id, input_id, "outcome")
            try:
                found = ray.get(actor.outcome.remote(session_id, input_id, min(left, 5.0)))
            except RayTaskError as exc:
                _raise_from_shard(exc, index)
            except _RETRYABLE as exc:
                dead = _dead_for_good(exc, actor)
                if dead is not None:
                    raise self._shard_died(
                        session_id, index, actor, input_id, dead, "outcome"
                    ) from exc
                found = None
                time.sleep(0.2)  # the shard is restarting
            if found is not None:
                return found  # type: ignore[no-any-return]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"input {input_id!r} of session {session_id!r} (shard {index}): "
                    f"no outcome within {timeout:g} s"
                )

    async def aoutcome(
        self, session_id: str, input_id: str, timeout: float | None = 60.0
    ) -> InputOutcome:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            index, actor = self._live_shard(session_id, input_id, "outcome")
            try:
                found = await actor.outcome.remote(session_id, input_id, min(left, 5.0))
            except RayTaskError as exc:
                _raise_from_shard(exc, index)
            except _RETRYABLE as exc:
                dead = await asyncio.to_thread(_dead_for_good, exc, actor)
                if dead is not None:
                    raise self._shard_died(
                        session_id, index, actor, input_id, dead, "outcome"
                    ) from exc
                found = None
                await asyncio.sleep(0.2)
            if found is not None:
                return found  # type: ignore[no-any-return]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"input {input_id!r} of session {session_id!r} (shard {index}): "
                    f"no outcome within {timeout:g} s"
                )

    def wait_idle(self, timeout: float = 60.0) -> bool:
        self._refuse_if_closed("wait_idle")
        return all(ray.get([a.wait_idle.remote(timeout) for a in self.actors]))

    def shutdown(self) -> None:
        """Shut every shard's runtime down (releasing its leases; all at once, waiting a
        minute at most in all), then the actors. Calls
        after it raise :class:`RuntimeClosed` (not :class:`ShardDead`: the shards were
        stopped, not lost). A subscriber may call it from its callback (on a shard's
        event thread, which ends once the callback returns). The bus events the shards
        publish until their runtimes are down (the turns they stop) are delivered
        before it returns (but to a subscriber calling it, whose thread goes on once the
        callback returns)."""
        self._closed = True
        # Every shard is asked at once, then waited for within one minute in all: one at
        # a time, busy shards took a minute each.
        asked = []
        for actor in self.actors:
            with contextlib.suppress(Exception):  # a dead shard's leases expire by themselves
                asked.append(actor.shutdown.remote())
        deadline = time.monotonic() + _SHUTDOWN_S
        for ref in asked:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        for feed in self._feeds:  # each fetches what its shard held last, then ends
            feed.close()
        for feed in self._feeds:
            if feed.thread is not threading.current_thread():  # (a subscriber's call)
                feed.thread.join(_POLL_S + 5.0)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
