"""Per-session settings (SET) and the layers they are read from when a turn opens (SCH5).

Layers, lowest to highest: the plugin config (the ``llm`` preference lives in the llm
service instead), the platform profile, the platform-type profile, the venue, and the
session's own layer (kept in its event log). A key set in a higher layer wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef, TurnSettings
from aalis_agent.services.config import AgentConfig

__all__ = [
    "LAYER_NAMES",
    "SETTING_FIELDS",
    "SettingField",
    "SettingsLayers",
    "SettingsResolver",
    "StaticSettings",
    "validate_setting",
    "venue_of",
]


class SettingsResolver(Protocol):
    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings: ...


def venue_of(platform: str | None, group_id: str | None) -> str | None:
    """The venue key of an input: ``<platform>:<group id>`` for a group, else None."""
    if not group_id:
        return None
    return f"{platform or ''}:{group_id}"


def _turn_settings(values: Mapping[str, Any]) -> TurnSettings:
    llm = values.get("llm")
    groups = values.get("enabledToolGroups")
    return TurnSettings(
        model=ModelRef(provider=llm["provider"], model=llm["model"]) if llm else None,
        think=values.get("think"),
        max_tool_iterations=values.get("maxToolIterations"),
        history_limit=values.get("historyLimit", 0),
        tool_groups=tuple(groups) if groups is not None else None,
        persona=values.get("persona"),
    )


@dataclass(frozen=True, slots=True)
class StaticSettings:
    """Fixed values, overridden by the session layer's keys when set."""

    model: ModelRef | None = None
    think: str | None = None
    max_tool_iterations: int | None = None
    history_limit: int = 0
    tool_groups: tuple[str, ...] | None = None

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        base: dict[str, Any] = {"historyLimit": self.history_limit}
        if self.model is not None:
            base["llm"] = {"provider": self.model.provider, "model": self.model.model}
        if self.think is not None:
            base["think"] = self.think
        if self.max_tool_iterations is not None:
            base["maxToolIterations"] = self.max_tool_iterations
        if self.tool_groups is not None:
            base["enabledToolGroups"] = self.tool_groups
        return _turn_settings({**base, **session_layer})


LAYER_NAMES = ("plugin config", "platform profile", "platform-type profile", "venue", "session")


@dataclass(frozen=True)
class SettingsLayers:
    """The SET layers. Every value is checked when the layers are built; an error names
    the layer, its key (a platform, type or venue) and the setting.

    ``platform_types`` maps a platform to its type; a platform not listed has the type
    written before its first ``:`` (``onebot:main`` is an ``onebot``), else itself.
    """

    config: AgentConfig = field(default_factory=AgentConfig)
    platforms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    types: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    venues: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    platform_types: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, layer in (
            ("platform profile", self.platforms),
            ("platform-type profile", self.types),
            ("venue", self.venues),
        ):
            checked: dict[str, dict[str, Any]] = {}
            for key, values in layer.items():
                where = f"{name} {key!r}"
                if not isinstance(values, Mapping):
                    raise ConfigError(f"{where}: expected a table of settings, got {values!r}")
                checked[key] = {k: validate_setting(k, v, layer=where) for k, v in values.items()}
            object.__setattr__(self, _ATTR[name], checked)

    def type_of(self, platform: str | None) -> str | None:
        if platform is None:
            return None
        if platform in self.platform_types:
            return self.platform_types[platform]
        return platform.split(":", 1)[0]

    def layers(
        self, platform: str | None, venue: str | None, session_layer: Mapping[str, Any]
    ) -> list[tuple[str, Mapping[str, Any]]]:
        """``(layer label, values)`` lowest first, only the layers that apply."""
        config = self.config
        plugin: dict[str, Any] = {"historyLimit": config.history_limit}
        if config.think is not None:
            plugin["think"] = config.think
        if config.max_tool_iterations is not None:
            plugin["maxToolIterations"] = config.max_tool_iterations
        out: list[tuple[str, Mapping[str, Any]]] = [("plugin config", plugin)]
        kind = self.type_of(platform)
        if platform is not None and platform in self.platforms:
            out.append((f"platform profile {platform!r}", self.platforms[platform]))
        if kind is not None and kind in self.types:
            out.append((f"platform-type profile {kind!r}", self.types[kind]))
        if venue is not None and venue in self.venues:
            out.append((f"venue {venue!r}", self.venues[venue]))
        out.append(("session", session_layer))
        return out

    def effective(
        self,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> dict[str, tuple[Any, str]]:
        """Each set key's value and the label of the layer it comes from."""
        out: dict[str, tuple[Any, str]] = {}
        for label, values in self.layers(platform, venue, session_layer):
            for key, value in values.items():
                out[key] = (value, label)
        return out

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        values = {k: v for k, (v, _) in self.effective(platform, session_layer, venue).items()}
        return _turn_settings(values)


_ATTR = {"platform profile": "platforms", "platform-type profile": "types", "venue": "venues"}


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
        SettingField("persona", "人设", False, "默认人设"),
        SettingField("enabledToolGroups", "工具分组", True, "全部"),
    )
}
"""The four keys of this plugin (SET1-SET4), then the persona and the tool groups, which
other plugins own but a turn reads when it opens (SCH5)."""


def validate_setting(key: str, value: Any, *, layer: str = "session") -> Any:
    """The value to store for ``key``, or a ConfigError naming the layer, key and problem."""
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
    if key in ("think", "persona"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected an id, got {value!r}")
        return value
    if key == "enabledToolGroups":
        if isinstance(value, str):
            value = [g for g in (p.strip() for p in value.split(",")) if g]
        if not isinstance(value, list | tuple) or not all(isinstance(g, str) and g for g in value):
            raise ConfigError(f"{where}: expected a list of group names ('*' for all)")
        return list(value)
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
