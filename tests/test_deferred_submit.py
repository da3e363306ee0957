"""An input submitted while its session winds down a deletion or a clear (the running
turn is stopped and must settle first) is acknowledged only once it is in the log.

It used to be acknowledged at once as ``deferred`` and kept in memory until the wind-down
was over: a crash meanwhile lost an input whose ``submit`` had returned. And ``run``
with such an input left the turn it opened unstarted (the turn was held for a caller
that had already gone on to wait for it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import InputReceived

from aalis_agent import (
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    SqliteEventStore,
    Tool,
    ToolCall,
    ToolRegistry,
)
from tests.harness import GatedTool


def _runtime(tmp_path: Path, tool: GatedTool) -> tuple[Runtime, SqliteEventStore]:
    def reply(request: Any, n: int) -> ScriptedReply:
        if n == 1:  # the first turn's call runs the slow tool
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name=tool.name, arguments="{}"),))
        return ScriptedReply(text=f"好{n}")

    store = SqliteEventStore(tmp_path / "log.db")
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool(tool.name, tool)]))
    return Runtime(store, services, janitor=False), store


def _received(store: SqliteEventStore, input_id: str) -> bool:
    return any(isinstance(e, InputReceived) and e.input.id == input_id for e in store.read("s"))


@pytest.mark.parametrize("call", ["submit", "run", "clear"])
def test_an_input_during_a_wind_down_is_acknowledged_once_it_is_in_the_log(
    tmp_path: Path, call: str
) -> None:
    tool = GatedTool()  # ignores the stop: the wind-down waits for it
    runtime, store = _runtime(tmp_path, tool)
    try:
        first = runtime.submit("s", Input(id="first", content="一"))
        tool.wait_running()
        winding = threading.Thread(
            target=(runtime.clear if call == "clear" else runtime.delete), args=("s",)
        )
        winding.start()
        deadline = time.monotonic() + 5
        while not runtime.view("s").queue.running or not _stopped(runtime):
            assert time.monotonic() < deadline, "the wind-down did not begin"
            time.sleep(0.01)
        answer: dict[str, Any] = {}

        def send() -> None:
            inp = Input(id="later", content="二")
            if call == "run":
                answer["result"] = runtime.run("s", inp)
            else:
                answer["result"] = runtime.submit("s", inp)
            answer["in_log"] = _received(store, "later")  # at the moment it returned

        sender = threading.Thread(target=send)
        sender.start()
        sender.join(0.5)
        assert sender.is_alive(), "acknowledged while its session was still winding down"
        assert not _received(store, "later")
        tool.release()
        sender.join(10)
        winding.join(10)
        assert not sender.is_alive() and not winding.is_alive()
        assert answer["in_log"] is True
        if call == "run":
            assert answer["result"].outcome == "replied"
        else:
            assert answer["result"].where == "opened"
            assert answer["result"].result(10).outcome == "replied"
        assert first.result(10).outcome in ("aborted", "released")
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
        store.close()


def _stopped(runtime: Runtime) -> bool:
    running = runtime.view("s").queue.running
    return running is not None and running.stop_requested


def _wait_stopping(runtime: Runtime, *sessions: str) -> None:
    deadline = time.monotonic() + 5
    while not all(
        (r := runtime.view(s).queue.running) is not None and r.stop_requested for s in sessions
    ):
        assert time.monotonic() < deadline, "the wind-down did not begin"
        time.sleep(0.01)


def test_tools_that_submit_to_each_others_sessions_during_both_deletions_do_not_deadlock(
    tmp_path: Path,
) -> None:
    """A submit from inside a turn does not wait for a wind-down (that turn, or one it
    waits on, may be what the wind-down waits for): A's tool submits to B and B's to A
    while both are deleted; both deletions return."""
    go = {"A": threading.Event(), "B": threading.Event()}
    in_tool = {"A": threading.Event(), "B": threading.Event()}
    told: dict[str, str] = {}

    def notify(args: Any, ctx: Any) -> str:
        other = "B" if ctx.session_id == "A" else "A"
        in_tool[ctx.session_id].set()
        go[ctx.session_id].wait(10)
        told[ctx.session_id] = runtime.submit(other, Input(id="", content="hi")).where
        return "told"

    def reply(request: Any, n: int) -> ScriptedReply:
        if request.messages[-1].role == "tool":
            return ScriptedReply(text="done")
        return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="notify", arguments="{}"),))

    store = SqliteEventStore(tmp_path / "log.db")
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("notify", notify)]))
    runtime = Runtime(store, services, janitor=False)
    try:
        handles = {s: runtime.submit(s, Input(id="", content="go")) for s in "AB"}
        assert all(e.wait(5) for e in in_tool.values())
        deletes = {s: threading.Thread(target=runtime.delete, args=(s,), daemon=True) for s in "AB"}
        for thread in deletes.values():
            thread.start()
        _wait_stopping(runtime, "A", "B")
        go["A"].set()  # A's tool submits to B, whose deletion waits for B's tool
        deadline = time.monotonic() + 10
        while "A" not in told:
            assert time.monotonic() < deadline, "A's submit waited for B's wind-down"
            time.sleep(0.01)
        assert told["A"] == "deferred"  # held back, not waited for from inside a turn
        go["B"].set()
        for thread in deletes.values():
            thread.join(10)
        assert not any(t.is_alive() for t in deletes.values()), "deadlocked"
        assert set(told) == {"A", "B"}
        assert {h.result(5).reason for h in handles.values()} == {"delete"}
    finally:
        for event in go.values():
            event.set()
        runtime.shutdown(timeout=10)
        store.close()


def test_a_clear_or_delete_from_a_callback_of_the_same_session_is_refused(
    tmp_path: Path,
) -> None:
    """A ``turn:ended`` subscriber runs while its session handles a message: a clear or
    delete of that session would wait for itself (it hung for good); it is refused, as
    a submit from there is."""
    tool = GatedTool()
    runtime, store = _runtime(tmp_path, tool)
    errors: list[str] = []

    def on_ended(topic: str, payload: Any) -> None:
        for call in (runtime.clear, runtime.delete):
            try:
                call(payload["sessionId"], timeout=5)
            except RuntimeError as exc:
                errors.append(str(exc))

    runtime.subscribe("turn:ended", on_ended)
    try:
        handle = runtime.submit("s", Input(id="", content="一"))
        tool.release()
        assert handle.result(10).outcome == "replied"
        assert len(errors) == 2 and all("would wait for itself" in e for e in errors)
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
        store.close()


def test_a_failed_write_ending_a_wind_down_answers_the_deletion_and_the_held_inputs(
    tmp_path: Path,
) -> None:
    """The write that records the deletion fails: the session is fenced, ``delete``
    raises SessionFailed (it waited for good), and the inputs held back meanwhile are
    refused, none of them written by the fenced actor."""
    from aalis_agent.events import SessionDeleted, SessionFailed

    class FailingDelete(SqliteEventStore):
        def append(self, session_id: str, events: Any, *args: Any, **kwargs: Any) -> int:
            if any(isinstance(e, SessionDeleted) for e in events):
                raise OSError("disk I/O error (injected)")
            return super().append(session_id, events, *args, **kwargs)

    tool = GatedTool()
    store = FailingDelete(tmp_path / "log.db")
    services = Services(
        llm=ScriptedModel(
            [ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),))]
        ),
        tools=ToolRegistry([Tool(tool.name, tool)]),
    )
    runtime = Runtime(store, services, janitor=False)
    out: dict[str, Any] = {}

    def call(name: str, fn: Any) -> threading.Thread:
        def run() -> None:
            try:
                out[name] = fn()
            except Exception as exc:
                out[name] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    try:
        runtime.submit("s", Input(id="first", content="一"))
        tool.wait_running()
        deleting = call("delete", lambda: runtime.delete("s"))
        _wait_stopping(runtime, "s")
        senders = [
            call(i, lambda i=i: runtime.submit("s", Input(id=i, content=i))) for i in ("d1", "d2")
        ]
        deadline = time.monotonic() + 5
        while len(runtime._entries["s"].actor._deferred) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tool.release()
        for thread in (deleting, *senders):
            thread.join(10)
            assert not thread.is_alive(), "left waiting"
        assert isinstance(out["delete"], SessionFailed)
        assert all(isinstance(out[i], Exception) for i in ("d1", "d2"))
        assert not {"d1", "d2"} & {
            e.input.id for e in store.read("s") if isinstance(e, InputReceived)
        }
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
        store.close()


def test_an_async_submit_held_back_by_a_deletion_does_not_hold_a_thread(
    tmp_path: Path,
) -> None:
    """``asubmit`` waits for a held-back input on the event loop: with two threads in
    the AsyncRuntime's pool, two such submits leave calls for other sessions free."""
    import asyncio

    from aalis_agent import AsyncRuntime

    tool = GatedTool()
    runtime, store = _runtime(tmp_path, tool)

    async def main() -> None:
        async with AsyncRuntime(runtime, threads=2) as aruntime:
            await aruntime.asubmit("s", Input(id="first", content="一"))
            await asyncio.to_thread(tool.wait_running)
            deleting = asyncio.ensure_future(asyncio.to_thread(runtime.delete, "s"))
            await asyncio.to_thread(_wait_stopping, runtime, "s")
            held = [
                asyncio.ensure_future(aruntime.asubmit("s", Input(id=i, content=i)))
                for i in ("d1", "d2")
            ]
            await asyncio.sleep(0.2)
            assert not any(h.done() for h in held)  # not acknowledged yet
            other = await asyncio.wait_for(aruntime.asubmit("other", "你好"), 5)
            assert other.where == "opened"
            tool.release()
            await deleting
            wheres = [(await h).where for h in held]
            assert wheres[0] == "opened" and wheres[1] in ("queued", "pending")

    try:
        asyncio.run(main())
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
        store.close()


