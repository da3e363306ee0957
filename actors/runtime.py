"""``Runtime``: the public entry. Hosts one ``SessionActor`` per active session.

    runtime = Runtime(SqliteEventStore("agent.db"))
    handle = runtime.submit("qq:group:1", Input(id="", content="你好"))
    outcome = handle.result(timeout=60)      # when that input's turn has ended

Sessions come up on their first input (rebuilt from their log) and are passivated when
idle, so threads stay bounded by active sessions, not by all sessions (ES4). With
``max_live_sessions``, memory is bounded too: past that many live sessions, the least
recently used idle ones are passivated as new ones come up. An input's text is at most
``max_input_bytes`` of UTF-8 (16 MiB by default), refused at submit past it.
"""

from __future__ import annotations

import _signal
import contextlib
import functools
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import pykka
import structlog
from aalis_agent.actors.budget import BudgetLog
from aalis_agent.actors.fields import FieldView, session_fields
from aalis_agent.actors.gate import Gate
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.host import SessionHost
from aalis_agent.actors.messages import (
    Clear,
    Delete,
    GetView,
    InputOutcome,
    Passivate,
    Ping,
    Release,
    SetSetting,
    Stop,
    StopCommand,
    Submit,
)
from aalis_agent.actors.ownership import SessionOwnedElsewhere
from aalis_agent.actors.session import SessionActor
from aalis_agent.actors.turn import TurnRunner, in_a_turn, in_turn_of
from aalis_agent.actors.workers import Workers
from aalis_agent.events import (
    Clock,
    ConfigError,
    CorruptEvent,
    EventStore,
    IdSource,
    Input,
    InvalidInput,
    ModelRef,
    RuntimeClosed,
    SessionEvent,
    SessionFailed,
    StoreError,
    SystemClock,
    TokenUsage,
    UuidIds,
)
from aalis_agent.events.codec import checked_input, checked_session_id, clean_text
from aalis_agent.projections import SessionView, project, queue, turns
from aalis_agent.projections.inputs import InputIds, unchanged
from aalis_agent.request.texts import Texts
from aalis_agent.request.usage import wire
from aalis_agent.services import Services
from aalis_agent.services.settings import LAYER_KEYS, check_setting_key, validate_setting
from aalis_agent.services.typed_tools import (
    release_default_loop_thread,
    use_default_loop_thread,
)

if TYPE_CHECKING:
    from aalis_agent.actors.ownership import SessionOwnership

__all__ = [
    "MAX_INPUT_BYTES",
    "InputBefore",
    "Quarantined",
    "Runtime",
    "RuntimeClosed",
    "SubmitHandle",
]

log = structlog.get_logger("aalis.runtime")
T = TypeVar("T")
_SIGINT = int(signal.SIGINT)

MAX_INPUT_BYTES = 16 * 2**20
"""The default of ``Runtime(max_input_bytes=...)``: 16 MiB of UTF-8 text in one input,
several times what the largest context windows hold (two million tokens are about 8 MB
of English), while an input this long still takes seconds, not minutes, to count and
store. A longer text is refused at submit (``InvalidInput``), before anything is written."""


