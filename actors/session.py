"""``SessionActor``: the single writer of one session's log, and its scheduler.

Each message is handled by a pure decision (``actors.scheduler``) that adds events to a
batch; the actor appends the batch atomically, adopts the folded view, then performs the
effects the events call for: start a turn runner, signal a stop, resolve the callers'
handles, write the SCH8 log lines and publish ``agent:queue`` and turn lifecycle events.
Turns run on their own threads (``actors.turn``), never on the actor's mailbox thread.

One lock serialises everything the actor does. Its mailbox thread handles messages under
it, and so does :meth:`SessionActor.call`: the runtime's ``submit`` and the session's own
turn runner hand their messages over on their own threads, with the same one-at-a-time
guarantee and no thread hop (a hop between Python threads costs about 0.1 ms each way,
more than the rest of a short turn's bookkeeping).

The mailbox thread itself starts only when a message is put in the mailbox (a ``tell`` or
an ``ask`` through the actor's ref): ``launch`` runs ``on_start`` on the launching thread,
and a session reached only through :meth:`SessionActor.call` (submits, its turn's
reports, views, pings, passivation) never has a thread of its own. Starting one costs
about 0.35 ms and a stack; a thousand live sessions would otherwise hold a thousand.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import operator
import queue as queue_module
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, NoReturn, cast

import msgspec
import pykka
import structlog
from aalis_agent.actors import logs
from aalis_agent.actors.history_cache import HistoryCache
from aalis_agent.actors.host import SessionHost
from aalis_agent.actors.messages import (
    AppendEvents,
    CallEnded,
    Clear,
    Delete,
    GetView,
    InputOutcome,
    InsertionPoint,
    Passivate,
    Ping,
    Release,
    SetSetting,
    Settled,
    Stop,
    StopCommand,
    Submit,
)
from aalis_agent.actors.scheduler import (
    OpenContext,
    Step,
    Where,
    archive_joined,
    archived_input_message,
    decide_call_ended,
    decide_insertion,
    decide_recover,
    decide_release,
    decide_settled,
    decide_stop,
    decide_submit,
    live_input,
    turn_left_history,
)
from aalis_agent.actors.turn import TurnRunner, deliver
from aalis_agent.actors.turn_base import FirstCall
from aalis_agent.events import (
    Batch,
    ChatMessage,
    Clock,
    ConcurrencyConflict,
    ContextCleared,
    EventStore,
    IdSource,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    InvalidBatch,
    InvalidInput,
    MessageMeta,
    MessageSaved,
    ModelCallStarted,
    RuntimeClosed,
    SessionDeleted,
    SessionEvent,
    SessionFailed,
    SettingsChanged,
    StopRequested,
    StoreError,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
)
from aalis_agent.projections import SessionView, project, queue, turns
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.inputs import Handled, InputIds, digest, same_input, sent_digest
from aalis_agent.projections.turns import TurnLog, turn_participants
from aalis_agent.request.tokens import default_counter
from aalis_agent.services import AbortSignal, OutboundMessage, Services
from aalis_agent.services.logging_setup import dropped
from aalis_agent.services.models import entry_id
from aalis_agent.services.settings import venue_of

__all__ = ["SessionActor"]

_LOG = "aalis.agent"
log = structlog.get_logger(_LOG)

_TOLD = (AppendEvents, CallEnded, Settled, Delete, Clear)
"""Messages sent with ``tell``: a failure handling one must not stop the actor."""
_UNTIMED = (Passivate, Ping, GetView)
"""Messages that are not a session's activity (its idle time goes on)."""


_ELSEWHERE = ", here or at its other owner (which may have done so already)"


def _begun(kind: str, where: str = _ELSEWHERE) -> str:
    """What a caller of a deletion (``kind`` "delete") or clear cut short after it began
    is told: the log holds its beginning, and the session's next start (``where``)
    finishes it."""
    what = "deletion" if kind == "delete" else "clear"
    return (
        f"its {what} was begun in its log (the turn stopped, its inputs released) and is "
        f"finished by the session's next start{where}"
    )


def _is_reply(event: SessionEvent) -> bool:
    """The event that saves a turn's reply (it carries the turn's record, SAVE5)."""
    return (
        isinstance(event, MessageSaved)
        and event.message.role == "assistant"
        and event.message.meta.turn_record is not None
    )


class _Direct:
    """What a turn runner holds of its actor: its asks and tells are handled on the
    runner's own thread (:meth:`SessionActor.call`)."""

    __slots__ = ("_actor", "ask")

    def __init__(self, actor: SessionActor) -> None:
        self._actor = actor
        # An ask is the actor's call itself (three or more a turn: no call in between).
        self.ask: Callable[[Any], Any] = actor.call

    def tell(self, message: Any) -> None:
        self._actor.call(message)


class _Mailbox(queue_module.Queue[Any]):
    """A session's inbox: the first message put in it starts the mailbox thread."""

    def __init__(self) -> None:
        super().__init__()
        self.on_first_put: Callable[[], None] | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        start = self.on_first_put
        if start is not None:
            start()


@dataclasses.dataclass(frozen=True, slots=True)
class _HeldSetting:
    """A setting change that arrived while a deletion winds down: written once the
    deletion is, so the deletion does not wipe it; ``done`` answers its caller then."""

    message: SetSetting
    done: Future[None]
    handed_on: None = None  # as a held-back Submit's, for the answers in _fail_waiting


def _comparable(inp: Input) -> Input:
    """What must match for an input to be the same one sent again: all of it but the
    time it was stamped with and the gateway's delivery number."""
    return msgspec.structs.replace(inp, timestamp=None, gateway_seq=None)


def _same_input(handled: Handled, msg: Submit) -> bool:
    """Whether ``msg``'s input is the one received under its id: as its submitter sent it
    (:func:`~aalis_agent.projections.inputs.same_input`), or, where no digest of the
    input as sent was recorded (the hooks left it as it was, or the log was written before
    ``sent_digest``), as the input hooks left it this time, as it was recorded."""
    if same_input(handled, msg.input if msg.sent is None else msg.sent):
        return True
    return handled.sent is None and msg.sent is not None and digest(msg.input) == handled.digest


_WITH_EFFECTS = frozenset(
    {
        InputHeld,
        InputQueued,
        InputJoined,
        InputRequeued,
        InputReleased,
        TurnOpened,
        MessageSaved,
        StopRequested,
        TurnRecorded,
    }
)
"""The event types :meth:`SessionActor._effects` acts on (its ``match`` cases)."""


