"""``aalis-agent replay DB --session S --fork SEQ``: re-run a turn from a past point.

The session's log up to ``SEQ`` (the events with seq <= SEQ) is copied into a scratch log
(in memory); the original database is only read (opened read-only, never written). The
turn that was open at ``SEQ``, or else the next one opened after it, is then run again
through the real :class:`~aalis_agent.actors.runtime.Runtime`:

- the copied prefix is brought to a consistent state the way a restart does
  (``Runtime.recover``: a turn the prefix cuts midway is recorded ``aborted``, reason
  ``crash``, and the inputs no model call carried go back to the head of the queue). A turn
  that had not reached the model yet at ``SEQ`` is not cut: it is left out and re-run from
  its start;
- the turn's inputs the prefix does not hold are submitted again, as they were; those the
  cut turn had already carried to the model are submitted again with a new id (``.fork``);
- ``--set KEY=VALUE`` writes the setting into the session's own layer (as
  ``/session.set`` does) before anything runs;
- the model is the original turn's replies replayed (default), a scripted model file
  (``--script``), or a model of a configuration file (``--config`` and ``--model``);
- tool calls answered in the original log get the recorded result again (the same call:
  name and arguments); the built-in tools (``current_time``, ``calculate``) run for calls
  the log does not hold; other tools answer with an error.

Every request the forked turn sends is recorded (messages, tools, the ``agent:trim``
trace), with its reply, tool calls and ``UsageRecorded`` numbers, and printed beside the
original turn's. The original turn's requests are not in the log: they are rebuilt by
re-running that turn from its start unchanged (same settings, its own replies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import msgspec
from aalis_agent.actors.commands import parse_value
from aalis_agent.actors.hooks import Hooks, ToolAfter, ToolBefore, TurnBefore
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import (
    Batch,
    ChatMessage,
    ConfigError,
    CorruptEvent,
    EventStore,
    FixedClock,
    InMemoryEventStore,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    ModelRef,
    ReplayError,
    SequentialIds,
    SessionEvent,
    SettingsChanged,
    TokenUsage,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
    to_builtins,
)
from aalis_agent.events.open import missing_database, open_store
from aalis_agent.projections import project
from aalis_agent.request.texts import ZH
from aalis_agent.scenarios.result import message_json
from aalis_agent.services import (
    AbortSignal,
    ChatModel,
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    StaticSessions,
    StreamChunk,
    Tool,
    ToolCallContext,
    ToolRegistry,
    Usage,
)
from aalis_agent.services.builtin_tools import builtin_tools
from aalis_agent.services.config import json_value
from aalis_agent.services.models import entry_id
from aalis_agent.services.settings import SETTING_FIELDS, validate_setting
from aalis_agent.timeline import render_event, shown_name, terminal_safe

__all__ = [
    "CallFacts",
    "ForkReport",
    "TurnFacts",
    "add_fork_arguments",
    "fork_session",
    "run_fork",
    "turn_facts",
]

DEFAULT_TIMEOUT_S = 300.0
FORK_ID_SUFFIX = ".fork"
"""Appended to the id of an input submitted again when the prefix already holds it."""


# --- the command line ------------------------------------------------------------------


def add_fork_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--fork SEQ`` and its options to the ``replay`` parser (``--json`` is its own)."""
    group = parser.add_argument_group(
        "fork",
        "re-run the turn open at SEQ (or the next one opened after it) from the log's state "
        "at SEQ, into a scratch log (the database is only read), and print it beside the "
        "original: requests (messages, tools, trim), replies, tool calls, usage",
    )
    group.add_argument(
        "--fork", metavar="SEQ", type=int, help="re-run from the session's state at this seq"
    )
    group.add_argument(
        "--script",
        metavar="FILE",
        help="with --fork: a scripted model's replies (TOML or JSON) instead of the original ones",
    )
    group.add_argument(
        "--config", metavar="FILE", help="with --fork: configuration file (TOML) giving models"
    )
    group.add_argument(
        "--model",
        metavar="ID",
        help="with --fork and --config: the model to use (<provider>/<model> or its id)",
    )
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="set_values",
        help="with --fork: set a session setting first, as /session.set does (repeatable)",
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        help=f"with --fork: how long the re-run may take (default: {DEFAULT_TIMEOUT_S:g})",
    )


_MAX_TIMEOUT_S = 86_400.0  # a day: far past any re-run; a deadline the clock can hold


def fork_flags_given(args: argparse.Namespace) -> list[str]:
    """The ``--fork`` options given on the command line (they mean nothing without it)."""
    given = {
        "--script": args.script is not None,
        "--config": args.config is not None,
        "--model": args.model is not None,
        "--set": bool(args.set_values),
        "--timeout": args.timeout is not None,
    }
    return [flag for flag, there in given.items() if there]


