"""OpenTelemetry export (services/otel.py): spans per turn, model call and tool call, seen
through the SDK's in-memory exporter."""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import pykka
import pytest
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import InMemoryEventStore, Input, ToolCall
from aalis_agent.services import (
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    Services,
    StreamChunk,
    Tool,
    ToolRegistry,
)
from aalis_agent.services.abort import AbortSignal
from aalis_agent.services.llm import Usage

SID = "qq:group:7"
OTHER = "qq:group:8"


def _sdk() -> Any:
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class Env:
    """A runtime on a scripted model, instrumented into an in-memory exporter."""

    def __init__(self, model: Any, tools: Sequence[Tool] = ()) -> None:
        from aalis_agent.services.otel import instrument

        self.provider, self.exporter = _sdk()
        self.hooks = Hooks()
        self.model = model
        self.runtime = Runtime(
            InMemoryEventStore(),
            Services(llm=model, tools=ToolRegistry(tools)),
            janitor=False,
            hooks=self.hooks,
        )
        self.uninstrument = instrument(self.runtime, tracer_provider=self.provider)

    def say(self, content: str, session: str = SID) -> Any:
        return self.runtime.submit(session, Input(id="", content=content)).result(10)

    def spans(self, turns: int = 1, timeout: float = 10.0) -> list[Any]:
        """The finished spans once ``turns`` turn spans are among them (``turn:ended``
        fires after the handles resolved)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = list(self.exporter.get_finished_spans())
            if sum(s.name == "aalis.turn" for s in spans) >= turns:
                return spans
            assert time.monotonic() < deadline, [s.name for s in spans]
            time.sleep(0.005)


@pytest.fixture
def envs() -> Iterator[list[Env]]:
    made: list[Env] = []
    yield made
    for env in made:
        env.uninstrument()
        env.runtime.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def make(envs: list[Env], model: Any, tools: Sequence[Tool] = ()) -> Env:
    env = Env(model, tools)
    envs.append(env)
    return env


def one(spans: list[Any], name: str) -> Any:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def echo(args: Any, ctx: Any) -> str:
    return f"echo:{dict(args)}"


def fail(args: Any, ctx: Any) -> str:
    raise ValueError("the disk is full")


def tool_then_text(call_id: str = "c1", name: str = "echo") -> list[ScriptedReply]:
    return [
        ScriptedReply(
            tool_calls=(ToolCall(id=call_id, name=name, arguments='{"x": 1}'),),
            usage=Usage(prompt_tokens=120, completion_tokens=9),
        ),
        ScriptedReply(text="好了。", usage=Usage(prompt_tokens=150, completion_tokens=4)),
    ]


def test_a_turn_with_a_tool_call(envs: list[Env]) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    env = make(envs, ScriptedModel(tool_then_text(), model_id="m1"), [Tool("echo", echo)])
    assert env.say("查一下").outcome == "replied"
    spans = env.spans()
    assert sorted(s.name for s in spans) == [
        "aalis.turn",
        "chat m1",
        "chat m1",
        "execute_tool echo",
    ]
    turn = one(spans, "aalis.turn")
    calls = sorted((s for s in spans if s.name == "chat m1"), key=lambda s: s.start_time)
    tool = one(spans, "execute_tool echo")
    turn_id = turn.attributes["aalis.turn_id"]
    assert turn.parent is None
    assert turn.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert turn.attributes["aalis.session_id"] == SID
    assert turn.attributes["gen_ai.conversation.id"] == SID
    assert turn.attributes["aalis.turn.outcome"] == "replied"
    assert turn.status.status_code is StatusCode.UNSET
    for child in [*calls, tool]:  # children of the turn, in its trace
        assert child.parent is not None
        assert child.parent.span_id == turn.context.span_id
        assert child.context.trace_id == turn.context.trace_id
        assert child.attributes["aalis.session_id"] == SID
        assert child.attributes["aalis.turn_id"] == turn_id
        assert turn.start_time <= child.start_time <= child.end_time <= turn.end_time
    usage = ((120, 9), (150, 4))
    for index, (call, (tokens, output)) in enumerate(zip(calls, usage, strict=True), 1):
        assert call.kind is SpanKind.CLIENT
        assert call.attributes["gen_ai.operation.name"] == "chat"
        assert call.attributes["gen_ai.request.model"] == "m1"
        assert call.attributes["aalis.model"] == "demo/m1"
        assert call.attributes["gen_ai.usage.input_tokens"] == tokens  # the provider's count
        assert call.attributes["gen_ai.request.max_tokens"] == 4096
        assert call.attributes["aalis.call.index"] == index
        assert call.attributes["aalis.call.returned"] is True
        assert call.attributes["gen_ai.usage.output_tokens"] == output
        assert call.status.status_code is StatusCode.UNSET
    # The tool loop in order: call 1, the tool, call 2; each call from its request going
    # out (llm:call) to its stream's end.
    assert turn.start_time <= calls[0].start_time <= calls[0].end_time <= tool.start_time
    assert tool.end_time <= calls[1].start_time <= calls[1].end_time
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "echo"
    assert tool.attributes["gen_ai.tool.call.id"] == "c1"
    assert tool.status.status_code is StatusCode.UNSET
    assert [e.name for e in calls[1].events] == ["aalis.first_chunk"]


def test_no_hook_middleware_is_installed(envs: list[Env]) -> None:
    env = make(envs, ScriptedModel())
    assert env.hooks.quiet(*(k for k in ("agent:turn:before", "agent:llm:before")))


def test_a_failing_tool_is_an_error_span(envs: list[Env]) -> None:
    from opentelemetry.trace import StatusCode

    env = make(envs, ScriptedModel(tool_then_text(name="disk")), [Tool("disk", fail)])
    assert env.say("写入").outcome == "replied"
    spans = env.spans()
    tool = one(spans, "execute_tool disk")
    assert tool.status.status_code is StatusCode.ERROR
    assert tool.status.description == "ValueError: the disk is full"
    assert tool.attributes["error.type"] == "ValueError"
    assert [(e.name, e.attributes["exception.message"]) for e in tool.events] == [
        ("exception", "ValueError: the disk is full")
    ]
    # The model got the error and answered: the turn itself did not fail.
    assert one(spans, "aalis.turn").status.status_code is StatusCode.UNSET


def test_an_unknown_tool_is_an_error_span(envs: list[Env]) -> None:
    from opentelemetry.trace import StatusCode

    env = make(envs, ScriptedModel(tool_then_text(name="nope")))
    env.say("调用")
    tool = one(env.spans(), "execute_tool nope")
    assert tool.status.status_code is StatusCode.ERROR
    assert tool.attributes["error.type"] == "_OTHER"
    assert "nope" in (tool.status.description or "")


class BrokenModel:
    """A model whose every call fails before anything streams."""

    id = "m1"
    provider_id = "demo"
    context_length = 32_000
    max_output_tokens = 4096

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        raise ConnectionError("connection refused")


def test_a_failed_model_call_is_an_error_on_the_call_and_the_turn(envs: list[Env]) -> None:
    from opentelemetry.trace import StatusCode

    env = make(envs, BrokenModel())
    assert env.say("你好").outcome == "error"
    spans = env.spans()
    turn = one(spans, "aalis.turn")
    call = one(spans, "chat m1")
    assert turn.status.status_code is StatusCode.ERROR
    assert turn.status.description == "ConnectionError"
    assert turn.attributes["aalis.turn.outcome"] == "error"
    assert turn.attributes["aalis.turn.reason"] == "ConnectionError"
    assert call.parent is not None and call.parent.span_id == turn.context.span_id
    assert call.status.status_code is StatusCode.ERROR
    assert call.attributes["aalis.call.returned"] is False
    assert call.attributes["error.type"] == "ConnectionError"
    assert call.status.description == "ConnectionError: connection refused"
    assert call.attributes["gen_ai.request.model"] == "m1"
    assert "gen_ai.usage.input_tokens" not in call.attributes


def test_a_stopped_turn(envs: list[Env]) -> None:
    from opentelemetry.trace import StatusCode

    slow = ScriptedReply(text="一" * 200, chunks=100, chunk_delay_s=0.05)
    env = make(envs, ScriptedModel([slow], model_id="m1"))
    streaming = threading.Event()
    env.runtime.subscribe("outbound:stream", lambda topic, payload: streaming.set())
    handle = env.runtime.submit(SID, Input(id="", content="讲个长故事"))
    assert streaming.wait(10)
    assert env.runtime.stop(SID) is not None
    assert handle.result(10).outcome == "aborted"
    spans = env.spans()
    turn = one(spans, "aalis.turn")
    call = one(spans, "chat m1")
    assert turn.attributes["aalis.turn.outcome"] == "aborted"
    assert turn.status.status_code is StatusCode.UNSET  # a stop is not an error
    assert call.parent is not None and call.parent.span_id == turn.context.span_id
    assert call.attributes["aalis.call.returned"] is False
    assert call.status.status_code is StatusCode.UNSET
    assert [e.name for e in call.events] == ["aalis.first_chunk"]
    assert call.end_time <= turn.end_time


def test_two_sessions_interleaved_do_not_mix(envs: list[Env]) -> None:
    def responder(request: ChatRequest, n: int) -> ScriptedReply:
        sid = request.session_id or "?"
        if request.messages[-1].role == "tool":
            return ScriptedReply(text=f"done {sid}", chunks=4, chunk_delay_s=0.02)
        return ScriptedReply(
            tool_calls=(ToolCall(id=f"call-{sid}", name="echo", arguments="{}"),),
            chunks=4,
            chunk_delay_s=0.02,
        )

    env = make(envs, ScriptedModel(responder), [Tool("echo", echo)])
    a = env.runtime.submit(SID, Input(id="", content="甲"))
    b = env.runtime.submit(OTHER, Input(id="", content="乙"))
    assert a.result(10).outcome == b.result(10).outcome == "replied"
    spans = env.spans(turns=2)
    turns = {s.attributes["aalis.session_id"]: s for s in spans if s.name == "aalis.turn"}
    assert set(turns) == {SID, OTHER}
    first, second = turns[SID], turns[OTHER]
    assert first.start_time < second.end_time and second.start_time < first.end_time  # overlap
    assert first.context.trace_id != second.context.trace_id
    for sid, turn in turns.items():
        children = [s for s in spans if s.parent and s.parent.span_id == turn.context.span_id]
        assert sorted(s.name for s in children) == [
            "chat scripted",
            "chat scripted",
            "execute_tool echo",
        ]
        for child in children:
            assert child.attributes["aalis.session_id"] == sid
            assert child.attributes["aalis.turn_id"] == turn.attributes["aalis.turn_id"]
        tool = next(s for s in children if s.name == "execute_tool echo")
        assert tool.attributes["gen_ai.tool.call.id"] == f"call-{sid}"
    assert len(spans) == 8


def test_token_request_makes_no_span(envs: list[Env]) -> None:
    env = make(envs, ScriptedModel())
    env.say("你好")
    before = len(env.spans())
    env.runtime.token_request(SID)
    time.sleep(0.05)
    assert len(env.exporter.get_finished_spans()) == before


def test_uninstrument_stops_export(envs: list[Env]) -> None:
    env = make(envs, ScriptedModel(), [Tool("echo", echo)])
    env.say("一")
    exported = len(env.spans())
    env.uninstrument()
    env.uninstrument()  # twice is harmless
    assert not env.runtime.services.bus.wants("token:usage")  # nothing left subscribed
    env.say("二")
    env.runtime.wait_idle(10)
    time.sleep(0.05)
    assert len(env.exporter.get_finished_spans()) == exported


def test_uninstrument_ends_the_spans_still_open(envs: list[Env]) -> None:
    slow = ScriptedReply(text="一" * 50, chunks=50, chunk_delay_s=0.05)
    env = make(envs, ScriptedModel([slow]))
    streaming = threading.Event()
    env.runtime.subscribe("outbound:stream", lambda topic, payload: streaming.set())
    handle = env.runtime.submit(SID, Input(id="", content="讲"))
    assert streaming.wait(10)
    env.uninstrument()
    turn = one(list(env.exporter.get_finished_spans()), "aalis.turn")
    assert turn.attributes["aalis.incomplete"] is True
    env.runtime.stop(SID)
    handle.result(10)


def test_the_module_imports_without_opentelemetry() -> None:
    name = "aalis_agent.services.otel"
    blocked = {"opentelemetry": None, "opentelemetry.trace": None}
    with mock.patch.dict(sys.modules, blocked):
        sys.modules.pop(name, None)
        otel = importlib.import_module(name)  # importing needs no opentelemetry
        with pytest.raises(ImportError, match=r"pip install aalis-agent\[otel\]"):
            otel.instrument(mock.Mock())


def test_each_call_names_the_model_it_used_when_several_are_served(envs: list[Env]) -> None:
    """With two models served, the turn span names none (the bus cannot say which a
    session uses before a call), but each call span names its own, from ``llm:call``."""
    from aalis_agent.actors.commands import set_setting
    from aalis_agent.services import LlmService, Provider

    first = ScriptedModel([ScriptedReply(text="一")], model_id="a", provider_id="p")
    second = ScriptedModel([ScriptedReply(text="二")], model_id="b", provider_id="p")
    env = make(envs, LlmService([Provider("p", [first, second])]))
    assert env.say("你好").outcome == "replied"
    set_setting(env.runtime, SID, "llm", "p/b")
    assert env.say("再来").outcome == "replied"
    spans = env.spans(turns=2)
    calls = sorted((s for s in spans if s.name.startswith("chat")), key=lambda s: s.start_time)
    assert [c.name for c in calls] == ["chat a", "chat b"]
    assert [c.attributes["aalis.model"] for c in calls] == ["p/a", "p/b"]
    for turn in (s for s in spans if s.name == "aalis.turn"):
        assert "gen_ai.request.model" not in turn.attributes
