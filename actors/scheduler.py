"""The scheduler (SCH1-SCH6, DEL1-DEL2) as pure decisions that add events to a batch.

Each ``decide_*`` takes a :class:`Step` — the session's projected view plus the batch
being built — and adds the events of its decision; the view folds each event as it is
added, so a decision sees its own effects. The actor appends the batch atomically and
then performs the effects the events call for (start a turn, signal a stop, resolve the
callers' handles). Nothing here does I/O, reads a clock or starts a thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, TypeVar

import msgspec
from aalis_agent.events import (
    Batch,
    ChatMessage,
    ContextCleared,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageMeta,
    MessageSaved,
    ModelCallEnded,
    SessionDeleted,
    SessionEvent,
    StopMarkerSaved,
    StopRequested,
    TurnOpened,
    TurnOutcome,
    TurnRecord,
    TurnRecorded,
    TurnSettings,
)
from aalis_agent.events.schema import ReleaseReason, TurnEntry
from aalis_agent.projections import SessionView, evolve, project, queue
from aalis_agent.projections.turns import TurnLog, input_origin
from aalis_agent.request.texts import ZH, Texts
from msgspec.structs import replace

__all__ = [
    "OpenContext",
    "Step",
    "Where",
    "archive_joined",
    "archived_input_message",
    "decide_call_ended",
    "decide_insertion",
    "decide_open_next",
    "decide_recover",
    "decide_release",
    "decide_settled",
    "decide_stop",
    "decide_submit",
    "turn_left_history",
]

E = TypeVar("E", bound=SessionEvent)


class Where(StrEnum):
    """Where an accepted input went (``SubmitHandle.where``, the SCH8 log line). The
    values are stable names; the display text comes from the locale
    (:meth:`~aalis_agent.request.texts.Texts.where`: ``zh`` 开轮, 待插入, 排队, 放掉, 插入)."""

    OPENED = "opened"
    """It opened a turn."""
    PENDING = "pending"
    """It waits to join the running turn at its next insertion point."""
    QUEUED = "queued"
    """It waits for a turn of its own."""
    RELEASED = "released"
    """It was let go without a turn (an input of a generation before a deletion)."""
    JOINED = "joined"
    """It joined the running turn (an insertion point took it; the log line only)."""
    DROPPED = "dropped"
    """An ``agent:input:before`` hook dropped it before the session saw it."""
    HANDLED = "handled"
    """Handled already: the same input (its id and content) sent again after its turn
    ended or it was released. Nothing is written; its handle resolves at once to how
    that earlier one ended."""
    DEFERRED = "deferred"
    """Held while its session could not take it yet (a deletion or clear winding down),
    and not yet in the log. ``Runtime.submit`` waits until it is handed on and returns
    where it went then; only a submit from inside a turn (a tool, its middleware), which
    must not wait, is answered this, its handle's ``accepted`` resolving once the input
    is durable."""

    @classmethod
    def of(cls, word: str) -> Where:
        """The outcome a ``zh`` display word (开轮, 待插入, ...) or a value names."""
        if isinstance(word, Where):
            return word
        found = _WHERE_WORDS.get(word)
        return found if found is not None else cls(word)


_WHERE_WORDS = {ZH.where(w): w for w in Where}


_FOLD_TOGETHER = 16
"""Events :meth:`Step.add_all` folds one by one below this many (a fold of its own
costs more than a few single ones)."""


@dataclass(slots=True)
class Step:
    """A view and the batch of events a decision adds, folded as they are added."""

    view: SessionView
    batch: Batch
    opened: TurnOpened | None = None
    """The first turn this step opened, if any."""

    def add(self, event: E) -> E:
        """Stamp ``event`` into the batch and fold it into the view. Stamped here as
        :meth:`Batch.add` stamps it (its session, the next seq, the time), without that
        call: a tool turn adds 16 events."""
        batch = self.batch
        events = batch.events
        stamped = replace(
            event,
            session_id=batch.session_id,
            seq=batch.expected_seq + len(events) + 1,
            at=batch.now_ms(),
        )
        events.append(stamped)
        self.view = evolve(self.view, stamped)
        return stamped

    def add_all(self, events: list[SessionEvent]) -> list[SessionEvent]:
        """:meth:`add` each of ``events``, for events none of which is decided from the
        view the ones before leave: folded together (``project``), so that a run of
        thousands (the inputs an insertion point takes, and their archive) costs its
        length, where folding each into a view of its own copies the queue each time."""
        if len(events) < _FOLD_TOGETHER:
            return [self.add(e) for e in events]
        stamped = [self.batch.add(e) for e in events]
        self.view = project(stamped, self.view)
        return stamped

    @property
    def events(self) -> list[SessionEvent]:
        return self.batch.events


class OpenContext(msgspec.Struct, frozen=True):
    """What opening a turn needs from outside the log (SCH5), read once at open."""

    settings_for: Callable[[Input], TurnSettings]
    new_turn_id: Callable[[], str]
    multi_party: bool = False
    venue_for: Callable[[Input], str | None] = lambda inp: None
    texts_for: Callable[[Input], Texts] = lambda inp: ZH
    """The texts of the locale the input's turn speaks (the batch prefix); default zh."""


