"""The queue projection: inputs waiting for a turn, and the session's generation.

An input is *queued* (it waits for a later turn, SCH3) or *pending* (it waits to join the
running turn at its next insertion point, SCH2) until it joins a turn or is released.
The state also knows the running turn, as far as scheduling needs it, the session
generation that deletion bumps (DEL2), and a deletion or clear begun in the log and not
yet written as done (``winding_down``).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Literal

import msgspec
from aalis_agent.events.schema import (
    ContextCleared,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    StopMarkerSaved,
    StopRequested,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    UsageRecorded,
)
from aalis_agent.projections._dispatch import Handler, check_complete, fold, keep
from aalis_agent.projections.chain import Chain
from msgspec.structs import replace

__all__ = [
    "HANDLERS",
    "QueueState",
    "RunningTurn",
    "Waiting",
    "WindDown",
    "evolve",
    "has_open_work",
    "head",
    "project",
    "waiting",
    "wound_down",
]


class Waiting(msgspec.Struct, frozen=True):
    """An accepted input that has not entered a turn; ``arrival`` is its event seq.
    ``front`` marks an input put back by recovery: it waits ahead of the others."""

    input: Input
    arrival: int
    generation: int
    held_for: str | None = None  # the turn it waits to join, when pending
    front: bool = False


class RunningTurn(msgspec.Struct, frozen=True):
    """The turn in flight, as scheduling sees it."""

    turn_id: str
    source: str | None
    stop_requested: bool = False
    final_call_returned: bool = False  # a model call returned without tool calls
    joined: tuple[Waiting, ...] = ()  # the inputs that entered it, in order
    carried: frozenset[str] = frozenset()  # of those, archived or sent to the model
    reply_saved: bool = False  # its reply is durable: a stop no longer applies

    @property
    def accepts_inserts(self) -> bool:
        """Human inputs may join it now (SCH2)."""
        return self.source is None and not self.final_call_returned and not self.stop_requested

    @property
    def stoppable(self) -> bool:
        """A stop still applies: the turn's reply is not yet durable (SAVE, SCH6)."""
        return not self.reply_saved

    @property
    def uncarried(self) -> tuple[Waiting, ...]:
        """Inputs that entered the turn but were neither archived nor carried by a model
        call: if the turn is cut now, they never reached the model."""
        return tuple(w for w in self.joined if w.input.id not in self.carried)


class WindDown(msgspec.Struct, frozen=True):
    """A deletion (``kind`` ``delete``) or a clear of the context (``clear``, its
    ``kinds``) that the log shows begun, by its release of the waiting inputs or its stop
    of the running turn, and not done: no ``SessionDeleted`` (no ``ContextCleared`` of
    the context) after it. The two are separate commits (the turn settles in between);
    a crash between them leaves this, and recovery writes the rest (DEL1). An input
    received after it ends it too: no session receives one while it winds down, so the
    wind-down was abandoned (a log a restart recovered before wind-downs were finished,
    which went on taking inputs); finishing it then would wipe what came since."""

    kind: Literal["delete", "clear"]
    kinds: tuple[str, ...] = ()


_WIND_REASONS = frozenset({"delete", "clear"})


def wound_down(current: WindDown | None, reason: str, kinds: tuple[str, ...]) -> WindDown | None:
    """The deletion or clear begun after an event released an input or stopped the turn
    for ``reason``: a deletion or clear now begun, unless one already was (a deletion
    takes the place of a clear: it clears the history too)."""
    if reason not in _WIND_REASONS:
        return current
    if current is None or (reason == "delete" and current.kind == "clear"):
        return WindDown("delete" if reason == "delete" else "clear", kinds)
    return current


class QueueState(msgspec.Struct, frozen=True):
    """Queued and pending inputs in the order they were placed, the running turn and the
    generation.

    ``queued`` and ``pending`` are chains (append-only views of a shared list): placing
    one more input extends the newest state's list in place rather than copying it, so a
    run of thousands of submits into a running turn costs its length. Taking an input out
    of either builds the chain anew without it."""

    generation: int = 0
    arrived: tuple[Waiting, ...] = ()  # received, not yet placed (within one batch)
    queued: Chain[Waiting] = msgspec.field(default_factory=Chain)
    pending: Chain[Waiting] = msgspec.field(default_factory=Chain)
    running: RunningTurn | None = None
    to_archive: tuple[Waiting, ...] = ()  # released with archived=True, not yet archived
    winding_down: WindDown | None = None  # a deletion or clear begun, not yet done


