"""Settings read once when a turn opens (SCH5): the plugin config under the session layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from events.schema import ModelRef, TurnSettings

__all__ = ["SettingsResolver", "StaticSettings"]


class SettingsResolver(Protocol):
    def for_turn(
        self, session_id: str, platform: str | None, session_layer: Mapping[str, Any]
    ) -> TurnSettings: ...


@dataclass(frozen=True, slots=True)
class StaticSettings:
    """Plugin-config values, overridden by the session layer's keys when set."""

    model: ModelRef | None = None
    think: str | None = None
    max_tool_iterations: int | None = None
    history_limit: int = 0
    tool_groups: tuple[str, ...] | None = None

    def for_turn(
        self, session_id: str, platform: str | None, session_layer: Mapping[str, Any]
    ) -> TurnSettings:
        def pick(key: str, default: Any) -> Any:
            return session_layer.get(key, default)

        groups = pick("enabledToolGroups", self.tool_groups)
        return TurnSettings(
            model=self.model,
            think=pick("think", self.think),
            max_tool_iterations=pick("maxToolIterations", self.max_tool_iterations),
            history_limit=pick("historyLimit", self.history_limit),
            tool_groups=tuple(groups) if groups is not None else None,
        )