def archived_input_message(
    inp: Input,
    turn_id: str | None,
    entry: str | None,
    message_id: str,
    entered_at: int | None = None,
) -> ChatMessage:
    """The archive's copy of an input (SAVE1): a user message with its provenance.

    Its time (the label the model reads) is ``entered_at``, the moment it entered its
    turn (opened or joined): 「消息的时间标注是进入这一轮的时刻」; an input archived without
    a turn (released) keeps its arrival time. A host notice keeps only the host's body:
    its untrusted part is never archived (INS2).
    """
    return ChatMessage(
        id=message_id,
        role="user",
        content=inp.content,
        meta=MessageMeta(
            turn_id=turn_id,
            entry=entry,  # type: ignore[arg-type]
            input_id=inp.id,
            sender=inp.sender,
            platform=inp.platform,
            timestamp=entered_at if entered_at is not None else inp.timestamp,
        ),
    )


def _open(step: Step, batch: list[Input], ctx: OpenContext, *, from_queue: bool) -> str:
    head = batch[0]
    prefix = None
    if from_queue and head.source is None:
        quiet = ctx.multi_party and not any(i.was_addressed for i in batch)
        prefix = ctx.texts_for(head).batch_prefix(no_reply_needed=quiet)
    turn_id = ctx.new_turn_id()
    opened = step.add(
        TurnOpened(
            turn_id=turn_id,
            input_ids=tuple(i.id for i in batch),
            source=head.source,
            platform=head.platform,
            settings=_with_party(ctx.settings_for(head), ctx.multi_party),
            from_queue=from_queue,
            batch_prefix=prefix,
            venue=ctx.venue_for(head),
        )
    )
    if step.opened is None:
        step.opened = opened
    if any(inp.from_turn is not None for inp in batch):
        # Its origin is read from the turns as the joins before it leave them.
        for inp in batch:
            step.add(_joined(step, inp, turn_id, "opened"))
    else:  # each joins as it would alone: they are folded together (a queue of thousands)
        step.add_all([_joined(step, inp, turn_id, "opened") for inp in batch])
    return turn_id


def _joined(step: Step, inp: Input, turn_id: str, entry: TurnEntry) -> InputJoined:
    """The input enters the turn, with the participants and speaker it brings, derived
    once (``originTurnOf``) and kept in the log."""
    participants, speaker = input_origin(step.view.turns, inp)
    return InputJoined(
        input_id=inp.id, turn_id=turn_id, entry=entry, participants=participants, speaker=speaker
    )


def _with_party(settings: TurnSettings, multi_party: bool) -> TurnSettings:
    if settings.multi_party == multi_party:
        return settings
    return msgspec.structs.replace(settings, multi_party=multi_party)


def decide_submit(
    step: Step, inp: Input, generation: int, ctx: OpenContext, sent_digest: str | None = None
) -> Where:
    """An input arrives (SCH1-SCH4, DEL2). Returns where it went: :class:`Where`
    ``OPENED``, ``PENDING``, ``QUEUED`` or ``RELEASED`` (the SCH8 log line shows each
    in the locale's words). ``sent_digest``: the digest of the input as its submitter
    sent it, when the input hooks changed it (recorded with it)."""
    step.add(InputReceived(input=inp, generation=generation, sent_digest=sent_digest))
    if generation != step.view.queue.generation:
        # An input of a generation before a deletion: dropped, unarchived (DEL2).
        step.add(InputReleased(input_id=inp.id, reason="stale-generation"))
        return Where.RELEASED
    running = step.view.queue.running
    if running is None:
        if step.view.queue.queued or step.view.queue.pending:
            step.add(InputQueued(input_id=inp.id))
            decide_open_next(step, ctx)
            return Where.QUEUED
        _open(step, [inp], ctx, from_queue=False)
        return Where.OPENED
    if inp.source is None and running.accepts_inserts:
        step.add(InputHeld(input_id=inp.id, turn_id=running.turn_id))
        return Where.PENDING
    step.add(InputQueued(input_id=inp.id))
    return Where.QUEUED


