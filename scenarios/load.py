"""Loading a scenario: a TOML file, or the table it parses to, read and checked into a
:class:`Scenario`; a mistake raises :class:`ScenarioError` naming the place and what is
wrong, and keys that are not part of the format are refused as typos.

Each table is decoded into a typed msgspec Struct (unknown keys refused, ranges as Meta
constraints, enumerations as Literals); what is left here is what a type cannot say: the
``at`` point grammar, cross references between sessions, tools, replies and steps, and
settings as ``/session.set`` would check them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import tomllib
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

import msgspec
import msgspec.inspect as mi
from aalis_agent.actors.hooks import HOOK_KEYS
from aalis_agent.events import ConfigError, HostNotice, Input, ModelRef, Sender, ToolCall
from aalis_agent.events.errors import ScenarioError
from aalis_agent.events.schema import TriggerType
from aalis_agent.request.limits import MAX_DEPTH, clean_text, find_unloggable, toml_too_deep
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
from aalis_agent.services import AgentConfig, Usage, shapes
from aalis_agent.services.config import toml_path, toml_value
from aalis_agent.services.settings import (
    MAX_TOKENS,
    check_config_range,
    validate_setting,
)
from aalis_agent.services.shapes import bare, info_at, value_at
from msgspec import Meta

T = TypeVar("T")

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
DEFAULT_TRIGGERS: dict[str, TriggerType] = {
    "schedule": "interval",
    "proactive": "proactive",
    "idle": "idle",
}

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
    '"start", "before call N", "after turn N", "after chunk K of call N", '
    '"while HOOK of call N runs" (HOOK: agent:llm:before, agent:llm:after, '
    'agent:reply:before), "while HOOK of turn N runs" (agent:turn:before, '
    'agent:turn:after) (each with " of SESSION"), "while TOOL runs" or '
    '"while TOOL call K runs"'
)

# --- the file's shape, checked by msgspec ------------------------------------------------
# A table whose place in error messages is named from what it holds ([[sessions]] by its
# id, [[tools]] by its name, [[replies]] and [[steps]] by their session and point) is read
# in two goes: a lenient head (the keys the name needs) first, then the whole table.
# Tables inside a table (usage, notice, settings, tool_calls, results) are Structs, and an
# error inside one names it after its owner ("reply #1 (call 1 of s1) usage"). ``extra``
# gives an error its words: ``what`` a value should be, ``required`` what a missing key
# is for; for an enumeration, ``values`` its values in the order shown and ``not`` what a
# value outside it is not. A key given as None (only the Python form can) is not given.

Tokens = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
Limit = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
JsonSchema = Annotated[dict[str, Any], Meta(extra={"what": "a table (a JSON schema)"})]


TABLES = "a list of tables ([[{key}]])"
Tables = Annotated[list[Any], Meta(extra={"what": TABLES})]


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A table of the file: an unknown key refused."""


class _Head(msgspec.Struct, kw_only=True):
    """The first keys of a table, read to name it; the rest is read with the whole."""


class _Model(_Spec):
    id: str
    provider: str = "scenario"
    context_length: Limit = 32_000
    max_output_tokens: Limit = 4096
    think_levels: list[str] = msgspec.field(default_factory=list)
    default_think: str | None = None


class _FirstModel(_Model):
    """``[model]``: the model every session uses unless it says otherwise."""

    id: str = "scripted"


class _Top(_Spec):
    name: str | None = None
    description: str = ""
    timezone: Annotated[str, Meta(extra={"what": 'text like "+08:00" or "UTC"'})] | None = None
    start: Any = None  # ISO text, a TOML date and time or milliseconds: _start reads it
    tick_ms: Annotated[int, Meta(ge=0, le=MAX_TICK_MS)] = 1000
    timeout_s: Annotated[
        float, Meta(gt=0, le=MAX_TIMEOUT_S, extra={"what": "a positive number"})
    ] = 10.0
    owners: list[str] = msgspec.field(default_factory=list)
    archive: bool = True
    config: Any = None  # "[config]": AgentConfig checks it
    model: Any = None  # "[model]": a _FirstModel
    models: Tables = msgspec.field(default_factory=list)
    sessions: Tables = msgspec.field(default_factory=list)
    tools: Tables = msgspec.field(default_factory=list)
    replies: Tables = msgspec.field(default_factory=list)
    steps: Tables = msgspec.field(default_factory=list)


