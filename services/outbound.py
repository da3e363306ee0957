"""Sending (OUT1-OUT2): the gateway port, and the message archive port (ARC1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

from aalis_agent.events import ConfigError

__all__ = [
    "Gateway",
    "LogArchive",
    "MessageArchive",
    "OutboundKind",
    "OutboundMessage",
    "PersonaService",
    "StaticPersonas",
]


OutboundKind: TypeAlias = Literal["reply", "error", "system"]


@dataclass(frozen=True, slots=True)
class OutboundMessage:
    """A reply or a notice leaving a turn; always carries the turn id (OUT2)."""

    session_id: str
    turn_id: str | None
    content: str
    kind: OutboundKind = "reply"
    platform: str | None = None
    host_notice: dict[str, str] | None = None  # {kind, id} when replying to a host notice
    reply_to: str | None = None


class Gateway(Protocol):
    """Outbound middleware and dispatch to the platform adapters."""

    def dispatch_outbound(self, message: OutboundMessage) -> None: ...


class MessageArchive(Protocol):
    """Where messages are archived; the default is the session's own log."""

    name: str


class LogArchive:
    """The default archive: messages are ``MessageSaved`` events in the session log."""

    name = "session-log"


class PersonaService(Protocol):
    def prompt(self, persona_id: str | None) -> str | None: ...

    def list(self) -> list[tuple[str, str]]: ...


class StaticPersonas:
    """Personas given up front as ``{id: (name, prompt)}``; ``default`` when none is set.

    A persona that is not a ``(name, prompt)`` pair of texts, or a ``default`` that names
    none of them, is refused with :class:`ConfigError` naming it (a bare prompt would be
    read as a pair, and an unknown default would leave every session with no persona).
    """

    def __init__(self, personas: dict[str, tuple[str, str]], default: str | None = None) -> None:
        self._personas = dict(personas)
        for pid, entry in self._personas.items():
            if not (
                isinstance(pid, str)
                and isinstance(entry, tuple | list)
                and len(entry) == 2
                and all(isinstance(part, str) for part in entry)
            ):
                raise ConfigError(
                    f"persona {pid!r:.80}: expected a (name, prompt) pair of texts, "
                    f"got {type(entry).__name__} {entry!r:.80}"
                )
        if default is not None and default not in self._personas:
            known = ", ".join(repr(k) for k in sorted(self._personas)) or "none"
            raise ConfigError(
                f"default persona {default!r:.80} is not one of them (known: {known})"
            )
        self._default = default

    def prompt(self, persona_id: str | None) -> str | None:
        key = persona_id or self._default
        if key is None or key not in self._personas:
            return None
        return self._personas[key][1]

    def list(self) -> list[tuple[str, str]]:
        return [(pid, name) for pid, (name, _) in sorted(self._personas.items())]

    @property
    def default(self) -> str | None:
        """The persona used when a session sets none."""
        return self._default
