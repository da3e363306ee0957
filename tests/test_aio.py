"""The asyncio API (actors/aio.py): awaitable submits with the reply text, typed event
streams, stop/delete/view, a slow consumer, and an event loop that never stalls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from aalis_agent.actors.aio import AsyncRuntime, EventsDropped, StreamEvent, TurnResult
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import InMemoryEventStore, Input, RuntimeClosed, Sender, ToolCall
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    Tool,
    ToolCallContext,
    ToolRegistry,
)
from aalis_agent.services.bus_events import (
    MessageSent,
    QueueChanged,
    StreamDelta,
    ToolExecution,
    TurnEnded,
    TurnStarted,
    UsageReported,
)

from tests.harness import ROOT, GatedModel

SID = "qq:group:42"
USER = {"sender": Sender(user_id="u1", nickname="u1"), "platform": "qq"}


def add(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
    return str(args["a"] + args["b"])


def tool_then_text(text: str = "一共 3 个", chunks: int = 3) -> list[ScriptedReply]:
    return [
        ScriptedReply(tool_calls=(ToolCall(id="c1", name="add", arguments='{"a":1,"b":2}'),)),
        ScriptedReply(text=text, chunks=chunks),
    ]


def make_runtime(model: Any) -> Runtime:
    return Runtime(
        InMemoryEventStore(),
        Services(llm=model, tools=ToolRegistry([Tool("add", add)])),
        janitor=False,
    )


async def collect_until_ended(stream: Any, turns: int = 1, timeout: float = 10) -> list[Any]:
    events: list[StreamEvent] = []
    ended = 0
    while ended < turns:
        event = await stream.next(timeout)
        events.append(event)
        ended += isinstance(event, TurnEnded)
    return events


def test_submit_awaits_the_reply_and_streams_typed_events() -> None:
    async def main() -> None:
        async with AsyncRuntime(make_runtime(ScriptedModel(tool_then_text()))) as aruntime:
            async with aruntime.events(SID) as events:
                handle = await aruntime.asubmit(SID, Input(id="", content="1+2?", **USER))
                assert handle.where == "opened"
                result = await handle
                assert result == TurnResult(
                    handle.input_id, result.turn_id, "replied", None, "一共 3 个"
                )
                assert result.turn_id and result.replied
                assert await handle.result(timeout=1) is result  # awaitable again
                seen = await collect_until_ended(events)
            view = await aruntime.aview(SID)
            assert view.queue.running is None
        kinds = [type(e) for e in seen]
        assert kinds.index(TurnStarted) < kinds.index(ToolExecution) and kinds[-1] is TurnEnded
        assert {ToolExecution, StreamDelta, MessageSent, UsageReported} <= set(kinds)
        deltas = "".join(e.content for e in seen if isinstance(e, StreamDelta))
        assert deltas == "一共 3 个"
        tools = [(e.phase, e.name) for e in seen if isinstance(e, ToolExecution)]
        assert tools == [("start", "add"), ("end", "add")]
        assert all(e.session_id == SID for e in seen if not isinstance(e, EventsDropped))

    asyncio.run(main())


def test_queue_insert_stop_and_delete() -> None:
    model = GatedModel()

    async def main() -> None:
        aruntime = await AsyncRuntime(make_runtime(model)).start()
        try:
            events = aruntime.events(SID, topics={"agent:queue", "turn:ended"})
            first = await aruntime.asubmit(SID, Input(id="", content="a", **USER))
            await asyncio.to_thread(model.wait_call)
            joined = await aruntime.asubmit(SID, Input(id="", content="b", **USER))
            assert joined.where == "pending"
            injected = await aruntime.asubmit(SID, Input(id="", content="c", source="timer"))
            assert injected.where == "queued"
            queue = await events.next(5)
            assert isinstance(queue, QueueChanged)
            assert await aruntime.astop(SID, platform="qq", user_id="u1") is not None
            assert (await first.result(5)).outcome == "aborted"
            # The pending input and the injection run next; delete stops that turn.
            await asyncio.to_thread(model.wait_call)
            generation = await aruntime.adelete(SID, timeout=10)
            assert generation == 1
            outcomes = {(await h).outcome for h in (joined, injected)}
            assert outcomes <= {"aborted", "released"}
            ended = [e async for e in _until(events, TurnEnded, 2)]
            assert [e.outcome for e in ended] == ["aborted", "aborted"]
            events.close()
            rest = [e async for e in events]  # what was queued, then the end
            assert not any(isinstance(e, EventsDropped) for e in rest)
        finally:
            await aruntime.ashutdown(timeout=10)

    asyncio.run(main())


async def _until(stream: Any, kind: type, n: int) -> Any:
    got = 0
    while got < n:
        event = await stream.next(5)
        if isinstance(event, kind):
            got += 1
            yield event


def test_a_slow_consumer_loses_the_newest_events_and_is_told() -> None:
    model = ScriptedModel([ScriptedReply(text="x" * 60, chunks=60)])

    async def main() -> None:
        async with AsyncRuntime(make_runtime(model)) as aruntime:
            stream = aruntime.events(SID, maxsize=4)
            published = [0]
            aruntime.runtime.subscribe(
                "*", lambda topic, payload: published.__setitem__(0, published[0] + 1)
            )
            handle = await aruntime.asubmit(SID, "hi")
            # Not reading: the turn still ends (runtime threads never wait for us).
            result = await handle.result(timeout=10)
            assert result.reply == "x" * 60
            await aruntime.await_idle(10)
            got: list[StreamEvent] = []
            while True:
                try:
                    got.append(await stream.next(0.2))
                except TimeoutError:
                    break
            stream.close()
        assert not any(isinstance(e, EventsDropped) for e in got[:4])  # the first four fitted
        assert len(got) == 5 and isinstance(got[4], EventsDropped)  # then the gap
        assert got[4].count == stream.dropped_total == published[0] - 4 > 50

    asyncio.run(main())


def test_a_stalled_loop_bounds_what_waits_for_it() -> None:
    async def main() -> None:
        async with AsyncRuntime(make_runtime(ScriptedModel())) as aruntime:
            stream = aruntime.events(maxsize=8)
            bus = aruntime.runtime.services.bus
            payload = {"sessionId": "s", "turnId": "t", "contentDelta": "."}

            def publish() -> None:
                for _ in range(100):
                    bus.publish("outbound:stream", payload)

            thread = threading.Thread(target=publish)
            thread.start()
            thread.join()  # blocks the loop on purpose: 100 events, none delivered
            got: list[StreamEvent] = []
            while True:
                try:
                    got.append(await stream.next(0.1))
                except TimeoutError:
                    break
        # 8 deliveries were scheduled and fit; 92 were dropped on the publishing thread.
        assert [type(e) for e in got] == [StreamDelta] * 8 + [EventsDropped]
        assert got[-1] == EventsDropped(92) and stream.dropped_total == 92

    asyncio.run(main())


def test_streams_end_when_the_runtime_shuts_down() -> None:
    async def main() -> list[StreamEvent]:
        aruntime = await AsyncRuntime(make_runtime(ScriptedModel())).start()
        stream = aruntime.events()
        handle = await aruntime.asubmit(SID, "hi")
        await handle

        async def drain() -> list[StreamEvent]:
            return [e async for e in stream]

        task = asyncio.create_task(drain())
        await aruntime.ashutdown(timeout=10)
        return await asyncio.wait_for(task, 5)

    seen = asyncio.run(main())
    assert isinstance(seen[-1], TurnEnded)


def test_a_stream_of_some_topics_listens_to_those_only() -> None:
    """A stream asked for some topics subscribes to those, not to every topic filtered
    after: ``agent:queue`` lists every waiting input, and its payload is built only
    while someone listens to it (a stream of other topics made each of 4,000 submits
    during a turn build the whole list: 0.7 ms each, growing with the queue)."""

    async def main() -> None:
        runtime = make_runtime(ScriptedModel())
        bus = runtime.services.bus
        async with AsyncRuntime(runtime) as aruntime:
            assert not bus.wants("agent:queue")
            async with aruntime.events(SID, topics=("turn:ended", "outbound:message")) as some:
                assert bus.wants("turn:ended") and bus.wants("outbound:message")
                assert not bus.wants("agent:queue")
                async with aruntime.events(SID, topics=("agent:queue",)) as queue:
                    assert bus.wants("agent:queue")
                    await (await aruntime.asubmit(SID, "hi"))
                    changed = await queue.next(5)
                    assert changed.session_id == SID
                    assert type(await some.next(5)).__name__ in ("MessageSent", "TurnEnded")
                assert not bus.wants("agent:queue")
            assert not bus.wants("turn:ended")

    asyncio.run(main())


LAG_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from aalis_agent.actors.aio import AsyncRuntime, warm_up
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.events import InMemoryEventStore, ToolCall
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    WARM_FIRST = sys.argv[1] == "warm-first"
    replies = []
    for n in range(4):
        replies.append(ScriptedReply(
            tool_calls=(ToolCall(id=f"c{n}", name="add", arguments='{"a":1,"b":2}'),)))
        replies.append(ScriptedReply(text="好的，" * 40, chunks=40, chunk_delay_s=0.002))
    tool = Tool("add", lambda args, ctx: str(args["a"] + args["b"]))

    async def main():
        loop = asyncio.get_running_loop()
        lag = {"max": 0.0}
        running = True

        async def probe():
            while running:
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lag["max"] = max(lag["max"], time.perf_counter() - t0 - 0.001)

        probing = asyncio.create_task(probe())
        await asyncio.sleep(0.01)
        runtime = Runtime(
            InMemoryEventStore(), Services(llm=ScriptedModel(replies), tools=ToolRegistry([tool])),
            janitor=False,
        )
        aruntime = AsyncRuntime(runtime)
        t0 = time.perf_counter()
        await aruntime.start()
        start_lag, start_s = lag["max"], time.perf_counter() - t0
        lag["max"] = 0.0
        events = aruntime.events()
        reader = asyncio.create_task(
            asyncio.wait_for(events.__anext__(), 30))  # touch the stream while turns run
        t0 = time.perf_counter()
        handles = [await aruntime.asubmit(f"room:{n % 2}", f"第 {n} 条") for n in range(4)]
        results = [await h for h in handles]
        turns_s = time.perf_counter() - t0
        await reader
        events.close()
        await aruntime.ashutdown(timeout=10)
        running = False
        await probing
        print(json.dumps({
            "start_lag": start_lag, "start_s": start_s, "turn_lag": lag["max"],
            "turns_s": turns_s, "outcomes": [r.outcome for r in results],
            "replies": sum(r.reply is not None for r in results),
        }))

    if WARM_FIRST:
        warm_up()
    asyncio.run(main())
    """
)


