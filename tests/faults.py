"""Fault injection and effect recording for the "persist, then act" tests.

- :class:`FailingStore` wraps a real store and refuses the Nth ``append`` (or every
  append from the Nth on, a full disk, until :meth:`FailingStore.heal`).
- :class:`Outbox` (a gateway, and a bus subscriber for ``outbound:message``),
  :class:`RecordingTool` and :class:`RecordingModel` record every effect a turn has —
  a message sent, a tool run, a model call — and check, at that very moment, that the
  events recording it are already committed in the store.
- :class:`Timeline` orders appends and effects, so a test can see what happened after a
  failed write; :func:`audit_log` checks a settled log against what was acknowledged,
  sent and executed.
- :func:`mount_tmpfs` and :func:`fill_disk` give a real full disk.

Everything here is thread-safe: turns run on their own threads.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aalis_agent.events import (
    ContextCleared,
    EventStore,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
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
from aalis_agent.events.store import CorruptHandler, Recorded
from aalis_agent.projections import project, queue
from aalis_agent.services import (
    AbortSignal,
    ChatRequest,
    OutboundMessage,
    ScriptedModel,
    ScriptedReply,
    StreamChunk,
    Tool,
    ToolCallContext,
)

from aalis_agent import StoreError

__all__ = [
    "INJECTED",
    "AppendRecord",
    "Delivered",
    "FailingStore",
    "LogFacts",
    "Mark",
    "ModelCall",
    "MountNotPermitted",
    "Outbox",
    "RecordingModel",
    "RecordingTool",
    "RunIds",
    "Timeline",
    "ToolRun",
    "audit_log",
    "fill_disk",
    "mount_tmpfs",
    "tool_then_reply",
    "wait_until",
]

INJECTED = "injected write failure"


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class RunIds:
    """Deterministic ids that differ between runtimes sharing one database:
    ``turn-r1-1``, ``msg-r1-2``, ... (``SequentialIds`` would repeat across runtimes)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def new(self, prefix: str) -> str:
        with self._lock:
            return f"{prefix}-{self.tag}-{next(self._counter)}"


# --- the timeline --------------------------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """One thing that happened, in the global order ``n``."""

    n: int
    kind: str  # append, append-failed, append-error, send, tool, model
    session_id: str
    detail: str = ""