class _SessionSettings(_Spec):
    # Any value: AgentConfig and validate_setting check them as /session.set would.
    history_limit: Any = msgspec.field(default=msgspec.UNSET, name="historyLimit")
    max_tool_iterations: Any = msgspec.field(default=msgspec.UNSET, name="maxToolIterations")
    think: Any = msgspec.UNSET
    enabled_tool_groups: list[str] | None = msgspec.field(default=None, name="enabledToolGroups")
    model: str | None = None


class _SessionHead(_Head):
    id: str


class _Session(_SessionHead, forbid_unknown_fields=True):
    platform: str = "cli"
    multi_party: bool = False
    group_id: str | None = None
    parent: str | None = None
    settings: _SessionSettings | None = None


class _Outcome(_Spec):
    result: str | None = None
    error: str | None = None


class _ToolHead(_Head):
    name: str


class _Tool(_ToolHead, forbid_unknown_fields=True):
    description: str = ""
    parameters: JsonSchema | None = None
    groups: list[str] = msgspec.field(default_factory=list)
    results: Annotated[list[str | _Outcome], Meta(extra={"what": TABLES})] = msgspec.field(
        default_factory=list
    )
    result: str | None = None
    error: str | None = None
    slow: bool = False
    abortable: bool = False


class _Usage(_Spec):
    prompt_tokens: Tokens | None = None
    completion_tokens: Tokens | None = None
    total_tokens: Tokens | None = None
    cached_prompt_tokens: Tokens | None = None


class _ToolCall(_Spec):
    name: str
    id: str | None = None
    arguments: (
        Annotated[str, Meta(extra={"what": "text (sent as is, so it may be broken JSON)"})]
        | dict[str, Any]
        | None
    ) = None


class _ReplyHead(_Head):
    session: str | None = None


class _Reply(_ReplyHead, forbid_unknown_fields=True):
    call: Annotated[int, Meta(ge=1)] | None = None
    text: str | None = None
    chunks: (
        Annotated[int, Meta(ge=1, le=MAX_CHUNKS, extra={"what": "a number >= 1"})]
        | list[str]
        | None
    ) = None
    usage: _Usage | None = None
    tool_calls: Annotated[list[_ToolCall], Meta(extra={"what": TABLES})] = msgspec.field(
        default_factory=list
    )
    reasoning: str | None = None
    error: str | None = None


class _Notice(_Spec):
    kind: str
    id: str
    untrusted: str | None = None
    reply_to: str | None = None


class _StepDo(_Head):
    do: Annotated[StepKind, Meta(extra={"not": "a step", "values": STEP_KINDS})]


class _StepHead(_StepDo):
    session: str | None = None
    at: str | None = None


class _Step(_StepHead, forbid_unknown_fields=True):
    """A step that takes nothing more (mute, delete)."""

    note: str | None = None


class _Say(_Step, kw_only=True):
    text: str
    trigger: Annotated[TriggerType, Meta(extra={"values": TRIGGERS})] | None = None
    sender: str | None = msgspec.field(default=None, name="from")
    nickname: str | None = None
    id: str = ""
    platform: str = ""
    message_id: str | None = None
    addressed: bool = True
    mentions: list[str] = msgspec.field(default_factory=list)
    gateway_seq: Annotated[int, Meta(ge=0)] | None = None


class _Inject(_Say, kw_only=True):
    actor: str | None = None
    source: Annotated[str, Meta(min_length=1)]
    notice: _Notice | None = None


class _Stop(_Step):
    by: str | None = None
    platform: str | None = None


class _Clear(_Step):
    kinds: list[str] = msgspec.field(default_factory=list)


class _Wait(_Step, kw_only=True):
    ms: Annotated[int, Meta(ge=1, le=MAX_WAIT_MS, extra={"required": "how far the clock moves"})]


_STEPS: dict[str, type[_Step]] = {
    "say": _Say,
    "inject": _Inject,
    "stop": _Stop,
    "stop_command": _Stop,
    "stop_all": _Stop,
    "clear": _Clear,
    "wait": _Wait,
    "mute": _Step,
    "delete": _Step,
}


