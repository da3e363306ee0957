"""The providers' message rules, checked on a request before it is sent (or in tests).

Orphaned tool-call ids after trimming are the most common cause of provider 400s: every
assistant tool call must be answered by a result with its id before any other message,
no result may come without its call, and no assistant message may be empty.
"""

from __future__ import annotations

from collections.abc import Sequence

from aalis_agent.events.schema import ChatMessage

__all__ = ["provider_violations"]


def provider_violations(messages: Sequence[ChatMessage]) -> list[str]:
    """Every breach of the rules, as readable lines (empty when the request is valid)."""
    problems: list[str] = []
    waiting: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in waiting:
                problems.append(f"#{i} tool result {m.tool_call_id!r} without its call")
            else:
                waiting.discard(m.tool_call_id or "")
            continue
        if waiting:
            problems.append(f"#{i} {m.role} message before the results of {sorted(waiting)}")
            waiting = set()
        if m.role == "assistant":
            if m.tool_calls:
                waiting = {c.id for c in m.tool_calls}
            elif not m.content.strip():
                problems.append(f"#{i} empty assistant message")
    if waiting:
        problems.append(f"end: calls without results {sorted(waiting)}")
    return problems