class Timeline:
    """A global, thread-safe order of appends and effects."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: list[Mark] = []

    def mark(self, kind: str, session_id: str, detail: str = "") -> int:
        with self._lock:
            n = len(self._marks) + 1
            self._marks.append(Mark(n, kind, session_id, detail))
            return n

    @property
    def marks(self) -> list[Mark]:
        with self._lock:
            return list(self._marks)

    def first(self, kind: str, session_id: str | None = None) -> Mark | None:
        for m in self.marks:
            if m.kind == kind and (session_id is None or m.session_id == session_id):
                return m
        return None

    def after(self, n: int, kinds: Sequence[str], session_id: str | None = None) -> list[Mark]:
        """Marks of ``kinds`` later than ``n`` (for ``session_id``, when given)."""
        return [
            m
            for m in self.marks
            if m.n > n and m.kind in kinds and (session_id is None or m.session_id == session_id)
        ]


# --- the failing store ---------------------------------------------------------------


@dataclass(frozen=True)
class AppendRecord:
    """One ``append`` call the store counted: its number, what it carried, how it ended."""

    n: int
    session_id: str
    kinds: tuple[str, ...]
    result: str  # ok, injected, error

    def describe(self) -> str:
        return f"#{self.n} {self.session_id} [{', '.join(self.kinds)}] {self.result}"


class FailingStore:
    """An :class:`EventStore` that delegates to ``inner`` and refuses appends on cue.

    ``fail_at`` (counting appends from 1; None: never) is refused with
    ``StoreError(INJECTED)``, nothing written; with ``until_healed`` every append from
    ``fail_at`` on is refused until :meth:`heal` (a full disk). ``session``, when given,
    counts (and fails) only that session's appends. :attr:`appends` counts the calls,
    :attr:`records` says what each carried and how it ended.
    """

    def __init__(
        self,
        inner: EventStore,
        fail_at: int | None = None,
        *,
        until_healed: bool = False,
        session: str | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.until_healed = until_healed
        self.session = session
        self.timeline = timeline
        self._lock = threading.Lock()
        self.appends = 0
        self.records: list[AppendRecord] = []
        self.failed = threading.Event()  # set at the first injected failure
        self.healed = False

    def arm(self, fail_at: int | None, *, until_healed: bool = False) -> None:
        """Fail the ``fail_at``-th append from now on the count (not reset)."""
        with self._lock:
            self.fail_at, self.until_healed, self.healed = fail_at, until_healed, False

    def heal(self) -> None:
        """The disk has room again: appends go through from now on."""
        with self._lock:
            self.healed = True

    @property
    def failures(self) -> list[AppendRecord]:
        with self._lock:
            return [r for r in self.records if r.result == "injected"]

    def _should_fail(self, n: int) -> bool:
        if self.healed or self.fail_at is None:
            return False
        return n == self.fail_at or (self.until_healed and n > self.fail_at)

    def _mark(self, kind: str, session_id: str, detail: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(kind, session_id, detail)

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        kinds = tuple(type(e).__name__ for e in events)
        counted = self.session is None or session_id == self.session
        with self._lock:
            n = 0
            fail = False
            if counted:
                self.appends += 1
                n = self.appends
                fail = self._should_fail(n)
            if fail:
                self.records.append(AppendRecord(n, session_id, kinds, "injected"))
        if fail:
            self._mark("append-failed", session_id, f"#{n} {','.join(kinds)}")
            self.failed.set()
            raise StoreError(INJECTED)
        try:
            seq = self.inner.append(session_id, events, expected_seq, open_work=open_work)
        except Exception:
            if counted:
                with self._lock:
                    self.records.append(AppendRecord(n, session_id, kinds, "error"))
            self._mark("append-error", session_id, f"#{n} {','.join(kinds)}")
            raise
        if counted:
            with self._lock:
                self.records.append(AppendRecord(n, session_id, kinds, "ok"))
        self._mark("append", session_id, f"#{n} {','.join(kinds)}")
        return seq

    # Everything else is the inner store's.

    def open_sessions(self) -> list[str]:
        return self.inner.open_sessions()

    def mark_idle(self, sessions: Sequence[tuple[str, int]]) -> int:
        return self.inner.mark_idle(sessions)

    def read(
        self, session_id: str, after_seq: int = 0, *, on_corrupt: CorruptHandler | None = None
    ) -> list[SessionEvent]:
        return self.inner.read(session_id, after_seq, on_corrupt=on_corrupt)

    def read_all(self, after_position: int = 0, limit: int | None = None) -> list[Recorded]:
        return self.inner.read_all(after_position, limit)

    def last_seq(self, session_id: str) -> int:
        return self.inner.last_seq(session_id)

    def sessions(self) -> list[str]:
        return self.inner.sessions()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # count() and other extras of the inner store
        return getattr(self.inner, name)


# --- what a log holds ------------------------------------------------------------------


@dataclass
class LogFacts:
    """Facts of one session's raw log, indexed for the checks."""

    events: list[SessionEvent]
    received: set[str] = field(default_factory=set)
    received_count: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received_at: dict[str, int] = field(default_factory=dict)  # input: seq of its receipt
    joined: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    released: dict[str, str] = field(default_factory=dict)
    released_archived: dict[str, bool] = field(default_factory=dict)
    releases: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requeued: set[tuple[str, str]] = field(default_factory=set)  # (input, turn)
    stopped: set[str] = field(default_factory=set)  # turns with a StopRequested
    archived_loose: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    archived: dict[str, list[str | None]] = field(default_factory=lambda: defaultdict(list))
    opened: list[str] = field(default_factory=list)
    recorded: dict[str, str] = field(default_factory=dict)
    recorded_reason: dict[str, str | None] = field(default_factory=dict)
    model_calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    calls_started: set[tuple[str, int]] = field(default_factory=set)  # (turn, index)
    calls_ended: set[tuple[str, int]] = field(default_factory=set)
    turn_replies: dict[str, str] = field(default_factory=dict)  # turn: its reply's text
    last_reset: int = 0  # the seq of the last deletion or clear of the context
    joined_at: dict[tuple[str, str], int] = field(default_factory=dict)  # (input, turn): seq
    tool_started: set[tuple[str, str]] = field(default_factory=set)
    tool_finished: set[tuple[str, str]] = field(default_factory=set)
    tool_results: set[str] = field(default_factory=set)  # call ids with a saved result
    replies: set[tuple[str | None, str]] = field(default_factory=set)  # (turn, text)
    texts: set[str] = field(default_factory=set)  # every saved message's text

    @classmethod
    def of(cls, events: Sequence[SessionEvent]) -> LogFacts:
        facts = cls(list(events))
        for e in events:
            match e:
                case InputReceived():
                    facts.received.add(e.input.id)
                    facts.received_count[e.input.id] += 1
                    facts.received_at.setdefault(e.input.id, e.seq)
                case InputJoined():
                    facts.joined[e.input_id].append(e.turn_id)
                    facts.joined_at.setdefault((e.input_id, e.turn_id), e.seq)
                case InputReleased():
                    facts.released[e.input_id] = e.reason
                    facts.released_archived[e.input_id] = e.archived
                    facts.releases[e.input_id] += 1
                case InputRequeued():
                    facts.requeued.add((e.input_id, e.turn_id))
                case StopRequested():
                    facts.stopped.add(e.turn_id)
                case TurnOpened():
                    facts.opened.append(e.turn_id)
                case TurnRecorded():
                    facts.recorded[e.turn_id] = e.outcome
                    facts.recorded_reason[e.turn_id] = e.reason
                case ModelCallStarted():
                    facts.model_calls[e.turn_id].append(e.seq)
                    facts.calls_started.add((e.turn_id, e.index))
                case ModelCallEnded():
                    facts.calls_ended.add((e.turn_id, e.index))
                case SessionDeleted():
                    facts.last_reset = e.seq
                case ContextCleared() if not e.kinds or "context" in e.kinds:
                    facts.last_reset = e.seq
                case ToolStarted():
                    facts.tool_started.add((e.turn_id, e.call_id))
                case ToolFinished():
                    facts.tool_finished.add((e.turn_id, e.call_id))
                case MessageSaved() | StopMarkerSaved():
                    facts._saved(e.message)
                case _:
                    pass
        return facts

    def _saved(self, m: Any) -> None:
        self.texts.add(m.content)
        if m.meta.visible_content is not None:
            self.texts.add(m.meta.visible_content)
        if m.role == "user" and m.meta.input_id is not None:
            self.archived[m.meta.input_id].append(m.meta.turn_id)
            if m.meta.turn_id is None:
                self.archived_loose[m.meta.input_id] += 1
        elif m.role == "tool" and m.tool_call_id is not None:
            self.tool_results.add(m.tool_call_id)
        elif m.role == "assistant" and m.meta.turn_record is not None and m.meta.turn_id:
            # a turn's reply (the last one saved is what its inputs are answered with)
            self.turn_replies[m.meta.turn_id] = (
                m.meta.visible_content if m.meta.visible_content is not None else m.content
            )
            self.replies.add((m.meta.turn_id, m.content))
            if m.meta.visible_content is not None:
                self.replies.add((m.meta.turn_id, m.meta.visible_content))
        elif m.role == "assistant" and not m.tool_calls:
            self.replies.add((m.meta.turn_id, m.content))
            if m.meta.visible_content is not None:
                self.replies.add((m.meta.turn_id, m.meta.visible_content))

    def has_reply(self, turn_id: str | None, text: str) -> bool:
        return (turn_id, text) in self.replies

    def answered(self, input_id: str) -> bool:
        """Archived in a turn the log records as ended, or entered a turn a deletion or
        a clear wound down (DEL1: it writes nothing more, so inputs it had not archived
        yet never are; its record answers them)."""
        if any(t is not None and t in self.recorded for t in self.archived.get(input_id, [])):
            return True
        return any(
            self.recorded_reason.get(t) in ("delete", "clear") for t in self.turns_entered(input_id)
        )

    def turns_entered(self, input_id: str) -> list[str]:
        """The turns the input joined (opening one or inserted), less those a recovery
        put it back from (cut before a model call carried it)."""
        return [t for t in self.joined.get(input_id, []) if (input_id, t) not in self.requeued]

    def answer(self, input_id: str) -> dict[str, Any] | None:
        """How the log says the input ended, as a handle answers it (``outcome``,
        ``reason``, ``turn``, ``reply``); None while it waits or runs (or is unknown)."""
        if input_id in self.released:
            return {
                "outcome": "released",
                "reason": self.released[input_id],
                "turn": None,
                "reply": None,
            }
        entered = self.turns_entered(input_id)
        if not entered or entered[-1] not in self.recorded:
            return None
        turn = entered[-1]
        return {
            "outcome": self.recorded[turn],
            "reason": self.recorded_reason[turn],
            "turn": turn,
            "reply": self.turn_replies.get(turn),
        }

    def turns_run(self, input_id: str) -> int:
        """Turns that ran the input: it was archived in them, or they called the model
        after it joined (a turn cut before either did not run it)."""
        ran = {t for t in self.archived.get(input_id, []) if t is not None}
        for t in self.joined.get(input_id, []):
            at = self.joined_at[(input_id, t)]
            if any(seq > at for seq in self.model_calls.get(t, [])):
                ran.add(t)
        return len(ran)