class _Place:
    """A place in the file (``top level``, ``tool "x"``, ``step 2 (say at now)``): its
    tables are converted here, and every error names the file and the place."""

    def __init__(self, file: str, where: str) -> None:
        self.file = file
        self.where = where

    def error(self, reason: str) -> ScenarioError:
        return ScenarioError(reason, file=self.file, where=self.where)

    def convert(self, value: Any, tp: type[T]) -> T:
        """``value`` as ``tp`` (msgspec checks it), or a ScenarioError naming the place;
        a key given as None (only the Python form can) counts as not given."""
        info = _type_info(tp)
        value = _given(value, info)
        try:
            return msgspec.convert(value, tp)
        except msgspec.ValidationError as exc:
            inner, reason = _explain(str(exc), value, info)
            raise ScenarioError(reason, file=self.file, where=self.where + inner) from None


# --- msgspec's errors in the file's words ----------------------------------------------


_TYPE_INFO: dict[Any, Any] = {}


def _type_info(tp: Any) -> Any:
    if tp not in _TYPE_INFO:
        _TYPE_INFO[tp] = mi.type_info(tp)
    return _TYPE_INFO[tp]


def _given(value: Any, info: Any) -> Any:
    """``value`` without the keys of its tables that hold None."""
    struct = bare(info, mi.StructType)
    if struct is not None and isinstance(value, Mapping):
        fields = {f.encode_name: f.type for f in struct.fields}
        return {
            k: _given(v, fields.get(k, mi.AnyType())) for k, v in value.items() if v is not None
        }
    items = bare(info, mi.ListType)
    if items is not None and isinstance(value, list):
        return [_given(v, items.item_type) for v in value]
    return value


def _explain(error: str, value: Any, info: Any) -> tuple[str, str]:
    """``(inner place, reason)`` for msgspec's ``error`` converting ``value`` to the type
    ``info``: a table inside the table converted names the inner place (`` usage``,
    `` tool_calls #2``); the reason names the key, what it takes and what it got."""
    message, steps = shapes.split_error(error)
    inner, i = "", 0
    while i < len(steps) and isinstance(steps[i], str):
        struct = bare(info, mi.StructType)
        members = struct.fields if struct is not None else ()
        field = next((f.type for f in members if f.encode_name == steps[i]), None)
        if field is None:
            break
        items = bare(field, mi.ListType)
        if bare(field, mi.StructType) is not None:
            inner, info, i = f"{inner} {steps[i]}", field, i + 1
        elif (
            items is not None
            and bare(items.item_type, mi.StructType) is not None
            and i + 1 < len(steps)
            and isinstance(steps[i + 1], int)
        ):
            inner += f" {steps[i]} #{int(steps[i + 1]) + 1}"
            info, i = items.item_type, i + 2
        else:
            break
    rest = steps[i:]
    key = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in rest).lstrip(".")
    subject = f"{key} " if key else ""
    info = info_at(info, rest)
    field_error = shapes.FIELD.match(message)
    if field_error is not None:
        name = field_error["name"]
        struct = bare(info, mi.StructType)
        fields = {f.encode_name: f.type for f in struct.fields} if struct else {}
        if field_error["how"] == "contains unknown":
            known = ", ".join(sorted(fields)) or "none"
            return inner, f"{subject}unknown key {toml_value(name)} (known here: {known})"
        hint = shapes.extra(fields.get(name)).get("required")
        return inner, f"{subject}{name} is required" + (f" ({hint})" if hint else "")
    got = value_at(value, steps)
    what = shapes.extra(info).get("what")
    bound = shapes.RANGE.match(message)
    if bound is not None:
        if what and bound["op"].startswith(">"):
            return inner, f"{subject}must be {shapes.what(info)}, got {toml_value(got)}"
        limit = f"{float(bound['bound']):g}" if "." in bound["bound"] else bound["bound"]
        return inner, f"{subject}must be {bound['op']} {limit}, got {toml_value(got)}"
    if message.startswith("Expected `str` of length"):
        return inner, f"{subject}must not be empty"
    literal = bare(info, mi.LiteralType)
    if message.startswith("Invalid enum value") and literal is not None:
        values = ", ".join(map(str, shapes.extra(info).get("values", literal.values)))
        nope = shapes.extra(info).get("not")
        if nope:
            return inner, f"{key} = {toml_value(got)} is not {nope}; use one of {values}"
        return inner, f"{subject}must be one of {values}, got {toml_value(got)}"
    if message.startswith("Expected `"):
        what = shapes.what(info).replace("{key}", key)
        return inner, f"{subject}must be {what}, got {shapes.kind(got, toml_value)}"
    return inner, subject + message[:1].lower() + message[1:]


