"""Per-session settings (SET) and the layers they are read from when a turn opens (SCH5).

Layers, lowest to highest: the plugin config (the ``llm`` preference lives in the llm
service instead), the platform profile, the platform-type profile, the venue, and the
session's own layer (kept in its event log). A key set in a higher layer wins.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef, TurnSettings
from aalis_agent.request.limits import INT64_MAX, has_lone_surrogate
from aalis_agent.request.locales import check_locale
from aalis_agent.services.config import AgentConfig, keyed

__all__ = [
    "CONFIG_MAXIMA",
    "LAYER_KEYS",
    "LAYER_NAMES",
    "MAX_ID_CHARS",
    "MAX_RATIO",
    "MAX_TIMEOUT_MS",
    "MAX_TOKENS",
    "MAX_TOOL_GROUPS",
    "SETTING_FIELDS",
    "SETTING_MAXIMA",
    "SettingField",
    "SettingsLayers",
    "SettingsResolver",
    "StaticSettings",
    "check_config_range",
    "check_setting_key",
    "shown_value",
    "validate_setting",
    "venue_of",
]

# --- what the log can hold ------------------------------------------------------------

MAX_TOKENS = 1_000_000_000
"""Upper bound of a token count (a context window, an output limit, a budget)."""

MAX_TIMEOUT_MS = 2**31 - 1
"""Upper bound of a timeout in milliseconds: the source's (JavaScript) timer limit, about
24.8 days; far below what Python's own waits accept."""

MAX_RATIO = 1000.0
"""Upper bound of ``trimThresholdRatio``: the trim budget (contextLength × ratio) stays a
count the log and the arithmetic hold."""

MAX_ID_CHARS = 256
"""Longest id a setting holds (a model, provider, level, persona or tool-group id)."""

MAX_TOOL_GROUPS = 256
"""Most tool groups ``enabledToolGroups`` lists."""

SETTING_MAXIMA: dict[str, int] = {"maxToolIterations": INT64_MAX, "historyLimit": INT64_MAX}
"""The integer settings' upper bounds: what the log's 64-bit integers hold (SET3, SET4)."""

CONFIG_MAXIMA: dict[str, float] = {
    "memoryTokenBudget": MAX_TOKENS,
    "promptBuildTimeoutMs": MAX_TIMEOUT_MS,
    "trimThresholdRatio": MAX_RATIO,
    **SETTING_MAXIMA,
}
"""Upper bounds of the plugin config's numbers (CFG2, CFG3, CFG5, CFG7, CFG8); the lower
bounds and types are :class:`AgentConfig`'s."""

_SHOW = reprlib.Repr()
_SHOW.maxstring = 60
_SHOW.maxother = 60
_SHOW.maxlevel = 3
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = 4


