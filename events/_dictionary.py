"""The fixed dictionary that format-2 rows are compressed against (see
:mod:`aalis_agent.events.codec`).

Typical events of a turn, as a row holds them (no ``session_id``, no ``seq``), with
placeholder ids and empty texts, so that tags, field names and common values cost a
back-reference each instead of their bytes; the most common come last, nearest to the
row. Rarer kinds are left out: a row finds them in the rows before it, or pays in full.
The encoded bytes are part of the format: a stored row inflates
only against exactly these, so they never change (:data:`SHA256` pins them); a different
dictionary would be a new row format.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

__all__ = ["SHA256", "dictionary"]

T = 1_767_225_600_000  # 2026-01-01T00:00:00Z: the high bytes of a timestamp

EVENTS: tuple[dict[str, Any], ...] = (
    {
        "type": "tool_started",
        "turn_id": "turn-0000000000000000",
        "call_id": "call_00000000000000000000000",
        "name": "",
        "arguments": "{}",
        "at": T,
    },
    {
        "type": "tool_finished",
        "turn_id": "turn-0000000000000000",
        "call_id": "call_00000000000000000000000",
        "name": "",
        "error": "",
        "at": T,
    },
    {
        "type": "tool_finished",
        "turn_id": "turn-0000000000000000",
        "call_id": "call_00000000000000000000000",
        "name": "",
        "result": "",
        "at": T,
    },
    {
        "type": "message_saved",
        "message": {
            "id": "msg-0000000000000000",
            "role": "assistant",
            "tool_calls": [{"id": "call_00000000000000000000000", "name": "", "arguments": "{}"}],
            "reasoning": "",
            "meta": {"turn_id": "turn-0000000000000000"},
        },
        "at": T,
    },
    {
        "type": "message_saved",
        "message": {
            "id": "msg-0000000000000000",
            "role": "tool",
            "tool_call_id": "call_00000000000000000000000",
            "name": "",
            "meta": {"turn_id": "turn-0000000000000000", "call_id": "call_00000000000000000000000"},
        },
        "at": T,
    },
    {
        "type": "model_call_ended",
        "turn_id": "turn-0000000000000000",
        "index": 1,
        "status": "error",
        "error": "",
        "at": T,
    },
    {
        "type": "model_call_ended",
        "turn_id": "turn-0000000000000000",
        "index": 1,
        "tool_calls": 1,
        "at": T,
    },
    {
        "type": "model_call_started",
        "turn_id": "turn-0000000000000000",
        "index": 1,
        "model": "",
        "purpose": "子任务",
        "at": T,
    },
    {"type": "model_call_ended", "turn_id": "turn-0000000000000000", "index": 2, "at": T},
    {
        "type": "usage_recorded",
        "usage": {
            "sessionId": "",
            "turnId": "turn-0000000000000000",
            "platform": "cli",
            "contextWindow": 32000,
            "maxTokens": 4096,
            "tokenBudget": 27392,
            "used": 1000,
            "usageRatio": 0.03125,
            "untrimmedHistory": 1000,
            "historyMessages": 10,
            "breakdown": {
                "system": 100,
                "systemOther": 10,
                "history": 1000,
                "toolResults": 10,
                "toolDefs": 100,
                "reservedForReply": 4096,
                "injectors": {"agent/other": 10},
            },
            "parts": [
                {"label": "历史消息", "tokens": 1000},
                {"label": "工具结果", "tokens": 10},
                {"label": "工具定义", "tokens": 100},
                {"label": "人设", "tokens": 0},
                {"label": "对话摘要", "tokens": 0},
                {"label": "向量记忆", "tokens": 0},
                {"label": "技能", "tokens": 0},
                {"label": "平台提示", "tokens": 0},
                {"label": "子任务", "tokens": 0},
                {"label": "其余系统提示", "tokens": 110, "injectors": {"agent/other": 10}},
            ],
        },
        "at": T,
    },
    {
        "type": "input_received",
        "input": {
            "id": "in-0000000000000000",
            "content": "",
            "sender": {"user_id": "", "nickname": ""},
            "platform": "qq",
            "group_id": "",
            "group_name": "",
            "session_type": "group",
            "message_id": "",
            "trigger_type": "direct",
            "mentions": [""],
            "timestamp": T,
            "gateway_seq": 1,
        },
        "at": T,
    },
    {
        "type": "input_received",
        "input": {"id": "in-0000000000000000", "content": "", "timestamp": T},
        "at": T,
    },
    {
        "type": "turn_opened",
        "turn_id": "turn-0000000000000000",
        "input_ids": ["in-0000000000000000"],
        "platform": "cli",
        "settings": {"history_limit": 20},
        "at": T,
    },
    {
        "type": "input_joined",
        "input_id": "in-0000000000000000",
        "turn_id": "turn-0000000000000000",
        "entry": "joined",
        "participants": [["qq", ""]],
        "speaker": "",
        "at": T,
    },
    {
        "type": "input_joined",
        "input_id": "in-0000000000000000",
        "turn_id": "turn-0000000000000000",
        "entry": "opened",
        "at": T,
    },
    {
        "type": "message_saved",
        "message": {
            "id": "msg-0000000000000000",
            "role": "user",
            "meta": {
                "turn_id": "turn-0000000000000000",
                "entry": "joined",
                "input_id": "in-0000000000000000",
                "visible_content": "",
                "sender": {"user_id": "", "nickname": ""},
                "platform": "qq",
                "timestamp": T,
            },
        },
        "at": T,
    },
    {
        "type": "message_saved",
        "message": {
            "id": "msg-0000000000000000",
            "role": "user",
            "meta": {
                "turn_id": "turn-0000000000000000",
                "entry": "opened",
                "input_id": "in-0000000000000000",
                "sender": {},
                "platform": "cli",
                "timestamp": T,
            },
        },
        "at": T,
    },
    {
        "type": "model_call_started",
        "turn_id": "turn-0000000000000000",
        "index": 2,
        "model": "",
        "purpose": "对话",
        "at": T,
    },
    {
        "type": "message_saved",
        "message": {
            "id": "msg-0000000000000000",
            "role": "assistant",
            "meta": {
                "turn_id": "turn-0000000000000000",
                "turn_record": {"turn_id": "turn-0000000000000000", "outcome": "replied"},
            },
        },
        "at": T,
    },
    {
        "type": "turn_recorded",
        "turn_id": "turn-0000000000000000",
        "outcome": "replied",
        "duration_ms": 1000,
        "at": T,
    },
)

SHA256 = "983d5d32ddbedf75f226e614f1c9111bc06001a755e35e45fae4f008873914bb"
"""The SHA-256 of :func:`dictionary`'s bytes."""


def dictionary() -> bytes:
    """:data:`EVENTS`, each encoded as a MessagePack map, one after the other; raises
    ``RuntimeError`` if the bytes are not the pinned ones (stored rows would not inflate)."""
    data = b"".join(msgspec.msgpack.encode(event) for event in EVENTS)
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise RuntimeError("the row dictionary changed: format-2 rows would not read back")
    return data
