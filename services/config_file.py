"""The configuration file (TOML): plugin config, model providers, preferences, settings
layers and personas, checked when it is loaded.

Every problem is a :class:`ConfigError` naming the file, the key (as a dotted path) and
what is wrong; nothing is half-loaded. The layout, with every table optional::

    [agent]                     # the plugin config, CFG1-CFG8 (camelCase keys)
    systemPrompt = "你是助手。"
    historyLimit = 40

    [servicePreferences]        # the global preference
    llm = "local/qwen2.5"

    [pluginServicePreferences.agent]   # this plugin's preference (wins over the global)
    llm = "openai/gpt-4o-mini"

    [providers.openai]          # a provider instance; its id is the table name
    type = "openai-compatible"  # or "scripted" (answers from a script, offline)
    baseUrl = "https://api.openai.com/v1"
    apiKeyEnv = "OPENAI_API_KEY"       # or apiKey = "..." (never logged)
    priority = 10
    timeoutMs = 120000
    listModels = false          # true: also list the server's models at load

    [[providers.openai.models]]
    id = "gpt-4o-mini"
    name = "GPT-4o mini"
    contextLength = 128000
    maxOutputTokens = 4096
    thinkLevels = [{ id = "low", name = "浅", effort = "low" }, { id = "high", name = "深" }]
    defaultThink = "low"

    [platforms]                 # platform -> platform type (default: text before ':')
    "qq-main" = "onebot"

    [settings.platform.qq-main] # settings layers: platform, platformType, venue
    historyLimit = 40
    [settings.platformType.onebot]
    maxToolIterations = 8
    [settings.venue."qq-main:12345"]
    think = "high"

    [personas.helper]
    name = "小助手"
    prompt = "你是小助手。"
    default = true
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef
from aalis_agent.request.limits import MAX_DEPTH, find_unloggable, toml_too_deep
from aalis_agent.services.config import AgentConfig
from aalis_agent.services.llm import ChatModel, ScriptedModel, ScriptedReply, ThinkLevel
from aalis_agent.services.models import LlmService, Provider, parse_model_ref
from aalis_agent.services.outbound import StaticPersonas
from aalis_agent.services.settings import (
    MAX_TIMEOUT_MS,
    MAX_TOKENS,
    SettingsLayers,
    check_config_range,
    shown_value,
    validate_setting,
)

if TYPE_CHECKING:
    from aalis_agent.services import Services

__all__ = ["FileConfig", "describe", "load_config", "parse_config"]

_TOP = {
    "agent",
    "servicePreferences",
    "pluginServicePreferences",
    "providers",
    "platforms",
    "settings",
    "personas",
}
_PROVIDER_KEYS = {
    "type",
    "baseUrl",
    "apiKey",
    "apiKeyEnv",
    "priority",
    "timeoutMs",
    "listModels",
    "models",
    "reply",
}
_MODEL_KEYS = {"id", "name", "contextLength", "maxOutputTokens", "thinkLevels", "defaultThink"}
_PROVIDER_TYPES = ("openai-compatible", "scripted")


@dataclass(frozen=True)
class FileConfig:
    """What a configuration file gives a runtime."""

    path: str
    config: AgentConfig
    llm: LlmService
    settings: SettingsLayers
    personas: StaticPersonas | None
    missing: tuple[str, ...] = ()
    """API-key variables that are not set (only when loaded with ``require_keys=False``)."""

    def services(self, **overrides: Any) -> Services:
        """Services built from this file (any field may be overridden)."""
        from aalis_agent.services import Services

        given: dict[str, Any] = {
            "llm": self.llm,
            "config": self.config,
            "settings": self.settings,
            "persona": self.personas,
        }
        given.update(overrides)
        return Services(**given)


class _Reader:
    """Checks values by dotted key; every error names the file and the key."""

    def __init__(self, file: str, *, require_keys: bool = True) -> None:
        self.file = file
        self.require_keys = require_keys
        self.missing: list[str] = []  # problems let through when keys are not required

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.file}: {key}: {problem}" if key else f"{self.file}: {problem}")

    def table(self, value: Any, key: str) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.error(key, f"expected a table, got {_kind(value)}")
        return value

    def only(self, table: Mapping[str, Any], key: str, known: set[str]) -> None:
        extra = sorted(set(table) - known)
        if extra:
            where = f"{key}.{extra[0]}" if key else extra[0]
            raise self.error(where, f"unknown key (known: {', '.join(sorted(known))})")

    def text(self, table: Mapping[str, Any], key: str, name: str, default: Any = None) -> Any:
        value = table.get(name, default)
        if value is not None and (not isinstance(value, str) or not value):
            raise self.error(f"{key}.{name}", f"expected non-empty text, got {_kind(value)}")
        return value

    def integer(
        self,
        table: Mapping[str, Any],
        key: str,
        name: str,
        default: int,
        minimum: int,
        maximum: int,
    ) -> int:
        value = table.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{key}.{name}", f"expected an integer, got {_kind(value)}")
        if value < minimum:
            raise self.error(f"{key}.{name}", f"must be >= {minimum}, got {shown_value(value)}")
        if value > maximum:
            raise self.error(f"{key}.{name}", f"must be <= {maximum}, got {shown_value(value)}")
        return value

    def flag(self, table: Mapping[str, Any], key: str, name: str) -> bool:
        value = table.get(name, False)
        if not isinstance(value, bool):
            raise self.error(f"{key}.{name}", f"expected true or false, got {_kind(value)}")
        return value


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"text ({shown_value(value)})" if value else "empty text"
    return type(value).__name__


def load_config(
    path: str | Path, *, env: Mapping[str, str] | None = None, require_keys: bool = True
) -> FileConfig:
    """Read and check ``path``. ``env`` (default: the process environment) gives the
    variables named by ``apiKeyEnv``; with ``require_keys=False`` a variable that is not
    set is listed in :attr:`FileConfig.missing` instead of refusing the file. Arrays and
    inline tables nested past :data:`MAX_DEPTH` are refused before the TOML is parsed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    deep = toml_too_deep(text, MAX_DEPTH)
    if deep is not None:
        key, line = deep
        raise ConfigError(f"{p}: {key}: nested deeper than {MAX_DEPTH} levels (line {line})")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse_config(data, file=str(p), env=env, require_keys=require_keys)