def _own_session_tool_runtime(tmp_path: Path, handler: Any) -> tuple[Runtime, SqliteEventStore]:
    def reply(request: Any, n: int) -> ScriptedReply:
        if n == 1:
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="own", arguments="{}"),))
        return ScriptedReply(text=f"好{n}")

    store = SqliteEventStore(tmp_path / "log.db")
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("own", handler)]))
    return Runtime(store, services, janitor=False), store


@pytest.mark.parametrize("call", ["delete", "clear", "run"])
def test_a_tool_asking_to_delete_clear_or_run_its_own_session_is_refused(
    tmp_path: Path, call: str
) -> None:
    """A tool of the session's running turn that deletes, clears or runs (and waits for)
    that very session would wait for the turn, which waits for the tool: the session hung
    for good, every later submit with it. The call is refused with RuntimeError (the tool
    reports it to the model), the turn ends, and the session goes on."""
    runtime: Runtime
    errors: list[str] = []

    def own(args: Any, ctx: Any) -> str:
        try:
            if call == "run":
                runtime.run(ctx.session_id, Input(id="inner", content="二"))
            else:
                getattr(runtime, call)(ctx.session_id, timeout=5)
        except RuntimeError as exc:
            errors.append(str(exc))
            raise
        return "done"

    runtime, store = _own_session_tool_runtime(tmp_path, own)
    try:
        assert runtime.submit("s", Input(id="", content="一")).result(10).outcome == "replied"
        assert len(errors) == 1
        assert f"session 's': {call} was called from within its own running turn" in errors[0]
        assert not _received(store, "inner")  # a refused run accepted nothing
        assert runtime.submit("s", Input(id="", content="三")).result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_a_tool_may_delete_its_own_session_from_another_thread(tmp_path: Path) -> None:
    """What the refusal advises: a deletion asked from another thread, not waited for in
    the tool, stops the turn and goes through once the tool returns."""
    from aalis_agent.events import SessionDeleted

    runtime: Runtime
    deleted: list[int] = []

    def own(args: Any, ctx: Any) -> str:
        threading.Thread(target=lambda: deleted.append(runtime.delete(ctx.session_id))).start()
        ctx.abort.wait(10)  # the deletion stops the turn
        return "done"

    runtime, store = _own_session_tool_runtime(tmp_path, own)
    try:
        outcome = runtime.submit("s", Input(id="", content="一")).result(10)
        assert (outcome.outcome, outcome.reason) == ("aborted", "delete")
        deadline = time.monotonic() + 10
        while not deleted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert deleted == [1]
        assert any(isinstance(e, SessionDeleted) for e in store.read("s"))
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_an_async_tool_asking_to_delete_its_own_session_through_asyncruntime_is_refused(
    tmp_path: Path,
) -> None:
    """The same from an ``async`` tool (it runs on a loop thread, not the turn's): the
    turn's context goes with it, into AsyncRuntime's calls."""
    import asyncio

    from aalis_agent import AsyncRuntime

    aruntime: AsyncRuntime
    errors: list[str] = []

    async def own(args: Any, ctx: Any) -> str:
        try:
            await aruntime.adelete(ctx.session_id, timeout=5)
        except RuntimeError as exc:
            errors.append(str(exc))
            raise
        return "done"

    runtime, store = _own_session_tool_runtime(tmp_path, own)

    async def main() -> None:
        nonlocal aruntime
        async with AsyncRuntime(runtime) as aruntime:
            result = await asyncio.wait_for(await aruntime.asubmit("s", "一"), 10)
            assert result.outcome == "replied"

    try:
        asyncio.run(main())
        assert (
            len(errors) == 1 and "delete was called from within its own running turn" in (errors[0])
        )
    finally:
        store.close()


