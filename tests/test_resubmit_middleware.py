"""An input sent again under an id its session knows does not go through the input hooks
again: ``agent:input:before`` and the input preprocessors ran for it the first time.

A retry (a caller whose submit timed out, a cancelled ``asubmit``, a gateway delivering
twice) is answered as the first input: its live handle while it waits or runs, how it
ended once it is over. A middleware that counts, drops duplicates or rewrites the input
sees it once. The retry must be what the caller sent the first time, not what the hooks
made of it (the session records the submitter's input's digest when a hook changed it);
another input under a used id is refused. An input a middleware dropped never reached the
session: sent again, it goes through the hooks again. Past one process too: a retry at
the next owner of a session (PostgreSQL leases) and at a Ray shard's next incarnation
(the fixtures skip without a PostgreSQL server).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aalis_agent.actors.aio import AsyncRuntime
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.runtime import InputBefore, Runtime
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    InputReceived,
    InvalidInput,
    SequentialIds,
    SqliteEventStore,
)
from aalis_agent.events.store import EventStore
from aalis_agent.services import Services

from tests.faults import RunIds
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures (skip without a server)
from tests.test_resubmit import Gate, _again

SID = "qq:private:7"


class Seen:
    """An ``agent:input:before`` middleware (or a preprocessor) recording the input ids it
    was called with, changing nothing."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def middleware(self, ctx: InputBefore, next_: Any) -> Any:
        self.ids.append(ctx.message.id)
        return next_()

    def preprocess(self, inp: Input) -> Input:
        self.ids.append(inp.id)
        return inp


def _runtime(store: EventStore, gate: Gate, hooks: Hooks) -> Runtime:
    return Runtime(
        store, Services(llm=gate.model), FixedClock(), SequentialIds(), hooks=hooks, janitor=False
    )


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def runtime(gate: Gate) -> Iterator[Runtime]:
    rt = _runtime(InMemoryEventStore(), gate, Hooks())
    yield rt
    gate.go.set()
    rt.shutdown(timeout=10)


def _received(store: EventStore, input_id: str) -> list[InputReceived]:
    return [e for e in store.read(SID) if isinstance(e, InputReceived) and e.input.id == input_id]


def _stamping(counter: list[int]) -> Any:
    """A middleware that rewrites every input's text with a number it counts up (as one
    stamping the time into it would): never the same twice."""

    def stamp(ctx: InputBefore, next_: Any) -> Any:
        counter[0] += 1
        msg = ctx.message
        ctx.message = msgspec.structs.replace(msg, content=f"[{counter[0]}] {msg.content}")
        return next_()

    return stamp


def test_a_counting_middleware_sees_an_input_sent_again_after_it_ended_once(
    runtime: Runtime, gate: Gate
) -> None:
    seen = Seen()
    runtime.hooks.use("agent:input:before", seen.middleware)
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "replied" and first.reply == "答1"
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert runtime.run(SID, Input(id="x", content="你好", timestamp=99)) == first
    assert seen.ids == ["x"]
    assert gate.calls == 1 and len(_received(runtime.store, "x")) == 1


def test_a_counting_middleware_sees_an_input_sent_again_while_it_waits_once(
    runtime: Runtime, gate: Gate
) -> None:
    seen = Seen()
    runtime.hooks.use("agent:input:before", seen.middleware)
    gate.go.clear()
    busy = runtime.submit(SID, Input(id="busy", content="占着"))
    assert gate.called.wait(10)  # the turn is held in its model call
    waiting = runtime.submit(SID, Input(id="x", content="你好"))
    assert waiting.where in ("pending", "queued")
    again = runtime.submit(SID, Input(id="x", content="你好"))
    assert again.where == waiting.where  # it follows the waiting one
    assert seen.ids == ["busy", "x"]
    gate.go.set()
    busy.result(10)
    assert again.result(10) == waiting.result(10)
    assert len(_received(runtime.store, "x")) == 1


def test_a_middleware_dropping_seen_ids_does_not_answer_a_retry_dropped(
    runtime: Runtime, gate: Gate
) -> None:
    seen: set[str] = set()

    def dedup(ctx: InputBefore, next_: Any) -> Any:
        if ctx.message.id in seen:
            return None  # drops it: not calling next()
        seen.add(ctx.message.id)
        return next_()

    runtime.hooks.use("agent:input:before", dedup)
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "replied"
    retried = _again(runtime, Input(id="x", content="你好"))
    assert retried == first  # the first input's real outcome and reply, not "dropped"
    assert retried.reply == "答1"