class _QueueItems:
    """``agent:queue``'s items (SCH7), kept from one change of the queue to the next.

    A change that only places inputs after every one already waiting (the usual one:
    inputs submitted while a turn runs) extends the items by those; any other change
    orders the queue anew (:func:`queue.waiting`), reusing the items of the inputs
    still waiting. Building every item at each change made a flood of submits into a
    busy session with a listener quadratic: ~1 ms a submit with 8,000 waiting (69 us
    without a listener). Each payload gets a list of its own; its item dicts are shared
    with later payloads (a subscriber must not change them, as the bus says)."""

    __slots__ = ("_items", "_last", "_made", "_pending", "_queued")

    def __init__(self) -> None:
        self._queued: Chain[queue.Waiting] | None = None  # what the items were made from
        self._pending: Chain[queue.Waiting] | None = None
        self._items: list[dict[str, Any]] = []
        # id(waiting) -> (waiting, its item): the waiting input is held, so its id stays
        # its own while it is here; inputs no longer waiting are dropped at a reordering.
        self._made: dict[int, tuple[queue.Waiting, dict[str, Any]]] = {}
        self._last = -1  # the highest arrival among the items

    def now(self, state: queue.QueueState) -> list[dict[str, Any]]:
        """The items of ``state``'s waiting inputs in ``queue.waiting``'s order."""
        queued, pending = state.queued, state.pending
        old_q, old_p = self._queued, self._pending
        if (
            old_q is not None
            and old_p is not None
            and queued.extends(old_q)
            and pending.extends(old_p)
        ):
            new = [*queued[len(old_q) :], *pending[len(old_p) :]]
            if self._follow_on(new):
                new.sort(key=_ARRIVAL)
                made, items = self._made, self._items
                for w in new:
                    item = _queue_item(w)
                    made[id(w)] = (w, item)
                    items.append(item)
                if new:
                    self._last = new[-1].arrival
                self._queued, self._pending = queued, pending
                return list(items)
        made, fresh = self._made, {}
        items = []
        for w in queue.waiting(state):
            key = id(w)
            got = made.get(key)
            if got is None or got[0] is not w:
                got = (w, _queue_item(w))
            fresh[key] = got
            items.append(got[1])
        self._made, self._items = fresh, items
        self._last = max((w.arrival for w, _ in fresh.values()), default=-1)
        self._queued, self._pending = queued, pending
        return list(items)

    def _follow_on(self, new: list[queue.Waiting]) -> bool:
        """Whether ``new`` all go after every item there is (none put in front, each
        arrived after the last): ``queue.waiting`` would place them at the end."""
        last = self._last
        return all(not w.front and w.arrival > last for w in new)


_ARRIVAL = operator.attrgetter("arrival")


def _queue_item(w: queue.Waiting) -> dict[str, Any]:
    return {
        "inputId": w.input.id,
        "seq": w.input.gateway_seq,
        "state": "pending" if w.held_for else "queued",
        "source": w.input.source,
    }