def parse_config(
    data: Mapping[str, Any],
    *,
    file: str = "config",
    env: Mapping[str, str] | None = None,
    require_keys: bool = True,
) -> FileConfig:
    """Check an already-parsed configuration; errors name ``file``. Anything the event
    log could not hold is refused by its dotted key: nesting past :data:`MAX_DEPTH`, an
    integer outside 64 bits, text with a lone surrogate; and every number to its range."""
    r = _Reader(file, require_keys=require_keys)
    if not isinstance(data, Mapping):
        raise r.error("", f"expected a table, got {_kind(data)}")
    bad = find_unloggable(data, max_depth=MAX_DEPTH)
    if bad is not None:
        raise r.error(*bad)
    r.only(data, "", _TOP)
    agent = dict(r.table(data.get("agent"), "agent"))
    try:
        config = AgentConfig.from_mapping(agent, where=f"{file}: agent")
        check_config_range(config, where=f"{file}: agent")
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # pragma: no cover - from_mapping names keys itself
        raise r.error("agent", str(exc)) from None
    llm = LlmService(
        _providers(r, data.get("providers"), os.environ if env is None else env),
        plugin_preference=_preference(r, data, plugin=True),
        global_preference=_preference(r, data, plugin=False),
    )
    return FileConfig(
        path=file,
        config=config,
        llm=llm,
        settings=_layers(r, data, config),
        personas=_personas(r, data.get("personas")),
        missing=tuple(r.missing),
    )


