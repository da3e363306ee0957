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
    timeoutMs = 120000          # the longest wait on the server (to connect, for more)
    maxReplyMs = 1800000        # the longest a whole reply may stream
    maxRetries = 3              # a 429 or 5xx answer is sent again this many times
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

    [mcp.files]                 # an MCP tool server (services/mcp.py); its name is the table's
    command = "uvx"             # run over stdio: command, args, env, cwd
    args = ["mcp-server-filesystem", "."]
    env = { LOG_LEVEL = "warning" }
    group = "files"             # the tool group its tools join (default: the server's name)
    timeoutMs = 60000           # a tool call's limit; startupTimeoutMs limits connecting
    maxLineBytes = 16777216     # a stdio server's longest line (one message) read
    [mcp.search]
    url = "http://127.0.0.1:8000/mcp"   # or streamable HTTP: url (and headers)
    toolPrefix = "search_"      # prepended to its tool names (default: none)
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect as mi
from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef
from aalis_agent.request.limits import MAX_DEPTH, find_unloggable, toml_too_deep
from aalis_agent.services import shapes
from aalis_agent.services.config import AgentConfig, toml_key, toml_path, toml_value
from aalis_agent.services.files import read_text_file
from aalis_agent.services.llm import ChatModel, ScriptedModel, ScriptedReply, ThinkLevel
from aalis_agent.services.mcp import DEFAULT_MAX_LINE_BYTES, McpServer
from aalis_agent.services.models import LlmService, Provider, parse_model_ref
from aalis_agent.services.outbound import StaticPersonas
from aalis_agent.services.settings import (
    MAX_TIMEOUT_MS,
    MAX_TOKENS,
    SettingsLayers,
    check_config_range,
    validate_setting,
)
from aalis_agent.services.shapes import bare, info_at, value_at
from msgspec import Meta

MAX_LINE_BYTES = 1 << 30
"""The most ``maxLineBytes`` an MCP server may be given: a line is held whole while it is read."""

if TYPE_CHECKING:
    from aalis_agent.services import Services

__all__ = ["FileConfig", "describe", "load_config", "parse_config"]

T = TypeVar("T")

# --- the file's shape, checked by msgspec ------------------------------------------------
# A table keyed by a name the file chooses (providers, personas, platforms, settings
# layers) is ``dict[str, Any]`` here and each entry is converted on its own: msgspec's
# error path does not name dict keys, and every error must. ``extra`` gives an error its
# words: ``what`` is what a value should be, ``required`` what a missing key is for.

Text = Annotated[str, Meta(min_length=1)]
ModelId = Annotated[str, Meta(min_length=1, extra={"required": "the model id the server knows"})]
Prompt = Annotated[str, Meta(min_length=1, extra={"required": "the persona's prompt"})]
PlatformType = Annotated[str, Meta(min_length=1, extra={"what": "a platform type"})]
Tokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]


class _Spec(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """A table of the file: camelCase keys, an unknown key refused."""


class _Preference(_Spec):
    llm: Any = msgspec.UNSET  # parse_model_ref checks it


class _PluginPreferences(_Spec):
    agent: _Preference = msgspec.field(default_factory=_Preference)


class _ThinkLevel(_Spec):
    id: Text
    name: Text | None = None
    effort: Text | None = None


class _Model(_Spec):
    id: ModelId
    name: Text | None = None
    context_length: Annotated[int, Meta(ge=1024, le=MAX_TOKENS)] = 128_000
    max_output_tokens: Tokens = 4096
    think_levels: Annotated[
        list[Text | _ThinkLevel], Meta(extra={"what": "a list of {id, name, effort} tables"})
    ] = msgspec.field(default_factory=list)
    default_think: Text | None = None


class _Provider(_Spec):
    kind: Literal["openai-compatible", "scripted"] = msgspec.field(
        default="openai-compatible", name="type"
    )
    base_url: Text | None = None
    api_key: Text | None = None
    api_key_env: Text | None = None
    priority: Annotated[int, Meta(ge=-1_000_000, le=1_000_000)] = 0
    timeout_ms: Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_MS)] = 120_000
    max_reply_ms: Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_MS)] = 1_800_000
    max_retries: Annotated[int, Meta(ge=0, le=10)] = 3
    list_models: bool = False
    models: Annotated[
        list[dict[str, Any]], Meta(extra={"what": "a list of tables ([[...models]])"})
    ] = msgspec.field(default_factory=list)
    reply: Text = "好的。"


class _Persona(_Spec):
    prompt: Prompt
    name: Text | None = None
    default: bool = False


