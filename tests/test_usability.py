"""What a first bot built from the README meets: the names it needs import from the
package root, and a mistake in how it hands over personas or tools is refused where it
is made, with an error naming it, instead of surfacing later (or never) as something
else."""

from __future__ import annotations

import pytest

import aalis_agent
from aalis_agent import (
    AgentConfig,
    ChatMessage,
    ConfigError,
    InMemoryEventStore,
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    StaticPersonas,
    ToolRegistry,
    tool,
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


def test_a_persona_given_as_a_bare_prompt_is_refused_naming_it() -> None:
    """``{"pirate": "You are a pirate."}`` was taken as a (name, prompt) pair: the
    prompt sent to the model was its second character, ``'o'``."""
    with pytest.raises(ConfigError, match=r"persona 'pirate': expected a \(name, prompt\) pair"):
        StaticPersonas({"pirate": "You are a pirate."}, default="pirate")  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="persona 'p'"):
        StaticPersonas({"p": ("P", 3)})  # type: ignore[dict-item]


def test_a_default_persona_that_names_none_of_them_is_refused() -> None:
    """A misspelt default gave every session no persona at all, silently."""
    with pytest.raises(ConfigError, match=r"default persona 'pirat' is not one of them.*'pirate'"):
        StaticPersonas({"pirate": ("Pirate", "You are a pirate.")}, default="pirat")


def test_well_formed_personas_reach_the_prompt() -> None:
    personas = StaticPersonas({"pirate": ("Pirate", "You are a pirate.")}, default="pirate")
    assert personas.prompt(None) == "You are a pirate."
    assert personas.list() == [("pirate", "Pirate")]
    seen: list[str] = []

    def model(request, n):  # type: ignore[no-untyped-def]
        seen.append("\n".join(m.content for m in request.messages if m.role == "system"))
        return ScriptedReply(text="arr")

    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=ScriptedModel(model), persona=personas, config=AgentConfig(locale="en")),
    )
    try:
        assert runtime.run("room", Input(id="", content="hi")).reply == "arr"
    finally:
        runtime.shutdown()
    assert "You are a pirate." in seen[0]


def test_a_plain_function_in_a_tool_registry_is_refused_saying_to_use_tool() -> None:
    """It failed with ``AttributeError: 'function' object has no attribute 'name'``."""

    def roll(sides: int) -> str:
        return str(sides)

    with pytest.raises(TypeError, match=r"'roll' is a function: make it a tool with @tool"):
        ToolRegistry([roll])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="holds Tool objects; got str"):
        ToolRegistry(["roll"])  # type: ignore[list-item]
    assert ToolRegistry([tool(roll)]).get("roll") is not None


def test_services_given_a_list_of_tools_is_refused_naming_tool_registry() -> None:
    """A list was accepted, and the first turn failed on it far from where it was given."""

    @tool
    def roll(sides: int) -> str:
        """Roll a die.

        Args:
            sides: How many sides.
        """
        return str(sides)

    with pytest.raises(
        TypeError, match=r"takes a ToolRegistry, got list: write tools=ToolRegistry"
    ):
        Services(tools=[roll])  # type: ignore[arg-type]


def test_an_asyncio_bot_recovers_after_a_restart_without_blocking_its_loop() -> None:
    """After a kill, a turn cut mid-call has no record and an input queued behind it
    waits; ``Runtime.recover`` fixes both, but ``AsyncRuntime`` had no way to call it off
    the event loop. ``await arecover()`` records the cut turn and runs the queued input."""
    import asyncio

    from aalis_agent.events import (
        Batch,
        InputJoined,
        InputQueued,
        InputReceived,
        MessageSaved,
        ModelCallStarted,
        TurnOpened,
    )
    from aalis_agent.events.schema import MessageMeta

    from aalis_agent import AsyncRuntime, TurnEnded

    store = InMemoryEventStore()
    cut = Batch("room", 0, now_ms=1_000)
    cut.add(InputReceived(input=Input(id="a", content="one", timestamp=1_000)))
    cut.add(TurnOpened(turn_id="turn-1", input_ids=("a",)))
    cut.add(InputJoined(input_id="a", turn_id="turn-1", entry="opened"))
    meta = MessageMeta(turn_id="turn-1", entry="opened", input_id="a")
    cut.add(MessageSaved(message=ChatMessage(id="m-a", role="user", content="one", meta=meta)))
    cut.add(ModelCallStarted(turn_id="turn-1", index=1))
    cut.add(InputReceived(input=Input(id="b", content="two", timestamp=1_000)))
    cut.add(InputQueued(input_id="b"))
    store.append("room", cut.events, 0)

    async def main() -> list[tuple[str, str, str | None]]:
        runtime = Runtime(store, Services(llm=ScriptedModel([ScriptedReply(text="back")])))
        async with AsyncRuntime(runtime) as agent:
            ended: list[tuple[str, str, str | None]] = []
            async with agent.events("room", topics=("turn:ended",)) as events:
                assert await agent.arecover(sessions=["elsewhere"]) == []  # not this one
                assert await agent.arecover() == ["room"]
                while len(ended) < 2:
                    event = await events.next(10)
                    assert isinstance(event, TurnEnded)
                    ended.append((event.turn_id, event.outcome, event.reason))
            return ended

    ended = asyncio.run(main())
    assert ended[0] == ("turn-1", "aborted", "crash")
    assert ended[1][1:] == ("replied", None)


def test_a_scripted_model_given_texts_is_refused_saying_to_wrap_them() -> None:
    """``ScriptedModel(["hi"])`` was accepted and every turn failed mid-call with
    ``AttributeError``; ``ScriptedModel("hi")`` answered 'h', then 'i'."""
    with pytest.raises(TypeError, match=r"reply 0 is str 'hi', not a ScriptedReply: write"):
        ScriptedModel(["hi"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"not a str: write \[ScriptedReply\(text='hi'\)\]"):
        ScriptedModel("hi")  # type: ignore[arg-type]


def test_a_scripted_model_function_of_the_wrong_shape_is_refused_naming_the_call() -> None:
    """A one-argument function was accepted and every turn ended ``error`` (TypeError
    from inside the model call)."""

    def answer(request):  # type: ignore[no-untyped-def]
        return ScriptedReply(text="x")

    with pytest.raises(TypeError, match=r"called as fn\(request, n\).*answer\(request\)"):
        ScriptedModel(answer)
    ScriptedModel(lambda request, n: ScriptedReply(text="x"))
    ScriptedModel(lambda *args: ScriptedReply(text="x"))


def test_a_scripted_model_function_returning_text_fails_its_turn_saying_so() -> None:
    """It failed with ``AttributeError: 'str' object has no attribute 'chunks'``."""
    model = ScriptedModel(lambda request, n: "hello")  # type: ignore[arg-type,return-value]
    runtime = Runtime(InMemoryEventStore(), Services(llm=model))
    try:
        outcome = runtime.run("room", Input(id="", content="hi"))
    finally:
        runtime.shutdown()
    assert (outcome.outcome, outcome.reason) == ("error", "TypeError")
    with pytest.raises(TypeError, match=r"function returned str 'hello' for call 2, not a"):
        model._next(model.requests[0])