def _preference(r: _Reader, data: Mapping[str, Any], *, plugin: bool) -> ModelRef | None:
    if plugin:
        outer = r.table(data.get("pluginServicePreferences"), "pluginServicePreferences")
        r.only(outer, "pluginServicePreferences", {"agent"})
        key = "pluginServicePreferences.agent"
        table = r.table(outer.get("agent"), key)
    else:
        key = "servicePreferences"
        table = r.table(data.get(key), key)
    r.only(table, key, {"llm"})
    if "llm" not in table:
        return None
    return parse_model_ref(table["llm"], where=f"{r.file}: {key}.llm")


def _providers(r: _Reader, value: Any, env: Mapping[str, str]) -> list[Provider]:
    providers: list[Provider] = []
    for pid, spec in r.table(value, "providers").items():
        key = f"providers.{pid}"
        if "/" in pid or not pid:
            raise r.error(key, "a provider id must be non-empty and without '/'")
        t = r.table(spec, key)
        r.only(t, key, _PROVIDER_KEYS)
        kind = r.text(t, key, "type", "openai-compatible")
        if kind not in _PROVIDER_TYPES:
            raise r.error(f"{key}.type", f"expected one of {', '.join(_PROVIDER_TYPES)}")
        priority = r.integer(t, key, "priority", 0, minimum=-1_000_000, maximum=1_000_000)
        models_raw = t.get("models", [])
        if not isinstance(models_raw, list):
            raise r.error(f"{key}.models", "expected a list of tables ([[...models]])")
        specs = [_model_spec(r, m, f"{key}.models[{i}]") for i, m in enumerate(models_raw)]
        seen: set[str] = set()
        for s in specs:
            if s["id"] in seen:
                raise r.error(f"{key}.models", f"model {s['id']!r} is listed twice")
            seen.add(s["id"])
        if kind == "scripted":
            for name in ("baseUrl", "apiKey", "apiKeyEnv", "timeoutMs", "listModels"):
                if name in t:
                    raise r.error(f"{key}.{name}", "not used by a scripted provider")
            reply = r.text(t, key, "reply", "好的。")
            models: list[ChatModel] = [
                ScriptedModel(
                    default=ScriptedReply(text=reply),
                    model_id=s["id"],
                    provider_id=pid,
                    context_length=s["contextLength"],
                    max_output_tokens=s["maxOutputTokens"],
                    name=s["name"],
                    think_levels=s["thinkLevels"],
                    default_think=s["defaultThink"],
                )
                for s in specs
            ]
        else:
            models = _openai_models(r, t, key, pid, specs, env)
        if not models:
            hint = "" if kind == "scripted" else " or set listModels = true"
            raise r.error(key, f"no models: add [[{key}.models]] tables{hint}")
        providers.append(Provider(pid, models, priority=priority))
    return providers


def _openai_models(
    r: _Reader,
    t: Mapping[str, Any],
    key: str,
    pid: str,
    specs: list[dict[str, Any]],
    env: Mapping[str, str],
) -> list[ChatModel]:
    from aalis_agent.services.openai_compat import OpenAICompatibleModel, list_server_models

    if "reply" in t:
        raise r.error(f"{key}.reply", "only a scripted provider takes a reply")
    base_url = r.text(t, key, "baseUrl")
    if base_url is None:
        raise r.error(
            f"{key}.baseUrl", "required: the server's URL, e.g. http://127.0.0.1:11434/v1"
        )
    if "apiKey" in t and "apiKeyEnv" in t:
        raise r.error(key, "give apiKey or apiKeyEnv, not both")
    api_key = r.text(t, key, "apiKey")
    key_env = r.text(t, key, "apiKeyEnv")
    if key_env is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
            # Never echoed: this is where a pasted key would end up.
            raise r.error(f"{key}.apiKeyEnv", "must name an environment variable, not hold a key")
        api_key = env.get(key_env)
        if not api_key:
            problem = r.error(f"{key}.apiKeyEnv", f"the environment variable {key_env} is not set")
            if r.require_keys:
                raise problem
            r.missing.append(str(problem))
    timeout_ms = r.integer(t, key, "timeoutMs", 120_000, minimum=1, maximum=MAX_TIMEOUT_MS)
    if r.flag(t, key, "listModels"):
        listed = {s["id"] for s in specs}
        try:
            served = list_server_models(base_url, api_key, timeout_s=min(timeout_ms / 1000, 30))
        except Exception as exc:
            raise r.error(
                f"{key}.listModels", f"listing the server's models failed: {exc}"
            ) from None
        for m in served:
            if m not in listed:  # a server may list a model twice
                listed.add(m)
                specs.append(_model_spec(r, {"id": m}, key))
    return [
        OpenAICompatibleModel(
            base_url=base_url,
            model=s["id"],
            api_key=api_key,
            provider_id=pid,
            context_length=s["contextLength"],
            max_output_tokens=s["maxOutputTokens"],
            timeout_s=timeout_ms / 1000,
            think_levels=s["thinkLevels"],
            default_think=s["defaultThink"],
            name=s["name"],
            env_key=False,  # a file's provider gets only the key the file names
        )
        for s in specs
    ]


