"""Loading a scenario: a TOML file, or the table it parses to, read and checked into a
:class:`Scenario`; a mistake raises :class:`ScenarioError` naming the place and what is
wrong, and keys never read are refused as typos."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import tomllib
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any, get_args

from aalis_agent.actors.hooks import HOOK_KEYS
from aalis_agent.events import ConfigError, HostNotice, Input, ModelRef, Sender, ToolCall
from aalis_agent.events.errors import ScenarioError
from aalis_agent.events.schema import TriggerType
from aalis_agent.request.limits import (
    INT64_MAX,
    MAX_DEPTH,
    clean_text,
    find_unloggable,
    toml_too_deep,
)
from aalis_agent.scenarios.spec import (
    HOOK_POINTS,
    Point,
    PointKind,
    ReplySpec,
    Scenario,
    SessionSpec,
    StepKind,
    StepSpec,
    ToolOutcome,
    ToolSpec,
)
from aalis_agent.services import AgentConfig, Usage
from aalis_agent.services.settings import (
    MAX_TOKENS,
    check_config_range,
    shown_value,
    validate_setting,
)

DEFAULT_START_MS = 1_767_225_600_000
"""2026-01-01T00:00:00Z, when a scenario gives no ``start``."""

MIN_TIME_MS = -62_135_596_800_000
MAX_TIME_MS = 253_402_300_799_999
"""``start`` in milliseconds: 0001-01-01 to 9999-12-31 (what a date can show)."""

MAX_TICK_MS = 86_400_000
"""Longest ``tick_ms``: a day per step."""

MAX_WAIT_MS = 366 * 86_400_000
"""Longest ``wait``: a year."""

MAX_TIMEOUT_S = 86_400.0
"""Longest ``timeout_s``: a day."""

MAX_CHUNKS = 100_000
"""Most pieces a reply's text streams in."""

MAX_POINT_DIGITS = 9
"""Numbers in a point (``before call N``) have at most this many digits."""

STEP_KINDS: tuple[str, ...] = get_args(StepKind)
TRIGGERS: tuple[str, ...] = get_args(TriggerType)
DEFAULT_TRIGGERS = {"schedule": "interval", "proactive": "proactive", "idle": "idle"}

_POINT_PATTERNS: tuple[tuple[re.Pattern[str], PointKind], ...] = (
    (re.compile(r"start"), "start"),
    (re.compile(r"before call (?P<n>\d+)(?: of (?P<session>\S+))?"), "before-call"),
    (re.compile(r"after turn (?P<n>\d+)(?: of (?P<session>\S+))?"), "after-turn"),
    (
        re.compile(r"after chunk (?P<chunk>\d+) of call (?P<n>\d+)(?: of (?P<session>\S+))?"),
        "chunk",
    ),
    (
        re.compile(
            r"while (?P<hook>agent:\S+?)(?: round (?P<round>\d+))? "
            r"of (?P<unit>call|turn) (?P<n>\d+)(?: of (?P<session>\S+))? runs"
        ),
        "hook",
    ),
    (re.compile(r"while (?P<tool>\S+?)(?: call (?P<n>\d+))? runs"), "tool"),
)
_POINT_FORMS = (
    "'start', 'before call N', 'after turn N', 'after chunk K of call N', "
    "'while HOOK of call N runs' (HOOK: agent:llm:before, agent:llm:after, "
    "agent:reply:before), 'while HOOK of turn N runs' (agent:turn:before, "
    "agent:turn:after) (each with ' of SESSION'), 'while TOOL runs' or "
    "'while TOOL call K runs'"
)