def test_a_tool_may_clear_what_does_not_stop_its_own_turn(tmp_path: Path) -> None:
    """Only a clear of the context stops the turn and waits: one of other kinds from the
    turn's own tool is recorded at once, as before."""
    from aalis_agent.events import ContextCleared

    runtime: Runtime

    def own(args: Any, ctx: Any) -> str:
        runtime.clear(ctx.session_id, ("memory",), timeout=5)
        return "cleared"

    runtime, store = _own_session_tool_runtime(tmp_path, own)
    try:
        assert runtime.submit("s", Input(id="", content="一")).result(10).outcome == "replied"
        assert [e.kinds for e in store.read("s") if isinstance(e, ContextCleared)] == [("memory",)]
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_a_task_a_turn_started_may_delete_its_session_once_the_turn_ended(
    tmp_path: Path,
) -> None:
    """The turn's mark goes with the context into what its tool starts; once the turn
    has ended, a deletion from there is not "from within its own turn"."""
    import asyncio

    runtime: Runtime
    later: list[Any] = []

    async def own(args: Any, ctx: Any) -> str:
        async def after_the_turn() -> int:
            await asyncio.sleep(0.3)
            return await asyncio.to_thread(runtime.delete, ctx.session_id, 10)

        later.append(asyncio.ensure_future(after_the_turn()))
        return "started"

    runtime, store = _own_session_tool_runtime(tmp_path, own)
    try:
        assert runtime.submit("s", Input(id="", content="一")).result(10).outcome == "replied"
        deadline = time.monotonic() + 10
        while not (later and later[0].done()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert later[0].result() == 1
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_run_from_another_sessions_tool_during_a_wind_down_is_answered(
    tmp_path: Path,
) -> None:
    """``run`` of "s" from a tool of "t" while "s" winds down a deletion is deferred and
    not waited for there; its turn, once handed on, was held for a caller that had gone
    (the tool then waited for good). A worker runs it now."""
    tool = GatedTool()  # s's tool ignores the stop: the wind-down waits for it
    runtime: Runtime
    got: list[str] = []

    def reply(request: Any, n: int) -> ScriptedReply:
        content = request.messages[-1].content
        if request.messages[-1].role == "user" and content.endswith(("go", "run")):
            name = tool.name if content.endswith("go") else "runner"
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name=name, arguments="{}"),))
        return ScriptedReply(text="好")

    def runner(args: Any, ctx: Any) -> str:
        got.append(runtime.run("s", Input(id="", content="from t")).outcome)
        return got[-1]

    store = SqliteEventStore(tmp_path / "log.db")
    tools = ToolRegistry([Tool(tool.name, tool), Tool("runner", runner)])
    runtime = Runtime(store, Services(llm=ScriptedModel(reply), tools=tools), janitor=False)
    try:
        runtime.submit("s", Input(id="", content="go"))
        tool.wait_running()
        deleting = threading.Thread(target=runtime.delete, args=("s",))
        deleting.start()
        time.sleep(0.2)  # winding down
        handle = runtime.submit("t", Input(id="", content="run"))
        time.sleep(0.2)
        tool.release()
        deleting.join(10)
        assert handle.result(10).outcome == "replied"
        assert got == ["replied"]
    finally:
        tool.release(10)
        runtime.shutdown(timeout=10)
        store.close()
