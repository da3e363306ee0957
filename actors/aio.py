"""``AsyncRuntime``: the runtime for asyncio programs, over the same threaded
:class:`~aalis_agent.actors.runtime.Runtime`.

    async with AsyncRuntime(Runtime(store, services)) as aruntime:
        async with aruntime.events("qq:group:1") as events:
            handle = await aruntime.asubmit("qq:group:1", Input(id="", content="你好"))
            print(handle.where)                    # opened, pending, queued or released
            result = await handle                  # TurnResult: turn_id, outcome, reply
            async for event in events:             # typed events (services/bus_events.py)
                ...

Nothing here blocks the event loop:

- Every blocking runtime call (``submit`` waits for the input's commit, ``delete`` for
  the turn to wind down, ``view`` may fold a log) runs on the AsyncRuntime's own thread
  pool (``threads`` workers, so a bot's calls never queue behind the loop's default
  executor). Waiting for a turn holds no thread: the handle's future is bridged with
  ``asyncio.wrap_future``.
- Bus events are published on runtime threads; each :class:`EventStream` converts them
  there (``typed_event``) and crosses over with ``loop.call_soon_threadsafe`` into its
  own bounded ``asyncio.Queue``.
- A slow consumer never slows the runtime: a stream whose queue is full (``maxsize``
  events not yet read), or whose loop has ``maxsize`` deliveries not yet run, drops the
  newest events until it has room again, and yields an :class:`EventsDropped` saying
  how many it lost where they were lost (after the events it kept from before them).
  Events are never reordered; runtime threads never wait for a consumer.
- The one stall left is the tokenizer: building tiktoken's encoding (~0.1-0.2 s) holds
  the GIL, so any thread doing it pauses the loop too. :meth:`AsyncRuntime.start`
  (``async with`` calls it) loads it once, up front, so no turn pauses the loop; call
  :func:`warm_up` before ``asyncio.run`` to keep even that pause out of the loop.

The reply text of a turn comes from its ``outbound:message`` event (kind ``reply``,
matched by turn id), kept for the last ``reply_memory`` turns. With a gateway configured
the runtime sends replies to the gateway instead of the bus, and ``TurnResult.reply`` is
None.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

from aalis_agent.actors.commands import handle_command
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import Input, InvalidInput, RuntimeClosed
from aalis_agent.projections import SessionView
from aalis_agent.request.tokens import default_counter
from aalis_agent.services.bus_events import TypedEvent, typed_event

__all__ = [
    "AsyncHandle",
    "AsyncRuntime",
    "EventStream",
    "EventsDropped",
    "StreamEvent",
    "TurnResult",
    "warm_up",
]

T = TypeVar("T")


def warm_up() -> None:
    """Load the token counter now (it holds the GIL ~0.1-0.2 s while it loads). Call it
    before the event loop runs, or let :meth:`AsyncRuntime.start` do it on a thread."""
    default_counter()


@dataclass(frozen=True, slots=True)
class EventsDropped:
    """``count`` events were dropped before this one: the consumer fell behind."""

    count: int
    topic: str = "aio:dropped"
    session_id: str | None = None


StreamEvent: TypeAlias = TypedEvent | EventsDropped
"""What an :class:`EventStream` yields."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    """How a submitted input ended: its turn (id, outcome) and the turn's reply text.

    ``turn_id`` is None when the input was released or dropped without a turn;
    ``reply`` is None when the turn did not reply (or a gateway received the reply)."""

    input_id: str
    turn_id: str | None
    outcome: str
    reason: str | None = None
    reply: str | None = None

    @property
    def replied(self) -> bool:
        return self.outcome == "replied"


class AsyncHandle:
    """An accepted input: ``where`` it went, and an awaitable for its :class:`TurnResult`.

    ``await handle`` (or ``await handle.result(timeout)``) waits without holding a thread;
    it may be awaited any number of times."""

    def __init__(self, handle: SubmitHandle, replies: _Replies) -> None:
        self._handle = handle
        self._replies = replies
        self._result: TurnResult | None = None

    @property
    def input_id(self) -> str:
        return self._handle.input_id

    @property
    def where(self) -> str:
        """``opened`` (opened a turn), ``pending`` (joins the running turn at its next
        insertion point), ``queued`` (queued), ``released`` (released), ``dropped``, or
        ``handled`` (the same input sent again after it ended: its result is ready)."""
        return self._handle.where

    @property
    def threaded(self) -> SubmitHandle:
        """The runtime's own handle (a ``concurrent.futures`` future)."""
        return self._handle

    def done(self) -> bool:
        return self._handle.done()

    async def result(self, timeout: float | None = None) -> TurnResult:
        """The turn's result; ``TimeoutError`` after ``timeout`` seconds. A wait that
        times out or is cancelled leaves the input's turn and this handle as they were:
        the handle can be awaited again."""
        if self._result is None:
            # Shielded: cancelling the wait (a timeout) must not cancel the runtime's
            # future, which every later wait on this handle reads.
            waiting = _shielded(self._handle.future)
            outcome = await (asyncio.wait_for(waiting, timeout) if timeout is not None else waiting)
            self._result = self._replies.result(outcome)
        return self._result

    def __await__(self) -> Any:
        return self.result().__await__()

    def __repr__(self) -> str:
        return f"AsyncHandle(input_id={self.input_id!r}, where={self.where!r})"


