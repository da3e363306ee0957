"""Values a caller, a model, a tool or a middleware may hand the runtime that the log
cannot hold as given: each is refused up front with an error naming it, or stored as
plain data; none stops the session or loses what was accepted before it.

- ``clear`` with a bare string for its kinds (``"context"`` for ``("context",)``) used to
  be read as a substring test, stop the running turn and then hang, or fence the session.
- A usage count past 64 bits from a provider used to fail every turn's commit.
- A ``str`` subclass (a markup string) as a session id, a tool's result, a model's tool
  call or a reply middleware's text used to stop the session at the write.
- A tool's metadata the log's JSON readers cannot print is dropped, as documented.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import MessageSaved, ToolFinished, UsageRecorded
from aalis_agent.services import ChatRequest, StreamChunk, Usage

from aalis_agent import (
    Input,
    InvalidInput,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    SqliteEventStore,
    Tool,
    ToolCall,
    ToolRegistry,
)


class Markup(str):
    """Stands in for markupsafe's ``Markup``: a str subclass the log cannot encode."""


def _runtime(
    tmp_path: Path, replies: Any, tools: list[Tool] | None = None
) -> tuple[Runtime, SqliteEventStore]:
    store = SqliteEventStore(tmp_path / "log.db")
    services = Services(
        llm=replies if hasattr(replies, "chat_stream") else ScriptedModel(replies),
        tools=ToolRegistry(tools or []),
    )
    return Runtime(store, services, janitor=False), store


@pytest.mark.parametrize("kinds", ["context", "memory", None, 5, ("context", 5), ("",)])
def test_clear_with_kinds_that_are_not_a_tuple_of_names_is_refused_before_anything_stops(
    tmp_path: Path, kinds: Any
) -> None:
    release = threading.Event()
    started = threading.Event()

    def slow(args: Any, ctx: Any) -> str:
        started.set()
        release.wait(10)
        return "done"

    replies = [
        ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),)),
        ScriptedReply(text="好的"),
    ]
    runtime, store = _runtime(tmp_path, replies, [Tool("slow", slow)])
    try:
        handle = runtime.submit("s", Input(id="", content="你好"))
        assert started.wait(10)
        with pytest.raises(InvalidInput, match="clear"):
            runtime.clear("s", kinds, timeout=5)
        release.set()
        assert handle.result(10).outcome == "replied"  # the running turn went on
        runtime.clear("s", ["context"], timeout=5)  # a list of names is fine
        assert runtime.run("s", Input(id="", content="再来")).outcome == "replied"
    finally:
        release.set()
        runtime.shutdown(timeout=10)
        store.close()


class _HugeUsage:
    """A model whose provider reports a prompt count past 64 bits (and a negative one)."""

    id = "huge"
    provider_id = "test"
    context_length = 100_000
    max_output_tokens = 1_000

    def chat_stream(self, request: ChatRequest, abort: Any) -> Any:
        yield StreamChunk(content_delta="好的")
        yield StreamChunk(usage=Usage(prompt_tokens=10**23, completion_tokens=-3, total_tokens=7))


def test_a_usage_count_the_log_cannot_hold_is_dropped_and_the_turn_replies(
    tmp_path: Path,
) -> None:
    runtime, store = _runtime(tmp_path, _HugeUsage())
    try:
        for text in ("一", "二"):
            assert runtime.run("s", Input(id="", content=text)).outcome == "replied"
        usages = [e.usage for e in store.read("s") if isinstance(e, UsageRecorded)]
        assert len(usages) == 2
        # The provider's count is dropped: ``used`` is the runtime's own estimate.
        assert all(0 < u.used < 10_000 for u in usages)
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_usage_sane_keeps_good_counts_and_drops_the_rest() -> None:
    good = Usage(prompt_tokens=5, completion_tokens=0, total_tokens=None)
    assert good.sane() is good
    bad = Usage(prompt_tokens=2**70, completion_tokens=-1, total_tokens=3, cached_prompt_tokens=1)
    assert bad.sane() == Usage(total_tokens=3, cached_prompt_tokens=1)