def _positive_or_none(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is a positive int (not a bool) or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")


@dataclass
class InputBefore:
    """The ``agent:input:before`` payload: the input and its metadata. The middleware
    runs once per input: not for one sent again under an id its session received."""

    message: Input
    metadata: dict[str, Any]


@dataclass(frozen=True)
class SubmitHandle:
    """An accepted input: ``where`` it went (``opened``: it opened a turn; ``pending``: it
    joins the running turn at its next insertion point; ``queued``; ``released``; ``dropped``
    by an ``agent:input:before`` middleware; ``handled``: sent again after it ended, the
    future already holding how; ``deferred``: see :attr:`accepted`), and a future for how it
    ended (its turn's outcome, or its release)."""

    input_id: str
    where: str
    future: Future[InputOutcome]
    accepted: Future[str] | None = field(default=None, repr=False, compare=False)
    """For ``where == "deferred"`` (a submit from inside a turn while the session winds
    down a deletion or clear): where the input went once it is handed on and durable."""

    def result(self, timeout: float | None = None) -> InputOutcome:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


@dataclass(frozen=True)
class Quarantined:
    """A session refused because its log does not read back: where, and why."""

    session_id: str
    seq: int | None
    reason: str


def _optional_text(name: str, value: object) -> None:
    """A caller's optional text argument (a platform, a user id): None or a str, else
    :class:`InvalidInput` naming it."""
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{name} must be a str or None, not {type(value).__name__}")


def _who(name: str, value: object) -> str | None:
    """Who asks (a platform, a user id) as the log records it: checked as
    :func:`_optional_text` does, lone surrogates cleaned as an input's sender is (the
    same account then matches the one its inputs brought)."""
    _optional_text(name, value)
    if value is None:
        return None
    cleaned = clean_text(value)  # type: ignore[arg-type]
    if len(cleaned) > _WHO_CHARS:  # as an input's ids may take at most (64 KiB as stored)
        raise InvalidInput(f"{name} is {len(cleaned):,} characters long, over {_WHO_CHARS:,}")
    return cleaned


_WHO_CHARS = 16_384
"""The most characters a platform or user id naming who stops or sets may have (at most
64 KiB in UTF-8, the limit of an input's other fields)."""


def _refuse_own_turn(session_id: str, what: str, instead: str | None = None) -> None:
    """Raise RuntimeError when called within a turn of ``session_id`` (its tool, its
    middleware, a callback of it): ``what`` waits for that turn to end, which waits for
    the call, so it would wait for itself, and the session with it."""
    if in_turn_of(session_id):
        raise RuntimeError(
            f"session {session_id!r}: {what} was called from within its own running turn "
            "(a tool, a middleware or a callback of it): it would wait for itself (for "
            "that turn to end, which waits for the call); "
            + (
                instead
                or "call it from another thread without waiting for it here (the turn is "
                "then stopped, and ends once this returns)"
            )
        )


def _checked_kinds(kinds: object) -> tuple[str, ...]:
    """``clear``'s kinds as the log stores them, or :class:`InvalidInput` naming what is
    wrong (a bare string would be read letter by letter, or as a substring)."""
    if isinstance(kinds, str) or not isinstance(kinds, tuple | list):
        raise InvalidInput(
            f"clear: kinds must be a tuple of names, like ('context',), not {kinds!r:.80}"
        )
    checked = []
    for kind in kinds:
        if not isinstance(kind, str) or not kind:
            raise InvalidInput(f"clear: each kind must be a non-empty str, not {kind!r:.80}")
        checked.append(clean_text(kind))
    return tuple(checked)


class _HeldInterrupt:
    """On the main thread, a Ctrl-C arriving inside the block (SIGINT, while Python has
    a handler for it) is held until the block has been left, then handled as it would
    have been. The runtime's gate is entered and left inside it: an interrupt raised as
    the gate is entered or left (before or after its own bookkeeping) would leave it
    held for good. ``with`` gives the list of interrupts held so far."""

    __slots__ = ("_previous", "held", "turn")

    def __enter__(self) -> list[Any]:
        self.held: list[Any] = []
        self._previous: Any = None
        # While a turn runs inside the block (``Runtime._run_here``), its own handler:
        # set here rather than installed, which would cost two more system calls a turn.
        self.turn: Callable[[int, Any], None] | None = None
        if threading.current_thread() is not threading.main_thread():
            return self.held
        try:  # _signal: signal's own functions convert to enums
            previous = _signal.getsignal(_SIGINT)
        except ValueError:  # not the main interpreter
            return self.held
        if callable(previous):  # a Python handler (the default raises KeyboardInterrupt)
            self._previous = previous
            _signal.signal(_SIGINT, self._hold)
        return self.held

    def _hold(self, signum: int, frame: Any) -> None:
        turn = self.turn
        if turn is not None:
            turn(signum, frame)
        else:
            self.held.append(frame)

    def __exit__(self, *exc: object) -> None:
        previous = self._previous
        if previous is None:
            return
        _signal.signal(_SIGINT, previous)
        if self.held:
            previous(signal.SIGINT, self.held[0])


@dataclass
class _Entry:
    actor: SessionActor
    ref: pykka.ActorRef[Any]
    generation: int
    owned: bool = False  # holds one acquisition of the runtime's ownership
    # Callers that took this entry and have not yet reached (or are in) its actor: it is
    # not passivated under them (they would meet it stopped, and again on their retry).
    calling: int = 0


class _InHooks:
    """A send of an input (under the id its caller gave) in its input hooks, or on its
    way from them to its session: another send of that id waits for it (``done``)."""

    __slots__ = ("done", "thread", "waiting")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.thread = threading.get_ident()
        self.waiting = 0  # sends waiting for it


class Runtime:
    """Hosts session actors over one event store, with embedded default services."""

    def __init__(
        self,
        store: EventStore,
        services: Services | None = None,
        clock: Clock | None = None,
        ids: IdSource | None = None,
        *,
        idle_s: float = 300.0,
        janitor: bool = True,
        ask_timeout_s: float = 60.0,
        hooks: Hooks | None = None,
        max_turn_threads: int = 512,
        ownership: SessionOwnership | None = None,
        max_live_sessions: int | None = None,
        gate_wait_s: float | None = 0.05,
        max_input_bytes: int | None = MAX_INPUT_BYTES,
    ) -> None:
        _positive_or_none("max_live_sessions", max_live_sessions)
        _positive_or_none("max_input_bytes", max_input_bytes)
        # The most UTF-8 bytes an input's text may have: a longer one is refused at
        # submit (InvalidInput, naming both sizes) before anything is written (None: no
        # limit). Counting and storing a text takes time that grows with it, and more so
        # for long runs without spaces, all the while holding its session.
        self.max_input_bytes = max_input_bytes
        self.store = store
        # Past this many live sessions, the least recently used idle ones are passivated
        # as new ones come up (None: only the janitor passivates, after idle_s).
        self.max_live_sessions = max_live_sessions
        # Several runtimes over one shared log (aalis_agent.scale): a session's actor
        # starts only once this runtime owns the session, and gives it back when it stops.
        self.ownership = ownership
        if ownership is not None:
            ownership.on_lost(self._ownership_lost)
        self.hooks = hooks or Hooks()
        self.budget_log = BudgetLog()  # ACC4: per-session throttled budget lines
        # Turns run on reused daemon threads; at most ``max_turn_threads`` at once (later
        # turns wait for a thread). A tool that waits on another session's turn needs one
        # more thread than there are such waits.
        # A turn's own steps, and submits, run one at a time: the threads of concurrent
        # turns then stop handing the GIL to each other at every native call. A step
        # waits at most gate_wait_s for the gate, then goes on (None: no gate; see
        # aalis_agent.actors.gate).
        self.workers = Workers(limit=max_turn_threads, gate=Gate(gate_wait_s))
        self._archive_warned = False
        self.services = services or Services()
        self.clock = clock or SystemClock()
        self.ids = ids or UuidIds()
        self.idle_s = idle_s
        self.ask_timeout_s = ask_timeout_s
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._generations: dict[str, int] = {}
        # Inputs in their input hooks, by (session, the id their caller gave). Under _lock.
        self._in_hooks: dict[tuple[str, str], _InHooks] = {}
        self._runners: set[TurnRunner] = set()
        self._runners_idle = threading.Condition(threading.Lock())
        # Turns of fenced actors still running (a tool that ignores the stop), by session,
        # with whether their actor held the session's ownership: the session is not given
        # up, nor a new turn of it started, until they end. Under _runners_idle.
        self._outliving: dict[str, list[tuple[TurnRunner, bool]]] = {}
        # Asked by turns before they act (SessionOwnership.confirm, when offered).
        self.confirm_ownership: Callable[[str], bool] | None = getattr(ownership, "confirm", None)
        self._closed = False
        self._quarantine: dict[str, SessionFailed] = {}
        self._quarantine_info: dict[str, Quarantined] = {}
        self._janitor_stop = threading.Event()
        self._janitor: threading.Thread | None = None
        if janitor:
            self._janitor = threading.Thread(
                target=self._janitor_loop, name="passivation", daemon=True
            )
            self._janitor.start()
        use_default_loop_thread()  # async tools' shared loop: closed by its last runtime

    # --- actors ----------------------------------------------------------------------

    def _load(self, session_id: str) -> SessionView:
        """Fold the session's log. A log that does not decode (or fold) quarantines the
        session: it is reported once and refused from then on; the others go on."""
        return self._folded(session_id, project)

    def _load_for_actor(self, session_id: str) -> tuple[SessionView, InputIds]:
        """:meth:`_load`, with the input ids the log received (what a resubmit is
        answered from, see ``SessionActor._on_submit``) folded from the same read."""
        return self._folded(session_id, lambda events: (project(events), InputIds.of(events)))

    def _folded(self, session_id: str, fold: Callable[[list[SessionEvent]], T]) -> T:
        """``fold`` of the session's log, a log that does not read back quarantined."""
        quarantined = self._quarantine.get(session_id)
        if quarantined is not None:
            raise quarantined
        try:
            return fold(self.store.read(session_id))
        except CorruptEvent as exc:
            raise self._quarantined(session_id, exc.seq, exc.reason) from None
        except StoreError:
            raise  # the store itself failed (not this log): nothing to quarantine
        except Exception as exc:
            raise self._quarantined(session_id, None, f"{type(exc).__name__}: {exc}") from None

    def _quarantined(self, session_id: str, seq: int | None, reason: str) -> SessionFailed:
        where = f"seq {seq}: " if seq is not None else ""
        error = SessionFailed(
            session_id, f"its log does not read back ({where}{reason})", quarantined=True
        )
        with self._lock:
            self._quarantine[session_id] = error
        self._quarantine_info[session_id] = Quarantined(session_id, seq, reason)
        log.error("session quarantined", session=session_id, seq=seq, reason=reason)
        return error

    def quarantined(self) -> list[Quarantined]:
        """Sessions refused because their log does not decode: session, seq, reason."""
        with self._lock:
            return [self._quarantine_info[s] for s in sorted(self._quarantine_info)]

    def _entry(self, session_id: str) -> _Entry:
        """The session's actor, started (and rebuilt from its log) when not running.

        Called with ``self._lock`` held.
        """
        entry = self._entries.get(session_id)
        if entry is not None and entry.ref.is_alive():
            if self.max_live_sessions is not None:  # most recently used last
                self._entries[session_id] = self._entries.pop(session_id)
            return entry
        if self._closed:
            raise RuntimeClosed("the runtime is shut down")
        session_id = checked_session_id(session_id)  # before anything is read or written
        if self.ownership is not None:  # before the log is read: SessionOwnedElsewhere
            self.ownership.acquire(session_id)
        try:
            view, input_ids = self._load_for_actor(session_id)
            host: SessionHost = self  # the narrow protocol the actor sees
            actor = SessionActor.launch(
                host=host,
                session_id=session_id,
                view=view,
                input_ids=input_ids,
                store=self.store,
                services=self.services,
                clock=self.clock,
                ids=self.ids,
            )
        except BaseException:
            self._release(session_id, self.ownership is not None)
            raise
        if actor.failure is not None:  # its recovery could not be written: it stopped
            self._release(session_id, self.ownership is not None)
            raise actor.failure
        if entry is not None:  # a dead actor's acquisition: the new one holds its own
            self._release(session_id, entry.owned)
        # The generation as recovery left it (it finishes a deletion a crash cut short).
        generation = actor.view.queue.generation
        entry = _Entry(actor, actor.actor_ref, generation, self.ownership is not None)
        self._generations.setdefault(session_id, generation)
        self._entries[session_id] = entry
        return entry

    def _release(self, session_id: str, owned: bool) -> None:
        """Give back an actor's acquisition of the session (when it held one)."""
        if owned and self.ownership is not None:
            try:
                self.ownership.release(session_id)
            except Exception:  # the lease then expires by itself
                log.exception("session ownership not released", session=session_id)

    def _ownership_lost(self, session_id: str) -> None:
        """Another runtime took the session (this one's lease expired): stop its actor.
        Whatever it still tries to append is refused by the store's sequence check."""
        with self._runners_idle:  # their acquisitions went with the lease: none to give back
            outliving = self._outliving.get(session_id)
            if outliving:
                self._outliving[session_id] = [(r, False) for r, _ in outliving]
        with self._lock:
            entry = self._entries.pop(session_id, None)
            self._generations.pop(session_id, None)  # its owner's log says it (DEL2)
        if entry is not None:
            log.warning("session ownership lost: its actor stops", session=session_id)
            with contextlib.suppress(Exception):
                entry.ref.stop(block=False)

    def _ask(self, session_id: str, message: Any) -> Any:
        """Have the session handle ``message`` on this thread (``SessionActor.call``)."""
        for attempt in (1, 2):
            with self._lock:
                entry = self._entry(session_id)
                entry.calling += 1
            try:
                return entry.actor.call(message, self.ask_timeout_s)
            except pykka.ActorDeadError:
                # It stopped (fenced after a failed write, shut down) under us: the next
                # actor is rebuilt from the log.
                self._forget(session_id, entry.ref)
                if attempt == 2:
                    raise
            finally:
                with self._lock:
                    entry.calling -= 1
        raise AssertionError("unreachable")

    def _forget(
        self, session_id: str, ref: pykka.ActorRef[Any], runner: TurnRunner | None = None
    ) -> None:
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.ref.actor_urn != ref.actor_urn:
                return
            del self._entries[session_id]
            # DEL2: the next actor reads the generation from the log, as its recovery
            # leaves it: a deletion whose first write failed did not happen; one begun in
            # the log and cut before its SessionDeleted is finished by that recovery.
            self._generations.pop(session_id, None)
        if runner is not None:
            with self._runners_idle:
                # Still running (begun: one never started has done nothing, and may never
                # start): the acquisition is given up when it ends.
                if runner in self._runners and runner.begun:
                    self._outliving.setdefault(session_id, []).append((runner, entry.owned))
                    return
        self._release(session_id, entry.owned)

    def session_failed(
        self, session_id: str, actor: SessionActor, runner: TurnRunner | None = None
    ) -> None:
        """Called by an actor fenced after a failed write: forget it, so the session's
        next use rebuilds it from its log. Its turn ``runner``, when one still runs (a
        tool that ignores the stop), keeps the session owned here until it ends, and a
        new turn of the session waits for it: one session never acts twice at once."""
        self._forget(session_id, actor.actor_ref, runner)

    def unregister_if_idle(self, session_id: str, actor: SessionActor) -> bool:
        """Called by an actor passivating itself: nothing may be on its way to it."""
        with self._lock:
            entry = self._entries.get(session_id)
            if (
                entry is None
                or entry.ref.actor_urn != actor.actor_urn
                or entry.calling
                or not actor.mailbox_idle()
            ):
                return False
            del self._entries[session_id]
            # DEL2: the generation lives on in the log; kept here only while a deletion
            # has raised it past the log's (an input arriving now then reads the log's).
            if self._generations.get(session_id) == actor.view.queue.generation:
                del self._generations[session_id]
        self._release(session_id, entry.owned)
        return True

    def archive_missed(self) -> None:
        """ARC1: one warning per activation, at the first write the absent archive missed."""
        with self._lock:
            if self._archive_warned:
                return
            self._archive_warned = True
        log.warning("message archive absent: new messages are not archived")

    def runner_started(self, runner: TurnRunner) -> None:
        with self._runners_idle:
            self._runners.add(runner)

    def runner_exited(self, runner: TurnRunner) -> None:
        owned = None
        with self._runners_idle:
            self._runners.discard(runner)
            self._runners_idle.notify_all()
            outliving = self._outliving.get(runner.session_id)
            if outliving:
                for i, (r, held) in enumerate(outliving):
                    if r is runner:
                        del outliving[i]
                        owned = held
                        break
                if not outliving:
                    del self._outliving[runner.session_id]
        if owned is not None:
            self._release(runner.session_id, owned)

    def wait_outliving(self, runner: TurnRunner) -> None:
        """Before ``runner`` acts: wait until no turn of its session's fenced actors runs
        any more (see :meth:`session_failed`), or ``runner`` is stopped."""
        if not self._outliving:  # the usual case, read without the lock
            return
        with self.workers.gate.released():  # other turns go on meanwhile
            self._wait_outliving(runner)

    def _wait_outliving(self, runner: TurnRunner) -> None:
        warned = False
        with self._runners_idle:
            while any(r is not runner for r, _ in self._outliving.get(runner.session_id, ())):
                if runner.abort.aborted:
                    return
                if not warned:
                    warned = True
                    log.warning(
                        "turn waits for the session's turn cut by a failed write: it is "
                        "still running (a tool that ignores the stop)",
                        session=runner.session_id,
                        turn=runner.turn_id,
                    )
                self._runners_idle.wait(0.05)

    def turn_threads(self) -> int:
        """How many turn threads are alive (a turn's thread outlives its end a moment)."""
        with self._runners_idle:
            return len(self._runners)

    # --- inputs ----------------------------------------------------------------------

    def submit(self, session_id: str, inp: Input) -> SubmitHandle:
        """Hand an input to its session; returns once the input is durably accepted.

        An input without an id gets one. The handle resolves when the input's turn has
        ended (SCH4) or when the input is released (SCH6, DEL1-DEL2).

        The same input sent again under an id the session received (a retry) never runs
        twice: while the first waits or runs, the handle follows it; once it ended, the
        handle (``where="handled"``) resolves at once to how it ended, and nothing is
        written. Another input under a used id raises :class:`InvalidInput` naming it.
        Such a retry does not go through the input preprocessors and
        ``agent:input:before`` again (they ran for it the first time; one sent while the
        first is still in them waits for it to reach its session), and it is
        compared with what its submitter sent then, not with what they made of it (the
        log holds a digest of that when they changed it). The session remembers its
        last ``KEEP_INPUT_IDS`` (10,000) ids (``projections/inputs.py``), across
        restarts; an older id is taken as new.
        """
        with _HeldInterrupt(), self.workers.gate.held():
            return self._submit(session_id, inp)[0]

    def _submit_unwaited(self, session_id: str, inp: Input) -> SubmitHandle:
        """:meth:`submit`, except that an input its session holds back (a deletion or
        clear winding down) is answered ``deferred`` at once, its handle's ``accepted``
        saying where it went once durable: for a caller that waits for that itself
        (``AsyncRuntime``, on its event loop)."""
        with _HeldInterrupt(), self.workers.gate.held():
            return self._submit(session_id, inp, wait_deferred=False)[0]

    def run(self, session_id: str, inp: Input) -> InputOutcome:
        """Submit ``inp`` and wait for how it ended; a turn it opens runs on this thread.

        The synchronous way to drive a session: ``submit(...).result()`` hands the turn
        to a worker thread and waits for it, and that hand-over between two threads (on
        two cores) cost about 0.3 ms of a tool turn with an instant model, 1.0 ms against
        0.7 here (cache misses, mostly; the share varies between machines and load). The
        wait has no timeout of its own (the model's and the tools' timeouts bound it); an
        input that does not open a turn (one is running) is waited for as a submit is.
        Called where it cannot run a turn (inside a turn, a middleware or a callback),
        the turn goes to a worker as with ``submit``; called within a turn of the same
        session, it is refused with RuntimeError (it would wait for that turn to end,
        which waits for it).
        """
        _refuse_own_turn(session_id, "run", instead="submit it instead: it returns once accepted")
        gate = self.workers.gate
        inside = gate.holder() == threading.get_ident()  # called from a step
        # One stay behind the gate for the submit and the turn: leaving it between them
        # would wake a waiting thread for nothing.
        with _HeldInterrupt() as interrupted, gate.held():
            handle, held = self._submit(session_id, inp, here=True)
            if held is not None:
                try:
                    if not interrupted:  # a Ctrl-C during the submit: a worker runs it
                        self._run_here(session_id, held, gated=not inside)
                finally:
                    held.start_once()  # only when it did not run here (an interrupt)
        return handle.result()

    def _submit(
        self, session_id: str, inp: Input, *, here: bool = False, wait_deferred: bool = True
    ) -> tuple[SubmitHandle, TurnRunner | None]:
        if self._closed:
            raise RuntimeClosed("the runtime is shut down")
        session_id = checked_session_id(session_id)
        # A wrong type is refused here, naming the field, and a text over max_input_bytes.
        inp = checked_input(inp, max_text_bytes=self.max_input_bytes)
        assigned = None  # the id given here, unless a middleware changes it
        if not inp.id:
            inp = msgspec.structs.replace(inp, id=self.ids.new("in"))
            assigned = inp.id
        if inp.timestamp is None:
            inp = msgspec.structs.replace(inp, timestamp=self.clock.now_ms())
        with self._lock:  # the generation when the input arrives (DEL2)
            arrived_in = self._generations.get(session_id)
            if arrived_in is None:  # not live: its log's, read now (the submit would)
                self._entry(session_id)
                arrived_in = self._generations[session_id]
        hooks = self.hooks
        hooked = hooks.has_preprocessors() or hooks.has_middleware("agent:input:before")
        # The same input sent again under an id its session received (a retry) does not
        # go through the input hooks again: they ran for it the first time (a counting,
        # deduplicating or rewriting middleware would see it twice). It goes to the
        # session as its submitter sent it, taken only as that input sent again.
        retry = hooked and assigned is None and self._knows_input(session_id, inp.id)
        if retry or not hooked or assigned is not None:
            return self._submit_checked(
                session_id, inp, assigned, arrived_in, hooked, retry, here, wait_deferred
            )
        # Another send of this id in its hooks (a gateway delivering twice while the
        # first delivery is in a slow middleware) is waited for: this one is then its
        # retry, the hooks not run for it again.
        key = (session_id, inp.id)
        mine = self._hold_input_id(key)
        try:
            retry = self._knows_input(session_id, inp.id)
            return self._submit_checked(
                session_id, inp, assigned, arrived_in, hooked, retry, here, wait_deferred
            )
        finally:
            if mine is not None:
                with self._lock:
                    if self._in_hooks.get(key) is mine:
                        del self._in_hooks[key]
                mine.done.set()

    def _hold_input_id(self, key: tuple[str, str]) -> _InHooks | None:
        """Wait (the gate open) while another send of the input ``key`` names is in its
        input hooks or on its way from them to its session, then hold the id for this
        one: what to release once it has reached its session (None when this thread holds
        it already: a middleware sending the input it was given again is not made to
        wait for itself; nor when the other send has not reached its session within
        ``ask_timeout_s``: it may be waiting for this one, a middleware handing its input
        to another thread that sends it again)."""
        me = threading.get_ident()
        while True:
            with self._lock:
                other = self._in_hooks.get(key)
                if other is None:
                    mine = self._in_hooks[key] = _InHooks()
                    return mine
                if other.thread == me:
                    return None
                other.waiting += 1
            try:
                with self.workers.gate.released():
                    reached = other.done.wait(self.ask_timeout_s)
            finally:
                with self._lock:
                    other.waiting -= 1
            if not reached:
                log.warning(
                    "input still in its hooks on another thread; sent on without waiting",
                    session_id=key[0],
                    input_id=key[1],
                    waited_s=self.ask_timeout_s,
                )
                return None

    def _submit_checked(
        self,
        session_id: str,
        inp: Input,
        assigned: str | None,
        arrived_in: int | None,
        hooked: bool,
        retry: bool,
        here: bool,
        wait_deferred: bool,
    ) -> tuple[SubmitHandle, TurnRunner | None]:
        """:meth:`_submit` of an input checked, its id given, its time stamped, its
        generation read; ``hooked``: input hooks are installed; ``retry``: sent again
        under an id its session received (the hooks not run for it)."""
        done: Future[InputOutcome] = Future()
        sent = None  # the input as its submitter sent it, when the hooks changed it
        if hooked and not retry:
            before = self._before_hooks(session_id, inp, assigned, done)
            if isinstance(before, SubmitHandle):
                return before, None
            inp, assigned, sent = before
        # else: nothing can change the input checked above
        attempt = 0
        while True:
            with self._lock:
                entry = self._entry(session_id)
                entry.calling += 1
                generation = arrived_in if arrived_in is not None else entry.generation
                if attempt == 1:  # the stopped actor's deletion may not have happened
                    generation = min(generation, entry.generation)
            try:  # on this thread, under the actor's lock: no hop to its mailbox
                if assigned is not None:
                    # An id source may restart (SequentialIds after a restart): an id
                    # given here that the session already received is drawn again, so a
                    # new input is never answered as that earlier one sent again.
                    while entry.actor.knows_input(inp.id):
                        inp = msgspec.structs.replace(inp, id=self.ids.new("in"))
                where = entry.actor.call(
                    Submit(
                        inp,
                        generation,
                        done,
                        here=here,
                        assigned=assigned is not None,
                        sent=sent,
                        retry=retry,
                    ),
                    self.ask_timeout_s,
                )
            except pykka.ActorDeadError:
                self._forget(session_id, entry.ref)  # stopped under us: try a fresh one
                attempt += 1
                if attempt == 2:
                    raise
                continue
            finally:
                with self._lock:
                    entry.calling -= 1
            # Held back (a deletion or clear winds down): answered with the future that
            # says where it went once handed on (made then: most inputs never wait so).
            handed_on: Future[str] | None = None
            if isinstance(where, Future):
                handed_on, where = where, "deferred"
            if where is None:
                # Sent as a retry, but the session does not know the id (forgotten
                # meanwhile, or a deletion or clear winds down): a new input, which goes
                # through the input hooks first.
                retry = False
                before = self._before_hooks(session_id, inp, assigned, done)
                if isinstance(before, SubmitHandle):
                    return before, None
                inp, assigned, sent = before
                continue
            if handed_on is not None and wait_deferred and not in_a_turn():
                # A deletion or clear is winding down: the input is handed on once it
                # is done, and only then durable. Waited for with the gate open (the
                # turn winding down needs it). Not from inside a turn (a tool, its
                # middleware): that turn may be the one winding down, or hold a thread or
                # a wait the wind-down needs; such a submit is answered "deferred".
                with self.workers.gate.released():
                    where = handed_on.result()
            if self.max_live_sessions is not None and len(self._entries) > self.max_live_sessions:
                try:  # the input is accepted: nothing here may fail the submit
                    self._shed(session_id)
                except Exception:
                    log.exception("passivating sessions over max_live_sessions failed")
            held = entry.actor.take_held() if here else None
            accepted = handed_on if where == "deferred" else None
            return SubmitHandle(inp.id, where, done, accepted), held

    def _knows_input(self, session_id: str, input_id: str) -> bool:
        """Whether the session received an input under ``input_id`` (one it remembers,
        waiting, running or handled): an input sent again under it is a retry."""
        with self._lock:
            entry = self._entry(session_id)
        return bool(entry.actor.knows_input(input_id))

    def _before_hooks(
        self, session_id: str, inp: Input, assigned: str | None, done: Future[InputOutcome]
    ) -> tuple[Input, str | None, Input | None] | SubmitHandle:
        """Run the input preprocessors and the ``agent:input:before`` middleware on an
        input its session has not received: the input as they left it, its id if it is
        still the one given here, and the input as its submitter sent it (under the id it
        now has) when they changed it, else None; or the handle of an input dropped."""
        sent = inp
        inp = self.hooks.preprocess(inp)
        ctx = InputBefore(message=inp, metadata={"sessionId": session_id})
        ran, _ = self.hooks.run("agent:input:before", ctx, lambda c: c)
        if not ran:  # FLOW1: a middleware that does not call next() drops the input
            done.set_result(InputOutcome(inp.id, None, "dropped", "agent:input:before"))
            return SubmitHandle(inp.id, "dropped", done)
        # as the preprocessors and middleware left it
        inp = checked_input(ctx.message, max_text_bytes=self.max_input_bytes)
        if inp.id != assigned:
            assigned = None  # a middleware gave it an id of its own
        if unchanged(sent, inp):
            return inp, assigned, None
        return inp, assigned, msgspec.structs.replace(sent, id=inp.id)

    def _run_here(self, session_id: str, runner: TurnRunner, *, gated: bool) -> None:
        """Run a turn held for :meth:`run` on this thread.

        On the main thread, where Python raises ``KeyboardInterrupt``, a Ctrl-C while the
        turn runs must not land inside the runtime's own steps: it stops the turn instead
        (a ``stop``, from another thread), and the interrupt is raised once the turn has
        ended, as a wait would have raised it."""
        if threading.current_thread() is not threading.main_thread():
            runner.run_once(gated=gated)
            return
        try:  # _signal: signal's own functions convert to enums, 15 us a turn
            previous = _signal.getsignal(_SIGINT)
        except ValueError:  # not the main interpreter
            previous = None
        if previous is None:  # no Python handler to stand in for
            runner.run_once(gated=gated)
            return
        interrupted: list[Any] = []

        def on_interrupt(signum: int, frame: Any) -> None:
            if not interrupted:
                stop = functools.partial(self._stop_interrupted, session_id, runner.turn_id)
                threading.Thread(target=stop, name="interrupt", daemon=True).start()
            interrupted.append(frame)

        block = getattr(previous, "__self__", None)
        if isinstance(block, _HeldInterrupt) and block.turn is None:
            # Inside ``run``'s block, whose handler is installed already: it hands a
            # Ctrl-C to this turn's handler while the turn runs.
            block.turn = on_interrupt
            try:
                runner.run_once(gated=gated)
            finally:
                block.turn = None
        else:
            _signal.signal(_SIGINT, on_interrupt)
            try:
                runner.run_once(gated=gated)
            finally:
                _signal.signal(_SIGINT, previous)
        if interrupted:
            if callable(previous):
                previous(signal.SIGINT, interrupted[0])
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)  # its default action, now

    def _stop_interrupted(self, session_id: str, turn_id: str) -> None:
        try:
            self._ask(session_id, Stop(reason="stop", turn_id=turn_id))
        except Exception:
            log.exception("stopping the interrupted turn failed", session=session_id)

    def _shed(self, keep: str) -> int:
        """Over ``max_live_sessions``: passivate idle sessions, least recently used first,
        until back at the cap (sessions with work stay: the cap is exceeded while more
        than that many have work). Returns how many were passivated."""
        cap = self.max_live_sessions
        assert cap is not None
        with self._lock:
            excess = len(self._entries) - cap
            if excess <= 0:
                return 0  # others passivated meanwhile
            # A few more than the excess, in case some have work: a submit never scans
            # every live session.
            candidates = [
                e.actor
                for s, e in itertools.islice(self._entries.items(), 2 * excess + 8)
                if s != keep
            ]
        stopped = 0
        for actor in candidates:
            if stopped >= excess:
                break
            try:  # one busy handling a message now has work: passed over at once
                stopped += bool(actor.call(Passivate(0.0), timeout=0))
            except (pykka.ActorDeadError, pykka.Timeout, SessionFailed, RuntimeError):
                continue  # gone already, busy, fenced, or this thread is inside it
        return stopped

    # --- stopping --------------------------------------------------------------------

    def stop(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        """Stop the session's running turn (the stop button); returns its id, if any."""
        who = Stop(platform=_who("platform", platform), user_id=_who("user_id", user_id))
        return self._ask(session_id, who)  # type: ignore[no-any-return]

    def stop_command(
        self,
        session_id: str,
        platform: str | None,
        user_id: str | None,
        venue: str | None = None,
    ) -> str | None:
        """``/stop`` (CMD3): None when the turn was stopped, else the reply to send, in
        the locale of ``platform`` and ``venue`` (default: the session's, see
        :meth:`texts_for`)."""
        platform, user_id = _who("platform", platform), _who("user_id", user_id)
        texts = self.texts_for(session_id, platform, venue)
        return self._ask(session_id, StopCommand(platform, user_id, texts))  # type: ignore[no-any-return]

    def stop_all(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        """Stop the running turn and release queued and pending inputs (archived)."""
        who = Release("stop-all", _who("platform", platform), _who("user_id", user_id))
        return self._ask(session_id, who)  # type: ignore[no-any-return]

    def mute(self, session_id: str) -> str | None:
        """Muted: stop the running turn and release queued and pending inputs (archived)."""
        return self._ask(session_id, Release("mute"))  # type: ignore[no-any-return]

    def delete(self, session_id: str, timeout: float | None = None) -> int:
        """Delete the session (DEL1-DEL2): stop at once, release unarchived, wait for the
        turn to wind down (no time limit unless ``timeout``); returns the new generation.
        Inputs that arrived before this call and reach the session later are dropped.
        Refused with RuntimeError within the session's own turn (it would wait for it)."""
        return self._begin_delete(session_id).result(timeout)

    def _begin_delete(self, session_id: str) -> Future[int]:
        """Ask for the deletion; its future resolves once the turn has wound down."""
        _refuse_own_turn(session_id, "delete")
        done: Future[int] = Future()
        with self._lock:
            entry = self._entry(session_id)
            entry.actor.refuse_reentry("a deletion")
            self._generations[session_id] = self._generations.get(session_id, entry.generation) + 1
            entry.ref.tell(Delete(done))
        return done

    def clear(
        self, session_id: str, kinds: tuple[str, ...] = (), timeout: float | None = None
    ) -> None:
        """``/clear``: with no kinds or ``context``, stop and release unarchived, then
        clear the message history; other kinds are recorded without stopping. ``kinds``
        is a tuple (or list) of names: anything else is refused with
        :class:`InvalidInput` before the session is touched."""
        self._begin_clear(session_id, kinds).result(timeout)

    def _begin_clear(self, session_id: str, kinds: tuple[str, ...] = ()) -> Future[None]:
        """Ask for the clear; its future resolves once it is done."""
        kinds = _checked_kinds(kinds)
        if not kinds or "context" in kinds:  # only that clear stops the turn and waits
            _refuse_own_turn(session_id, "clear")
        done: Future[None] = Future()
        with self._lock:
            entry = self._entry(session_id)
            entry.actor.refuse_reentry("a clear")
            entry.ref.tell(Clear(kinds, done))
        return done

    def shutdown(self, timeout: float | None = None) -> None:
        """Release every session's queued and pending inputs (archived after its running
        turn settles), wait for running turns, then stop all actors. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._entries.items())
        self._janitor_stop.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for _, e in entries:  # each on this thread: a release does not wait for turns
                try:
                    e.actor.call(Release("shutdown"), self._ask_within(deadline))
                except pykka.ActorDeadError:
                    pass
                except Exception:  # a failed write (fenced), or stuck in a store call
                    log.warning("a session could not release its inputs at shutdown")
            self.wait_idle(None if deadline is None else max(deadline - time.monotonic(), 0))
        finally:
            # Always stop every actor (a mailbox thread would keep the process alive).
            with self._lock:
                actors = [e.actor for e in self._entries.values()]
                actors += [e.actor for _, e in entries]
                # Those gone from _entries meanwhile were released as they left.
                owned = [s for s, e in self._entries.items() if e.owned]
                self._entries.clear()
            for actor in dict.fromkeys(actors):  # each once
                with contextlib.suppress(Exception):  # one stuck stops when it is done
                    actor.shut(timeout=self._ask_within(deadline))
            for session_id in owned:
                self._release(session_id, True)
            if self._janitor is not None:
                self._janitor.join(timeout=5)
            self.workers.release_idle()
            # Async tools' loop, shared by the runtimes of the process: the last one to
            # shut down stops it (it starts again when used).
            release_default_loop_thread()

    close = shutdown

    # --- observing -------------------------------------------------------------------

    def subscribe(self, topic: str, fn: Callable[[str, Any], None]) -> Callable[[], None]:
        """Events: ``agent:queue``, ``turn:opened``, ``turn:ended``, ``outbound:message``
        and the others of ``services.bus_events.TOPICS`` (``*``: all); ``fn(topic,
        payload)`` is called on the thread that publishes. Payloads are read-only (shared
        with the topic's other subscribers, and in part with later events)."""
        if not isinstance(topic, str) or not topic:
            raise InvalidInput(f"subscribe: topic must be a non-empty str, not {topic!r:.80}")
        if not callable(fn):
            raise InvalidInput(f"subscribe: fn must be callable, not {type(fn).__name__}")
        return self.services.bus.subscribe(topic, fn)

    def view(self, session_id: str) -> SessionView:
        """The session's projected state (its actor's, or folded from the log)."""
        session_id = checked_session_id(session_id)
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            return self._load(session_id)
        try:
            return entry.actor.call(GetView(), self.ask_timeout_s)  # type: ignore[no-any-return]
        except (pykka.ActorDeadError, SessionFailed):
            return self._load(session_id)  # it stopped: the log is the truth

    def token_request(self, session_id: str, platform: str | None = None) -> TokenUsage:
        """``token:request`` (ACC3): the usage a turn would have now, built the same way
        (same read, same trim) without writing or logging anything; no turn id."""
        from aalis_agent.actors.snapshot import token_request

        session_id = checked_session_id(session_id)
        _optional_text("platform", platform)
        usage = token_request(self, session_id, platform)
        self.services.bus.publish("token:usage", wire(usage))
        return usage

    def fields(
        self, session_id: str, platform: str | None = None, venue: str | None = None
    ) -> list[FieldView]:
        """The session's settings as the settings UI shows them (SET): effective value,
        the layer it comes from and the UI text; the model field reports the model in
        use. ``platform`` and ``venue`` default to those the latest turn read its settings
        for, else the session's origin."""
        view, platform, venue = self._place(session_id, platform, venue)
        return session_fields(
            self.services, session_id, view.settings, platform=platform, venue=venue
        )

    def texts_for(
        self, session_id: str, platform: str | None = None, venue: str | None = None
    ) -> Texts:
        """The texts a reply to the session speaks: the locale of ``platform`` and
        ``venue``, which default as :meth:`fields` has them (the room of its latest turn,
        else its origin), so a reply and the settings it shows are in one language."""
        _view, platform, venue = self._place(session_id, platform, venue)
        return self.services.texts_for(platform, venue)

    def _place(
        self, session_id: str, platform: str | None, venue: str | None
    ) -> tuple[SessionView, str | None, str | None]:
        """The session's view, and ``platform`` and ``venue`` defaulting to those the
        latest turn read its settings for, else the session's origin."""
        session_id = checked_session_id(session_id)
        _optional_text("platform", platform)
        _optional_text("venue", venue)
        info = self.services.sessions.info(session_id)
        view = self.view(session_id)
        last = turns.last_opened(view.turns)  # where the latest turn read its settings
        return (
            view,
            platform or (last.platform if last else None) or info.origin_platform,
            venue or (last.venue if last else None) or info.venue,
        )

    def assign_model(self, session_id: str, model: ModelRef | str) -> None:
        """Write ``llm`` into the session's own layer (SET1), as when a child session is
        given a model; ``model`` is a ModelRef or ``"<provider>/<model>"``."""
        if not isinstance(model, str | ModelRef):
            raise InvalidInput(
                f"assign_model: model must be a ModelRef or '<provider>/<model>', "
                f"not {type(model).__name__}"
            )
        value = (
            model if isinstance(model, str) else {"provider": model.provider, "model": model.model}
        )
        self.set_setting(session_id, "llm", value)

    def set_setting(
        self,
        session_id: str,
        key: str,
        value: Any = None,
        *,
        reset: bool = False,
        by: str | None = None,
    ) -> None:
        """Set (or ``reset``) a setting in the session's own layer (SET3), validated to
        the type and range the log holds (ConfigError naming the key otherwise). Who may
        change which key is the caller's to check (``/session.set`` does, SET4). ``by``
        (who changed it, recorded) is a str or None, as the stops' ``platform`` and
        ``user_id`` are (InvalidInput otherwise); lone surrogates in them are cleaned.
        While a deletion of the session winds down, the change is written after the
        deletion (which would wipe it), and this returns then. ``locale`` is refused: a
        platform, platform-type or venue layer picks a language (or ``AgentConfig.locale``),
        a session's own layer does not (nothing would read it). A reset refuses an unknown
        key as a set does, but clears ``locale``: an older log may hold one (it was once
        written there)."""
        if reset:
            check_setting_key(key)
        elif isinstance(key, str) and key in LAYER_KEYS:
            raise ConfigError(
                f"session setting {key!r}: a session's own layer takes no {key}; set it in "
                f"a platform, platform-type or venue layer, or AgentConfig.{key}"
            )
        stored = None if reset else validate_setting(key, value)
        held = self._ask(session_id, SetSetting(key, stored, reset, _who("by", by)))
        if held is not None and not in_a_turn():
            # A deletion winds down: the change is written once it is (it would wipe the
            # change), and acknowledged then. Not waited for from inside a turn, which
            # the wind-down may wait for (as a submit from there is not).
            held.result()

    def active_sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def _ask_within(self, deadline: float | None) -> float:
        """How long one ask may wait: ``ask_timeout_s``, cut to what is left before
        ``deadline`` (a monotonic time; at least 10 ms)."""
        if deadline is None:
            return self.ask_timeout_s
        return min(self.ask_timeout_s, max(deadline - time.monotonic(), 0.01))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no turn runs in this runtime; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._runners_idle:
                if not self._runners:
                    pass
                else:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._runners_idle.wait(remaining)
                    continue
            # Runners report their end by message: let every actor handle it.
            with self._lock:
                actors = [e.actor for e in self._entries.values()]
            busy = False
            for actor in actors:
                try:
                    busy |= not actor.call(Ping(), self._ask_within(deadline))
                except (pykka.ActorDeadError, SessionFailed):
                    continue
                except pykka.Timeout:  # its mailbox is stuck (a store call that hangs)
                    busy = True
                    break
            with self._runners_idle:
                if not busy and not self._runners:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    # --- recovery and passivation ----------------------------------------------------

    def recover(self, sessions: Iterable[str] | None = None) -> list[str]:
        """Start the sessions whose log shows unfinished work: a turn cut by a crash, or
        inputs still queued. Their actors record the cut turn and schedule the queue.
        Returns the sessions started.

        ``sessions`` limits it to those ids (the others' logs are not read, their work is
        left for the runtime that runs them: a chat restarted on a shared database
        recovers its own session only, and not others' queues with its model); an id
        with no log, or none left to do, is skipped. ``None`` (the default): every
        session."""
        wanted = None if sessions is None else set(sessions)
        started, idle = [], []
        # Only sessions the log does not know to be idle are folded (ES4: start-up does
        # not grow with the whole history); those found idle are marked for next time.
        # A session whose log does not decode is quarantined (see quarantined()); the
        # others go on.
        for session_id in self.store.open_sessions():
            if wanted is not None and session_id not in wanted:
                continue
            try:
                view = self._load(session_id)
                if queue.has_open_work(view.queue):
                    with self._lock:
                        self._entry(session_id)
                    started.append(session_id)
                elif view.seq:
                    idle.append((session_id, view.seq))
            except SessionOwnedElsewhere:
                continue  # another runtime runs it (and recovers it)
            except SessionFailed as exc:
                if not exc.quarantined:
                    log.error("session could not recover", session=session_id, error=str(exc))
                continue
        if idle:
            self.store.mark_idle(idle)
        return started

    def passivate_idle(self, idle_s: float | None = None) -> int:
        """Ask every actor idle for ``idle_s`` (default: the runtime's) to stop, and let
        the idle turn threads exit; returns how many actors stopped. Each is asked on
        this thread (no mailbox thread starts for it), once the message it handles now
        is done."""
        idle = self.idle_s if idle_s is None else idle_s
        with self._lock:
            actors = [e.actor for e in self._entries.values()]
        stopped = 0
        for actor in actors:
            try:
                stopped += bool(actor.call(Passivate(idle), self.ask_timeout_s))
            except (pykka.ActorDeadError, pykka.Timeout, SessionFailed):
                continue
        self.workers.release_idle()  # idle turn threads go with the idle sessions
        return stopped

    def _janitor_loop(self) -> None:
        interval = min(max(self.idle_s / 4, 0.05), 5.0)
        while not self._janitor_stop.wait(interval):
            try:
                self.passivate_idle()
            except Exception:
                log.exception("passivation failed")
