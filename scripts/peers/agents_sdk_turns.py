"""The turns workload on the OpenAI Agents SDK, with its SQLiteSession.

An Agent with one function tool, ``echo``, and a custom ``Model`` that answers a user
message with a call to ``echo`` and the tool's output with a final reply (a new text every
turn): instant, deterministic, in process. Every turn is one ``Runner.run_sync`` with the
same SQLiteSession on a file; tracing is disabled. Prints one JSON line.

Run through scripts/peers/run, or: .venv-peers/bin/python scripts/peers/agents_sdk_turns.py
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import _common as common  # sets tracing off before the framework is imported
from agents import (
    Agent,
    Model,
    ModelResponse,
    ModelTracing,
    RunConfig,
    Runner,
    SQLiteSession,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

PEER = "openai-agents"


class ScriptedModel(Model):
    """Answers a user message with one ``echo`` call, and a tool result with a final
    reply whose text differs every turn."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: Any = None,
        **kwargs: Any,
    ) -> ModelResponse:
        n = 1 if isinstance(input, str) else len(input)
        last = None if isinstance(input, str) else input[-1]
        item: ResponseFunctionToolCall | ResponseOutputMessage
        if isinstance(last, dict) and last.get("type") == "function_call_output":
            text = ResponseOutputText(
                type="output_text", text=f"{n}: {common.REPLY_TEXT}", annotations=[]
            )
            item = ResponseOutputMessage(
                id=f"msg_{n}",
                type="message",
                role="assistant",
                status="completed",
                content=[text],
            )
        else:
            item = ResponseFunctionToolCall(
                id=f"fc_{n}",
                call_id=f"call_{n}",
                type="function_call",
                name="echo",
                arguments="{}",
                status="completed",
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the workload does not stream")


@function_tool
def echo() -> str:
    """Answer with one character."""
    return common.TOOL_RESULT


def run(path: Path, turns: int, *, timed: bool) -> list[float]:
    agent = Agent(
        name="assistant",
        instructions="You are a helpful assistant.",
        model=ScriptedModel(),
        tools=[echo],
    )
    run_config = RunConfig(tracing_disabled=True)
    session = SQLiteSession(common.SESSION_ID, str(path))
    try:

        def turn(i: int) -> None:
            result = Runner.run_sync(
                agent, common.user_text(i), session=session, run_config=run_config
            )
            assert isinstance(result.final_output, str), result.final_output

        if timed:
            samples = common.time_turns(turns, turn)
        else:
            for i in range(turns):
                turn(i)
            samples = []
        items = asyncio.run(session.get_items())
        assert len(items) == 4 * turns, len(items)  # user, call, output, reply per turn
    finally:
        session.close()
    return samples


def main() -> int:
    args = common.parse_args(PEER)
    common.block_network()
    set_tracing_disabled(True)
    with common.db_paths(args.db) as (warmup_db, db):
        if args.warmup:
            run(warmup_db, args.warmup, timed=False)
        samples = run(db, args.turns, timed=True)
        common.report(PEER, samples, common.stored_bytes(db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
