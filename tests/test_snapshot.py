"""token:request snapshots (ACC3): built like a real turn, writing and logging nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from aalis_agent.actors.hooks import Contribution, ContributionView
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, InMemoryEventStore, Input, SequentialIds
from aalis_agent.request.tokens import count_messages, default_counter
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    StaticSessions,
    Usage,
)
from structlog.testing import capture_logs


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    sessions = StaticSessions(
        {
            "room": SessionInfo("room", origin_platform="qq", multi_party=True),
            "child": SessionInfo("child", parent_id="room"),
        }
    )
    model = ScriptedModel(
        lambda r, n: ScriptedReply(text=f"回答{n}", usage=Usage(prompt_tokens=999))
    )
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=model, sessions=sessions),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    yield rt
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize(
    ("session", "explicit", "expected"),
    [("room", "tg", "tg"), ("room", None, "qq"), ("child", None, "qq"), ("dm", None, "webui")],
)
def test_snapshot_platform(
    runtime: Runtime, session: str, explicit: str | None, expected: str
) -> None:
    assert runtime.token_request(session, explicit).platform == expected


def test_a_snapshot_is_an_estimate_with_no_turn_id_and_writes_nothing(runtime: Runtime) -> None:
    for text in ("一", "二", "三"):
        runtime.submit("room", Input(id="", content=text, platform="qq")).result(10)
    runtime.wait_idle(10)
    before = len(runtime.store.read("room"))
    seen: list[Any] = []
    runtime.subscribe("token:usage", lambda t, p: seen.append(p))
    with capture_logs() as logs:
        usage = runtime.token_request("room")
    assert usage.turn_id is None
    assert usage.used != 999 and usage.used > 0  # the estimate, never a provider count
    assert usage.history_messages == 6
    assert len(runtime.store.read("room")) == before  # nothing written
    assert logs == []  # no logs
    assert seen and seen[0]["turnId"] is None  # a snapshot carries no turn id


def test_contributions_see_a_dry_run(runtime: Runtime) -> None:
    views: list[ContributionView] = []
    runtime.hooks.contribute(
        Contribution("mem", "s", "knowledge", lambda v: views.append(v) or "摘要")
    )  # type: ignore[func-returns-value]
    usage = runtime.token_request("room")
    assert [v.dry_run for v in views] == [True]
    assert usage.breakdown.memory_summary == 0 and usage.breakdown.system_other > 0


def test_the_snapshot_reads_history_like_the_next_turn(runtime: Runtime) -> None:
    for text in ("一", "二"):
        runtime.submit("room", Input(id="", content=text, platform="qq")).result(10)
    runtime.wait_idle(10)
    snap = runtime.token_request("room")
    real: list[Any] = []
    runtime.subscribe("token:usage", lambda t, p: real.append(p))
    runtime.submit("room", Input(id="", content="三", platform="qq")).result(10)
    runtime.wait_idle(10)
    assert real[0]["historyMessages"] == snap.history_messages
    assert real[0]["tokenBudget"] == snap.token_budget


def test_a_snapshot_and_the_next_turns_first_call_cut_and_count_history_alike() -> None:
    """One way to build a request: the snapshot and a turn's call share the trim and the
    accounting (actors/request.py), so over a history long enough to be cut they agree on
    the budget, the cut and what the history costs."""
    model = ScriptedModel(lambda r, n: ScriptedReply(text=f"回答 {n} " + "很长的回答" * 40))
    model.context_length, model.max_output_tokens = 4000, 1000
    rt = Runtime(
        InMemoryEventStore(), Services(llm=model), FixedClock(), SequentialIds(), janitor=False
    )
    try:
        for n in range(30):
            rt.submit("s", Input(id="", content=f"第 {n} 个问题" + "细节" * 30)).result(10)
        snapshot = rt.token_request("s", "cli")  # the platform the turn will read for
        rt.submit("s", Input(id="", content="再问一个")).result(10)
        turn = [e.usage for e in rt.store.read("s") if type(e).__name__ == "UsageRecorded"][-1]
        assert snapshot.trimmed and turn.trimmed
        assert (snapshot.token_budget, snapshot.untrimmed_history) == (
            turn.token_budget,
            turn.untrimmed_history,
        )
        # The same history was kept; the turn's history part also counts its new input.
        sent = model.requests[-1].messages
        new_input = [m for m in sent if m.role == "user"][-1]
        counted = count_messages(default_counter(), [new_input])
        assert turn.breakdown.history - snapshot.breakdown.history == counted
    finally:
        rt.shutdown(timeout=10)
