"""The session-manager port: a session's origin platform and chat, multi-party or not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SessionDirectory", "SessionInfo", "StaticSessions"]


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the orchestrator needs to know about a session (SCH5, ACC1, ACC3)."""

    session_id: str
    origin_platform: str | None = None
    multi_party: bool = False  # from the root session's origin chat
    parent_id: str | None = None
    venue: str | None = None  # the venue settings layer's key (SET), e.g. "qq:12345"
    peer: str | None = None  # a one-to-one chat's other party (account on origin_platform)

    @property
    def is_child(self) -> bool:
        return self.parent_id is not None


class SessionDirectory(Protocol):
    def info(self, session_id: str) -> SessionInfo: ...


class StaticSessions:
    """Sessions described up front; unknown sessions are single-party with no origin."""

    def __init__(self, sessions: Mapping[str, SessionInfo] | None = None) -> None:
        self._sessions = dict(sessions or {})
        self._last = SessionInfo("")  # the last unknown session's (asked several times a turn)

    def add(self, info: SessionInfo) -> None:
        self._sessions[info.session_id] = info

    def info(self, session_id: str) -> SessionInfo:
        found = self._sessions.get(session_id)
        if found is not None:
            return found
        last = self._last
        if last.session_id != session_id:
            last = self._last = SessionInfo(session_id)
        return last
