"""Scenario files: sessions, tools, scripted model replies and a timeline of inputs and
stops, run through the real runtime, the same way on every run (docs/scenarios.md).

    result = run_scenario("tests/scenarios/insert_while_tool_runs.toml")
    result.calls["qq:group:1"][1].messages     # what call 2 of the session sent
    result.logs["qq:group:1"]                  # the session's event log

The model parks every call until the driver answers it from the script, and slow tools
park until the driver releases them. After each step, answer or release, the driver
waits until every turn is parked again or has ended, then moves the clock; so only one
thing happens at a time, and ids, times and the output are the same on every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any, Literal, TextIO, get_args

import msgspec

from actors.messages import InputOutcome
from actors.replay import render_event
from actors.runtime import Runtime, SubmitHandle
from events import (
    AgentError,
    ChatMessage,
    ConfigError,
    EventStore,
    FixedClock,
    HostNotice,
    InMemoryEventStore,
    Input,
    ModelCallStarted,
    ModelRef,
    Sender,
    SequentialIds,
    SessionEvent,
    SqliteEventStore,
    ToolCall,
    TurnSettings,
    to_builtins,
)
from events.schema import TriggerType
from projections.validate import provider_violations
from services import (
    AbortSignal,
    AgentConfig,
    ChatRequest,
    LogArchive,
    Services,
    SessionInfo,
    StaticAuthority,
    StaticSessions,
    StaticSettings,
    StreamChunk,
    Tool,
    ToolCallContext,
    ToolRegistry,
    Usage,
)
from services.llm import ThinkLevel, ToolCallProgress
from services.models import LlmService, Provider

__all__ = [
    "CallRecord",
    "InputRecord",
    "Point",
    "ReplySpec",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "SessionSpec",
    "StepRecord",
    "StepSpec",
    "ToolError",
    "ToolOutcome",
    "ToolSpec",
    "load_scenario",
    "message_json",
    "run_cli",
    "run_scenario",
]

DEFAULT_START_MS = 1_767_225_600_000
"""2026-01-01T00:00:00Z, when a scenario gives no ``start``."""

PARK_LIMIT_S = 600.0
"""Safety net: a parked model call or tool gives up after this long without the driver."""

StepKind = Literal[
    "say", "inject", "stop", "stop_command", "stop_all", "mute", "delete", "clear", "wait"
]
STEP_KINDS: tuple[str, ...] = get_args(StepKind)
TRIGGERS: tuple[str, ...] = get_args(TriggerType)
DEFAULT_TRIGGERS = {"schedule": "interval", "proactive": "proactive", "idle": "idle"}


class ScenarioError(AgentError):
    """A scenario file that is wrong, or a run that cannot go on as the file says.

    The message names the file, the place (a step, a tool, a reply) and what is wrong.
    """

    def __init__(self, reason: str, *, file: str = "<scenario>", where: str | None = None):
        self.file = file
        self.where = where
        self.reason = reason
        super().__init__(f"{file}: {where}: {reason}" if where else f"{file}: {reason}")


class ToolError(Exception):
    """Raised by a scenario tool scripted to fail; the model sees ``ToolError: <text>``."""


# --- the parsed scenario ---------------------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """A session and its room: platform, multi-party, and its session-layer settings."""

    id: str
    platform: str = "cli"
    multi_party: bool = False
    group_id: str | None = None
    parent: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call returns: a result, or an error raised as :class:`ToolError`."""

    result: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A scripted tool: call K takes ``results[K-1]``, later calls ``default``."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    groups: tuple[str, ...] = ()
    results: tuple[ToolOutcome, ...] = ()
    default: ToolOutcome | None = None
    slow: bool = False
    abortable: bool = False

    def outcome(self, k: int) -> ToolOutcome | None:
        return self.results[k - 1] if k <= len(self.results) else self.default


@dataclass(frozen=True)
class ReplySpec:
    """The scripted answer to one model call of one session."""

    session: str
    call: int
    text: str = ""
    reasoning: str | None = None
    pieces: tuple[str, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    error: str | None = None

    def chunks(self) -> Iterator[StreamChunk]:
        """The stream: reasoning, text pieces, tool-call progress, then the end chunk."""
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.reasoning:
            yield StreamChunk(reasoning_delta=self.reasoning)
        for piece in self.pieces:
            if piece:
                yield StreamChunk(content_delta=piece)
        for index, tc in enumerate(self.tool_calls):
            yield StreamChunk(
                tool_call_progress=ToolCallProgress(
                    index=index, name=tc.name, call_id=tc.id, chars_accumulated=len(tc.arguments)
                )
            )
        yield StreamChunk(tool_calls=self.tool_calls, done=True, usage=self.usage)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text}
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if len(self.pieces) > 1:
            out["chunks"] = list(self.pieces)
        if self.tool_calls:
            out["tool_calls"] = [msgspec.to_builtins(tc) for tc in self.tool_calls]
        if self.usage is not None:
            usage = msgspec.to_builtins(self.usage).items()
            out["usage"] = {k: v for k, v in usage if v is not None}
        if self.error is not None:
            out["error"] = self.error
        return out


PointKind = Literal["now", "start", "before-call", "tool", "after-turn"]