class _Table:
    """A TOML table being read: typed getters; keys never read are refused (typos)."""

    def __init__(self, data: Any, where: str, file: str) -> None:
        self.where = where
        self.file = file
        if not isinstance(data, Mapping):
            raise self.error(f"must be a table, got {_kind(data)}")
        self.data: Mapping[str, Any] = data
        self._read: set[str] = set()

    def error(self, reason: str) -> ScenarioError:
        return ScenarioError(reason, file=self.file, where=self.where)

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str) -> Any:
        self._read.add(key)
        return self.data.get(key)

    def text(self, key: str, default: str | None = None, *, required: bool = False) -> Any:
        value = self.get(key)
        if value is None:
            if required:
                raise self.error(f"{key} is required")
            return default
        if not isinstance(value, str):
            raise self.error(f"{key} must be text, got {_kind(value)}")
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        minimum: int = 0,
        maximum: int = INT64_MAX,
    ) -> Any:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{key} must be an integer, got {_kind(value)}")
        if value < minimum:
            raise self.error(f"{key} must be >= {minimum}, got {value}")
        if value > maximum:
            raise self.error(f"{key} must be <= {maximum}, got {value}")
        return value

    def number(self, key: str, default: float, *, maximum: float) -> float:
        value = self.get(key)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise self.error(f"{key} must be a positive number, got {shown_value(value)}")
        if value > maximum:
            raise self.error(f"{key} must be <= {maximum:g}, got {shown_value(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {_kind(value)}")
        return value

    def texts(self, key: str) -> tuple[str, ...] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"{key} must be a list of text")
        return tuple(value)

    def tables(self, key: str) -> list[Any]:
        value = self.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(f"{key} must be a list of tables ([[{key}]]), got {_kind(value)}")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            raise self.error(f"unknown key {unknown[0]!r} (known here: {known})")


def _only(scripted: int) -> str:
    return f"only {scripted} {'reply is' if scripted == 1 else 'replies are'}"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return f"text {shown_value(value)}"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a table"
    return type(value).__name__


def load_scenario(source: str | Path | Mapping[str, Any]) -> Scenario:
    """Read and check a scenario: a TOML file's path, or the table it would parse to.

    What the event log could not hold is refused naming the file and the dotted key:
    nesting past :data:`~aalis_agent.request.limits.MAX_DEPTH` (in a file, before the
    TOML is parsed), an integer outside 64 bits, text with a lone surrogate."""
    if isinstance(source, Mapping):
        name = source.get("name")
        file = clean_text(name) if isinstance(name, str) and name else "<scenario>"
        data: Mapping[str, Any] = source
    else:
        file = str(source)
        path = Path(source)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ScenarioError(f"cannot read the file: {exc.strerror or exc}", file=file) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ScenarioError("not UTF-8 text", file=file) from None
        deep = toml_too_deep(text, MAX_DEPTH)
        if deep is not None:
            key, line = deep
            raise ScenarioError(
                f"nested deeper than {MAX_DEPTH} levels (line {line})", file=file, where=key
            )
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"not valid TOML: {exc}", file=file) from None
    bad = find_unloggable(data, max_depth=MAX_DEPTH)
    if bad is not None:
        raise ScenarioError(bad[1], file=file, where=bad[0] or "top level")
    return _Loader(file).load(data, default_name=Path(file).stem)


