"""The scheduler under random interleavings (ES5): a hypothesis state machine.

A real :class:`Runtime` (two sessions, one of them a multi-party room) is driven through
random sequences of human inputs (addressed or not, from a few senders), injections of
every source kind, model answers (replies, silent replies, batches of one or two calls
to a gated tool), tool returns, stop, stop-all, mute, deletion (also one racing an input,
DEL2), ``/clear``, passivation, shutdown and crash-restart. After every step the runtime
is settled (each running turn parked at a model call or in the tool) and the log, the
actor's view, a replay of the log and the parked requests are compared with a shadow
model kept from the rules of the spec (SCH1-SCH6, DEL1-DEL2, SAVE1, SAVE5, SAVE6), never
from the implementation's state.

The shadow names a turn by its ordinal within its session: turn ids come from one id
source shared by every session, and after a crash-restart two sessions recover on their
own threads, so the order ids are handed out in is not the scheduler's to decide.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pykka
import pytest
from aalis_agent.actors.messages import Ping
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import (
    ContextCleared,
    FixedClock,
    HostNotice,
    InMemoryEventStore,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    Sender,
    SequentialIds,
    SessionDeleted,
    SessionEvent,
    StopMarkerSaved,
    StopRequested,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
)
from aalis_agent.projections import project, queue
from aalis_agent.projections.turns import all_turns, turn_info
from aalis_agent.request.texts import (
    BATCH_NO_REPLY_NEEDED,
    BATCH_PREFIX,
    FOCUS_GUIDE_HEAD,
    stop_marker_text,
)
from aalis_agent.services import (
    Services,
    SessionInfo,
    StaticAuthority,
    StaticSessions,
    Tool,
    ToolCallContext,
    ToolRegistry,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.harness import GatedModel

DM = "qq:private:a"  # single-party
ROOM = "qq:group:1"  # multi-party (SessionInfo.multi_party)
SESSIONS = (DM, ROOM)
OWNERS = (("qq", "owner"), ("tg", "owner-tg"))
SENDERS = ("a", "b", "owner")
# (source, trigger_type) of every injection kind (SCH3, INS1-INS3).
INJECTIONS = (
    ("schedule", "interval"),
    ("host-notice", None),
    ("workflow", None),
    ("friend-request", None),
    ("idle", "idle"),
    ("subtask", "proactive"),
)
# Who presses stop / stop-all: nobody named, a participant, the owner, the owner elsewhere.
STOPPERS: tuple[tuple[str, str] | None, ...] = (
    None,
    ("qq", "a"),
    ("qq", "owner"),
    ("tg", "owner-tg"),
)


# --- test doubles ----------------------------------------------------------------------


@dataclass(eq=False)
class _Ticket:
    session_id: str
    released: bool = False


class KeyedTool:
    """A gated tool released per session (oldest call first), unlike ``GatedTool``'s one
    global counter; ``open()`` lets every call, now and later, through."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._tickets: list[_Ticket] = []
        self._open = False
        self.entered = 0

    def __call__(self, args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        with self._cv:
            ticket = _Ticket(ctx.session_id)
            self.entered += 1
            self._tickets.append(ticket)
            self._cv.notify_all()
            while not ticket.released and not self._open:
                self._cv.wait()
            self._tickets.remove(ticket)
            self._cv.notify_all()
        return "done"

    @property
    def running(self) -> int:
        """Calls parked in the tool (what ``settle`` counts)."""
        with self._cv:
            return 0 if self._open else sum(not t.released for t in self._tickets)

    def parked_in(self, session_id: str) -> int:
        with self._cv:
            return sum(not t.released and t.session_id == session_id for t in self._tickets)

    def release(self, session_id: str) -> None:
        with self._cv:
            ticket = next(t for t in self._tickets if not t.released and t.session_id == session_id)
            ticket.released = True
            self._cv.notify_all()

    def release_all(self) -> None:
        with self._cv:
            for t in self._tickets:
                t.released = True
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """Every call goes through while inside (the running ones return at once)."""
        self.open()
        try:
            yield
        finally:
            with self._cv:
                self._open = False


def settle_quietly(
    runtime: Runtime, model: GatedModel, tool: KeyedTool, store: InMemoryEventStore
) -> None:
    """Like ``tests.harness.settle``, but returns only after two consecutive rounds that
    saw the *same* quiet state (same runners, same parked calls, same log lengths).

    ``harness.settle`` counts two quiet rounds in a row even when the state changed
    between them: a turn ends and the next one opens and parks between the rounds, and
    it returns before the actor has handled what the new runner reported before parking
    (its ``ModelCallStarted``), so the log is one event short. Here every runner parked
    at the first round has its earlier reports handled by the second round's pings.
    """
    deadline = time.monotonic() + 10
    previous: tuple[Any, ...] | None = None
    while time.monotonic() < deadline:
        with runtime._lock:
            refs = [e.ref for e in runtime._entries.values()]
        for ref in refs:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.ask(Ping(), timeout=10)
        with runtime._runners_idle:
            runners = frozenset(id(r) for r in runtime._runners)
        parked = (len(model.parked), tool.running)
        snapshot = (
            runners,
            parked,
            len(model.calls),
            tool.entered,
            tuple(store.last_seq(sid) for sid in store.sessions()),
        )
        if len(runners) == sum(parked):
            if snapshot == previous:
                return
            previous = snapshot
        else:
            previous = None
            time.sleep(0.0002)
    raise TimeoutError("the runtime did not settle")


def parked_calls(model: GatedModel, session_id: str) -> list[Any]:
    return [c for c in model.parked if c.request.session_id == session_id]


def answer(
    model: GatedModel, session_id: str, text: str = "", tool_calls: tuple[ToolCall, ...] = ()
) -> None:
    """Answer the one model call parked for this session (``GatedModel.answer`` takes the
    oldest call of any session)."""
    (call,) = parked_calls(model, session_id)
    with model._cv:
        call.text = text
        call.tool_calls = tool_calls
        call.answered = True
        model._cv.notify_all()


def kill(runtime: Runtime, tool: KeyedTool) -> None:
    """Simulate the process dying: the runtime's actors stop without writing anything
    more (a stopped actor's ``on_stop`` only aborts its turn, and whatever its turn thread
    tells it afterwards fails with ``ActorDeadError``); the turn threads parked in the
    model (aborted) or the tool (released here) then end against dead actors."""
    with runtime._lock:
        runtime._closed = True
        refs = [e.ref for e in runtime._entries.values()]
    runtime._janitor_stop.set()
    for ref in refs:
        ref.stop(block=True, timeout=10)
    tool.release_all()
    assert runtime.wait_idle(timeout=10)


def stop_name(multi_party: bool, who: tuple[str, str] | None) -> str | None:
    """How the stop marker names who stopped (SAVE6): none in the owner's own session;
    the owner stopping a room's turn from another platform by his room-platform account."""
    if who is None:
        return None
    platform, user = who
    if who in OWNERS:
        if not multi_party:
            return None
        if platform != "qq":  # the rooms here are on qq, where the owner is "owner"
            return "owner"
    return user


# --- the shadow model ------------------------------------------------------------------

Place = tuple[Any, ...]
# ("queued",) | ("pending", turn_key) | ("turn", turn_key, entry)
# | ("released", reason, archived)


@dataclass(eq=False)
class SInput:
    id: str
    human: bool
    source: str | None
    idle: bool  # an idle prompt: shown to the model, never archived (INS3)
    addressed: bool
    instruction: bool = False  # shown as an instruction block, not a user message (INS)
    sender: str | None = None
    place: Place = ("new",)
    archive_done: bool = False  # released archived: its archive has been written


@dataclass(eq=False)
class STurn:
    key: int  # ordinal within its session
    source: str | None
    opened: list[str]
    from_queue: bool
    prefix: str | None
    joined: list[str] = field(default_factory=list)
    insertions: list[list[SInput]] = field(default_factory=list)  # joined, per insertion
    phase: str = "model"  # "model" | "tool" | "ended"
    calls: int = 1  # model calls started
    calls_ended: int = 0  # ModelCallEnded logged
    tools_left: int = 0  # calls of the current batch not yet returned
    tools_started: int = 0
    tools_finished: int = 0
    groups: int = 0  # tool-call groups saved
    stop: tuple[str, str | None] | None = None  # (reason, by) of the stop request
    # A deletion or clear of a turn stopped already stops it once more (its stop begins
    # the deletion in the log); the first stop still names the turn's end.
    stopped_again: list[tuple[str, str | None]] = field(default_factory=list)
    left_history: bool = False
    winding: bool = False  # deleted or cleared: the turn writes nothing more (DEL1)
    cut_seq: int | None = None  # log seq when the deletion or clear was handled
    outcome: str | None = None
    reason: str | None = None
    marker: str | None = None  # the stop marker's text, when one is due (SAVE6)

    @property
    def human_opened(self) -> bool:
        return self.source is None


@dataclass(eq=False)
class SSession:
    sid: str
    multi_party: bool
    inputs: dict[str, SInput] = field(default_factory=dict)  # in arrival order
    turns: list[STurn] = field(default_factory=list)
    running: STurn | None = None
    generation: int = 0
    active: bool = False  # an actor is up for it in the runtime
    to_archive: list[SInput] = field(default_factory=list)  # released, archived later
    history: list[tuple[str, Any]] = field(default_factory=list)  # ("in", id) / ("marker", key)

    def waiting(self) -> list[SInput]:
        return [i for i in self.inputs.values() if i.place[0] in ("queued", "pending")]

    # SCH4
    def open_turn(self, batch: list[SInput], from_queue: bool) -> STurn:
        prefix = None
        if from_queue and batch[0].human:
            prefix = BATCH_PREFIX
            if self.multi_party and not any(i.addressed for i in batch):
                prefix = f"{BATCH_PREFIX}\n{BATCH_NO_REPLY_NEEDED}"
        turn = STurn(len(self.turns), batch[0].source, [i.id for i in batch], from_queue, prefix)
        for inp in batch:
            inp.place = ("turn", turn.key, "opened")
            if not inp.idle:  # SAVE1: archived when the turn opens
                self.history.append(("in", inp.id))
                turn.left_history = True
        self.turns.append(turn)
        self.running = turn
        return turn

    def open_next(self) -> None:
        waiting = self.waiting()
        if self.running is not None or not waiting:
            return
        head = waiting[0]
        batch = [i for i in waiting if i.human] if head.human else [head]
        self.open_turn(batch, from_queue=True)

    # SCH1-SCH3
    def submit(self, inp: SInput) -> str:
        self.inputs[inp.id] = inp
        running = self.running
        if running is None:
            if self.waiting():
                inp.place = ("queued",)
                self.open_next()
                return "queued"
            self.open_turn([inp], from_queue=False)
            return "opened"
        if (
            inp.human
            and running.human_opened
            and not running.stop
            and not running.winding
            and running.phase != "ended"
        ):
            inp.place = ("pending", running.key)
            return "pending"
        inp.place = ("queued",)
        return "queued"

    def _archive(self, inp: SInput) -> None:
        inp.archive_done = True
        self.history.append(("in", inp.id))

    # SAVE5, SAVE6, SCH4, SCH6
    def end_turn(
        self, outcome: str, reason: str | None, *, name_stopper: bool = True, open_next: bool
    ) -> None:
        turn = self.running
        assert turn is not None
        turn.phase, turn.outcome, turn.reason = "ended", outcome, reason
        if outcome == "aborted" and not turn.winding and turn.left_history:
            by = turn.stop[1] if name_stopper and turn.stop else None
            turn.marker = stop_marker_text(by)
            self.history.append(("marker", turn.key))
        self.running = None
        # Released by stop-all, mute or shutdown: archived after the turn settles, however
        # it ends (a deletion clears the data only after this).
        for inp in self.to_archive:
            self._archive(inp)
        self.to_archive = []
        for inp in self.waiting():
            if inp.place == ("pending", turn.key):
                inp.place = ("queued",)
        if open_next:
            self.open_next()

    def request_stop(self, reason: str, by: str | None) -> STurn | None:
        turn = self.running
        if turn is not None and turn.stop is None:
            turn.stop = (reason, by)
        elif turn is not None and reason in ("delete", "clear"):
            turn.stopped_again.append((reason, by))
        return turn

    def abort_at_model(self) -> None:
        """A stopped turn parked at a model call abandons it and settles at once."""
        turn = self.running
        if turn is not None and turn.stop is not None and turn.phase == "model":
            if not turn.winding:
                turn.calls_ended += 1  # ModelCallEnded(status="aborted")
            self.end_turn("aborted", turn.stop[0], open_next=not turn.winding)

    # SCH6: stop
    def stop(self, by: str | None) -> STurn | None:
        turn = self.request_stop("stop", by)
        self.abort_at_model()
        return turn

    # SCH6, DEL1: stop-all, mute (archived later), delete, clear (never archived)
    def release(self, reason: str, by: str | None) -> STurn | None:
        archived = reason in ("stop-all", "mute", "shutdown")
        turn = self.request_stop(reason, by)
        for inp in self.waiting():
            archived = reason in ("stop-all", "mute", "shutdown") and not inp.idle  # INS3
            inp.place = ("released", reason, archived)
            if archived:
                if turn is None:
                    self._archive(inp)
                else:
                    self.to_archive.append(inp)
        if turn is not None and reason in ("delete", "clear"):
            turn.winding = True
        self.abort_at_model()
        return turn

    def finish_wind_down(self, kind: str) -> None:
        if kind == "delete":
            self.generation += 1
        self.history = []

    # the model answers the parked call
    def answer_final(self, text: str) -> None:
        turn = self.running
        assert turn is not None and turn.phase == "model"
        turn.calls_ended += 1
        for inp in self.waiting():  # SCH2: inputs that missed the final call queue
            if inp.place == ("pending", turn.key):
                inp.place = ("queued",)
        self.end_turn("replied" if text.strip() else "silent", None, open_next=True)

    def answer_tools(self, n: int) -> None:
        turn = self.running
        assert turn is not None and turn.phase == "model"
        turn.calls_ended += 1
        turn.phase, turn.tools_left = "tool", n
        turn.tools_started += 1

    # FLOW8, FLOW13, SCH6
    def tool_returned(self) -> None:
        turn = self.running
        assert turn is not None and turn.phase == "tool"
        turn.tools_left -= 1
        if not turn.winding:
            turn.tools_finished += 1
        if turn.tools_left > 0 and turn.stop is None:
            if not turn.winding:
                turn.tools_started += 1  # the batch's next call runs
            return
        # The batch is over, or stopped: a stopped turn waits for the running call, then
        # starts no further one (SCH6, DEL1). The calls that ran are saved as a group and
        # stay in history, unless the turn was deleted or cleared.
        if not turn.winding:
            turn.groups += 1
            turn.left_history = True
        if turn.stop is not None:
            self.end_turn("aborted", turn.stop[0], open_next=not turn.winding)
            return
        # The insertion point before the next model call: pending inputs join (SCH2).
        joined = [i for i in self.waiting() if i.place == ("pending", turn.key)]
        for inp in joined:
            inp.place = ("turn", turn.key, "joined")
            turn.joined.append(inp.id)
            turn.left_history = True
            self.history.append(("in", inp.id))
        if joined:
            turn.insertions.append(joined)
        turn.calls += 1
        turn.phase = "model"

    def crash(self) -> bool:
        """The process died; returns whether recovery starts this session."""
        unfinished = self.running is not None or bool(self.waiting())
        if self.running is not None:
            self.end_turn("aborted", "crash", name_stopper=False, open_next=True)
        else:
            self.open_next()
        self.active = unfinished
        return unfinished


# --- reading the log -------------------------------------------------------------------


@dataclass
class TurnFacts:
    opened: TurnOpened
    entries: list[tuple[str, str]] = field(default_factory=list)
    calls_started: int = 0
    calls_ended: int = 0
    tools_started: int = 0
    tools_finished: int = 0
    groups: int = 0
    replies: int = 0
    records: int = 0  # turn-record control markers
    stops: list[StopRequested] = field(default_factory=list)
    markers: list[StopMarkerSaved] = field(default_factory=list)
    final_returned: bool = False
    recorded: TurnRecorded | None = None
    last_seq: int = 0  # of the turn's last event before its record


def turn_of(event: SessionEvent) -> str | None:
    if isinstance(event, MessageSaved):
        return event.message.meta.turn_id
    if isinstance(
        event,
        InputJoined
        | ModelCallStarted
        | ModelCallEnded
        | ToolStarted
        | ToolFinished
        | StopRequested
        | StopMarkerSaved
        | TurnRecorded,
    ):
        return event.turn_id
    return None


@dataclass
class LogFacts:
    turns: dict[str, TurnFacts] = field(default_factory=dict)  # in opening order
    places: dict[str, Place] = field(default_factory=dict)  # in arrival order
    inputs: dict[str, Input] = field(default_factory=dict)
    archives: dict[str, list[MessageSaved]] = field(default_factory=dict)


def read_log(log: list[SessionEvent]) -> LogFacts:
    """Fold the log once, asserting the scheduler's log-level invariants on the way."""
    facts = LogFacts()
    places = facts.places
    open_turn: TurnFacts | None = None
    for event in log:
        tid = turn_of(event)
        if tid is not None and not isinstance(event, MessageSaved | TurnRecorded):
            # Every turn event belongs to the one running turn (no writes after a record).
            assert open_turn is not None and tid == open_turn.opened.turn_id, event
        match event:
            case InputReceived(input=inp):
                assert inp.id not in places, f"input {inp.id} received twice"
                places[inp.id] = ("arrived",)
                facts.inputs[inp.id] = inp
            case InputQueued(input_id=iid):
                assert places[iid][0] in ("arrived", "pending"), (iid, places[iid])
                places[iid] = ("queued",)
            case InputHeld(input_id=iid, turn_id=held_for):
                assert places[iid] == ("arrived",), (iid, places[iid])
                assert open_turn is not None and held_for == open_turn.opened.turn_id
                assert facts.inputs[iid].source is None  # only human inputs wait to join
                places[iid] = ("pending", held_for)
            case InputJoined(input_id=iid, entry=entry):
                assert open_turn is not None
                before = places[iid]
                assert before[0] in ("arrived", "queued", "pending"), (iid, before)
                if entry == "joined":
                    # SCH2: only human inputs, only human-opened turns, only while inserts
                    # are open (before the final call returned, before a stop).
                    assert before == ("pending", tid), (iid, before)
                    assert facts.inputs[iid].source is None
                    assert open_turn.opened.source is None
                    assert not open_turn.final_returned, f"{iid} joined after the final call"
                    assert not open_turn.stops, f"{iid} joined a stopped turn"
                    assert open_turn.calls_started >= 1
                else:
                    assert open_turn.calls_started == 0
                open_turn.entries.append((iid, entry))
                places[iid] = ("turn", tid, entry)
            case InputReleased(input_id=iid, reason=reason, archived=archived):
                assert places[iid][0] in ("arrived", "queued", "pending"), (iid, places[iid])
                places[iid] = ("released", reason, archived)
            case TurnOpened():
                assert open_turn is None, "two turns run at once (SCH1)"
                assert event.turn_id not in facts.turns, "turn id reused"
                open_turn = facts.turns[event.turn_id] = TurnFacts(event)
            case ModelCallStarted():
                assert open_turn is not None
                open_turn.calls_started += 1
                assert event.index == open_turn.calls_started
            case ModelCallEnded():
                assert open_turn is not None
                open_turn.calls_ended += 1
                if event.status == "ok" and event.tool_calls == 0:
                    open_turn.final_returned = True
            case ToolStarted():
                assert open_turn is not None
                open_turn.tools_started += 1
            case ToolFinished():
                assert open_turn is not None
                open_turn.tools_finished += 1
            case StopRequested():
                assert open_turn is not None
                open_turn.stops.append(event)
            case StopMarkerSaved():
                assert open_turn is not None
                open_turn.markers.append(event)
            case MessageSaved(message=m):
                if m.meta.input_id is not None:
                    facts.archives.setdefault(m.meta.input_id, []).append(event)
                if tid is not None:
                    assert open_turn is not None and tid == open_turn.opened.turn_id, event
                    if m.role == "assistant" and m.tool_calls:
                        open_turn.groups += 1
                    elif m.role == "assistant" and m.kind is None:
                        open_turn.replies += 1
                    elif m.kind == "turn-record":
                        open_turn.records += 1
            case TurnRecorded():
                assert open_turn is not None and tid == open_turn.opened.turn_id
                open_turn.recorded = event
                open_turn = None
            case _:
                pass
        if open_turn is not None and tid == open_turn.opened.turn_id:
            open_turn.last_seq = event.seq
    for turn in facts.turns.values():
        opened = turn.opened
        assert [i for i, e in turn.entries if e == "opened"] == list(opened.input_ids)
        if opened.source is not None:
            # SCH3: an injection runs as its own turn; nothing joins it.
            assert len(opened.input_ids) == 1 and len(turn.entries) == 1, opened
        if turn.recorded is not None and turn.recorded.outcome == "aborted":
            assert turn.replies == 0, f"aborted turn {opened.turn_id} saved a reply"
    return facts


def describe(log: list[SessionEvent]) -> str:
    """A compact timeline of a log, for assertion messages."""
    lines = []
    for e in log:
        fields = {
            k: getattr(e, k)
            for k in ("input_id", "turn_id", "entry", "index", "status", "tool_calls", "reason")
            if hasattr(e, k)
        }
        if isinstance(e, InputReceived):
            fields["input"] = e.input.id
        if isinstance(e, MessageSaved):
            m = e.message
            fields.update(role=m.role, kind=m.kind, turn=m.meta.turn_id, input=m.meta.input_id)
        lines.append(f"{e.seq:3} {type(e).__name__} {fields}")
    return "\n".join(lines)


# --- the machine -----------------------------------------------------------------------

SIDS = st.sampled_from(SESSIONS)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = InMemoryEventStore()
        self.model = GatedModel()
        self.tool = KeyedTool()
        sessions = StaticSessions({ROOM: SessionInfo(ROOM, origin_platform="qq", multi_party=True)})
        self.services = Services(
            llm=self.model,
            tools=ToolRegistry([Tool("slow", self.tool)]),
            authority=StaticAuthority(OWNERS),
            sessions=sessions,
        )
        self.clock = FixedClock(step_ms=5)
        self.ids = SequentialIds()  # shared across restarts: ids stay unique in the store
        self.runtime = self._new_runtime()
        self.shadow = {sid: SSession(sid, multi_party=sid == ROOM) for sid in SESSIONS}
        self.handles: dict[str, tuple[str, SubmitHandle]] = {}
        self.counter = 0
        self._turn_ids: dict[str, list[str]] = {}

    def _new_runtime(self) -> Runtime:
        return Runtime(self.store, self.services, self.clock, self.ids, janitor=False)

    def teardown(self) -> None:
        self.tool.open()
        try:
            self.runtime.shutdown(timeout=10)
        finally:
            pykka.ActorRegistry.stop_all()

    def settle(self) -> None:
        settle_quietly(self.runtime, self.model, self.tool, self.store)

    def _new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _in_phase(self, phase: str) -> list[str]:
        return [
            sid
            for sid, s in self.shadow.items()
            if s.running is not None and s.running.phase == phase
        ]

    def _submit(self, sid: str, inp: Input) -> None:
        s = self.shadow[sid]
        s.active = True
        where = s.submit(
            SInput(
                inp.id,
                human=inp.source is None,
                source=inp.source,
                idle=inp.trigger_type == "idle",
                addressed=inp.was_addressed,
                instruction=inp.trigger_type in ("idle", "proactive")
                or inp.host_notice is not None,
                sender=inp.sender.user_id,
            )
        )
        handle = self.runtime.submit(sid, inp)
        self.handles[inp.id] = (sid, handle)
        self.settle()
        assert handle.where == where

    def _human(self, sender: str, addressed: bool) -> Input:
        iid = self._new_id("h")
        return Input(
            id=iid,
            content=f"话{iid}",
            sender=Sender(user_id=sender, nickname=f"昵称{sender}"),
            platform="qq",
            # wasAddressed follows the trigger: direct is addressed, interval is not.
            trigger_type="direct" if addressed else "interval",
        )

    # --- inputs ----------------------------------------------------------------------

    @rule(sid=SIDS, sender=st.sampled_from(SENDERS), addressed=st.booleans())
    def human_input(self, sid: str, sender: str, addressed: bool) -> None:
        self._submit(sid, self._human(sender, addressed))

    @rule(sid=SIDS, kind=st.sampled_from(INJECTIONS))
    def injection(self, sid: str, kind: tuple[str, str | None]) -> None:
        source, trigger = kind
        iid = self._new_id("j")
        notice = None
        if source == "host-notice":  # its untrusted part is never archived (INS2)
            notice = HostNotice(kind="reminder", id=iid, untrusted="不可信的片段")
        self._submit(
            sid,
            Input(
                id=iid,
                content=f"注入{iid}",
                source=source,
                trigger_type=trigger,  # type: ignore[arg-type]
                host_notice=notice,
            ),
        )

    # --- the model and the tool ------------------------------------------------------

    @precondition(lambda self: self._in_phase("model"))
    @rule(data=st.data(), text=st.sampled_from(["好的", "", "  "]))
    def model_replies(self, data: st.DataObject, text: str) -> None:
        sid = data.draw(st.sampled_from(self._in_phase("model")), label="sid")
        self.shadow[sid].answer_final(text)
        answer(self.model, sid, text)
        self.settle()

    @precondition(lambda self: self._in_phase("model"))
    @rule(data=st.data(), n=st.integers(min_value=1, max_value=2), text=st.sampled_from(["", "查"]))
    def model_calls_tools(self, data: st.DataObject, n: int, text: str) -> None:
        sid = data.draw(st.sampled_from(self._in_phase("model")), label="sid")
        self.shadow[sid].answer_tools(n)
        calls = tuple(
            ToolCall(id=self._new_id("call-"), name="slow", arguments="{}") for _ in range(n)
        )
        answer(self.model, sid, text, calls)
        self.settle()

    @precondition(lambda self: self._in_phase("tool"))
    @rule(data=st.data())
    def tool_returns(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self._in_phase("tool")), label="sid")
        self.shadow[sid].tool_returned()
        self.tool.release(sid)
        self.settle()

    # --- stopping --------------------------------------------------------------------

    @rule(
        sid=SIDS,
        how=st.sampled_from(["stop", "stop-all", "mute", "delete", "clear", "delete-racing"]),
        who=st.sampled_from(STOPPERS),
        during=st.none() | st.tuples(st.sampled_from(SENDERS), st.booleans()),
    )
    def interrupt(
        self, sid: str, how: str, who: tuple[str, str] | None, during: tuple[str, bool] | None
    ) -> None:
        """One rule for every way a turn is cut short, so that the rules that drive turns
        forward (inputs, answers, tool returns) get most of the steps."""
        if how == "stop":
            self.stop(sid, who)
        elif how in ("stop-all", "mute"):
            self.release_queue(sid, how, who)
        elif how == "delete-racing" and sid not in self._in_phase("tool"):
            self.delete_racing_an_input(sid, during or ("a", True))
        else:
            self.wind_down(sid, how.removesuffix("-racing"), during)

    def stop(self, sid: str, who: tuple[str, str] | None) -> None:
        s = self.shadow[sid]
        s.active = True
        turn = s.stop(stop_name(s.multi_party, who))
        platform, user = who or (None, None)
        got = self.runtime.stop(sid, platform=platform, user_id=user)
        self.settle()
        assert got == (None if turn is None else self._turn_id(sid, turn.key))

    def release_queue(self, sid: str, how: str, who: tuple[str, str] | None) -> None:
        """Stop-all names who pressed it; mute names nobody (SCH6)."""
        s = self.shadow[sid]
        s.active = True
        if how == "mute":
            turn = s.release("mute", None)
            got = self.runtime.mute(sid)
        else:
            turn = s.release("stop-all", stop_name(s.multi_party, who))
            platform, user = who or (None, None)
            got = self.runtime.stop_all(sid, platform=platform, user_id=user)
        self.settle()
        assert got == (None if turn is None else self._turn_id(sid, turn.key))

    # --- deletion and /clear ---------------------------------------------------------

    def wind_down(self, sid: str, kind: str, during: tuple[str, bool] | None) -> None:
        """Delete the session or ``/clear`` its context (DEL1, SCH6). While a tool runs the
        call waits for it: it is made with ``timeout=0`` (the wait times out, the actor
        goes on winding down) and the tool is then released step by step. An input that
        arrives meanwhile is handled once the deletion is done (``during``)."""
        s = self.shadow[sid]
        s.active = True
        turn = s.running
        in_tool = turn is not None and turn.phase == "tool"
        call = self.runtime.delete if kind == "delete" else self.runtime.clear
        s.release(kind, None)
        if not in_tool:
            got = call(sid, timeout=10)
            s.finish_wind_down(kind)
            self.settle()
            if kind == "delete":
                assert got == s.generation
            return
        assert turn is not None
        with pytest.raises(TimeoutError):
            call(sid, timeout=0)
        self.settle()
        turn.cut_seq = self.store.last_seq(sid)
        deferred: list[tuple[Input, threading.Thread, dict[str, SubmitHandle]]] = []
        if during is not None:
            # Held by the session until the wind-down is over: its submit returns only
            # once it is in the log, so it is sent from a thread of its own.
            inp = self._human(*during)
            got: dict[str, SubmitHandle] = {}
            sender = threading.Thread(
                target=lambda: got.setdefault("handle", self.runtime.submit(sid, inp)),
                daemon=True,
            )
            sender.start()
            self._wait_held_back(sid)
            assert sender.is_alive() and inp.id not in self._received(sid)
            deferred.append((inp, sender, got))
            self.settle()
        while s.running is turn:
            # The wind-down waits for the tool, however long it takes (DEL1, DEL2).
            assert not any(isinstance(e, SessionDeleted | ContextCleared) for e in self._tail(sid))
            assert self.tool.parked_in(sid) == 1
            s.tool_returned()
            self.tool.release(sid)
            self.settle()
        s.finish_wind_down(kind)
        for inp, sender, got in deferred:
            where = s.submit(
                SInput(
                    inp.id,
                    human=True,
                    source=None,
                    idle=False,
                    addressed=inp.was_addressed,
                    sender=inp.sender.user_id,
                ),
            )
            sender.join(10)
            assert not sender.is_alive(), "the held input was never handed on"
            self.handles[inp.id] = (sid, got["handle"])
            assert got["handle"].where == where
        self.settle()

    def _wait_held_back(self, sid: str) -> None:
        """Until the session holds back a submit (its wind-down not over yet)."""
        deadline = time.monotonic() + 10
        while not self.runtime._entries[sid].actor._deferred:
            assert time.monotonic() < deadline, "the input never reached its session"
            time.sleep(0.001)

    def _received(self, sid: str) -> list[str]:
        return [e.input.id for e in self.store.read(sid) if isinstance(e, InputReceived)]

    def delete_racing_an_input(self, sid: str, who: tuple[str, bool]) -> None:
        """DEL2: an input arrives (its generation is taken), and before it is handed on
        the session is deleted (from an ``agent:input:before`` middleware, so the order
        is fixed): it belongs to the generation before the deletion and is dropped,
        unarchived. Only while no tool runs, or the deletion would wait for it here."""
        s = self.shadow[sid]
        s.active = True
        inp = self._human(*who)
        deleted: list[int] = []

        def delete_first(ctx: Any, next_: Any) -> Any:
            remove()
            deleted.append(self.runtime.delete(sid, timeout=10))
            return next_()

        remove = self.runtime.hooks.use("agent:input:before", delete_first)
        s.release("delete", None)
        s.finish_wind_down("delete")
        s.inputs[inp.id] = SInput(
            inp.id,
            human=True,
            source=None,
            idle=False,
            addressed=inp.was_addressed,
            place=("released", "stale-generation", False),
        )
        handle = self.runtime.submit(sid, inp)
        self.handles[inp.id] = (sid, handle)
        self.settle()
        assert handle.where == "released"
        assert deleted == [s.generation]

    def _tail(self, sid: str) -> list[SessionEvent]:
        turn = self.shadow[sid].running
        after = turn.cut_seq if turn is not None and turn.cut_seq is not None else 0
        return self.store.read(sid, after)

    # --- passivation and crashes -----------------------------------------------------

    @rule(what=st.sampled_from(["passivate", "clear-vector", "crash", "shutdown"]), sid=SIDS)
    def lifecycle(self, what: str, sid: str) -> None:
        if what == "passivate":
            self.passivate()
        elif what == "crash":
            self.crash_and_restart()
        elif what == "shutdown":
            self.shutdown_and_restart()
        else:
            # ``/clear -t vector`` leaves the history and the running turn alone.
            self.shadow[sid].active = True
            self.runtime.clear(sid, ("vector",), timeout=10)
            self.settle()

    def passivate(self) -> None:
        idle = [
            s
            for s in self.shadow.values()
            if s.active and s.running is None and not s.waiting() and not s.to_archive
        ]
        got = self.runtime.passivate_idle(0)
        for s in idle:
            s.active = False
        self.settle()
        assert got == len(idle)

    def shutdown_and_restart(self) -> None:
        """Shutdown (SCH6): every session's queued and pending inputs are released, and
        archived once its running turn has settled; a turn in a tool stops once that
        call returns. The shutdown runs on a thread; once it has asked the turns in a
        tool to stop and released the inputs waiting behind them, the tool lets its calls
        through (else a turn ending first would open the next one from the queue, which
        the shutdown would then stop: the order the shadow does not take). Then a new
        runtime on the same store finds nothing to recover."""
        in_tool: list[tuple[str, int]] = []
        behind: list[tuple[str, str]] = []  # inputs waiting behind a turn in the tool
        for sid, s in self.shadow.items():
            turn = s.running
            if turn is not None and turn.phase == "tool":
                behind += [(sid, i.id) for i in s.waiting()]
                if turn.stop is None:
                    in_tool.append((sid, turn.key))
            turn = s.release("shutdown", None)  # shutdown names nobody
            if turn is not None and turn.phase == "tool":
                s.tool_returned()
            assert s.running is None
            s.active = False
        errors: list[BaseException] = []

        def shut() -> None:
            try:
                self.runtime.shutdown(timeout=10)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=shut, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        for sid, key in in_tool:
            turn_id = self._turn_id(sid, key)
            while not any(
                isinstance(e, StopRequested) and e.turn_id == turn_id for e in self.store.read(sid)
            ):
                assert time.monotonic() < deadline, "shutdown did not stop the turn"
                time.sleep(0.0005)
        for sid, input_id in behind:
            while not any(
                isinstance(e, InputReleased) and e.input_id == input_id
                for e in self.store.read(sid)
            ):
                assert time.monotonic() < deadline, "shutdown did not release the queue"
                time.sleep(0.0005)
        with self.tool.opened():
            thread.join(15)
        assert not thread.is_alive() and not errors, errors
        assert self.runtime.active_sessions() == []
        self.runtime = self._new_runtime()
        assert self.runtime.recover() == []
        self.settle()

    def crash_and_restart(self) -> None:
        """The process dies (its actors stop without writing; its turn threads are left
        to die against dead actors), and a new runtime recovers from the same store."""
        kill(self.runtime, self.tool)
        self.handles.clear()  # the old process's callers are gone with it
        expected = sorted(sid for sid, s in self.shadow.items() if s.crash())
        self.runtime = self._new_runtime()
        assert sorted(self.runtime.recover()) == expected
        self.settle()

    # --- checking --------------------------------------------------------------------

    def _turn_id(self, sid: str, key: int) -> str:
        opened = [e.turn_id for e in self.store.read(sid) if isinstance(e, TurnOpened)]
        return opened[key]

    @invariant()
    def runtime_agrees_with_the_shadow(self) -> None:
        assert self.runtime.active_sessions() == sorted(
            sid for sid, s in self.shadow.items() if s.active
        )
        for s in self.shadow.values():
            self._check_session(s)
        self._check_handles()

    def _check_session(self, s: SSession) -> None:
        log = self.store.read(s.sid)
        facts = read_log(log)
        turn_ids = list(facts.turns)
        assert len(turn_ids) == len(s.turns), (turn_ids, len(s.turns))
        self._turn_ids[s.sid] = turn_ids

        def tid(key: int) -> str:
            return turn_ids[key]

        def expected_place(place: Place) -> Place:
            if place[0] in ("pending", "turn"):
                return (place[0], tid(place[1]), *place[2:])
            return place

        # Every accepted input is in exactly one place, the one the shadow says, and the
        # log keeps arrival order.
        assert list(facts.places) == list(s.inputs), "inputs or their arrival order differ"
        for iid, inp in s.inputs.items():
            assert facts.places[iid] == expected_place(inp.place), (iid, facts.places[iid])
            archives = facts.archives.get(iid, [])
            match inp.place:
                case ("turn", key, entry):
                    want = [] if inp.idle else [(tid(key), entry, facts.inputs[iid].content)]
                    assert [
                        (a.message.meta.turn_id, a.message.meta.entry, a.message.content)
                        for a in archives
                    ] == want, iid
                case ("released", reason, archived):
                    if reason in ("delete", "clear", "stale-generation"):
                        assert not archives, f"{iid} released by {reason} was archived"
                    else:
                        assert archived or inp.idle  # an idle prompt is never archived
                        assert len(archives) == (1 if inp.archive_done else 0), iid
                        assert all(a.message.meta.turn_id is None for a in archives)
                case _:
                    assert not archives, f"{iid} archived before entering a turn"

        # Each turn as the shadow expects it.
        for turn in s.turns:
            got = facts.turns[tid(turn.key)]
            opened = got.opened
            assert list(opened.input_ids) == turn.opened
            assert opened.source == turn.source
            assert opened.from_queue == turn.from_queue
            assert opened.batch_prefix == turn.prefix
            assert opened.settings.multi_party == s.multi_party
            assert [i for i, e in got.entries if e == "joined"] == turn.joined
            assert got.calls_started == turn.calls, f"{turn}\n{describe(log)}"
            assert got.calls_ended == turn.calls_ended
            assert (got.tools_started, got.tools_finished) == (
                turn.tools_started,
                turn.tools_finished,
            )
            assert got.groups == turn.groups
            assert [(e.reason, e.by) for e in got.stops] == (
                [turn.stop, *turn.stopped_again] if turn.stop else []
            )
            assert [m.message.content for m in got.markers] == (
                [turn.marker] if turn.marker else []
            )
            record = got.recorded
            if turn.outcome is None:
                assert record is None
            else:
                assert record is not None
                assert (record.outcome, record.reason) == (turn.outcome, turn.reason)
                assert got.replies == (1 if turn.outcome == "replied" else 0)
                archived = turn.outcome != "replied" and not turn.winding
                assert got.records == (1 if archived else 0)  # SAVE5
            if turn.cut_seq is not None:
                # DEL1: after the deletion or clear was handled the turn wrote nothing but
                # its log record.
                assert record is not None
                assert got.last_seq <= turn.cut_seq, f"{tid(turn.key)} wrote after the cut"

        # The actor's view is the replay of the log (ES2), and its queue is the shadow's.
        view = self.runtime.view(s.sid)
        replay = project(log)
        assert view.seq == replay.seq == len(log)
        assert view.queue == replay.queue
        assert list(view.history.messages) == list(replay.history.messages)
        assert view.history.active_from == replay.history.active_from
        assert dict(view.settings) == dict(replay.settings)
        assert [turn_info(t) for t in all_turns(view.turns)] == [
            turn_info(t) for t in all_turns(replay.turns)
        ]
        q = view.queue
        assert q.generation == s.generation
        assert q.arrived == ()
        waiting = queue.waiting(q)
        assert [w.input.id for w in waiting] == [i.id for i in s.waiting()]  # arrival order
        assert [w.arrival for w in waiting] == sorted(w.arrival for w in waiting)
        assert [w.held_for for w in waiting] == [
            tid(i.place[1]) if i.place[0] == "pending" else None for i in s.waiting()
        ]
        assert [w.input.id for w in q.to_archive] == [i.id for i in s.to_archive]
        running = s.running
        if running is None:
            assert q.running is None
        else:
            assert q.running is not None
            assert q.running.turn_id == tid(running.key)
            assert q.running.stop_requested == (running.stop is not None)
            assert not q.running.final_call_returned

        history = [
            ("marker", m.meta.turn_id) if m.kind == "turn-stopped" else ("in", m.meta.input_id)
            for m in view.history.messages
            if m.kind == "turn-stopped" or (m.role == "user" and m.meta.input_id)
        ]
        assert history == [(k, tid(v) if k == "marker" else v) for k, v in s.history]

        # What is parked where: one model call per turn at a call, one tool per turn in one.
        calls = parked_calls(self.model, s.sid)
        assert len(calls) == (1 if running is not None and running.phase == "model" else 0)
        assert self.tool.parked_in(s.sid) == (
            1 if running is not None and running.phase == "tool" else 0
        )
        if calls:
            assert running is not None
            sent = [
                m.meta.input_id
                for m in calls[0].request.messages
                if m.role == "user" and m.meta.turn_id == tid(running.key)
            ]
            (head,) = [s.inputs[i] for i in running.opened[:1]]
            assert sent == ([] if head.instruction else running.opened + running.joined)
            # SCH2: in a room, a focus-guide block before each insertion that brings
            # addressed inputs, listing every addressed insert so far; none elsewhere.
            got_tail: list[tuple[str, Any]] = []
            for m in calls[0].request.messages:
                if m.role == "system" and m.content.startswith(FOCUS_GUIDE_HEAD):
                    accounts = [line.split(") ", 1)[1] for line in m.content.split("\n")[1:]]
                    got_tail.append(("guide", accounts))
                elif m.meta.entry == "joined" and m.meta.turn_id == tid(running.key):
                    got_tail.append(("in", m.meta.input_id))
            want_tail: list[tuple[str, Any]] = []
            addressed: list[str | None] = []
            for batch in running.insertions:
                now = [i.sender for i in batch if i.addressed]
                if s.multi_party and now:
                    addressed += now
                    want_tail.append(("guide", list(addressed)))
                want_tail += [("in", i.id) for i in batch]
            assert got_tail == want_tail

    def _check_handles(self) -> None:
        for iid, (sid, handle) in self.handles.items():
            s = self.shadow[sid]
            inp = s.inputs.get(iid)
            if inp is None:  # deferred, not yet handled
                assert not handle.done()
                continue
            match inp.place:
                case ("released", reason, _):
                    result = handle.result(0)
                    assert (result.turn_id, result.outcome, result.reason) == (
                        None,
                        "released",
                        reason,
                    )
                case ("turn", key, _) if s.turns[key].outcome is not None:
                    result = handle.result(0)
                    assert result.turn_id == self._turn_ids[sid][key]
                    assert result.outcome == s.turns[key].outcome
                case _:
                    assert not handle.done(), iid


MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_scheduler_machine() -> None:
    """200 examples of up to 50 steps; derandomised in CI (``tests/conftest.py``)."""
    run_state_machine_as_test(SchedulerMachine, settings=MACHINE_SETTINGS)


# --- plain tests ------------------------------------------------------------------------


@dataclass
class Rig:
    runtime: Runtime
    store: InMemoryEventStore
    model: GatedModel
    tool: KeyedTool

    def settle(self) -> None:
        settle_quietly(self.runtime, self.model, self.tool, self.store)

    def of(self, kind: type, sid: str = DM) -> list[Any]:
        return [e for e in self.store.read(sid) if isinstance(e, kind)]


@pytest.fixture
def rig() -> Iterator[Rig]:
    store = InMemoryEventStore()
    model = GatedModel()
    tool = KeyedTool()
    services = Services(
        llm=model,
        tools=ToolRegistry([Tool("slow", tool)]),
        authority=StaticAuthority(OWNERS),
        sessions=StaticSessions({ROOM: SessionInfo(ROOM, origin_platform="qq", multi_party=True)}),
    )
    runtime = Runtime(store, services, FixedClock(step_ms=5), SequentialIds(), janitor=False)
    r = Rig(runtime, store, model, tool)
    yield r
    tool.open()
    r.runtime.shutdown(timeout=10)  # a test may have replaced the runtime
    pykka.ActorRegistry.stop_all()


