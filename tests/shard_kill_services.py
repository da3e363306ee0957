"""Services for ``tests/test_process_shards_kill.py``'s workers: an instant model that
answers a user message with a call of the ``work`` tool and its result with a reply; the
tool takes a few milliseconds, so a kill often lands inside a tool or between commits."""

from __future__ import annotations

import random
import time
from typing import Any

from aalis_agent.events import ToolCall
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry


def _reply(request: Any, n: int) -> ScriptedReply:
    if request.messages[-1].role == "user":
        return ScriptedReply(tool_calls=(ToolCall(id=f"w{n}", name="work", arguments="{}"),))
    return ScriptedReply(text=f"好的 {n}")


def _work(args: Any, ctx: Any) -> str:
    time.sleep(random.uniform(0, 0.004))
    return "done"


def services() -> Services:
    return Services(
        llm=ScriptedModel(_reply, keep_requests=0),
        tools=ToolRegistry([Tool("work", _work)]),
    )
