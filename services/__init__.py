"""Ports (Protocols) and their default adapters. Services never import ``actors``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo

from aalis_agent.request.texts import Texts, texts_for
from aalis_agent.services.abort import Aborted, AbortSignal
from aalis_agent.services.authority import Authority, StaticAuthority
from aalis_agent.services.bus import EventBus
from aalis_agent.services.config import AgentConfig
from aalis_agent.services.llm import (
    ChatModel,
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    StreamChunk,
    Usage,
)
from aalis_agent.services.memory import MemoryService, ProjectionMemory
from aalis_agent.services.models import LlmService, ModelChoice, Provider
from aalis_agent.services.outbound import (
    Gateway,
    LogArchive,
    MessageArchive,
    OutboundMessage,
    PersonaService,
    StaticPersonas,
)
from aalis_agent.services.sessions import SessionDirectory, SessionInfo, StaticSessions
from aalis_agent.services.settings import SettingsLayers, SettingsResolver, StaticSettings
from aalis_agent.services.tools import Inbound, Tool, ToolCallContext, ToolRegistry
from aalis_agent.services.typed_tools import EventLoopThread, TypedTool, tool, tool_from

__all__ = [
    "AbortSignal",
    "Aborted",
    "AgentConfig",
    "Authority",
    "ChatModel",
    "ChatRequest",
    "EventBus",
    "EventLoopThread",
    "Gateway",
    "Inbound",
    "LlmService",
    "LogArchive",
    "MemoryService",
    "MessageArchive",
    "ModelChoice",
    "OutboundMessage",
    "PersonaService",
    "ProjectionMemory",
    "Provider",
    "ScriptedModel",
    "ScriptedReply",
    "Services",
    "SessionDirectory",
    "SessionInfo",
    "SettingsLayers",
    "SettingsResolver",
    "StaticAuthority",
    "StaticPersonas",
    "StaticSessions",
    "StaticSettings",
    "StreamChunk",
    "Tool",
    "ToolCallContext",
    "ToolRegistry",
    "TypedTool",
    "Usage",
    "tool",
    "tool_from",
]


@dataclass
class Services:
    """Everything a runtime talks to, with embedded defaults: one process, no servers."""

    llm: ChatModel | LlmService = field(default_factory=ScriptedModel)
    """One chat model, or an :class:`LlmService` of providers and preferences."""
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    authority: Authority = field(default_factory=StaticAuthority)
    sessions: SessionDirectory = field(default_factory=StaticSessions)
    settings: SettingsResolver | None = None
    """The settings layers (SET); None: the plugin config under each session's own layer."""
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
    _models: LlmService | None = field(default=None, init=False, repr=False, compare=False)
    _layers: SettingsLayers | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tools, ToolRegistry):
            raise TypeError(
                f"Services(tools=...) takes a ToolRegistry, got {type(self.tools).__name__}: "
                "write tools=ToolRegistry([...])"
            )

    @property
    def resolver(self) -> SettingsResolver:
        """The settings layers in use: :attr:`settings`, else the plugin config alone."""
        if self.settings is not None:
            return self.settings
        cached = self._layers
        if cached is None or cached.config is not self.config:
            cached = self._layers = SettingsLayers(config=self.config)
        return cached

    def texts_for(self, platform: str | None = None, venue: str | None = None) -> Texts:
        """The texts of ``platform`` (and ``venue``): the locale a settings layer picks for
        it (``locale`` in a platform, platform-type or venue layer), else the runtime's
        :attr:`AgentConfig.locale`."""
        pick = getattr(self.resolver, "locale_for", None)
        chosen = pick(platform, venue) if pick is not None else None
        return texts_for(chosen or self.config.locale)

    @property
    def texts(self) -> Texts:
        """The runtime's own texts (:attr:`AgentConfig.locale`), for no platform."""
        return texts_for(self.config.locale)

    @property
    def models(self) -> LlmService:
        """The llm service; a single model is served as a one-provider service."""
        llm = self.llm
        if isinstance(llm, LlmService):
            return llm
        cached = self._models
        if cached is None or cached.providers[0].models[0] is not llm:
            cached = self._models = LlmService.single(llm)
        return cached


def _local_tz() -> tzinfo:
    tz = datetime.now().astimezone().tzinfo
    return tz if tz is not None else UTC
