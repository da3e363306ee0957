"""Messages between the runtime, session actors and turn runners."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aalis_agent.events import Input, ModelCallStarted, SessionEvent, TurnOutcome
from aalis_agent.events.schema import ReleaseReason
from aalis_agent.request.texts import Texts
from aalis_agent.services.outbound import OutboundMessage

__all__ = [
    "AppendEvents",
    "CallEnded",
    "Clear",
    "Delete",
    "GetView",
    "InputOutcome",
    "InsertionPoint",
    "Passivate",
    "Ping",
    "Release",
    "SetSetting",
    "Settled",
    "Stop",
    "StopCommand",
    "Submit",
]


@dataclass(frozen=True, slots=True)
class InputOutcome:
    """How an input ended: in a turn (with its outcome) or released without one."""

    input_id: str
    turn_id: str | None
    outcome: TurnOutcome | str  # a turn outcome, or "released"
    reason: str | None = None
    reply: str | None = None  # the text the turn replied with (saved, then sent)


class Submit(msgspec.Struct, frozen=True):
    """An input with the session generation it arrived in; ``done`` resolves at its end."""

    input: Input
    generation: int
    done: Future[InputOutcome]
    here: bool = False  # a turn it opens is left for the caller to run (``Runtime.run``)
    # Answered with where the input went once it is durably accepted, when the session
    # had to defer it (a deletion or clear winding down): the submit waits for it, as
    # nothing may be acknowledged before it is in the log.
    handed_on: Future[str] | None = None
    # Its id was given by the runtime (the input came without one) and the session had
    # not received it: no caller can be sending it again, so it is not looked up.
    assigned: bool = False
    # The input as its submitter sent it (under the id ``input`` has), when the input
    # hooks changed it: what the same input sent again is compared with.
    sent: Input | None = None
    # Sent again under an id the session received: the input hooks have not run for it.
    # Taken only as that input sent again (followed, or answered with how it ended);
    # None is answered when the session does not know the id (any more, or yet: a
    # deletion or clear winding down), or when it differs from the input received under
    # it, of which no digest as sent was recorded (the hooks may have rewritten it), and
    # the submit goes through the hooks.
    retry: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the running turn (the stop button); ``platform``/``user_id`` say who."""

    platform: str | None = None
    user_id: str | None = None
    reason: str = "stop"
    turn_id: str | None = None  # only this turn, if it still runs


@dataclass(frozen=True, slots=True)
class StopCommand:
    """``/stop`` from someone (CMD3): only participants and the owner may stop."""

    platform: str | None
    user_id: str | None
    texts: Texts | None = None  # the locale of the reply; default: the platform's


@dataclass(frozen=True, slots=True)
class Release:
    """Stop-all, mute or shutdown: stop, then release queued and pending inputs."""

    reason: ReleaseReason
    platform: str | None = None
    user_id: str | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """Session deletion (DEL1): ``done`` resolves once the turn has wound down."""

    done: Future[int] = field(compare=False)


@dataclass(frozen=True, slots=True)
class Clear:
    """``/clear`` of the given kinds; with none or ``context``, the message history."""

    kinds: tuple[str, ...]
    done: Future[None] = field(compare=False)


class AppendEvents(msgspec.Struct, frozen=True):
    """Facts a turn runner reports, as typed events the actor stamps and logs."""

    turn_id: str
    events: tuple[SessionEvent, ...]
    final: bool = False  # saves the reply: refused when a stop came first
    # Starts a tool: its ``ToolStarted`` is refused when a stop came first (the tool
    # then never runs); the batch's other facts are written.
    starts_tool: bool = False
    # With the reply: the turn ends in the same commit, and its reply (``settle.notice``)
    # is sent by the actor once that commit is durable.
    settle: Settled | None = None


class InsertionPoint(msgspec.Struct, frozen=True):
    """A runner asks which pending inputs join its turn now (FLOW8), committing its
    queued facts in the same batch. Answered with the joined inputs, or None when the
    turn is no longer recorded (stopped by deletion, or not running)."""

    turn_id: str
    events: tuple[SessionEvent, ...] = ()
    started: ModelCallStarted | None = None  # committed instead when none joins


class CallEnded(msgspec.Struct, frozen=True):
    """A model call of the running turn returned, threw or was abandoned."""

    turn_id: str
    index: int
    status: Literal["ok", "error", "aborted"] = "ok"
    tool_calls: int = 0
    error: str | None = None


class Settled(msgspec.Struct, frozen=True):
    """The runner finished its turn: its last facts, recorded with the turn's record in
    one batch, and a message (an error notice, or the reply) to send once that batch is
    durable."""

    turn_id: str
    outcome: TurnOutcome
    reason: str | None = None
    duration_ms: int = 0
    events: tuple[SessionEvent, ...] = ()
    notice: OutboundMessage | None = None


@dataclass(frozen=True, slots=True)
class SetSetting:
    """Set (or reset) a session-layer setting; the value is already validated."""

    key: str
    value: Any = None
    reset: bool = False
    by: str | None = None


@dataclass(frozen=True, slots=True)
class Passivate:
    """Stop if idle for at least ``idle_s`` seconds; the log rebuilds the actor later."""

    idle_s: float


@dataclass(frozen=True, slots=True)
class Ping:
    """Answered once every message before it is handled (tests, quiescence)."""


@dataclass(frozen=True, slots=True)
class GetView:
    """Ask for the actor's projected view."""