@dataclass(frozen=True)
class Point:
    """Where on the timeline a step happens."""

    kind: PointKind
    session: str | None = None
    n: int = 0
    tool: str | None = None

    def describe(self) -> str:
        match self.kind:
            case "now":
                return "now"
            case "start":
                return "start"
            case "before-call":
                return f"before call {self.n} of {self.session}"
            case "tool":
                return f"while {self.tool} call {self.n} runs"
            case _:
                return f"after turn {self.n} of {self.session}"


@dataclass(frozen=True)
class StepSpec:
    """One timeline step: an input, a stop, a release, a deletion, a clear or a wait."""

    index: int
    do: StepKind
    session: str
    at: Point
    input: Input | None = None
    by: str | None = None
    platform: str | None = None
    kinds: tuple[str, ...] = ()
    ms: int = 0
    note: str | None = None

    def label(self) -> str:
        return f"step {self.index} ({self.do} at {self.at.describe()})"


@dataclass(frozen=True)
class Scenario:
    """A scenario file, parsed and checked."""

    name: str
    file: str
    description: str
    start_ms: int
    tz: tzinfo
    tick_ms: int
    timeout_s: float
    owners: tuple[tuple[str, str], ...]
    archive: bool
    config: AgentConfig
    models: tuple[Mapping[str, Any], ...]  # the first is [model]; the rest [[models]]
    sessions: tuple[SessionSpec, ...]
    tools: tuple[ToolSpec, ...]
    replies: Mapping[str, tuple[ReplySpec, ...]]
    steps: tuple[StepSpec, ...]

    def session(self, session_id: str) -> SessionSpec:
        return next(s for s in self.sessions if s.id == session_id)


# --- loading ---------------------------------------------------------------------------

