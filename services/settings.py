"""Settings read once when a turn opens (SCH5): the plugin config under the session layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from events.schema import ModelRef, TurnSettings

__all__ = [
    "SETTING_FIELDS",
    "SettingField",
    "SettingsResolver",
    "StaticSettings",
    "validate_setting",
]


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
        llm = session_layer.get("llm")
        model = ModelRef(provider=llm["provider"], model=llm["model"]) if llm else self.model
        return TurnSettings(
            model=model,
            think=pick("think", self.think),
            max_tool_iterations=pick("maxToolIterations", self.max_tool_iterations),
            history_limit=pick("historyLimit", self.history_limit),
            tool_groups=tuple(groups) if groups is not None else None,
        )


# --- per-session setting fields (SET) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class SettingField:
    """A session-settable key: who may set it and what it accepts."""

    key: str
    label: str
    owner_only: bool
    unset_text: str


SETTING_FIELDS: dict[str, SettingField] = {
    f.key: f
    for f in (
        SettingField("llm", "模型", False, "跟随服务偏好"),
        SettingField("think", "深度思考", False, "按模型的默认档"),
        SettingField("maxToolIterations", "最大工具迭代", True, "不限"),
        SettingField("historyLimit", "历史条数上限", True, "0"),
    )
}


def validate_setting(key: str, value: Any, *, layer: str = "session") -> Any:
    """The value to store for ``key``, or a ConfigError naming the key, layer and problem."""
    from events.errors import ConfigError

    where = f"{layer} setting {key!r}"
    if key not in SETTING_FIELDS:
        raise ConfigError(f"unknown {where}; known: {', '.join(SETTING_FIELDS)}")
    if key == "llm":
        if isinstance(value, str) and value.count("/") >= 1:
            provider, model = value.split("/", 1)
            value = {"provider": provider, "model": model}
        if (
            not isinstance(value, Mapping)
            or not isinstance(value.get("provider"), str)
            or not isinstance(value.get("model"), str)
            or not value["provider"]
            or not value["model"]
        ):
            raise ConfigError(f"{where}: expected <provider>/<model>, got {value!r}")
        return {"provider": value["provider"], "model": value["model"]}
    if key == "think":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected a level id, got {value!r}")
        return value
    number = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if isinstance(number, bool) or not isinstance(number, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    minimum = 1 if key == "maxToolIterations" else 0
    if number < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {number}")
    return number