def shown_value(value: Any) -> str:
    """``repr(value)`` for an error message, shortened: never deep, long or unprintable
    (a huge integer is described, text is escaped as ``repr`` does)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    try:
        return _SHOW.repr(value)
    except (ValueError, RecursionError):  # an integer past the digit limit, a strange type
        return f"a {type(value).__name__}"


def check_config_range(
    config: AgentConfig, *, where: str = "config", table: str | None = None
) -> None:
    """Refuse plugin-config numbers above :data:`CONFIG_MAXIMA` (ConfigError naming the
    key), so every count a turn derives from them fits in the log."""
    for key, value in config.to_mapping().items():
        limit = CONFIG_MAXIMA.get(key)
        if limit is not None and isinstance(value, int | float) and value > limit:
            bound = int(limit) if float(limit).is_integer() else limit
            raise ConfigError(
                keyed(where, f"{key} must be <= {bound}, got {shown_value(value)}", table)
            )


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

    def __post_init__(self) -> None:
        where = "static settings"
        validate_setting("historyLimit", self.history_limit, layer=where)
        if self.max_tool_iterations is not None:
            validate_setting("maxToolIterations", self.max_tool_iterations, layer=where)
        if self.think is not None:
            validate_setting("think", self.think, layer=where)
        if self.tool_groups is not None:
            validate_setting("enabledToolGroups", self.tool_groups, layer=where)
        if self.model is not None:
            model = {"provider": self.model.provider, "model": self.model.model}
            validate_setting("llm", model, layer=where)

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
                if not isinstance(key, str) or has_lone_surrogate(key):
                    raise ConfigError(f"{name} {shown_value(key)}: the key must be valid text")
                where = f"{name} {key!r}"
                if not isinstance(values, Mapping):
                    raise ConfigError(
                        f"{where}: expected a table of settings, got {shown_value(values)}"
                    )
                checked[key] = {k: validate_setting(k, v, layer=where) for k, v in values.items()}
            object.__setattr__(self, _ATTR[name], checked)
        # Its own copy: a mapping changed by its caller afterwards changes nothing here.
        object.__setattr__(self, "platform_types", dict(self.platform_types))
        # The layers below the session's never change: what they give a platform and a
        # venue is worked out once (a turn asks twice: its settings, its locale). Not in
        # a subclass that words them otherwise (its own ``layers``, ``effective`` or
        # ``type_of``): it is asked each time, as it would be without this.
        cls = type(self)
        own = all(
            getattr(cls, name) is getattr(SettingsLayers, name)
            for name in ("layers", "effective", "type_of")
        )
        object.__setattr__(self, "_fixed_cache", {} if own else None)

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

    def _fixed(
        self, platform: str | None, venue: str | None
    ) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
        """What the layers below the session's give ``platform`` and ``venue``: each key's
        value with its layer's label, and the values alone (both shared: not to change)."""
        cache: dict[tuple[str | None, str | None], Any] = self._fixed_cache  # type: ignore[attr-defined]
        key = (platform, venue)
        hit = cache.get(key)
        if hit is None:
            labelled: dict[str, tuple[Any, str]] = {}
            for label, values in self.layers(platform, venue, {})[:-1]:  # not the session's
                for name, value in values.items():
                    labelled[name] = (value, label)
            if len(cache) >= _FIXED_KEPT:
                cache.clear()
            hit = cache[key] = (labelled, {k: v for k, (v, _) in labelled.items()})
        return hit

    def _effective_by_layers(
        self, platform: str | None, session_layer: Mapping[str, Any], venue: str | None
    ) -> dict[str, tuple[Any, str]]:
        out: dict[str, tuple[Any, str]] = {}
        for label, values in self.layers(platform, venue, session_layer):
            for key, value in values.items():
                out[key] = (value, label)
        return out

    def effective(
        self,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> dict[str, tuple[Any, str]]:
        """Each set key's value and the label of the layer it comes from."""
        if self._fixed_cache is None:  # type: ignore[attr-defined]
            return self._effective_by_layers(platform, session_layer, venue)
        out = dict(self._fixed(platform, venue)[0])
        for key, value in session_layer.items():
            out[key] = (value, "session")
        return out

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        if self._fixed_cache is None:  # type: ignore[attr-defined]
            eff = self.effective(platform, session_layer, venue)
            return _turn_settings({k: v for k, (v, _) in eff.items()})
        return _turn_settings({**self._fixed(platform, venue)[1], **session_layer})

    def locale_for(self, platform: str | None, venue: str | None = None) -> str | None:
        """The ``locale`` the highest layer that sets one gives ``platform`` and ``venue``
        (platform profile, then platform type, then venue); None when none sets it (the
        runtime's own, ``AgentConfig.locale``, applies)."""
        if self._fixed_cache is None:  # type: ignore[attr-defined]
            found = self.effective(platform, {}, venue).get("locale")
        else:
            found = self._fixed(platform, venue)[0].get("locale")
        return found[0] if found is not None else None


_ATTR = {"platform profile": "platforms", "platform-type profile": "types", "venue": "venues"}
_FIXED_KEPT = 4096  # (platform, venue) pairs whose lower layers are kept worked out


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


LAYER_KEYS = frozenset({"locale"})
"""Keys a settings layer (a platform, a platform type, a venue) may set besides the
session's fields: ``locale``, the language its sessions' texts are in."""


def check_setting_key(
    key: Any, *, layer: str = "session", shown: Callable[[Any], str] = shown_value
) -> None:
    """A ConfigError naming ``key`` (shown by ``shown``) and the known keys unless it is
    one of :data:`SETTING_FIELDS` or :data:`LAYER_KEYS`."""
    if not isinstance(key, str) or (key not in SETTING_FIELDS and key not in LAYER_KEYS):
        raise ConfigError(
            f"unknown {layer} setting {shown(key)}; "
            f"known: {', '.join([*SETTING_FIELDS, *sorted(LAYER_KEYS)])}"
        )


def validate_setting(
    key: str, value: Any, *, layer: str = "session", shown: Callable[[Any], str] = shown_value
) -> Any:
    """The value to store for ``key``, or a ConfigError naming the layer, key and problem
    (the key, a hint and a wrong value shown by ``shown``: as Python spells them unless
    told otherwise; a configuration file passes ``toml_value``, which spells them as the
    file does, ``/session.set`` passes ``json_value``).

    Every value is checked to the type and range the log holds: integers within
    :data:`SETTING_MAXIMA`, ids valid text (no lone surrogates) of at most
    :data:`MAX_ID_CHARS` characters, at most :data:`MAX_TOOL_GROUPS` tool groups."""
    if key in LAYER_KEYS:
        return check_locale(value, where=f"{layer} setting {shown(key)}", shown=shown)
    check_setting_key(key, layer=layer, shown=shown)
    where = f"{layer} setting {shown(key)}"
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
            raise ConfigError(f"{where}: expected <provider>/<model>, got {shown(value)}")
        provider, model = value["provider"], value["model"]
        _check_id(where, provider, shown)
        _check_id(where, model, shown)
        return {"provider": provider, "model": model}
    if key in ("think", "persona"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected an id, got {shown(value)}")
        _check_id(where, value, shown)
        return value
    if key == "enabledToolGroups":
        if isinstance(value, str):
            if len(value) > MAX_TOOL_GROUPS * (MAX_ID_CHARS + 1):
                raise ConfigError(f"{where}: too long ({len(value)} characters)")
            value = [g for g in (p.strip() for p in value.split(",")) if g]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list of group names ({shown('*')} for all)")
        if len(value) > MAX_TOOL_GROUPS:
            raise ConfigError(f"{where}: at most {MAX_TOOL_GROUPS} groups, got {len(value)}")
        if not all(isinstance(g, str) and g for g in value):
            raise ConfigError(f"{where}: expected a list of group names ({shown('*')} for all)")
        for g in value:
            _check_id(where, g, shown)
        return list(value)
    return _integer(where, value, minimum=1 if key == "maxToolIterations" else 0, shown=shown)


_INTEGER_TEXT = re.compile(r"\s*([+-]?)0*([0-9]+)\s*", re.ASCII)


def _integer(
    where: str,
    value: Any,
    *,
    minimum: int,
    maximum: int = INT64_MAX,
    shown: Callable[[Any], str] = shown_value,
) -> int:
    number = value
    if isinstance(value, str):
        m = _INTEGER_TEXT.fullmatch(value)
        if m is None:
            raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
        if len(m[2]) > len(str(maximum)):  # never converts thousands of digits
            raise ConfigError(f"{where}: must be <= {maximum}, got {shown(value)}")
        number = int(m[1] + m[2])
    if isinstance(number, bool) or not isinstance(number, int):
        raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
    if number < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {shown(number)}")
    if number > maximum:
        raise ConfigError(f"{where}: must be <= {maximum}, got {shown(number)}")
    return int(number)


def _check_id(where: str, value: str, shown: Callable[[Any], str] = shown_value) -> None:
    if has_lone_surrogate(value):
        raise ConfigError(f"{where}: {shown(value)} is not valid text (a lone surrogate)")
    if len(value) > MAX_ID_CHARS:
        raise ConfigError(
            f"{where}: an id of at most {MAX_ID_CHARS} characters, got {len(value)} characters"
        )