def test_a_str_subclass_as_session_id_is_the_same_session_as_its_plain_text(
    tmp_path: Path,
) -> None:
    runtime, store = _runtime(tmp_path, lambda request, n: ScriptedReply(text=f"好{n}"))
    try:
        assert runtime.run(Markup("room-1"), Input(id="", content="一")).outcome == "replied"
        assert runtime.run("room-1", Input(id="", content="二")).outcome == "replied"
        assert not runtime.quarantined()
        saved = [e.message.content for e in store.read("room-1") if isinstance(e, MessageSaved)]
        assert len(saved) == 4 and all(type(c) is str for c in saved)
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_str_subclasses_from_a_tool_a_model_and_a_reply_middleware_are_stored_as_text(
    tmp_path: Path,
) -> None:
    replies = [
        ScriptedReply(
            tool_calls=(ToolCall(id=Markup("c1"), name=Markup("t"), arguments=Markup("{}")),)
        ),
        ScriptedReply(text="好的"),
    ]
    runtime, store = _runtime(tmp_path, replies, [Tool("t", lambda args, ctx: Markup("<b>x</b>"))])

    def markup(ctx: Any, next_: Any) -> Any:
        ctx.content = Markup(ctx.content + "\ud800")  # a lone surrogate too
        ctx.archive_content = Markup("archived")
        return next_()

    runtime.hooks.use("agent:reply:before", markup)
    try:
        outcome = runtime.run("s", Input(id="", content="你好"))
        assert outcome.outcome == "replied"
        assert outcome.reply == "好的\ufffd"
        events = store.read("s")
        results = [e.result for e in events if isinstance(e, ToolFinished)]
        assert results == ["<b>x</b>"]
        reply = [e.message for e in events if isinstance(e, MessageSaved)][-1]
        assert reply.content == "archived" and reply.meta.visible_content == "好的\ufffd"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_a_reply_middleware_leaving_content_that_is_not_text_fails_the_turn_only(
    tmp_path: Path,
) -> None:
    runtime, store = _runtime(tmp_path, lambda request, n: ScriptedReply(text="好的"))

    def broken(ctx: Any, next_: Any) -> Any:
        if ctx.session_id == "bad":
            ctx.content = 42
        return next_()

    runtime.hooks.use("agent:reply:before", broken)
    try:
        assert runtime.run("bad", Input(id="", content="一")).outcome == "error"
        assert runtime.run("good", Input(id="", content="二")).outcome == "replied"
        assert runtime.run("bad", Input(id="", content="三")).outcome == "error"  # not fenced
    finally:
        runtime.shutdown(timeout=10)
        store.close()


class _Opaque:
    pass


@pytest.mark.parametrize("value", [_Opaque(), Markup("x"), {(1, 2): "tuple key"}])
def test_tool_metadata_the_logs_readers_cannot_print_is_dropped_and_the_turn_goes_on(
    tmp_path: Path, value: Any
) -> None:
    replies = [
        ScriptedReply(tool_calls=(ToolCall(id="c1", name="t", arguments="{}"),)),
        ScriptedReply(text="好的"),
    ]

    runtime, store = _runtime(tmp_path, replies, [Tool("t", lambda args, ctx: "ok")])

    def annotate(ctx: Any, next_: Any) -> Any:
        ctx.metadata["kept?"] = value
        return next_()

    runtime.hooks.use("agent:tool:after", annotate)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        finished = [e for e in store.read("s") if isinstance(e, ToolFinished)]
        assert [(e.result, e.metadata) for e in finished] == [("ok", {})]
    finally:
        runtime.shutdown(timeout=10)
        store.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda rt: rt.view(5),
        lambda rt: rt.view(""),
        lambda rt: rt.view("a\ud800"),
        lambda rt: rt.token_request(5),
        lambda rt: rt.token_request("s", platform=5),
        lambda rt: rt.fields(None),
        lambda rt: rt.stop_command("s", 5, 6),
        lambda rt: rt.stop_all("s", platform=5),
        lambda rt: rt.assign_model("s", 5),
        lambda rt: rt.subscribe("turn:ended", None),
        lambda rt: rt.subscribe(None, lambda topic, payload: None),
    ],
)
def test_runtime_calls_with_arguments_of_the_wrong_kind_are_refused_by_name(
    tmp_path: Path, call: Any
) -> None:
    runtime, store = _runtime(tmp_path, lambda request, n: ScriptedReply(text="好"))
    try:
        assert runtime.run("s", Input(id="", content="一")).outcome == "replied"
        with pytest.raises(InvalidInput):
            call(runtime)
        assert not runtime.quarantined()
        assert runtime.run("s", Input(id="", content="二")).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        store.close()