def live_input(view: SessionView, input_id: str) -> tuple[Input, Where] | None:
    """The input with id ``input_id`` that is still waiting in the session or in its
    running turn, and where it is; None when no such input is live (the id is new, or its
    input's turn is over, or it was released)."""
    q = view.queue
    for w in q.pending:
        if w.input.id == input_id:
            return w.input, Where.PENDING
    for w in (*q.queued, *q.arrived):
        if w.input.id == input_id:
            return w.input, Where.QUEUED
    running = q.running
    if running is not None:
        for n, w in enumerate(running.joined):
            if w.input.id == input_id:
                return w.input, Where.OPENED if n == 0 else Where.JOINED
    return None


def decide_insertion(step: Step, turn_id: str) -> list[Input]:
    """An insertion point of the running turn (SCH2, FLOW8): the pending inputs join it,
    in arrival order. A turn that stopped, or is not human-opened, takes none."""
    running = step.view.queue.running
    if running is None or running.turn_id != turn_id or not running.accepts_inserts:
        return []
    joined = [w.input for w in step.view.queue.pending if w.held_for == turn_id]
    if any(inp.from_turn is not None for inp in joined):
        # Its origin is read from the turns as the joins before it leave them.
        for inp in joined:
            step.add(_joined(step, inp, turn_id, "joined"))
    else:  # each joins as it would alone: they are folded together
        step.add_all([_joined(step, inp, turn_id, "joined") for inp in joined])
    return joined


def archive_joined(
    step: Step,
    turn_id: str,
    joined: list[Input],
    message_id: Callable[[], str],
    *,
    save: bool = True,
) -> list[ChatMessage]:
    """The archive's copies of inputs that just joined ``turn_id`` in this step, each
    timed by its ``InputJoined``; saved in the same batch (``save``), so a joined input is
    archived in the commit that takes it (「插进来的在插入时」归档). Without an archive
    (ARC1) the copies are built for the prompt but not saved."""
    at = {
        e.input_id: e.at
        for e in step.events
        if isinstance(e, InputJoined) and e.turn_id == turn_id and e.entry == "joined"
    }
    messages = [
        archived_input_message(inp, turn_id, "joined", message_id(), at.get(inp.id))
        for inp in joined
    ]
    if save:
        step.add_all([MessageSaved(message=m) for m in messages])
    return messages


def decide_call_ended(
    step: Step,
    turn_id: str,
    index: int,
    *,
    status: Literal["ok", "error", "aborted"] = "ok",
    tool_calls: int = 0,
    error: str | None = None,
) -> None:
    """A model call returned. After the final call (no tool calls) inserts are over: the
    inputs still waiting to join this turn wait for the next one (SCH2)."""
    step.add(
        ModelCallEnded(
            turn_id=turn_id, index=index, status=status, tool_calls=tool_calls, error=error
        )
    )
    pending = step.view.queue.pending
    if status == "ok" and tool_calls == 0 and pending:  # folded together: thousands may wait
        step.add_all([InputQueued(input_id=w.input.id) for w in pending if w.held_for == turn_id])


def decide_stop(
    step: Step, by: str | None = None, reason: str = "stop", kinds: tuple[str, ...] = ()
) -> str | None:
    """Stop the running turn (SCH6); returns its id, or None when none runs. A turn whose
    reply is already durable is past stopping: it ends as replied, and for a stop no turn
    runs any more. A deletion or clear (``reason`` ``delete``, ``clear``, a clear's
    ``kinds``) stops a turn stopped already once more: its stop begins the deletion in
    the log (see ``decide_recover``)."""
    running = step.view.queue.running
    if running is None:
        return None
    if not running.stoppable:
        if reason in ("delete", "clear"):
            # Past stopping (its reply is durable; it is not cut), but the deletion's
            # stop is written all the same: it begins the deletion in the log, which a
            # release alone does not when nothing waits.
            step.add(StopRequested(turn_id=running.turn_id, by=by, reason=reason, kinds=kinds))
        return None
    if not running.stop_requested or reason in ("delete", "clear"):
        step.add(StopRequested(turn_id=running.turn_id, by=by, reason=reason, kinds=kinds))
    return running.turn_id