def _without(items: tuple[Waiting, ...], input_id: str) -> tuple[Waiting, ...]:
    return tuple([w for w in items if w.input.id != input_id])


def _chain_without(items: Chain[Waiting], input_id: str) -> Chain[Waiting]:
    return Chain([w for w in items if w.input.id != input_id])


def _take(state: QueueState, input_id: str) -> tuple[QueueState, Waiting | None]:
    """Remove the input from wherever it waits."""
    for w in state.arrived:
        if w.input.id == input_id:
            return replace(state, arrived=_without(state.arrived, input_id)), w
    for w in state.queued:
        if w.input.id == input_id:
            return replace(state, queued=_chain_without(state.queued, input_id)), w
    for w in state.pending:
        if w.input.id == input_id:
            return replace(state, pending=_chain_without(state.pending, input_id)), w
    return state, None


def _on_received(state: QueueState, event: InputReceived) -> QueueState:
    arrived = Waiting(event.input, event.seq, event.generation)
    # A session winding down takes no input (it holds them back in memory, and recovery
    # finishes the wind-down before anything new): one received after a wind-down began
    # means it was abandoned (a log recovered before wind-downs were finished on
    # restart, which went on): not to be finished now, over what came since.
    return replace(state, arrived=(*state.arrived, arrived), winding_down=None)


def _on_queued(state: QueueState, event: InputQueued) -> QueueState:
    state, taken = _take(state, event.input_id)
    if taken is None:
        return state
    return replace(state, queued=state.queued.append(replace(taken, held_for=None)))


def _on_held(state: QueueState, event: InputHeld) -> QueueState:
    state, taken = _take(state, event.input_id)
    if taken is None:
        return state
    return replace(state, pending=state.pending.append(replace(taken, held_for=event.turn_id)))


def _on_joined(state: QueueState, event: InputJoined) -> QueueState:
    input_id = event.input_id
    running = state.running
    if running is not None and running.turn_id == event.turn_id:
        arrived = state.arrived
        for w in arrived:  # the usual case: received, then joined in the same batch
            if w.input.id == input_id:
                if w.held_for is not None or w.front:
                    w = replace(w, held_for=None, front=False)
                running = replace(running, joined=(*running.joined, w))
                return replace(state, arrived=_without(arrived, input_id), running=running)
    state, taken = _take(state, input_id)
    running = state.running
    if taken is None or running is None or running.turn_id != event.turn_id:
        return state
    if taken.held_for is not None or taken.front:
        taken = replace(taken, held_for=None, front=False)
    return replace(state, running=replace(running, joined=(*running.joined, taken)))


def _on_requeued(state: QueueState, event: InputRequeued) -> QueueState:
    running = state.running
    if running is None or running.turn_id != event.turn_id:
        return state
    for w in running.joined:
        if w.input.id == event.input_id:
            joined = tuple(j for j in running.joined if j is not w)
            return replace(
                state,
                running=replace(running, joined=joined),
                queued=state.queued.append(replace(w, front=True)),
            )
    return state


def _on_call_started(state: QueueState, event: ModelCallStarted) -> QueueState:
    running = state.running
    if running is None or running.turn_id != event.turn_id:
        return state
    joined = running.joined
    if len(joined) == 1 == len(running.carried) and joined[0].input.id in running.carried:
        return state  # the usual turn: its one input is carried already
    carried = frozenset([w.input.id for w in joined])
    if carried == running.carried:
        return state
    return replace(state, running=replace(running, carried=carried))


def _on_released(state: QueueState, event: InputReleased) -> QueueState:
    wind = wound_down(state.winding_down, event.reason, event.kinds)
    if wind is not state.winding_down:
        state = replace(state, winding_down=wind)
    state, taken = _take(state, event.input_id)
    if taken is None or not event.archived:
        return state
    return replace(state, to_archive=(*state.to_archive, replace(taken, held_for=None)))


