"""A request's preparation does not copy the history more than it must: the list is
assembled in one pass, the trim is told where the history is (unless a hook saw the
list), and an untrimmed request is sent as assembled. What is sent and what is counted
stay exactly what the slower path gives."""

from __future__ import annotations

from typing import Any

import pykka
from aalis_agent.actors.hooks import LlmBefore
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, SequentialIds
from aalis_agent.events.schema import ChatMessage
from aalis_agent.request.prompt import Block, TurnPrompt, assemble, assemble_at, split_parts
from aalis_agent.request.tokens import EstimateCounter
from aalis_agent.request.trim import TrimRequest, trim
from aalis_agent.services import ScriptedModel, Services

COUNTER = EstimateCounter()


def _history(n: int) -> tuple[ChatMessage, ...]:
    return tuple(
        ChatMessage(id=f"h{i}", role="user" if i % 2 == 0 else "assistant", content=f"第{i}条")
        for i in range(n)
    )


def _prompt(history: tuple[ChatMessage, ...]) -> TurnPrompt:
    return TurnPrompt(
        system="系统",
        history=history,
        blocks=[Block("knowledge", "mem/k", "记忆"), Block("turn-context", "p/ctx", "上下文")],
        volatile="现在",
        inputs=[ChatMessage(id="in", role="user", content="你好")],
        tail=[ChatMessage(id="t", role="assistant", content="稍等")],
    )


def test_assemble_at_is_assemble_and_says_where_the_history_starts() -> None:
    history = _history(6)
    prompt = _prompt(history)
    messages, at = assemble_at(prompt)
    assert isinstance(messages, tuple)  # what the request carries: no copy to make
    assert list(messages) == assemble(prompt)
    assert messages[at : at + len(history)] == history
    assert [m.id for m in messages[:at]] == ["system", "block:mem/k:0"]


def test_split_parts_told_where_the_history_is_splits_as_it_would_unaided() -> None:
    history = _history(6)
    messages, at = assemble_at(_prompt(history))
    ids = {m.id for m in history}
    head, hist, turn = split_parts(messages, ids, history, at=at)
    assert hist is history  # the prepared history itself: not walked, not copied
    unaided = split_parts(messages, ids, history)
    assert (head, list(hist), turn) == (unaided[0], list(unaided[1]), unaided[2])
    assert (*head, *hist, *turn) == messages


def test_an_untrimmed_request_is_the_assembled_list_itself() -> None:
    history = _history(6)
    messages, at = assemble_at(_prompt(history))
    head, hist, turn = split_parts(messages, {m.id for m in history}, history, at=at)
    roomy = trim(
        TrimRequest(head=head, history=hist, turn=turn, budget=100_000, whole=messages), COUNTER
    )
    assert roomy.messages is messages and roomy.steps == [1] and not roomy.trace
    # Dropping history builds a new list and leaves the assembled one as it was.
    tight = trim(
        TrimRequest(head=head, history=hist, turn=turn, budget=60, whole=messages), COUNTER
    )
    assert tight.history_dropped > 0
    assert tight.messages is not messages
    kept = list(history[tight.history_dropped :])
    assert tight.messages[len(tight.head) : len(tight.head) + len(kept)] == kept


def _usage_of_second_turn(hook: Any | None) -> tuple[dict[str, Any], list[str]]:
    model = ScriptedModel(keep_requests=10)
    runtime = Runtime(
        InMemoryEventStore(), Services(llm=model), FixedClock(), SequentialIds(), janitor=False
    )
    seen: list[dict[str, Any]] = []
    runtime.subscribe("token:usage", lambda topic, p: seen.append(p))
    try:
        runtime.submit("s", Input(id="", content="第一句")).result(10)
        runtime.wait_idle(10)
        if hook is not None:
            runtime.hooks.use("agent:llm:before", hook)
        runtime.submit("s", Input(id="", content="第二句")).result(10)
        runtime.wait_idle(10)
        return seen[-1], [m.content for m in model.requests[-1].messages]
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_a_hook_that_moves_the_history_is_split_by_looking() -> None:
    """With a middleware on ``agent:llm:before`` the trim cannot know where the history
    is in the list: it looks, so what is counted as history is still the history."""

    def insert_at_head(ctx: LlmBefore, next_: Any) -> Any:
        ctx.messages.insert(1, ChatMessage(id="x", role="system", content="插入的系统提示"))
        return next_()

    plain, plain_sent = _usage_of_second_turn(None)
    hooked, hooked_sent = _usage_of_second_turn(insert_at_head)
    assert hooked_sent == [plain_sent[0], "插入的系统提示", *plain_sent[1:]]
    assert hooked["breakdown"]["history"] == plain["breakdown"]["history"] > 0
    assert hooked["breakdown"]["systemOther"] > plain["breakdown"]["systemOther"]