def test_a_rewriting_middleware_does_not_make_a_retry_another_input(
    runtime: Runtime, gate: Gate
) -> None:
    counter = [0]
    runtime.hooks.use("agent:input:before", _stamping(counter))
    gate.go.clear()
    busy = runtime.submit(SID, Input(id="busy", content="占着"))
    assert gate.called.wait(10)
    waiting = runtime.submit(SID, Input(id="x", content="你好"))
    # while it waits: the same as the caller sent it, so the same input
    assert runtime.submit(SID, Input(id="x", content="你好")).where == waiting.where
    gate.go.set()
    busy.result(10)
    first = waiting.result(10)
    assert first.outcome == "replied"
    (received,) = _received(runtime.store, "x")
    assert received.input.content == "[2] 你好"  # as the middleware left it
    # once it ended: answered from the log, not refused as another input
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert counter[0] == 2 and gate.calls == 2


def test_preprocessors_do_not_run_for_an_input_sent_again(runtime: Runtime, gate: Gate) -> None:
    seen = Seen()
    count = [0]

    def stamp(inp: Input) -> Input:
        count[0] += 1
        return msgspec.structs.replace(inp, content=f"{inp.content} ({count[0]})")

    runtime.hooks.add_preprocessor(seen.preprocess)
    runtime.hooks.add_preprocessor(stamp)
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert _received(runtime.store, "x")[0].input.content == "你好 (1)"
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert seen.ids == ["x"] and count[0] == 1


def test_an_input_the_middleware_dropped_goes_through_it_again(
    runtime: Runtime, gate: Gate
) -> None:
    calls: list[str] = []

    def drop_the_first(ctx: InputBefore, next_: Any) -> Any:
        calls.append(ctx.message.id)
        if len(calls) == 1:
            return None
        return next_()

    runtime.hooks.use("agent:input:before", drop_the_first)
    dropped = runtime.submit(SID, Input(id="x", content="你好"))
    assert dropped.where == "dropped"
    assert _received(runtime.store, "x") == []
    # the session never knew it: sent again, the middleware sees it again and lets it in
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "replied" and calls == ["x", "x"]
    # now it is known: a third send is a retry, answered without the middleware
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert calls == ["x", "x"]


def test_another_input_under_a_used_id_is_refused_without_the_middleware(
    runtime: Runtime, gate: Gate
) -> None:
    counter = [0]
    runtime.hooks.use("agent:input:before", _stamping(counter))
    first = runtime.run(SID, Input(id="x", content="你好"))
    before = runtime.store.read(SID)
    with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
        runtime.submit(SID, Input(id="x", content="别的话"))
    # What the middleware made of the first one is not what the caller sent: refused too.
    with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
        runtime.submit(SID, Input(id="x", content="[1] 你好"))
    assert counter[0] == 1  # refused by the session, not counted by the middleware
    assert runtime.store.read(SID) == before
    gate.go.clear()
    runtime.submit(SID, Input(id="busy", content="占着"))
    assert gate.called.wait(10)
    runtime.submit(SID, Input(id="w", content="等着"))
    with pytest.raises(InvalidInput, match="input id 'w' is taken by another input"):
        runtime.submit(SID, Input(id="w", content="别的话"))
    assert counter[0] == 3
    gate.go.set()
    assert runtime.wait_idle(10)  # the turns let go end first: _again compares the log
    assert _again(runtime, Input(id="x", content="你好")) == first


def test_a_rewritten_input_sent_again_after_a_restart_is_answered(tmp_path: Path) -> None:
    path = tmp_path / "agent.db"
    gate, counter = Gate(), [0]
    hooks = Hooks()
    hooks.use("agent:input:before", _stamping(counter))
    rt = _runtime(SqliteEventStore(path), gate, hooks)
    first = rt.run(SID, Input(id="x", content="你好"))
    plain = rt.run(SID, Input(id="y", content="[9] 原样"))
    rt.shutdown(timeout=10)
    rt.store.close()

    again = Gate()
    rt = _runtime(SqliteEventStore(path), again, hooks)
    try:
        assert _again(rt, Input(id="x", content="你好")) == first
        with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
            rt.submit(SID, Input(id="x", content="别的话"))
        assert _again(rt, Input(id="y", content="[9] 原样")) == plain
        assert counter[0] == 2 and again.calls == 0
    finally:
        rt.shutdown(timeout=10)
        rt.store.close()
    # Without the middleware, the retry is still what the caller sent.
    rt = _runtime(SqliteEventStore(path), Gate(), Hooks())
    try:
        assert _again(rt, Input(id="x", content="你好")) == first
    finally:
        rt.shutdown(timeout=10)
        rt.store.close()


