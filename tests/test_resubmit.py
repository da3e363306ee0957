"""An input sent again under an id its session already handled never runs twice.

A caller whose submit timed out, or whose ``await asubmit(...)`` was cancelled after the
input was accepted, sends it again under the same id: its handle answers how the first
one ended (the turn's result, or its release), nothing is written, no model is called.
The ids are a fold of the log: they survive passivation and a restart, bounded to the
last ``KEEP_INPUT_IDS`` per session.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aalis_agent.actors.aio import AsyncRuntime, TurnResult
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    ChatMessage,
    FixedClock,
    InMemoryEventStore,
    Input,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    InvalidInput,
    MessageMeta,
    MessageSaved,
    SequentialIds,
    SqliteEventStore,
    TurnRecord,
    TurnRecorded,
)
from aalis_agent.events.store import EventStore
from aalis_agent.projections import inputs as inputs_module
from aalis_agent.projections.inputs import Handled, InputIds, digest
from aalis_agent.services import ChatRequest, ScriptedModel, ScriptedReply, Services

SID = "qq:private:7"


class Gate:
    """A model whose calls wait for ``go`` (set by default), counting them."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.called = threading.Event()
        self.fail = False
        self.model = ScriptedModel(self._reply)

    def _reply(self, request: ChatRequest, n: int) -> ScriptedReply:
        self.called.set()
        assert self.go.wait(10)
        if self.fail:
            raise RuntimeError("the provider is down")
        return ScriptedReply(text=f"答{n}")

    @property
    def calls(self) -> int:
        return self.model.calls


def _runtime(store: EventStore, gate: Gate) -> Runtime:
    return Runtime(store, Services(llm=gate.model), FixedClock(), SequentialIds(), janitor=False)


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def runtime(gate: Gate) -> Iterator[Runtime]:
    rt = _runtime(InMemoryEventStore(), gate)
    yield rt
    gate.go.set()
    rt.shutdown(timeout=10)


def _received(store: EventStore, input_id: str) -> int:
    return sum(
        1 for e in store.read(SID) if isinstance(e, InputReceived) and e.input.id == input_id
    )


def _again(rt: Runtime, inp: Input) -> Any:
    """Send ``inp`` again: its handle is answered at once, and nothing is written."""
    before = rt.store.read(SID)
    handle = rt.submit(SID, inp)
    assert handle.where == "handled"
    assert handle.done()
    assert rt.store.read(SID) == before
    return handle.result(0)


def test_a_replied_input_sent_again_is_answered_with_its_turn(runtime: Runtime, gate: Gate) -> None:
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "replied" and first.reply == "答1"
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert gate.calls == 1 and _received(runtime.store, "x") == 1
    # run (the turn on the calling thread) answers it the same way
    assert runtime.run(SID, Input(id="x", content="你好", timestamp=123)) == first
    assert gate.calls == 1


def test_a_failed_input_sent_again_is_answered_with_its_failure(
    runtime: Runtime, gate: Gate
) -> None:
    gate.fail = True
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert first.outcome == "error"
    gate.fail = False
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert gate.calls == 1


def test_a_stopped_input_sent_again_is_answered_aborted(runtime: Runtime, gate: Gate) -> None:
    gate.go.clear()
    handle = runtime.submit(SID, Input(id="x", content="你好"))
    assert gate.called.wait(10)
    assert runtime.stop(SID) is not None
    gate.go.set()
    first = handle.result(10)
    assert first.outcome == "aborted" and first.reason == "stop"
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert gate.calls == 1


def test_an_input_joined_to_a_turn_is_answered_with_that_turn(runtime: Runtime, gate: Gate) -> None:
    gate.go.clear()
    opener = runtime.submit(SID, Input(id="a", content="一"))
    assert gate.called.wait(10)
    joined = runtime.submit(SID, Input(id="b", content="二"))
    assert joined.where in ("pending", "queued")
    gate.go.set()
    opener.result(10)
    second = joined.result(10)
    assert _again(runtime, Input(id="b", content="二")) == second
    assert gate.calls == 2


