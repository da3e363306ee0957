"""Hostile input through the whole runtime: nothing unreadable is ever written.

Wrong types are refused at ``submit`` naming the field; text with lone surrogates (half
an emoji, from a client or split across stream chunks) is cleaned where it enters; tool
results of any type are coerced or refused with an error to the model; and every event
the runtime writes decodes back equal (a property over generated inputs and results).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.runtime import MAX_INPUT_BYTES, Runtime
from aalis_agent.events import (
    ChatMessage,
    FixedClock,
    InMemoryEventStore,
    Input,
    InputReceived,
    InvalidInput,
    MessageSaved,
    ModelCallEnded,
    RuntimeClosed,
    Sender,
    SequentialIds,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnRecorded,
    decode,
    encode,
)
from aalis_agent.services import (
    AbortSignal,
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    Services,
    StreamChunk,
    Tool,
    ToolRegistry,
)
from aalis_agent.services.llm import Usage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SID = "qq:group:9"


def _runtime(llm: Any, tools: ToolRegistry | None = None) -> Runtime:
    services = Services(llm=llm, tools=tools or ToolRegistry())
    return Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = _runtime(ScriptedModel())
    yield rt
    rt.shutdown(timeout=10)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"content": None}, "Expected `str`, got `None` - at `$.content`"),
        ({"content": 123}, "Expected `str`, got `int` - at `$.content`"),
        ({"content": b"bytes"}, "Expected `str`, got `bytes` - at `$.content`"),
        ({"content": "x", "timestamp": 2**70}, "can't serialize ints"),
        ({"content": "x", "sender": "u"}, "Expected `object`, got `str` - at `$.sender`"),
        ({"content": "x", "mentions": [object()]}, "Encoding objects of type object"),
    ],
)
def test_a_wrong_type_is_refused_at_submit_naming_the_field(
    runtime: Runtime, fields: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        runtime.submit(SID, Input(id="bad", **fields))
    assert problem in str(info.value)
    assert runtime.store.read(SID) == []  # nothing was written
    # The session is unharmed: the next good input runs.
    assert runtime.submit(SID, Input(id="", content="好的")).result(10).outcome == "replied"


def _nested(depth: int) -> list[Any]:
    top: list[Any] = []
    inner = top
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return top


def test_a_value_nested_past_the_recursion_limit_is_refused_naming_its_field(
    runtime: Runtime,
) -> None:
    """It raised a bare RecursionError (from the encoder) out of submit."""
    with pytest.raises(InvalidInput, match="input 'deep': mentions is nested too deeply"):
        runtime.submit(SID, Input(id="deep", content="x", mentions=_nested(100_000)))  # type: ignore[arg-type]
    assert runtime.store.read(SID) == []
    assert runtime.submit(SID, Input(id="", content="好的")).result(10).outcome == "replied"


def test_submit_refuses_what_is_not_an_input(runtime: Runtime) -> None:
    with pytest.raises(InvalidInput, match="expected an Input, got dict"):
        runtime.submit(SID, {"content": "hi"})  # type: ignore[arg-type]


def test_a_text_over_max_input_bytes_is_refused_before_anything_is_written() -> None:
    model = ScriptedModel()
    services = Services(llm=model)
    rt = Runtime(
        InMemoryEventStore(),
        services,
        FixedClock(),
        SequentialIds(),
        janitor=False,
        max_input_bytes=300,
    )
    try:
        assert rt.run(SID, Input(id="", content="早")).outcome == "replied"
        before, calls = rt.store.read(SID), model.calls
        # UTF-8 bytes, not characters: 101 ideographs are 303 bytes
        for call, text, size in [(rt.submit, "好" * 101, 303), (rt.run, "w" * 301, 301)]:
            with pytest.raises(InvalidInput) as info:
                call(SID, Input(id="big", content=text))
            assert str(info.value) == (
                f"input 'big': its text is {size} bytes (UTF-8), over the limit of 300 "
                "bytes (Runtime max_input_bytes)"
            )
        # a new session is not even started for it
        with pytest.raises(InvalidInput, match="over the limit of 300 bytes"):
            rt.submit("other", Input(id="", content="w" * 301))
        assert rt.store.read(SID) == before and rt.store.read("other") == []
        assert model.calls == calls
        # at the limit, it is accepted
        assert rt.run(SID, Input(id="", content="好" * 100)).outcome == "replied"
        assert rt.run(SID, Input(id="", content="w" * 300)).outcome == "replied"
    finally:
        rt.shutdown(timeout=10)


def test_a_middleware_that_lengthens_an_input_past_the_limit_is_refused_too() -> None:
    hooks = Hooks()

    def longer(ctx: Any, call_next: Any) -> Any:
        ctx.message = msgspec.structs.replace(ctx.message, content=ctx.message.content * 100)
        return call_next()

    hooks.use("agent:input:before", longer)
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=ScriptedModel()),
        janitor=False,
        hooks=hooks,
        max_input_bytes=1000,
    )
    try:
        with pytest.raises(InvalidInput, match="its text is 2,000 bytes"):
            rt.submit(SID, Input(id="", content="ab" * 10))
        assert rt.store.read(SID) == []
    finally:
        rt.shutdown(timeout=10)


def test_the_other_fields_of_an_input_are_bounded_too() -> None:
    """A small text with a nickname of 100 kB, or 20,000 mentions: past 64 KiB for its
    fields besides the text as stored, refused before anything is written, naming the
    sizes; a long id is cut in the message. A nickname of 10 kB goes through."""
    from aalis_agent.events import Sender
    from aalis_agent.events.codec import OTHER_FIELDS_BYTES

    rt = Runtime(InMemoryEventStore(), Services(llm=ScriptedModel()), janitor=False)
    try:
        huge_nick = Input(id="n", content="hi", sender=Sender(user_id="u", nickname="N" * 100_000))
        many = Input(
            id="m" * 1_000, content="hi", mentions=tuple(f"u{i:08d}" for i in range(20_000))
        )
        for inp in (huge_nick, many):
            with pytest.raises(InvalidInput) as info:
                rt.submit(SID, inp)
            message = str(info.value)
            assert "bytes as stored, its text 2 of them" in message, message
            assert f"over their limit of {OTHER_FIELDS_BYTES:,} bytes" in message
            assert len(message) < 600  # the 1,000-character id is cut
        assert rt.store.read(SID) == []
        fine = Input(id="", content="hi", sender=Sender(user_id="u", nickname="N" * 10_000))
        assert rt.run(SID, fine).outcome == "replied"
    finally:
        rt.shutdown(timeout=10)


def test_the_default_limit_is_16_mib_and_none_is_no_limit() -> None:
    store = InMemoryEventStore()
    rt = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    unlimited = Runtime(store, Services(llm=ScriptedModel()), janitor=False, max_input_bytes=None)
    try:
        assert rt.max_input_bytes == MAX_INPUT_BYTES == 16 * 2**20
        with pytest.raises(InvalidInput, match=r"16,777,217 bytes .* limit of 16,777,216"):
            rt.submit(SID, Input(id="", content="w" * (MAX_INPUT_BYTES + 1)))
        # a text far longer than any context window is well within it
        text = "The quarterly report shows revenue grew, mostly overseas. " * 20_000
        assert rt.run(SID, Input(id="", content=text)).outcome == "replied"
        assert unlimited.max_input_bytes is None
        checked = unlimited.submit("s2", Input(id="", content="w" * 100))
        assert checked.result(10).outcome == "replied"
    finally:
        rt.shutdown(timeout=10)
        unlimited.shutdown(timeout=10)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1000"])
def test_max_input_bytes_must_be_a_positive_int_or_none(value: Any) -> None:
    with pytest.raises(ValueError, match="max_input_bytes must be a positive int or None"):
        Runtime(InMemoryEventStore(), janitor=False, max_input_bytes=value)


@pytest.mark.parametrize(
    ("session_id", "problem"),
    [
        (5, "session id must be a str, got int"),
        (None, "session id must be a str, got NoneType"),
        (b"s", "session id must be a str, got bytes"),
        (["s"], "session id must be a str, got list"),
        ("a\ud800b", "not valid Unicode"),
        ("", "session id must not be empty"),
    ],
)
def test_a_session_id_that_cannot_name_a_log_is_refused_before_anything_runs(
    session_id: Any, problem: str
) -> None:
    # 5 and "5" would file into one log; a lone surrogate cannot be stored. Refused at
    # once, naming it: no model call, nothing written, no session quarantined.
    model = ScriptedModel()
    rt = _runtime(model)
    try:
        for call in (rt.submit, rt.run):
            with pytest.raises(InvalidInput, match=problem):
                call(session_id, Input(id="", content="你好"))
        assert model.requests == [] and rt.store.read_all() == [] and rt.quarantined() == []
        assert rt.run("5", Input(id="", content="你好")).outcome == "replied"  # "5" is fine
    finally:
        rt.shutdown(timeout=10)


def test_lone_surrogates_in_an_input_are_cleaned_before_they_are_stored(
    runtime: Runtime,
) -> None:
    text = "split \ud83d\ude00 and half \ud83d end"
    nick = "name\udc00"
    outcome = runtime.submit(SID, Input(id="", content=text, sender=Sender(nickname=nick)))
    assert outcome.result(10).outcome == "replied"
    [received] = [e for e in runtime.store.read(SID) if isinstance(e, InputReceived)]
    assert received.input.content == "split 😀 and half \ufffd end"
    assert received.input.sender.nickname == "name\ufffd"


class SplitEmojiModel:
    """Streams an emoji as two surrogate halves in separate chunks, as a client that
    decodes JSON string escapes chunk by chunk would hand them over."""

    id = "split"
    provider_id = "test"
    context_length = 32_000
    max_output_tokens = 1024

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        yield StreamChunk(content_delta="好的 \ud83d")
        yield StreamChunk(content_delta="\ude00 再见 \udc00")
        yield StreamChunk(done=True, usage=Usage(prompt_tokens=10))


def test_a_surrogate_pair_split_across_stream_chunks_is_saved_and_sent_whole() -> None:
    rt = _runtime(SplitEmojiModel())
    sent: list[Any] = []
    rt.subscribe("outbound:message", lambda _t, p: sent.append(p["content"]))
    try:
        assert rt.submit(SID, Input(id="", content="嗨")).result(10).outcome == "replied"
        replies = [
            e.message.content
            for e in rt.store.read(SID)
            if isinstance(e, MessageSaved) and e.message.role == "assistant"
        ]
        assert replies == ["好的 😀 再见 \ufffd"] and sent == replies
    finally:
        rt.shutdown(timeout=10)


@pytest.mark.parametrize("where", ["id", "name"])
def test_a_lone_surrogate_in_a_tool_calls_id_or_name_is_cleaned_not_fatal(where: str) -> None:
    # The model's call id and tool name are stored with the tool's start: cleaned as its
    # text and arguments are, so the session goes on and the call is answered.
    call = {"id": "c1", "name": "echo", "arguments": "{}"}
    call[where] = {"id": "c\ud800", "name": "ec\udc00ho"}[where]
    ran: list[str] = []

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        if not any(m.role == "tool" for m in request.messages):
            return ScriptedReply(tool_calls=(ToolCall(**call),))
        return ScriptedReply(text="好了")

    tools = ToolRegistry([Tool("echo", lambda a, c: ran.append("echo") or "r")])
    rt = _runtime(ScriptedModel(reply), tools)
    try:
        assert rt.submit(SID, Input(id="", content="嗨")).result(10).outcome == "replied"
        [started] = [e for e in rt.store.read(SID) if isinstance(e, ToolStarted)]
        assert (started.call_id, started.name) == (
            ("c\ufffd", "echo") if where == "id" else ("c1", "ec\ufffdho")
        )
        assert ran == (["echo"] if where == "id" else [])  # no tool by the cleaned name
    finally:
        rt.shutdown(timeout=10)


def test_a_shutdown_leaves_nobody_waiting_forever() -> None:
    # A turn whose tool outlives the shutdown's wait, and an input after it: neither
    # caller waits forever. The first hears that the session stopped (its input stays in
    # the log), the second is refused at once.
    release = threading.Event()

    def stubborn(args: Any, ctx: Any) -> str:
        release.wait(10)  # does not watch the stop
        return "迟了"

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        if not any(m.role == "tool" for m in request.messages):
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="stubborn", arguments="{}"),))
        return ScriptedReply(text="好")

    rt = _runtime(ScriptedModel(reply), ToolRegistry([Tool("stubborn", stubborn)]))
    try:
        handle = rt.submit(SID, Input(id="", content="慢慢来"))
        deadline = time.monotonic() + 5
        while not any(isinstance(e, ToolStarted) for e in rt.store.read(SID)):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        rt.shutdown(timeout=0.2)  # the tool still runs: the wait runs out
        with pytest.raises(RuntimeClosed, match="stopped here"):
            handle.result(5)
        with pytest.raises(RuntimeClosed, match="shut down"):
            rt.run(SID, Input(id="", content="还在吗"))
    finally:
        release.set()


async def _async_tool(args: Any, ctx: Any) -> str:
    return "awaited"


@pytest.mark.parametrize(
    ("handler", "result", "error"),
    [
        (lambda a, c: {"温度": 21, "ok": True}, '{"温度":21,"ok":true}', None),
        (lambda a, c: [1, 2.5, None], "[1,2.5,null]", None),
        (lambda a, c: b"\xe4\xbd\xa0\xff", "你\ufffd", None),
        (lambda a, c: "half \ud83d", "half \ufffd", None),
        (lambda a, c: 2**70, "1180591620717411303424", None),
        (lambda a, c: math.nan, None, "NaN"),
        (lambda a, c: object(), None, "工具返回了 object"),
        (_async_tool, "awaited", None),  # run on the tool loop thread, not refused
    ],
)
def test_tool_results_of_any_type_are_coerced_or_refused(
    handler: Any, result: str | None, error: str | None
) -> None:
    call = ToolCall(id="c1", name="t", arguments="{}")
    model = ScriptedModel([ScriptedReply(tool_calls=(call,)), ScriptedReply(text="好")])
    rt = _runtime(model, ToolRegistry([Tool("t", handler)]))
    try:
        assert rt.submit(SID, Input(id="", content="查")).result(10).outcome == "replied"
        [finished] = [e for e in rt.store.read(SID) if isinstance(e, ToolFinished)]
        assert finished.result == result
        if error is None:
            assert finished.error is None
        else:
            assert finished.error is not None and error in finished.error
    finally:
        rt.shutdown(timeout=10)


# --- every event the runtime writes decodes back equal -------------------------------

_TEXT = st.text(alphabet=st.characters(blacklist_categories=()), max_size=40)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)
_RESULTS = _JSON | st.binary(max_size=20) | st.tuples(_TEXT, st.integers())


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    content=_TEXT,
    nickname=st.none() | _TEXT,
    arguments=_TEXT,
    result=_RESULTS,
    reply=_TEXT,
)
def test_every_event_the_runtime_writes_decodes_back_equal(
    content: str, nickname: str | None, arguments: str, result: Any, reply: str
) -> None:
    call = ToolCall(id="c1", name="t", arguments=arguments)
    model = ScriptedModel([ScriptedReply(tool_calls=(call,)), ScriptedReply(text=reply)])
    rt = _runtime(model, ToolRegistry([Tool("t", lambda a, c: result)]))
    try:
        handle = rt.submit(SID, Input(id="", content=content, sender=Sender(nickname=nickname)))
        assert handle.result(10).outcome in ("replied", "silent")
        log = rt.store.read(SID)
        assert log, "nothing was written"
        for event in log:
            assert decode(encode(event)) == event
        messages = [e.message for e in log if isinstance(e, MessageSaved)]
        assert all(isinstance(m, ChatMessage) for m in messages)
    finally:
        rt.shutdown(timeout=10)


# --- one id, sent twice ------------------------------------------------------------------


@pytest.fixture
def gated() -> Iterator[tuple[Runtime, threading.Event]]:
    """A runtime whose first model call waits for the event (set, then shut down, at the
    end)."""
    gate = threading.Event()

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        if n == 1:
            gate.wait(10)
        return ScriptedReply(text=f"答{n}")

    rt = _runtime(ScriptedModel(reply))
    yield rt, gate
    gate.set()
    rt.shutdown(timeout=10)


@pytest.mark.parametrize("source", [None, "schedule"])
def test_an_input_sent_again_while_it_waits_is_recorded_once_and_both_handles_answer(
    source: str | None,
    gated: tuple[Runtime, threading.Event],
) -> None:
    rt, gate = gated
    busy = rt.submit(SID, Input(id="busy", content="占着"))
    first = rt.submit(SID, Input(id="x", content="一", source=source))
    again = rt.submit(SID, Input(id="x", content="一", source=source))
    assert first.where == again.where == ("pending" if source is None else "queued")
    gate.set()
    assert busy.result(10).outcome == "replied"
    assert first.result(10) == again.result(10)
    assert first.result().reply == "答2"
    received = [e for e in rt.store.read(SID) if isinstance(e, InputReceived)]
    assert [e.input.id for e in received] == ["busy", "x"]


def test_an_input_sent_again_while_its_turn_runs_follows_that_turn(
    gated: tuple[Runtime, threading.Event],
) -> None:
    rt, gate = gated
    first = rt.submit(SID, Input(id="x", content="一"))
    again = rt.submit(SID, Input(id="x", content="一"))
    assert (first.where, again.where) == ("opened", "opened")
    gate.set()
    assert again.result(10) == first.result(10)
    assert first.result().outcome == "replied"
    received = [e for e in rt.store.read(SID) if isinstance(e, InputReceived)]
    assert len(received) == 1
    assert rt.view(SID).queue.queued == () and rt.view(SID).queue.pending == ()


@pytest.mark.parametrize(
    "other",
    [
        Input(id="x", content="二", sender=Sender(user_id="alice")),  # other words
        Input(id="x", content="一", sender=Sender(user_id="bob")),  # another sender
    ],
)
def test_another_input_under_a_waiting_inputs_id_is_refused_and_the_first_runs(
    other: Input,
    gated: tuple[Runtime, threading.Event],
) -> None:
    rt, gate = gated
    rt.submit(SID, Input(id="busy", content="占着"))
    first = rt.submit(SID, Input(id="x", content="一", sender=Sender(user_id="alice")))
    seq = rt.store.last_seq(SID)
    with pytest.raises(InvalidInput, match="input id 'x' is taken by another input"):
        rt.submit(SID, other)
    assert rt.store.last_seq(SID) == seq  # nothing recorded
    gate.set()
    assert first.result(10).outcome == "replied"


def test_an_id_whose_turn_is_over_sent_again_is_answered_not_run(runtime: Runtime) -> None:
    # (tests/test_resubmit.py has the rest: every way an input ends, restarts, the bound)
    one = runtime.run(SID, Input(id="x", content="一"))
    two = runtime.run(SID, Input(id="x", content="一"))
    assert one.outcome == "replied" and two == one
    assert sum(isinstance(e, InputReceived) for e in runtime.store.read(SID)) == 1


def test_the_same_input_again_is_answered_though_the_first_caller_gave_up(
    gated: tuple[Runtime, threading.Event],
) -> None:
    rt, gate = gated
    rt.submit(SID, Input(id="busy", content="占着"))
    first = rt.submit(SID, Input(id="x", content="一"))
    assert first.future.cancel()  # its caller stopped waiting (a timeout, say)
    again = rt.submit(SID, Input(id="x", content="一"))
    gate.set()
    assert again.result(10).outcome == "replied" and again.result().reply == "答2"


def test_an_input_accepted_before_a_restart_is_known_again_after_it() -> None:
    """The session's next actor (another runtime over the same log, as after a crash)
    knows the inputs its log holds as waiting: the same one sent again follows it."""
    store = InMemoryEventStore()
    gate1, gate2 = threading.Event(), threading.Event()

    def held(gate: threading.Event) -> Any:
        def reply(request: ChatRequest, n: int) -> ScriptedReply:
            gate.wait(10)
            return ScriptedReply(text=f"答{n}")

        return ScriptedModel(reply)

    first = Runtime(store, Services(llm=held(gate1)), FixedClock(), SequentialIds(), janitor=False)
    second = Runtime(store, Services(llm=held(gate2)), FixedClock(), SequentialIds(), janitor=False)
    try:
        first.submit(SID, Input(id="busy", content="占着"))
        first.submit(SID, Input(id="x", content="一"))  # waits behind the running turn
        # "first" is gone (it will never write again); "second" takes the log over.
        assert second.recover() == [SID]
        again = second.submit(SID, Input(id="x", content="一"))
        gate2.set()
        assert again.result(10).outcome == "replied"
        received = [e for e in store.read(SID) if isinstance(e, InputReceived)]
        assert [e.input.id for e in received] == ["busy", "x"]
    finally:
        gate2.set()
        second.shutdown(timeout=10)
        gate1.set()
        first.shutdown(timeout=10)


def test_a_reply_past_what_the_output_limit_can_hold_is_cut_there() -> None:
    """A model (a broken or hostile endpoint) streaming far more than its
    max_output_tokens can hold: the stream is read no further than 128 characters a token,
    the reply saved is cut there, the call marked cut; tool-call arguments past it are
    refused as too long, and the tool does not run."""
    from aalis_agent.actors.turn_base import REPLY_CHARS_PER_TOKEN, reply_limit
    from aalis_agent.events import MessageSaved, ToolCall
    from aalis_agent.services import ScriptedReply, Tool, ToolRegistry

    ran: list[object] = []
    huge = ScriptedReply(text="长" * 300_000, chunks=300)  # 300 chunks of 1,000
    calls = [
        ScriptedReply(
            tool_calls=(ToolCall(id="c1", name="t", arguments='{"a":"' + "x" * 70_000 + '"}'),)
        ),
        ScriptedReply(text="好的"),
    ]
    model = ScriptedModel([huge, *calls], max_output_tokens=500)
    services = Services(
        llm=model, tools=ToolRegistry([Tool("t", lambda a, c: ran.append(a) or "ok")])
    )
    rt = Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)
    limit = 500 * REPLY_CHARS_PER_TOKEN
    try:
        assert reply_limit(model) == limit == 64_000
        assert rt.run(SID, Input(id="", content="说")).outcome == "replied"
        replies = [
            e.message.content
            for e in rt.store.read(SID)
            if isinstance(e, MessageSaved) and e.message.role == "assistant"
        ]
        assert replies == ["长" * limit]
        assert rt.run(SID, Input(id="", content="再说")).outcome == "replied"
        assert ran == []  # its arguments were refused: the tool never ran
        results = [
            e.message.content
            for e in rt.store.read(SID)
            if isinstance(e, MessageSaved) and e.message.role == "tool"
        ]
        assert len(results) == 1 and "64000" in results[0].replace(",", ""), results
        stored = [
            c.arguments
            for e in rt.store.read(SID)
            if isinstance(e, MessageSaved)
            for c in e.message.tool_calls
        ]
        assert stored == ["{}"]
    finally:
        rt.shutdown(timeout=10)


class _Unprintable(Exception):
    """An exception whose ``str()`` itself fails (a library's, with a broken message)."""

    def __str__(self) -> str:
        raise RuntimeError("its message cannot be built")


class _LibraryExit(BaseException):
    """Stands in for a library's own BaseException (gevent's GreenletExit, say)."""


class FailingModel:
    """Streams a word, then raises ``exc`` (once; the next call answers)."""

    id = "failing"
    provider_id = "test"
    context_length = 32_000
    max_output_tokens = 1024

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.calls = 0

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        self.calls += 1
        yield StreamChunk(content_delta="好")
        if self.calls == 1:
            raise self.exc
        yield StreamChunk(done=True)


@pytest.mark.parametrize(
    ("exc", "named", "error"),
    [
        (asyncio.CancelledError(), "CancelledError", "CancelledError"),
        (GeneratorExit(), "GeneratorExit", "GeneratorExit"),
        (_LibraryExit("greenlet killed"), "_LibraryExit", "greenlet killed"),
        (_Unprintable(), "_Unprintable", "_Unprintable: <exception str() failed>"),
    ],
    ids=["CancelledError", "GeneratorExit", "library", "unprintable"],
)
def test_a_model_raising_any_exception_fails_the_turn_with_its_name_and_a_notice(
    exc: BaseException, named: str, error: str
) -> None:
    """A model raising a BaseException that is not an interrupt or an exit (an
    ``asyncio.CancelledError`` from a client built on asyncio, ``GeneratorExit``) ended
    its turn ``error`` with no reason, its model call never ended in the log and the user
    was sent no notice; one whose message could not be built was recorded as the
    ``RuntimeError`` of building it. Each is now the turn's failure, as any exception."""
    rt = _runtime(FailingModel(exc))
    sent: list[Any] = []
    rt.subscribe("outbound:message", lambda _t, p: sent.append((p["kind"], p["content"])))
    try:
        outcome = rt.submit(SID, Input(id="", content="嗨")).result(10)
        assert (outcome.outcome, outcome.reason) == ("error", named)
        events = rt.store.read(SID)
        [ended] = [e for e in events if isinstance(e, ModelCallEnded)]
        assert ended.status == "error" and ended.error == error
        [record] = [e for e in events if isinstance(e, TurnRecorded)]
        assert (record.outcome, record.reason) == ("error", named)
        assert [kind for kind, _ in sent] == ["error"] and named in sent[0][1]
        # The session goes on.
        assert rt.submit(SID, Input(id="", content="还在吗")).result(10).outcome == "replied"
    finally:
        rt.shutdown(timeout=10)
