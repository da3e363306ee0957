"""The plugin configuration (CFG1-CFG8), validated when it is loaded."""

from __future__ import annotations

import datetime
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import structlog
from aalis_agent.events.errors import ConfigError
from aalis_agent.request.locales import DEFAULT_LOCALE, check_locale

__all__ = ["AgentConfig", "json_value", "keyed", "toml_key", "toml_path", "toml_value"]

log = structlog.get_logger("aalis.config")

_KEYS = {
    "systemPrompt": "system_prompt",
    "memoryTokenBudget": "memory_token_budget",
    "promptBuildTimeoutMs": "prompt_build_timeout_ms",
    "toolResultMaxRatio": "tool_result_max_ratio",
    "trimThresholdRatio": "trim_threshold_ratio",
    "think": "think",
    "maxToolIterations": "max_tool_iterations",
    "historyLimit": "history_limit",
    "locale": "locale",
}


@dataclass(frozen=True)
class AgentConfig:
    """CFG1-CFG8 with their defaults. Build from the source's camelCase keys with
    :meth:`from_mapping`, which refuses wrong types and out-of-range values by key."""

    system_prompt: str = ""
    memory_token_budget: int = 4096
    prompt_build_timeout_ms: int = 10_000
    tool_result_max_ratio: float = 0.15
    trim_threshold_ratio: float = 1.0
    think: str | None = None
    max_tool_iterations: int | None = None
    history_limit: int = 0
    locale: str = DEFAULT_LOCALE
    """The language of every text the model and people see (``request/locales``: ``zh``,
    the default, or ``en``); a settings layer may pick another for its platform."""

    def __post_init__(self) -> None:
        # Upper bounds: what the log and the turn can hold (as the configuration file
        # checks them): tokens up to 1e9, a timeout up to 2**31-1 ms, counts in 64 bits.
        _check_int("memoryTokenBudget", self.memory_token_budget, minimum=0, maximum=10**9)
        _check_int(
            "promptBuildTimeoutMs", self.prompt_build_timeout_ms, minimum=0, maximum=2**31 - 1
        )
        _check_ratio("toolResultMaxRatio", self.tool_result_max_ratio, upper=1.0)
        _check_ratio("trimThresholdRatio", self.trim_threshold_ratio, upper=1000.0)
        if self.max_tool_iterations is not None:
            _check_int("maxToolIterations", self.max_tool_iterations, minimum=1)
        _check_int("historyLimit", self.history_limit, minimum=0)
        if not isinstance(self.system_prompt, str):
            raise ConfigError(f"systemPrompt must be text, got {toml_value(self.system_prompt)}")
        if self.think is not None and not isinstance(self.think, str):
            raise ConfigError(f"think must be a level id (text), got {toml_value(self.think)}")
        check_locale(self.locale, shown=toml_value)

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], *, where: str = "config", table: str | None = None
    ) -> AgentConfig:
        """Build from ``{"systemPrompt": ..., "historyLimit": ...}``; unknown keys are refused,
        except ``llm``, which has no effect in the plugin config (SET1). An error names
        ``where`` (and the config file's ``table`` the values are from, if given)."""
        place = where if table is None else f"{where}: {table}"
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key == "llm":
                # SET1: the model's global layer is the service preference, not this.
                log.warning(
                    "an llm key in the plugin config has no effect; set "
                    "pluginServicePreferences.agent.llm or servicePreferences.llm",
                    where=where,
                )
                continue
            if key not in _KEYS:
                known = ", ".join(sorted(_KEYS))
                raise ConfigError(f"{place}: unknown key {toml_value(key)} (known: {known})")
            kwargs[_KEYS[key]] = value
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(keyed(where, str(exc), table)) from None

    def to_mapping(self) -> dict[str, Any]:
        names = {v: k for k, v in _KEYS.items()}
        return {names[f.name]: getattr(self, f.name) for f in fields(self)}


def keyed(where: str, said: str, table: str | None = None) -> str:
    """``said`` (a message that begins with a key, as "historyLimit must be ...") placed
    at ``where``; for a config file's ``table``, the key as a path ("a.toml: agent.
    historyLimit must be ...")."""
    if table is None:
        return f"{where}: {said}"
    first = said.split(" ", 1)[0]
    if first in _KEYS or (first.endswith(":") and first[:-1] in _KEYS):
        return f"{where}: {table}.{said}"
    return f"{where}: {table}: {said}"