def audit_log(
    events: Sequence[SessionEvent],
    *,
    acked: Sequence[str] = (),
    delivered: Sequence[Delivered] = (),
    tool_runs: Sequence[ToolRun] = (),
    model_calls: Sequence[ModelCall] = (),
    resends: Sequence[Mapping[str, Any]] = (),
    settled: bool = True,
) -> dict[str, list[str]]:
    """Check one session's log against what was acknowledged, delivered, executed and
    sent to the model. Returns the findings by kind (empty lists when all is well):

    - ``lost``: an acknowledged input neither answered (archived in a recorded turn, or
      in a turn a deletion or clear wound down), released, nor still queued;
    - ``twice``: an input archived twice, or run by two turns;
    - ``missing_history``: an acknowledged input, not released, absent from the history;
    - ``reply_not_logged``: a reply delivered but not saved as an assistant message of
      its turn; an error notice whose turn has no record;
    - ``half_applied``: a turn recorded ``replied`` without a saved reply, a turn opened
      without a record (when ``settled``), a tool run without its ToolStarted, a tool
      result the model saw without its ToolFinished and saved result, an input the model
      saw that was never archived, a running turn left in the log (when ``settled``);
    - ``entered_twice``: an input received twice, or that entered (opened or joined) two
      turns, besides a turn a recovery put it back from before a model call carried it;
    - ``release_archive``: an input released more than once, or released to be archived
      and not archived exactly once (without a turn id), or archived without a turn id
      when it was not released to be;
    - ``call_unended``: a model call started without its end, in a turn never recorded
      (when ``settled``); a tool call started without its finish in a turn recorded
      otherwise than cut by a crash or wound down by a deletion or clear;
    - ``stop_undone``: an input put back in the queue by a recovery from a turn whose
      stop was durable (it would run after the user stopped it);
    - ``wind_down_unfinished`` (when ``settled``): a deletion or clear begun in the log
      (its release or its stop) and never finished (``QueueState.winding_down``): the
      session would be deleted or cleared again at its next start;
    - ``resend_wrong``: an input sent again (``resends``: records ``{"id", "where"}``, with
      ``outcome``, ``reason``, ``turn``, ``reply`` when ``where`` is ``handled`` or
      ``run`` or the record says it ``followed`` a live input to its end; ``error`` when
      refused) refused, or answered otherwise than the log says it ended.
    """
    facts = LogFacts.of(events)
    view = project(events)
    waiting = {w.input.id for w in queue.waiting(view.queue)}
    history_inputs = {m.meta.input_id for m in view.history.messages if m.meta.input_id}
    out: dict[str, list[str]] = {
        "lost": [],
        "twice": [],
        "missing_history": [],
        "reply_not_logged": [],
        "half_applied": [],
        "entered_twice": [],
        "release_archive": [],
        "call_unended": [],
        "stop_undone": [],
        "resend_wrong": [],
        "wind_down_unfinished": [],
    }
    for input_id in acked:
        released = input_id in facts.released
        if not (facts.answered(input_id) or released or input_id in waiting):
            out["lost"].append(
                f"{input_id}: acknowledged, joined {facts.joined.get(input_id, [])}, archived "
                f"{facts.archived.get(input_id, [])}, neither answered, released nor queued"
            )
        before_reset = facts.received_at.get(input_id, 0) < facts.last_reset
        if (
            not released
            and not before_reset  # a deletion or clear emptied the history since
            and input_id not in history_inputs
            and input_id not in waiting
        ):
            out["missing_history"].append(f"{input_id}: not in the history")
    for input_id, turns in facts.archived.items():
        if len(turns) > 1 or facts.turns_run(input_id) > 1:
            out["twice"].append(
                f"{input_id}: archived in {turns}, joined {facts.joined.get(input_id, [])}"
            )
    for input_id, n in facts.received_count.items():
        entered = facts.turns_entered(input_id)
        if n > 1 or len(set(entered)) > 1:
            out["entered_twice"].append(
                f"{input_id}: received {n} times, entered turns {entered} "
                f"(joined {facts.joined.get(input_id, [])})"
            )
    for input_id, n in facts.releases.items():
        loose = facts.archived_loose.get(input_id, 0)
        if n > 1 or loose != (1 if facts.released_archived[input_id] else 0):
            out["release_archive"].append(
                f"{input_id}: released {n} times ({facts.released[input_id]}, archived "
                f"{facts.released_archived[input_id]}), archived without a turn {loose} times"
            )
    for input_id in facts.archived_loose:
        if input_id not in facts.releases:
            out["release_archive"].append(f"{input_id}: archived without a turn, not released")
    if settled:
        for turn_id, index in sorted(facts.calls_started - facts.calls_ended):
            if turn_id not in facts.recorded:
                out["call_unended"].append(f"model call {index} of {turn_id}: no end, no record")
    for turn_id, call_id in sorted(facts.tool_started - facts.tool_finished):
        # Only a turn cut by a crash, or wound down by a deletion or clear (it writes
        # nothing more), may leave a tool call started without its finish.
        if turn_id in facts.recorded and facts.recorded_reason[turn_id] not in _CUT:
            out["call_unended"].append(
                f"tool call {call_id} of {turn_id} (recorded {facts.recorded[turn_id]}/"
                f"{facts.recorded_reason[turn_id]}): started, never finished"
            )
    for input_id, turn_id in sorted(facts.requeued):
        if turn_id in facts.stopped:
            out["stop_undone"].append(f"{input_id}: put back from {turn_id}, which was stopped")
    for r in resends:
        out["resend_wrong"] += _resend_findings(facts, r)
    for d in delivered:
        if d.kind == "reply" and not facts.has_reply(d.turn_id, d.content):
            out["reply_not_logged"].append(f"reply {d.content!r} of {d.turn_id} not in the log")
        elif d.kind != "reply" and d.turn_id not in facts.recorded and d.content not in facts.texts:
            out["reply_not_logged"].append(
                f"{d.kind} notice {d.content!r} of {d.turn_id}: neither saved nor its turn recorded"
            )
    for turn_id, outcome in facts.recorded.items():
        if outcome == "replied" and not any(t == turn_id for t, _ in facts.replies):
            out["half_applied"].append(f"{turn_id} recorded replied without a saved reply")
    if settled:
        for turn_id in facts.opened:
            if turn_id not in facts.recorded:
                out["half_applied"].append(f"{turn_id} opened, never recorded")
        if view.queue.running is not None:
            out["half_applied"].append(f"{view.queue.running.turn_id} still running in the log")
        wind = view.queue.winding_down
        if wind is not None:
            out["wind_down_unfinished"].append(
                f"a {wind.kind} (kinds {list(wind.kinds)}) begun in the log, never finished"
            )
    for run in tool_runs:
        if (run.turn_id, run.call_id) not in facts.tool_started:
            out["half_applied"].append(f"tool {run.call_id} of {run.turn_id} ran, no ToolStarted")
    seen_results = {c for call in model_calls for c in call.tool_results}
    for call_id in seen_results:
        finished = any(c == call_id for _, c in facts.tool_finished)
        if not finished or call_id not in facts.tool_results:
            out["half_applied"].append(
                f"tool result {call_id} reached the model: ToolFinished {finished}, "
                f"result saved {call_id in facts.tool_results}"
            )
    for input_id in {i for call in model_calls for i in call.input_ids}:
        if input_id not in facts.archived:
            out["half_applied"].append(f"input {input_id} reached the model, never archived")
    return out