def run_fork(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``replay DB --session S --fork SEQ ...``: print the fork report; 0 when it ran.

    Problems (no such database or session, SEQ outside the log, a bad ``--set``, a script
    or configuration file that does not load) raise :class:`ReplayError` or
    :class:`ConfigError`, which the command prints as one error line."""
    out = sys.stdout if out is None else out
    if getattr(args, "at", None) is not None:
        raise ReplayError("--at and --fork do not go together")
    if args.fork is None:
        raise ReplayError("--fork SEQ is required here")
    if args.model and args.script:
        raise ConfigError("--model and --script do not go together")
    if args.script and args.config:
        raise ConfigError(
            "--script and --config do not go together: the fork's model answers from "
            "the script, or is a model of the configuration file"
        )
    if args.model and not args.config:
        raise ConfigError("--model names a model of a configuration file: add --config FILE")
    if args.timeout is None:
        args.timeout = DEFAULT_TIMEOUT_S
    if not 0 < args.timeout <= _MAX_TIMEOUT_S:  # NaN fails too
        raise ReplayError(
            f"--timeout must be more than 0 and at most {_MAX_TIMEOUT_S:g} seconds, "
            f"got {args.timeout}"
        )
    sets = parse_sets(args.set_values or [])
    model_choice = _model_choice(args)
    missing = missing_database(args.db)
    if missing is not None:
        raise ReplayError(missing)
    store = open_store(args.db, read_only=True)  # the original is only read
    try:
        session_id = _session(store, args.session, args.db)
        events = _read(store, session_id)
    finally:
        store.close()
    report = fork_session(
        events,
        session_id,
        args.fork,
        sets=sets,
        model=model_choice,
        timeout_s=args.timeout,
        db=args.db,
    )
    if args.json:
        out.write(json.dumps(report.to_json(), ensure_ascii=False, indent=2) + "\n")
    else:
        out.write(report.render())
    return 0


def parse_sets(values: Sequence[str]) -> list[tuple[str, Any]]:
    """``KEY=VALUE`` pairs as ``/session.set KEY VALUE`` reads them, each validated to
    what the log holds; a bad one raises ConfigError naming it."""
    sets: list[tuple[str, Any]] = []
    for raw in values:
        key, eq, value = raw.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--set {raw!r}: expected KEY=VALUE")
        if key not in SETTING_FIELDS:
            known = ", ".join(SETTING_FIELDS)
            raise ConfigError(
                f"--set {raw!r}: unknown session setting {json_value(key)}; known: {known}"
            )
        try:
            stored = validate_setting(key, parse_value(key, value), shown=json_value)
        except ConfigError as exc:
            raise ConfigError(f"--set {raw!r}: {exc}") from None
        sets.append((key, stored))
    return sets


@dataclass(frozen=True)
class ModelChoice:
    """Which model the fork runs: the original replies, a script file, or a config model."""

    kind: Literal["replay", "script", "config"] = "replay"
    script: str | None = None
    config: str | None = None
    model: str | None = None


def _model_choice(args: argparse.Namespace) -> ModelChoice:
    """Checked before anything runs: a script or configuration that does not load is an
    error now, not after the prefix was copied."""
    if args.script:
        ScriptedModel.from_file(args.script)  # raises ConfigError naming the file
        return ModelChoice("script", script=args.script)
    if args.config:
        _config_model(args.config, args.model)
        return ModelChoice("config", config=args.config, model=args.model)
    return ModelChoice()


def _config_model(path: str, wanted: str | None) -> tuple[ChatModel, Any]:
    from aalis_agent.services.config_file import load_config

    fc = load_config(path)
    models = fc.llm.models()
    if wanted is None:
        return fc.llm.preferred(), fc
    found = [m for m in models if entry_id(m) == wanted] or [m for m in models if m.id == wanted]
    if len(found) != 1:
        known = ", ".join(entry_id(m) for m in models) or "none"
        why = "is ambiguous" if found else "is not there"
        raise ConfigError(f"--model {wanted!r} {why} in {path} (models: {known})")
    return found[0], fc


def _session(store: EventStore, session: str | None, db: str) -> str:
    sessions = store.sessions()
    if session is None:
        if len(sessions) == 1:
            return sessions[0]
        known = ", ".join(map(shown_name, sessions[:10])) or "none"
        raise ReplayError(f"--fork needs --session ID ({db!r} holds: {known})")
    if session not in sessions:
        known = ", ".join(map(shown_name, sessions[:10])) or "none"
        raise ReplayError(f"no session {session!r} in {db!r} (sessions: {known})")
    return session


def _read(store: EventStore, session_id: str) -> list[SessionEvent]:
    try:
        return store.read(session_id)
    except CorruptEvent as exc:
        raise ReplayError(
            f"cannot fork {session_id!r}: seq {exc.seq} does not decode ({exc.reason})"
        ) from None


# --- what a turn did, read from a log --------------------------------------------------


@dataclass
class CallFacts:
    """One model call: what the log says it returned, and (when recorded) what it sent."""

    turn_id: str
    index: int
    model: str | None
    status: str | None = None
    error: str | None = None
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    usage: TokenUsage | None = None
    request: ChatRequest | None = None
    provider_usage: Usage | None = None
    trim: dict[str, Any] | None = None

    def reply(self) -> ScriptedReply:
        """This call's answer, for a scripted model to give again."""
        return ScriptedReply(
            text=self.text, reasoning=self.reasoning, tool_calls=tuple(self.tool_calls)
        )

    def to_json(self) -> dict[str, Any]:
        request = None
        if self.request is not None:
            r = self.request
            request = {
                "model": r.model,
                "think": r.think,
                "messages": [message_json(m) for m in r.messages],
                "tools": [dict(t) for t in r.tools],
            }
        return {
            "turn_id": self.turn_id,
            "call": self.index,
            "model": self.model,
            "status": self.status,
            "error": self.error,
            "request": request,
            "trim": self.trim,
            "reply": {
                "text": self.text,
                "reasoning": self.reasoning,
                "tool_calls": [msgspec.to_builtins(c) for c in self.tool_calls],
            },
            "tool_results": self.tool_results,
            "usage": None if self.usage is None else msgspec.to_builtins(self.usage),
            "provider_usage": (
                None if self.provider_usage is None else msgspec.to_builtins(self.provider_usage)
            ),
        }


@dataclass
class TurnFacts:
    """One turn as the log tells it: its opening, inputs, calls and record."""

    turn_id: str
    opened: TurnOpened | None = None
    inputs: list[tuple[Input, str]] = field(default_factory=list)
    calls: list[CallFacts] = field(default_factory=list)
    outcome: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        opened = self.opened
        return {
            "turn_id": self.turn_id,
            "opened_seq": None if opened is None else opened.seq,
            "settings": None if opened is None else msgspec.to_builtins(opened.settings),
            "inputs": [
                {"input_id": i.id, "entry": entry, "content": i.content} for i, entry in self.inputs
            ],
            "outcome": self.outcome,
            "reason": self.reason,
            "calls": [c.to_json() for c in self.calls],
        }


def turn_facts(events: Sequence[SessionEvent], turn_id: str) -> TurnFacts:
    """The turn's calls with their replies, tool calls and results, and usage, from its
    events: everything between a call's start and the next one belongs to that call."""
    facts = TurnFacts(turn_id)
    received: dict[str, Input] = {}
    current: CallFacts | None = None
    for e in events:
        match e:
            case InputReceived():
                received[e.input.id] = e.input
            case TurnOpened() if e.turn_id == turn_id:
                facts.opened = e
            case InputJoined() if e.turn_id == turn_id:
                inp = received.get(e.input_id)
                if inp is not None:
                    facts.inputs.append((inp, e.entry))
            case ModelCallStarted() if e.turn_id == turn_id:
                current = CallFacts(turn_id, e.index, e.model)
                facts.calls.append(current)
            case ModelCallEnded() if e.turn_id == turn_id:
                for call in facts.calls:
                    if call.index == e.index:
                        call.status, call.error = e.status, e.error
            case MessageSaved(message=m) if (
                current is not None and m.role == "assistant" and m.meta.turn_id == turn_id
            ):
                current.text = f"{current.text}\n{m.content}" if current.text else m.content
                current.reasoning = m.reasoning or current.reasoning
                current.tool_calls.extend(m.tool_calls)
            case ToolStarted() if current is not None and e.turn_id == turn_id:
                current.tool_results.append(
                    {"call_id": e.call_id, "name": e.name, "result": None, "error": None}
                )
            case ToolFinished() if current is not None and e.turn_id == turn_id:
                for row in current.tool_results:
                    if row["call_id"] == e.call_id:
                        row["result"], row["error"] = e.result, e.error
            case UsageRecorded(usage=u) if current is not None and u.turn_id == turn_id:
                current.usage = u
            case TurnRecorded() if e.turn_id == turn_id:
                facts.outcome, facts.reason = e.outcome, e.reason
            case _:
                pass
    return facts


# --- the prefix ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The turn a fork re-runs, and its inputs in the order they entered it."""

    opened: TurnOpened
    open_at_seq: bool  # open at SEQ (True) or opened after it
    inputs: tuple[Input, ...]

    @property
    def turn_id(self) -> str:
        return self.opened.turn_id


def find_target(events: Sequence[SessionEvent], seq: int) -> Target:
    """The turn open at ``seq``, else the first turn opened after it."""
    recorded = {e.turn_id: e.seq for e in events if isinstance(e, TurnRecorded)}
    opened = [e for e in events if isinstance(e, TurnOpened)]
    open_at = [o for o in opened if o.seq <= seq and recorded.get(o.turn_id, seq + 1) > seq]
    later = [o for o in opened if o.seq > seq]
    if open_at:
        chosen, at = open_at[-1], True
    elif later:
        chosen, at = later[0], False
    else:
        raise ReplayError(
            f"no turn is open at seq {seq} or opens after it in {events[0].session_id!r}: "
            "nothing to re-run"
        )
    received = {e.input.id: e.input for e in events if isinstance(e, InputReceived)}
    joined = [
        received[e.input_id]
        for e in events
        if isinstance(e, InputJoined) and e.turn_id == chosen.turn_id and e.input_id in received
    ]
    return Target(chosen, at, tuple(joined))


@dataclass
class Prefix:
    """The copied events (renumbered when some were left out) and what to submit again."""

    events: list[SessionEvent]
    left_out: int
    restarted: bool  # the target was open but had not reached the model: re-run from start
    resubmit: list[Input]


def cut_prefix(events: Sequence[SessionEvent], seq: int, target: Target) -> Prefix:
    """The log's state at ``seq`` as a log a runtime can resume from.

    Batches are atomic, so a seq inside one leaves a state no live log ever had; two
    cases are mended here, the rest is what recovery mends: the target turn open but not
    yet carried to the model (left out whole: it re-runs from its start), and the target's
    inputs received without where they went (left out: they are submitted again)."""
    kept = [e for e in events if e.seq <= seq]
    tid = target.turn_id
    restarted = False
    running = project(kept).queue.running
    if running is not None and running.turn_id == tid and not running.carried:
        restarted = True
        kept = [e for e in kept if not _of_turn(e, tid)]
    placed = {
        e.input_id
        for e in kept
        if isinstance(e, InputQueued | InputHeld | InputJoined | InputReleased)
    }
    mine = {i.id for i in target.inputs}
    kept = [
        e
        for e in kept
        if not (isinstance(e, InputReceived) and e.input.id in mine and e.input.id not in placed)
    ]
    left_out = sum(1 for e in events if e.seq <= seq) - len(kept)
    if left_out:
        kept = [msgspec.structs.replace(e, seq=n) for n, e in enumerate(kept, 1)]
    received = {e.input.id for e in kept if isinstance(e, InputReceived)}
    running = project(kept).queue.running
    carried = running.carried if running is not None and running.turn_id == tid else frozenset()
    resubmit = []
    for inp in target.inputs:
        if inp.id not in received:
            resubmit.append(inp)
        elif inp.id in carried:  # it reached the model in the cut turn: asked once more
            resubmit.append(msgspec.structs.replace(inp, id=inp.id + FORK_ID_SUFFIX))
    return Prefix(kept, left_out, restarted, resubmit)


def _of_turn(event: SessionEvent, turn_id: str) -> bool:
    if isinstance(event, MessageSaved):
        return event.message.meta.turn_id == turn_id
    return getattr(event, "turn_id", None) == turn_id


# --- the re-run ------------------------------------------------------------------------


class _Recorder:
    """A chat model that records each request (by the call it belongs to) and delegates."""

    def __init__(self, inner: ChatModel, locate: Callable[[], tuple[str, int]]) -> None:
        self.inner = inner
        self.id = inner.id
        self.provider_id = inner.provider_id
        self.context_length = inner.context_length
        self.max_output_tokens = inner.max_output_tokens
        self.name = getattr(inner, "name", None) or inner.id
        self.think_levels = tuple(getattr(inner, "think_levels", ()) or ())
        self.default_think = getattr(inner, "default_think", None)
        self._locate = locate
        self._lock = threading.Lock()
        self.calls: dict[tuple[str, int], tuple[ChatRequest, list[Usage]]] = {}

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        usage: list[Usage] = []
        with self._lock:
            self.calls[self._locate()] = (request, usage)
        for chunk in self.inner.chat_stream(request, abort):
            if chunk.usage is not None:
                usage.append(chunk.usage)
            yield chunk


class _ForkSettings:
    """The settings the original turn read when it opened, under the session's own layer
    (its earlier keys and the fork's ``--set``), with the fork's model unless ``llm`` is set."""

    def __init__(self, base: TurnSettings, model: ModelRef | None, llm_set: bool) -> None:
        self.base = base
        self.model = model
        self.llm_set = llm_set

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        s = self.base
        changes: dict[str, Any] = {}
        layer = session_layer
        if layer.get("llm"):
            changes["model"] = ModelRef(
                provider=layer["llm"]["provider"], model=layer["llm"]["model"]
            )
        if "think" in layer:
            changes["think"] = layer["think"]
        if "maxToolIterations" in layer:
            changes["max_tool_iterations"] = layer["maxToolIterations"]
        if "historyLimit" in layer:
            changes["history_limit"] = layer["historyLimit"]
        if "enabledToolGroups" in layer:
            groups = layer["enabledToolGroups"]
            changes["tool_groups"] = tuple(groups) if groups is not None else None
        if "persona" in layer:
            changes["persona"] = layer["persona"]
        settings = msgspec.structs.replace(s, **changes) if changes else s
        if self.model is not None and not self.llm_set and settings.model not in (None, self.model):
            settings = msgspec.structs.replace(settings, model=self.model)
        return settings


@dataclass(frozen=True)
class _Recorded:
    call_id: str
    name: str
    arguments: Any
    result: str | None
    error: str | None
    metadata: dict[str, Any]


def _canonical(arguments: str | Mapping[str, Any]) -> Any:
    if not isinstance(arguments, str):
        return json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str)
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return arguments