class _Mcp(_Spec):
    command: Text | None = None
    args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, Any] | None = None  # each value checked on its own, naming its key
    cwd: Text | None = None
    url: Annotated[str, Meta(pattern=r"^https?://", extra={"what": "an http(s) URL"})] | None = None
    headers: dict[str, Any] | None = None
    group: Text | None = None
    tool_prefix: str = ""
    timeout_ms: Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_MS)] = 60_000
    startup_timeout_ms: Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_MS)] = 30_000
    max_line_bytes: Annotated[int, Meta(ge=1, le=MAX_LINE_BYTES)] = DEFAULT_MAX_LINE_BYTES


class _Layers(_Spec):
    platform: dict[str, Any] = msgspec.field(default_factory=dict)
    platform_type: dict[str, Any] = msgspec.field(default_factory=dict)
    venue: dict[str, Any] = msgspec.field(default_factory=dict)


class _File(_Spec):
    agent: dict[str, Any] = msgspec.field(default_factory=dict)  # AgentConfig checks it
    service_preferences: _Preference = msgspec.field(default_factory=_Preference)
    plugin_service_preferences: _PluginPreferences = msgspec.field(
        default_factory=_PluginPreferences
    )
    providers: dict[str, Any] = msgspec.field(default_factory=dict)
    platforms: dict[str, Any] = msgspec.field(default_factory=dict)
    settings: _Layers = msgspec.field(default_factory=_Layers)
    personas: dict[str, Any] = msgspec.field(default_factory=dict)
    mcp: dict[str, Any] = msgspec.field(default_factory=dict)


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
    mcp: tuple[McpServer, ...] = ()
    """The MCP tool servers (``[mcp.<name>]``); connect them with ``McpClient(fc.mcp)``."""

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
    """Converts tables by dotted key; every error names the file and the key."""

    def __init__(self, file: str, *, require_keys: bool = True) -> None:
        self.file = file
        self.require_keys = require_keys
        self.missing: list[str] = []  # problems let through when keys are not required

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.file}: {key}: {problem}" if key else f"{self.file}: {problem}")

    def convert(self, value: Any, tp: type[T], key: str) -> T:
        """``value`` as ``tp`` (msgspec checks it), or a ConfigError naming the key."""
        try:
            return msgspec.convert(value, tp)
        except msgspec.ValidationError as exc:
            where, problem = _explain(str(exc), value, tp)
            raise self.error(_join(key, where), problem) from None


# --- msgspec's errors in the file's words ----------------------------------------------


def _explain(error: str, value: Any, tp: Any) -> tuple[str, str]:
    """``(dotted key, problem)`` for msgspec's ``error`` converting ``value`` to ``tp``:
    its path ``$.a.b[0]`` becomes ``a.b[0]`` (a part TOML quotes, quoted), and the
    problem names what the key takes and what it got."""
    message, steps = shapes.split_error(error)
    info = info_at(mi.type_info(tp), steps)
    where = toml_path(tuple(steps))
    field = shapes.FIELD.match(message)
    if field is not None:
        struct = bare(info, mi.StructType)
        fields = {f.encode_name: f.type for f in struct.fields} if struct else {}
        if field["how"] == "contains unknown":
            problem = f"unknown key (known: {', '.join(sorted(fields))})"
        else:
            hint = shapes.extra(fields.get(field["name"])).get("required")
            problem = f"required: {hint}" if hint else "required"
        return _join(where, toml_key(field["name"])), problem
    got = value_at(value, steps)
    bound = shapes.RANGE.match(message)
    if bound is not None:
        return where, f"must be {bound['op']} {bound['bound']}, got {toml_value(got)}"
    if message.startswith(("Expected `", "Invalid enum value")):
        return where, f"expected {shapes.what(info)}, got {shapes.kind(got, toml_value)}"
    return where, message[:1].lower() + message[1:]


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key and name and not name.startswith("[") else key + name


# --- loading ------------------------------------------------------------------------------


def load_config(
    path: str | Path, *, env: Mapping[str, str] | None = None, require_keys: bool = True
) -> FileConfig:
    """Read and check ``path``. ``env`` (default: the process environment) gives the
    variables named by ``apiKeyEnv``; with ``require_keys=False`` a variable that is not
    set is listed in :attr:`FileConfig.missing` instead of refusing the file. Arrays and
    inline tables nested past :data:`MAX_DEPTH` are refused before the TOML is parsed."""
    p = Path(path)
    text = read_text_file(p, "configuration")
    deep = toml_too_deep(text, MAX_DEPTH, shown=toml_path)
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
    bad = find_unloggable(data, max_depth=MAX_DEPTH, shown=toml_path)
    if bad is not None:
        raise r.error(*bad)
    spec = r.convert(data, _File, "")
    try:
        config = AgentConfig.from_mapping(dict(spec.agent), where=file, table="agent")
        check_config_range(config, where=file, table="agent")
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # pragma: no cover - from_mapping names keys itself
        raise r.error("agent", str(exc)) from None
    llm = LlmService(
        _providers(r, spec.providers, os.environ if env is None else env),
        plugin_preference=_preference(
            r, spec.plugin_service_preferences.agent, "pluginServicePreferences.agent"
        ),
        global_preference=_preference(r, spec.service_preferences, "servicePreferences"),
    )
    return FileConfig(
        path=file,
        config=config,
        llm=llm,
        settings=_layers(r, spec, config),
        personas=_personas(r, spec.personas),
        missing=tuple(r.missing),
        mcp=_mcp_servers(r, spec.mcp),
    )


