"""The tools port: a registry of tools, their groups, and the context a call runs with."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aalis_agent.services.abort import AbortSignal

__all__ = ["Inbound", "Tool", "ToolCallContext", "ToolRegistry"]


@dataclass(frozen=True, slots=True)
class Inbound:
    """Where the turn's inputs came from (TCX1)."""

    source: str | None = None
    from_turn: str | None = None
    message_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    """Built per tool batch (TCX1); ``abort`` is the turn's abort signal (SCH6)."""

    session_id: str
    turn_id: str
    call_id: str
    abort: AbortSignal
    platform: str | None = None
    participants: tuple[str, ...] = ()
    inbound: Inbound = field(default_factory=Inbound)
    user_id: str | None = None


ToolHandler = Callable[[Mapping[str, Any], ToolCallContext], str]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call; ``groups`` empty means always available (FLOW5)."""

    name: str
    handler: ToolHandler
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    groups: tuple[str, ...] = ()

    def definition(self) -> dict[str, Any]:
        """The OpenAI-style function definition sent to the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


class ToolRegistry:
    """Tools by name. Ungrouped tools always apply; grouped ones per enabled groups."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._lock = threading.Lock()
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if not isinstance(tool, Tool):
            what = getattr(tool, "__name__", None)
            hint = (
                f"{what!r:.80} is a {type(tool).__name__}: make it a tool with @tool "
                "(aalis_agent.tool) or Tool(name, handler)"
                if callable(tool) and what
                else f"got {type(tool).__name__}"
            )
            raise TypeError(f"a ToolRegistry holds Tool objects; {hint}")
        with self._lock:
            if tool.name in self._tools:
                raise ValueError(f"tool {tool.name!r} is registered already")
            self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        with self._lock:
            return self._tools.get(name)

    def available(self, enabled_groups: tuple[str, ...] | None) -> list[Tool]:
        """Tools for a session: ``None`` or ``('*',)`` = all groups, ``()`` = none (FLOW5)."""
        with self._lock:
            tools = list(self._tools.values())
        if enabled_groups is None or "*" in enabled_groups:
            return tools
        enabled = set(enabled_groups)
        return [t for t in tools if not t.groups or enabled.intersection(t.groups)]