@pytest.mark.parametrize("how", ["stop-all", "delete"])
def test_a_released_input_sent_again_is_answered_released(
    runtime: Runtime, gate: Gate, how: str
) -> None:
    gate.go.clear()
    runtime.submit(SID, Input(id="busy", content="占着"))
    assert gate.called.wait(10)
    waiting = runtime.submit(SID, Input(id="x", content="等着"))
    if how == "stop-all":
        runtime.stop_all(SID)
    else:
        deleting = threading.Thread(target=runtime.delete, args=(SID,), kwargs={"timeout": 10})
        deleting.start()
    released = waiting.result(10)
    gate.go.set()
    if how == "delete":
        deleting.join(10)
    assert (released.turn_id, released.outcome, released.reason) == (None, "released", how)
    assert _again(runtime, Input(id="x", content="等着")) == released
    assert gate.calls == 1


def test_an_input_of_a_stale_generation_sent_again_is_answered_released(
    runtime: Runtime, gate: Gate
) -> None:
    def delete_first(ctx: Any, next_: Any) -> Any:
        remove()
        runtime.delete(SID, timeout=10)
        return next_()

    remove = runtime.hooks.use("agent:input:before", delete_first)
    late = runtime.submit(SID, Input(id="late", content="删除前到达"))
    assert late.where == "released"
    first = late.result(5)
    assert first.reason == "stale-generation"
    assert _again(runtime, Input(id="late", content="删除前到达")) == first
    assert gate.calls == 0


def test_another_input_under_a_handled_id_is_refused_naming_the_id(
    runtime: Runtime, gate: Gate
) -> None:
    runtime.run(SID, Input(id="x", content="你好"))
    before = runtime.store.read(SID)
    with pytest.raises(InvalidInput, match="input id 'x' was used by another input"):
        runtime.submit(SID, Input(id="x", content="别的话"))
    assert runtime.store.read(SID) == before
    assert gate.calls == 1
    # what was accepted is untouched: the same input still gets its answer
    assert _again(runtime, Input(id="x", content="你好")).outcome == "replied"


def test_a_passivated_session_still_knows_its_inputs(runtime: Runtime, gate: Gate) -> None:
    first = runtime.run(SID, Input(id="x", content="你好"))
    assert runtime.passivate_idle(0) == 1
    assert _again(runtime, Input(id="x", content="你好")) == first
    assert gate.calls == 1


def test_an_input_sent_again_after_a_restart_is_answered_from_the_log(tmp_path: Path) -> None:
    path = tmp_path / "agent.db"
    gate = Gate()
    rt = _runtime(SqliteEventStore(path), gate)
    first = rt.run(SID, Input(id="x", content="你好"))
    given = rt.run(SID, Input(id="", content="无编号"))  # its id given by the runtime
    rt.shutdown(timeout=10)
    rt.store.close()

    again = Gate()
    rt = _runtime(SqliteEventStore(path), again)
    try:
        assert _again(rt, Input(id="x", content="你好")) == first
        assert again.calls == 0
        # The restarted id source gives "in-1" again: a new input under a new id, not
        # the earlier one's answer.
        fresh = rt.run(SID, Input(id="", content="无编号"))
        assert fresh.input_id != given.input_id
        assert fresh.outcome == "replied" and again.calls == 1
    finally:
        rt.shutdown(timeout=10)
        rt.store.close()


