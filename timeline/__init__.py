"""The timeline renderer shared by ``replay`` and scenario transcripts: one line per
event (:func:`render_event`), a session's projected state (:func:`render_state`,
:func:`state_json`). Pure: it reads events and projections and prints nothing."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from aalis_agent.events import (
    ChatMessage,
    ContextCleared,
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
from aalis_agent.events.codec import event_tag, to_builtins
from aalis_agent.projections import SessionView, history, queue

__all__ = [
    "PREVIEW",
    "history_limit_of",
    "render_event",
    "render_state",
    "render_time",
    "shown_name",
    "state_json",
    "terminal_safe",
]

PREVIEW = 60


def _preview(text: str | None, width: int = PREVIEW) -> str:
    if not text:
        return '""'
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def shown_name(name: str) -> str:
    """A session id as a terminal line shows it: as is when printable, else quoted with
    its control characters escaped (a newline or an escape sequence in an id would
    forge lines or colour the terminal)."""
    return name if name.isprintable() else repr(name)


def render_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).strftime("%m-%d %H:%M:%S.%f")[:-3]


def _message(m: ChatMessage) -> str:
    meta = m.meta
    bits = [f"{m.role}"]
    if m.kind:
        bits.append(f"kind={m.kind}")
    if meta.turn_id:
        bits.append(f"turn={meta.turn_id}")
    if meta.entry:
        bits.append(f"entry={meta.entry}")
    if m.tool_calls:
        calls = ", ".join(f"{c.name}#{c.id}({_preview(c.arguments, 40)})" for c in m.tool_calls)
        return f"saved {' '.join(bits)} calls [{calls}]"
    if m.tool_call_id:
        bits.append(f"callId={m.tool_call_id}")
    if meta.turn_record:
        bits.append(f"record={meta.turn_record.outcome}")
    return f"saved {' '.join(bits)} {_preview(m.content)}"


def terminal_safe(text: str) -> str:
    """``text`` for a terminal: every character that is not printable (a newline, an
    escape sequence's ESC) written as its escape, so a value in the log can neither forge
    lines nor drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render_event(event: SessionEvent) -> str:
    """One readable line for one event (without seq and time), terminal-safe (ids, names
    and keys come from the log as they are)."""
    return terminal_safe(_render_event(event))


def _render_event(event: SessionEvent) -> str:
    match event:
        case InputReceived(input=inp):
            who = "human" if inp.source is None else f"injection source={inp.source}"
            sender = inp.sender.user_id or "-"
            gw = f" #{inp.gateway_seq}" if inp.gateway_seq is not None else ""
            addressed = "" if inp.addressed else " not-addressed"
            return (
                f"input {inp.id}{gw} received ({who}, platform={inp.platform}, "
                f"sender={sender}{addressed}, generation={event.generation})"
            )
        case InputQueued():
            return f"input {event.input_id} → queued"
        case InputHeld():
            return f"input {event.input_id} → pending insert into {event.turn_id}"
        case InputJoined():
            return f"input {event.input_id} → {event.turn_id} ({event.entry})"
        case InputReleased():
            archived = "archived" if event.archived else "not archived"
            why = f"{event.reason}{_kinds(event.kinds)}"
            return f"input {event.input_id} released ({why}, {archived})"
        case InputRequeued():
            return (
                f"input {event.input_id} back to the head of the queue "
                f"({event.turn_id} was cut by a {event.reason} before a model call carried it)"
            )
        case TurnOpened():
            who = "human" if event.source is None else f"source={event.source}"
            s = event.settings
            limit = f", historyLimit={s.history_limit}" if s.history_limit else ""
            model = f", model={s.model}" if s.model else ""
            queued = ", from queue" if event.from_queue else ""
            return (
                f"TURN {event.turn_id} opened ({who}{queued}; inputs "
                f"{' '.join(event.input_ids)}{model}{limit})"
            )
        case ModelCallStarted():
            retry = " format-retry" if event.format_retry else ""
            return f"  model call {event.index} started ({event.model or '-'}{retry})"
        case ModelCallEnded():
            err = f" error={_preview(event.error)}" if event.error else ""
            return (
                f"  model call {event.index} {event.status}, {event.tool_calls} tool call(s){err}"
            )
        case MessageSaved(message=m):
            return f"  {_message(m)}"
        case ToolStarted():
            return f"  tool {event.name} callId={event.call_id} started {_preview(event.arguments)}"
        case ToolFinished():
            if event.error is not None:
                return f"  tool {event.name} callId={event.call_id} failed {_preview(event.error)}"
            return f"  tool {event.name} callId={event.call_id} done {_preview(event.result)}"
        case UsageRecorded(usage=u):
            return (
                f"  usage used={u.used}/{u.token_budget} ({u.usage_ratio:.1%}) "
                f"trimmed={u.trimmed} historyMessages={u.history_messages}"
            )
        case StopRequested():
            by = f" by {event.by}" if event.by else ""
            return f"  stop requested{by} ({event.reason}{_kinds(event.kinds)})"
        case StopMarkerSaved(message=m):
            return f"  stop marker {_preview(m.content)}"
        case TurnRecorded():
            reason = f" reason={event.reason}" if event.reason else ""
            return f"TURN {event.turn_id} ended: {event.outcome}{reason} in {event.duration_ms}ms"
        case SessionDeleted():
            return f"session deleted → generation {event.generation}"
        case ContextCleared():
            return f"context cleared ({', '.join(event.kinds) or 'all'})"
        case SettingsChanged():
            if event.reset:
                return f"setting {event.key} reset"
            return f"setting {event.key} = {event.value!r}"
        case _:
            return event_tag(event)


def history_limit_of(view: SessionView) -> int:
    """The history limit in force: the running (or last) turn's, else the session's."""
    current = view.turns.current
    if current is not None:
        return current.opened.settings.history_limit
    if view.turns.finished:
        return view.turns.finished[-1].opened.settings.history_limit
    value = view.settings.get("historyLimit", 0)
    return value if isinstance(value, int) else 0


def _kinds(kinds: tuple[str, ...]) -> str:
    """A clear's kinds, as an event line or the state shows them (nothing when none)."""
    return f" of {', '.join(kinds)}" if kinds else ""


def state_json(view: SessionView) -> dict[str, Any]:
    """The projected state as plain data (what ``--at --json`` prints)."""
    limit = history_limit_of(view)
    window = history.history_window(view.history, limit)
    active = history.active_history(view.history)
    running, wind = view.queue.running, view.queue.winding_down
    return {
        "session_id": view.session_id,
        "seq": view.seq,
        "generation": view.queue.generation,
        "history_limit": limit,
        "history_active": len(active),
        "history_start": history.window_start(len(active), limit),
        "history_window": [to_builtins(m) for m in window],
        "queued": [w.input.id for w in view.queue.queued],
        "pending": [w.input.id for w in view.queue.pending],
        "running_turn": None if running is None else to_builtins(running),
        # A deletion or clear begun and not finished (the next start finishes it).
        "winding_down": None if wind is None else to_builtins(wind),
        "turns": len(view.turns.finished) + (view.turns.current is not None),
        "settings": dict(view.settings),
    }


def render_state(view: SessionView) -> str:
    """The projected state as readable text."""
    data = state_json(view)
    lines = [
        f"state of {shown_name(str(data['session_id']))} at seq {data['seq']} "
        f"(generation {data['generation']}, {data['turns']} turn(s))",
    ]
    running = view.queue.running
    if running is None:
        lines.append("running turn: none")
    else:
        flags = [
            "human-opened" if running.source is None else f"source={running.source}",
            "accepts inserts" if running.accepts_inserts else "no inserts",
        ]
        if running.stop_requested:
            flags.append("stop requested")
        lines.append(f"running turn: {running.turn_id} ({', '.join(flags)})")
    wind = view.queue.winding_down
    if wind is not None:
        what = "deletion" if wind.kind == "delete" else f"clear{_kinds(wind.kinds)}"
        lines.append(f"{what} begun, not finished (the session's next start finishes it)")
    waiting = queue.waiting(view.queue)
    lines.append(f"queue ({len(view.queue.queued)} queued, {len(view.queue.pending)} pending):")
    for w in waiting:
        where = f"pending → {w.held_for}" if w.held_for else "queued"
        src = "human" if w.input.source is None else f"source={w.input.source}"
        lines.append(f"  #{w.arrival} {w.input.id} {where} ({src})")
    limit = data["history_limit"]
    window = history.history_window(view.history, limit)
    lines.append(
        f"history: {data['history_active']} active message(s), historyLimit={limit}, "
        f"window starts at {data['history_start']}, {len(window)} sent:"
    )
    for m in window:
        lines.append(f"  {_message(m)}")
    return "\n".join(lines)
