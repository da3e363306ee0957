"""Ports (Protocols) and their default adapters. Services never import ``actors``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo

from services.abort import Aborted, AbortSignal
from services.authority import Authority, StaticAuthority
from services.bus import EventBus
from services.config import AgentConfig
from services.llm import ChatModel, ChatRequest, ScriptedModel, ScriptedReply, StreamChunk, Usage
from services.memory import MemoryService, ProjectionMemory
from services.outbound import (
    Gateway,
    LogArchive,
    MessageArchive,
    OutboundMessage,
    PersonaService,
    StaticPersonas,
)
from services.sessions import SessionDirectory, SessionInfo, StaticSessions
from services.settings import SettingsResolver, StaticSettings
from services.tools import Inbound, Tool, ToolCallContext, ToolRegistry

__all__ = [
    "AbortSignal",
    "Aborted",
    "AgentConfig",
    "Authority",
    "ChatModel",
    "ChatRequest",
    "EventBus",
    "Gateway",
    "Inbound",
    "LogArchive",
    "MemoryService",
    "MessageArchive",
    "OutboundMessage",
    "PersonaService",
    "ProjectionMemory",
    "ScriptedModel",
    "ScriptedReply",
    "Services",
    "SessionDirectory",
    "SessionInfo",
    "SettingsResolver",
    "StaticAuthority",
    "StaticPersonas",
    "StaticSessions",
    "StaticSettings",
    "StreamChunk",
    "Tool",
    "ToolCallContext",
    "ToolRegistry",
    "Usage",
]


@dataclass
class Services:
    """Everything a runtime talks to, with embedded defaults: one process, no servers."""

    llm: ChatModel = field(default_factory=ScriptedModel)
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    authority: Authority = field(default_factory=StaticAuthority)
    sessions: SessionDirectory = field(default_factory=StaticSessions)
    settings: SettingsResolver = field(default_factory=StaticSettings)
    bus: EventBus = field(default_factory=EventBus)
    config: AgentConfig = field(default_factory=AgentConfig)
    persona: PersonaService | None = None
    memory: MemoryService = field(default_factory=ProjectionMemory)
    archive: MessageArchive | None = field(default_factory=LogArchive)
    """``None``: the archive is absent (ARC1): turns run, nothing new is archived."""
    gateway: Gateway | None = None
    """``None``: replies are emitted as ``outbound:message`` events on the bus (OUT1)."""
    tz: tzinfo = field(default_factory=lambda: _local_tz())
    """The time zone of time labels shown to the model."""


def _local_tz() -> tzinfo:
    tz = datetime.now().astimezone().tzinfo
    return tz if tz is not None else UTC
