"""The memory/history port: the history a turn sends (FLOW4, SET4).

The default reads the session's history projection. A backend that can count its
history (``count_history``) is read from the window's start on; one that cannot is
read whole and sliced — both give the same window (SET4).
"""

from __future__ import annotations

from typing import Protocol

from aalis_agent.events.schema import ChatMessage
from aalis_agent.projections import history
from aalis_agent.projections.history import HistoryState

__all__ = ["MemoryService", "ProjectionMemory"]


class MemoryService(Protocol):
    def window(
        self, session_id: str, state: HistoryState, limit: int, exclude_turn: str | None
    ) -> list[ChatMessage]:
        """The history sent under ``historyLimit`` = ``limit``, tool groups in order."""
        ...

    def count_history(self, session_id: str, state: HistoryState, exclude_turn: str | None) -> int:
        """How many conversational messages the active history holds."""
        ...


class ProjectionMemory:
    """The default: the session log's history projection, with ``count_history``."""

    def window(
        self, session_id: str, state: HistoryState, limit: int, exclude_turn: str | None
    ) -> list[ChatMessage]:
        active = history.active_history(state, exclude_turn=exclude_turn)
        start = history.window_start(len(active), limit)
        return history.group_tool_calls(active[start:])

    def count_history(self, session_id: str, state: HistoryState, exclude_turn: str | None) -> int:
        return len(history.active_history(state, exclude_turn=exclude_turn))