TWO_CALLS = (
    ToolCall(id="call-1", name="slow", arguments="{}"),
    ToolCall(id="call-2", name="slow", arguments="{}"),
)


def test_stop_during_a_tool_batch_starts_no_further_tool_call(rig: Rig) -> None:  # SCH6
    """A turn stopped while the first call of a two-call batch runs waits for that call,
    then settles: it starts no further call, and the group keeps the call that ran.
    (The machine found the runner starting the second call; fixed in the runner since.)"""
    rig.runtime.submit(DM, Input(id="h1", content="跑两个工具"))
    rig.settle()
    answer(rig.model, DM, tool_calls=TWO_CALLS)
    rig.settle()
    rig.runtime.stop(DM)
    rig.settle()
    rig.tool.release(DM)  # the call that was running when the stop came returns
    rig.settle()
    assert rig.tool.parked_in(DM) == 0, "the stopped turn started another tool call"
    assert [e.call_id for e in rig.of(ToolStarted)] == ["call-1"]
    assert [e.outcome for e in rig.of(TurnRecorded)] == ["aborted"]
    (group,) = [e.message for e in rig.of(MessageSaved) if e.message.tool_calls]
    assert [c.id for c in group.tool_calls] == ["call-1"]
    assert rig.of(StopMarkerSaved)  # the group stayed in history: the next turn is told


