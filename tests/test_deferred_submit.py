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
