"""aalis-agent: an embedded, event-sourced actor runtime for LLM chat sessions.

Everything installs under this one import name; the repository keeps its folders at the
top level (``events/``, ``projections/``, ``actors/``, ``services/``) and the
distribution maps them to ``aalis_agent.events`` and so on, so a project's own
``events`` or ``services`` package never collides with ours.

    from aalis_agent import AsyncRuntime, Input, Runtime, Services, SqliteEventStore, tool

    runtime = Runtime(SqliteEventStore("agent.db"), Services(llm=..., tools=...))
    async with AsyncRuntime(runtime) as agent:
        result = await (await agent.asubmit("room-1", Input(id="", content="hi")))
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from aalis_agent.actors.aio import AsyncHandle, AsyncRuntime, EventsDropped, TurnResult
from aalis_agent.actors.hooks import Contribution, Hooks
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.actors.runtime import (
    InputBefore,
    Quarantined,
    Runtime,
    RuntimeClosed,
    SubmitHandle,
)
from aalis_agent.events import (
    AgentError,
    ConcurrencyConflict,
    ConfigError,
    CorruptEvent,
    EventStore,
    InMemoryEventStore,
    Input,
    InvalidBatch,
    InvalidInput,
    ModelRef,
    ProviderError,
    ReplayError,
    RunError,
    ScenarioError,
    Sender,
    SessionFailed,
    SqliteEventStore,
    StoreError,
    StoreInUse,
    ToolCall,
    ToolError,
    UsageError,
)
from aalis_agent.events.schema import ChatMessage
from aalis_agent.services import (
    Aborted,
    AbortSignal,
    AgentConfig,
    ChatModel,
    ChatRequest,
    LlmService,
    OutboundMessage,
    Provider,
    ScriptedModel,
    ScriptedReply,
    Services,
    StaticPersonas,
    StreamChunk,
    Tool,
    ToolCallContext,
    ToolRegistry,
)
from aalis_agent.services.bus_events import (
    MessageSent,
    ModelCall,
    QueueChanged,
    StreamDelta,
    StreamEnded,
    ToolCallStreaming,
    ToolExecution,
    TrimApplied,
    TurnEnded,
    TurnStarted,
    UsageReported,
    subscribe_typed,
    typed_event,
)
from aalis_agent.services.logging_setup import install as _install_logging
from aalis_agent.services.typed_tools import TypedTool, tool, tool_from

_install_logging()  # quiet: nothing is printed unless the application configures logging

try:
    __version__ = _version("aalis-agent")
except PackageNotFoundError:  # pragma: no cover - running from a tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AbortSignal",
    "Aborted",
    "AgentConfig",
    "AgentError",
    "AsyncHandle",
    "AsyncRuntime",
    "ChatMessage",
    "ChatModel",
    "ChatRequest",
    "ConcurrencyConflict",
    "ConfigError",
    "Contribution",
    "CorruptEvent",
    "EventStore",
    "EventsDropped",
    "Hooks",
    "InMemoryEventStore",
    "Input",
    "InputBefore",
    "InputOutcome",
    "InvalidBatch",
    "InvalidInput",
    "LlmService",
    "MessageSent",
    "ModelCall",
    "ModelRef",
    "OutboundMessage",
    "Provider",
    "ProviderError",
    "Quarantined",
    "QueueChanged",
    "ReplayError",
    "RunError",
    "Runtime",
    "RuntimeClosed",
    "ScenarioError",
    "ScriptedModel",
    "ScriptedReply",
    "Sender",
    "Services",
    "SessionFailed",
    "SqliteEventStore",
    "StaticPersonas",
    "StoreError",
    "StoreInUse",
    "StreamChunk",
    "StreamDelta",
    "StreamEnded",
    "SubmitHandle",
    "Tool",
    "ToolCall",
    "ToolCallContext",
    "ToolCallStreaming",
    "ToolError",
    "ToolExecution",
    "ToolRegistry",
    "TrimApplied",
    "TurnEnded",
    "TurnResult",
    "TurnStarted",
    "TypedTool",
    "UsageError",
    "UsageReported",
    "__version__",
    "subscribe_typed",
    "tool",
    "tool_from",
    "typed_event",
]