_CUT = frozenset({"crash", "delete", "clear"})
"""The reasons of turns that may end with a tool call started and not finished."""


def _resend_findings(facts: LogFacts, r: Mapping[str, Any]) -> list[str]:
    """What is wrong with the answer to one input sent again (see :func:`audit_log`)."""
    input_id = r["id"]
    if "error" in r:
        return [f"{input_id} sent again ({r.get('tag')}): refused: {r['error']}"]
    if input_id not in facts.received:
        return [
            f"{input_id} sent again ({r.get('tag')}): answered {r.get('where')}, not in the log"
        ]
    if not (r.get("where") in ("handled", "run") or r.get("followed")):
        return []  # followed a live input (or ran a new one): its end is checked if seen
    answered = {k: r.get(k) for k in ("outcome", "reason", "turn", "reply")}
    logged = facts.answer(input_id)
    if answered != logged:
        how = "followed to its end" if r.get("followed") else f"answered {r.get('where')}"
        return [f"{input_id} sent again ({r.get('tag')}): {how} {answered}, the log says {logged}"]
    return []


def _committed(store: EventStore, session_id: str) -> LogFacts:
    return LogFacts.of(store.read(session_id))


# --- effect recorders ----------------------------------------------------------------


@dataclass(frozen=True)
class Delivered:
    """A message that left the runtime; ``logged_first`` says whether the events that
    record it were committed when it was sent."""

    session_id: str
    turn_id: str | None
    content: str
    kind: str
    logged_first: bool
    mark: int