def test_an_input_the_hooks_left_unchanged_is_recorded_as_before(runtime: Runtime) -> None:
    runtime.hooks.use("agent:input:before", Seen().middleware)
    runtime.run(SID, Input(id="x", content="你好"))
    counter = [0]
    runtime.hooks.use("agent:input:before", _stamping(counter))
    runtime.run(SID, Input(id="y", content="你好"))
    (unchanged,) = _received(runtime.store, "x")
    (rewritten,) = _received(runtime.store, "y")
    # the submitter's input is recorded (as a digest) only when a hook changed it
    assert unchanged.sent_digest is None
    assert isinstance(rewritten.sent_digest, str) and rewritten.sent_digest


def test_asubmit_sent_again_skips_the_middleware() -> None:
    gate, seen = Gate(), Seen()
    hooks = Hooks()
    hooks.use("agent:input:before", seen.middleware)
    rt = _runtime(InMemoryEventStore(), gate, hooks)

    async def main() -> tuple[Any, Any, str, str]:
        async with AsyncRuntime(rt) as agent:
            gate.go.clear()
            inp = Input(id="x", content="你好")
            handle = await agent.asubmit(SID, inp)
            assert await asyncio.to_thread(gate.called.wait, 10)
            live = await agent.asubmit(SID, inp)  # while its turn runs
            gate.go.set()
            result = await live.result(10)
            over = await agent.asubmit(SID, inp)  # once it is over
            assert await handle.result(10) == result
            return result, await over.result(10), live.where, over.where

    try:
        result, recorded, live_where, over_where = asyncio.run(main())
    finally:
        gate.go.set()
        rt.shutdown(timeout=10)
    assert (live_where, over_where) == ("opened", "handled")
    assert result == recorded and result.reply == "答1"
    assert seen.ids == ["x"]
    assert gate.calls == 1 and len(_received(rt.store, "x")) == 1


