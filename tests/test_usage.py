"""token:usage (ACC1-ACC2) and the throttled budget log (ACC4)."""

from __future__ import annotations

from typing import Any

import msgspec
import pykka
import pytest
from aalis_agent.actors.budget import BudgetLog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.actors.turn import ReplyBefore
from aalis_agent.events import (
    ChatMessage,
    FixedClock,
    InMemoryEventStore,
    Input,
    MessageMeta,
    SequentialIds,
    TokenBreakdown,
    UsageRecorded,
)
from aalis_agent.request.usage import PART_LABELS, bucket, budget_line, usage_payload
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Usage


def payload(used: float | None, estimate: int = 900, window: int = 32000) -> Any:
    parts = TokenBreakdown(
        system=600,
        persona=2300,
        memory_summary=1000,
        memory_vector=800,
        skills=900,
        system_other=500,
        history=8901,
        tool_results=5400,
        tool_defs=2703,
        reserved_for_reply=4096,
    )
    return usage_payload(
        session_id="s1",
        turn_id="t1",
        platform="qq",
        context_window=window,
        max_tokens=4096,
        token_budget=27392,
        provider_input_tokens=used,
        estimate=estimate,
        trimmed=False,
        untrimmed_history=100,
        history_messages=7,
        parts=parts,
    )


@pytest.mark.parametrize(
    ("provider", "used"),
    [(23104, 23104), (None, 900), (0, 900), (-5, 900), (float("inf"), 900), (float("nan"), 900)],
)
def test_used_is_the_provider_count_when_positive_and_finite(
    provider: Any, used: int
) -> None:  # ACC2
    assert payload(provider).used == used


def test_parts_have_the_source_labels_in_order() -> None:  # ACC2
    usage = payload(23104)
    assert tuple(p.label for p in usage.parts) == PART_LABELS
    assert usage.parts[0].tokens == 8901 and usage.parts[2].tokens == 2703
    wire = __import__("msgspec").to_builtins(usage)
    assert {
        "sessionId",
        "turnId",
        "contextWindow",
        "tokenBudget",
        "usageRatio",
        "untrimmedHistory",
        "historyMessages",
    } <= wire.keys()
    assert {"memorySummary", "memoryVector", "systemOther", "toolDefs", "reservedForReply"} <= wire[
        "breakdown"
    ].keys()


def test_budget_line_matches_the_sample_format() -> None:  # ACC4
    line = budget_line(payload(23104))
    assert line == (
        "[token-usage:WARN] s1 23104/32000 (72.2%) sys=6100(persona=2300 mem=1800 "
        "skills=900 subtask=0 other=1100) hist=8901 tools=5400+2703def reserve=4096"
    )


@pytest.mark.parametrize(
    ("ratio", "label"),
    [(0.1, "OK"), (0.5, "INFO"), (0.69, "INFO"), (0.7, "WARN"), (0.85, "CRITICAL")],
)
def test_buckets(ratio: float, label: str) -> None:  # ACC4
    assert bucket(ratio)[1] == label


def test_budget_log_prints_on_bucket_change_and_every_tenth() -> None:  # ACC4
    log = BudgetLog()
    low, high = payload(1000), payload(30000)
    printed = [log.observe(low) is not None for _ in range(12)]
    assert printed == [True] + [False] * 8 + [True] + [False] * 2  # first time, then the 10th
    assert log.observe(high) is not None  # a change
    assert log.observe(low) is not None  # falling back is a change too
    other = BudgetLog()
    assert other.observe(payload(1000)) is not None  # per session, first time included


def test_budget_log_counts_unseen_lines_and_forgets_the_least_recent_sessions() -> None:
    # ACC4's throttle moves on when its line would not be seen (nothing is built then).
    log = BudgetLog()
    assert log.observe(payload(1000), line=False) is None  # the first time, not built
    assert [log.observe(payload(1000)) for _ in range(8)] == [None] * 8
    assert log.observe(payload(1000)) is not None  # the 10th usage
    # Bounded: the least recently seen session is let go and starts over as a first time.
    bounded = BudgetLog(max_sessions=2)
    a, b, c = (msgspec.structs.replace(payload(1000), session_id=s) for s in "abc")
    assert all(bounded.observe(u) is not None for u in (a, b))
    assert bounded.observe(a) is None  # a is now the most recent; b the least
    assert bounded.observe(c) is not None and len(bounded) == 2  # b let go
    assert bounded.observe(a) is None  # a kept its state
    assert bounded.observe(b) is not None  # b starts over
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_sessions"):
            BudgetLog(max_sessions=bad)