class Outbox:
    """Records every outbound message: as the gateway (``Services(gateway=outbox)``) or as
    an ``outbound:message`` subscriber (``runtime.subscribe("outbound:message", outbox)``).

    A reply counts as recorded first when its assistant message (same turn, same text)
    was committed; a notice when its turn's record or a message with its text was."""

    def __init__(self, store: EventStore, timeline: Timeline | None = None) -> None:
        self.store = store
        self.timeline = timeline or Timeline()
        self._lock = threading.Lock()
        self._delivered: list[Delivered] = []

    def dispatch_outbound(self, message: OutboundMessage) -> None:
        self._record(message.session_id, message.turn_id, message.content, message.kind)

    def __call__(self, topic: str, payload: Mapping[str, Any]) -> None:
        if topic == "outbound:message":
            self._record(
                payload["sessionId"], payload.get("turnId"), payload["content"], payload["kind"]
            )

    def _record(self, session_id: str, turn_id: str | None, content: str, kind: str) -> None:
        facts = _committed(self.store, session_id)
        if kind == "reply":
            first = facts.has_reply(turn_id, content)
        else:
            first = turn_id in facts.recorded or content in facts.texts
        n = self.timeline.mark("send", session_id, f"{kind} {turn_id}")
        with self._lock:
            self._delivered.append(Delivered(session_id, turn_id, content, kind, first, n))

    @property
    def delivered(self) -> list[Delivered]:
        with self._lock:
            return list(self._delivered)

    def of(self, session_id: str) -> list[Delivered]:
        return [d for d in self.delivered if d.session_id == session_id]