def _recorded_tools(events: Sequence[SessionEvent]) -> list[_Recorded]:
    started = {(e.turn_id, e.call_id): e for e in events if isinstance(e, ToolStarted)}
    out = []
    for e in events:
        if isinstance(e, ToolFinished):
            s = started.get((e.turn_id, e.call_id))
            args = _canonical(s.arguments) if s is not None else None
            out.append(_Recorded(e.call_id, e.name, args, e.result, e.error, dict(e.metadata)))
    return out


def _tools(recorded: list[_Recorded], clock_ms: Callable[[], int], hooks: Hooks) -> ToolRegistry:
    """The built-in tools, and every tool the log shows called; a call the log answered
    gets the recorded answer (through ``agent:tool:after``), exactly as it was."""
    registry = ToolRegistry(builtin_tools(clock_ms))

    def unknown(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        raise ConfigError("the original log holds no result for this call")

    for name in sorted({r.name for r in recorded}):
        if registry.get(name) is None:
            registry.register(Tool(name, unknown, description=f"{name} (answers from the log)"))
    args_of: dict[str, Any] = {}

    def before(ctx: ToolBefore, proceed: Callable[[], Any]) -> Any:
        args_of[ctx.tool_call_context.call_id] = _canonical(ctx.args)
        return proceed()

    def after(ctx: ToolAfter, proceed: Callable[[], Any]) -> Any:
        call_id = ctx.tool_call_context.call_id
        args = args_of.get(call_id)
        same = [r for r in recorded if r.name == ctx.name and r.arguments == args]
        exact = [r for r in same if r.call_id == call_id]
        if args is not None and (exact or same):
            found = (exact or same)[-1]
            ctx.result, ctx.error, ctx.metadata = found.result, found.error, dict(found.metadata)
        return proceed()

    hooks.use("agent:tool:before", before)
    hooks.use("agent:tool:after", after)
    return registry


@dataclass
class RunResult:
    """One re-run: the prefix, what went where, the log it wrote and the calls it made."""

    prefix: Prefix
    settings_events: int
    submitted: list[tuple[Input, str]]
    events: list[SessionEvent]
    turns: list[TurnFacts]
    recovered: list[str]

    def main_turn(self, target: Target) -> TurnFacts | None:
        """The turn that re-ran the target's inputs (else the first turn that ran)."""
        mine = {i.id for i in target.inputs}
        for turn in self.turns:
            if any(i.id.removesuffix(FORK_ID_SUFFIX) in mine for i, _ in turn.inputs):
                return turn
        return self.turns[0] if self.turns else None

    @property
    def new_events(self) -> list[SessionEvent]:
        return self.events[len(self.prefix.events) :]


def rerun(
    session_id: str,
    prefix: Prefix,
    target: Target,
    model: ChatModel,
    *,
    replayer: _Replayer | None = None,
    sets: Sequence[tuple[str, Any]] = (),
    recorded: list[_Recorded],
    services: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RunResult:
    """Copy the prefix into a scratch log, apply ``sets``, recover, submit the inputs
    again and run to idle through the real runtime; every request is recorded."""
    store = InMemoryEventStore()
    if prefix.events:
        store.append(session_id, prefix.events, 0)
    clock = FixedClock(target.opened.at, step_ms=0)
    if sets:
        batch = Batch(session_id, store.last_seq(session_id), clock=clock)
        for key, value in sets:
            batch.add(SettingsChanged(key=key, value=value, by="fork"))
        store.append(session_id, batch.events, batch.expected_seq)
    settings_events = len(sets)

    def locate() -> tuple[str, int]:
        last = store.last_seq(session_id)
        for e in reversed(store.read(session_id, max(last - 64, 0))):
            if isinstance(e, ModelCallStarted):
                return e.turn_id, e.index
        for e in reversed(store.read(session_id)):
            if isinstance(e, ModelCallStarted):
                return e.turn_id, e.index
        return "?", 0

    recorder = _Recorder(model, locate)
    if replayer is not None:

        def where() -> tuple[tuple[str, ...], int]:
            turn_id, index = locate()
            opened = [
                e
                for e in store.read(session_id, len(prefix.events))
                if isinstance(e, TurnOpened) and e.turn_id == turn_id
            ]
            return (opened[-1].input_ids if opened else ()), index

        replayer.where = where
    hooks = Hooks()
    gate = threading.Event()

    def hold(ctx: TurnBefore, proceed: Callable[[], Any]) -> Any:
        gate.wait(timeout_s)  # every input is in before a turn goes on: a fixed order
        return proceed()

    hooks.use("agent:turn:before", hold)
    opened = target.opened
    given = dict(services or {})
    given.update(
        llm=recorder,
        tools=_tools(recorded, clock.now_ms, hooks),
        sessions=StaticSessions(
            {
                session_id: SessionInfo(
                    session_id,
                    origin_platform=opened.platform,
                    multi_party=opened.settings.multi_party,
                )
            }
        ),
        settings=_ForkSettings(
            opened.settings,
            ModelRef(provider=recorder.provider_id, model=recorder.id),
            llm_set=any(k == "llm" for k, _ in sets),
        ),
    )
    trims: dict[tuple[str, int], dict[str, Any]] = {}

    def on_trim(topic: str, payload: Any) -> None:
        trims[(payload["turnId"], payload["call"])] = {
            "budget": payload["budget"],
            "steps": payload["steps"],
            "trace": payload["trace"],
        }

    runtime = Runtime(
        store,
        Services(**given),
        clock=clock,
        ids=_ForkIds(),
        hooks=hooks,
        janitor=False,
        ask_timeout_s=min(timeout_s, 60.0),
    )
    runtime.subscribe("agent:trim", on_trim)
    submitted: list[tuple[Input, str]] = []
    handles: list[SubmitHandle] = []
    try:
        try:
            recovered = runtime.recover()
            for inp in prefix.resubmit:
                handle = runtime.submit(session_id, inp)
                handles.append(handle)
                submitted.append((inp, handle.where))
        finally:
            gate.set()
        for handle in handles:
            handle.result(timeout_s)
        if not runtime.wait_idle(timeout_s):
            raise ReplayError(f"the re-run did not finish within {timeout_s:g}s")
    except TimeoutError:
        raise ReplayError(f"the re-run did not finish within {timeout_s:g}s") from None
    finally:
        runtime.shutdown(timeout=timeout_s)
    events = store.read(session_id)
    new = events[len(prefix.events) :]
    turn_ids = [e.turn_id for e in new if isinstance(e, TurnOpened)]
    turns = [turn_facts(events, tid) for tid in turn_ids]
    for t in turns:
        for c in t.calls:
            sent = recorder.calls.get((c.turn_id, c.index))
            if sent is not None:
                c.request = sent[0]
                c.provider_usage = sent[1][-1] if sent[1] else None
            c.trim = trims.get((c.turn_id, c.index))
    return RunResult(prefix, settings_events, submitted, events, turns, recovered)


class _ForkIds:
    """``fork-turn-1``, ``fork-msg-1``...: deterministic, and never an id of the prefix."""

    def __init__(self) -> None:
        self._ids = SequentialIds()

    def new(self, prefix: str) -> str:
        return f"fork-{self._ids.new(prefix)}"


class _Replayer:
    """The original replies, per turn: a call of a forked turn gets the reply the same
    call (by index) of the original turn its first input came from; past those, or for a
    turn with no original, the reply of the re-run turn's original call, else "好的。"."""

    def __init__(self, events: Sequence[SessionEvent], target: TurnFacts) -> None:
        self._events = events
        self._target = target
        self._turn_of: dict[str, str] = {
            e.input_id: e.turn_id for e in events if isinstance(e, InputJoined)
        }
        self._replies: dict[str, list[ScriptedReply]] = {
            target.turn_id: [c.reply() for c in target.calls]
        }
        self.where: Callable[[], tuple[tuple[str, ...], int]] = lambda: ((), 0)

    def _of(self, turn_id: str) -> list[ScriptedReply]:
        replies = self._replies.get(turn_id)
        if replies is None:
            replies = [c.reply() for c in turn_facts(self._events, turn_id).calls]
            self._replies[turn_id] = replies
        return replies

    def __call__(self, request: ChatRequest, n: int) -> ScriptedReply:
        inputs, index = self.where()
        original = self._target.turn_id
        for input_id in inputs:
            found = self._turn_of.get(input_id.removesuffix(FORK_ID_SUFFIX))
            if found is not None:
                original = found
                break
        for turn_id in (original, self._target.turn_id):
            replies = self._of(turn_id)
            if 1 <= index <= len(replies):
                return replies[index - 1]
        return ScriptedReply(text="好的。")


def _model_identity(original: TurnFacts) -> dict[str, Any]:
    """The original model's ids and limits (its ``UsageRecorded`` numbers), so a scripted
    stand-in is resolved and budgeted as the original was."""
    first = original.calls[0] if original.calls else None
    provider, model_id = "demo", "scripted"
    if first is not None and first.model and "/" in first.model:
        provider, model_id = first.model.split("/", 1)
    elif original.opened is not None and original.opened.settings.model is not None:
        ref = original.opened.settings.model
        provider, model_id = ref.provider, ref.model
    usage = next((c.usage for c in original.calls if c.usage is not None), None)
    given: dict[str, Any] = {"model_id": model_id, "provider_id": provider}
    if usage is not None and usage.context_window > 0:
        given["context_length"] = usage.context_window
    if usage is not None and usage.max_tokens > 0:
        given["max_output_tokens"] = usage.max_tokens
    return given


# --- the fork --------------------------------------------------------------------------


@dataclass
class ForkReport:
    """The original turn and its fork, side by side."""

    session_id: str
    seq: int
    db: str | None
    target: Target
    sets: list[tuple[str, Any]]
    model: str
    original: TurnFacts
    baseline: RunResult
    fork: RunResult

    @property
    def fork_turn(self) -> TurnFacts | None:
        return self.fork.main_turn(self.target)

    def original_calls(self) -> list[CallFacts]:
        """The original calls, each with the request the unchanged re-run sent for it."""
        main = self.baseline.main_turn(self.target)
        rebuilt = main.calls if main is not None else []
        calls = []
        for n, call in enumerate(self.original.calls):
            c = dataclasses.replace(call, tool_calls=list(call.tool_calls))
            if n < len(rebuilt):
                c.request, c.trim = rebuilt[n].request, rebuilt[n].trim
            calls.append(c)
        return calls

    def to_json(self) -> dict[str, Any]:
        fork = self.fork
        return {
            "session_id": self.session_id,
            "db": self.db,
            "seq": self.seq,
            "turn_id": self.target.turn_id,
            "turn_open_at_seq": self.target.open_at_seq,
            "prefix": {
                "events": len(fork.prefix.events),
                "left_out": fork.prefix.left_out,
                "restarted": fork.prefix.restarted,
            },
            "settings": {k: v for k, v in self.sets},
            "model": self.model,
            "original": {
                **self.original.to_json(),
                "calls": [c.to_json() for c in self.original_calls()],
                "requests_rebuilt": True,
            },
            "fork": {
                "recovered": fork.recovered,
                "resubmitted": [
                    {"input_id": i.id, "where": where, "content": i.content}
                    for i, where in fork.submitted
                ],
                "turn_id": None if self.fork_turn is None else self.fork_turn.turn_id,
                "turns": [t.to_json() for t in fork.turns],
                "log": [to_builtins(e) for e in fork.new_events],
            },
        }

    def render(self) -> str:
        """The report as text, terminal-safe line by line (values from the log may hold
        newlines and escape sequences)."""
        return "\n".join(terminal_safe(line) for line in _render(self).split("\n"))


def fork_session(
    events: Sequence[SessionEvent],
    session_id: str,
    seq: int,
    *,
    sets: Sequence[tuple[str, Any]] = (),
    model: ModelChoice | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    db: str | None = None,
) -> ForkReport:
    """Fork ``session_id``'s log (``events``, read from the original) at ``seq``."""
    if not events:
        raise ReplayError(f"session {session_id!r} has no events")
    last = events[-1].seq
    if not 1 <= seq <= last:
        raise ReplayError(f"--fork {seq}: the log of {session_id!r} has seq 1 to {last}")
    model = model or ModelChoice()
    target = find_target(events, seq)
    original = turn_facts(events, target.turn_id)
    recorded = _recorded_tools(events)
    services: dict[str, Any] = {}
    identity = _model_identity(original)
    replayer: _Replayer | None = None
    if model.kind == "script":
        assert model.script is not None
        chosen: ChatModel = ScriptedModel.from_file(model.script, **identity)
        described = f"{entry_id(chosen)} scripted from {model.script}"
    elif model.kind == "config":
        assert model.config is not None
        chosen, fc = _config_model(model.config, model.model)
        services = {"config": fc.config, "persona": fc.personas}
        described = f"{entry_id(chosen)} from {model.config}"
    else:
        replayer = _Replayer(events, original)
        chosen = ScriptedModel(replayer, **identity)
        described = f"{entry_id(chosen)} replaying the original replies"
    # The original's requests, rebuilt: the same turn re-run from its start, unchanged.
    start = cut_prefix(events, target.opened.seq - 1, target)
    base_replayer = _Replayer(events, original)
    baseline = rerun(
        session_id,
        start,
        target,
        ScriptedModel(base_replayer, **identity),
        replayer=base_replayer,
        recorded=recorded,
        services=services,
        timeout_s=timeout_s,
    )
    prefix = cut_prefix(events, seq, target)
    fork = rerun(
        session_id,
        prefix,
        target,
        chosen,
        replayer=replayer,
        sets=sets,
        recorded=recorded,
        services=services,
        timeout_s=timeout_s,
    )
    return ForkReport(session_id, seq, db, target, list(sets), described, original, baseline, fork)


# --- the text report -------------------------------------------------------------------


def _preview(text: str | None, width: int = 80) -> str:
    if not text:
        return '""'
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def _settings_text(s: TurnSettings | None) -> str:
    if s is None:
        return "-"
    bits = [f"historyLimit={s.history_limit}"]
    if s.max_tool_iterations is not None:
        bits.append(f"maxToolIterations={s.max_tool_iterations}")
    if s.model is not None:
        bits.append(f"llm={s.model}")
    if s.think is not None:
        bits.append(f"think={s.think}")
    if s.tool_groups is not None:
        bits.append(f"enabledToolGroups={','.join(s.tool_groups) or '-'}")
    if s.persona is not None:
        bits.append(f"persona={_preview(s.persona)}")  # a persona may be megabytes
    return " ".join(bits)


def _message_line(m: ChatMessage) -> str:
    if m.tool_calls:
        calls = ", ".join(f"{c.name}#{c.id}({_preview(c.arguments, 40)})" for c in m.tool_calls)
        return f"{m.role}: calls {calls}"
    who = f"{m.role}[{m.tool_call_id}]" if m.tool_call_id else m.role
    kind = f" ({m.kind})" if m.kind else ""
    return f"{who}{kind}: {_preview(m.content)}"


def _call_lines(call: CallFacts | None, label: str, last: int = 3) -> list[str]:
    if call is None:
        return [f"  {label:<9} (no such call)"]
    status = call.status or "no end recorded"
    err = f" error={_preview(call.error, 60)}" if call.error else ""
    lines = [f"  {label:<9} {call.turn_id} call {call.index} ({call.model or '-'}): {status}{err}"]
    r = call.request
    if r is None:
        lines.append("    request: not recorded")
    else:
        roles: dict[str, int] = {}
        for m in r.messages:
            roles[m.role] = roles.get(m.role, 0) + 1
        counts = ", ".join(f"{k} {v}" for k, v in roles.items())
        names = [str(t.get("function", {}).get("name")) for t in r.tools]
        lines.append(
            f"    request: {len(r.messages)} messages ({counts}); "
            f"{len(names)} tools [{', '.join(names)}]"
        )
        shown = r.messages[-last:]
        if len(r.messages) > len(shown):
            lines.append(f"      … {len(r.messages) - len(shown)} earlier")
        lines.extend(f"      {_message_line(m)}" for m in shown)
    if call.trim is None:
        lines.append("    trim: none")
    else:
        t = call.trim
        lines.append(
            f"    trim: budget {t['budget']}, steps {', '.join(map(str, t['steps'])) or '-'}"
        )
        for a in t["trace"]:
            ids = ", ".join(a["ids"])
            lines.append(f"      {a['step']} {a['action']} [{ids}] saved {a['saved']}")
    if call.tool_calls:
        calls = ", ".join(f"{c.name}#{c.id}({_preview(c.arguments, 40)})" for c in call.tool_calls)
        lines.append(f"    reply: tool calls {calls}")
        if call.text:
            lines.append(f"      with text {_preview(call.text)}")
    else:
        lines.append(f"    reply: {_preview(call.text)}")
    for row in call.tool_results:
        if row["error"] is not None:
            lines.append(
                f"    tool {row['name']}#{row['call_id']} failed {_preview(row['error'], 60)}"
            )
        else:
            lines.append(f"    tool {row['name']}#{row['call_id']} → {_preview(row['result'], 60)}")
    u = call.usage
    if u is None:
        lines.append("    usage: not recorded")
    else:
        lines.append(
            f"    usage: used {u.used}/{u.token_budget} ({u.usage_ratio:.1%}), "
            f"trimmed {'yes' if u.trimmed else 'no'}, history {u.history_messages} message(s), "
            f"untrimmed history {u.untrimmed_history} tokens"
        )
    p = call.provider_usage
    if p is not None:
        lines.append(
            f"    provider usage: prompt {p.prompt_tokens}, completion {p.completion_tokens}, "
            f"total {p.total_tokens}"
        )
    return lines


def _render(report: ForkReport) -> str:
    t, fork = report.target, report.fork
    where = (
        f"open at seq {report.seq}"
        if t.open_at_seq
        else f"opened at seq {t.opened.seq}, after seq {report.seq}"
    )
    lines = [
        f"Fork of session {shown_name(report.session_id)} at seq {report.seq}"
        + (f" ({report.db}, read only)" if report.db else ""),
        f"  turn re-run: {t.turn_id} ({where})",
    ]
    p = fork.prefix
    note = ""
    if p.left_out:
        note = f"; {p.left_out} event(s) of a batch cut midway left out"
    if p.restarted:
        note += f"; {t.turn_id} had not reached the model yet: re-run from its start"
    lines.append(f"  prefix: {len(p.events)} event(s) copied into a scratch log{note}")
    sets = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in report.sets)
    lines.append(f"  settings changed: {sets or 'none'}")
    lines.append(f"  model: {report.model}")
    for e in fork.new_events:
        if (isinstance(e, TurnRecorded) and e.reason == "crash") or isinstance(e, InputRequeued):
            lines.append(f"  recovery: {render_event(e)}")
    if fork.submitted:
        subs = ", ".join(
            f"{i.id} {_preview(i.content, 30)} → {ZH.where(where)}" for i, where in fork.submitted
        )
        lines.append(f"  submitted again: {subs}")
    o = report.original
    lines.append("")
    lines.append(
        f"original {o.turn_id}: {o.outcome or 'no record'}"
        + (f" ({o.reason})" if o.reason else "")
        + f"; {_settings_text(o.opened.settings if o.opened else None)}; inputs "
        + ", ".join(f"{i.id} {_preview(i.content, 30)}" for i, _ in o.inputs)
    )
    for ft in fork.turns:
        lines.append(
            f"fork     {ft.turn_id}: {ft.outcome or 'no record'}"
            + (f" ({ft.reason})" if ft.reason else "")
            + f"; {_settings_text(ft.opened.settings if ft.opened else None)}; inputs "
            + ", ".join(f"{i.id} {_preview(i.content, 30)}" for i, _ in ft.inputs)
        )
    if not fork.turns:
        lines.append("fork     ran no turn")
    lines.append("(the original's requests are rebuilt by re-running it from its start unchanged)")
    main = report.fork_turn
    originals, forked = report.original_calls(), main.calls if main is not None else []
    for n in range(max(len(originals), len(forked))):
        lines.append("")
        lines.append(f"call {n + 1}")
        lines.extend(_call_lines(originals[n] if n < len(originals) else None, "original"))
        lines.extend(_call_lines(forked[n] if n < len(forked) else None, "fork"))
    for other in fork.turns:
        if other is main:
            continue
        lines.append("")
        lines.append(f"the fork also ran {other.turn_id} ({other.outcome or 'no record'}):")
        for call in other.calls:
            lines.extend(_call_lines(call, "fork"))
    lines.append("")
    lines.append(f"fork log after the prefix ({len(fork.new_events)} events):")
    for e in fork.new_events:
        lines.append(f"  #{e.seq:<5} {render_event(e)}")
    return "\n".join(lines) + "\n"