def _check_int(key: str, value: Any, *, minimum: int, maximum: int = 2**63 - 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {toml_value(value)}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {toml_value(value)}")
    if value > maximum:
        raise ConfigError(f"{key} must be <= {maximum}, got {toml_value(value)}")


def _check_ratio(key: str, value: Any, *, upper: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a number, got {toml_value(value)}")
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {toml_value(value)}")
    if upper is not None and value > upper:
        raise ConfigError(f"{key} must be <= {upper:g}, got {toml_value(value)}")


_SHOWN_CHARS = 60
_SHOWN_ITEMS = 4
_SHOWN_DEPTH = 3
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\t": "\\t",
    "\r": "\\r",
    "\b": "\\b",
    "\f": "\\f",
}


def toml_value(value: Any, depth: int = _SHOWN_DEPTH) -> str:
    """``value`` for an error message as a TOML (or JSON) file spells it: ``true``,
    ``"x"``, ``1.5``, ``inf``, ``[1, "a"]``, ``{a = 1}``, ``2020-01-02`` (and ``null``),
    never as Python does (``True``, ``'x'``). Shortened: text past 60 characters, more
    than 4 items and nesting past 3 levels are cut (``...``); a huge integer is
    described; a value no file holds is named by its type."""
    return _spelled(value, depth, json=False)


def json_value(value: Any, depth: int = _SHOWN_DEPTH) -> str:
    """``value`` for an error message as JSON spells it (what ``/session.set`` reads):
    ``true``, ``null``, ``"x"``, ``1.5``, ``Infinity``, ``[1, "a"]``, ``{"a": 1}``, never
    as Python does (``True``, ``None``, ``'x'``, ``{'a': 1}``). Shortened as
    :func:`toml_value` is."""
    return _spelled(value, depth, json=True)


def _spelled(value: Any, depth: int, *, json: bool) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() > 256:
            digits = int(value.bit_length() * math.log10(2)) + 1
            return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN" if json else "nan"
        if math.isinf(value):
            if json:
                return "Infinity" if value > 0 else "-Infinity"
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _quoted(value, json=json)
    if isinstance(value, datetime.date | datetime.time):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, list | tuple):
        if depth <= 0:
            return "[...]"
        items = [_spelled(v, depth - 1, json=json) for v in value[:_SHOWN_ITEMS]]
        if len(value) > _SHOWN_ITEMS:
            items.append("...")
        return f"[{', '.join(items)}]"
    if isinstance(value, Mapping):
        if depth <= 0:
            return "{...}"
        pairs = itertools.islice(value.items(), _SHOWN_ITEMS)
        if json:
            items = [f"{_json_key(k)}: {_spelled(v, depth - 1, json=True)}" for k, v in pairs]
        else:
            items = [f"{toml_key(k)} = {_spelled(v, depth - 1, json=False)}" for k, v in pairs]
        if len(value) > _SHOWN_ITEMS:
            items.append("...")
        return "{" + ", ".join(items) + "}"
    return f"a {type(value).__name__}"


def toml_key(key: Any) -> str:
    """``key`` as one part of a dotted key in a TOML file: as is when it is a bare key
    (``A-Za-z0-9_-`` only), else quoted (``"qq:1"``, ``"a/b"``, ``""``); cut after 60
    characters either way."""
    if isinstance(key, str) and _BARE_KEY.fullmatch(key):
        return key if len(key) <= _SHOWN_CHARS else key[:_SHOWN_CHARS] + "..."
    return _quoted(key) if isinstance(key, str) else toml_value(key, 0)


def toml_path(path: tuple[object, ...], *, limit: int = 200) -> str:
    """A place in a TOML file as the file writes its key: parts joined by dots, each as
    :func:`toml_key` spells it, list indices in brackets (``settings.venue."qq:1".x``,
    ``providers.a.models[0].id``), the whole cut to ``limit`` characters."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out.append(f"[{part}]")
            continue
        out.append(("." if out else "") + toml_key(part))
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_key(key: Any) -> str:
    return _quoted(key, json=True) if isinstance(key, str) else json_value(key, 0)


def _quoted(text: str, *, json: bool = False) -> str:
    """``text`` as a basic string (TOML's, or JSON's with ``json``): quotes, backslashes
    and what does not print escaped (a lone surrogate too); cut after 60 characters."""
    out = []
    for ch in text[:_SHOWN_CHARS]:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        elif json:  # JSON has no \U escape: a surrogate pair
            high, low = divmod(ord(ch) - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    more = "..." if len(text) > _SHOWN_CHARS else ""
    return f'"{"".join(out)}{more}"'