def _preference(r: _Reader, pref: _Preference, key: str) -> ModelRef | None:
    if pref.llm is msgspec.UNSET:
        return None
    return parse_model_ref(pref.llm, where=f"{r.file}: {key}.llm", shown=toml_value)


_NOT_SCRIPTED = (
    "baseUrl",
    "apiKey",
    "apiKeyEnv",
    "timeoutMs",
    "maxReplyMs",
    "maxRetries",
    "listModels",
)


def _providers(r: _Reader, table: dict[str, Any], env: Mapping[str, str]) -> list[Provider]:
    providers: list[Provider] = []
    for pid, raw in table.items():
        key = f"providers.{toml_key(pid)}"
        if "/" in pid or not pid:
            raise r.error(key, 'a provider id must be non-empty and without "/"')
        p = r.convert(raw, _Provider, key)
        specs = [_model_spec(r, m, f"{key}.models[{i}]") for i, m in enumerate(p.models)]
        seen: set[str] = set()
        for s, _ in specs:
            if s.id in seen:
                raise r.error(f"{key}.models", f"model {toml_value(s.id)} is listed twice")
            seen.add(s.id)
        if p.kind == "scripted":
            for name in _NOT_SCRIPTED:
                if name in raw:
                    raise r.error(f"{key}.{name}", "not used by a scripted provider")
            models: list[ChatModel] = [
                ScriptedModel(
                    default=ScriptedReply(text=p.reply),
                    model_id=s.id,
                    provider_id=pid,
                    context_length=s.context_length,
                    max_output_tokens=s.max_output_tokens,
                    name=s.name,
                    think_levels=levels,
                    default_think=s.default_think,
                )
                for s, levels in specs
            ]
        else:
            if "reply" in raw:
                raise r.error(f"{key}.reply", "only a scripted provider takes a reply")
            models = _openai_models(r, p, key, pid, specs, env)
        if not models:
            hint = "" if p.kind == "scripted" else " or set listModels = true"
            raise r.error(key, f"no models: add [[{key}.models]] tables{hint}")
        providers.append(Provider(pid, models, priority=p.priority))
    return providers


def _openai_models(
    r: _Reader,
    p: _Provider,
    key: str,
    pid: str,
    specs: list[tuple[_Model, tuple[ThinkLevel, ...]]],
    env: Mapping[str, str],
) -> list[ChatModel]:
    from aalis_agent.services.openai_compat import OpenAICompatibleModel, list_server_models

    base_url = p.base_url
    if base_url is None:
        raise r.error(
            f"{key}.baseUrl", "required: the server's URL, e.g. http://127.0.0.1:11434/v1"
        )
    parsed = urlsplit(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise r.error(
            f"{key}.baseUrl",
            f"expected an http:// or https:// URL with a host, got {toml_value(base_url)}",
        )
    if p.api_key is not None and p.api_key_env is not None:
        raise r.error(key, "give apiKey or apiKeyEnv, not both")
    api_key = p.api_key
    key_env = p.api_key_env
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
    if p.list_models:
        listed = {s.id for s, _ in specs}
        try:
            served = list_server_models(base_url, api_key, timeout_s=min(p.timeout_ms / 1000, 30))
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
            model=s.id,
            api_key=api_key,
            provider_id=pid,
            context_length=s.context_length,
            max_output_tokens=s.max_output_tokens,
            timeout_s=p.timeout_ms / 1000,
            max_reply_s=p.max_reply_ms / 1000,
            max_retries=p.max_retries,
            think_levels=levels,
            default_think=s.default_think,
            name=s.name,
            env_key=False,  # a file's provider gets only the key the file names
        )
        for s, levels in specs
    ]


def _model_spec(r: _Reader, value: Any, key: str) -> tuple[_Model, tuple[ThinkLevel, ...]]:
    """A model table and its think levels (a level may be given as its id alone)."""
    spec = r.convert(value, _Model, key)
    levels: list[ThinkLevel] = []
    for i, lv in enumerate(spec.think_levels):
        level = ThinkLevel(id=lv) if isinstance(lv, str) else _think_level(lv)
        if any(seen.id == level.id for seen in levels):
            raise r.error(
                f"{key}.thinkLevels[{i}]", f"level {toml_value(level.id)} is listed twice"
            )
        levels.append(level)
    default = spec.default_think
    if default is not None and all(lv.id != default for lv in levels):
        raise r.error(f"{key}.defaultThink", f"{toml_value(default)} is not one of thinkLevels")
    return spec, tuple(levels)