def _model_spec(r: _Reader, value: Any, key: str) -> dict[str, Any]:
    t = r.table(value, key)
    r.only(t, key, _MODEL_KEYS)
    model_id = r.text(t, key, "id")
    if model_id is None:
        raise r.error(f"{key}.id", "required: the model id the server knows")
    levels_raw = t.get("thinkLevels", [])
    if not isinstance(levels_raw, list):
        raise r.error(f"{key}.thinkLevels", "expected a list of {id, name, effort} tables")
    levels: list[ThinkLevel] = []
    level_ids: set[str] = set()
    for i, lv in enumerate(levels_raw):
        lk = f"{key}.thinkLevels[{i}]"
        if isinstance(lv, str):
            lv = {"id": lv}
        lt = r.table(lv, lk)
        r.only(lt, lk, {"id", "name", "effort"})
        level_id = r.text(lt, lk, "id")
        if level_id is None:
            raise r.error(f"{lk}.id", "required")
        if level_id in level_ids:
            raise r.error(lk, f"level {level_id!r} is listed twice")
        level_ids.add(level_id)
        levels.append(
            ThinkLevel(
                id=level_id, name=r.text(lt, lk, "name") or "", effort=r.text(lt, lk, "effort")
            )
        )
    default_think = r.text(t, key, "defaultThink")
    if default_think is not None and default_think not in level_ids:
        raise r.error(f"{key}.defaultThink", f"{default_think!r} is not one of thinkLevels")
    return {
        "id": model_id,
        "name": r.text(t, key, "name"),
        "contextLength": r.integer(
            t, key, "contextLength", 128_000, minimum=1024, maximum=MAX_TOKENS
        ),
        "maxOutputTokens": r.integer(
            t, key, "maxOutputTokens", 4096, minimum=1, maximum=MAX_TOKENS
        ),
        "thinkLevels": tuple(levels),
        "defaultThink": default_think,
    }


def _layers(r: _Reader, data: Mapping[str, Any], config: AgentConfig) -> SettingsLayers:
    platforms = r.table(data.get("platforms"), "platforms")
    for name, kind in platforms.items():
        if not isinstance(kind, str) or not kind:
            raise r.error(f"platforms.{name}", f"expected a platform type, got {_kind(kind)}")
    layers = r.table(data.get("settings"), "settings")
    r.only(layers, "settings", {"platform", "platformType", "venue"})
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for name, label in LAYERS.items():
        tables[name] = {}
        for k, v in r.table(layers.get(name), f"settings.{name}").items():
            values = r.table(v, f"settings.{name}.{k}")
            checked: dict[str, Any] = {}
            for setting, raw in values.items():
                try:
                    checked[setting] = validate_setting(setting, raw, layer=f"{label} {k!r}")
                except ConfigError as exc:
                    raise r.error(f"settings.{name}.{k}.{setting}", str(exc)) from None
            tables[name][k] = checked
    return SettingsLayers(
        config=config,
        platforms=tables["platform"],
        types=tables["platformType"],
        venues=tables["venue"],
        platform_types=dict(platforms),
    )


