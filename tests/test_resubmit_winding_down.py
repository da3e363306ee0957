"""An input sent again while its session winds down a deletion or a ``/clear`` (DEL1) does
not go through the input hooks again: they ran for it when it was first sent.

The wind-down releases what waits (the inputs are archived, released with reason
``delete`` or ``clear``) and lasts until the running turn has settled; inputs that
arrive meanwhile are held back and handed on once it is done. A retry of an input the
session received (a caller whose submit timed out, a gateway delivering twice) that
arrives in that window is held back as the retry it is: once the wind-down is done it is
answered with how the input ended, and a counting, de-duplicating or rewriting
middleware sees it once. A retry of an input that was itself held back (its first send
has not reached the log yet) follows that input.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from aalis_agent.actors.aio import AsyncRuntime
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.runtime import InputBefore, Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, SequentialIds
from aalis_agent.services import ScriptedModel, ScriptedReply, Services

SID = "qq:private:7"


class Held:
    """An ``agent:turn:after`` middleware that holds the turn of the input ``busy`` past
    its reply (so a deletion's wind-down lasts until ``go`` is set)."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()

    def middleware(self, ctx: Any, next_: Any) -> Any:
        result = next_()
        self.inside.set()
        assert self.go.wait(10)
        return result


class Counting:
    """An ``agent:input:before`` middleware recording the ids it sees; with ``stamp``,
    it rewrites each input's text with a number counted up (never the same twice)."""

    def __init__(self, stamp: bool = False) -> None:
        self.ids: list[str] = []
        self.stamp = stamp

    def __call__(self, ctx: InputBefore, next_: Any) -> Any:
        self.ids.append(ctx.message.id)
        if self.stamp:
            msg = ctx.message
            ctx.message = msgspec.structs.replace(msg, content=f"[{len(self.ids)}] {msg.content}")
        return next_()


@pytest.fixture
def held() -> Iterator[Held]:
    h = Held()
    yield h
    h.go.set()


def _runtime(held: Held, counting: Counting) -> Runtime:
    hooks = Hooks()
    hooks.use("agent:input:before", counting)
    hooks.use("agent:turn:after", held.middleware)
    model = ScriptedModel(lambda request, n: ScriptedReply(text=f"答{n}"))
    return Runtime(
        InMemoryEventStore(),
        Services(llm=model),
        FixedClock(),
        SequentialIds(),
        hooks=hooks,
        janitor=False,
    )


def _deferred(runtime: Runtime) -> list[Any]:
    """The submits the session holds back until its wind-down is done."""
    return list(runtime._entries[SID].actor._deferred)


def _send_held_back(runtime: Runtime, inp: Input) -> tuple[threading.Thread, list[Any]]:
    """Submit ``inp`` from another thread, and return once the session holds it back
    (before a fix, it went through the hooks first) or the submit returned: the thread,
    and the list its handle is put in."""
    handles: list[Any] = []
    sending = threading.Thread(target=lambda: handles.append(runtime.submit(SID, inp)))
    sending.start()
    while not _deferred(runtime) and sending.is_alive():
        time.sleep(0.005)
    return sending, handles


def _winding_down(runtime: Runtime, held: Held, kind: str) -> threading.Thread:
    """A turn held past its reply, ``x`` waiting behind it, then a deletion (or clear)
    started on another thread: it releases ``x`` and waits for the turn."""
    runtime.submit(SID, Input(id="busy", content="占着"))
    assert held.inside.wait(10)
    waiting = runtime.submit(SID, Input(id="x", content="你好"))
    assert waiting.where == "queued"
    if kind == "delete":
        target: Any = lambda: runtime.delete(SID, timeout=10)  # noqa: E731
    else:
        target = lambda: runtime.clear(SID, timeout=10)  # noqa: E731
    thread = threading.Thread(target=target)
    thread.start()
    outcome = waiting.result(10)
    assert (outcome.outcome, outcome.reason) == ("released", kind)
    return thread


@pytest.mark.parametrize("kind", ["delete", "clear"])
@pytest.mark.parametrize("stamp", [False, True])
def test_a_released_input_sent_again_during_the_wind_down_skips_the_hooks(
    held: Held, kind: str, stamp: bool
) -> None:
    counting = Counting(stamp)
    runtime = _runtime(held, counting)
    try:
        thread = _winding_down(runtime, held, kind)
        sending, retry = _send_held_back(runtime, Input(id="x", content="你好"))
        held.go.set()
        thread.join(10)
        sending.join(10)
        assert not thread.is_alive() and not sending.is_alive()
        outcome = retry[0].result(10)
        assert (outcome.outcome, outcome.reason) == ("released", kind)
        assert counting.ids == ["busy", "x"]
    finally:
        held.go.set()
        runtime.shutdown(timeout=10)


@pytest.mark.parametrize("stamp", [False, True])
def test_an_input_sent_twice_while_held_back_goes_through_the_hooks_once(
    held: Held, stamp: bool
) -> None:
    """``asubmit`` answers an input held back by a wind-down at once (``deferred``) and
    waits for it on its event loop: a second send of that input (a gateway delivering
    twice) is its retry, not a new input run through the hooks again."""
    counting = Counting(stamp)
    runtime = _runtime(held, counting)

    async def main() -> tuple[Any, Any]:
        async with AsyncRuntime(runtime) as aruntime:
            thread = _winding_down(runtime, held, "delete")
            first = asyncio.ensure_future(aruntime.asubmit(SID, Input(id="y", content="新的")))
            while not _deferred(runtime):
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(aruntime.asubmit(SID, Input(id="y", content="新的")))
            while len(_deferred(runtime)) < 2 and counting.ids.count("y") < 2:
                await asyncio.sleep(0.01)
            held.go.set()
            handles = await asyncio.gather(first, second)
            results = [await h.result(10) for h in handles]
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
            return handles, results

    try:
        handles, results = asyncio.run(main())
        assert [h.where for h in handles] == ["opened", "opened"]
        assert results[0] == results[1] and results[0].outcome == "replied"
        assert counting.ids == ["busy", "x", "y"]
    finally:
        held.go.set()
        runtime.shutdown(timeout=10)


def test_an_input_held_back_is_known_until_it_is_handed_on(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``knows_input`` is read without the actor's lock (a retry is told from a new input
    by it, before the hooks). Once the deletion was written, the held-back submits were
    taken from ``_deferred`` before they were listed as being handed on: read between
    the two, an input held back was known neither as held back nor as received, and a
    send of it then ran the hooks again. Checked at the very moment ``_deferred`` is
    emptied."""
    from aalis_agent.actors.session import SessionActor

    counting = Counting()
    runtime = _runtime(held, counting)
    seen: list[bool] = []
    watching = threading.Event()
    plain = SessionActor.__setattr__

    def spy(self: Any, name: str, value: Any) -> None:
        plain(self, name, value)
        if name == "_deferred" and value == [] and watching.is_set():
            seen.append(self.knows_input("y"))

    monkeypatch.setattr(SessionActor, "__setattr__", spy)
    try:
        thread = _winding_down(runtime, held, "delete")
        sending, sent = _send_held_back(runtime, Input(id="y", content="新的"))
        watching.set()
        held.go.set()
        thread.join(10)
        sending.join(10)
        assert not thread.is_alive() and not sending.is_alive()
        assert sent[0].result(10).outcome == "replied"
    finally:
        held.go.set()
        runtime.shutdown(timeout=10)
    assert seen and all(seen), seen