def test_delete_during_a_tool_batch_waits_only_for_the_running_call(rig: Rig) -> None:  # DEL1
    """Deleting the session while the first call of a batch runs stops the turn at once:
    the deletion waits for that call only, and the deleted turn writes nothing more."""
    rig.runtime.submit(DM, Input(id="h1", content="跑两个工具"))
    rig.settle()
    answer(rig.model, DM, tool_calls=TWO_CALLS)
    rig.settle()
    with pytest.raises(TimeoutError):
        rig.runtime.delete(DM, timeout=0)  # the wait for the wind-down has no limit
    rig.settle()
    rig.tool.release(DM)
    rig.settle()
    assert rig.tool.parked_in(DM) == 0, "the deleted turn started another tool call"
    assert [e.generation for e in rig.of(SessionDeleted)] == [1]
    assert not rig.of(ToolFinished) and not rig.of(StopMarkerSaved)


def test_crash_while_a_tool_runs_is_recovered_as_an_aborted_turn(rig: Rig) -> None:
    """A crash while a human-opened turn sits in a tool, with an input pending for it and
    an injection queued: recovery records the turn ``aborted`` (reason ``crash``) with a
    stop marker naming nobody (it left its input in history; the half-done tool group is
    not), then opens the next turn from the head of the queue, the injection alone, and
    the pending input waits behind it."""
    rig.runtime.submit(DM, Input(id="h1", content="查一下", sender=Sender(user_id="a")))
    rig.settle()
    answer(rig.model, DM, tool_calls=TWO_CALLS[:1])
    rig.settle()
    rig.runtime.submit(DM, Input(id="j2", content="提醒", source="schedule"))
    rig.runtime.submit(DM, Input(id="h3", content="还有", sender=Sender(user_id="b")))
    rig.settle()
    kill(rig.runtime, rig.tool)
    assert not rig.of(ToolFinished)  # the dead process wrote nothing more
    rig.runtime = Runtime(
        rig.store, rig.runtime.services, FixedClock(), rig.runtime.ids, janitor=False
    )
    assert rig.runtime.recover() == [DM]
    rig.settle()
    first, second = rig.of(TurnOpened)
    (record,) = rig.of(TurnRecorded)
    assert (record.turn_id, record.outcome, record.reason) == (first.turn_id, "aborted", "crash")
    (marker,) = rig.of(StopMarkerSaved)
    assert marker.message.content == stop_marker_text(None)
    assert not [e for e in rig.of(MessageSaved) if e.message.tool_calls]
    assert (second.input_ids, second.source) == (("j2",), "schedule")
    view = rig.runtime.view(DM)
    assert [w.input.id for w in queue.waiting(view.queue)] == ["h3"]
    assert project(rig.store.read(DM)).queue == view.queue