@dataclass(frozen=True)
class ToolRun:
    """One execution of a tool handler; ``logged_first``: its ToolStarted was committed."""

    session_id: str
    turn_id: str
    call_id: str
    logged_first: bool
    mark: int


class RecordingTool:
    """A tool (name ``name``) that records each execution, thread-safe.

    With ``gated``, a run waits until :meth:`release` (or its turn's abort, or
    ``safety_s``); with ``until_abort``, until its turn is stopped (or ``safety_s``). Only
    the next ``blocking`` runs wait (see :meth:`block_next`); later ones return at once.
    :attr:`started` is set when a run begins.
    """

    def __init__(
        self,
        store: EventStore,
        timeline: Timeline | None = None,
        *,
        name: str = "lookup",
        result: str = "查到了",
        gated: bool = False,
        until_abort: bool = False,
        safety_s: float = 3.0,
        blocking: int = 1,
    ) -> None:
        self.store = store
        self.timeline = timeline or Timeline()
        self.name = name
        self.result = result
        self.gated = gated
        self.until_abort = until_abort
        self.safety_s = safety_s
        self.blocking = blocking
        self._lock = threading.Lock()
        self._runs: list[ToolRun] = []
        self._gate = threading.Event()
        self.started = threading.Event()

    def tool(self) -> Tool:
        return Tool(self.name, self, description="looks something up")

    def release(self) -> None:
        """Let the waiting (gated) run go on."""
        self._gate.set()

    def unblock(self) -> None:
        """No run waits any more, from now on; a waiting gated run goes on."""
        with self._lock:
            self.blocking = 0
        self._gate.set()

    def block_next(self, n: int) -> None:
        """The next ``n`` runs wait (gated: until :meth:`release` or :meth:`unblock`)."""
        with self._lock:
            self.blocking = n
            self._gate.clear()

    def __call__(self, args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        facts = _committed(self.store, ctx.session_id)
        first = (ctx.turn_id, ctx.call_id) in facts.tool_started
        n = self.timeline.mark("tool", ctx.session_id, f"{ctx.turn_id} {ctx.call_id}")
        with self._lock:
            self._runs.append(ToolRun(ctx.session_id, ctx.turn_id, ctx.call_id, first, n))
            blocks = self.blocking > 0
            self.blocking -= blocks
        self.started.set()
        if blocks and self.until_abort:
            ctx.abort.wait(self.safety_s)
        elif blocks and self.gated:
            self._wait_gate(ctx.abort)
        return self.result

    def _wait_gate(self, abort: AbortSignal) -> None:
        abort.add_callback(self._gate.set)  # wakes this wait; a later run re-checks
        deadline = time.monotonic() + self.safety_s
        while not self._gate.is_set() and not abort.aborted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._gate.wait(min(remaining, 0.05))

    @property
    def runs(self) -> list[ToolRun]:
        with self._lock:
            return list(self._runs)


@dataclass(frozen=True)
class ModelCall:
    """One model call: the inputs and tool results it carried, and those of them whose
    archive (MessageSaved; for a result also ToolFinished) was not committed yet."""

    session_id: str
    input_ids: tuple[str, ...]
    tool_results: tuple[str, ...]
    unarchived_inputs: tuple[str, ...]
    unsaved_results: tuple[str, ...]
    mark: int


def tool_then_reply(tag: str, tool: str = "lookup") -> Callable[[ChatRequest, int], ScriptedReply]:
    """A script: every turn makes one ``tool`` call, then answers with text.

    Walking back from the end of the request past user and system messages (inputs,
    inputs that joined, instruction blocks, markers): a tool result met before any
    plain assistant reply means the turn has had its tool, so the call answers
    ``答复 {tag}-{n}``; otherwise it asks for the tool (call id ``{tag}-call-{n}``). A
    turn can never loop on the tool: the call after a tool batch always answers."""

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        for m in reversed(request.messages):
            if m.role == "tool":
                return ScriptedReply(text=f"答复 {tag}-{n}")
            if m.role == "assistant" and not m.tool_calls:
                break
        call = ToolCall(id=f"{tag}-call-{n}", name=tool, arguments="{}")
        return ScriptedReply(tool_calls=(call,))

    return reply


class RecordingModel:
    """A chat model answering from a :class:`ScriptedModel` script, recording each call
    and what of it was committed when it was made."""

    def __init__(
        self,
        script: Sequence[ScriptedReply] | Callable[[ChatRequest, int], ScriptedReply],
        store: EventStore,
        timeline: Timeline | None = None,
    ) -> None:
        self._inner = ScriptedModel(script)
        self.store = store
        self.timeline = timeline or Timeline()
        self.id = self._inner.id
        self.provider_id = self._inner.provider_id
        self.context_length = self._inner.context_length
        self.max_output_tokens = self._inner.max_output_tokens
        self._lock = threading.Lock()
        self._calls: list[ModelCall] = []

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        session_id = request.session_id or ""
        inputs = tuple(
            m.meta.input_id for m in request.messages if m.role == "user" and m.meta.input_id
        )
        results = tuple(
            m.tool_call_id for m in request.messages if m.role == "tool" and m.tool_call_id
        )
        facts = _committed(self.store, session_id)
        finished = {c for _, c in facts.tool_finished}
        unarchived = tuple(i for i in inputs if i not in facts.archived)
        unsaved = tuple(c for c in results if c not in facts.tool_results or c not in finished)
        n = self.timeline.mark("model", session_id, ",".join(inputs))
        with self._lock:
            self._calls.append(ModelCall(session_id, inputs, results, unarchived, unsaved, n))
        return self._inner.chat_stream(request, abort)

    @property
    def calls(self) -> list[ModelCall]:
        with self._lock:
            return list(self._calls)


# --- a real full disk ------------------------------------------------------------------


class MountNotPermitted(Exception):
    """``mount -t tmpfs`` was refused here (no privilege, no mount binary)."""


@contextlib.contextmanager
def mount_tmpfs(size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of ``size`` mounted on a temporary directory, unmounted after."""
    where = Path(tempfile.mkdtemp(prefix="aalis-tmpfs-"))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        where.rmdir()
        raise MountNotPermitted(f"cannot run mount: {exc}") from None
    if done.returncode != 0:
        where.rmdir()
        raise MountNotPermitted(
            f"mount -t tmpfs refused (exit {done.returncode}): {done.stderr.strip()}"
        )
    try:
        yield where
    finally:
        gone = subprocess.run(["umount", str(where)], capture_output=True, timeout=10, check=False)
        if gone.returncode != 0:  # still busy: detach it
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)
        with contextlib.suppress(OSError):
            where.rmdir()


def fill_disk(directory: Path, name: str = "filler") -> Path:
    """Write zeros into ``directory/name`` until the file system is full (ENOSPC)."""
    path = directory / name
    chunk = b"\0" * 65536
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        size = 4096
        while size:  # top up the last partial chunk
            try:
                f.write(b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    return path
