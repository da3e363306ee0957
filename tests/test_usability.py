"""What a first bot built from the README meets: the names it needs import from the
package root, and a mistake in how it hands over personas or tools is refused where it
is made, with an error naming it, instead of surfacing later (or never) as something
else."""

from __future__ import annotations

import aalis_agent
from aalis_agent import (
    AgentConfig,
    ChatMessage,
    StaticPersonas,
)


def test_a_bot_imports_what_it_uses_from_the_package_root() -> None:
    """The locale pack's config, the personas, the message type an ``agent:llm:before``
    middleware rewrites, and the typed events a bot renders were reachable only through
    subpackages (``aalis_agent.services``, ``...services.bus_events``, ``...events.schema``)."""
    from aalis_agent.events.schema import ChatMessage as schema_message
    from aalis_agent.services import AgentConfig as services_config
    from aalis_agent.services import StaticPersonas as services_personas
    from aalis_agent.services import bus_events

    assert AgentConfig is services_config
    assert StaticPersonas is services_personas
    assert ChatMessage is schema_message
    for name in (
        "MessageSent",
        "ModelCall",
        "QueueChanged",
        "StreamDelta",
        "StreamEnded",
        "ToolCallStreaming",
        "ToolExecution",
        "TrimApplied",
        "TurnEnded",
        "TurnStarted",
        "UsageReported",
    ):
        assert name in aalis_agent.__all__, name
        assert getattr(aalis_agent, name) is getattr(bus_events, name)
