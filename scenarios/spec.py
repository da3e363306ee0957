"""What a loaded scenario is: its sessions, tools, scripted replies and timeline steps
(:class:`Scenario` and its parts), and the runner's errors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any, Literal

import msgspec
from aalis_agent.events import Input, ToolCall
from aalis_agent.services import AgentConfig, StreamChunk, Usage
from aalis_agent.services.llm import ToolCallProgress

StepKind = Literal[
    "say", "inject", "stop", "stop_command", "stop_all", "mute", "delete", "clear", "wait"
]


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

    @property
    def text_chunks(self) -> tuple[str, ...]:
        """The text pieces as streamed (empty ones are not): what ``after chunk K of call
        N`` counts."""
        return tuple(piece for piece in self.pieces if piece)

    def chunks(self) -> Iterator[StreamChunk]:
        """The stream: reasoning, text pieces, tool-call progress, then the end chunk."""
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.reasoning:
            yield StreamChunk(reasoning_delta=self.reasoning)
        for piece in self.text_chunks:
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


PointKind = Literal["now", "start", "before-call", "tool", "after-turn", "hook", "chunk"]

HOOK_POINTS: dict[str, Literal["call", "turn"]] = {
    "agent:turn:before": "turn",
    "agent:llm:before": "call",
    "agent:llm:after": "call",
    "agent:reply:before": "call",
    "agent:turn:after": "turn",
}
"""The hooks a step can be placed in, and what counts their runs: a model call of the
session (``while agent:llm:after of call 2 runs``) or a turn of it (``of turn 2``)."""


@dataclass(frozen=True)
class Point:
    """Where on the timeline a step happens.

    ``n`` counts the point's unit (a call, a turn, a tool's call); a ``hook`` point names
    the hook and, for ``agent:llm:before``, the ``round`` of the insertion point; a
    ``chunk`` point is after the ``chunk``-th streamed text piece of call ``n``."""

    kind: PointKind
    session: str | None = None
    n: int = 0
    tool: str | None = None
    hook: str | None = None
    round: int = 1
    chunk: int = 0

    @property
    def unit(self) -> str:
        """What ``n`` counts: ``call`` or ``turn`` (hook points)."""
        return HOOK_POINTS.get(self.hook or "", "call")

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
            case "hook":
                rounds = f" round {self.round}" if self.round > 1 else ""
                return f"while {self.hook}{rounds} of {self.unit} {self.n} of {self.session} runs"
            case "chunk":
                return f"after chunk {self.chunk} of call {self.n} of {self.session}"
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