LAYERS = {"platform": "platform profile", "platformType": "platform-type profile", "venue": "venue"}


def _personas(r: _Reader, value: Any) -> StaticPersonas | None:
    table = r.table(value, "personas")
    if not table:
        return None
    personas: dict[str, tuple[str, str]] = {}
    default: str | None = None
    for pid, spec in table.items():
        key = f"personas.{pid}"
        t = r.table(spec, key)
        r.only(t, key, {"name", "prompt", "default"})
        prompt = r.text(t, key, "prompt")
        if prompt is None:
            raise r.error(f"{key}.prompt", "required: the persona's prompt")
        personas[pid] = (r.text(t, key, "name", pid), prompt)
        if r.flag(t, key, "default"):
            if default is not None:
                raise r.error(f"{key}.default", f"{default!r} is already the default persona")
            default = pid
    return StaticPersonas(personas, default)


def describe(fc: FileConfig) -> str:
    """A readable summary of what ``fc`` gives a runtime (``aalis-agent config``)."""
    from aalis_agent.services.models import entry_id, model_name, think_default, think_levels

    c = fc.config
    prompt = f"{len(c.system_prompt)} chars" if c.system_prompt else "none"
    lines = [
        f"{fc.path}: ok" if not fc.missing else f"{fc.path}: valid, but keys are missing",
        f"plugin config: systemPrompt {prompt}, historyLimit {c.history_limit}, "
        f"maxToolIterations {c.max_tool_iterations or 'unlimited'}, think {c.think or 'unset'}, "
        f"memoryTokenBudget {c.memory_token_budget}, trimThresholdRatio {c.trim_threshold_ratio}",
    ]
    models = fc.llm.models()
    lines.append(f"models ({len(models)}, in priority order):")
    for m in models:
        levels = think_levels(m)
        default = think_default(m)
        think = (
            "; think "
            + ", ".join(lv.id + (f" ({lv.name})" if lv.name else "") for lv in levels)
            + f", default {default.id}"
            if levels and default is not None
            else ""
        )
        lines.append(
            f"  {entry_id(m)}  {model_name(m)} · context {m.context_length} · "
            f"max output {m.max_output_tokens}{think}"
        )
    for label, ref in (
        ("this plugin's preference", fc.llm.plugin_preference),
        ("global preference", fc.llm.global_preference),
    ):
        if ref is not None:
            there = "present" if fc.llm.find(ref) is not None else "MISSING: falls back"
            lines.append(f"{label}: {ref} ({there})")
    if models:
        choice = fc.llm.resolve(None, warn=False)
        lines.append(f"a session without an llm setting uses: {choice.entry_id} ({choice.source})")
    else:
        lines.append("no models: chat falls back to its scripted model")
    layers = fc.settings
    for label, table in (
        ("platform profile", layers.platforms),
        ("platform-type profile", layers.types),
        ("venue", layers.venues),
    ):
        for key, values in table.items():
            shown = ", ".join(f"{k} {_shown(v)}" for k, v in values.items()) or "(empty)"
            lines.append(f"{label} {key!r}: {shown}")
    for platform, kind in layers.platform_types.items():
        lines.append(f"platform {platform!r} is of type {kind!r}")
    for problem in fc.missing:
        lines.append(f"not usable here: {problem}")
    if fc.personas is not None:
        names = [
            pid + (" (default)" if pid == fc.personas.default else "")
            for pid, _ in fc.personas.list()
        ]
        lines.append("personas: " + ", ".join(names))
    return "\n".join(lines) + "\n"


def _shown(value: Any) -> str:
    if isinstance(value, Mapping) and {"provider", "model"} <= value.keys():
        return f"{value['provider']}/{value['model']}"
    return str(value)
