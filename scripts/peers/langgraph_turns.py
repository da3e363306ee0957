"""The turns workload on LangGraph, with the SqliteSaver checkpointer.

A StateGraph over MessagesState: an ``agent`` node calls a chat model bound to the tools,
``tools_condition`` routes its tool calls to a prebuilt ToolNode, which loops back to the
agent. The graph is compiled with SqliteSaver on a file, and every turn is one
``graph.invoke`` on the same ``thread_id``. The chat model is a fake: instant,
deterministic, in process. Prints one JSON line.

Run through scripts/peers/run, or: .venv-peers/bin/python scripts/peers/langgraph_turns.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _common as common  # sets tracing off before the framework is imported
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

PEER = "langgraph"


class ScriptedChatModel(BaseChatModel):
    """Answers a user message with one ``echo`` call, and a tool result with a final
    reply whose text differs every turn."""

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        n = len(messages)
        if isinstance(messages[-1], ToolMessage):
            reply = AIMessage(content=f"{n}: {common.REPLY_TEXT}")
        else:
            call = {"name": "echo", "args": {}, "id": f"call_{n}", "type": "tool_call"}
            reply = AIMessage(content="", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        # As a real chat model does: the tools' schemas travel with every call.
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    @property
    def _llm_type(self) -> str:
        return "scripted"


@tool
def echo() -> str:
    """Answer with one character."""
    return common.TOOL_RESULT


def run(path: Path, turns: int, *, timed: bool) -> list[float]:
    tools = [echo]
    model = ScriptedChatModel().bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")

    with SqliteSaver.from_conn_string(str(path)) as checkpointer:
        graph = builder.compile(checkpointer=checkpointer)
        config = {"configurable": {"thread_id": common.SESSION_ID}}

        def turn(i: int) -> None:
            out = graph.invoke({"messages": [HumanMessage(common.user_text(i))]}, config)
            last = out["messages"][-1]
            assert isinstance(last, AIMessage) and not last.tool_calls, last

        if timed:
            samples = common.time_turns(turns, turn)
        else:
            for i in range(turns):
                turn(i)
            samples = []
        final = graph.get_state(config).values["messages"]
        assert len(final) == 4 * turns, len(final)
    return samples


def main() -> int:
    args = common.parse_args(PEER)
    common.block_network()
    with common.db_paths(args.db) as (warmup_db, db):
        if args.warmup:
            run(warmup_db, args.warmup, timed=False)
        samples = run(db, args.turns, timed=True)
        common.report(PEER, samples, common.stored_bytes(db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
