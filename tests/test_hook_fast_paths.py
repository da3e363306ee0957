"""A hook with no middleware is skipped with its payload (``agent:turn:before``,
``agent:reply:before``, ``agent:tool:after``, ``agent:turn:after``): a turn then does
exactly what running the chain's default on the payload as built did. A middleware
that only calls ``next()`` stands for that chain: the log, the replies and the tool's
context come out the same with it as without it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, SequentialIds, ToolCall
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

_SKIPPED = ("agent:turn:before", "agent:reply:before", "agent:tool:after", "agent:turn:after")


def _run(hooked: tuple[str, ...], step: int = 0) -> tuple[list[bytes], list[Any], list[str]]:
    """Three tool turns (a tool that answers, one that fails, an empty reply) with a
    pass-through middleware on each hook of ``hooked``: the log's bytes, the outcomes
    and the tools' contexts."""

    def reply(request: Any, n: int) -> ScriptedReply:
        if n in (1, 3):
            name = "echo" if n == 1 else "boom"
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name=name, arguments="{}"),))
        return ScriptedReply(text="" if n == 6 else f"{n}: 好")

    contexts: list[str] = []

    def echo(args: Any, ctx: Any) -> str:
        contexts.append(repr((ctx.session_id, ctx.turn_id, ctx.participants, ctx.user_id)))
        return "好"

    def boom(args: Any, ctx: Any) -> str:
        raise ValueError("boom")

    hooks = Hooks()
    for key in hooked:
        hooks.use(key, lambda ctx, next_: next_())
    store = InMemoryEventStore()
    services = Services(
        llm=ScriptedModel(reply),
        tools=ToolRegistry([Tool("echo", echo), Tool("boom", boom)]),
    )
    runtime = Runtime(
        store, services, FixedClock(step_ms=step), SequentialIds(), janitor=False, hooks=hooks
    )
    try:
        outcomes = [runtime.run("s", Input(id="", content=f"{n}: 你好")) for n in range(4)]
    finally:
        runtime.shutdown(timeout=10)
    return [msgspec.msgpack.encode(e) for e in store.read("s")], outcomes, contexts


@pytest.mark.parametrize(
    ("key", "step"),
    [
        *((key, 0) for key in _SKIPPED),
        # These two leave the turn's commits as they are, so each event reads the clock
        # where it did: a clock that moves at each read gives the same log too. (With a
        # middleware on agent:turn:before the first call's start is committed at its
        # insertion point, and on agent:turn:after the reply is committed before the
        # hook runs: more commits, the same events.)
        ("agent:reply:before", 7),
        ("agent:tool:after", 7),
    ],
)
def test_a_pass_through_middleware_changes_nothing_a_turn_writes_or_answers(
    key: str, step: int
) -> None:
    plain = _run((), step)
    hooked = _run((key,), step)
    assert [o.outcome for o in plain[1]] == ["replied", "replied", "replied", "silent"]
    assert plain[2], "the tool ran"
    assert hooked == plain