class SessionActor(pykka.ThreadingActor):
    """One session: decides, appends, then acts. Built from its log (``view``)."""

    def __init__(
        self,
        *,
        host: SessionHost,
        session_id: str,
        view: SessionView,
        store: EventStore,
        services: Services,
        clock: Clock,
        ids: IdSource,
        input_ids: InputIds | None = None,
    ) -> None:
        super().__init__()
        self.host = host
        self.session_id = session_id
        self.view = view
        self.store = store
        self.services = services
        self.clock = clock
        self.ids = ids
        self._waiters: dict[str, Future[InputOutcome]] = {}
        self._followers: dict[str, list[Future[InputOutcome]]] = {}  # the same input again
        # Every input id that may still be waiting or running here (some no longer are):
        # a submit looks an id up here before it searches the queue (see _on_submit).
        q = view.queue
        running = q.running.joined if q.running is not None else ()
        self._live_ids: set[str] = {
            w.input.id for w in (*q.arrived, *q.queued, *q.pending, *running)
        }
        # The inputs its log received, by id, and how each ended (folded after each
        # commit): a finished one sent again is answered from here (see _on_submit).
        self._input_ids = input_ids if input_ids is not None else InputIds()
        self._turn_inputs: dict[str, list[Input]] = {}
        self._replies: dict[str, str] = {}  # turn id -> the reply text saved (and sent)
        self._queue_items = _QueueItems()  # agent:queue's items, kept between changes
        self._runner: TurnRunner | None = None
        self._start_here: str | None = None  # the input whose submitter runs its turn
        self._held: TurnRunner | None = None  # that turn, not started, until taken
        self._abort: AbortSignal | None = None
        self._call_ended: CallEnded | None = None  # written with the next commit
        self._first_calls: dict[str, FirstCall] = {}  # recorded at open, by turn
        # The history part of this session's requests, extended turn by turn.
        self._history_cache = HistoryCache(default_counter())
        self._winding_down: list[tuple[str, Future[Any], tuple[str, ...]]] = []
        self._deferred: list[Submit | _HeldSetting] = []
        self._handing_on: list[Submit | _HeldSetting] = []  # the held back, being handed on
        self._last_activity = time.monotonic()
        # Turn ids the log has used, kept up as finished turns are added (_new_turn_id).
        self._used_turn_ids: set[str] = set()
        self._used_turn_ids_seen: Chain[TurnLog] | None = None  # the finished turns read
        self._failed: SessionFailed | None = None  # set by _fence: nothing more happens
        self._notice: OutboundMessage | None = None  # sent once its turn's record commits
        self._lock = threading.Lock()  # held while any message is handled (see call)
        self._holder: int | None = None  # the thread handling a message now
        self._ready = threading.Event()  # on_start has run: calls may be handled
        self._recovered = False  # _ready is set (a plain read: calls check it first)
        self._closed = False  # passivated or stopped: calls are refused (ActorDeadError)
        # The mailbox thread: None until a message is put in the mailbox; False once the
        # actor stopped without one (it never starts then).
        self._thread: threading.Thread | bool | None = None
        self._thread_lock = threading.Lock()
        self._stop_pending = False  # stop() while handling a call: stops when it ends
        self._shut_late = False  # shut() gave up waiting: start no turn from now on
        self.fresh = True  # no message handled yet: the one it was started for is coming
        # One item per call waiting for the lock (deque appends and pops are atomic):
        # passivation is refused while anyone waits to use the session.
        self._callers: collections.deque[None] = collections.deque()

    @staticmethod
    def _create_actor_inbox() -> _Mailbox:
        return _Mailbox()

    @classmethod
    def launch(cls, **kwargs: Any) -> SessionActor:
        """Start an actor as ``pykka.Actor.start`` does, and return the actor itself: its
        :meth:`call` is how the runtime and the turn runners reach it without a hop.

        ``on_start`` (recovery) runs here, on the launching thread; the mailbox thread
        starts with the first message put in the mailbox."""
        actor = cls(**kwargs)
        pykka.ActorRegistry.register(actor.actor_ref)
        mailbox = actor.actor_inbox
        assert isinstance(mailbox, _Mailbox)
        mailbox.on_first_put = actor._start_mailbox
        actor._actor_loop_setup()  # on_start; a failure there stops the actor (pykka)
        if actor.actor_stopped.is_set():
            actor._stop_pending = False
            actor._stop_without_thread()
        else:
            actor._stop_if_pending()
        return actor

    @property
    def failure(self) -> SessionFailed | None:
        """The failed write that stopped this actor (see :meth:`_fence`), if one did."""
        return self._failed

    def _start_actor_loop(self) -> None:
        raise TypeError("a SessionActor is started with SessionActor.launch")

    def _start_mailbox(self) -> None:
        """The first message was put in the mailbox: start the thread that handles it."""
        with self._thread_lock:
            if self._thread is not None:
                return  # running already, or stopped without one
            mailbox = self.actor_inbox
            assert isinstance(mailbox, _Mailbox)
            mailbox.on_first_put = None
            thread = threading.Thread(target=self._mailbox_loop, name=f"session {self.session_id}")
            thread.daemon = self.use_daemon_thread
            self._thread = thread
            thread.start()

    def _mailbox_loop(self) -> None:
        self._actor_loop_running()
        self._actor_loop_teardown()

    def stop(self) -> None:
        """Stop the actor once the message being handled is done (as ``pykka.Actor.stop``
        does through the mailbox). Without a mailbox thread, the call handling the
        message stops it as it returns."""
        with self._thread_lock:
            thread = self._thread
        if isinstance(thread, threading.Thread):
            super().stop()
        elif thread is None:
            self._stop_pending = True

    def _stop_if_pending(self) -> None:
        """After a message handled on a caller's thread: a stop it asked for happens now,
        outside the lock (``on_stop`` takes it)."""
        if self._stop_pending:
            self._stop_pending = False
            with self._thread_lock:
                threaded = isinstance(self._thread, threading.Thread)
            if threaded:
                super().stop()
            else:
                self._stop_without_thread()

    def _stop_without_thread(self) -> None:
        """Stop an actor whose mailbox thread never started: no thread starts after this,
        and a message that slipped into the mailbox is answered with ActorDeadError."""
        with self._thread_lock:
            if self._thread is None:
                self._thread = False
                mailbox = self.actor_inbox
                assert isinstance(mailbox, _Mailbox)
                mailbox.on_first_put = None
            elif isinstance(self._thread, threading.Thread):
                super().stop()  # a message started the thread meanwhile: it stops there
                return
        if not self.actor_stopped.is_set():
            self._stop()
        self._actor_loop_teardown()

    def shut(self, timeout: float | None = None) -> None:
        """Stop the actor from outside and wait for it (``ActorRef.stop(block=True)``),
        without starting a mailbox thread for it when it has none."""
        with self._thread_lock:
            threaded = isinstance(self._thread, threading.Thread)
        if threaded:
            try:
                self.actor_ref.stop(block=True, timeout=timeout)
            except pykka.Timeout:
                self._shut_late = True  # its stop is queued behind the message it handles
                raise
            return
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            # Stuck in a message (a store call that waits): it stops as that ends, and a
            # turn that message opened is not started here (the log holds it; the next
            # start of the session recovers it).
            self._shut_late = True
            self._stop_pending = True
            raise pykka.Timeout(f"session {self.session_id}: busy for {timeout} s")
        self._lock.release()
        self._stop_without_thread()

    def refuse_reentry(self, what: str) -> None:
        """Raise, as :meth:`call` does, when the calling thread is in a callback run while
        this session handles a message: ``what`` (a deletion, a clear) would wait for a
        message that can only run after that callback returns."""
        if self._holder == threading.get_ident():
            raise RuntimeError(
                f"session {self.session_id}: a callback run while the session handles a "
                f"message asked for {what} of the same session (it would wait for itself); "
                "hand the call to another thread"
            )

    def call(self, message: Any, timeout: float | None = None) -> Any:
        """Handle ``message`` on the calling thread, under the lock the mailbox thread
        takes for each message: exactly as if it had been asked, without the two thread
        hops an ask costs. Raises ``pykka.ActorDeadError`` once the actor has stopped or
        passivated (the caller starts a fresh one, as after a failed ask), and
        ``pykka.Timeout`` when the actor is not free within ``timeout`` seconds."""
        me = threading.get_ident()
        if self._holder == me:
            if isinstance(message, GetView):
                return self.view  # a read from a callback: the durable view it runs on
            raise RuntimeError(
                f"session {self.session_id}: a callback run while the session handles a "
                "message called into the same session (it would wait for itself); hand "
                "the call to another thread"
            )
        callers = self._callers
        callers.append(None)
        try:
            # Recovered (as a rule): no wait for it, read without its lock first.
            acquired = (self._recovered or self._ready.wait(timeout)) and self._lock.acquire(
                timeout=-1 if timeout is None else timeout
            )
        finally:
            callers.pop()
        if not acquired:
            raise pykka.Timeout(f"session {self.session_id}: busy for {timeout} s")
        try:
            if self._closed or self.actor_stopped.is_set():
                raise pykka.ActorDeadError(f"{self.actor_ref} stopped")
            self._holder = me
            return self._receive(message)
        finally:
            self._holder = None
            self._lock.release()
            if self._stop_pending:
                self._stop_if_pending()

    # --- lifecycle -------------------------------------------------------------------

    def on_start(self) -> None:
        """Recover: a turn opened without a record was cut by a crash, a kill or a failed
        write. When recording that fails too, the actor is fenced (see :meth:`_fence`)
        and every message it gets is answered with the error."""
        try:
            if self.view.seq == 0:
                return  # an empty log: nothing to recover (the first use of a session)
            with self._lock:
                step = self._step()
                decide_recover(
                    step,
                    self._open_context(),
                    stop_marker=lambda _turn: self._marker(None),
                    message_id=self._message_id,
                )
                with contextlib.suppress(SessionFailed):
                    self._commit(step)
        except BaseException:
            self._closed = True  # pykka stops the actor: calls are refused
            raise
        finally:
            self._ready.set()
            self._recovered = True

    def on_stop(self) -> None:
        with self._lock:
            self._closed = True
            if self._abort is not None:
                self._abort.abort("shutdown")
            # Nobody may wait forever on a stopped actor (a turn cut by a shutdown whose
            # wait ran out, an input accepted while it stopped): what it accepted is in
            # its log and runs when the session is next started. A deletion or clear
            # winding down is begun in the log: the next start finishes it, and runs
            # none of the inputs it stopped or released.
            stopped = (
                f"session {self.session_id!r} stopped here (the runtime shut down, or the "
                "session moved to another owner)"
            )
            winding, self._winding_down = self._winding_down, []
            for kind, done, _kinds in winding:
                if not done.done():
                    done.set_exception(
                        RuntimeClosed(f"{stopped} while its turn wound down: {_begun(kind)}")
                    )
            wind = self.view.queue.winding_down  # as the log has it
            if wind is not None:
                what = "deletion" if wind.kind == "delete" else "clear"
                error = RuntimeClosed(
                    f"{stopped} while its {what} wound down: the {what}, begun in its log, "
                    "stopped the turn and released the inputs waiting, so this input does "
                    "not run; the session's next start finishes the "
                    f"{what}{_ELSEWHERE}"
                )
            else:
                error = RuntimeClosed(
                    f"{stopped} before the turn ended; what it accepted is in its log and "
                    "runs when the session is next started"
                )
            self._fail_waiting(error)

    def _fail_waiting(self, error: BaseException) -> None:
        """Answer everyone still waiting on this actor with ``error``."""
        waiters, self._waiters = self._waiters, {}
        followers, self._followers = self._followers, {}
        for future in (*waiters.values(), *itertools.chain(*followers.values())):
            if not future.done():
                future.set_exception(error)
        winding, self._winding_down = self._winding_down, []
        for _kind, done, _kinds in winding:
            if not done.done():
                done.set_exception(error)
        deferred, self._deferred = self._deferred, []
        if deferred:
            held_back = RuntimeClosed(
                f"session {self.session_id!r} stopped before an input (or a setting) held "
                "back during its deletion or clear was handed on: it is not in its log "
                f"(send it again); the session stopped on {type(error).__name__}"
            )
            held_back.__cause__ = error
            for submit in deferred:
                for answer in (submit.done, submit.handed_on):
                    if answer is not None and not answer.done():
                        answer.set_exception(held_back)

    # --- plumbing --------------------------------------------------------------------

    def _step(self) -> Step:
        """A new decision on the durable view. A model call's end reported by the runner
        and not yet written goes first: the next commit carries it (one commit fewer per
        turn), and every decision sees it, as replaying the log will."""
        step = Step(self.view, Batch(self.session_id, self.view.seq, clock=self.clock))
        ended = self._call_ended
        if ended is not None and self._running(ended.turn_id) and not self._winding_down:
            decide_call_ended(
                step,
                ended.turn_id,
                ended.index,
                status=ended.status,
                tool_calls=ended.tool_calls,
                error=ended.error,
            )
        return step

    def _message_id(self) -> str:
        return self.ids.new("msg")

    def _open_context(self) -> OpenContext:
        info = self.services.sessions.info(self.session_id)
        settings = self.services.resolver
        layer = self.view.settings

        def venue_for(inp: Input) -> str | None:
            return venue_of(inp.platform, inp.group_id) or info.venue

        def settings_for(inp: Input) -> Any:
            return settings.for_turn(self.session_id, inp.platform, layer, venue_for(inp))

        return OpenContext(
            settings_for=settings_for,
            new_turn_id=self._new_turn_id,
            multi_party=info.multi_party,
            venue_for=venue_for,
            texts_for=lambda inp: self.services.texts_for(inp.platform, venue_for(inp)),
        )

    def _new_turn_id(self) -> str:
        """A turn id this session's log has not used (id sources may restart)."""
        finished = self.view.turns.finished
        used, seen = self._used_turn_ids, self._used_turn_ids_seen
        # The finished turns only grow: add the new ones, unless the view was rebuilt.
        start = 0
        if seen is not None and finished.extends(seen):
            start = len(seen)
        else:
            used.clear()
        if start < len(finished):
            used.update(t.turn_id for t in finished[start:])
        self._used_turn_ids_seen = finished
        current = self.view.turns.current
        while True:
            turn_id = self.ids.new("turn")
            if turn_id not in used and (current is None or turn_id != current.turn_id):
                return turn_id

    def _known_inputs(self, before: SessionView, events: list[SessionEvent]) -> dict[str, Input]:
        q = before.queue
        joined = q.running.joined if q.running is not None else ()  # put back (recovery)
        known = {w.input.id: w.input for w in (*q.arrived, *q.queued, *q.pending, *joined)}
        for event in events:
            if isinstance(event, InputReceived):
                known[event.input.id] = event.input
        return known

    def _commit(self, step: Step, *, refusable: bool = False) -> None:
        """Append the step's batch atomically, adopt its view, then perform its effects.

        A failed append fences the actor (:meth:`_fence`). Only where ``refusable`` (a
        new input, a setting) is a batch the store refuses as invalid merely refused:
        nothing was written, so the session goes on without that message."""
        events = step.batch.events  # (``step.events``, without the property's call)
        if not events:
            return
        if step.opened is not None:  # most commits open no turn
            self._first_call_at_open(step)
        before = self.view
        try:
            self.store.append(
                self.session_id,
                events,
                step.batch.expected_seq,
                open_work=queue.has_open_work(step.view.queue),
            )
        except InvalidBatch:
            if not refusable:
                self._fence(sys.exc_info()[1])
            raise  # nothing was written and the view is unchanged: refuse this message
        except Exception as exc:
            self._fence(exc)
        self._call_ended = None  # written with this batch, or its turn is over
        self.view = step.view
        self._input_ids.fold(events)
        self._effects(before, events)

    def _first_call_at_open(self, step: Step) -> None:
        """When nothing outside the runtime runs between a turn's open and its first model
        call (no ``agent:turn:before`` or ``agent:llm:before`` middleware, no prompt
        contributions), the commit that opens the turn also archives its inputs (SAVE1)
        and records the first call's start: one commit and one round trip fewer per turn.
        Its runner then makes that call at once (it has no insertion point: nothing can
        be pending yet)."""
        opened = step.opened
        if opened is None:
            return  # most commits open no turn
        if not self.host.hooks.quiet("agent:turn:before", "agent:llm:before"):
            return
        try:
            model = self.services.models.resolve(opened.settings.model).model
            info = self.services.sessions.info(self.session_id)
        except Exception:
            return  # the runner meets it and reports it as it always does
        # The inputs as they joined (the queue's fold took each from where it waited):
        # the turn's own few, however many others wait.
        running = step.view.queue.running
        if running is None or running.turn_id != opened.turn_id:
            return
        known = {w.input.id: w.input for w in running.joined}
        inputs = [
            known[e.input_id]
            for e in step.events
            if isinstance(e, InputJoined) and e.turn_id == opened.turn_id and e.input_id in known
        ]
        if len(inputs) != len(opened.input_ids):
            return
        messages = []
        saves: list[SessionEvent] = []
        for inp in inputs:
            message = archived_input_message(
                inp, opened.turn_id, "opened", self._message_id(), opened.at
            )
            messages.append(message)
            if inp.trigger_type == "idle":
                continue  # an idle prompt is not archived (INS3)
            if self.services.archive is None:
                self.host.archive_missed()
            else:
                saves.append(MessageSaved(message=message))
        step.add_all(saves)  # a turn opened from a long queue: folded together
        started = step.add(
            ModelCallStarted(
                turn_id=opened.turn_id,
                index=1,
                model=entry_id(model),
                purpose="子任务" if info.is_child else "对话",  # ACC1
                format_retry=False,
            )
        )
        self._first_calls[opened.turn_id] = FirstCall(started, model, tuple(messages))

    def _fence(self, exc: BaseException | None) -> NoReturn:
        """Persist, then act: a write failed, so this actor stops here (as Akka
        Persistence does). Its turn is aborted with no further effects, every caller
        waiting on it gets :class:`SessionFailed`, and the runtime forgets it, so the next
        use rebuilds the session from its log, which holds a consistent state: the
        failed batch was written whole or not at all."""
        reason = f"{type(exc).__name__}: {exc}"
        error = SessionFailed(self.session_id, reason)
        self._failed = error
        log.error(
            "session stopped: a write to its log failed", session=self.session_id, error=reason
        )
        if self._abort is not None:
            self._abort.abort("store")
        # Forgotten first: a caller its error wakes (a deletion, a held-back input) finds
        # the next actor, rebuilt from the log, and the generation the log holds.
        self.host.session_failed(self.session_id, self, self._runner)
        # A deletion or clear winding down was begun in the log (its stop and releases
        # written): what failed is a later write, and the next start finishes it.
        winding, self._winding_down = self._winding_down, []
        for kind, done, _kinds in winding:
            if not done.done():
                if isinstance(exc, ConcurrencyConflict):  # a new owner wrote first
                    how = f"another owner wrote to its log first ({reason})"
                    where = _ELSEWHERE
                else:
                    how, where = f"a write to its log failed ({reason})", ""
                cut = SessionFailed(self.session_id, reason)
                cut.args = (
                    f"session {self.session_id!r} stopped: {how} while its turn wound "
                    f"down: {_begun(kind, where)}",
                )
                cut.__cause__ = exc
                done.set_exception(cut)
        self._fail_waiting(error)
        self.stop()
        raise error from exc

    def _effects(self, before: SessionView, events: list[SessionEvent]) -> None:
        received: dict[str, Input] | None = None
        known: dict[str, Input] | None = None

        def lookup(input_id: str) -> Input | None:
            # Built on first use (most commits move no input): the inputs this batch
            # received first, as a rule the one asked for; then those the running turn
            # took (an input joining from the queue); all that wait only if not.
            nonlocal received, known
            if received is None:
                received = {e.input.id: e.input for e in events if type(e) is InputReceived}
                running = self.view.queue.running
                if running is not None:
                    for w in running.joined:
                        received.setdefault(w.input.id, w.input)
            found = received.get(input_id)
            if found is None:
                if known is None:
                    known = self._known_inputs(before, events)
                found = known.get(input_id)
            return found

        opened: TurnOpened | None = None
        queue_changed = False
        sid = self.session_id
        for event in events:
            kind = type(event)
            if kind not in _WITH_EFFECTS:
                continue  # most of a turn's events (usage, tools, calls): nothing to do
            if kind is MessageSaved:  # the commonest: only a turn's reply does something
                m = event.message  # type: ignore[union-attr]
                if m.role == "assistant" and m.meta.turn_record is not None and m.meta.turn_id:
                    self._replies[m.meta.turn_id] = (
                        m.meta.visible_content if m.meta.visible_content is not None else m.content
                    )
                continue
            match event:
                case TurnOpened():
                    opened = event
                case TurnRecorded():
                    self._turn_ended(event)
                case InputHeld() | InputQueued():
                    queue_changed = True
                    if not dropped(_LOG, logging.DEBUG):
                        where = "待插入" if isinstance(event, InputHeld) else "排队"
                        inp = lookup(event.input_id)
                        log.debug(logs.handed_on(where, inp.gateway_seq if inp else None, sid))
                case InputJoined():
                    queue_changed = True
                    inp = lookup(event.input_id)
                    if inp is not None:
                        self._turn_inputs.setdefault(event.turn_id, []).append(inp)
                    if not dropped(_LOG, logging.DEBUG):
                        where = "开轮" if event.entry == "opened" else "插入"
                        seq = inp.gateway_seq if inp else None
                        log.debug(logs.handed_on(where, seq, sid, event.turn_id))
                case InputRequeued():
                    queue_changed = True
                    log.warning(
                        "input put back at the head of the queue: its turn was cut before "
                        "a model call carried it",
                        session=sid,
                        input=event.input_id,
                        turn=event.turn_id,
                        reason=event.reason,
                    )
                case InputReleased():
                    queue_changed = True
                    if not dropped(_LOG, logging.DEBUG):
                        inp = lookup(event.input_id)
                        log.debug(logs.handed_on("放掉", inp.gateway_seq if inp else None, sid))
                    self._resolve(
                        event.input_id, InputOutcome(event.input_id, None, "released", event.reason)
                    )
                case StopRequested():
                    runner, abort = self._runner, self._abort
                    if abort is not None and runner is not None and runner.turn_id == event.turn_id:
                        abort.abort(event.reason, event.by)
                case _:
                    pass
        if queue_changed and self.services.bus.wants("agent:queue"):
            self.services.bus.publish("agent:queue", self._queue_payload())
        if opened is not None:
            self._start_turn(opened)

    def take_held(self) -> TurnRunner | None:
        """The turn a submit asked to run itself (``Submit.here``) and opened, not started:
        the caller must now run or start it."""
        held, self._held = self._held, None
        return held

    def _queue_payload(self) -> dict[str, Any]:
        return {"sessionId": self.session_id, "items": self._queue_items.now(self.view.queue)}

    def _resolve(self, input_id: str, outcome: InputOutcome) -> None:
        self._live_ids.discard(input_id)
        future = self._waiters.pop(input_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)
        for follower in self._followers.pop(input_id, ()):
            if not follower.done():  # its caller may have given up on it (cancelled)
                follower.set_result(outcome)

    def _turn_ended(self, event: TurnRecorded) -> None:
        notice, self._notice = self._notice, None
        if notice is not None and notice.turn_id == event.turn_id:
            try:  # the turn's record is durable: now its reply or error notice goes out
                deliver(self.services, notice)
            except Exception:
                log.exception("sending the turn's message failed", session=self.session_id)
        inputs = self._turn_inputs.pop(event.turn_id, [])
        reply = self._replies.pop(event.turn_id, None)
        for inp in inputs:
            self._resolve(
                inp.id, InputOutcome(inp.id, event.turn_id, event.outcome, event.reason, reply)
            )
        if not dropped(_LOG, logging.INFO):
            log.info(
                logs.turn_ended(
                    event.turn_id,
                    self.session_id,
                    event.outcome,
                    event.reason,
                    event.duration_ms,
                    [i.gateway_seq for i in inputs],
                )
            )
        bus = self.services.bus
        if bus.wants("turn:ended"):
            bus.publish(
                "turn:ended",
                {
                    "sessionId": self.session_id,
                    "turnId": event.turn_id,
                    "outcome": event.outcome,
                    "reason": event.reason,
                    "durationMs": event.duration_ms,
                },
            )

    def _start_turn(self, opened: TurnOpened) -> None:
        if self._shut_late:
            return  # the runtime shut down meanwhile: recovered at the next start
        inputs = list(self._turn_inputs.get(opened.turn_id, []))
        self._abort = abort = AbortSignal()
        self._runner = TurnRunner(
            actor=_Direct(self),
            session_id=self.session_id,
            opened=opened,
            inputs=inputs,
            view=self.view,
            services=self.services,
            hooks=self.host.hooks,
            clock=self.clock,
            ids=self.ids,
            abort=abort,
            on_exit=self.host.runner_exited,
            before_acting=self.host.wait_outliving,
            confirm_owned=self.host.confirm_ownership,
            on_archive_missed=self.host.archive_missed,
            budget_log=self.host.budget_log,
            history_cache=self._history_cache,
            workers=self.host.workers,
            first_call=self._first_calls.pop(opened.turn_id, None),
        )
        self.host.runner_started(self._runner)
        here = self._start_here
        if here is not None and any(inp.id == here for inp in inputs):
            self._held = self._runner  # the submitting thread runs it (Runtime.run)
        bus = self.services.bus
        if bus.wants("turn:opened"):  # no payload built when no one listens
            bus.publish(
                "turn:opened",
                {
                    "sessionId": self.session_id,
                    "turnId": opened.turn_id,
                    "inputIds": list(opened.input_ids),
                    "source": opened.source,
                },
            )
        if self._held is not self._runner:
            self._runner.start()

    # --- who may stop, and how the marker names them ---------------------------------

    def _stop_name(self, platform: str | None, user_id: str | None) -> str | None:
        """How the stop marker names who stopped (SAVE6)."""
        if user_id is None:
            return None
        authority = self.services.authority
        if authority.is_owner(platform, user_id):
            info = self.services.sessions.info(self.session_id)
            own = not info.multi_party and (
                info.peer is None or authority.is_owner(info.origin_platform, info.peer)
            )
            if own:
                return None  # the owner's own session: no name
            room = info.origin_platform
            if room is not None and platform != room:
                return authority.owner_account(room) or user_id
        return user_id

    def _marker(self, by: str | None) -> ChatMessage:
        turn = self.view.queue.running
        opened = turns.last_opened(self.view.turns)
        texts = self.services.texts_for(
            opened.platform if opened else None, opened.venue if opened else None
        )
        return ChatMessage(
            id=self._message_id(),
            role="system",
            kind="turn-stopped",
            content=texts.stop_marker_text(by),
            meta=MessageMeta(turn_id=turn.turn_id if turn else None),
        )

    # --- messages --------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        try:
            with self._lock:
                self._holder = threading.get_ident()
                try:
                    return self._receive(message)
                finally:
                    self._holder = None
        finally:
            cast(_Mailbox, self.actor_inbox).task_done()  # see mailbox_idle

    def mailbox_idle(self) -> bool:
        """No message waits in the mailbox or is in the mailbox thread's hands (taken
        out, waiting for the lock that a call on another thread holds). Passivation is
        refused otherwise: that message would be handled by an actor already replaced."""
        mailbox = self.actor_inbox
        assert isinstance(mailbox, _Mailbox)
        return mailbox.unfinished_tasks == 0

    def _receive(self, message: Any) -> Any:
        self.fresh = False
        kind = type(message)
        # Whether it is told and whether it is activity: looked up for a known type.
        flags = _FLAGS.get(kind)
        if flags is None:  # another type (a subclass): checked as such
            flags = (isinstance(message, _TOLD), not isinstance(message, _UNTIMED))
        told, timed = flags
        if self._failed is not None:
            # Fenced after a failed write: nothing more happens here. Asks get the error;
            # told messages with a future get it there.
            if not told:
                raise self._failed
            done = getattr(message, "done", None)
            if isinstance(done, Future) and not done.done():
                done.set_exception(self._failed)
            return None
        if timed:
            self._last_activity = time.monotonic()
        handler = self._HANDLERS.get(kind)
        if handler is None:
            raise TypeError(f"SessionActor: unknown message {type(message).__name__}")
        if not told:
            return handler(self, message)  # an ask: the caller gets the exception
        try:
            return handler(self, message)
        except Exception as exc:
            if self._failed is None:
                # Nobody waits on a told message: log, rebuild from the log, keep serving.
                log.exception(
                    "session actor failed",
                    session=self.session_id,
                    message=type(message).__name__,
                )
                events = self.store.read(self.session_id)
                self.view = project(events)
                self._input_ids = InputIds.of(events)
            done = getattr(message, "done", None)
            if isinstance(done, Future) and not done.done():
                done.set_exception(exc)
            return None

    def _on_submit(self, msg: Submit) -> str | Future[str] | None:
        if self._winding_down or msg.generation > self.view.queue.generation:
            if msg.retry and not self._known_retry(msg):
                return None  # its submitter runs the input hooks, then submits it as new
            # Handled once the deletion or clear is done (or, for an input of the
            # generation a deletion still on its way here raised, once that deletion is);
            # its submitter waits for that (``handed_on``): nothing is acknowledged
            # before it is in the log. A submit that came without that future (the
            # runtime's: most inputs are never deferred) is answered with it, made now.
            if msg.handed_on is None:
                msg = msgspec.structs.replace(msg, handed_on=Future())
                self._deferred.append(msg)
                return msg.handed_on
            self._deferred.append(msg)
            return "deferred"
        input_id = msg.input.id
        if input_id in self._live_ids:  # perhaps still live: the queue says for sure
            live = live_input(self.view, input_id)
            if live is not None:
                return self._follow(msg, *live)
            self._live_ids.discard(input_id)
        if not msg.assigned:  # an id the runtime gave is new here (Runtime._submit)
            handled = self._input_ids.get(input_id)
            if handled is not None and handled.outcome is not None:
                return self._answer_again(msg, handled)
        if msg.retry:
            return None  # not known here (any more): it goes through the input hooks
        self._waiters[input_id] = msg.done
        self._live_ids.add(input_id)  # before its effects, which may end it at once
        step = self._step()
        self._start_here = msg.input.id if msg.here else None
        try:
            sent = None if msg.sent is None else sent_digest(msg.sent)
            where = decide_submit(step, msg.input, msg.generation, self._open_context(), sent)
            self._commit(step, refusable=True)
        except BaseException:
            self._waiters.pop(msg.input.id, None)
            held, self._held = self._held, None
            if held is not None:  # opened, then failed: its caller will not run it
                held.start_once()
            raise
        finally:
            self._start_here = None
        return where

    def _known_retry(self, msg: Submit) -> bool:
        """Whether a retry (sent without the input hooks) that arrives while a deletion or
        clear winds down is the input received under its id: one this session remembers,
        or one held back itself (its first send came during the wind-down too). It is
        then held back as that input's retry, and answered once the wind-down is done;
        the hooks, which ran for its first send, do not run for it again."""
        input_id = msg.input.id
        handled = self._input_ids.get(input_id)
        if handled is not None:
            return _same_input(handled, msg)
        for earlier in self._deferred:
            if isinstance(earlier, Submit) and earlier.input.id == input_id:
                first = earlier.input if earlier.sent is None else earlier.sent
                return _comparable(first) == _comparable(msg.input)
        return False

    def _follow(self, msg: Submit, earlier: Input, where: Where) -> str | None:
        """An input whose id is taken by one still waiting or running here: the same input
        sent again (a retry, a gateway delivering twice) is not recorded a second time,
        its handle follows the earlier one's outcome; another input under that id is
        refused (each would answer for the other). The same: as its submitter sent it
        (see :func:`~aalis_agent.projections.inputs.same_input`)."""
        inp = msg.input
        handled = self._input_ids.get(inp.id)
        if handled is not None:
            same = _same_input(handled, msg)
        else:  # not remembered (a log folded without it): as the queue holds it
            same = _comparable(inp) == _comparable(earlier) or (
                msg.sent is not None and _comparable(msg.sent) == _comparable(earlier)
            )
        if not same:
            if msg.retry and (handled is None or handled.sent is None):
                return None  # perhaps rewritten, unrecorded: see _answer_again
            raise InvalidInput(
                f"session {self.session_id!r}: input id {inp.id!r} is taken by another "
                "input that is still waiting or running; give this one an id of its own"
            )
        if inp.id in self._waiters:
            self._followers.setdefault(inp.id, []).append(msg.done)
        else:
            self._waiters[inp.id] = msg.done  # accepted by an earlier actor (recovered)
        return where

    def _answer_again(self, msg: Submit, handled: Handled) -> str | None:
        """An input whose id this session received before, and whose turn is over or
        which was released: the same input sent again (a retry after a timeout or a
        cancelled wait) is answered with how it ended, and nothing is written; another
        input under that id is refused, as one under the id of a live input is. The
        same: as its submitter sent it, whatever the input hooks made of it (see
        :func:`~aalis_agent.projections.inputs.same_input`)."""
        inp = msg.input
        if not _same_input(handled, msg):
            if msg.retry and handled.sent is None:
                # Sent without the input hooks, and differing from the input received,
                # of which no digest as sent was recorded (a log written before
                # sent_digest, whose hooks may have rewritten it): it goes through the
                # hooks, as it did then, and is compared as they leave it.
                return None
            raise InvalidInput(
                f"session {self.session_id!r}: input id {inp.id!r} was used by another "
                "input, which was already handled (its turn is over, or it was released); "
                "give this one an id of its own"
            )
        outcome = handled.outcome or ""  # set: only an input that ended comes here
        reply = None if handled.reply_seq is None else self._reply_at(handled.reply_seq)
        msg.done.set_result(InputOutcome(inp.id, handled.turn_id, outcome, handled.reason, reply))
        return Where.HANDLED

    def _reply_at(self, seq: int) -> str:
        """The text of the reply saved at ``seq`` (as a live turn's handle gives it), read
        back from the log: the session keeps the seqs of its handled inputs' replies, not
        their texts. A log that does not read back raises, as a load of it would. Read
        alone where the store can (``read_range``): the rest of the log after it is not
        read (an early input of a long log sent again read all of it, 150,000 events)."""
        read_range = getattr(self.store, "read_range", None)
        if read_range is not None:
            events = read_range(self.session_id, seq - 1, seq)
        else:
            events = self.store.read(self.session_id, seq - 1)
        saved = events[0] if events else None
        if not isinstance(saved, MessageSaved) or saved.seq != seq:
            raise StoreError(
                f"session {self.session_id!r}: the reply saved at seq {seq} is not in its "
                f"log (found {type(saved).__name__ if saved else 'nothing'})"
            )
        meta = saved.message.meta
        return meta.visible_content if meta.visible_content is not None else saved.message.content

    def knows_input(self, input_id: str) -> bool:
        """Whether this session has received an input under ``input_id`` (one it still
        remembers, or one live). Read without the actor's lock: ids are added by commits
        of inputs that came with ids of their own, or given earlier by the same id source."""
        if input_id in self._input_ids or input_id in self._live_ids:
            return True
        # Or one held back while a deletion or clear winds down (not received yet: its
        # hooks ran, it is handed on once the wind-down is done).
        for held in (self._deferred, self._handing_on):
            if held and any(isinstance(s, Submit) and s.input.id == input_id for s in list(held)):
                return True
        return False

    def _on_insertion(
        self, msg: InsertionPoint
    ) -> tuple[list[Input], list[ChatMessage], bool] | None:
        """One round of a turn's insertion point (FLOW8): its runner's facts, the pending
        inputs joining and their archive in one commit; when none joins, the model call's
        start instead, unless a stop came first (then the call never starts). Answers the
        joined inputs, their archived messages and whether the start was recorded; None
        when the turn is not recorded any more (deleted, DEL1)."""
        if not self._running(msg.turn_id) or self._winding_down:
            return None
        step = self._step()
        for event in msg.events:
            step.add(event)
        joined = decide_insertion(step, msg.turn_id)
        archive = self.services.archive is not None
        messages = archive_joined(step, msg.turn_id, joined, self._message_id, save=archive)
        if joined and not archive:
            self.host.archive_missed()
        running = step.view.queue.running
        start = not joined and msg.started is not None
        if start and running is not None and running.stop_requested:
            start = False  # stopped: the call is not made
        if start and msg.started is not None:
            step.add(msg.started)
        self._commit(step)
        return joined, messages, start

    def _running(self, turn_id: str) -> bool:
        running = self.view.queue.running
        return running is not None and running.turn_id == turn_id

    def _on_append(self, msg: AppendEvents) -> bool:
        """Commit a runner's facts; False when they are refused: the turn is not running
        (deleted turns write nothing more, DEL1), or this batch saves the reply or starts
        a tool and a stop came first (a stopped turn saves no reply and sends none, and
        starts no tool once the stop is acknowledged)."""
        running = self.view.queue.running
        if running is None or running.turn_id != msg.turn_id or self._winding_down:
            return False
        refused = (msg.final or msg.starts_tool) and running.stop_requested
        step = self._step()
        for event in msg.events:
            if refused and (_is_reply(event) or type(event) is ToolStarted):
                continue  # not saved; its other facts (the call's end, usage) stay
            step.add(event)
        if msg.settle is not None and not refused:
            # The reply and the turn's end in one commit; the actor sends the reply once
            # it is durable, before the turn's waiters hear of its end.
            if self._runner is not None and self._runner.turn_id == msg.turn_id:
                self._runner = None
                self._abort = None
            self._settle(step, msg.settle)
            return True
        self._commit(step)
        return not refused

    def _on_call_ended(self, msg: CallEnded) -> None:
        """A model call returned: its end is written with the next commit (see
        :meth:`_step`), which the runner's next report (its reply, its record) or any
        decision in between makes. Nothing acts on it before: a turn's runner reports
        once more after any call, and a crash before that finds the call cut."""
        if not self._running(msg.turn_id) or self._winding_down:
            return
        if self._call_ended is not None:
            self._commit(self._step())  # an earlier one not written yet: write it now
        self._call_ended = msg

    def _on_settled(self, msg: Settled) -> None:
        if self._runner is not None and self._runner.turn_id == msg.turn_id:
            self._runner = None
            self._abort = None
        if not self._running(msg.turn_id):
            return
        step = self._step()
        if not self._winding_down:  # the runner's last facts (a deleted turn writes none)
            for event in msg.events:
                step.add(event)
        self._settle(step, msg)

    def _settle(self, step: Step, msg: Settled) -> None:
        """Record the turn's end in ``step`` (its marker after a stop, the next turn
        opened) and commit it."""
        winding = self._winding_down
        running = step.view.queue.running
        marker = None
        if (
            msg.outcome == "aborted"
            and not winding
            and running is not None
            and turn_left_history(step.view, msg.turn_id)
        ):
            by = None  # who stopped it, named by the marker
            if step.view.turns.current is not None:
                stops = [e for e in step.view.turns.current.events if isinstance(e, StopRequested)]
                by = stops[-1].by if stops else None
            marker = self._marker(by)
        self._notice = msg.notice if not winding else None
        decide_settled(
            step,
            msg.turn_id,
            msg.outcome,
            self._open_context(),
            reason=msg.reason,
            duration_ms=msg.duration_ms,
            stop_marker=marker,
            message_id=self._message_id,
            open_next=not winding,
            archive=not winding,
        )
        self._commit(step)
        if winding:
            self._finish_winding_down()

    def _on_stop(self, msg: Stop) -> str | None:
        if msg.turn_id is not None and not self._running(msg.turn_id):
            return None  # that turn is over
        step = self._step()
        turn = decide_stop(step, by=self._stop_name(msg.platform, msg.user_id), reason=msg.reason)
        self._commit(step)
        return turn

    def _on_stop_command(self, msg: StopCommand) -> str | None:
        """``/stop`` (CMD3): the reply to send, or None when the turn was stopped."""
        texts = msg.texts or self.services.texts_for(msg.platform)
        running = self.view.queue.running
        if running is None or not running.stoppable:
            return texts("stop.no_running_turn")
        current = self.view.turns.current
        participants = turn_participants(current) if current is not None else ()
        allowed = self.services.authority.is_owner(msg.platform, msg.user_id) or (
            msg.user_id is not None and (msg.platform, msg.user_id) in participants
        )
        if not allowed:
            return texts("stop.denied")
        self._on_stop(Stop(platform=msg.platform, user_id=msg.user_id))
        return None

    def _on_release(self, msg: Release) -> str | None:
        step = self._step()
        turn = decide_release(
            step,
            msg.reason,
            by=self._stop_name(msg.platform, msg.user_id),
            message_id=self._message_id,
        )
        self._commit(step)
        return turn

    def _wind_down(self, kind: str, done: Future[Any], kinds: tuple[str, ...]) -> None:
        """Stop at once and release unarchived (DEL1); finish once the turn has settled.
        The stop and the releases begin the deletion (the clear) in the log: when a crash
        comes before it is finished, recovery finishes it (``decide_recover``)."""
        step = self._step()
        reason = "delete" if kind == "delete" else "clear"
        decide_release(step, reason, message_id=self._message_id, kinds=kinds)  # type: ignore[arg-type]
        self._commit(step)
        self._winding_down.append((kind, done, kinds))
        # A turn past its reply is not stopped (its reply is durable) but still runs (its
        # agent:turn:after): it is waited for as a stopped one is.
        running = self.view.queue.running
        if running is None:
            self._finish_winding_down()
        elif self._runner is None or self._runner.turn_id != running.turn_id:
            # Running in the log but no runner here: settle it now.
            self._on_settled(Settled(running.turn_id, "aborted", reason))

    def _finish_winding_down(self) -> None:
        pending = self._winding_down
        step = self._step()
        for kind, _done, kinds in pending:
            if kind == "delete":
                step.add(SessionDeleted(generation=step.view.queue.generation + 1))
            else:
                step.add(ContextCleared(kinds=kinds))
        # A failed write fences the actor, and its waiters (these deletions and clears,
        # the inputs held back) are answered with the error: they are still listed.
        self._commit(step)
        self._winding_down = []
        for kind, done, _kinds in pending:
            if not done.done():
                done.set_result(self.view.queue.generation if kind == "delete" else None)
        # Listed as being handed on before taken from _deferred: knows_input, read
        # without the lock, finds them in one or the other at every moment.
        deferred = self._handing_on = self._deferred
        self._deferred = []
        try:
            self._hand_on(deferred)
        finally:
            self._handing_on = []

    def _hand_on(self, deferred: list[Submit | _HeldSetting]) -> None:
        """Hand on the submits and settings held back while a deletion or clear wound
        down, in the order they came."""
        for n, submit in enumerate(deferred):
            if self._failed is not None:  # fenced by an earlier one: nothing more is written
                self._deferred = deferred[n:]
                self._fail_waiting(self._failed)
                break
            if isinstance(submit, _HeldSetting):
                try:
                    self._write_setting(submit.message)
                except Exception as exc:
                    submit.done.set_exception(exc)
                else:
                    submit.done.set_result(None)
                continue
            try:
                where = self._on_submit(submit)
                if where is None:
                    # A retry held back as the input its session knew, which it does not
                    # know as that any more (the input's first send, held back too, was
                    # refused): taken as sent, a new input (its hooks ran for it once).
                    where = self._on_submit(msgspec.structs.replace(submit, retry=False))
                # A held-back submit has its future (see _on_submit): where it went, or
                # "deferred" again.
                assert isinstance(where, str)
                if where == "deferred":
                    continue  # for a later deletion still on its way: held again
            except Exception as exc:
                for future in (submit.done, submit.handed_on):
                    if future is not None and not future.done():
                        future.set_exception(exc)
            else:
                held, self._held = self._held, None
                if held is not None:  # its submitter may not be there to run it: a worker does
                    held.start_once()
                if submit.handed_on is not None and not submit.handed_on.done():
                    submit.handed_on.set_result(where)

    def _on_delete(self, msg: Delete) -> str:
        self._wind_down("delete", msg.done, ())
        return "deleting"

    def _on_clear(self, msg: Clear) -> str:
        if msg.kinds and "context" not in msg.kinds:
            # Clears that do not touch the message history do not stop the session.
            step = self._step()
            step.add(ContextCleared(kinds=msg.kinds))
            self._commit(step)
            msg.done.set_result(None)
            return "cleared"
        self._wind_down("clear", msg.done, msg.kinds)
        return "clearing"

    def _on_set_setting(self, msg: SetSetting) -> Future[None] | None:
        """Write the change; while a deletion winds down, hold it back until the deletion
        is written (which would wipe it) and answer a future resolved once it is durable."""
        if any(kind == "delete" for kind, _done, _kinds in self._winding_down):
            held = _HeldSetting(msg, Future())
            self._deferred.append(held)
            return held.done
        self._write_setting(msg)
        return None

    def _write_setting(self, msg: SetSetting) -> None:
        step = self._step()
        step.add(SettingsChanged(key=msg.key, value=msg.value, reset=msg.reset, by=msg.by))
        self._commit(step, refusable=True)

    def _on_passivate(self, msg: Passivate) -> bool:
        idle = (
            self._runner is None
            and self.view.queue.running is None
            and not self.view.queue.queued
            and not self.view.queue.pending
            and not self._winding_down
            and not self._deferred
            and not self._waiters
            and not self._followers
        )
        quiet = time.monotonic() - self._last_activity
        if not idle or quiet < msg.idle_s or self._callers or (self.fresh and quiet < 1.0):
            # Someone waits to use it, or it was just started and its first message is
            # on its way: a passivation now would make that caller start another.
            return False
        if not self.host.unregister_if_idle(self.session_id, self):
            return False
        self._closed = True  # a call that waited for the lock now goes to a fresh actor
        self.stop()
        return True

    def _on_ping(self, msg: Ping) -> bool:
        return self._runner is None

    def _on_get_view(self, msg: GetView) -> SessionView:
        return self.view

    _HANDLERS: ClassVar[dict[type, Callable[[SessionActor, Any], Any]]] = {
        Submit: _on_submit,
        InsertionPoint: _on_insertion,
        AppendEvents: _on_append,
        CallEnded: _on_call_ended,
        Settled: _on_settled,
        Stop: _on_stop,
        StopCommand: _on_stop_command,
        Release: _on_release,
        Delete: _on_delete,
        Clear: _on_clear,
        SetSetting: _on_set_setting,
        Passivate: _on_passivate,
        Ping: _on_ping,
        GetView: _on_get_view,
    }


_FLAGS: dict[type, tuple[bool, bool]] = {
    kind: (issubclass(kind, _TOLD), not issubclass(kind, _UNTIMED))
    for kind in SessionActor._HANDLERS
}
"""By message type: whether it is told (``_TOLD``), and whether it counts as the
session's activity (not ``_UNTIMED``), as ``isinstance`` says of a message of that
type (one of another type is checked with ``isinstance`` itself)."""