class _Replies:
    """Reply texts by turn id, from ``outbound:message`` events (bounded: oldest go)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._texts: OrderedDict[str, str] = OrderedDict()

    def on_message(self, topic: str, payload: Any) -> None:
        if not isinstance(payload, dict) or payload.get("kind") != "reply":
            return
        turn_id = payload.get("turnId")
        if not isinstance(turn_id, str):
            return
        with self._lock:
            self._texts[turn_id] = str(payload.get("content", ""))
            self._texts.move_to_end(turn_id)
            while len(self._texts) > self._size:
                self._texts.popitem(last=False)

    def result(self, outcome: InputOutcome) -> TurnResult:
        reply = outcome.reply  # what the turn saved and sent
        if reply is None and outcome.turn_id is not None and outcome.outcome == "replied":
            with self._lock:
                reply = self._texts.get(outcome.turn_id)
        return TurnResult(outcome.input_id, outcome.turn_id, outcome.outcome, outcome.reason, reply)


_CLOSED = object()


class EventStream:
    """Typed bus events for one asyncio consumer: ``async for event in stream``.

    Subscribed from the moment it is made (so nothing published after ``events()``
    returned is missed) until :meth:`aclose` (``async with`` closes it). ``session_id``
    and ``topics`` filter on the publishing thread. See the module docstring for what
    happens when the consumer falls behind."""

    def __init__(
        self,
        runtime: Runtime,
        loop: asyncio.AbstractEventLoop,
        *,
        session_id: str | None,
        topics: Collection[str] | None,
        maxsize: int,
        on_close: Callable[[EventStream], None] | None = None,
    ) -> None:
        if maxsize < 2:
            raise ValueError("an event stream needs maxsize >= 2")
        self._loop = loop
        self._session_id = session_id
        self._topics = None if topics is None else frozenset(topics)
        self._maxsize = maxsize
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self._lock = threading.Lock()
        self._in_flight = 0  # deliveries scheduled on the loop, not yet run
        self._lost_early = 0  # dropped on the publishing thread (the loop lags behind)
        self._dropped = 0  # dropped on the loop, not yet reported
        self._closed = False
        self._on_close = on_close
        self.dropped_total = 0
        """Every event this stream dropped so far."""
        # Only the topics asked for, when given: a payload costly to build (agent:queue
        # lists every waiting input) is built only while someone listens to its topic.
        bus = runtime.services.bus
        if self._topics is None:
            self._unsubscribe = bus.subscribe("*", self._on_bus)
        else:
            removers = [bus.subscribe(topic, self._on_bus) for topic in sorted(self._topics)]

            def unsubscribe() -> None:
                for remove in removers:
                    remove()

            self._unsubscribe = unsubscribe

    # --- the publishing thread ---------------------------------------------------------

    def _on_bus(self, topic: str, payload: Any) -> None:
        if self._topics is not None and topic not in self._topics:
            return
        if self._session_id is not None and (
            not isinstance(payload, dict) or payload.get("sessionId") != self._session_id
        ):
            return
        event = typed_event(topic, payload)
        with self._lock:
            if self._closed:
                return
            if self._in_flight >= self._maxsize:
                self._lost_early += 1  # the loop is not running our deliveries
                return
            self._in_flight += 1
            # Those lost since the last delivery scheduled go with this one: reported
            # before it, where they were lost.
            lost, self._lost_early = self._lost_early, 0
        try:
            self._loop.call_soon_threadsafe(self._deliver, event, lost)
        except RuntimeError:  # the loop is closed: nobody will read this stream
            with self._lock:
                self._in_flight -= 1
                self._closed = True
            self._unsubscribe()

    # --- the loop ----------------------------------------------------------------------

    def _deliver(self, event: Any, lost_before: int = 0) -> None:
        with self._lock:
            self._in_flight -= 1
            # Dropped on the publishing thread after every delivery now scheduled (no
            # later one will carry them): counted after this one, the last.
            lost_after = self._lost_early if self._in_flight == 0 else 0
            self._lost_early -= lost_after
            if self._closed:
                return
        if lost_before:
            self._drop(lost_before)
        queue = self._queue
        if self._dropped:
            # Report the gap first; the event goes in only if both fit.
            if queue.maxsize - queue.qsize() >= 2:
                queue.put_nowait(EventsDropped(self._dropped))
                self._dropped = 0
                queue.put_nowait(event)
            else:
                self._drop(1)
        elif queue.full():
            self._drop(1)
        else:
            queue.put_nowait(event)
        if lost_after:
            self._drop(lost_after)

    def _drop(self, n: int) -> None:
        self._dropped += n
        self.dropped_total += n

    def _gap(self) -> EventsDropped | None:
        """The drops not yet reported, once everything before them was read."""
        if not self._dropped:
            return None
        gap, self._dropped = EventsDropped(self._dropped), 0
        return gap

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._queue.empty():
            gap = self._gap()
            if gap is not None:
                return gap
            if self._closed:
                raise StopAsyncIteration
        item = await self._queue.get()
        if item is _CLOSED:
            gap = self._gap()
            if gap is not None:
                return gap
            raise StopAsyncIteration
        event: StreamEvent = item
        return event

    async def next(self, timeout: float | None = None) -> StreamEvent:
        """The next event (``asyncio.TimeoutError`` after ``timeout`` seconds);
        ``StopAsyncIteration`` once closed."""
        return await asyncio.wait_for(self.__anext__(), timeout)

    def close(self) -> None:
        """Unsubscribe; events already queued are still yielded, then iteration ends.
        Call it on the stream's loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._unsubscribe()
        # Wakes a waiting consumer; when the queue is full nobody waits, and __anext__
        # ends on ``_closed`` once the queue drains.
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSED)
        if self._on_close is not None:
            self._on_close(self)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_IDLE_STEP_S = 0.25