def turn_left_history(view: SessionView, turn_id: str) -> bool:
    """Whether the turn left inputs or tool groups in the history (SAVE6)."""
    return any(m.meta.turn_id == turn_id for m in reversed(view.history.messages))


def _archive_released(step: Step, next_id: Callable[[], str]) -> None:
    """Archive, without turn id, the inputs released with ``archived=True`` (SCH6)."""
    step.add_all(
        [
            MessageSaved(message=archived_input_message(w.input, None, None, next_id()))
            for w in step.view.queue.to_archive
        ]
    )


def decide_release(
    step: Step,
    reason: ReleaseReason,
    *,
    by: str | None = None,
    message_id: Callable[[], str],
    kinds: tuple[str, ...] = (),
) -> str | None:
    """Stop-all, mute, shutdown (archived after the running turn settles), delete and
    clear (never archived): stop the running turn and release every queued and pending
    input (SCH6, DEL1). Returns the stopped turn's id, if one runs. For a deletion or a
    clear the stop and the releases begin it in the log (a clear's with its ``kinds``):
    its ``SessionDeleted`` (``ContextCleared``) follows once the turn has settled."""
    archived = reason in ("stop-all", "mute", "shutdown")
    stopped = decide_stop(step, by=by if reason == "stop-all" else None, reason=reason, kinds=kinds)
    # Folded together: thousands may wait (an idle prompt is never archived, INS3).
    step.add_all(
        [
            InputReleased(
                input_id=w.input.id,
                reason=reason,
                archived=archived and w.input.trigger_type != "idle",
                kinds=kinds,
            )
            for w in queue.waiting(step.view.queue)
        ]
    )
    if step.view.queue.running is None:  # else once it settles (a turn past its reply too)
        _archive_released(step, message_id)
    return stopped


def decide_settled(
    step: Step,
    turn_id: str,
    outcome: TurnOutcome,
    ctx: OpenContext,
    *,
    reason: str | None = None,
    duration_ms: int = 0,
    stop_marker: ChatMessage | None = None,
    message_id: Callable[[], str],
    open_next: bool = True,
    archive: bool = True,
) -> None:
    """The running turn ended: its stop marker (SAVE6) and record (SAVE5), the releases
    waiting for it archived, its pending inputs queued, then the next turn opens from the
    head of the queue (SCH4). With ``archive`` false (deletion, ``/clear``) nothing is
    archived: no marker, no record message, only the log's own record."""
    running = step.view.queue.running
    if running is None or running.turn_id != turn_id:
        return
    if running.reply_saved:
        # Its record rides on the saved reply: what fails after (sending, the
        # agent:turn:after middleware) is not recorded again (SAVE5).
        outcome, stop_marker = "replied", None
    if stop_marker is not None and archive:
        step.add(StopMarkerSaved(turn_id=turn_id, message=stop_marker))
    if outcome != "replied" and archive:
        # No saved reply carries the record: it gets its own control marker (SAVE5).
        step.add(
            MessageSaved(
                message=ChatMessage(
                    id=message_id(),
                    role="system",
                    kind="turn-record",
                    meta=MessageMeta(
                        turn_id=turn_id,
                        turn_record=TurnRecord(
                            turn_id=turn_id, outcome=outcome, source=running.source
                        ),
                    ),
                )
            )
        )
    step.add(
        TurnRecorded(
            turn_id=turn_id,
            outcome=outcome,
            source=running.source,
            reason=reason,
            duration_ms=duration_ms,
        )
    )
    if step.view.queue.to_archive:
        _archive_released(step, message_id)
    if step.view.queue.pending:
        step.add_all([InputQueued(input_id=w.input.id) for w in step.view.queue.pending])
    if open_next:
        decide_open_next(step, ctx)


