"""The providers' message rules (the validator the scenario output carries)."""

from __future__ import annotations

from aalis_agent.events import ChatMessage, ToolCall
from aalis_agent.request.validate import provider_violations


def m(id_: str, role: str, content: str = "x", **kw: object) -> ChatMessage:
    return ChatMessage(id=id_, role=role, content=content, **kw)  # type: ignore[arg-type]


CALLS = (ToolCall(id="c1", name="a"), ToolCall(id="c2", name="b"))


def test_a_complete_group_is_valid() -> None:
    msgs = [
        m("u", "user"),
        m("a", "assistant", "", tool_calls=CALLS),
        m("r1", "tool", tool_call_id="c1"),
        m("r2", "tool", tool_call_id="c2"),
        m("z", "assistant"),
    ]
    assert provider_violations(msgs) == []


def test_each_rule_is_caught() -> None:
    orphan = [m("u", "user"), m("r", "tool", tool_call_id="c9")]
    assert provider_violations(orphan) == ["#1 tool result 'c9' without its call"]
    cut = [
        m("a", "assistant", "", tool_calls=CALLS),
        m("r1", "tool", tool_call_id="c1"),
        m("u", "user"),
    ]
    assert provider_violations(cut) == ["#2 user message before the results of ['c2']"]
    empty = [m("u", "user"), m("a", "assistant", "  ")]
    assert provider_violations(empty) == ["#1 empty assistant message"]
    dangling = [m("u", "user"), m("a", "assistant", "", tool_calls=CALLS[:1])]
    assert provider_violations(dangling) == ["end: calls without results ['c1']"]