def test_a_retry_the_session_no_longer_knows_goes_through_the_hooks(
    runtime: Runtime, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime takes an input as a retry when its session knew the id a moment before;
    a session that does not know it when the input arrives (forgotten meanwhile, or a
    deletion winding down) answers so, writing nothing, and the input goes through the
    hooks as a new one."""
    seen = Seen()
    runtime.hooks.use("agent:input:before", seen.middleware)
    monkeypatch.setattr(runtime, "_knows_input", lambda session_id, input_id: True)
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "replied" and seen.ids == ["x"]
    assert len(_received(runtime.store, "x")) == 1


def test_a_retry_that_went_through_the_hooks_is_compared_as_sent(
    runtime: Runtime, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sends of one input racing (both found the id unknown, so the hooks ran for
    both): the session compares what each submitter sent, not what the hooks made of it."""
    counter = [0]
    runtime.hooks.use("agent:input:before", _stamping(counter))
    first = runtime.run(SID, Input(id="x", content="你好"))
    # raising=False: on a runtime without the look-up, the hooks run for every send
    monkeypatch.setattr(runtime, "_knows_input", lambda session_id, input_id: False, raising=False)
    assert _again(runtime, Input(id="x", content="你好")) == first
    with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
        runtime.submit(SID, Input(id="x", content="别的话"))
    assert counter[0] == 3 and gate.calls == 1


def test_a_rewritten_input_sent_again_to_the_next_owner_is_answered(
    pg_url: str,  # noqa: F811
) -> None:
    """Past one process: A runs x through a rewriting middleware; A's lease lapses and x
    comes again to B (the same middleware installed there): B answers it from the shared
    log, without its middleware, and writes nothing."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")
    import psycopg
    from aalis_agent.events.postgres import PostgresEventStore
    from aalis_agent.scale.leases import PostgresLeases

    made: list[tuple[Runtime, Any, Any]] = []

    def node(tag: str, counter: list[int]) -> tuple[Runtime, Gate]:
        store = PostgresEventStore(pg_url)
        leases = PostgresLeases(store, owner=f"node-{tag}", ttl_s=1.0)
        hooks = Hooks()
        hooks.use("agent:input:before", _stamping(counter))
        gate = Gate()
        rt = Runtime(
            store,
            Services(llm=gate.model),
            FixedClock(),
            RunIds(tag),
            hooks=hooks,
            janitor=False,
            ownership=leases,
        )
        made.append((rt, leases, store))
        return rt, gate

    at_a, at_b = [0], [100]  # each node stamps its own numbers, as with its own clock
    try:
        a, gate_a = node("a", at_a)
        b, gate_b = node("b", at_b)
        first = a.run(SID, Input(id="x", content="你好"))
        assert first.outcome == "replied"
        with psycopg.connect(pg_url, autocommit=True) as conn:  # A stopped renewing
            conn.execute("UPDATE aalis_leases SET expires_at = now() - interval '1 s'")
        assert _again(b, Input(id="x", content="你好", timestamp=99)) == first
        with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
            b.submit(SID, Input(id="x", content="别的话"))
        assert (at_a[0], at_b[0]) == (1, 100)
        assert (gate_a.calls, gate_b.calls) == (1, 0)
    finally:
        for rt, leases, store in reversed(made):
            rt.shutdown(timeout=10)
            leases.close()
            store.close()


def test_a_shard_runs_its_middleware_once_for_an_input_and_its_retries(
    pg_url: str,  # noqa: F811
) -> None:
    """Through a Ray shard (what the Ray client's submits and its resends after a shard
    restart reach): x sent again while it runs and after goes through the shard's
    middleware once; the next incarnation of the shard answers x sent again from the log,
    not refusing it as another input for what its own middleware made of it."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'aalis-agent[ray]')")
    from aalis_agent.scale.ray_shards import RuntimeShard

    def shard_with(gate: Gate, counter: list[int]) -> Any:
        hooks = Hooks()
        hooks.use("agent:input:before", _stamping(counter))
        return RuntimeShard(
            0,
            1,
            pg_url,
            lambda: Services(llm=gate.model),
            ttl_s=1.0,
            runtime_options={"hooks": hooks},
        )

    x = Input(id="x", content="你好")
    gate, counter = Gate(), [0]
    gate.go.clear()
    shard = shard_with(gate, counter)
    try:
        assert shard.submit(SID, x) == ("x", "opened")
        assert gate.called.wait(30)
        assert shard.submit(SID, x) == ("x", "opened")  # follows the first
        gate.go.set()
        first = shard.outcome(SID, "x", 30)
        assert first is not None and first.outcome == "replied"
        assert shard.submit(SID, x) == ("x", "handled")
        assert counter == [1]
    finally:
        gate.go.set()
        shard.shutdown()
    later, counter = Gate(), [100]
    shard = shard_with(later, counter)
    try:
        before = shard.store.read(SID)
        assert shard.submit(SID, x) == ("x", "handled")
        assert shard.outcome(SID, "x", 30) == first
        assert shard.store.read(SID) == before
        assert counter == [100] and later.calls == 0
    finally:
        shard.shutdown()


def _prefixing(counter: list[int]) -> Any:
    """A middleware that rewrites every input's text the same way (a fixed prefix),
    counting its calls."""

    def prefix(ctx: InputBefore, next_: Any) -> Any:
        counter[0] += 1
        ctx.message = msgspec.structs.replace(ctx.message, content=f"[qq] {ctx.message.content}")
        return next_()

    return prefix


def test_a_retry_of_an_input_rewritten_before_digests_were_recorded_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log written before ``InputReceived.sent_digest`` holds what a rewriting middleware
    made of an input, and nothing of what its submitter sent. A retry of it is not refused
    as another input: it goes through the hooks again, as it did when that log was
    written, and a middleware rewriting the same way makes it the input received."""
    path = tmp_path / "agent.db"
    counter = [0]
    hooks = Hooks()
    hooks.use("agent:input:before", _prefixing(counter))
    import aalis_agent.actors.runtime as runtime_module

    with monkeypatch.context() as old:  # as written then: no digest of the input as sent
        old.setattr(runtime_module, "unchanged", lambda sent, recorded: True)
        rt = _runtime(SqliteEventStore(path), Gate(), hooks)
        try:
            first = rt.run(SID, Input(id="x", content="你好"))
        finally:
            rt.shutdown(timeout=10)
            rt.store.close()
    (received,) = _received(SqliteEventStore(path), "x")
    assert received.input.content == "[qq] 你好" and received.sent_digest is None

    later = Gate()
    rt = _runtime(SqliteEventStore(path), later, hooks)
    try:
        assert _again(rt, Input(id="x", content="你好")) == first
        with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
            rt.submit(SID, Input(id="x", content="别的话"))
        assert later.calls == 0
    finally:
        rt.shutdown(timeout=10)
        rt.store.close()


def test_a_retry_of_a_waiting_input_received_without_its_digest_follows_it(
    runtime: Runtime, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for an input still waiting (received by a process that recorded no digest
    of it as sent): its retry follows it, it is not refused as another input."""
    counter = [0]
    runtime.hooks.use("agent:input:before", _prefixing(counter))
    import aalis_agent.actors.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "unchanged", lambda sent, recorded: True)
    gate.go.clear()
    busy = runtime.submit(SID, Input(id="busy", content="占着"))
    assert gate.called.wait(10)
    waiting = runtime.submit(SID, Input(id="x", content="你好"))
    again = runtime.submit(SID, Input(id="x", content="你好"))
    assert again.where == waiting.where
    gate.go.set()
    busy.result(10)
    assert again.result(10) == waiting.result(10)
    assert len(_received(runtime.store, "x")) == 1