def run_lag(mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", LAG_SCRIPT, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def least_lag(mode: str, key: str, attempts: int = 3) -> dict[str, Any]:
    """The run with the least ``key`` lag of up to ``attempts`` fresh processes: a stall
    the code causes shows in every run; a busy machine's scheduling noise does not."""
    best: dict[str, Any] | None = None
    for _ in range(attempts):
        run = run_lag(mode)
        assert run["outcomes"] == ["replied"] * 4 and run["replies"] == 4, run
        if best is None or run[key] < best[key]:
            best = run
        if best[key] < LAG_LIMIT_S:
            break
    assert best is not None
    return best


LAG_LIMIT_S = 0.05


def test_the_loop_never_stalls_while_turns_run() -> None:
    """In a fresh process (the tokenizer not loaded): the first turns of two sessions,
    each with a tool call and a streamed reply, never pause the loop 50 ms. Loading the
    tokenizer holds the GIL (~0.1-0.2 s): ``start()`` does it up front, so no turn does;
    ``warm_up()`` before ``asyncio.run`` keeps that pause out of the loop too."""
    cold = least_lag("start-in-loop", "turn_lag")
    assert cold["turn_lag"] < LAG_LIMIT_S, cold
    warm = least_lag("warm-first", "start_lag")
    assert max(warm["start_lag"], warm["turn_lag"]) < LAG_LIMIT_S, warm
    print(f"\nloop lag: cold {cold}\nwarm {warm}")


def test_without_start_the_first_turn_is_still_off_the_loop() -> None:
    """Without ``start()`` the first turn loads the tokenizer on its own thread: the
    turn completes and replies; only the GIL pause of that load reaches the loop."""

    async def main() -> TurnResult:
        aruntime = AsyncRuntime(make_runtime(ScriptedModel(tool_then_text())))
        try:
            t0 = time.perf_counter()
            handle = await aruntime.asubmit(SID, "1+2?")
            assert time.perf_counter() - t0 < 5
            return await handle.result(timeout=30)
        finally:
            await aruntime.ashutdown(timeout=10)

    assert asyncio.run(main()).reply == "一共 3 个"


def test_a_wait_that_times_out_leaves_the_handle_to_be_awaited_again() -> None:
    """A timed-out ``handle.result(timeout)`` (or ``asyncio.wait_for(handle, ...)``) used
    to cancel the runtime's own future: every later wait raised ``CancelledError``
    although the turn went on and replied."""
    model = GatedModel()

    async def main() -> None:
        async with AsyncRuntime(make_runtime(model)) as aruntime:
            handle = await aruntime.asubmit(SID, Input(id="", content="一", **USER))
            try:
                await handle.result(timeout=0.05)
                raise AssertionError("the turn waits on the model: the wait must time out")
            except TimeoutError:
                pass
            try:
                await asyncio.wait_for(handle, 0.05)
                raise AssertionError("still waiting on the model")
            except TimeoutError:
                pass
            assert not handle.threaded.future.cancelled()
            await asyncio.to_thread(model.answer, "好的")
            result = await handle.result(timeout=10)
            assert result.outcome == "replied" and result.reply == "好的"
            assert handle.threaded.result(timeout=1).outcome == "replied"

    asyncio.run(main())


def test_a_wait_that_timed_out_leaves_no_unretrieved_error_when_the_turn_fails() -> None:
    """Each wait that timed out (or was cancelled) left a future behind that took the
    turn's error later: asyncio logged it as "Future exception was never retrieved",
    with a traceback, once per abandoned wait."""
    import gc

    from tests.harness import GatedTool

    tool = GatedTool()  # ignores the stop: the shutdown gives up on its turn
    reported: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
        model = ScriptedModel(
            [ScriptedReply(tool_calls=(ToolCall(id="c1", name=tool.name, arguments="{}"),))]
        )
        runtime = Runtime(
            InMemoryEventStore(),
            Services(llm=model, tools=ToolRegistry([Tool(tool.name, tool)])),
            janitor=False,
        )
        aruntime = await AsyncRuntime(runtime).start()
        try:
            handle = await aruntime.asubmit(SID, "hi")
            await asyncio.to_thread(tool.wait_running)
            with contextlib.suppress(TimeoutError):
                await handle.result(timeout=0.01)
            waiting = asyncio.create_task(handle.result())
            await asyncio.sleep(0)
            waiting.cancel()
            await aruntime.ashutdown(0.1)  # the turn is left running: its input fails
            with contextlib.suppress(RuntimeClosed):
                await handle.result()  # the error reached this wait (and the others')
        finally:
            tool.release(10)

    asyncio.run(main())
    gc.collect()
    assert reported == []


def test_events_refuses_a_bare_topic_string_and_a_maxsize_of_zero() -> None:
    """``topics="turn:ended"`` was read letter by letter (topics ``t``, ``u``, ...): the
    stream yielded nothing, ever; ``maxsize=0`` became the default size unsaid."""
    from aalis_agent.events import InvalidInput

    async def main() -> None:
        async with AsyncRuntime(make_runtime(ScriptedModel())) as aruntime:
            with pytest.raises(InvalidInput, match="topics must be a collection of topic"):
                aruntime.events(topics="turn:ended")
            with pytest.raises(ValueError, match="maxsize >= 2"):
                aruntime.events(maxsize=0)
            async with aruntime.events(SID, topics=["turn:ended"]) as stream:
                await (await aruntime.asubmit(SID, "hi")).result(timeout=10)
                assert isinstance(await stream.next(10), TurnEnded)

    asyncio.run(main())


def test_a_closed_async_runtime_refuses_calls_as_closed_and_still_shuts_down() -> None:
    from aalis_agent.events import RuntimeClosed

    async def main() -> None:
        runtime = make_runtime(ScriptedModel(tool_then_text()))
        aruntime = await AsyncRuntime(runtime).start()
        await aruntime.aclose()
        try:
            await aruntime.asubmit(SID, "你好")
            raise AssertionError("a closed AsyncRuntime took an input")
        except RuntimeClosed:
            pass
        await aruntime.ashutdown(timeout=10)  # after aclose: the runtime itself stops
        try:
            runtime.submit(SID, Input(id="", content="再来"))
            raise AssertionError("the runtime was not shut down")
        except RuntimeClosed:
            pass

    asyncio.run(main())


def _deltas(n: int) -> list[dict[str, Any]]:
    return [{"sessionId": "s", "turnId": "t", "contentDelta": str(i)} for i in range(n)]


def test_an_event_after_a_reported_gap_is_kept_when_both_fit() -> None:
    """The gap is told first, then the event goes in too when both fit (it used to be
    lost, and counted nowhere): what was published is what was yielded plus what the
    gaps say."""

    async def main() -> None:
        async with AsyncRuntime(make_runtime(ScriptedModel())) as aruntime:
            stream = aruntime.events(maxsize=4)
            bus = aruntime.runtime.services.bus
            first, later = _deltas(10), _deltas(1)
            for payload in first:  # delivered in turn: 4 fit, 6 are dropped on the loop
                bus.publish("outbound:stream", payload)
            await asyncio.sleep(0.05)
            got = [await stream.next(1) for _ in range(4)]  # room again
            bus.publish("outbound:stream", later[0])
            await asyncio.sleep(0.05)
            got += [await stream.next(1) for _ in range(2)]
            stream.close()
        assert [type(e) for e in got] == [StreamDelta] * 4 + [EventsDropped, StreamDelta]
        assert got[4] == EventsDropped(6) and stream.dropped_total == 6

    asyncio.run(main())


def test_events_lost_while_the_loop_lags_are_told_where_they_were_lost() -> None:
    """Lost on the publishing thread (every delivery slot in flight), then a later event
    scheduled once a slot is free: the gap comes before that event, not after it."""

    async def main() -> None:
        async with AsyncRuntime(make_runtime(ScriptedModel())) as aruntime:
            stream = aruntime.events(maxsize=4)
            bus = aruntime.runtime.services.bus
            loop = asyncio.get_running_loop()
            payloads = _deltas(6)
            got: list[StreamEvent] = []

            def read_one_then_publish_the_sixth() -> None:
                got.append(stream._queue.get_nowait())  # a consumer reads one
                bus.publish("outbound:stream", payloads[5])

            bus.publish("outbound:stream", payloads[0])
            loop.call_soon(read_one_then_publish_the_sixth)
            for payload in payloads[1:5]:  # the fifth finds 4 deliveries in flight
                bus.publish("outbound:stream", payload)
            await asyncio.sleep(0.05)
            got += [await stream.next(1) for _ in range(4)]
            stream.close()
        seen = [e.count if isinstance(e, EventsDropped) else e.content for e in got]
        # The sixth found the queue with room for one: the gap (the fifth) is told, and
        # the sixth dropped with it, as both did not fit.
        assert seen == ["0", "1", "2", "3", 2]
        assert stream.dropped_total == 2

    asyncio.run(main())


def test_an_async_tool_raising_systemexit_ends_its_turn_and_leaves_the_loop_running() -> None:
    """asyncio raises SystemExit out of the loop itself: it ended the shared loop's
    thread, and every session's async tools waited for good after it."""

    async def bad(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        raise SystemExit(3)

    async def good(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        await asyncio.sleep(0)
        return "pong"

    def reply(request: Any, n: int) -> ScriptedReply:
        if request.messages[-1].role == "tool":
            return ScriptedReply(text=f"done: {request.messages[-1].content}")
        name = "bad" if "bad" in request.messages[-1].content else "good"
        return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name=name, arguments="{}"),))

    runtime = Runtime(
        InMemoryEventStore(),
        Services(
            llm=ScriptedModel(reply), tools=ToolRegistry([Tool("bad", bad), Tool("good", good)])
        ),
        janitor=False,
    )

    async def main() -> None:
        async with AsyncRuntime(runtime) as aruntime:
            failed = await (await aruntime.asubmit("a", "bad")).result(timeout=10)
            # Ended as the exit it is (recorded before it is raised on), not a failure.
            assert (failed.outcome, failed.reason) == ("aborted", "exit")
            for session in ("b", "c"):
                ok = await (await aruntime.asubmit(session, "good")).result(timeout=10)
                assert (ok.outcome, ok.reply) == ("replied", "done: pong")

    asyncio.run(main())