def test_usage_after_every_call_including_format_retries() -> None:  # FLOW11, ACC1, ACC2
    model = ScriptedModel(
        [ScriptedReply(text="第一次", usage=Usage(prompt_tokens=321)), ScriptedReply(text="第二次")]
    )
    runtime = Runtime(
        InMemoryEventStore(), Services(llm=model), FixedClock(), SequentialIds(), janitor=False
    )
    seen: list[Any] = []
    runtime.subscribe("token:usage", lambda topic, p: seen.append(p))

    def retry_once(ctx: ReplyBefore, next_: Any) -> Any:
        ctx.retry_requested = ctx.attempt == 0
        return next_()

    runtime.hooks.use("agent:reply:before", retry_once)
    try:
        runtime.submit("s", Input(id="", content="你好")).result(10)
        runtime.wait_idle(10)
        assert seen[0]["used"] == 321
        assert len(seen) == 2 and seen[1]["used"] > 0  # the retry's estimate
        assert {p["turnId"] for p in seen} == {"turn-1"}
        logged = [e for e in runtime.store.read("s") if isinstance(e, UsageRecorded)]
        assert [e.usage.used for e in logged] == [p["used"] for p in seen]
        assert [(r.session_id, r.purpose) for r in model.requests] == [("s", "对话")] * 2
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_no_usage_when_the_call_throws() -> None:  # FLOW11
    class Failing(ScriptedModel):
        def chat_stream(self, request: Any, abort: Any) -> Any:
            raise ConnectionError("provider down")

    runtime = Runtime(
        InMemoryEventStore(), Services(llm=Failing()), FixedClock(), SequentialIds(), janitor=False
    )
    seen: list[Any] = []
    runtime.subscribe("token:usage", lambda topic, p: seen.append(p))
    try:
        outcome = runtime.submit("s", Input(id="", content="你好")).result(10)
        assert outcome.outcome == "error"
        assert seen == []
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_trimmed_untrimmed_history_and_the_hard_trim_log() -> None:  # ACC2
    from structlog.testing import capture_logs

    model = ScriptedModel(
        lambda request, n: ScriptedReply(text="答" * 300),
        context_length=2048 + 1024 + 512,
        max_output_tokens=1024,
    )
    runtime = Runtime(
        InMemoryEventStore(), Services(llm=model), FixedClock(), SequentialIds(), janitor=False
    )
    seen: list[Any] = []
    runtime.subscribe("token:usage", lambda topic, p: seen.append(p))
    try:
        with capture_logs() as logs:
            for i in range(8):
                runtime.submit("s", Input(id="", content=f"问题{i}" + "细节" * 150)).result(10)
            runtime.wait_idle(10)
        first, last = seen[0], seen[-1]
        assert first["trimmed"] is False  # a short conversation fits: no hard trim
        assert last["trimmed"] is True
        # untrimmedHistory counts what the history would have cost before trimming
        assert last["untrimmedHistory"] > last["breakdown"]["history"]
        # historyMessages: the whole active history, the part beyond the cut included
        assert last["historyMessages"] == 14
        trims = [e for e in logs if e["event"] == "hard trim removed messages"]
        assert trims and trims[-1]["session"] == "s" and trims[-1]["after"] < trims[-1]["before"]
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def _trim_parts() -> tuple[list[ChatMessage], list[ChatMessage], list[ChatMessage]]:
    from aalis_agent.events import ToolCall

    call = ToolCall(id="c1", name="echo", arguments='{"q": "天气"}')
    head = [
        ChatMessage(id="system", role="system", content="你是助手。" * 20),
        ChatMessage(
            id="b1", role="system", content="记忆摘要", meta=MessageMeta(injector="memory/summary")
        ),
        ChatMessage(id="b2", role="system", content="别的", meta=MessageMeta(injector="x/y")),
    ]
    history = [
        ChatMessage(id=f"h{i}", role="user" if i % 2 else "assistant", content=f"历史 {i} " * 30)
        for i in range(20)
    ]
    turn = [
        ChatMessage(id="u", role="user", content="(12/4 21:19) 明天上海的天气?"),
        ChatMessage(id="a", role="assistant", content="", tool_calls=(call,)),
        ChatMessage(id="t", role="tool", content="多云" * 50, tool_call_id="c1", name="echo"),
    ]
    return head, history, turn


@pytest.mark.parametrize("budget", [1_000_000, 400, 60])
def test_usage_split_from_the_trims_counts_equals_a_recount(budget: int) -> None:  # ACC2
    """The parts of ``token:usage`` are split from the counts the trim made when it left
    the head and turn as they came (nothing cut, or only history); the same as counting
    them again; counted again when the trim changed them (a budget too tight for them)."""
    from aalis_agent.request.tokens import default_counter, message_tokens
    from aalis_agent.request.trim import TrimRequest, trim
    from aalis_agent.request.usage import breakdown

    counter = default_counter()
    head, history, turn = _trim_parts()
    result = trim(TrimRequest(head=head, history=history, turn=turn, budget=budget), counter)
    if budget == 60:  # steps 2 and on changed the head or the turn: counted again
        assert max(result.steps) > 1 and result.head_counts is None and result.turn_counts is None
    else:  # nothing cut (1M), or only history (step 1): head and turn as they came
        assert result.steps == [1] and (result.history_dropped > 0) == (budget == 400)
        assert result.head_counts == [message_tokens(counter, m) for m in result.head]
        assert result.turn_counts == [message_tokens(counter, m) for m in result.turn]
    sent = [*result.head, *result.turn]
    args: dict[str, Any] = {
        "history_ids": frozenset(),
        "persona_tokens": 7,
        "tool_defs_tokens": 11,
        "reserved": 100,
        "history_tokens": result.history_tokens,
    }
    recount = breakdown(counter, sent, **args)
    if result.head_counts is not None and result.turn_counts is not None:
        counts = [*result.head_counts, *result.turn_counts]
        assert breakdown(counter, sent, counts=counts, **args) == recount
    assert recount.tool_results == message_tokens(counter, turn[2])
    # ACC2's untrimmed history: all of it and the turn's tool results, before any cut.
    whole = sum(message_tokens(counter, m) for m in history)
    assert result.untrimmed_history == whole + message_tokens(counter, turn[2])