"""The longest an ``await_idle`` holds a thread at a time."""


async def _waited(done: concurrent.futures.Future[T], timeout: float | None) -> T:
    """``done``'s result, awaited on the loop without a thread; a cancelled or timed-out
    wait leaves ``done`` alone (whoever resolves it still can)."""
    return await asyncio.wait_for(_shielded(done), timeout)


def _shielded(done: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """``done`` awaitable on the running loop, shielded: a wait on it that is cancelled
    or times out leaves ``done`` alone. The error ``done`` may get afterwards counts as
    retrieved: nobody awaits the shield's inner future once the wait is gone, and asyncio
    would log it ("Future exception was never retrieved") for every abandoned wait."""
    inner = asyncio.wrap_future(done)
    inner.add_done_callback(_retrieved)
    return asyncio.shield(inner)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class AsyncRuntime:
    """The asyncio face of a :class:`Runtime`: ``await`` its calls, ``async for`` its
    events. Made and used on one event loop; the runtime itself stays usable from
    threads too. ``threads`` bounds the blocking calls in flight at once."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        threads: int = 8,
        reply_memory: int = 4096,
        event_queue_size: int = 1000,
    ) -> None:
        self.runtime = runtime
        self.event_queue_size = event_queue_size
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="aalis-aio")
        self._replies = _Replies(reply_memory)
        self._unsubscribe = runtime.services.bus.subscribe(
            "outbound:message", self._replies.on_message
        )
        self._streams: set[EventStream] = set()
        self._closed = False

    async def _call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise RuntimeClosed("this AsyncRuntime is closed (aclose or ashutdown)")
        loop = asyncio.get_running_loop()
        # In this task's context (as asyncio.to_thread does): a call from a turn's own
        # async tool is then known as one (Runtime.delete refuses to wait for itself).
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._executor, call)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> AsyncRuntime:
        """Load the token counter on a thread, so that no turn does (see the module
        docstring); returns self."""
        await self._call(warm_up)
        return self

    async def __aenter__(self) -> AsyncRuntime:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.ashutdown()

    async def ashutdown(self, timeout: float | None = None) -> None:
        """``Runtime.shutdown`` on a thread (release inputs, wait for running turns,
        stop the actors), then :meth:`aclose`. Not on this object's threads: those may
        all be taken by calls still waiting, and the timeout would not start."""
        try:
            await asyncio.to_thread(self.runtime.shutdown, timeout)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close every event stream and this object's threads; the runtime keeps
        running (see :meth:`ashutdown`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        for stream in list(self._streams):
            stream.close()
        self._executor.shutdown(wait=False)

    # --- inputs ------------------------------------------------------------------------

    async def asubmit(self, session_id: str, inp: Input | str) -> AsyncHandle:
        """``Runtime.submit``: returns once the input is durably accepted; ``await`` the
        handle for its :class:`TurnResult`. A plain string is a console input.

        A cancelled ``asubmit`` may still have been accepted: send the same input (same
        id) again. Its turn runs once; the new handle follows it while it runs, and gives
        its recorded result once it is over (see ``Runtime.submit``)."""
        if isinstance(inp, str):
            inp = Input(id="", content=inp)
        handle = await self._call(self.runtime._submit_unwaited, session_id, inp)
        if handle.accepted is not None:
            # Held back while the session winds down a deletion or clear: acknowledged
            # once it is in the log, waited for here without holding a thread.
            where = await _shielded(handle.accepted)
            handle = SubmitHandle(handle.input_id, where, handle.future)
        return AsyncHandle(handle, self._replies)

    async def acommand(
        self,
        session_id: str,
        text: str,
        *,
        platform: str | None,
        user_id: str | None,
        venue: str | None = None,
    ) -> str | None:
        """A slash command (``/stop``, ``/session``, ...; ``actors/commands.py``): the
        reply, or None (not a command, or ``/stop`` stopped the turn)."""
        return await self._call(
            handle_command,
            self.runtime,
            session_id,
            text,
            platform=platform,
            user_id=user_id,
            venue=venue,
        )

    # --- stopping and deleting ---------------------------------------------------------

    async def astop(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        """Stop the running turn (the stop button); its id, if one ran."""
        return await self._call(self.runtime.stop, session_id, platform=platform, user_id=user_id)

    async def astop_command(
        self,
        session_id: str,
        platform: str | None,
        user_id: str | None,
        venue: str | None = None,
    ) -> str | None:
        """``/stop`` (only participants and the owner): None when stopped, else the reply."""
        return await self._call(self.runtime.stop_command, session_id, platform, user_id, venue)

    async def astop_all(
        self, session_id: str, *, platform: str | None = None, user_id: str | None = None
    ) -> str | None:
        return await self._call(
            self.runtime.stop_all, session_id, platform=platform, user_id=user_id
        )

    async def adelete(self, session_id: str, timeout: float | None = None) -> int:
        """Delete the session (``Runtime.delete``); the new generation. The wait for its
        turn to wind down holds no thread: a cancelled or timed-out wait gives up only
        the wait (the deletion goes on)."""
        done = await self._call(self.runtime._begin_delete, session_id)
        return await _waited(done, timeout)

    async def aclear(
        self, session_id: str, kinds: tuple[str, ...] = (), timeout: float | None = None
    ) -> None:
        """``Runtime.clear``, waited for as :meth:`adelete` waits."""
        done = await self._call(self.runtime._begin_clear, session_id, kinds)
        await _waited(done, timeout)

    # --- observing ---------------------------------------------------------------------

    async def arecover(self, sessions: Iterable[str] | None = None) -> list[str]:
        """``Runtime.recover`` on a thread: after a restart, record each turn a crash cut
        and run the inputs still queued (a session's next use does it too, but a room
        nobody writes to again would keep its queued inputs unanswered). ``sessions``
        limits it to those ids. Returns the sessions it started."""
        return await self._call(self.runtime.recover, sessions)

    async def aview(self, session_id: str) -> SessionView:
        """The session's projected state."""
        return await self._call(self.runtime.view, session_id)

    async def await_idle(self, timeout: float | None = None) -> bool:
        """Wait until no turn runs; False on timeout. Waited in short stretches on a
        thread, so a cancelled wait gives its thread back at once after one."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            step = _IDLE_STEP_S if left is None else min(_IDLE_STEP_S, left)
            if await self._call(self.runtime.wait_idle, step):
                return True
            if left is not None and left <= step:
                return False

    def events(
        self,
        session_id: str | None = None,
        *,
        topics: Collection[str] | None = None,
        maxsize: int | None = None,
    ) -> EventStream:
        """A stream of typed events (all sessions', or ``session_id``'s; all topics, or
        ``topics``), subscribed now. Call it on the loop that will read it."""
        if self._closed:
            raise RuntimeError("the AsyncRuntime is closed")
        if isinstance(topics, str):  # would be read letter by letter: no event, ever
            raise InvalidInput(
                f"topics must be a collection of topic names, like ({topics!r:.80},), not a str"
            )
        stream = EventStream(
            self.runtime,
            asyncio.get_running_loop(),
            session_id=session_id,
            topics=topics,
            maxsize=self.event_queue_size if maxsize is None else maxsize,
            on_close=self._streams.discard,
        )
        self._streams.add(stream)
        return stream
