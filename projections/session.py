"""All projections of one session folded together, as an actor or a replay keeps them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
from aalis_agent.events.schema import (
    CONTROL_KINDS,
    SessionDeleted,
    SessionEvent,
    SettingsChanged,
    TurnOpened,
)
from aalis_agent.projections import history, queue, turns
from aalis_agent.projections._dispatch import EVENT_TYPES, keep
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.history import COMPACTION_KIND, HistoryState
from aalis_agent.projections.queue import (
    QueueState,
    RunningTurn,
    Waiting,
    WindDown,
    _without,
    wound_down,
)
from aalis_agent.projections.turns import TurnLog, TurnsState
from msgspec.structs import replace

__all__ = ["SessionView", "evolve", "project"]

_NO_SETTINGS: Mapping[str, Any] = MappingProxyType({})


class SessionView(msgspec.Struct, frozen=True):
    """History, turns, queue and session-layer settings as of ``seq``."""

    session_id: str | None = None
    seq: int = 0
    history: HistoryState = msgspec.field(default_factory=HistoryState)
    turns: TurnsState = msgspec.field(default_factory=TurnsState)
    queue: QueueState = msgspec.field(default_factory=QueueState)
    settings: Mapping[str, Any] = _NO_SETTINGS


def _settings(current: Mapping[str, Any], event: SessionEvent) -> Mapping[str, Any]:
    if isinstance(event, SessionDeleted):
        return _NO_SETTINGS
    assert isinstance(event, SettingsChanged)
    updated = dict(current)
    if event.reset:
        updated.pop(event.key, None)
    else:
        updated[event.key] = event.value
    return MappingProxyType(updated)


# What ``project`` does for each event type, read off the projections' own handler
# tables: a combination of handlers without a step here fails at import. The queue
# handlers listed are inlined in ``project`` (``_on_joined`` and ``_on_queued`` for their
# usual cases only);
# any other queue handler (``_CALLED``) is called on the queue state as it stands.
(
    _MESSAGE,
    _TURN_EVENT,
    _CALL_STARTED,
    _CALL_ENDED,
    _RECEIVED,
    _OPENED,
    _RECORDED,
    _KEEP,
    _STOP,
    _MARKER,
    _CLEARED,
    _DELETED,
    _SETTINGS,
    _JOINED,
    _QUEUE_CALL,
    _TURN_EVENT_QUEUE_CALL,
    _QUEUED,
    _RELEASED,
) = range(18)
_CALLED = object()
_STEPS: dict[tuple[object, object, object, bool], int] = {
    (history._on_message, turns._on_message, queue._on_message, False): _MESSAGE,
    (keep, turns._on_turn_event, keep, False): _TURN_EVENT,
    (keep, turns._on_turn_event, queue._on_call_started, False): _CALL_STARTED,
    (keep, turns._on_turn_event, queue._on_call_ended, False): _CALL_ENDED,
    (keep, keep, queue._on_received, False): _RECEIVED,
    (keep, turns._on_opened, queue._on_opened, False): _OPENED,
    (keep, turns._on_recorded, queue._on_recorded, False): _RECORDED,
    (keep, keep, keep, False): _KEEP,
    (keep, turns._on_turn_event, queue._on_stop, False): _STOP,
    (history._on_stop_marker, turns._on_turn_event, keep, False): _MARKER,
    (history._on_cleared, keep, queue._on_cleared, False): _CLEARED,
    (history._on_deleted, keep, queue._on_deleted, True): _DELETED,
    (keep, keep, keep, True): _SETTINGS,
    (keep, turns._on_turn_event, queue._on_joined, False): _JOINED,
    (keep, keep, _CALLED, False): _QUEUE_CALL,
    (keep, turns._on_turn_event, _CALLED, False): _TURN_EVENT_QUEUE_CALL,
    (keep, keep, queue._on_queued, False): _QUEUED,
    (keep, keep, queue._on_released, False): _RELEASED,
}
_NAMED: frozenset[object] = frozenset(q for _, _, q, _ in _STEPS)
_CODES: dict[type, int] = {
    kind: _STEPS[
        history.HANDLERS[kind],
        turns.HANDLERS[kind],
        queue.HANDLERS[kind] if queue.HANDLERS[kind] in _NAMED else _CALLED,
        kind is SettingsChanged or kind is SessionDeleted,
    ]
    for kind in EVENT_TYPES
}
_NO_CARRIED: frozenset[str] = frozenset()


# --- one event: ``evolve`` -------------------------------------------------------------
# The common steps fold their event inline, as the handlers of their combination would;
# the rest call the handlers that do something for their type. Either way only what the
# event changes is rebuilt: the other states are the view's own.

_Evolver = Callable[[SessionView, Any], SessionView]


def _evolve_by_handlers(kind: type) -> _Evolver:
    """A fold of one event of ``kind`` through the handlers that do something for it."""
    fh = None if history.HANDLERS[kind] is keep else history.HANDLERS[kind]
    ft = None if turns.HANDLERS[kind] is keep else turns.HANDLERS[kind]
    fq = None if queue.HANDLERS[kind] is keep else queue.HANDLERS[kind]
    fs = _settings if kind is SettingsChanged or kind is SessionDeleted else None

    def evolve_by_handlers(view: SessionView, event: SessionEvent) -> SessionView:
        return SessionView(
            event.session_id,
            event.seq,
            view.history if fh is None else fh(view.history, event),
            view.turns if ft is None else ft(view.turns, event),
            view.queue if fq is None else fq(view.queue, event),
            view.settings if fs is None else fs(view.settings, event),
        )

    return evolve_by_handlers


_INLINE_IN_EVOLVE = frozenset(
    {_MESSAGE, _TURN_EVENT, _CALL_STARTED, _CALL_ENDED, _RECEIVED, _OPENED, _RECORDED, _KEEP}
)
# Per event type: its step when ``evolve`` folds it inline, else a fold by handlers.
_EVOLVE: dict[type, int | _Evolver] = {
    kind: code if code in _INLINE_IN_EVOLVE else _evolve_by_handlers(kind)
    for kind, code in _CODES.items()
}


def evolve(view: SessionView, event: SessionEvent) -> SessionView:
    """Fold one event into every projection.

    The same as ``project((event,), view)``, made for one event at a time (as a decision
    adds them): only the states the event changes are rebuilt, and a chain it extends is
    appended to as ``Chain.append`` does; the others are the view's own. The common steps
    are folded inline, as their handlers would; the rest through their handlers.
    """
    step = _EVOLVE[type(event)]
    hist = view.history
    turns_state = view.turns
    q = view.queue
    if step == _MESSAGE:
        message = event.message  # type: ignore[union-attr]
        kind = message.kind
        if kind is None or kind not in CONTROL_KINDS:
            hist = HistoryState(hist.messages.append(message), hist.active_from)
        elif kind == COMPACTION_KIND:
            hist = HistoryState(hist.messages, len(hist.messages))
        meta = message.meta
        m_turn = meta.turn_id
        if m_turn is not None:
            current = turns_state.current
            if current is not None and current.opened.turn_id == m_turn:
                log = TurnLog(current.opened, current.events.append(event))
                turns_state = TurnsState(turns_state.finished, log)
            running = q.running
            if running is not None and running.turn_id == m_turn:
                input_id = meta.input_id
                if input_id is not None and input_id not in running.carried:
                    running = replace(running, carried=running.carried | {input_id})
                if meta.turn_record is not None and message.role == "assistant":
                    running = replace(running, reply_saved=True)
                if running is not q.running:
                    q = replace(q, running=running)
        if q.to_archive:
            input_id = meta.input_id
            if input_id is not None:
                q = replace(q, to_archive=_without(q.to_archive, input_id))
    elif step in (_TURN_EVENT, _CALL_STARTED, _CALL_ENDED):
        turn_id = event.turn_id  # type: ignore[union-attr]
        current = turns_state.current
        if current is not None and current.opened.turn_id == turn_id:
            log = TurnLog(current.opened, current.events.append(event))
            turns_state = TurnsState(turns_state.finished, log)
        if step != _TURN_EVENT:
            running = q.running
            if running is not None and running.turn_id == turn_id:
                if step == _CALL_STARTED:
                    joined, carried = running.joined, running.carried
                    if not (len(joined) == 1 == len(carried) and joined[0].input.id in carried):
                        q = queue._on_call_started(q, event)  # type: ignore[arg-type]
                    # else the usual turn: its one input is carried already
                elif event.status == "ok" and not event.tool_calls:  # type: ignore[union-attr]
                    q = replace(q, running=replace(running, final_call_returned=True))
    elif step == _RECEIVED:
        waiting = Waiting(event.input, event.seq, event.generation)  # type: ignore[union-attr]
        q = replace(q, arrived=(*q.arrived, waiting), winding_down=None)  # see queue's
    elif step == _OPENED:
        finished = turns_state.finished
        if turns_state.current is not None:  # cut off without a record: keep what is known
            finished = finished.append(turns_state.current)
        turns_state = TurnsState(finished, TurnLog(event))  # type: ignore[arg-type]
        q = replace(q, running=RunningTurn(event.turn_id, event.source))  # type: ignore[union-attr]
    elif step == _RECORDED:
        turn_id = event.turn_id  # type: ignore[union-attr]
        current = turns_state.current
        if current is not None and current.opened.turn_id == turn_id:
            log = TurnLog(current.opened, current.events, event)  # type: ignore[arg-type]
            turns_state = TurnsState(turns_state.finished.append(log))
        running = q.running
        if running is not None and running.turn_id == turn_id:
            q = replace(q, running=None)
    elif step != _KEEP:
        return step(view, event)  # type: ignore[operator]
    return SessionView(event.session_id, event.seq, hist, turns_state, q, view.settings)


# --- many events: ``project`` ----------------------------------------------------------

_QueueFields = tuple[
    int,
    tuple[Waiting, ...],
    Chain[Waiting],
    Chain[Waiting],
    tuple[Waiting, ...],
    RunningTurn | None,
    str | None,
    str | None,
    bool,
    bool,
    tuple[Waiting, ...],
    frozenset[str],
    bool,
    WindDown | None,
]


def _queue_fields(q: QueueState) -> _QueueFields:
    """The queue's fields as ``project`` holds them: its own, then the running turn's
    (no turn id when none runs)."""
    r = q.running
    if r is None:
        return (
            q.generation,
            q.arrived,
            q.queued,
            q.pending,
            q.to_archive,
            None,
            None,
            None,
            False,
            False,
            (),
            _NO_CARRIED,
            False,
            q.winding_down,
        )
    return (
        q.generation,
        q.arrived,
        q.queued,
        q.pending,
        q.to_archive,
        r,
        r.turn_id,
        r.source,
        r.stop_requested,
        r.final_call_returned,
        r.joined,
        r.carried,
        r.reply_saved,
        q.winding_down,
    )


def _first_by_id(items: Iterable[Waiting]) -> dict[str, Waiting]:
    """The first input waiting under each id in ``items``, as the queue's ``_take`` finds
    one: an index ``project`` builds once for a run of inputs taken by id."""
    first: dict[str, Waiting] = {}
    for w in items:
        first.setdefault(w.input.id, w)
    return first


def project(events: Iterable[SessionEvent], view: SessionView | None = None) -> SessionView:
    """Fold a whole log (or the rest of one, from ``view``).

    The result is what folding each projection's handlers gives (``history.project``,
    ``turns.project``, ``queue.project`` and the settings), but the history, the turns
    and the queue are folded here in one pass over plain lists and local variables,
    wrapped in their states once at the end: a long replay then builds no state per
    event that it throws away. The queue's rarer events (and an input joining a turn
    that is not running) go through its own handlers, on the queue state as it stands
    then; an input joining the running turn is taken from ``arrived``, ``queued`` or
    ``pending`` here, each list rebuilt once without the inputs taken from it.
    As ``Chain.append`` does, a list shared with ``view`` is extended in place only
    while ``view`` holds its newest items, and copied first otherwise.
    """
    if view is None:
        view = SessionView()
    codes = _CODES
    control_kinds = CONTROL_KINDS
    settings = view.settings
    # The history's messages, the finished turns and the current turn's events, as lists.
    hist = view.history
    h_start = hist.messages
    h_list = h_start.list_to_extend()
    h_append = h_list.append
    h_from = hist.active_from
    turns_state = view.turns
    f_start = turns_state.finished
    f_list = f_start.list_to_extend()
    current = turns_state.current
    c_opened: TurnOpened | None = None
    c_id: str | None = None
    c_list: list[SessionEvent] = []
    if current is not None:
        c_opened = current.opened
        c_id = c_opened.turn_id
        c_list = current.events.list_to_extend()
    c_append = c_list.append
    # The queue, field by field; ``q_obj`` (``r_obj``) is the state (running turn) these
    # hold while it is known, and None once a field changed.
    q_obj: QueueState | None = view.queue
    (
        generation,
        arrived,
        queued,
        pending,
        to_archive,
        r_obj,
        r_id,
        r_source,
        r_stop,
        r_final,
        r_joined,
        r_carried,
        r_reply,
        wind,
    ) = _queue_fields(view.queue)
    # Gathered as a run of inputs joins (a turn's insertion point may take thousands, a
    # turn opened from the queue as many): inputs carried and joined since ``r_carried``
    # and ``r_joined`` were last built, and the inputs taken from ``queued`` and from
    # ``pending`` (by id: each is rebuilt without them once, where it is next read),
    # found through ``q_first`` and ``p_first`` (the first waiting under each id). Each
    # run costs its length, not its length times the queue's (a fold of a tuple or a
    # frozenset per input copied the whole).
    c_more: set[str] = set()
    j_more: list[Waiting] = []
    q_drop: set[str] = set()
    q_first: dict[str, Waiting] | None = None
    p_drop: set[str] = set()
    p_first: dict[str, Waiting] | None = None
    # Inputs released to be archived, and taken off once archived (a stop-all or a
    # shutdown may release thousands): ``to_archive`` held as a dict by input id while a
    # run goes on (``a_map``, None when not held so), made a tuple again where the queue
    # state is next built. Held only while the ids are distinct (``a_dupes`` else), as
    # taking one off by id then takes exactly what ``_without`` takes.
    a_map: dict[str, Waiting] | None = None
    a_dupes = False
    event: SessionEvent | None = None
    for event in events:
        code = codes[type(event)]
        if code == _MESSAGE:
            message = event.message  # type: ignore[union-attr]
            kind = message.kind
            if kind is None or kind not in control_kinds:
                h_append(message)
            elif kind == COMPACTION_KIND:
                h_from = len(h_list)
            meta = message.meta
            m_turn = meta.turn_id
            if m_turn is not None:
                if m_turn == c_id:
                    c_append(event)
                if m_turn == r_id:
                    input_id = meta.input_id
                    if (
                        input_id is not None
                        and input_id not in r_carried
                        and input_id not in c_more
                    ):
                        c_more.add(input_id)
                        r_obj = q_obj = None
                    if meta.turn_record is not None and message.role == "assistant":
                        r_reply = True
                        r_obj = q_obj = None
            if a_map if a_map is not None else to_archive:
                input_id = meta.input_id
                if input_id is not None:
                    if a_map is None and not a_dupes:
                        a_map = {w.input.id: w for w in to_archive}
                        if len(a_map) != len(to_archive):
                            a_map, a_dupes = None, True
                    if a_map is not None:
                        a_map.pop(input_id, None)
                    else:
                        to_archive = _without(to_archive, input_id)
                    q_obj = None
        elif code == _TURN_EVENT:
            if event.turn_id == c_id:  # type: ignore[union-attr]
                c_append(event)
        elif code == _CALL_STARTED:
            turn_id = event.turn_id  # type: ignore[union-attr]
            if turn_id == c_id:
                c_append(event)
            if c_more:
                r_carried, c_more = r_carried | c_more, set()
            if j_more:
                r_joined, j_more = (*r_joined, *j_more), []
            if (
                r_id is not None
                and turn_id == r_id
                and not (len(r_joined) == 1 == len(r_carried) and r_joined[0].input.id in r_carried)
            ):  # else the usual turn: its one input is carried already
                carried = frozenset([w.input.id for w in r_joined])
                if carried != r_carried:
                    r_carried = carried
                    r_obj = q_obj = None
        elif code == _CALL_ENDED:
            turn_id = event.turn_id  # type: ignore[union-attr]
            if turn_id == c_id:
                c_append(event)
            if (
                r_id is not None
                and turn_id == r_id
                and event.status == "ok"  # type: ignore[union-attr]
                and not event.tool_calls  # type: ignore[union-attr]
            ):
                r_final = True
                r_obj = q_obj = None
        elif code == _RECEIVED:
            arrived = (*arrived, Waiting(event.input, event.seq, event.generation))  # type: ignore[union-attr]
            q_obj = wind = None  # a wind-down an input came after was abandoned (see queue's)
        elif code == _OPENED:
            if c_opened is not None:  # cut off without a record: keep what is known
                f_list.append(TurnLog(c_opened, Chain(c_list)))
            c_opened = event  # type: ignore[assignment]
            c_id = r_id = event.turn_id  # type: ignore[union-attr]
            c_list = []
            c_append = c_list.append
            r_source = event.source  # type: ignore[union-attr]
            r_stop = r_final = r_reply = False
            r_joined, r_carried = (), _NO_CARRIED
            c_more, j_more = set(), []
            r_obj = q_obj = None
        elif code == _RECORDED:
            turn_id = event.turn_id  # type: ignore[union-attr]
            if c_opened is not None and turn_id == c_id:
                f_list.append(TurnLog(c_opened, Chain(c_list), event))  # type: ignore[arg-type]
                c_opened = c_id = None
                c_list = []
                c_append = c_list.append
            if r_id is not None and turn_id == r_id:
                r_id = r_obj = q_obj = None
        elif code == _KEEP:
            pass
        elif code >= _JOINED:  # the queue's own handler, unless an input moves as usual
            if code == _QUEUED:
                # The usual case of a run (a final call's end, a turn settling): a pending
                # input moves to the queue; taken from ``pending`` as a join is, and
                # appended to ``queued``. From anywhere else, by the queue's handler.
                code = _QUEUE_CALL
                input_id = event.input_id  # type: ignore[union-attr]
                if (
                    pending
                    and input_id not in p_drop
                    and not q_drop
                    and all(w.input.id != input_id for w in arrived)
                ):
                    if p_first is None:
                        p_first = _first_by_id(pending)
                    moved = p_first.get(input_id)
                    if moved is not None:
                        if q_first is None:
                            q_first = _first_by_id(queued)
                        if input_id not in q_first:
                            p_drop.add(input_id)
                            if moved.held_for is not None:
                                moved = replace(moved, held_for=None)
                            queued = queued.append(moved)
                            q_first[input_id] = moved
                            q_obj = None
                            code = _QUEUED
            elif code == _RELEASED:
                # The usual case of a run (a stop-all, a shutdown, a deletion): an input
                # released from ``queued`` or ``pending``, taken as a join takes it (the
                # list rebuilt once without it where it is next read), and put in
                # ``to_archive`` when archived. Else by the queue's handler.
                code = _QUEUE_CALL
                input_id = event.input_id  # type: ignore[union-attr]
                reason = event.reason  # type: ignore[union-attr]
                if reason == "delete" or reason == "clear":  # a deletion or clear begun
                    begun = wound_down(wind, reason, event.kinds)  # type: ignore[union-attr]
                    if begun is not wind:
                        wind = begun
                        q_obj = None
                if all(w.input.id != input_id for w in arrived):
                    released: Waiting | None = None
                    if input_id not in q_drop:
                        if q_first is None:
                            q_first = _first_by_id(queued)
                        released = q_first.get(input_id)
                    drop = q_drop
                    if released is None and input_id not in p_drop:
                        if p_first is None:
                            p_first = _first_by_id(pending)
                        released = p_first.get(input_id)
                        drop = p_drop
                    if released is None:
                        code = _RELEASED  # waiting nowhere: nothing to take
                    elif event.archived:  # type: ignore[union-attr]
                        if a_map is None and not a_dupes:
                            a_map = {w.input.id: w for w in to_archive}
                            if len(a_map) != len(to_archive):
                                a_map, a_dupes = None, True
                        if a_map is not None and input_id not in a_map:
                            drop.add(input_id)
                            a_map[input_id] = replace(released, held_for=None)
                            q_obj = None
                            code = _RELEASED
                    else:
                        drop.add(input_id)
                        q_obj = None
                        code = _RELEASED
            elif code != _QUEUE_CALL and event.turn_id == c_id:  # type: ignore[union-attr]
                c_append(event)
            if code == _JOINED and r_id is not None and event.turn_id == r_id:  # type: ignore[union-attr]
                input_id = event.input_id  # type: ignore[union-attr]
                for w in arrived:  # the usual case: received, then joined in the same batch
                    if w.input.id == input_id:
                        if w.held_for is not None or w.front:
                            w = replace(w, held_for=None, front=False)
                        j_more.append(w)
                        # (w is the only one when it arrived alone)
                        arrived = () if len(arrived) == 1 else _without(arrived, input_id)
                        r_obj = q_obj = None
                        break
                else:
                    # Taken from where it waits, as the queue's handler takes it: from
                    # ``queued``, else from ``pending``.
                    found: Waiting | None = None
                    if input_id not in q_drop:
                        if q_first is None:
                            q_first = _first_by_id(queued)
                        found = q_first.get(input_id)
                    if found is not None:
                        q_drop.add(input_id)
                        if found.held_for is not None or found.front:
                            found = replace(found, held_for=None, front=False)
                        j_more.append(found)
                        r_obj = q_obj = None
                    elif input_id not in p_drop:
                        if p_first is None:
                            p_first = _first_by_id(pending)
                        found = p_first.get(input_id)
                        if found is not None:
                            p_drop.add(input_id)
                            if found.held_for is not None or found.front:
                                found = replace(found, held_for=None, front=False)
                            j_more.append(found)
                            r_obj = q_obj = None
            elif code != _QUEUED and code != _RELEASED:
                code = _QUEUE_CALL
            if code == _QUEUE_CALL:
                if a_map is not None:
                    to_archive, a_map = tuple(a_map.values()), None
                if c_more:
                    r_carried, c_more = r_carried | c_more, set()
                if j_more:
                    r_joined, j_more = (*r_joined, *j_more), []
                if q_drop:
                    queued = Chain([w for w in queued if w.input.id not in q_drop])
                    q_drop = set()
                if p_drop:
                    pending = Chain([w for w in pending if w.input.id not in p_drop])
                    p_drop = set()
                q_first = p_first = None  # the handler may change both
                if q_obj is None:
                    if r_id is not None and r_obj is None:
                        r_obj = RunningTurn(
                            r_id, r_source, r_stop, r_final, r_joined, r_carried, r_reply
                        )
                    q_obj = QueueState(
                        generation, arrived, queued, pending, r_obj, to_archive, wind
                    )
                q_obj = queue.HANDLERS[type(event)](q_obj, event)
                a_dupes = False
                (
                    generation,
                    arrived,
                    queued,
                    pending,
                    to_archive,
                    r_obj,
                    r_id,
                    r_source,
                    r_stop,
                    r_final,
                    r_joined,
                    r_carried,
                    r_reply,
                    wind,
                ) = _queue_fields(q_obj)
        elif code == _STOP:
            turn_id = event.turn_id  # type: ignore[union-attr]
            if turn_id == c_id:
                c_append(event)
            if r_id is not None and turn_id == r_id:
                r_stop = True
                r_obj = q_obj = None
                wind = wound_down(wind, event.reason, event.kinds)  # type: ignore[union-attr,arg-type]
        elif code == _MARKER:
            h_append(event.message)  # type: ignore[union-attr]
            if event.turn_id == c_id:  # type: ignore[union-attr]
                c_append(event)
        elif code == _SETTINGS:
            settings = _settings(settings, event)
        elif code == _DELETED or (
            not event.kinds or "context" in event.kinds  # type: ignore[union-attr]
        ):  # _DELETED, or _CLEARED of the context
            h_list, h_from = [], 0
            h_append = h_list.append
            if code == _DELETED:
                generation = event.generation  # type: ignore[union-attr]
                wind = q_obj = None
                settings = _settings(settings, event)
            elif wind is not None and wind.kind == "clear":  # the clear begun is done
                wind = q_obj = None
    if event is None:
        return view
    if h_from != hist.active_from or not h_start.views_whole(h_list):
        hist = HistoryState(Chain(h_list), h_from)
    opened_before = current.opened if current is not None else None
    if (
        c_opened is not opened_before
        or len(f_list) != len(f_start)
        or (current is not None and len(c_list) != len(current.events))
    ):
        finished = Chain(f_list) if len(f_list) != len(f_start) else f_start
        if c_opened is None:
            turns_state = TurnsState(finished, None)
        elif (
            current is not None and c_opened is opened_before and len(c_list) == len(current.events)
        ):
            turns_state = TurnsState(finished, current)
        else:
            turns_state = TurnsState(finished, TurnLog(c_opened, Chain(c_list)))
    if q_obj is None:
        if a_map is not None:
            to_archive = tuple(a_map.values())
        if c_more:
            r_carried = r_carried | c_more
        if j_more:
            r_joined = (*r_joined, *j_more)
        if q_drop:
            queued = Chain([w for w in queued if w.input.id not in q_drop])
        if p_drop:
            pending = Chain([w for w in pending if w.input.id not in p_drop])
        if r_id is None:
            r_obj = None
        elif r_obj is None:
            r_obj = RunningTurn(r_id, r_source, r_stop, r_final, r_joined, r_carried, r_reply)
        q_obj = QueueState(generation, arrived, queued, pending, r_obj, to_archive, wind)
    return SessionView(event.session_id, event.seq, hist, turns_state, q_obj, settings)