def _count_reads(store: Any) -> list[int]:
    """Wraps the reads of ``store`` (``read`` and, where it has one, ``read_range``) to
    list how many events each gave back."""
    counts: list[int] = []
    for name in ("read", "read_range"):
        method = getattr(store, name, None)
        if method is None:
            continue

        def counted(*args: Any, _method: Any = method, **kw: Any) -> Any:
            events = _method(*args, **kw)
            counts.append(len(events))
            return events

        setattr(store, name, counted)
    return counts


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_an_early_input_sent_again_reads_its_reply_not_the_rest_of_the_log(
    gate: Gate, tmp_path: Path, kind: str
) -> None:
    """The reply of an input sent again is read back from the log by its seq: that event
    alone, not the log from there on. It read every later event: the first of the last
    10,000 inputs of a session of ordinary tool turns read 150,000 events (117 ms and
    70 MB at its peak, the session's other inputs waiting meanwhile)."""
    store: EventStore = (
        InMemoryEventStore() if kind == "memory" else SqliteEventStore(tmp_path / "agent.db")
    )
    rt = _runtime(store, gate)
    try:
        first = rt.run(SID, Input(id="x", content="你好"))
        assert first.reply == "答1"
        for n in range(30):
            rt.run(SID, Input(id=f"later-{n}", content=f"第{n}句"))
        before = store.read(SID)
        counts = _count_reads(store)
        handle = rt.submit(SID, Input(id="x", content="你好"))
        assert handle.where == "handled" and handle.result(0) == first
        assert counts == [1]  # the reply alone (it read the 30 turns after it too)
        assert store.read(SID) == before  # nothing written
    finally:
        rt.shutdown(timeout=10)
        store.close()


def test_only_the_last_ids_are_kept(
    runtime: Runtime, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inputs_module, "KEEP_INPUT_IDS", 2)
    for n, input_id in enumerate(("a", "b", "c"), 1):
        assert runtime.run(SID, Input(id=input_id, content=f"第{n}句")).outcome == "replied"
    assert _again(runtime, Input(id="c", content="第3句")).turn_id == "turn-3"
    assert _again(runtime, Input(id="b", content="第2句")).turn_id == "turn-2"
    # "a" is the third id back: forgotten, so it is taken as a new input
    again = runtime.submit(SID, Input(id="a", content="第1句"))
    assert again.where == "opened"
    assert again.result(10).turn_id == "turn-4"
    assert gate.calls == 4
    # the same after a rebuild from the log
    assert runtime.passivate_idle(0) == 1
    assert _again(runtime, Input(id="a", content="第1句")).turn_id == "turn-4"
    assert runtime.submit(SID, Input(id="b", content="第2句")).where == "opened"


def test_an_input_still_waiting_is_not_forgotten_however_many_come_after() -> None:
    """Inputs past the limit arriving while an earlier one still waits do not push it
    out: once it ran, it is answered if sent again (it ran twice: forgotten while it
    waited, it was taken as new); the memory holds more meanwhile (every input still
    waiting), and comes back to the limit as the waiting ones end."""
    log: list[Any] = [
        *_arrived("w"),  # waits (queued behind a turn) while the others come and go
        *[e for n in range(6) for e in (*_arrived(f"i{n}"), *_turn(f"t{n}", f"i{n}"))],
    ]
    ids = InputIds.of(log, limit=3)
    assert "w" in ids and ids.get("w") == Handled(digest(Input(id="w", content="说 w")))
    assert len(ids) == 3 and "i5" in ids and "i4" in ids  # the ended ones are forgotten
    ids.fold(_turn("tw", "w"))
    ended = ids.get("w")
    assert ended is not None and (ended.turn_id, ended.outcome) == ("tw", "replied")
    for n in range(3):
        ids.fold(_arrived(f"j{n}"))
    assert "w" not in ids and len(ids) == 3  # ended, then forgotten in its turn
    # A run still waiting is held past the limit, every input of it (the queue holds
    # them all too); the memory comes back to the limit once they ended.
    flood_log = [e for n in range(50) for e in _arrived(f"k{n}")]
    flood = InputIds.of(flood_log, limit=3)
    assert len(flood) == 50 and all(f"k{n}" in flood for n in range(50))
    flood.fold([InputReleased(input_id=f"k{n}", reason="stopped") for n in range(50)])
    flood.fold(_arrived("z"))
    assert len(flood) == 3 and "z" in flood