_POINT_PATTERNS: tuple[tuple[re.Pattern[str], PointKind], ...] = (
    (re.compile(r"start"), "start"),
    (re.compile(r"before call (?P<n>\d+)(?: of (?P<session>\S+))?"), "before-call"),
    (re.compile(r"after turn (?P<n>\d+)(?: of (?P<session>\S+))?"), "after-turn"),
    (re.compile(r"while (?P<tool>\S+?)(?: call (?P<n>\d+))? runs"), "tool"),
)
_POINT_FORMS = (
    "'start', 'before call N', 'after turn N' (either with ' of SESSION'), "
    "'while TOOL runs' or 'while TOOL call K runs'"
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

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0) -> Any:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{key} must be an integer, got {_kind(value)}")
        if value < minimum:
            raise self.error(f"{key} must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(f"{key} must be a positive number, got {value!r}")
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


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return f"text {value!r}"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a table"
    return type(value).__name__


def load_scenario(source: str | Path | Mapping[str, Any]) -> Scenario:
    """Read and check a scenario: a TOML file's path, or the table it would parse to."""
    if isinstance(source, Mapping):
        file = str(source.get("name") or "<scenario>")
        data: Mapping[str, Any] = source
    else:
        file = str(source)
        path = Path(source)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ScenarioError(f"cannot read the file: {exc.strerror or exc}", file=file) from None
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ScenarioError("not UTF-8 text", file=file) from None
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"not valid TOML: {exc}", file=file) from None
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
        tick_ms = top.integer("tick_ms", 1000)
        timeout_s = top.number("timeout_s", 10.0)
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
            raise top.error(f"timezone must look like '+08:00', '-05:30' or 'UTC', got {value!r}")
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
                raise top.error(f"start is not an ISO date and time: {value!r}") from None
        if isinstance(value, bool):
            raise top.error("start must be a date and time, or milliseconds since the epoch")
        if isinstance(value, int):
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
            return AgentConfig.from_mapping(data, where="[config]")
        except (ConfigError, TypeError) as exc:
            raise ScenarioError(str(exc), file=self.file) from None

    def _models(self, first: Any, more: list[Any]) -> tuple[dict[str, Any], ...]:
        models: list[dict[str, Any]] = []
        for i, data in enumerate([first if first is not None else {}, *more]):
            t = self.table(data, "[model]" if i == 0 else f"[[models]] #{i}")
            model = {
                "id": t.text("id", "scripted" if i == 0 else None, required=i > 0),
                "provider": t.text("provider", "scenario"),
                "context_length": t.integer("context_length", 32_000, minimum=1),
                "max_output_tokens": t.integer("max_output_tokens", 4096, minimum=1),
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
            AgentConfig.from_mapping(checked, where=t.where)
        except ConfigError as exc:
            raise ScenarioError(str(exc), file=self.file) from None
        groups = t.texts("enabledToolGroups")
        if groups is not None:
            layer["enabledToolGroups"] = groups
        model = t.text("model")
        if model is not None:
            provider, sep, model_id = model.partition("/")
            if not sep or not provider or not model_id:
                raise t.error(f"model must be 'provider/model', got {model!r}")
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
        text = text or ""
        size = -(-len(text) // chunks) if text else 0
        return tuple(text[i * size : (i + 1) * size] for i in range(chunks)) if size else ()

    def _usage(self, data: Any, owner: _Table) -> Usage | None:
        if data is None:
            return None
        t = self.table(data, f"{owner.where} usage")
        usage = Usage(
            prompt_tokens=t.integer("prompt_tokens"),
            completion_tokens=t.integer("completion_tokens"),
            total_tokens=t.integer("total_tokens"),
            cached_prompt_tokens=t.integer("cached_prompt_tokens"),
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
            arguments = json.dumps(arguments, ensure_ascii=False)
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
        text = " ".join(value.split())
        for pattern, kind in _POINT_PATTERNS:
            m = pattern.fullmatch(text)
            if m is None:
                continue
            groups = m.groupdict()
            n = int(groups.get("n") or 1)
            if kind == "start":
                return Point("start")
            if n < 1:
                raise t.error(f"at {value!r}: numbers count from 1")
            if kind == "tool":
                tool = groups["tool"]
                if tool not in tools:
                    declared = ", ".join(tools) or "none"
                    raise t.error(f"at {value!r}: no tool {tool!r} (declared: {declared})")
                return Point("tool", n=n, tool=tool)
            point_sid = groups.get("session") or sid
            if point_sid not in sessions:
                raise t.error(f"at {value!r}: no session {point_sid!r}")
            scripted = len(replies[point_sid])
            if kind == "before-call" and n - 1 > scripted:
                raise t.error(
                    f"at {value!r} can never happen: call {n} of {point_sid} needs calls "
                    f"1-{n - 1} answered, and only {scripted} repl"
                    f"{'y is' if scripted == 1 else 'ies are'} scripted"
                )
            return Point(kind, session=point_sid, n=n)
        raise t.error(f"at {value!r} is not a point; use {_POINT_FORMS}")

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
            ms = t.integer("ms", minimum=1)
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


# --- the parked model and tools --------------------------------------------------------


@dataclass(eq=False)
class _ModelCall:
    session: str
    index: int
    request: ChatRequest
    abort: AbortSignal
    order: int
    state: Literal["parked", "answered", "abandoned"] = "parked"
    reply: ReplySpec | None = None

    @property
    def parked(self) -> bool:
        return self.state == "parked" and not self.abort.aborted


@dataclass(eq=False)
class _ToolRun:
    spec: ToolSpec
    index: int
    arguments: dict[str, Any]
    ctx: ToolCallContext
    order: int
    outcome: ToolOutcome | None
    state: Literal["parked", "released", "done"] = "parked"

    @property
    def parked(self) -> bool:
        return (
            self.spec.slow
            and self.state == "parked"
            and not (self.spec.abortable and self.ctx.abort.aborted)
        )


class _Gate:
    """What is parked, in the order it parked, and the journal of what happened."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.closed = False
        self.calls: dict[str, list[_ModelCall]] = {}
        self.runs: dict[str, list[_ToolRun]] = {}
        self.journal: list[tuple[str, Any]] = []
        self.problems: list[str] = []
        self.opened: dict[str, int] = {}
        self.ended: dict[str, int] = {}
        self.outbound: dict[str, list[dict[str, Any]]] = {}
        self._order = 0

    def order(self) -> int:
        self._order += 1
        return self._order

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def note(self, kind: str, item: Any) -> None:
        with self.cv:
            self.journal.append((kind, item))

    def wait(self, done: Callable[[], bool]) -> bool:
        """With ``cv`` held, wait until ``done()``; False if the gate closed (or the park
        limit passed) first."""
        deadline = time.monotonic() + PARK_LIMIT_S
        while not done():
            remaining = deadline - time.monotonic()
            if self.closed or remaining <= 0:
                return False
            self.cv.wait(remaining)
        return True

    def on_bus(self, topic: str, payload: Any) -> None:
        sid = payload.get("sessionId", "") if isinstance(payload, Mapping) else ""
        with self.cv:
            if topic == "turn:opened":
                self.opened[sid] = self.opened.get(sid, 0) + 1
            elif topic == "turn:ended":
                self.ended[sid] = self.ended.get(sid, 0) + 1
                self.journal.append(("ended", dict(payload)))
            elif topic == "outbound:message":
                self.outbound.setdefault(sid, []).append(dict(payload))
                self.journal.append(("out", dict(payload)))


class _Model:
    """A chat model whose every call parks until the driver answers it (or a stop)."""

    def __init__(self, gate: _Gate, spec: Mapping[str, Any]) -> None:
        self._gate = gate
        self.id: str = spec["id"]
        self.provider_id: str = spec["provider"]
        self.context_length: int = spec["context_length"]
        self.max_output_tokens: int = spec["max_output_tokens"]
        self.think_levels = tuple(ThinkLevel(id=level) for level in spec["think_levels"])
        self.default_think: str | None = spec["default_think"]

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        gate = self._gate
        sid = request.session_id or ""
        with gate.cv:
            calls = gate.calls.setdefault(sid, [])
            call = _ModelCall(sid, len(calls) + 1, request, abort, gate.order())
            calls.append(call)
            gate.journal.append(("call", call))
            gate.cv.notify_all()
        abort.add_callback(gate.wake)
        with gate.cv:
            gate.wait(lambda: call.state != "parked" or abort.aborted)
            if call.state != "answered":
                call.state = "abandoned"
                gate.journal.append(("abandoned", call))
                if abort.aborted or gate.closed:
                    return
                raise ScenarioError(f"model call {call.index} of {sid} was never answered")
        assert call.reply is not None
        yield from call.reply.chunks()


def _llm_service(gate: _Gate, specs: tuple[Mapping[str, Any], ...]) -> LlmService:
    """The scenario's models as providers, in declaration order; the first is the default."""
    providers: dict[str, Provider] = {}
    for spec in specs:
        provider = providers.setdefault(spec["provider"], Provider(spec["provider"]))
        provider.models.append(_Model(gate, spec))
    return LlmService(providers.values())


class _Tools:
    """Tool handlers from the scenario; slow ones park until the driver releases them."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate

    def handler(self, spec: ToolSpec) -> Callable[[Mapping[str, Any], ToolCallContext], str]:
        def run(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
            gate = self._gate
            with gate.cv:
                runs = gate.runs.setdefault(spec.name, [])
                k = len(runs) + 1
                outcome = spec.outcome(k)
                state: Literal["parked", "done"] = "parked" if spec.slow else "done"
                item = _ToolRun(spec, k, dict(args), ctx, gate.order(), outcome, state)
                runs.append(item)
                gate.journal.append(("tool", item))
                if outcome is None:
                    gate.problems.append(
                        f"tool {spec.name!r}: call {k} (callId {ctx.call_id} in "
                        f"{ctx.session_id}) has no scripted result: results has "
                        f"{len(spec.results)}, and there is no result or error for later calls"
                    )
                gate.cv.notify_all()
            if spec.slow:
                if spec.abortable:
                    ctx.abort.add_callback(gate.wake)
                with gate.cv:
                    gate.wait(
                        lambda: item.state != "parked" or (spec.abortable and ctx.abort.aborted)
                    )
                    item.state = "done"
            if outcome is None:
                raise ScenarioError(f"tool {spec.name!r} call {k}: no scripted result")
            if outcome.error is not None:
                raise ToolError(outcome.error)
            return outcome.result or ""

        return run


@dataclass(frozen=True)
class _Settings:
    """Settings layers, lowest first: the plugin config, the session's scripted
    ``settings``, then what the session's log set (SCH5)."""

    base: StaticSettings
    layers: Mapping[str, Mapping[str, Any]]

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        layer = {**self.layers.get(session_id, {}), **session_layer}
        settings = self.base.for_turn(session_id, platform, layer, venue)
        model = layer.get("model")
        if isinstance(model, ModelRef):
            settings = msgspec.structs.replace(settings, model=model)
        return settings


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRecord:
    """One model call: the exact request sent, and how the driver answered it."""

    session_id: str
    index: int
    request: ChatRequest
    status: str
    reply: ReplySpec | None
    turn_id: str | None = None
    trim: dict[str, Any] | None = None  # the trim trace of this call (agent:trim), if any

    @property
    def violations(self) -> list[str]:
        """Breaches of the providers' message rules in the request (should be none)."""
        return provider_violations(self.request.messages)

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        return self.request.messages

    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        return self.request.tools

    @property
    def tool_names(self) -> list[str]:
        return [str(t.get("function", {}).get("name")) for t in self.request.tools]

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {
            "call": self.index,
            "turn_id": self.turn_id,
            "status": self.status,
            "model": r.model,
            "purpose": r.purpose,
            "think": r.think,
            "messages": [message_json(m) for m in r.messages],
            "tools": [dict(t) for t in r.tools],
            "reply": None if self.reply is None else self.reply.to_json(),
            "trim": self.trim,
            "violations": self.violations,
        }


@dataclass(frozen=True)
class InputRecord:
    """An input a step submitted: where it went, and how it ended."""

    step: int
    session_id: str
    input_id: str
    where: str
    turn_id: str | None
    outcome: str | None
    reason: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "input_id": self.input_id,
            "where": self.where,
            "turn_id": self.turn_id,
            "outcome": self.outcome,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class StepRecord:
    """A step as it happened, with what the runtime returned for it."""

    step: StepSpec
    result: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        s = self.step
        out: dict[str, Any] = {"step": s.index, "do": s.do, "session": s.session}
        out["at"] = s.at.describe()
        out["result"] = dict(self.result)
        return out


def message_json(m: ChatMessage) -> dict[str, Any]:
    """A sent message as plain data: role and content, then only the fields it has."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [msgspec.to_builtins(tc) for tc in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        out["reasoning"] = m.reasoning
    if m.kind is not None:
        out["kind"] = m.kind
    if m.meta.injector is not None:
        out["injector"] = m.meta.injector
    return out


@dataclass
class ScenarioResult:
    """What a scenario run produced, per session: calls, inputs, replies sent, the log."""

    scenario: Scenario
    calls: dict[str, list[CallRecord]]
    inputs: dict[str, list[InputRecord]]
    outbound: dict[str, list[dict[str, Any]]]
    logs: dict[str, list[SessionEvent]]
    steps: list[StepRecord]
    warnings: list[str]
    journal: list[tuple[str, Any]] = field(repr=False, default_factory=list)
    db: str | None = None

    def of(self, kind: type, session_id: str | None = None) -> list[Any]:
        """The session's logged events of one type (the only session when not given)."""
        sid = session_id or self.scenario.sessions[0].id
        return [e for e in self.logs[sid] if isinstance(e, kind)]

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document, as plain data."""
        sessions: dict[str, Any] = {}
        for s in self.scenario.sessions:
            sessions[s.id] = {
                "calls": [c.to_json() for c in self.calls[s.id]],
                "inputs": [i.to_json() for i in self.inputs[s.id]],
                "outbound": self.outbound[s.id],
                "log": [to_builtins(e) for e in self.logs[s.id]],
            }
        return {
            "scenario": self.scenario.name,
            "steps": [s.to_json() for s in self.steps],
            "sessions": sessions,
            "warnings": list(self.warnings),
        }

    def dumps(self) -> str:
        """The ``--json`` document: indented, UTF-8 text, the same bytes on every run."""
        raw = msgspec.json.encode(self.to_json())
        return msgspec.json.format(raw, indent=2).decode() + "\n"

    def transcript(self) -> str:
        """A readable account: steps, calls with what they sent, replies, tool runs,
        turn ends, input outcomes, then each session's timeline from the log."""
        return _transcript(self)


# --- the driver ------------------------------------------------------------------------


class _Driver:
    """Runs one scenario: fires steps at their points, answers calls, releases tools."""

    def __init__(self, sc: Scenario, store: EventStore, timeout_s: float) -> None:
        self.sc = sc
        self.store = store
        self.timeout_s = timeout_s
        self.gate = _Gate()
        self.clock = FixedClock(sc.start_ms, 0)
        self.actions = 0
        self.handles: list[tuple[StepSpec, SubmitHandle]] = []
        self.records: list[StepRecord] = []
        tools = _Tools(self.gate)
        registry = ToolRegistry(
            Tool(
                t.name,
                tools.handler(t),
                description=t.description,
                parameters=t.parameters,
                groups=t.groups,
            )
            for t in sc.tools
        )
        config = sc.config
        services = Services(
            llm=_llm_service(self.gate, sc.models),
            tools=registry,
            authority=StaticAuthority(sc.owners),
            sessions=StaticSessions(
                {
                    s.id: SessionInfo(
                        s.id, s.platform, multi_party=s.multi_party, parent_id=s.parent
                    )
                    for s in sc.sessions
                }
            ),
            settings=_Settings(
                StaticSettings(
                    think=config.think,
                    max_tool_iterations=config.max_tool_iterations,
                    history_limit=config.history_limit,
                ),
                {s.id: s.settings for s in sc.sessions},
            ),
            config=config,
            archive=LogArchive() if sc.archive else None,
            tz=sc.tz,
        )
        self.runtime = Runtime(
            store, services, self.clock, SequentialIds(), janitor=False, ask_timeout_s=timeout_s
        )
        for topic in ("turn:opened", "turn:ended", "outbound:message"):
            self.runtime.subscribe(topic, self.gate.on_bus)
        self.trims: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.runtime.subscribe("agent:trim", self._on_trim)

    def _on_trim(self, topic: str, payload: Any) -> None:
        key = (payload["sessionId"], payload["turnId"], payload["call"])
        self.trims[key] = {
            "budget": payload["budget"],
            "steps": payload["steps"],
            "trace": payload["trace"],
        }

    def error(self, reason: str, step: StepSpec | None = None) -> ScenarioError:
        return ScenarioError(reason, file=self.sc.file, where=step.label() if step else None)

    # --- running --------------------------------------------------------------------

    def run(self) -> ScenarioResult:
        ok = False
        try:
            self.settle("the start")
            for step in self.sc.steps:
                self.reach(step)
                self.fire(step)
            self.finish()
            inputs = self.outcomes()
            ok = True
        finally:
            if not ok:  # stopped turns leave their parked calls quietly
                for s in self.sc.sessions:
                    with contextlib.suppress(Exception):
                        self.runtime.stop(s.id)
            self.gate.close()  # parked tools return
            try:
                self.runtime.shutdown(timeout=self.timeout_s)
            except Exception:
                if ok:
                    raise
        return self.result(inputs)

    def settle(self, after: str) -> None:
        """Wait until every actor has handled its mail and every running turn is parked
        at a model call or a slow tool (or has ended)."""
        deadline = time.monotonic() + self.timeout_s
        stable = 0
        sessions = [s.id for s in self.sc.sessions]
        while True:
            for sid in sessions:
                self.runtime.view(sid)  # answered after every message before it
            with self.gate.cv:
                live = sum(self.gate.opened.get(s, 0) - self.gate.ended.get(s, 0) for s in sessions)
                parked = len(self.parked_calls()) + len(self.parked_runs())
                problems = list(self.gate.problems)
            if problems:
                raise self.error(problems[0])
            if live == parked:
                stable += 1
                if stable >= 2:
                    return
                continue
            stable = 0
            if time.monotonic() > deadline:
                raise self.error(
                    f"the runtime did not settle within {self.timeout_s:g}s after {after}: "
                    f"{live} turn(s) running, {parked} parked at a model call or a slow tool"
                )
            time.sleep(0.0005)

    def parked_calls(self) -> list[_ModelCall]:
        return [c for calls in self.gate.calls.values() for c in calls if c.parked]

    def parked_runs(self) -> list[_ToolRun]:
        return [r for runs in self.gate.runs.values() for r in runs if r.parked]

    def reply_for(self, call: _ModelCall) -> ReplySpec | None:
        replies = self.sc.replies.get(call.session, ())
        return replies[call.index - 1] if call.index <= len(replies) else None

    def advance(self, only: str | None = None) -> bool:
        """Answer the call or release the tool that parked first (of session ``only``,
        when given); False when nothing can move. Calls without a reply stay parked."""
        with self.gate.cv:
            items: list[_ModelCall | _ToolRun] = [
                c for c in self.parked_calls() if self.reply_for(c) is not None
            ]
            items += self.parked_runs()
            items = [x for x in items if only is None or _session_of(x) == only]
            if not items:
                return False
            item = min(items, key=lambda x: x.order)
            if isinstance(item, _ModelCall):
                item.reply = self.reply_for(item)
                item.state = "answered"
                self.gate.journal.append(("answer", item))
                what = f"answering call {item.index} of {item.session}"
            else:
                item.state = "released"
                self.gate.journal.append(("release", item))
                what = f"releasing tool {item.spec.name} call {item.index}"
            self.gate.cv.notify_all()
        self.actions += 1
        self.settle(what)
        self.clock.advance(self.sc.tick_ms)
        return True

    def point_state(self, at: Point) -> Literal["reached", "passed", "pending"]:
        with self.gate.cv:
            if at.kind == "now":
                return "reached"
            if at.kind == "start":
                return "reached" if self.actions == 0 else "passed"
            if at.kind == "after-turn":
                ended = self.gate.ended.get(at.session or "", 0)
                return "reached" if ended >= at.n else "pending"
            items: list[Any] = (
                self.gate.calls.get(at.session or "", [])
                if at.kind == "before-call"
                else self.gate.runs.get(at.tool or "", [])
            )
            if len(items) < at.n:
                return "pending"
            return "reached" if items[at.n - 1].parked else "passed"

    def reach(self, step: StepSpec) -> None:
        """Drive the runtime forward until the step's point, or fail clearly."""
        while True:
            state = self.point_state(step.at)
            if state == "reached":
                return
            if state == "passed":
                raise self.error(
                    "that point has already passed when the steps before it were done "
                    "(steps happen in file order)",
                    step,
                )
            if not self.advance():
                raise self.error(f"can never happen: {self.stuck(step.at)}", step)

    def stuck(self, at: Point) -> str:
        """Why nothing can move any more, for an error message."""
        with self.gate.cv:
            waiting = [c for c in self.parked_calls() if self.reply_for(c) is None]
            calls = len(self.gate.calls.get(at.session or "", []))
            runs = len(self.gate.runs.get(at.tool or "", []))
            ended = self.gate.ended.get(at.session or "", 0)
        if waiting:
            c = waiting[0]
            scripted = len(self.sc.replies.get(c.session, ()))
            return (
                f"call {c.index} of {c.session} waits for a reply, {_scripted(scripted, c.session)}"
            )
        if at.kind == "tool":
            return f"nothing runs any more, and tool {at.tool} ran {runs} time(s)"
        if at.kind == "after-turn":
            return f"nothing runs any more, and session {at.session} ended {ended} turn(s)"
        return f"nothing runs any more, and session {at.session} made {calls} model call(s)"

    def fire(self, step: StepSpec) -> None:
        sid = step.session
        rt = self.runtime
        result: dict[str, Any] = {}  # filled in below; noted first so the journal's order
        record = StepRecord(step, result)  # puts the step before what it causes
        self.records.append(record)
        self.gate.note("step", record)
        platform = step.platform or self.sc.session(sid).platform
        match step.do:
            case "say" | "inject":
                assert step.input is not None
                room = self.sc.session(sid)
                inp = msgspec.structs.replace(
                    step.input,
                    platform=step.input.platform or room.platform,
                    group_id=room.group_id,
                )
                handle = rt.submit(sid, inp)
                self.handles.append((step, handle))
                result.update(input_id=handle.input_id, where=handle.where)
            case "stop":
                result["turn_id"] = rt.stop(sid, platform=platform, user_id=step.by)
            case "stop_command":
                result["reply"] = rt.stop_command(sid, platform, step.by)
            case "stop_all":
                result["turn_id"] = rt.stop_all(sid, platform=platform, user_id=step.by)
            case "mute":
                result["turn_id"] = rt.mute(sid)
            case "delete":
                generation = self.blocking(step, lambda: rt.delete(sid, timeout=self.timeout_s))
                result["generation"] = generation
            case "clear":
                kinds = step.kinds
                self.blocking(step, lambda: rt.clear(sid, kinds, timeout=self.timeout_s))
            case "wait":
                self.clock.advance(step.ms)
                result["now_ms"] = self.clock.now_ms()
        self.settle(step.label())
        self.clock.advance(self.sc.tick_ms)

    def blocking(self, step: StepSpec, fn: Callable[[], Any]) -> Any:
        """Run a call that waits for the running turn to wind down (delete, clear), while
        driving the runtime so that a parked tool can return."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        worker = threading.Thread(target=work, name=f"scenario:{step.do}", daemon=True)
        worker.start()
        deadline = time.monotonic() + self.timeout_s
        sid = step.session
        while worker.is_alive():
            self.settle(step.label())
            with self.gate.cv:
                running = self.gate.opened.get(sid, 0) > self.gate.ended.get(sid, 0)
            # Only the session's own turn holds the call up; once it has ended the call
            # returns by itself, and moving anything else would race with it.
            if running and self.advance(only=sid):
                continue
            worker.join(max(deadline - time.monotonic(), 0))
            if worker.is_alive():
                raise self.error(f"{step.do} did not finish within {self.timeout_s:g}s", step)
        if "error" in box:
            raise self.error(f"{step.do} failed: {box['error']}", step)
        return box.get("value")

    def finish(self) -> None:
        """After the last step: answer and release everything until all is idle."""
        while self.advance():
            pass
        with self.gate.cv:
            waiting = [c for c in self.parked_calls() if self.reply_for(c) is None]
        if waiting:
            c = waiting[0]
            scripted = len(self.sc.replies.get(c.session, ()))
            raise self.error(
                f"after the last step, call {c.index} of {c.session} waits for a reply, "
                f"{_scripted(scripted, c.session)}: add a [[replies]] entry"
            )

    def outcomes(self) -> dict[str, list[InputRecord]]:
        out: dict[str, list[InputRecord]] = {s.id: [] for s in self.sc.sessions}
        deadline = time.monotonic() + self.timeout_s
        for step, handle in self.handles:
            outcome: InputOutcome | None = None
            with contextlib.suppress(TimeoutError):
                outcome = handle.result(max(deadline - time.monotonic(), 0))
            out[step.session].append(
                InputRecord(
                    step=step.index,
                    session_id=step.session,
                    input_id=handle.input_id,
                    where=handle.where,
                    turn_id=outcome.turn_id if outcome else None,
                    outcome=str(outcome.outcome) if outcome else None,
                    reason=outcome.reason if outcome else None,
                )
            )
        return out

    def result(self, inputs: dict[str, list[InputRecord]]) -> ScenarioResult:
        sc = self.sc
        logs = {s.id: self.store.read(s.id) for s in sc.sessions}
        calls: dict[str, list[CallRecord]] = {}
        warnings: list[str] = []
        for s in sc.sessions:
            started = [e for e in logs[s.id] if isinstance(e, ModelCallStarted)]
            made = self.gate.calls.get(s.id, [])
            calls[s.id] = [
                CallRecord(
                    session_id=s.id,
                    index=c.index,
                    request=c.request,
                    status=c.state,
                    reply=c.reply,
                    turn_id=started[i].turn_id if i < len(started) else None,
                    trim=self.trims.get((s.id, started[i].turn_id, started[i].index))
                    if i < len(started)
                    else None,
                )
                for i, c in enumerate(made)
            ]
            scripted = len(sc.replies.get(s.id, ()))
            if scripted > len(made):
                warnings.append(
                    f"session {s.id}: {scripted - len(made)} scripted repl"
                    f"{'y was' if scripted - len(made) == 1 else 'ies were'} never used "
                    f"({len(made)} model call(s) were made)"
                )
        for records in inputs.values():
            for r in records:
                if r.outcome is None:
                    warnings.append(f"input {r.input_id} (step {r.step}) never resolved")
        return ScenarioResult(
            scenario=sc,
            calls=calls,
            inputs=inputs,
            outbound={s.id: list(self.gate.outbound.get(s.id, [])) for s in sc.sessions},
            logs=logs,
            steps=list(self.records),
            warnings=warnings,
            journal=list(self.gate.journal),
        )


def _scripted(n: int, session: str) -> str:
    return f"but only {n} {'reply is' if n == 1 else 'replies are'} scripted for {session}"


def _session_of(item: _ModelCall | _ToolRun) -> str:
    return item.session if isinstance(item, _ModelCall) else item.ctx.session_id


def run_scenario(
    source: str | Path | Mapping[str, Any] | Scenario,
    *,
    db: str | Path | None = None,
    timeout_s: float | None = None,
) -> ScenarioResult:
    """Run a scenario (a file, its parsed table, or a loaded :class:`Scenario`).

    The log goes to an in-memory store, or to the SQLite file ``db`` (which must not
    hold the scenario's sessions yet). ``timeout_s`` overrides the file's ``timeout_s``.
    """
    sc = source if isinstance(source, Scenario) else load_scenario(source)
    store: EventStore
    if db is None:
        store = InMemoryEventStore()
    else:
        store = SqliteEventStore(str(db))
        taken = sorted(set(store.sessions()) & {s.id for s in sc.sessions})
        if taken:
            store.close()
            raise ScenarioError(
                f"{db} already holds session {taken[0]!r}: use a new database file", file=sc.file
            )
    try:
        result = _Driver(sc, store, timeout_s or sc.timeout_s).run()
    finally:
        if db is not None:
            store.close()
    result.db = None if db is None else str(db)
    return result


# --- the readable transcript -------------------------------------------------------------


def _preview(text: str | None, width: int = 100) -> str:
    if text is None:
        return "-"
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def _message_line(m: ChatMessage) -> str:
    tags: list[str] = [m.role]
    if m.kind:
        tags.append(f"kind={m.kind}")
    if m.meta.injector:
        tags.append(f"injector={m.meta.injector}")
    if m.tool_call_id:
        tags.append(f"callId={m.tool_call_id}")
    line = f"      {' '.join(tags):<22} {_preview(m.content, 90)}"
    for tc in m.tool_calls:
        line += f"\n      {'':<22} → {tc.name}#{tc.id} {_preview(tc.arguments, 60)}"
    return line


def _reply_line(reply: ReplySpec) -> str:
    if reply.error is not None:
        return f"model fails: {_preview(reply.error)}"
    parts = []
    if reply.reasoning:
        parts.append(f"reasoning {_preview(reply.reasoning, 40)}")
    if reply.text or not reply.tool_calls:
        parts.append(f"text {_preview(reply.text)}")
    parts += [f"{tc.name}#{tc.id} {_preview(tc.arguments, 60)}" for tc in reply.tool_calls]
    return "; ".join(parts)


def _step_line(record: StepRecord) -> str:
    s = record.step
    head = f"[step {s.index}] {s.at.describe()}: {s.session} ← {s.do}"
    if s.input is not None:
        inp = s.input
        who = inp.sender.user_id or "-"
        if inp.sender.nickname:
            who += f" ({inp.sender.nickname})"
        kind = "" if inp.source is None else f" source={inp.source}"
        if inp.trigger_type:
            kind += f" trigger={inp.trigger_type}"
        addressed = "" if inp.addressed else " not-addressed"
        head += f" from {who}{kind}{addressed}: {_preview(inp.content, 60)}"
    elif s.by is not None:
        head += f" by {s.by}"
    elif s.kinds:
        head += f" {', '.join(s.kinds)}"
    result = ", ".join(f"{k}={v}" for k, v in record.result.items())
    if result:
        head += f" → {result}"
    if s.note:
        head += f"\n    ({s.note})"
    return head


def _transcript(result: ScenarioResult) -> str:
    sc = result.scenario
    start = datetime.fromtimestamp(sc.start_ms / 1000, sc.tz).isoformat()
    rooms = ", ".join(
        f"{s.id} ({s.platform}{', multi-party' if s.multi_party else ''})" for s in sc.sessions
    )
    lines = [f"scenario {sc.name} ({sc.file})", f"start {start}; sessions: {rooms}"]
    if sc.description:
        lines.append(sc.description.strip())
    lines.append("")
    turn_of = {(c.session_id, c.index): c.turn_id for calls in result.calls.values() for c in calls}
    for kind, item in result.journal:
        if kind == "step":
            lines.append(_step_line(item))
        elif kind == "call":
            turn = turn_of.get((item.session, item.index)) or "?"
            r = item.request
            tools = ", ".join(str(t.get("function", {}).get("name")) for t in r.tools) or "none"
            lines.append(
                f"[call {item.index} of {item.session}] {turn}: {len(r.messages)} messages, "
                f"tools: {tools}"
            )
            lines += [_message_line(m) for m in r.messages]
        elif kind == "answer":
            lines.append(f"    answered call {item.index}: {_reply_line(item.reply)}")
        elif kind == "abandoned":
            lines.append(f"    call {item.index} of {item.session} abandoned (stopped)")
        elif kind == "tool":
            args = json.dumps(item.arguments, ensure_ascii=False)
            parked = " (slow: parked)" if item.spec.slow else ""
            lines.append(
                f"[tool {item.spec.name} call {item.index}] {item.ctx.call_id} {args}{parked}"
                + ("" if item.spec.slow else f" → {_outcome_text(item.outcome)}")
            )
        elif kind == "release":
            lines.append(
                f"    released {item.spec.name} call {item.index} → {_outcome_text(item.outcome)}"
            )
        elif kind == "out":
            kind_ = item.get("kind", "reply")
            lines.append(f"[{kind_} {item.get('turnId')}] {_preview(item.get('content'))}")
        elif kind == "ended":
            reason = f" ({item['reason']})" if item.get("reason") else ""
            lines.append(
                f"[turn {item['turnId']} of {item['sessionId']}] {item['outcome']}{reason}"
            )
    lines.append("")
    lines.append("Inputs:")
    for s in sc.sessions:
        for r in result.inputs[s.id]:
            end = f"{r.turn_id or '-'} {r.outcome}" + (f" ({r.reason})" if r.reason else "")
            lines.append(f"  {s.id} {r.input_id} (step {r.step}): {r.where} → {end}")
    for w in result.warnings:
        lines.append(f"warning: {w}")
    for s in sc.sessions:
        lines.append("")
        lines.append(f"== log of {s.id} ({len(result.logs[s.id])} events) ==")
        lines += [f"#{e.seq:<4} {render_event(e)}" for e in result.logs[s.id]]
    lines.append("")
    if result.db is not None:
        lines.append("Replay it:")
        lines += [f"  aalis-agent replay {result.db} --session {s.id}" for s in sc.sessions]
    else:
        lines.append(
            "The log was kept in memory: add --db FILE to keep it, then replay it with "
            "`aalis-agent replay FILE`."
        )
    return "\n".join(lines) + "\n"


def _outcome_text(outcome: ToolOutcome | None) -> str:
    if outcome is None:
        return "(no scripted result)"
    if outcome.error is not None:
        return f"ToolError: {_preview(outcome.error, 60)}"
    return _preview(outcome.result, 60)


# --- the command -----------------------------------------------------------------------


def run_cli(
    file: str,
    *,
    db: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``aalis-agent scenario FILE [--db PATH] [--json]``: run it, print the JSON document
    or the transcript; warnings go to ``err``. Errors raise :class:`ScenarioError`."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    result = run_scenario(file, db=db)
    out.write(result.dumps() if as_json else result.transcript())
    for warning in result.warnings:
        err.write(f"warning: {warning}\n")
    return 0
