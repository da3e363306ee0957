"""A session actor handles the runtime's submits and its turn runner's reports on the
calling thread, under the lock its mailbox thread takes (SessionActor.call): the same
one-at-a-time guarantee as an ask, without the thread hops. These tests pin what that
path must keep: where the work runs, what a callback calling back into its own session
gets, and a submit racing the actor's passivation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, InputReceived, SequentialIds
from aalis_agent.services import ScriptedModel, ScriptedReply, Services

SID = "user:direct"


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    services = Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text=f"好{n}")))
    rt = Runtime(
        InMemoryEventStore(), services, FixedClock(step_ms=5), SequentialIds(), janitor=False
    )
    yield rt
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def test_submit_commits_on_the_callers_thread_and_the_turn_on_its_runners(
    runtime: Runtime,
) -> None:
    seen: dict[str, list[str]] = {}

    def record(topic: str, payload: Any) -> None:
        seen.setdefault(topic, []).append(threading.current_thread().name)

    runtime.subscribe("turn:opened", record)
    runtime.subscribe("turn:ended", record)
    outcome = runtime.submit(SID, Input(id="", content="你好")).result(10)
    assert outcome.outcome == "replied"
    # The input's commit opened the turn on the submitting thread, not a mailbox thread.
    assert seen["turn:opened"] == [threading.current_thread().name]
    # The turn's end was committed by its runner, on a turn worker.
    assert seen["turn:ended"][0].startswith("turn-")


def test_a_callback_calling_into_its_own_session_gets_an_error_not_a_hang(
    runtime: Runtime,
) -> None:
    errors: list[BaseException] = []

    def submit_again(topic: str, payload: Any) -> None:
        try:
            runtime.submit(SID, Input(id="", content="again"))
        except BaseException as exc:
            errors.append(exc)

    unsubscribe = runtime.subscribe("turn:ended", submit_again)
    started = time.monotonic()
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    unsubscribe()
    assert time.monotonic() - started < runtime.ask_timeout_s  # no wait for itself
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert SID in str(errors[0]) and "another thread" in str(errors[0])
    # The session goes on, and the refused input was never written.
    assert runtime.submit(SID, Input(id="", content="二")).result(10).outcome == "replied"
    contents = [e.input.content for e in runtime.store.read(SID) if isinstance(e, InputReceived)]
    assert contents == ["一", "二"]


def test_a_submit_racing_passivation_goes_to_a_fresh_actor(runtime: Runtime) -> None:
    assert runtime.submit(SID, Input(id="", content="一")).result(10).outcome == "replied"
    old = runtime._entries[SID].actor
    reached = threading.Event()
    refused: list[BaseException] = []
    call = old.call

    def watched(message: Any, timeout: float | None = None) -> Any:
        reached.set()
        try:
            return call(message, timeout)
        except BaseException as exc:
            refused.append(exc)
            raise

    old.call = watched  # type: ignore[method-assign]
    unregister = runtime.unregister_if_idle

    def slow_unregister(session_id: str, actor: Any) -> bool:
        # The passivating actor holds its lock here; let the submit reach that lock.
        assert reached.wait(10)
        time.sleep(0.05)
        return unregister(session_id, actor)

    runtime.unregister_if_idle = slow_unregister  # type: ignore[method-assign]
    passivated: list[int] = []
    passivating = threading.Thread(target=lambda: passivated.append(runtime.passivate_idle(0)))
    passivating.start()
    while not old._lock.locked():  # the Passivate message is being handled
        time.sleep(0.001)
    handle = runtime.submit(SID, Input(id="", content="二"))
    passivating.join(10)
    assert passivated == [1]
    assert len(refused) == 1 and isinstance(refused[0], pykka.ActorDeadError)
    assert handle.result(10).outcome == "replied"
    assert runtime._entries[SID].actor is not old
    contents = [e.input.content for e in runtime.store.read(SID) if isinstance(e, InputReceived)]
    assert contents == ["一", "二"]  # written once, by the fresh actor