def test_an_async_tool_whose_own_timeout_runs_out_fails_that_call_and_the_turn_goes_on() -> None:
    """``asyncio.timeout`` inside an async tool raises TimeoutError: its turn's thread
    took it for its own wait running out and spun for good (a stop did not end it)."""

    async def lookup(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        async with asyncio.timeout(0.001):
            await asyncio.Event().wait()
        return "never"

    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="lookup", arguments="{}"),)),
            ScriptedReply(text="查不到"),
        ]
    )
    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=model, tools=ToolRegistry([Tool("lookup", lookup)])),
        janitor=False,
    )

    async def main() -> None:
        aruntime = await AsyncRuntime(runtime).start()
        try:
            result = await (await aruntime.asubmit(SID, "查一下")).result(timeout=10)
            assert (result.outcome, result.reply) == ("replied", "查不到")
            sent = [m.content for m in model.requests[-1].messages if m.role == "tool"]
            assert sent == ["TimeoutError: "]
        finally:
            await aruntime.ashutdown(5)

    asyncio.run(main())


def test_shutting_one_runtime_down_leaves_another_runtimes_async_tools_running() -> None:
    started, go = threading.Event(), threading.Event()

    async def slow(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        started.set()
        while not go.is_set():
            await asyncio.sleep(0.01)
        return "slept fine"

    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),)),
            ScriptedReply(text="ok"),
        ]
    )
    a = Runtime(
        InMemoryEventStore(),
        Services(llm=model, tools=ToolRegistry([Tool("slow", slow)])),
        janitor=False,
    )
    b = Runtime(InMemoryEventStore(), Services(llm=ScriptedModel()), janitor=False)
    try:
        handle = a.submit("s", Input(id="", content="一"))
        assert started.wait(10)
        b.shutdown(timeout=10)  # the async tools' loop is shared: A still uses it
        go.set()
        assert handle.result(10).outcome == "replied"
        results = [m.content for m in model.requests[-1].messages if m.role == "tool"]
        assert results == ["slept fine"]
    finally:
        go.set()
        a.shutdown(timeout=10)