def test_no_input_still_waiting_is_forgotten_in_a_flood(
    runtime: Runtime, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice the limit of inputs waiting at once (behind a running turn) forgot one of
    them while it waited (the memory was capped at twice the limit): sent again after it
    ran, it ran twice. Every one is kept while it waits, and answered once it ran, live
    and after a rebuild from the log; the memory holds at most the limit plus twice the
    inputs waiting (the queue holds them anyway)."""
    monkeypatch.setattr(inputs_module, "KEEP_INPUT_IDS", 2)
    gate.go.clear()
    first = runtime.submit(SID, Input(id="w", content="第0句"))
    assert gate.called.wait(10)  # its turn runs: the others wait behind it
    flood = [Input(id=f"q{n}", content=f"第{n + 1}句") for n in range(5)]
    handles = [runtime.submit(SID, inp) for inp in flood]
    assert [h.where for h in handles] == ["pending"] * 5  # waiting to join the turn
    gate.go.set()
    outcomes = [first.result(10), *(h.result(10) for h in handles)]
    assert all(o.outcome == "replied" for o in outcomes)
    calls = gate.calls
    for inp, outcome in zip([Input(id="w", content="第0句"), *flood], outcomes, strict=True):
        assert _again(runtime, inp) == outcome
    assert gate.calls == calls  # none ran twice
    # a session rebuilt from its log answers them as the live one did
    live = runtime.store.read(SID)
    whole = InputIds.of(live, limit=2)
    parts = InputIds(limit=2)
    for event in live:
        parts.fold([event])
    assert [whole.get(i) for i in ("w", *(inp.id for inp in flood))] == [
        parts.get(i) for i in ("w", *(inp.id for inp in flood))
    ]


def test_a_cancelled_asubmit_sent_again_gets_the_same_turn() -> None:
    gate = Gate()
    rt = _runtime(InMemoryEventStore(), gate)
    accepted, go_on = threading.Event(), threading.Event()

    def hold_the_submit(topic: str, payload: Any) -> None:
        # Called on the submitting thread once the input is durable and its turn opened:
        # the submit has not returned to the event loop yet.
        accepted.set()
        assert go_on.wait(10)

    unsubscribe = rt.services.bus.subscribe("turn:opened", hold_the_submit)

    async def main() -> tuple[TurnResult, TurnResult, str, str]:
        async with AsyncRuntime(rt) as agent:
            gate.go.clear()
            inp = Input(id="x", content="你好")
            task = asyncio.create_task(agent.asubmit(SID, inp))
            assert await asyncio.to_thread(accepted.wait, 10)
            task.cancel()
            unsubscribe()
            go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(gate.called.wait, 10)
            live = await agent.asubmit(SID, inp)  # while its turn runs: that turn's handle
            gate.go.set()
            result = await live.result(10)
            over = await agent.asubmit(SID, inp)  # once it is over: its recorded result
            return result, await over.result(10), live.where, over.where

    try:
        result, recorded, live_where, over_where = asyncio.run(main())
    finally:
        gate.go.set()
        rt.shutdown(timeout=10)
    assert (live_where, over_where) == ("opened", "handled")
    assert result == recorded
    assert result.outcome == "replied" and result.reply == "答1"
    assert gate.calls == 1 and _received(rt.store, "x") == 1


def _turn(turn_id: str, *input_ids: str, outcome: Any = "replied", reason: Any = None) -> list:
    """A turn's events as the log holds them: its inputs joining, its reply, its record."""
    events: list[Any] = [
        InputJoined(input_id=i, turn_id=turn_id, entry="opened" if n == 0 else "joined")
        for n, i in enumerate(input_ids)
    ]
    if outcome == "replied":
        reply = ChatMessage(
            id=f"m-{turn_id}",
            role="assistant",
            content=f"答 {turn_id}",
            meta=MessageMeta(
                turn_id=turn_id, turn_record=TurnRecord(turn_id=turn_id, outcome="replied")
            ),
        )
        events.append(MessageSaved(message=reply))
    events.append(TurnRecorded(turn_id=turn_id, outcome=outcome, reason=reason))
    return events


def _arrived(*input_ids: str) -> list:
    return [InputReceived(input=Input(id=i, content=f"说 {i}")) for i in input_ids]


def test_an_input_put_back_by_recovery_is_answered_by_the_turn_that_ran_it() -> None:
    log = [
        *_arrived("a", "b"),
        *_turn("t1", "a", "b")[:2],  # both joined t1, cut by a crash
        InputRequeued(input_id="b", turn_id="t1"),  # b never reached the model
        TurnRecorded(turn_id="t1", outcome="aborted", reason="crash"),
        *_turn("t2", "b"),
    ]
    log = [msgspec.structs.replace(e, seq=n) for n, e in enumerate(log, 1)]
    waiting = InputIds.of(log[:-3])  # b waits again: not over, whatever t1's record says
    assert waiting.get("b") == Handled(digest(Input(id="b", content="说 b")), "t1")
    ids = InputIds.of(log)
    a, b = ids.get("a"), ids.get("b")
    assert a is not None and (a.turn_id, a.outcome, a.reason) == ("t1", "aborted", "crash")
    # The reply is kept as its seq (its text is read back from the log when asked for).
    assert b is not None and (b.turn_id, b.outcome, b.reply_seq) == ("t2", "replied", len(log) - 1)
    assert log[len(log) - 2].message.content == "答 t2"


def test_the_fold_gives_the_same_in_any_cut_of_the_log() -> None:
    # As the actor folds it: commit by commit, after each append.
    log = [
        *_arrived("a"),
        *_turn("t1", "a"),
        *_arrived("b", "c"),
        InputReleased(input_id="c", reason="stop-all", archived=True),
        *_turn("t2", "b", outcome="aborted", reason="stop"),
        *_arrived("a"),  # an id received again (forgotten, or from another tool)
        *_turn("t3", "a", outcome="error", reason="boom"),
    ]
    whole = InputIds.of(log)
    expected = {i: whole.get(i) for i in "abc"}
    assert expected["a"] == Handled(digest(Input(id="a", content="说 a")), "t3", "error", "boom")
    assert expected["c"] == Handled(
        digest(Input(id="c", content="说 c")), None, "released", "stop-all"
    )
    for cut in range(len(log) + 1):
        parts = InputIds()
        parts.fold(log[:cut])
        parts.fold(log[cut:])
        assert {i: parts.get(i) for i in "abc"} == expected, cut
    with pytest.raises(ValueError, match="limit >= 1"):
        InputIds(0)


def test_the_record_keeps_no_reply_text_once_the_log_is_let_go() -> None:
    """A session remembers up to 10,000 inputs: it keeps where each reply was saved, not
    its text (read back from the log when an input is sent again), so a session of long
    replies does not hold them all in memory."""
    import gc
    import tracemalloc

    tracemalloc.start()
    try:
        log: list[Any] = []
        for n in range(200):
            log += _arrived(f"i{n}")
            turn = _turn(f"t{n}", f"i{n}")
            reply = turn[1].message
            long = msgspec.structs.replace(reply, content=f"{n}" + "长" * 25_000)  # 75 KB
            turn[1] = MessageSaved(message=long)
            log += turn
        log = [msgspec.structs.replace(e, seq=n) for n, e in enumerate(log, 1)]
        ids = InputIds.of(log)
        del log, turn, reply, long
        gc.collect()
        kept, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ids) == 200 and ids.get("i7") is not None
    assert kept < 1_000_000, kept  # the replies alone are 15 MB