def _on_message(state: QueueState, event: MessageSaved) -> QueueState:
    running = state.running
    meta = event.message.meta
    input_id = meta.input_id
    if running is not None and meta.turn_id == running.turn_id:
        if input_id is not None and input_id not in running.carried:
            running = replace(running, carried=running.carried | {input_id})
            state = replace(state, running=running)
        if meta.turn_record is not None and event.message.role == "assistant":
            state = replace(state, running=replace(running, reply_saved=True))
    if not state.to_archive:
        return state
    if input_id is None:
        return state
    return replace(state, to_archive=_without(state.to_archive, input_id))


def _on_opened(state: QueueState, event: TurnOpened) -> QueueState:
    return replace(state, running=RunningTurn(event.turn_id, event.source))


def _on_call_ended(state: QueueState, event: ModelCallEnded) -> QueueState:
    running = state.running
    if (
        running is None
        or running.turn_id != event.turn_id
        or event.status != "ok"
        or event.tool_calls
    ):
        return state
    return replace(state, running=replace(running, final_call_returned=True))


def _on_stop(state: QueueState, event: StopRequested) -> QueueState:
    running = state.running
    if running is None or running.turn_id != event.turn_id:
        return state
    wind = wound_down(state.winding_down, event.reason, event.kinds)
    return replace(state, running=replace(running, stop_requested=True), winding_down=wind)


def _on_recorded(state: QueueState, event: TurnRecorded) -> QueueState:
    running = state.running
    if running is None or running.turn_id != event.turn_id:
        return state
    return replace(state, running=None)


def _on_deleted(state: QueueState, event: SessionDeleted) -> QueueState:
    return replace(state, generation=event.generation, winding_down=None)


def _on_cleared(state: QueueState, event: ContextCleared) -> QueueState:
    wind = state.winding_down
    if wind is None or wind.kind != "clear" or (event.kinds and "context" not in event.kinds):
        return state  # a clear of other kinds leaves the context's clear to come
    return replace(state, winding_down=None)


HANDLERS: dict[type, Handler[QueueState]] = {
    InputReceived: _on_received,
    InputQueued: _on_queued,
    InputHeld: _on_held,
    InputJoined: _on_joined,
    InputReleased: _on_released,
    InputRequeued: _on_requeued,
    ModelCallStarted: _on_call_started,
    MessageSaved: _on_message,
    TurnOpened: _on_opened,
    ModelCallEnded: _on_call_ended,
    StopRequested: _on_stop,
    TurnRecorded: _on_recorded,
    SessionDeleted: _on_deleted,
    ContextCleared: _on_cleared,
    **dict.fromkeys(
        (
            ToolStarted,
            ToolFinished,
            UsageRecorded,
            StopMarkerSaved,
            SettingsChanged,
        ),
        keep,
    ),
}
check_complete("queue", HANDLERS)


def evolve(state: QueueState, event: SessionEvent) -> QueueState:
    """Fold one event into the queue."""
    return HANDLERS[type(event)](state, event)


def project(events: Iterable[SessionEvent], state: QueueState | None = None) -> QueueState:
    """Fold a whole log (or the rest of one, from ``state``)."""
    return fold(HANDLERS, QueueState() if state is None else state, events)


def _order(w: Waiting) -> tuple[bool, int]:
    return not w.front, w.arrival


_ARRIVAL = attrgetter("arrival")
_FRONT = attrgetter("front")


def waiting(state: QueueState) -> list[Waiting]:
    """Queued and pending inputs together, in arrival order (what ``agent:queue`` reports);
    inputs put back by recovery come first. (As sorted by :func:`_order`, with keys read
    in C: ``agent:queue`` sorts every waiting input at each change.)"""
    both = sorted((*state.queued, *state.pending), key=_ARRIVAL)
    if any(map(_FRONT, both)):
        both.sort(key=_FRONT, reverse=True)  # stable: each part stays in arrival order
    return both


def head(state: QueueState) -> Waiting | None:
    """The first of :func:`waiting` (None when nothing waits), without ordering the rest."""
    if not state.queued and not state.pending:
        return None
    return min((*state.queued, *state.pending), key=_order)


def has_open_work(state: QueueState) -> bool:
    """Whether the session has unfinished work: a running turn, inputs accepted but not
    yet decided, inputs queued or pending, or a deletion or clear begun and not done. A
    restart must resume such a session."""
    return bool(
        state.running is not None
        or state.arrived
        or state.queued
        or state.pending
        or state.winding_down is not None
    )