def test_cancelled_waits_give_their_threads_back() -> None:
    """With one thread: waits for idleness and for a deletion, cancelled or timed out
    while a turn is parked, used to keep that thread for good (every later call, and
    ``ashutdown``'s timeout, waited behind them)."""
    model = GatedModel()

    async def main() -> None:
        aruntime = await AsyncRuntime(make_runtime(model), threads=1).start()
        try:
            await aruntime.asubmit(SID, "hi")
            while not model.parked:
                await asyncio.sleep(0.01)
            for _ in range(3):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(aruntime.await_idle(), 0.05)
                task = asyncio.create_task(aruntime.await_idle())
                await asyncio.sleep(0.02)
                task.cancel()
            view = await asyncio.wait_for(aruntime.aview("another"), 2)
            assert view.seq == 0
        finally:
            await asyncio.to_thread(model.answer, "好")
            await asyncio.wait_for(aruntime.ashutdown(5), 10)

    asyncio.run(main())


def test_a_timed_out_adelete_holds_no_thread_and_the_deletion_goes_on() -> None:
    from tests.harness import GatedTool

    tool = GatedTool()  # ignores the stop: the deletion waits for it
    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name=tool.name, arguments="{}"),)),
            ScriptedReply(text="好"),
        ]
    )
    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=model, tools=ToolRegistry([Tool(tool.name, tool)])),
        janitor=False,
    )

    async def main() -> None:
        aruntime = await AsyncRuntime(runtime, threads=1).start()
        try:
            await aruntime.asubmit(SID, "hi")
            await asyncio.to_thread(tool.wait_running)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(aruntime.adelete(SID), 0.1)
            view = await asyncio.wait_for(aruntime.aview("another"), 2)  # the one thread
            assert view.seq == 0
            tool.release()
            assert await aruntime.await_idle(10)
            assert (await aruntime.aview(SID)).queue.generation == 1  # it went on
        finally:
            tool.release(10)
            await asyncio.wait_for(aruntime.ashutdown(5), 10)

    asyncio.run(main())