def test_an_input_arriving_during_a_deletion_opens_a_turn_afterwards(rig: Rig) -> None:
    """DEL1-DEL2: while a deletion waits for a tool, a new input is held back (not
    logged, and its submit not answered); once the turn has wound down and the session
    is deleted it is handled in the new generation and opens a turn of its own, with
    none of the old history: its submit returns then."""
    rig.runtime.submit(DM, Input(id="h1", content="查一下"))
    rig.settle()
    answer(rig.model, DM, tool_calls=TWO_CALLS[:1])
    rig.settle()
    with pytest.raises(TimeoutError):
        rig.runtime.delete(DM, timeout=0)
    rig.settle()
    got: dict[str, SubmitHandle] = {}
    sender = threading.Thread(
        target=lambda: got.setdefault(
            "late", rig.runtime.submit(DM, Input(id="h2", content="新的"))
        )
    )
    sender.start()
    sender.join(0.3)
    rig.settle()
    assert sender.is_alive()  # not acknowledged: it is not in the log yet
    assert "h2" not in [e.input.id for e in rig.of(InputReceived)]
    rig.tool.release(DM)
    sender.join(10)
    rig.settle()
    assert got["late"].where == "opened"
    log = rig.store.read(DM)
    deleted = next(e.seq for e in log if isinstance(e, SessionDeleted))
    received = next(e for e in log if isinstance(e, InputReceived) and e.input.id == "h2")
    assert received.seq > deleted and received.generation == 1
    (_, opened) = rig.of(TurnOpened)
    assert opened.input_ids == ("h2",)
    (call,) = parked_calls(rig.model, DM)
    assert [m.meta.input_id for m in call.request.messages if m.role == "user"] == ["h2"]