def _think_level(lv: _ThinkLevel) -> ThinkLevel:
    return ThinkLevel(id=lv.id, name=lv.name or "", effort=lv.effort)


def _layers(r: _Reader, spec: _File, config: AgentConfig) -> SettingsLayers:
    platforms = {
        name: r.convert(kind, PlatformType, f"platforms.{toml_key(name)}")
        for name, kind in spec.platforms.items()
    }
    given = {"platform": spec.settings.platform, "platformType": spec.settings.platform_type}
    given["venue"] = spec.settings.venue
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for name, label in LAYERS.items():
        tables[name] = {}
        for k, v in given[name].items():
            at = f"settings.{name}.{toml_key(k)}"
            values = r.convert(v, dict[str, Any], at)
            checked: dict[str, Any] = {}
            for setting, raw in values.items():
                if setting in _NOT_TEXT and isinstance(raw, str):
                    # a file writes a list or a number as such (/session.set takes text)
                    raise r.error(
                        f"{at}.{toml_key(setting)}",
                        f"{label} {toml_value(k)} setting {toml_value(setting)}: "
                        f"must be {_NOT_TEXT[setting]}, "
                        f"not a string: {toml_value(raw)}",
                    )
                try:
                    checked[setting] = validate_setting(
                        setting, raw, layer=f"{label} {toml_value(k)}", shown=toml_value
                    )
                except ConfigError as exc:
                    raise r.error(f"{at}.{toml_key(setting)}", str(exc)) from None
            tables[name][k] = checked
    return SettingsLayers(
        config=config,
        platforms=tables["platform"],
        types=tables["platformType"],
        venues=tables["venue"],
        platform_types=platforms,
    )


LAYERS = {"platform": "platform profile", "platformType": "platform-type profile", "venue": "venue"}
_NOT_TEXT = {
    "enabledToolGroups": 'a list of strings (group names, ["*"] for all)',
    "historyLimit": "an integer",
    "maxToolIterations": "an integer",
}
"""Settings a layer of the file must not give as a string, though ``/session.set`` (whose
value is text) converts one: what each must be."""


def _personas(r: _Reader, table: dict[str, Any]) -> StaticPersonas | None:
    if not table:
        return None
    personas: dict[str, tuple[str, str]] = {}
    default: str | None = None
    for pid, raw in table.items():
        key = f"personas.{toml_key(pid)}"
        p = r.convert(raw, _Persona, key)
        personas[pid] = (p.name or pid, p.prompt)
        if p.default:
            if default is not None:
                raise r.error(
                    f"{key}.default", f"{toml_value(default)} is already the default persona"
                )
            default = pid
    return StaticPersonas(personas, default)


def _mcp_servers(r: _Reader, table: dict[str, Any]) -> tuple[McpServer, ...]:
    servers: list[McpServer] = []
    for name, raw in table.items():
        key = f"mcp.{toml_key(name)}"
        if not name:
            raise r.error(key, "an MCP server's name must be non-empty")
        m = r.convert(raw, _Mcp, key)
        if (m.command is None) == (m.url is None):
            raise r.error(key, "give command (stdio) or url (streamable HTTP), one of them")
        if m.url is not None:
            for only in ("args", "env", "cwd"):
                if only in raw:
                    raise r.error(f"{key}.{only}", "only a command (stdio) server takes it")
        elif "headers" in raw:
            raise r.error(f"{key}.headers", "only a url (streamable HTTP) server takes it")
        env, headers = (
            None
            if table is None
            else {k: r.convert(v, str, f"{key}.{what}.{toml_key(k)}") for k, v in table.items()}
            for what, table in (("env", m.env), ("headers", m.headers))
        )
        servers.append(
            McpServer(
                name=name,
                command=m.command,
                args=tuple(m.args),
                env=env,
                cwd=m.cwd,
                url=m.url,
                headers=headers,
                group=m.group,
                prefix=m.tool_prefix,
                timeout_s=m.timeout_ms / 1000,
                startup_timeout_s=m.startup_timeout_ms / 1000,
                max_line_bytes=m.max_line_bytes,
            )
        )
    return tuple(servers)


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
    for server in fc.mcp:
        target = server.url or " ".join([server.command or "", *server.args])
        lines.append(
            f"MCP server {server.name!r} ({server.transport}: {target}), "
            f"tool group {server.tool_group!r}"
        )
    return "\n".join(lines) + "\n"


def _shown(value: Any) -> str:
    if isinstance(value, Mapping) and {"provider", "model"} <= value.keys():
        return f"{value['provider']}/{value['model']}"
    return str(value)