def test_an_input_sent_again_while_its_first_send_is_in_the_hooks_waits_for_it(
    runtime: Runtime, gate: Gate
) -> None:
    """A gateway delivering an input twice while the first delivery is still inside a slow
    middleware (a billing or rate-limit service): the second waits for the first to reach
    its session, then follows it as a retry; the middleware sees the input once."""
    from tests.faults import wait_until

    calls: list[str] = []
    first_in, go = threading.Event(), threading.Event()

    def slow(ctx: InputBefore, next_: Any) -> Any:
        calls.append(ctx.message.id)
        if len(calls) == 1:
            first_in.set()
            assert go.wait(10)
        return next_()

    runtime.hooks.use("agent:input:before", slow)
    handles: dict[str, Any] = {}

    def send(name: str) -> None:
        handles[name] = runtime.submit(SID, Input(id="x", content="你好"))

    first = threading.Thread(target=send, args=("first",))
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=send, args=("second",))
    second.start()

    def second_is_waiting() -> bool:  # in the runtime, or (before) in the middleware
        held = getattr(runtime, "_in_hooks", {}).get((SID, "x"))
        return len(calls) > 1 or (held is not None and held.waiting > 0)

    assert wait_until(second_is_waiting, 10)
    go.set()
    first.join(10)
    second.join(10)
    assert calls == ["x"]
    assert handles["second"].result(10) == handles["first"].result(10)
    assert len(_received(runtime.store, "x")) == 1 and gate.calls == 1


def test_an_input_sent_again_from_its_own_middleware_does_not_wait_for_itself(
    runtime: Runtime, gate: Gate
) -> None:
    """A middleware that submits the input it was given again (on its own thread) is not
    made to wait for that input's hooks, which wait for it: the hooks run for the inner
    send too, as for any send the session has not received."""
    calls: list[str] = []
    inner: list[Any] = []

    def again(ctx: InputBefore, next_: Any) -> Any:
        calls.append(ctx.message.id)
        if len(calls) == 1:
            inner.append(runtime.submit(SID, Input(id="x", content="你好")))
        return next_()

    runtime.hooks.use("agent:input:before", again)
    outer = runtime.submit(SID, Input(id="x", content="你好"))
    assert calls == ["x", "x"]
    assert outer.result(10) == inner[0].result(10)
    assert len(_received(runtime.store, "x")) == 1


def test_a_middleware_waiting_for_another_thread_sending_its_input_is_not_stuck() -> None:
    """A middleware that hands the input it was given to another thread, which sends it
    again, and waits for that send: the other send waits for the first at most the
    runtime's ``ask_timeout_s``, then goes through the hooks itself (as any send the
    session has not received), rather than both waiting for each other for good."""
    gate, calls = Gate(), []
    hooks = Hooks()
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=gate.model),
        FixedClock(),
        SequentialIds(),
        hooks=hooks,
        janitor=False,
        ask_timeout_s=0.2,
    )
    inner: list[Any] = []

    def hand_over(ctx: InputBefore, next_: Any) -> Any:
        calls.append(ctx.message.id)
        if len(calls) == 1:
            other = threading.Thread(
                target=lambda: inner.append(rt.submit(SID, Input(id="x", content="你好")))
            )
            other.start()
            other.join(10)
            assert not other.is_alive(), "the other send waits for this one, which waits for it"
        return next_()

    hooks.use("agent:input:before", hand_over)
    try:
        outer = rt.submit(SID, Input(id="x", content="你好"))
        assert calls == ["x", "x"]
        assert outer.result(10) == inner[0].result(10)
        assert len(_received(rt.store, "x")) == 1
    finally:
        rt.shutdown(timeout=10)
