"""The ``token:usage`` payload (ACC2) and the throttled budget log (ACC4): pure functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
from aalis_agent.events.schema import ChatMessage, TokenBreakdown, TokenPart, TokenUsage
from aalis_agent.request.tokens import TokenCounter, message_tokens

__all__ = [
    "PART_LABELS",
    "breakdown",
    "bucket",
    "budget_line",
    "usage_payload",
    "wire",
]

PART_LABELS = (
    "历史消息",
    "工具结果",
    "工具定义",
    "人设",
    "对话摘要",
    "向量记忆",
    "技能",
    "平台提示",
    "子任务",
    "其余系统提示",
)

# Injector keys ("<plugin>/<id>") whose plugin part names a breakdown field.
_CATEGORIES = {
    "memory-summary": "memory_summary",
    "summary": "memory_summary",
    "memory-vector": "memory_vector",
    "vector": "memory_vector",
    "skills": "skills",
    "platform": "platform",
    "subtask": "subtask",
}


def _category(injector: str | None) -> str:
    plugin = (injector or "").split("/", 1)[0]
    return _CATEGORIES.get(plugin, "system_other")


def breakdown(
    counter: TokenCounter,
    messages: Sequence[ChatMessage],
    *,
    history_ids: frozenset[str],
    persona_tokens: int,
    tool_defs_tokens: int,
    reserved: int,
    history_tokens: int = 0,
    counts: Sequence[int] | None = None,
) -> TokenBreakdown:
    """Split what was sent (after trimming) into the source's breakdown fields.

    ``history_tokens`` is added to the history: a caller that already knows what the
    history costs passes only the other messages. ``counts``: each message's tokens, in
    order, when the caller has counted them already.
    """
    system = tool_results = 0
    history = history_tokens
    injected: dict[str, int] = {}  # the injected system messages' tokens, by category
    injectors: dict[str, int] = {}
    if counts is None:
        counts = [message_tokens(counter, m) for m in messages]
    first = True
    for m, n in zip(messages, counts, strict=True):
        role = m.role
        if first:
            first = False
            if role == "system":
                system += n
                continue
        if m.id in history_ids:
            history += n
        elif role == "tool":
            tool_results += n
        elif role == "system" and m.kind is None:
            key = _category(m.meta.injector)
            injected[key] = injected.get(key, 0) + n
            if key == "system_other":
                name = m.meta.injector or "agent/other"
                injectors[name] = injectors.get(name, 0) + n
        else:
            history += n  # this turn's conversation counts with the history
    persona = min(persona_tokens, system)
    get = injected.get
    return TokenBreakdown(
        system=system - persona,
        persona=persona,
        memory_summary=get("memory_summary", 0),
        memory_vector=get("memory_vector", 0),
        skills=get("skills", 0),
        platform=get("platform", 0),
        subtask=get("subtask", 0),
        system_other=get("system_other", 0),
        history=history,
        tool_results=tool_results,
        tool_defs=tool_defs_tokens,
        reserved_for_reply=reserved,
        injectors=injectors,
    )


def usage_payload(
    *,
    session_id: str,
    turn_id: str | None,
    platform: str | None,
    context_window: int,
    max_tokens: int,
    token_budget: int,
    provider_input_tokens: float | None,
    estimate: int,
    trimmed: bool,
    untrimmed_history: int,
    history_messages: int,
    parts: TokenBreakdown,
) -> TokenUsage:
    """ACC2: ``used`` is the provider's input tokens when a positive finite number, else
    the estimate; the ratio is against the context window."""
    used = estimate
    if (
        provider_input_tokens is not None
        and math.isfinite(provider_input_tokens)
        and provider_input_tokens > 0
    ):
        used = int(provider_input_tokens)
    return TokenUsage(
        session_id=session_id,
        turn_id=turn_id,
        platform=platform,
        context_window=context_window,
        max_tokens=max_tokens,
        token_budget=token_budget,
        used=used,
        usage_ratio=used / context_window if context_window > 0 else 0.0,
        trimmed=trimmed,
        untrimmed_history=untrimmed_history,
        history_messages=history_messages,
        breakdown=parts,
        parts=(
            TokenPart(label="历史消息", tokens=parts.history),
            TokenPart(label="工具结果", tokens=parts.tool_results),
            TokenPart(label="工具定义", tokens=parts.tool_defs),
            TokenPart(label="人设", tokens=parts.persona),
            TokenPart(label="对话摘要", tokens=parts.memory_summary),
            TokenPart(label="向量记忆", tokens=parts.memory_vector),
            TokenPart(label="技能", tokens=parts.skills),
            TokenPart(label="平台提示", tokens=parts.platform),
            TokenPart(label="子任务", tokens=parts.subtask),
            TokenPart(
                label="其余系统提示",
                tokens=parts.system_other + parts.system,
                injectors=dict(parts.injectors),
            ),
        ),
    )


_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {}


def _fields(kind: type) -> tuple[tuple[str, str], ...]:
    # msgspec.structs.fields evaluates annotations on every call: keep the answer per type.
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple((f.name, f.encode_name) for f in msgspec.structs.fields(kind))
    return names


def wire(value: Any) -> Any:
    """The ``token:usage`` payload as plain data with every field present (the stored event
    leaves out default values; consumers of the payload get them all)."""
    if isinstance(value, msgspec.Struct):
        return {out: wire(getattr(value, name)) for name, out in _fields(type(value))}
    if isinstance(value, tuple | list):
        return [wire(v) for v in value]
    if isinstance(value, dict):
        return {k: wire(v) for k, v in value.items()}
    return value


def bucket(ratio: float) -> tuple[int, str]:
    """ACC4 buckets: < 0.5 OK, 0.5–0.7 INFO, 0.7–0.85 WARN, ≥ 0.85 CRITICAL."""
    if ratio < 0.5:
        return 0, "OK"
    if ratio < 0.7:
        return 1, "INFO"
    if ratio < 0.85:
        return 2, "WARN"
    return 3, "CRITICAL"


def budget_line(usage: TokenUsage) -> str:
    """``[token-usage:WARN] <sessionId> 23104/32000 (72.2%) sys=…(persona=… mem=… skills=…
    subtask=… other=…) hist=… tools=<results>+<defs>def reserve=…``"""
    b = usage.breakdown
    _, label = bucket(usage.usage_ratio)
    mem = b.memory_summary + b.memory_vector
    other = b.system_other + b.system + b.platform
    sys_total = b.persona + mem + b.skills + b.subtask + other
    return (
        f"[token-usage:{label}] {usage.session_id} {usage.used}/{usage.context_window} "
        f"({usage.usage_ratio * 100:.1f}%) sys={sys_total}(persona={b.persona} mem={mem} "
        f"skills={b.skills} subtask={b.subtask} other={other}) hist={b.history} "
        f"tools={b.tool_results}+{b.tool_defs}def reserve={b.reserved_for_reply}"
    )