def _only(scripted: int) -> str:
    return f"only {scripted} {'reply is' if scripted == 1 else 'replies are'}"


def load_scenario(source: str | Path | Mapping[str, Any]) -> Scenario:
    """Read and check a scenario: a TOML file's path, or the table it would parse to.

    What the event log could not hold is refused naming the file and the dotted key (as
    TOML writes it: ``tools[0].parameters."a b"``):
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
        deep = toml_too_deep(text, MAX_DEPTH, shown=toml_path)
        if deep is not None:
            key, line = deep
            raise ScenarioError(
                f"nested deeper than {MAX_DEPTH} levels (line {line})", file=file, where=key
            )
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"not valid TOML: {exc}", file=file) from None
    bad = find_unloggable(data, max_depth=MAX_DEPTH, shown=toml_path)
    if bad is not None:
        raise ScenarioError(bad[1], file=file, where=bad[0] or "top level")
    return _Loader(file).load(data, default_name=Path(file).stem)


class _Loader:
    def __init__(self, file: str) -> None:
        self.file = file

    def place(self, where: str) -> _Place:
        return _Place(self.file, where)

    def load(self, data: Mapping[str, Any], default_name: str) -> Scenario:
        top = self.place("top level")
        spec = top.convert(data, _Top)
        tz = self._tz(top, spec)
        start_ms = self._start(top, spec.start, tz)
        owners = self._owners(top, spec.owners)
        config = self._config(spec.config)
        models = self._models(spec.model, spec.models)
        sessions = self._sessions(spec.sessions, top)
        ids = [s.id for s in sessions]
        tools = self._tools(spec.tools)
        replies = self._replies(spec.replies, ids)
        steps = self._steps(spec.steps, ids, tools, replies)
        return Scenario(
            name=spec.name if spec.name is not None else default_name,
            file=self.file,
            description=spec.description,
            start_ms=start_ms,
            tz=tz,
            tick_ms=spec.tick_ms,
            timeout_s=spec.timeout_s,
            owners=owners,
            archive=spec.archive,
            config=config,
            models=models,
            sessions=tuple(sessions),
            tools=tuple(tools),
            replies=replies,
            steps=tuple(steps),
        )

    # --- settings -----------------------------------------------------------------

    def _tz(self, top: _Place, spec: _Top) -> tzinfo:
        value = spec.timezone
        if value is None:
            start = spec.start
            if isinstance(start, str):
                with contextlib.suppress(ValueError):
                    start = datetime.fromisoformat(start)
            if isinstance(start, datetime) and start.tzinfo is not None:
                return start.tzinfo
            return UTC
        if value.upper() in ("UTC", "Z"):
            return UTC
        m = re.fullmatch(r"([+-])(\d{2}):?(\d{2})", value)
        if m is None or int(m[2]) > 23 or int(m[3]) > 59:
            raise top.error(
                f'timezone must look like "+08:00", "-05:30" or "UTC", got {toml_value(value)}'
            )
        sign = 1 if m[1] == "+" else -1
        return timezone(sign * timedelta(hours=int(m[2]), minutes=int(m[3])))

    def _start(self, top: _Place, value: Any, tz: tzinfo) -> int:
        """``start``: ISO text, a TOML date and time, or milliseconds since the epoch."""
        if value is None:
            return DEFAULT_START_MS
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value)
            except ValueError:
                raise top.error(f"start is not an ISO date and time: {toml_value(value)}") from None
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
        raise top.error(f"start must be a date and time, got {shapes.kind(value, toml_value)}")

    def _owners(self, top: _Place, owners: list[str]) -> tuple[tuple[str, str], ...]:
        out = []
        for owner in owners:
            platform, sep, user = owner.partition(":")
            if not sep or not platform or not user:
                raise top.error(f'owners: {toml_value(owner)} is not "platform:user_id"')
            out.append((platform, user))
        return tuple(out)

    def _config(self, data: Any) -> AgentConfig:
        if data is None:
            return AgentConfig()
        table = self.place("[config]").convert(data, dict[str, Any])
        try:
            config = AgentConfig.from_mapping(table, where="[config]")
            check_config_range(config, where="[config]")
        except (ConfigError, TypeError) as exc:
            raise ScenarioError(str(exc), file=self.file) from None
        return config

    def _models(self, first: Any, more: list[Any]) -> tuple[dict[str, Any], ...]:
        models: list[dict[str, Any]] = []
        for i, data in enumerate([first if first is not None else {}, *more]):
            t = self.place("[model]" if i == 0 else f"[[models]] #{i}")
            spec = t.convert(data, _FirstModel if i == 0 else _Model)
            entry = f"{spec.provider}/{spec.id}"
            if any(f"{m['provider']}/{m['id']}" == entry for m in models):
                raise t.error(f"model {toml_value(entry)} is declared twice")
            if spec.default_think is not None and spec.default_think not in spec.think_levels:
                raise t.error("default_think must be one of think_levels")
            models.append(
                {
                    "id": spec.id,
                    "provider": spec.provider,
                    "context_length": spec.context_length,
                    "max_output_tokens": spec.max_output_tokens,
                    "think_levels": tuple(spec.think_levels),
                    "default_think": spec.default_think,
                }
            )
        return tuple(models)

    def _sessions(self, items: list[Any], top: _Place) -> list[SessionSpec]:
        if not items:
            raise top.error("no [[sessions]]: declare at least one session (id, platform)")
        sessions: list[SessionSpec] = []
        for i, item in enumerate(items, 1):
            t = self.place(f"[[sessions]] #{i}")
            sid = t.convert(item, _SessionHead).id
            t.where = f"session {toml_value(sid)}"
            if not sid or any(s.id == sid for s in sessions):
                raise t.error("session ids must be non-empty and unique")
            spec = t.convert(item, _Session)
            sessions.append(
                SessionSpec(
                    id=sid,
                    platform=spec.platform,
                    multi_party=spec.multi_party,
                    group_id=spec.group_id,
                    parent=spec.parent,
                    settings=self._session_settings(spec.settings, t),
                )
            )
        return sessions

    def _session_settings(self, spec: _SessionSettings | None, owner: _Place) -> dict[str, Any]:
        if spec is None:
            return {}
        t = self.place(f"{owner.where} settings")
        given = {
            "historyLimit": spec.history_limit,
            "maxToolIterations": spec.max_tool_iterations,
            "think": spec.think,
        }
        checked = {k: v for k, v in given.items() if v is not msgspec.UNSET}
        layer: dict[str, Any] = dict(checked)
        try:
            check_config_range(AgentConfig.from_mapping(checked, where=t.where), where=t.where)
            for key, value in checked.items():  # as /session.set would check them
                validate_setting(key, value, layer=owner.where, shown=toml_value)
            if spec.enabled_tool_groups is not None:
                groups = tuple(spec.enabled_tool_groups)
                validate_setting("enabledToolGroups", groups, layer=owner.where, shown=toml_value)
                layer["enabledToolGroups"] = groups
        except ConfigError as exc:
            raise ScenarioError(str(exc), file=self.file) from None
        model = spec.model
        if model is not None:
            provider, sep, model_id = model.partition("/")
            if not sep or not provider or not model_id:
                raise t.error(f'model must be "provider/model", got {toml_value(model)}')
            try:
                validate_setting("llm", model, layer=owner.where, shown=toml_value)
            except ConfigError as exc:
                raise ScenarioError(str(exc), file=self.file) from None
            layer["model"] = ModelRef(provider=provider, model=model_id)
        return layer

    # --- tools and replies ----------------------------------------------------------

    def _tools(self, items: list[Any]) -> list[ToolSpec]:
        tools: list[ToolSpec] = []
        for i, item in enumerate(items, 1):
            t = self.place(f"[[tools]] #{i}")
            name = t.convert(item, _ToolHead).name
            t.where = f"tool {toml_value(name)}"
            if not name or any(c.isspace() for c in name) or any(x.name == name for x in tools):
                raise t.error("tool names must be unique, non-empty and without spaces")
            spec = t.convert(item, _Tool)
            results = tuple(self._tool_outcome(r, t, k) for k, r in enumerate(spec.results, 1))
            result, error = spec.result, spec.error
            if result is not None and error is not None:
                raise t.error("give result or error, not both")
            default = (
                ToolOutcome(result, error) if result is not None or error is not None else None
            )
            if default is None and not results:
                raise t.error("give result, error or results (one per call)")
            params = spec.parameters
            tools.append(
                ToolSpec(
                    name=name,
                    description=spec.description,
                    parameters=params
                    if params is not None
                    else {"type": "object", "properties": {}},
                    groups=tuple(spec.groups),
                    results=results,
                    default=default,
                    slow=spec.slow,
                    abortable=spec.abortable,
                )
            )
        return tools

    def _tool_outcome(self, item: str | _Outcome, tool: _Place, k: int) -> ToolOutcome:
        if isinstance(item, str):
            return ToolOutcome(result=item)
        if (item.result is None) == (item.error is None):
            raise self.place(f"{tool.where} results #{k}").error(
                "each result is text, or a table with result or error (one of them)"
            )
        return ToolOutcome(item.result, item.error)

    def _replies(self, items: list[Any], sessions: list[str]) -> dict[str, tuple[ReplySpec, ...]]:
        by_session: dict[str, list[ReplySpec]] = {s: [] for s in sessions}
        for i, item in enumerate(items, 1):
            t = self.place(f"[[replies]] #{i}")
            sid = self._session_of(t, t.convert(item, _ReplyHead).session, sessions)
            own = by_session[sid]
            n = len(own) + 1
            t.where = f"reply #{i} (call {n} of {sid})"
            spec = t.convert(item, _Reply)
            call = spec.call if spec.call is not None else n
            if call != n:
                raise t.error(
                    f"call = {call}, but this is reply {n} of session {toml_value(sid)}: "
                    "replies answer a session's calls in file order"
                )
            pieces = self._pieces(t, spec.text, spec.chunks)
            usage = self._usage(spec.usage)
            calls = tuple(self._tool_call(c, t, j, n) for j, c in enumerate(spec.tool_calls, 1))
            own.append(
                ReplySpec(
                    session=sid,
                    call=n,
                    text="".join(pieces),
                    reasoning=spec.reasoning,
                    pieces=pieces,
                    tool_calls=calls,
                    usage=usage,
                    error=spec.error,
                )
            )
        return {s: tuple(r) for s, r in by_session.items()}

    def _pieces(
        self, t: _Place, text: str | None, chunks: int | list[str] | None
    ) -> tuple[str, ...]:
        if chunks is None:
            return (text,) if text else ()
        if isinstance(chunks, list):
            if text is not None:
                raise t.error("chunks as a list is the text itself: give text or chunks, not both")
            return tuple(chunks)
        text = text or ""
        size = -(-len(text) // chunks) if text else 0
        return tuple(text[i * size : (i + 1) * size] for i in range(chunks)) if size else ()

    @staticmethod
    def _usage(spec: _Usage | None) -> Usage | None:
        if spec is None:
            return None
        return Usage(
            prompt_tokens=spec.prompt_tokens,
            completion_tokens=spec.completion_tokens,
            total_tokens=spec.total_tokens,
            cached_prompt_tokens=spec.cached_prompt_tokens,
        )

    def _tool_call(self, spec: _ToolCall, owner: _Place, j: int, n: int) -> ToolCall:
        arguments = spec.arguments
        if arguments is None:
            arguments = ""
        elif isinstance(arguments, dict):
            try:
                arguments = json.dumps(arguments, ensure_ascii=False)
            except (TypeError, ValueError) as exc:  # a date or time has no JSON form
                raise self.place(f"{owner.where} tool_calls #{j}").error(
                    f"arguments as a table must hold JSON values only: {exc}"
                ) from None
        call_id = spec.id if spec.id is not None else f"call-{n}-{j}"
        return ToolCall(id=call_id, name=spec.name, arguments=arguments)

    # --- steps ------------------------------------------------------------------------

    def _session_of(self, t: _Place, sid: str | None, sessions: list[str]) -> str:
        if sid is None:
            if len(sessions) == 1:
                return sessions[0]
            raise t.error(f"session is required with more than one session ({', '.join(sessions)})")
        if sid not in sessions:
            raise t.error(f"no session {toml_value(sid)} (declared: {', '.join(sessions)})")
        return str(sid)

    def _point(
        self,
        t: _Place,
        sid: str,
        sessions: list[str],
        tools: dict[str, ToolSpec],
        replies: Mapping[str, tuple[ReplySpec, ...]],
        value: str | None,
    ) -> Point:
        if value is None:
            return Point("now")
        shown = toml_value(value)
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
                    raise t.error(f"at {shown}: no tool {toml_value(tool)} (declared: {declared})")
                return Point("tool", n=n, tool=tool)
            point_sid = groups.get("session") or sid
            if point_sid not in sessions:
                raise t.error(f"at {shown}: no session {toml_value(point_sid)}")
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
            return f'say which {unit} it runs for: "while {hook} of {unit} N runs"'
        return (
            f"a step cannot be placed in {hook} (it can in {', '.join(HOOK_POINTS)}; "
            'for a tool\'s run, use "while TOOL runs")'
        )

    def _hook_point(
        self,
        t: _Place,
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
                f"at {shown}: no hook {toml_value(hook)} "
                f"(a step can be placed in {', '.join(HOOK_POINTS)})"
            )
        if HOOK_POINTS[hook] != unit:
            raise t.error(
                f"at {shown}: {hook} runs once per {HOOK_POINTS[hook]}: "
                f'"while {hook} of {HOOK_POINTS[hook]} N runs"'
            )
        rounds = int(groups["round"] or 1)
        if groups["round"] is not None and hook != "agent:llm:before":
            raise t.error(
                f"at {shown}: only agent:llm:before runs in rounds (again after inputs join "
                'at the insertion point); leave out "round"'
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
        t: _Place,
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
            t = self.place(f"step {i}")
            do = t.convert(item, _StepDo).do
            t.where = f"step {i} ({do})"
            head = t.convert(item, _StepHead)
            sid = self._session_of(t, head.session, sessions)
            at = self._point(t, sid, sessions, by_name, replies, head.at)
            t.where = f"step {i} ({do} at {at.describe()})"
            if at.kind == "tool" and at.tool is not None and not by_name[at.tool].slow:
                # A tool named in a point must park for the step to happen while it runs.
                by_name[at.tool] = dataclasses.replace(by_name[at.tool], slow=True)
            steps.append(self._step(t, i, t.convert(item, _STEPS[do]), sid, at))
        tools[:] = [by_name[t.name] for t in tools]  # the caller's list: slow ones updated
        return steps

    def _step(self, t: _Place, i: int, spec: _Step, sid: str, at: Point) -> StepSpec:
        base: dict[str, Any] = {
            "index": i,
            "do": spec.do,
            "session": sid,
            "at": at,
            "note": spec.note,
        }
        if isinstance(spec, _Say):
            return StepSpec(**base, input=self._input(t, spec))
        if isinstance(spec, _Stop):
            return StepSpec(**base, by=spec.by, platform=spec.platform)
        if isinstance(spec, _Clear):
            return StepSpec(**base, kinds=tuple(spec.kinds))
        if isinstance(spec, _Wait):
            return StepSpec(**base, ms=spec.ms)
        return StepSpec(**base)

    def _input(self, t: _Place, spec: _Say) -> Input:
        source = actor = None
        notice = None
        if isinstance(spec, _Inject):
            actor, source = spec.actor, spec.source
            notice = self._notice(spec.notice)
            if source == "host-notice" and notice is None:
                raise t.error("a host-notice injection needs notice = { kind = ..., id = ... }")
        trigger = spec.trigger if spec.trigger is not None else DEFAULT_TRIGGERS.get(source or "")
        return Input(
            id=spec.id,
            content=spec.text,
            sender=Sender(user_id=spec.sender, nickname=spec.nickname),
            actor=actor,
            platform=spec.platform,
            message_id=spec.message_id,
            trigger_type=trigger,
            source=source,
            addressed=spec.addressed,
            mentions=tuple(spec.mentions),
            gateway_seq=spec.gateway_seq,
            host_notice=notice,
        )

    @staticmethod
    def _notice(spec: _Notice | None) -> HostNotice | None:
        if spec is None:
            return None
        return HostNotice(
            kind=spec.kind, id=spec.id, untrusted=spec.untrusted, reply_to=spec.reply_to
        )
