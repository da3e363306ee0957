"""What a scenario run produced (:class:`ScenarioResult` and its records), and how it
reads: the ``--json`` document and the transcript."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from aalis_agent.events import ChatMessage, SessionEvent, to_builtins
from aalis_agent.request.validate import provider_violations
from aalis_agent.scenarios.spec import ReplySpec, Scenario, StepSpec, ToolOutcome
from aalis_agent.services import ChatRequest
from aalis_agent.timeline import render_event


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
    streamed: int | None = None  # status "cut": the text chunks the turn received

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
        } | ({} if self.streamed is None else {"streamed": self.streamed})


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
        elif kind == "hold":
            lines.append(_hold_line(item))
        elif kind == "resume":
            lines.append(f"    released {item.describe()}")
        elif kind == "cut":
            lines.append(
                f"    the stream of call {item.point.n} of {item.session} ended after chunk "
                f"{item.point.chunk}: the turn was stopped"
            )
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


def _hold_line(hold: Any) -> str:
    """A turn held where a step is placed: in a hook, or between two streamed chunks."""
    at = hold.point
    turn = hold.turn_id or "?"
    if at.kind == "chunk":
        return (
            f"[call {at.n} of {hold.session}] {turn}: streamed chunk {at.chunk} "
            f"{_preview(hold.text, 60)} (held mid-stream)"
        )
    return f"[{hold.describe()}] {turn}: held in the hook"


def _outcome_text(outcome: ToolOutcome | None) -> str:
    if outcome is None:
        return "(no scripted result)"
    if outcome.error is not None:
        return f"ToolError: {_preview(outcome.error, 60)}"
    return _preview(outcome.result, 60)
