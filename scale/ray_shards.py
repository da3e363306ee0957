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
  ``handle.result`` as itself, its class and attributes kept, its message followed by
  ``(raised by shard <n>)`` and its ``shard`` attribute set; Ray's error, with the
  shard's traceback, is its ``__cause__``.

``services`` is a picklable callable building the shard's :class:`Services` (a model,
tools, gateway), called in the shard's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import time
import uuid
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
from aalis_agent.events.errors import RunError, RuntimeClosed
from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.scale import with_input_id
from aalis_agent.scale.leases import PostgresLeases
from aalis_agent.scale.ownership import ShardOwnership, shard_of
from aalis_agent.services import Services
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

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
    attributes (``carried``), which pickle. Ray pickles an error by its ``args``, from
    which an error whose ``__init__`` takes other arguments (``SessionOwnedElsewhere``,
    ``SessionFailed``) cannot be rebuilt: the client would get Ray's
    ``UnserializableException`` instead of it."""

    def __init__(self, carried: tuple[type[BaseException], str, dict[str, Any]]) -> None:
        super().__init__(carried)
        self.carried = carried

    def __str__(self) -> str:
        return f"{self.carried[0].__name__}: {self.carried[1]}"

    @classmethod
    def of(cls, exc: Exception) -> _Raised:
        carried = (type(exc), str(exc), dict(getattr(exc, "__dict__", {})))
        try:
            pickle.loads(pickle.dumps(carried))
        except Exception:  # its class or an attribute does not pickle: its text does
            carried = (RunError, f"{type(exc).__name__}: {exc}", {})
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
        """The shard's index, owner name, process id and the sessions it recovered since
        it started."""
        import os

        return {
            "index": self.index,
            "owner": self.owner,
            "pid": os.getpid(),
            "recovered": list(self.recovered),
        }

    def submit(self, session_id: str, inp: Input) -> tuple[str, str]:
        """``Runtime.submit``: (input id, where), once the input is durably accepted. A
        session an earlier incarnation of this shard still holds (``incarnation_owner``)
        is waited for until its lease expires (at most twice ``ttl_s``); one held by
        another name is refused at once (``SessionOwnedElsewhere``)."""
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
        self.runtime.shutdown(timeout=30)
        self.leases.close()
        self.store.close()


class _RayShard(RuntimeShard):
    """:class:`RuntimeShard` as the Ray actor: an error its calls raise is sent back as
    :class:`_Raised`, which the client turns into the error itself (naming the shard)."""

    def submit(self, session_id: str, inp: Input) -> tuple[str, str]:
        try:
            return super().submit(session_id, inp)
        except Exception as exc:
            raise _Raised.of(exc) from exc

    def outcome(self, session_id: str, input_id: str, timeout: float) -> InputOutcome | None:
        try:
            return super().outcome(session_id, input_id, timeout)
        except Exception as exc:
            raise _Raised.of(exc) from exc


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


class ShardedRuntime:
    """Starts ``shards`` :class:`RuntimeShard` actors on the connected Ray cluster and
    routes each session to its shard."""

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
    ) -> None:
        """``incarnation_owners``: each incarnation of a shard owns under a name of its
        own and waits out its predecessor's leases (see the module docstring)."""
        shard_class: Any = ray.remote(_RayShard)
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
            )
            for i in range(shards)
        ]
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
                input_id, where = ray.get(actor.submit.remote(session_id, inp))
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
                input_id, where = await actor.submit.remote(session_id, inp)
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
        """Shut every shard's runtime down (releasing its leases), then the actors. Calls
        after it raise :class:`RuntimeClosed` (not :class:`ShardDead`: the shards were
        stopped, not lost)."""
        self._closed = True
        for actor in self.actors:
            with contextlib.suppress(Exception):  # a dead shard's leases expire by themselves
                ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor, no_restart=True)