class _Loader:
    def __init__(self, file: str) -> None:
        self.file = file

    def table(self, data: Any, where: str) -> _Table:
        return _Table(data, where, self.file)

    def load(self, data: Mapping[str, Any], default_name: str) -> Scenario:
        top = self.table(data, "")
        top.where = "top level"
        name = top.text("name", default_name)
        description = top.text("description", "")
        tz = self._tz(top)
        start_ms = self._start(top, tz)
        tick_ms = top.integer("tick_ms", 1000, maximum=MAX_TICK_MS)
        timeout_s = top.number("timeout_s", 10.0, maximum=MAX_TIMEOUT_S)
        owners = self._owners(top)
        archive = top.flag("archive", True)
        config = self._config(top.get("config"))
        models = self._models(top.get("model"), top.tables("models"))
        sessions = self._sessions(top.tables("sessions"), top)
        ids = [s.id for s in sessions]
        tools = self._tools(top.tables("tools"))
        replies = self._replies(top.tables("replies"), ids)
        steps = self._steps(top.tables("steps"), ids, tools, replies)
        top.done()
        return Scenario(
            name=name,
            file=self.file,
            description=description,
            start_ms=start_ms,
            tz=tz,
            tick_ms=tick_ms,
            timeout_s=timeout_s,
            owners=owners,
            archive=archive,
            config=config,
            models=models,
            sessions=tuple(sessions),
            tools=tuple(tools),
            replies=replies,
            steps=tuple(steps),
        )

    # --- settings -----------------------------------------------------------------

    def _tz(self, top: _Table) -> tzinfo:
        value = top.get("timezone")
        if value is None:
            start = top.data.get("start")
            if isinstance(start, str):
                with contextlib.suppress(ValueError):
                    start = datetime.fromisoformat(start)
            if isinstance(start, datetime) and start.tzinfo is not None:
                return start.tzinfo
            return UTC
        if not isinstance(value, str):
            raise top.error(f"timezone must be text like '+08:00' or 'UTC', got {_kind(value)}")
        if value.upper() in ("UTC", "Z"):
            return UTC
        m = re.fullmatch(r"([+-])(\d{2}):?(\d{2})", value)
        if m is None or int(m[2]) > 23 or int(m[3]) > 59:
            raise top.error(
                f"timezone must look like '+08:00', '-05:30' or 'UTC', got {shown_value(value)}"
            )
        sign = 1 if m[1] == "+" else -1
        return timezone(sign * timedelta(hours=int(m[2]), minutes=int(m[3])))

    def _start(self, top: _Table, tz: tzinfo) -> int:
        value = top.get("start")
        if value is None:
            return DEFAULT_START_MS
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value)
            except ValueError:
                raise top.error(
                    f"start is not an ISO date and time: {shown_value(value)}"
                ) from None
        if isinstance(value, bool):
            raise top.error("start must be a date and time, or milliseconds since the epoch")
        if isinstance(value, int):
            if not MIN_TIME_MS <= value <= MAX_TIME_MS:
                raise top.error(
                    f"start must be from {MIN_TIME_MS} to {MAX_TIME_MS} milliseconds "
                    f"(years 1 to 9999), got {value}"
                )
            return value
        if isinstance(value, datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=tz)
            return int(value.timestamp() * 1000)
        if isinstance(value, date):
            raise top.error("start needs a time of day too, e.g. 2026-01-01T08:00:00+08:00")
        raise top.error(f"start must be a date and time, got {_kind(value)}")

    def _owners(self, top: _Table) -> tuple[tuple[str, str], ...]:
        owners = top.texts("owners") or ()
        out = []
        for owner in owners:
            platform, sep, user = owner.partition(":")
            if not sep or not platform or not user:
                raise top.error(f"owners: {owner!r} is not 'platform:user_id'")
            out.append((platform, user))
        return tuple(out)

    def _config(self, data: Any) -> AgentConfig:
        if data is None:
            return AgentConfig()
        if not isinstance(data, Mapping):
            raise ScenarioError(
                f"must be a table, got {_kind(data)}", file=self.file, where="[config]"
            )
        try:
            config = AgentConfig.from_mapping(data, where="[config]")
            check_config_range(config, where="[config]")
        except (ConfigError, TypeError) as exc:
            raise ScenarioError(str(exc), file=self.file) from None
        return config

    def _models(self, first: Any, more: list[Any]) -> tuple[dict[str, Any], ...]:
        models: list[dict[str, Any]] = []
        for i, data in enumerate([first if first is not None else {}, *more]):
            t = self.table(data, "[model]" if i == 0 else f"[[models]] #{i}")
            model = {
                "id": t.text("id", "scripted" if i == 0 else None, required=i > 0),
                "provider": t.text("provider", "scenario"),
                "context_length": t.integer(
                    "context_length", 32_000, minimum=1, maximum=MAX_TOKENS
                ),
                "max_output_tokens": t.integer(
                    "max_output_tokens", 4096, minimum=1, maximum=MAX_TOKENS
                ),
                "think_levels": tuple(t.texts("think_levels") or ()),
                "default_think": t.text("default_think"),
            }
            entry = f"{model['provider']}/{model['id']}"
            if any(f"{m['provider']}/{m['id']}" == entry for m in models):
                raise t.error(f"model {entry!r} is declared twice")
            if model["default_think"] is not None and (
                model["default_think"] not in model["think_levels"]
            ):
                raise t.error("default_think must be one of think_levels")
            t.done()
            models.append(model)
        return tuple(models)

    def _sessions(self, items: list[Any], top: _Table) -> list[SessionSpec]:
        if not items:
            raise top.error("no [[sessions]]: declare at least one session (id, platform)")
        sessions: list[SessionSpec] = []
        for i, item in enumerate(items, 1):
            t = self.table(item, f"[[sessions]] #{i}")
            sid = t.text("id", required=True)
            t.where = f"session {sid!r}"
            if not sid or any(s.id == sid for s in sessions):
                raise t.error("session ids must be non-empty and unique")
            spec = SessionSpec(
                id=sid,
                platform=t.text("platform", "cli"),
                multi_party=t.flag("multi_party", False),
                group_id=t.text("group_id"),
                parent=t.text("parent"),
                settings=self._session_settings(t.get("settings"), t),
            )
            t.done()
            sessions.append(spec)
        return sessions

    def _session_settings(self, data: Any, owner: _Table) -> dict[str, Any]:
        if data is None:
            return {}
        t = self.table(data, f"{owner.where} settings")
        layer: dict[str, Any] = {}
        checked: dict[str, Any] = {}
        for key in ("historyLimit", "maxToolIterations", "think"):
            if t.has(key):
                checked[key] = layer[key] = t.get(key)
        try:
            check_config_range(AgentConfig.from_mapping(checked, where=t.where), where=t.where)
            for key, value in checked.items():  # as /session.set would check them
                validate_setting(key, value, layer=owner.where)
        except ConfigError as exc:
            raise ScenarioError(str(exc), file=self.file) from None
        groups = t.texts("enabledToolGroups")
        if groups is not None:
            try:
                validate_setting("enabledToolGroups", groups, layer=owner.where)
            except ConfigError as exc:
                raise ScenarioError(str(exc), file=self.file) from None
            layer["enabledToolGroups"] = groups
        model = t.text("model")
        if model is not None:
            provider, sep, model_id = model.partition("/")
            if not sep or not provider or not model_id:
                raise t.error(f"model must be 'provider/model', got {model!r}")
            try:
                validate_setting("llm", model, layer=owner.where)
            except ConfigError as exc:
                raise ScenarioError(str(exc), file=self.file) from None
            layer["model"] = ModelRef(provider=provider, model=model_id)
        t.done()
        return layer

    # --- tools and replies ----------------------------------------------------------

    def _tools(self, items: list[Any]) -> list[ToolSpec]:
        tools: list[ToolSpec] = []
        for i, item in enumerate(items, 1):
            t = self.table(item, f"[[tools]] #{i}")
            name = t.text("name", required=True)
            t.where = f"tool {name!r}"
            if not name or any(c.isspace() for c in name) or any(x.name == name for x in tools):
                raise t.error("tool names must be unique, non-empty and without spaces")
            results = tuple(
                self._tool_outcome(r, t, k) for k, r in enumerate(t.tables("results"), 1)
            )
            result, error = t.text("result"), t.text("error")
            if result is not None and error is not None:
                raise t.error("give result or error, not both")
            default = (
                ToolOutcome(result, error) if result is not None or error is not None else None
            )
            if default is None and not results:
                raise t.error("give result, error or results (one per call)")
            params = t.get("parameters")
            if params is not None and not isinstance(params, Mapping):
                raise t.error("parameters must be a table (a JSON schema)")
            tools.append(
                ToolSpec(
                    name=name,
                    description=t.text("description", ""),
                    parameters=params
                    if params is not None
                    else {"type": "object", "properties": {}},
                    groups=t.texts("groups") or (),
                    results=results,
                    default=default,
                    slow=t.flag("slow", False),
                    abortable=t.flag("abortable", False),
                )
            )
            t.done()
        return tools

    def _tool_outcome(self, item: Any, tool: _Table, k: int) -> ToolOutcome:
        if isinstance(item, str):
            return ToolOutcome(result=item)
        t = self.table(item, f"{tool.where} results #{k}")
        result, error = t.text("result"), t.text("error")
        t.done()
        if (result is None) == (error is None):
            raise t.error("each result is text, or a table with result or error (one of them)")
        return ToolOutcome(result, error)

    def _replies(self, items: list[Any], sessions: list[str]) -> dict[str, tuple[ReplySpec, ...]]:
        by_session: dict[str, list[ReplySpec]] = {s: [] for s in sessions}
        for i, item in enumerate(items, 1):
            t = self.table(item, f"[[replies]] #{i}")
            sid = self._session_of(t, sessions)
            own = by_session[sid]
            n = len(own) + 1
            t.where = f"reply #{i} (call {n} of {sid})"
            call = t.integer("call", n, minimum=1)
            if call != n:
                raise t.error(
                    f"call = {call}, but this is reply {n} of session {sid!r}: replies answer "
                    "a session's calls in file order"
                )
            text = t.text("text")
            pieces = self._pieces(t, text)
            usage = self._usage(t.get("usage"), t)
            calls = tuple(
                self._tool_call(c, t, j, sid, n) for j, c in enumerate(t.tables("tool_calls"), 1)
            )
            own.append(
                ReplySpec(
                    session=sid,
                    call=n,
                    text="".join(pieces),
                    reasoning=t.text("reasoning"),
                    pieces=pieces,
                    tool_calls=calls,
                    usage=usage,
                    error=t.text("error"),
                )
            )
            t.done()
        return {s: tuple(r) for s, r in by_session.items()}

    def _pieces(self, t: _Table, text: str | None) -> tuple[str, ...]:
        chunks = t.get("chunks")
        if chunks is None:
            return (text,) if text else ()
        if isinstance(chunks, list):
            if text is not None:
                raise t.error("chunks as a list is the text itself: give text or chunks, not both")
            if not all(isinstance(c, str) for c in chunks):
                raise t.error("chunks must be a number or a list of text")
            return tuple(chunks)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise t.error(f"chunks must be a number >= 1 or a list of text, got {_kind(chunks)}")
        if chunks > MAX_CHUNKS:
            raise t.error(f"chunks must be <= {MAX_CHUNKS}, got {chunks}")
        text = text or ""
        size = -(-len(text) // chunks) if text else 0
        return tuple(text[i * size : (i + 1) * size] for i in range(chunks)) if size else ()

    def _usage(self, data: Any, owner: _Table) -> Usage | None:
        if data is None:
            return None
        t = self.table(data, f"{owner.where} usage")
        usage = Usage(
            prompt_tokens=t.integer("prompt_tokens", maximum=MAX_TOKENS),
            completion_tokens=t.integer("completion_tokens", maximum=MAX_TOKENS),
            total_tokens=t.integer("total_tokens", maximum=MAX_TOKENS),
            cached_prompt_tokens=t.integer("cached_prompt_tokens", maximum=MAX_TOKENS),
        )
        t.done()
        return usage

    def _tool_call(self, data: Any, owner: _Table, j: int, sid: str, n: int) -> ToolCall:
        t = self.table(data, f"{owner.where} tool_calls #{j}")
        name = t.text("name", required=True)
        call_id = t.text("id", f"call-{n}-{j}")
        arguments = t.get("arguments")
        if arguments is None:
            arguments = ""
        elif isinstance(arguments, Mapping):
            try:
                arguments = json.dumps(arguments, ensure_ascii=False)
            except (TypeError, ValueError) as exc:  # a date or time has no JSON form
                raise t.error(f"arguments as a table must hold JSON values only: {exc}") from None
        elif not isinstance(arguments, str):
            raise t.error(
                "arguments must be text (sent as is, so it may be broken JSON) or a table"
            )
        t.done()
        return ToolCall(id=call_id, name=name, arguments=arguments)

    # --- steps ------------------------------------------------------------------------

    def _session_of(self, t: _Table, sessions: list[str]) -> str:
        sid = t.text("session")
        if sid is None:
            if len(sessions) == 1:
                return sessions[0]
            raise t.error(f"session is required with more than one session ({', '.join(sessions)})")
        if sid not in sessions:
            raise t.error(f"no session {sid!r} (declared: {', '.join(sessions)})")
        return str(sid)

    def _point(
        self,
        t: _Table,
        sid: str,
        sessions: list[str],
        tools: dict[str, ToolSpec],
        replies: Mapping[str, tuple[ReplySpec, ...]],
    ) -> Point:
        value = t.text("at")
        if value is None:
            return Point("now")
        shown = shown_value(value)
        text = " ".join(value.split())
        for pattern, kind in _POINT_PATTERNS:
            m = pattern.fullmatch(text)
            if m is None:
                continue
            groups = m.groupdict()
            for key in ("n", "chunk", "round"):
                if len(groups.get(key) or "") > MAX_POINT_DIGITS:
                    raise t.error(f"at {shown}: numbers have at most {MAX_POINT_DIGITS} digits")
            n = int(groups.get("n") or 1)
            if kind == "start":
                return Point("start")
            if n < 1 or any(
                groups.get(k) is not None and int(groups[k]) < 1 for k in ("chunk", "round")
            ):
                raise t.error(f"at {shown}: numbers count from 1")
            if kind == "tool":
                tool = groups["tool"]
                if tool not in tools:
                    if tool in HOOK_KEYS:
                        raise t.error(f"at {shown}: {self._hook_form(tool)}")
                    declared = ", ".join(tools) or "none"
                    raise t.error(f"at {shown}: no tool {tool!r} (declared: {declared})")
                return Point("tool", n=n, tool=tool)
            point_sid = groups.get("session") or sid
            if point_sid not in sessions:
                raise t.error(f"at {shown}: no session {point_sid!r}")
            scripted = len(replies[point_sid])
            if kind == "hook":
                return self._hook_point(t, shown, groups, n, point_sid, replies[point_sid])
            if kind == "chunk":
                return self._chunk_point(t, shown, int(groups["chunk"]), n, point_sid, replies)
            if kind == "before-call" and n - 1 > scripted:
                raise t.error(
                    f"at {shown} can never happen: call {n} of {point_sid} needs calls "
                    f"1-{n - 1} answered, and {_only(scripted)} scripted"
                )
            return Point(kind, session=point_sid, n=n)
        raise t.error(f"at {shown} is not a point; use {_POINT_FORMS}")

    @staticmethod
    def _hook_form(hook: str) -> str:
        """How to name a point in ``hook``, or why there is none."""
        unit = HOOK_POINTS.get(hook)
        if unit is not None:
            return f"say which {unit} it runs for: 'while {hook} of {unit} N runs'"
        return (
            f"a step cannot be placed in {hook} (it can in {', '.join(HOOK_POINTS)}; "
            "for a tool's run, use 'while TOOL runs')"
        )

    def _hook_point(
        self,
        t: _Table,
        shown: str,
        groups: dict[str, Any],
        n: int,
        sid: str,
        replies: tuple[ReplySpec, ...],
    ) -> Point:
        """``while HOOK [round R] of call|turn N [of SESSION] runs``, checked against the
        script: the call must be able to come, and the hook to run for it."""
        hook, unit = groups["hook"], groups["unit"]
        if hook not in HOOK_POINTS:
            if hook in HOOK_KEYS:
                raise t.error(f"at {shown}: {self._hook_form(hook)}")
            raise t.error(
                f"at {shown}: no hook {hook!r} (a step can be placed in {', '.join(HOOK_POINTS)})"
            )
        if HOOK_POINTS[hook] != unit:
            raise t.error(
                f"at {shown}: {hook} runs once per {HOOK_POINTS[hook]}: "
                f"'while {hook} of {HOOK_POINTS[hook]} N runs'"
            )
        rounds = int(groups["round"] or 1)
        if groups["round"] is not None and hook != "agent:llm:before":
            raise t.error(
                f"at {shown}: only agent:llm:before runs in rounds (again after inputs join "
                "at the insertion point); leave out 'round'"
            )
        point = Point("hook", session=sid, n=n, hook=hook, round=rounds)
        scripted = len(replies)
        if hook == "agent:llm:before" and n - 1 > scripted:
            raise t.error(
                f"at {shown} can never happen: call {n} of {sid} needs calls 1-{n - 1} "
                f"answered, and {_only(scripted)} scripted"
            )
        if hook in ("agent:llm:after", "agent:reply:before"):
            if n > scripted:
                raise t.error(
                    f"at {shown} can never happen: {hook} runs once call {n} of {sid} is "
                    f"answered, and {_only(scripted)} scripted"
                )
            if replies[n - 1].error is not None:
                raise t.error(
                    f"at {shown} can never happen: reply {n} of {sid} fails (error), and "
                    f"{hook} does not run for a call that fails"
                )
        return point

    def _chunk_point(
        self,
        t: _Table,
        shown: str,
        chunk: int,
        n: int,
        sid: str,
        replies: Mapping[str, tuple[ReplySpec, ...]],
    ) -> Point:
        """``after chunk K of call N [of SESSION]``: reply N must stream K text chunks."""
        own = replies[sid]
        if n > len(own):
            raise t.error(
                f"at {shown} can never happen: call {n} of {sid} streams once it is "
                f"answered, and {_only(len(own))} scripted"
            )
        reply = own[n - 1]
        if reply.error is not None:
            raise t.error(f"at {shown} can never happen: reply {n} of {sid} fails (error)")
        streamed = len(reply.text_chunks)
        if chunk > streamed:
            raise t.error(
                f"at {shown} can never happen: reply {n} of {sid} streams {streamed} text "
                "chunk(s) (set its chunks)"
            )
        return Point("chunk", session=sid, n=n, chunk=chunk)

    def _steps(
        self,
        items: list[Any],
        sessions: list[str],
        tools: list[ToolSpec],
        replies: Mapping[str, tuple[ReplySpec, ...]],
    ) -> list[StepSpec]:
        by_name = {t.name: t for t in tools}
        steps: list[StepSpec] = []
        for i, item in enumerate(items, 1):
            t = self.table(item, f"step {i}")
            do = t.text("do", required=True)
            if do not in STEP_KINDS:
                raise t.error(f"do = {do!r} is not a step; use one of {', '.join(STEP_KINDS)}")
            t.where = f"step {i} ({do})"
            sid = self._session_of(t, sessions)
            at = self._point(t, sid, sessions, by_name, replies)
            t.where = f"step {i} ({do} at {at.describe()})"
            if at.kind == "tool" and at.tool is not None and not by_name[at.tool].slow:
                # A tool named in a point must park for the step to happen while it runs.
                by_name[at.tool] = dataclasses.replace(by_name[at.tool], slow=True)
            step = self._step(t, i, do, sid, at)
            t.done()
            steps.append(step)
        tools[:] = [by_name[t.name] for t in tools]  # the caller's list: slow ones updated
        return steps

    def _step(self, t: _Table, i: int, do: Any, sid: str, at: Point) -> StepSpec:
        note = t.text("note")
        base = {"index": i, "do": do, "session": sid, "at": at, "note": note}
        if do in ("say", "inject"):
            return StepSpec(**base, input=self._input(t, do))
        if do in ("stop", "stop_command", "stop_all"):
            return StepSpec(**base, by=t.text("by"), platform=t.text("platform"))
        if do == "clear":
            return StepSpec(**base, kinds=t.texts("kinds") or ())
        if do == "wait":
            ms = t.integer("ms", minimum=1, maximum=MAX_WAIT_MS)
            if ms is None:
                raise t.error("ms is required (how far the clock moves)")
            return StepSpec(**base, ms=ms)
        return StepSpec(**base)

    def _input(self, t: _Table, do: str) -> Input:
        text = t.text("text", required=True)
        source = actor = None
        notice = None
        if do == "inject":
            actor = t.text("actor")
            source = t.text("source", required=True)
            if not source:
                raise t.error("source must not be empty")
            notice = self._notice(t.get("notice"), t)
            if source == "host-notice" and notice is None:
                raise t.error("a host-notice injection needs notice = { kind = ..., id = ... }")
        trigger = t.text("trigger", DEFAULT_TRIGGERS.get(source or ""))
        if trigger is not None and trigger not in TRIGGERS:
            raise t.error(f"trigger must be one of {', '.join(TRIGGERS)}, got {trigger!r}")
        user = t.text("from")
        nickname = t.text("nickname")
        return Input(
            id=t.text("id", ""),
            content=text,
            sender=Sender(user_id=user, nickname=nickname),
            actor=actor,
            platform=t.text("platform", ""),
            message_id=t.text("message_id"),
            trigger_type=trigger,
            source=source,
            addressed=t.flag("addressed", True),
            mentions=t.texts("mentions") or (),
            gateway_seq=t.integer("gateway_seq"),
            host_notice=notice,
        )

    def _notice(self, data: Any, owner: _Table) -> HostNotice | None:
        if data is None:
            return None
        t = self.table(data, f"{owner.where} notice")
        notice = HostNotice(
            kind=t.text("kind", required=True),
            id=t.text("id", required=True),
            untrusted=t.text("untrusted"),
            reply_to=t.text("reply_to"),
        )
        t.done()
        return notice