def decide_open_next(step: Step, ctx: OpenContext) -> str | None:
    """Open the next turn from the head of the queue (SCH4): a human head opens with every
    queued human input in arrival order; an injection opens alone."""
    if step.view.queue.running is not None:
        return None
    first = queue.head(step.view.queue)
    if first is None:
        return None
    head = first.input
    if head.source is not None:  # an injection: alone (the rest need not be ordered)
        return _open(step, [head], ctx, from_queue=True)
    batch = [w.input for w in queue.waiting(step.view.queue) if w.input.source is None]
    return _open(step, batch, ctx, from_queue=True)


def decide_recover(
    step: Step,
    ctx: OpenContext,
    *,
    stop_marker: Callable[[TurnLog], ChatMessage | None],
    message_id: Callable[[], str],
) -> str | None:
    """On start: a turn opened without a record was cut by a crash (or a failed write).
    Its inputs that no model call carried (nor the archive took) go back to the head of
    the queue: they never reached the model, so they run rather than being lost; unless
    the turn's stop was durable: then they are archived in it, as a stopped turn's are,
    and not run (a stop holds across a crash, SCH6). The turn
    is recorded ``aborted`` (reason ``crash``), or ``replied`` when its reply was already
    durable, with the time it ran until its last durable event (not until now: the
    process may have been down for days); then the queue is scheduled as usual. Returns
    the cut turn's id.

    A deletion or clear of the context begun in the log and not done (its release
    committed, then a crash before its ``SessionDeleted`` or ``ContextCleared``, see
    :class:`~aalis_agent.projections.queue.WindDown`) is finished as the session would
    have finished it (DEL1): the cut turn recorded ``aborted`` for it, nothing of it
    archived or run again, then the deletion (the clear) written, before anything new."""
    current = step.view.turns.current
    running = step.view.queue.running
    wind = step.view.queue.winding_down
    cut = None
    if current is not None and running is not None and wind is not None:
        # Wound down as a deletion's turn is: its uncarried inputs neither archived nor
        # run again, no marker, no record message (the session winds down unarchived).
        cut = current.turn_id
        last_at = current.events[-1].at if current.events else current.opened.at
        # Its first stop names its end, as its stopped runner would have (the first wins).
        stop = next((e for e in current.events if isinstance(e, StopRequested)), None)
        decide_settled(
            step,
            cut,
            "replied" if running.reply_saved else "aborted",
            ctx,
            reason=stop.reason if stop is not None else wind.kind,
            duration_ms=max(last_at - current.opened.at, 0),
            message_id=message_id,
            open_next=False,
            archive=False,
        )
    elif current is not None and running is not None:
        cut = current.turn_id
        if running.stop_requested and not running.reply_saved:
            # Its stop was durable: the turn ends as a stopped turn does (SCH6), its
            # inputs archived in it, not run again in a new turn (as the put-back
            # below would: the input the user stopped would run after all).
            joined = {e.input_id: e for e in current.events if isinstance(e, InputJoined)}
            step.add_all(
                [
                    MessageSaved(
                        message=archived_input_message(
                            w.input,
                            cut,
                            joined[w.input.id].entry if w.input.id in joined else "opened",
                            message_id(),
                            joined[w.input.id].at if w.input.id in joined else None,
                        )
                    )
                    for w in running.uncarried
                    if w.input.trigger_type != "idle"  # an idle prompt is not archived
                ]
            )
        else:
            for w in running.uncarried:
                step.add(InputRequeued(input_id=w.input.id, turn_id=cut, reason="crash"))
        replied = running.reply_saved
        last_at = current.events[-1].at if current.events else current.opened.at
        left = not replied and turn_left_history(step.view, cut)
        marker = stop_marker(current) if left else None
        decide_settled(
            step,
            cut,
            "replied" if replied else "aborted",
            ctx,
            reason="crash",
            duration_ms=max(last_at - current.opened.at, 0),
            stop_marker=marker,
            message_id=message_id,
            open_next=False,
        )
    if wind is not None:  # written as _finish_winding_down writes it
        if wind.kind == "delete":
            step.add(SessionDeleted(generation=step.view.queue.generation + 1))
        else:
            step.add(ContextCleared(kinds=wind.kinds))
    # Inputs received but never placed (a crash inside a batch cannot leave any, since
    # batches are atomic; kept for logs written by other tools) are queued.
    for w in step.view.queue.arrived:
        step.add(InputQueued(input_id=w.input.id))
    decide_open_next(step, ctx)
    return cut
