"""The runtime and its scheduler end to end (SCH1-SCH8, DEL1-DEL2, CMD3, SAVE6, ES4)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta, timezone
from typing import Any

import pykka
import pytest
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.messages import Ping, Submit
from aalis_agent.actors.runtime import Runtime, RuntimeClosed
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    InputHeld,
    InputJoined,
    InputQueued,
    InputReleased,
    InputRequeued,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    Sender,
    SequentialIds,
    SessionDeleted,
    SessionEvent,
    SessionFailed,
    StopMarkerSaved,
    StopRequested,
    ToolCall,
    ToolFinished,
    TurnOpened,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
)
from aalis_agent.projections import history, project, turns
from aalis_agent.request.texts import (
    BATCH_NO_REPLY_NEEDED,
    BATCH_PREFIX,
    FOCUS_GUIDE_HEAD,
    NO_RUNNING_TURN,
    STOP_DENIED,
    STOP_MARKER_PREFIX,
)
from aalis_agent.request.validate import provider_violations
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    StaticAuthority,
    StaticSessions,
    Tool,
    ToolRegistry,
)
from structlog.testing import capture_logs

from tests.harness import GatedModel, GatedTool, settle

SID = "qq:group:1"


@dataclass
class Rig:
    runtime: Runtime
    store: InMemoryEventStore
    model: GatedModel
    tool: GatedTool
    sessions: StaticSessions
    bus_events: list[tuple[str, Any]] = field(default_factory=list)

    def settle(self) -> None:
        settle(self.runtime, self.model, (self.tool,))

    def log(self, session_id: str = SID) -> list[SessionEvent]:
        return self.store.read(session_id)

    def of(self, kind: type, session_id: str = SID) -> list[Any]:
        return [e for e in self.log(session_id) if isinstance(e, kind)]

    def submit(self, content: str, session_id: str = SID, **kw: Any) -> Any:
        handle = self.runtime.submit(session_id, Input(id="", content=content, **kw))
        self.settle()
        return handle


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    """Wait for something another thread does (polling on a short interval)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.002)


def human(user: str, addressed: bool | None = None, **kw: Any) -> dict[str, Any]:
    """A human input's fields; ``addressed`` picks the trigger wasAddressed follows."""
    if addressed is not None:
        kw["trigger_type"] = "direct" if addressed else "interval"
    return {"sender": Sender(user_id=user, nickname=f"昵称{user}"), "platform": "qq", **kw}


@pytest.fixture
def rig() -> Iterator[Rig]:
    store = InMemoryEventStore()
    model = GatedModel()
    tool = GatedTool()
    sessions = StaticSessions()
    services = Services(
        llm=model,
        tools=ToolRegistry([Tool("slow", tool)]),
        authority=StaticAuthority([("qq", "owner"), ("tg", "owner-tg")]),
        sessions=sessions,
    )
    services.tz = timezone(timedelta(hours=8))
    runtime = Runtime(store, services, FixedClock(step_ms=5), SequentialIds(), janitor=False)
    r = Rig(runtime, store, model, tool, sessions)
    runtime.subscribe("*", lambda topic, payload: r.bus_events.append((topic, payload)))
    yield r
    tool.release(100)
    runtime.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


CALL = ToolCall(id="call-1", name="slow", arguments="{}")


def test_one_turn_at_a_time_and_new_messages_never_interrupt(rig: Rig) -> None:  # SCH1
    first = rig.submit("第一条", **human("a"))
    second = rig.submit("第二条", **human("b"))
    assert (first.where, second.where) == ("opened", "pending")
    assert len(rig.of(TurnOpened)) == 1
    assert len(rig.model.calls) == 1  # the running call was not restarted or interrupted
    rig.model.answer("好")
    rig.settle()
    assert [e.outcome for e in rig.of(TurnRecorded)] == ["replied"]


def test_human_inserts_join_before_the_next_call_after_the_tool_batch(rig: Rig) -> None:  # SCH2
    rig.submit("查一下", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    inserted = rig.submit("顺便也看看这个", **human("b", addressed=False))
    assert inserted.where == "pending"
    rig.tool.release()
    rig.settle()
    second = rig.model.wait_call().request
    roles = [(m.role, m.content) for m in second.messages]
    assert roles[-4:] == [
        ("user", "(1/1 08:00) [昵称a(a)]: 查一下"),
        ("assistant", ""),
        ("tool", "done"),
        ("user", "(1/1 08:00) [昵称b(b)]: 顺便也看看这个"),
    ]
    joined = [e for e in rig.of(InputJoined) if e.entry == "joined"]
    assert [e.input_id for e in joined] == [inserted.input_id]
    rig.model.answer("好了")
    rig.settle()
    assert inserted.result(1).turn_id == "turn-1"


def test_forty_inserts_join_at_one_insertion_point_as_one_at_a_time_would(rig: Rig) -> None:
    """Forty inputs pending while a tool runs all join before the next call, in arrival
    order, each archived (SCH2, SAVE1): the actor's view after that commit (its events
    folded together) is the fold of its log, and the request carries them all."""
    rig.submit("查一下", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    inserted = [rig.submit(f"插入{n}", **human(f"u{n}", addressed=False)) for n in range(40)]
    assert {h.where for h in inserted} == {"pending"}
    rig.tool.release()
    rig.settle()
    second = rig.model.wait_call().request
    assert [m.content.rsplit(": ", 1)[-1] for m in second.messages[-40:]] == [
        f"插入{n}" for n in range(40)
    ]
    joined = [e for e in rig.of(InputJoined) if e.entry == "joined"]
    assert [e.input_id for e in joined] == [h.input_id for h in inserted]
    assert rig.runtime.view(SID) == project(rig.log())
    running = rig.runtime.view(SID).queue.running
    assert running is not None and running.carried >= {h.input_id for h in inserted}
    rig.model.answer("好了")
    rig.settle()
    assert {h.result(1).turn_id for h in inserted} == {"turn-1"}


def test_forty_queued_inputs_open_the_next_turn_in_one_commit_folded_together(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty humans queued behind an injection's turn open the next turn together (SCH4):
    the commit that opens it joins and archives them all, in arrival order (SAVE1), and
    its events are folded together (``Step.add_all``), not one at a time (each archived
    input then rebuilt the running turn's carried set: 16,000 queued inputs took 2.7 s
    from the tool's release to their turn's end, now 0.6 s). The actor's view is the
    fold of its log."""
    from aalis_agent.actors.scheduler import Step

    rig.submit("定时任务", source="schedule")
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    queued = [rig.submit(f"排队{n}", **human(f"u{n}", addressed=False)) for n in range(40)]
    assert {h.where for h in queued} == {"queued"}
    added_alone: list[SessionEvent] = []
    add = Step.add

    def recorded(step: Step, event: Any) -> Any:
        added_alone.append(event)
        return add(step, event)

    monkeypatch.setattr(Step, "add", recorded)
    rig.tool.release()
    rig.settle()
    rig.model.answer("好")
    rig.settle()
    request = rig.model.wait_call().request
    assert [m.content.rsplit(": ", 1)[-1] for m in request.messages[-40:]] == [
        f"排队{n}" for n in range(40)
    ]
    log = rig.log()
    opened = next(e for e in log if isinstance(e, TurnOpened) and e.turn_id == "turn-2")
    commit = [e for e in log if e.seq > opened.seq][:81]
    assert [type(e) for e in commit] == [InputJoined] * 40 + [MessageSaved] * 40 + [
        ModelCallStarted
    ]
    assert [e.message.meta.input_id for e in commit[40:80]] == [h.input_id for h in queued]
    assert not [
        e
        for e in added_alone
        if isinstance(e, InputJoined) or (isinstance(e, MessageSaved) and e.message.meta.entry)
    ]
    assert rig.runtime.view(SID) == project(log)
    rig.model.answer("都收到了")
    rig.settle()
    assert {h.result(1).turn_id for h in queued} == {"turn-2"}


def test_input_that_misses_the_final_call_waits_for_the_next_turn(rig: Rig) -> None:  # SCH2
    rig.submit("你好", **human("a"))
    late = rig.submit("还有一件事", **human("b"))
    assert late.where == "pending"
    rig.model.answer("你好呀")  # the final call returns without tool calls
    rig.settle()
    first_end = rig.of(TurnRecorded)[0]
    assert first_end.turn_id == "turn-1"
    opened = rig.of(TurnOpened)
    assert [o.input_ids for o in opened] == [("in-1",), (late.input_id,)]
    assert opened[1].from_queue and opened[1].batch_prefix == BATCH_PREFIX
    queued = [e.input_id for e in rig.of(InputQueued)]
    assert queued == [late.input_id]


def test_after_the_call_capped_by_max_tool_iterations_returns_inputs_queue(rig: Rig) -> None:
    """SCH2:「她已经在写最后的回复时才到的(最后一次模型调用返回不带工具调用的回复之后)不再插,
    排到下一轮」. With ``maxToolIterations`` reached the last call is made without tools and
    its reply is the turn's final one, whatever tool calls the model still returns (they are
    not run): an input arriving after it returned is queued, never pending."""
    entered, go = threading.Event(), threading.Event()

    def hold(ctx: Any, next_: Any) -> Any:
        entered.set()
        go.wait(5)
        return next_()

    rig.runtime.hooks.use("agent:reply:before", hold)
    rig.runtime.set_setting(SID, "maxToolIterations", 1)
    rig.submit("查一下", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    rig.tool.release()
    rig.settle()
    last = rig.model.answer("就这样", tool_calls=(ToolCall(id="call-2", name="slow"),))
    assert last.request.tools == ()  # the capped call: no tools offered
    assert entered.wait(5)  # the final reply is being written
    late = rig.runtime.submit(SID, Input(id="", content="晚到的", **human("b")))
    assert late.where == "queued"
    assert not rig.of(InputHeld)
    go.set()
    rig.settle()
    assert len(rig.tool.contexts) == 1  # the capped call's tool call never ran
    assert [e.outcome for e in rig.of(TurnRecorded)] == ["replied"]
    assert rig.model.wait_call().request.messages[-1].content.endswith("晚到的")
    rig.model.answer("好")
    rig.settle()


def test_injections_queue_and_run_alone(rig: Rig) -> None:  # SCH3
    rig.submit("你好", **human("a"))
    notice = rig.submit("定时提醒", source="schedule", trigger_type="interval")
    assert notice.where == "queued"
    rig.model.answer("好")
    rig.settle()
    opened = rig.of(TurnOpened)
    assert opened[1].input_ids == (notice.input_id,) and opened[1].source == "schedule"
    assert opened[1].batch_prefix is None
    # A human message during the injection's turn queues: nothing joins an injection.
    during = rig.submit("在吗", **human("b"))
    assert during.where == "queued"
    rig.model.answer("提醒完毕")
    rig.settle()
    assert rig.of(TurnOpened)[2].input_ids == (during.input_id,)
    assert [e.entry for e in rig.of(InputJoined) if e.turn_id == "turn-2"] == ["opened"]


def test_queue_head_opens_the_next_turn(rig: Rig) -> None:  # SCH4
    rig.submit("一", **human("a"))
    inj = rig.submit("通知", source="host-notice")
    h1 = rig.submit("二", **human("b"))
    rig.model.answer("最终")  # h1 was pending: it missed the final call and queues
    rig.settle()
    h2 = rig.submit("三", **human("c"))
    assert h2.where == "queued"  # the injection's turn is running now
    rig.model.answer("通知已读")
    rig.settle()
    opened = rig.of(TurnOpened)
    assert [o.input_ids for o in opened] == [
        ("in-1",),
        (inj.input_id,),  # the head was the injection: alone
        (h1.input_id, h2.input_id),  # then every queued human input, in arrival order
    ]
    assert opened[2].batch_prefix == BATCH_PREFIX
    rig.model.answer("好")
    rig.settle()
    assert h1.result(1).turn_id == h2.result(1).turn_id == opened[2].turn_id


def test_multi_party_batch_without_address_adds_the_no_reply_line(rig: Rig) -> None:  # SCH4
    rig.sessions.add(SessionInfo(SID, origin_platform="qq", multi_party=True))
    rig.submit("大家好", **human("a"))
    rig.submit("插话", **human("b", addressed=False))
    rig.model.answer("嗨")
    rig.settle()
    opened = rig.of(TurnOpened)[1]
    assert opened.batch_prefix == f"{BATCH_PREFIX}\n{BATCH_NO_REPLY_NEEDED}"
    assert opened.settings.multi_party


def test_settings_are_read_once_when_the_turn_opens(rig: Rig) -> None:  # SCH5
    reads: list[str | None] = []

    class Counting:
        limit = 10

        def for_turn(
            self, session_id: str, platform: str | None, layer: Any, venue: Any = None
        ) -> TurnSettings:
            reads.append(platform)
            return TurnSettings(history_limit=self.limit)

    resolver = Counting()
    rig.runtime.services.settings = resolver
    rig.submit("开轮", **human("a"))
    resolver.limit = 99
    rig.submit("插入", **human("b"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.release()
    rig.settle()
    rig.model.answer("完")
    rig.settle()
    assert rig.of(TurnOpened)[0].settings.history_limit == 10
    assert reads == ["qq"]  # the inserted input did not re-read


def test_stop_while_the_model_streams_abandons_the_call(rig: Rig) -> None:  # SCH6
    first = rig.submit("写一首长诗", **human("a"))
    call = rig.model.wait_call()
    assert rig.runtime.stop(SID, platform="qq", user_id="a") == "turn-1"
    rig.settle()
    assert call.abandoned
    record = rig.of(TurnRecorded)[0]
    assert (record.outcome, record.reason) == ("aborted", "stop")
    assert not [m for m in rig.of(MessageSaved) if m.message.role == "assistant"]
    assert not [t for t, _ in rig.bus_events if t == "outbound:message"]
    marker = rig.of(StopMarkerSaved)[0]
    assert (
        marker.message.content.startswith(STOP_MARKER_PREFIX)
        and "被 a 停下" in marker.message.content
    )
    assert first.result(1).outcome == "aborted"
    # The next turn reads the marker in its history.
    rig.submit("继续", **human("a"))
    sent = rig.model.wait_call().request.messages
    assert any(m.kind == "turn-stopped" for m in sent)


def test_stop_during_a_tool_waits_for_it_and_keeps_the_group(rig: Rig) -> None:  # SCH6
    rig.submit("跑个工具", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    queued = rig.submit("通知", source="schedule")
    rig.runtime.stop(SID, platform="qq", user_id="a")
    rig.settle()
    ctx = rig.tool.contexts[0]
    assert ctx.abort.aborted  # the tool's context carries the turn's abort signal
    assert not rig.of(TurnRecorded)  # the turn waits for the tool to return
    assert len(rig.of(TurnOpened)) == 1  # and queued inputs do not open meanwhile
    rig.tool.release()
    rig.settle()
    assert rig.of(TurnRecorded)[0].outcome == "aborted"
    finished = rig.of(ToolFinished)
    assert finished[0].result == "done"
    window = history.history_window(rig.runtime.view(SID).history)
    assert [m.role for m in window][:3] == ["user", "assistant", "tool"]
    assert rig.of(TurnOpened)[1].input_ids == (queued.input_id,)


def test_pending_inputs_of_a_stopped_turn_open_the_next_one(rig: Rig) -> None:  # SCH6
    rig.submit("一", **human("a"))
    pending = rig.submit("二", **human("b"))
    rig.runtime.stop(SID)
    rig.settle()
    assert rig.of(TurnOpened)[1].input_ids == (pending.input_id,)


@pytest.mark.parametrize("how", ["stop_all", "mute", "shutdown"])
def test_release_archives_after_the_running_turn_settles(rig: Rig, how: str) -> None:  # SCH6
    rig.submit("跑个工具", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    pending = rig.submit("二", **human("b"))
    queued = rig.submit("通知", source="schedule")
    if how == "shutdown":
        done = threading.Thread(target=rig.runtime.shutdown, kwargs={"timeout": 10})
        done.start()
        wait_for(lambda: len(rig.of(InputReleased)) == 2)
    else:
        getattr(rig.runtime, how)(SID)
        rig.settle()
    released = rig.of(InputReleased)
    assert {(e.input_id, e.reason, e.archived) for e in released} == {
        (pending.input_id, how.replace("_", "-"), True),
        (queued.input_id, how.replace("_", "-"), True),
    }
    rig.tool.release()
    if how == "shutdown":
        done.join(10)
    else:
        rig.settle()
    log = rig.log()
    recorded = next(i for i, e in enumerate(log) if isinstance(e, TurnRecorded))
    archived = [
        (i, e.message)
        for i, e in enumerate(log)
        if isinstance(e, MessageSaved)
        and e.message.meta.input_id in (pending.input_id, queued.input_id)
    ]
    assert [m.meta.turn_id for _, m in archived] == [None, None]  # archived without turn id
    assert all(i > recorded for i, _ in archived)  # after the running turn settled
    assert len(rig.of(TurnOpened)) == 1  # nothing opened from the released inputs
    assert pending.result(1).outcome == "released"


@pytest.mark.parametrize("how", ["stop_all", "mute"])
def test_release_waits_for_a_turn_past_its_reply_to_settle(rig: Rig, how: str) -> None:
    """SCH6:「禁言、后台页「全部停止」对子会话、停机连同排队与待插入的一起放掉,放掉的在这个
    会话在跑的一轮落定之后归档(不带回合 id)」: a running turn whose reply is durable is not
    stopped, but it has not settled while its ``agent:turn:after`` runs; the released inputs
    are archived once it has."""
    entered, go = threading.Event(), threading.Event()

    def hold(ctx: Any, next_: Any) -> Any:
        entered.set()
        go.wait(10)
        return next_()

    rig.runtime.hooks.use("agent:turn:after", hold)
    first = rig.runtime.submit(SID, Input(id="", content="问", **human("a")))
    rig.model.answer("答")
    assert entered.wait(5)
    queued = rig.runtime.submit(SID, Input(id="", content="通知", source="schedule"))
    assert getattr(rig.runtime, how)(SID) is None  # past its reply: nothing to stop
    assert [e.input_id for e in rig.of(InputReleased)] == [queued.input_id]
    assert not [e for e in rig.of(MessageSaved) if e.message.meta.input_id == queued.input_id]
    go.set()
    assert first.result(5).outcome == "replied"
    log = rig.log()
    recorded = next(i for i, e in enumerate(log) if isinstance(e, TurnRecorded))
    archived = [
        (i, e.message.meta.turn_id)
        for i, e in enumerate(log)
        if isinstance(e, MessageSaved) and e.message.meta.input_id == queued.input_id
    ]
    assert len(archived) == 1 and archived[0][0] > recorded and archived[0][1] is None


def test_agent_queue_reports_in_arrival_order(rig: Rig) -> None:  # SCH7
    rig.submit("一", **human("a"))
    rig.submit("通知", source="schedule")
    rig.submit("二", **human("b"))
    queues = [p for t, p in rig.bus_events if t == "agent:queue"]
    assert [(i["inputId"], i["state"]) for i in queues[-1]["items"]] == [
        ("in-2", "queued"),
        ("in-3", "pending"),
    ]
    rig.model.answer("好")
    rig.settle()
    # The report after entering the next turn: in-3 left the queue with the turn...
    after = [p for t, p in rig.bus_events if t == "agent:queue"][-1]
    assert [i["inputId"] for i in after["items"]] == ["in-3"]


def test_log_lines_follow_the_format_and_never_carry_text(rig: Rig) -> None:  # SCH8
    with capture_logs() as logs:
        rig.submit("秘密内容", **human("a", gateway_seq=7))
        rig.submit("也是秘密", **human("b", gateway_seq=8))
        rig.submit("提醒", source="schedule", gateway_seq=9)
        rig.runtime.stop(SID)
        rig.settle()
        rig.model.answer("好")
        rig.settle()
    lines = [e["event"] for e in logs]
    assert (
        lines[:4]
        == [
            f"→ 开轮 #7 session={SID} turn=turn-1",
            f"→ 待插入 #8 session={SID}",
            f"→ 排队 #9 session={SID}",
            f"回合结束 turn=turn-1 session={SID} 结局=aborted 原因=stop 用时=10ms 输入 #7",
        ][:4]
        or lines
    )
    assert f"回合结束 turn=turn-1 session={SID} 结局=aborted 原因=stop" in " ".join(lines)
    assert f"→ 排队 #8 session={SID}" in lines  # the pending input waits for the next turn
    assert any(line.startswith("回合结束 turn=turn-2") and "原因" not in line for line in lines)
    text = repr(logs)
    for secret in ("秘密", "昵称", "提醒"):
        assert secret not in text


def test_delete_stops_at_once_releases_unarchived_and_waits(rig: Rig) -> None:  # DEL1
    rig.submit("跑个工具", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    queued = rig.submit("通知", source="schedule")
    result: Future[int] = Future()
    deleter = threading.Thread(target=lambda: result.set_result(rig.runtime.delete(SID)))
    deleter.start()
    rig.settle()
    assert not result.done()  # the wait for the wind-down has no time limit
    released = rig.of(InputReleased)
    assert [(e.input_id, e.reason, e.archived) for e in released] == [
        (queued.input_id, "delete", False)
    ]
    rig.tool.release()
    deleter.join(10)
    assert result.result(1) == 1
    assert not rig.of(ToolFinished)  # no more writes from the deleted turn
    assert not [
        e for e in rig.of(MessageSaved) if e.message.meta.input_id == queued.input_id
    ]  # released unarchived
    assert rig.of(SessionDeleted)[0].generation == 1
    view = rig.runtime.view(SID)
    assert len(view.history.messages) == 0 and view.queue.generation == 1
    # The session works again afterwards.
    rig.submit("新的开始", **human("a"))
    assert len(rig.model.parked) == 1


def test_delete_waits_for_a_turn_past_its_reply_to_end(rig: Rig) -> None:  # DEL1
    """DEL1:「收到 session:deleted 时停下这个会话在跑的一轮、放掉排着的(不归档),并等它收尾,
    之后会话管理才清它的数据」: a turn whose reply is durable can no longer be stopped, but
    it still runs (its ``agent:turn:after`` middleware): the deletion waits for it to end,
    so nothing of the old session is written after the deletion."""
    entered, go = threading.Event(), threading.Event()

    def hold(ctx: Any, next_: Any) -> Any:
        entered.set()
        go.wait(10)
        return next_()

    rig.runtime.hooks.use("agent:turn:after", hold)
    rig.runtime.submit(SID, Input(id="", content="问", **human("a")))
    rig.model.answer("答")
    assert entered.wait(5)  # the reply is saved and sent; agent:turn:after runs
    deleted = rig.runtime._begin_delete(SID)
    rig.runtime._entries[SID].ref.ask(Ping(), timeout=5)  # the deletion has been handled
    assert not deleted.done()
    assert not rig.of(SessionDeleted)
    go.set()
    assert deleted.result(5) == 1
    rig.settle()
    kinds = [type(e).__name__ for e in rig.log()]
    assert kinds.index("TurnRecorded") < kinds.index("SessionDeleted")
    assert kinds[-1] == "SessionDeleted"  # nothing of the deleted session after it
    assert rig.runtime.view(SID).queue.running is None
    fresh = rig.submit("新的开始", **human("a"))
    assert fresh.where == "opened"
    rig.model.answer("好")
    rig.settle()


def test_inputs_of_an_older_generation_are_dropped(rig: Rig) -> None:  # DEL2
    rig.runtime.delete(SID)
    stale: Future[Any] = Future()
    where = rig.runtime._ask(SID, Submit(Input(id="old", content="迟到的"), 0, stale))
    assert where == "released"
    assert stale.result(1).outcome == "released"
    assert [(e.input_id, e.reason) for e in rig.of(InputReleased)] == [("old", "stale-generation")]
    assert not rig.of(MessageSaved) and not rig.of(TurnOpened)


@pytest.mark.parametrize("how", ["passivated", "never loaded"])
def test_an_input_arriving_before_a_deletion_of_a_session_not_live_is_dropped(
    rig: Rig, how: str
) -> None:  # DEL2
    # The generation an input arrives in is the log's when no actor is live: read then,
    # not when the input is handed on after a deletion in between.
    rig.submit("第一句")
    rig.model.answer("好")
    rig.settle()
    runtime = rig.runtime
    if how == "passivated":
        assert runtime.passivate_idle(0) == 1
        assert SID not in runtime._generations  # nothing of it kept in memory
    else:
        runtime.shutdown(timeout=10)
        runtime = Runtime(rig.store, runtime.services, FixedClock(), SequentialIds(), janitor=False)
    deleted: list[int] = []

    def delete_first(ctx: Any, next_: Any) -> Any:
        remove()
        deleted.append(runtime.delete(SID, timeout=10))
        return next_()

    remove = runtime.hooks.use("agent:input:before", delete_first)
    try:
        handle = runtime.submit(SID, Input(id="late", content="删除前到达"))
        assert deleted == [1]
        assert handle.where == "released"
        assert handle.result(5).outcome == "released"
        released = [(e.input_id, e.reason) for e in rig.of(InputReleased)]
        assert released[-1] == ("late", "stale-generation")
    finally:
        if runtime is not rig.runtime:
            runtime.shutdown(timeout=10)


def test_a_passivated_session_leaves_no_generation_behind() -> None:  # DEL2, ES4
    # Sessions come and go: the runtime keeps a generation only for live sessions (and
    # for one whose deletion has not reached its log yet).
    model = ScriptedModel(lambda request, n: ScriptedReply(text=f"好{n}"))
    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=model),
        FixedClock(),
        SequentialIds(),
        janitor=False,
        max_live_sessions=3,
    )
    try:
        for n in range(20):
            runtime.run(f"s{n}", Input(id="", content="你好"))
        assert len(runtime._entries) <= 3
        assert set(runtime._generations) == set(runtime._entries)
        runtime.delete("s0", timeout=10)  # revived, deleted: generation 1 in its log
        assert runtime.passivate_idle(0) >= 1
        assert not runtime._generations
        # Back from its log, with the generation the deletion left.
        assert runtime.run("s0", Input(id="", content="又来了")).outcome == "replied"
        assert runtime._generations == {"s0": 1}
    finally:
        runtime.shutdown(timeout=10)


class _HandOverLeases:
    """Two runtimes' ownership of sessions over one log, handed from one to the other
    by hand (as an expired lease is taken over): a stand-in for ``PostgresLeases``."""

    def __init__(self, table: dict[str, str], owner: str) -> None:
        self.table, self.owner = table, owner
        self.lost: list[Any] = []

    def acquire(self, session_id: str) -> None:
        from aalis_agent.actors.ownership import SessionOwnedElsewhere

        holder = self.table.setdefault(session_id, self.owner)
        if holder != self.owner:
            raise SessionOwnedElsewhere(session_id, holder)

    def release(self, session_id: str) -> None:
        if self.table.get(session_id) == self.owner:
            del self.table[session_id]

    def on_lost(self, callback: Any) -> None:
        self.lost.append(callback)

    def close(self) -> None:
        pass


def test_a_session_taken_over_and_deleted_elsewhere_is_not_stale_when_it_comes_back() -> None:
    # DEL2 across owners: A loses a session, B takes it over and deletes it, then lets it
    # go. A's inputs to it afterwards belong to the generation B's deletion left in the
    # log (A used to keep its own, older one and drop them all as stale).
    store, table = InMemoryEventStore(), {}
    leases_a, leases_b = _HandOverLeases(table, "a"), _HandOverLeases(table, "b")

    def runtime(leases: _HandOverLeases) -> Runtime:
        model = ScriptedModel(lambda request, n: ScriptedReply(text=f"{leases.owner}{n}"))
        return Runtime(store, Services(llm=model), janitor=False, ownership=leases)

    a, b = runtime(leases_a), runtime(leases_b)
    try:
        assert a.run("s", Input(id="", content="一")).outcome == "replied"
        table["s"] = "b"  # A's lease ran out and B took it
        for lost in leases_a.lost:
            lost("s")
        assert b.delete("s", timeout=10) == 1 and b.passivate_idle(0) == 1
        assert "s" not in table
        outcome = a.run("s", Input(id="", content="二"))
        assert (outcome.outcome, outcome.reason) == ("replied", None)
    finally:
        a.shutdown(timeout=10)
        b.shutdown(timeout=10)


def test_stop_command_permissions(rig: Rig) -> None:  # CMD3
    assert rig.runtime.stop_command(SID, "qq", "a") == NO_RUNNING_TURN
    rig.submit("一", **human("a"))
    rig.submit("二", **human("b"))  # pending: not a participant yet
    rig.submit("匿名", platform="qq")  # no account: nobody
    assert rig.runtime.stop_command(SID, "qq", "b") == STOP_DENIED
    assert rig.runtime.stop_command(SID, "qq", "stranger") == STOP_DENIED
    assert rig.runtime.stop_command(SID, "qq", "a") is None
    rig.settle()
    assert rig.of(TurnRecorded)[0].outcome == "aborted"
    # The owner may stop any turn.
    assert rig.runtime.stop_command(SID, "qq", "owner") is None


def test_a_continuation_turn_may_be_stopped_by_those_of_the_turn_that_started_it(
    rig: Rig,
) -> None:  # CMD3: originTurnOf of a continuation is the starting turn's participants
    rig.submit("一", **human("a"))
    started = rig.of(TurnOpened)[0].turn_id
    rig.submit("续做", platform="qq", source="continuation", from_turn=started)
    rig.model.answer("好")
    rig.settle()
    assert [e.turn_id for e in rig.of(TurnOpened)][-1] != started  # the continuation's turn
    assert rig.runtime.stop_command(SID, "qq", "stranger") == STOP_DENIED
    assert rig.runtime.stop_command(SID, "qq", "a") is None


def test_a_continuations_origin_comes_from_the_log_across_restarts(rig: Rig) -> None:
    """「续做的通知不带它,取起它的那一轮的发言者,参与者同样取那一轮的」: the participants and
    speaker a continuation brings are derived from its starting turn as the log recorded
    it, however long ago and after the actor was passivated; /stop and the tool context
    use that one derivation."""
    for user in ("a", "b", "c"):
        rig.submit(f"{user} 说", **human(user))
        rig.model.answer("好")
        rig.settle()
    first = rig.of(TurnOpened)[0].turn_id
    joined = [e for e in rig.of(InputJoined) if e.turn_id == first]
    assert [(e.participants, e.speaker) for e in joined] == [((("qq", "a"),), "a")]
    assert rig.runtime.passivate_idle(0) == 1  # the next actor comes back from the log
    rig.submit("续做", platform="qq", source="continuation", from_turn=first)
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    context = rig.tool.contexts[-1]
    assert (context.user_id, context.participants) == ("a", ("a",))
    assert context.inbound.from_turn == first
    assert rig.runtime.stop_command(SID, "qq", "b") == STOP_DENIED
    assert rig.runtime.stop_command(SID, "qq", "a") is None
    rig.tool.release()
    rig.settle()


def test_stop_marker_names_who_stopped(rig: Rig) -> None:  # SAVE6
    def stop_and_marker(platform: str, user: str) -> str:
        rig.submit("一", **human("a"))
        rig.runtime.stop(SID, platform=platform, user_id=user)
        rig.settle()
        return rig.of(StopMarkerSaved)[-1].message.content

    assert "被" not in stop_and_marker("qq", "owner")  # the owner's own session
    rig.sessions.add(SessionInfo(SID, origin_platform="qq", multi_party=True))
    assert "被 owner 停下" in stop_and_marker(
        "tg", "owner-tg"
    )  # his account on the room's platform
    assert "被 b 停下" in stop_and_marker("qq", "b")


def test_the_owner_stopping_someone_elses_private_chat_is_named(rig: Rig) -> None:  # SAVE6
    """「owner 自己的会话里不写…其余写停下的人的账号」: only the owner's own session omits
    the name; in another person's private chat the owner is named by his account on the
    chat's platform."""

    def marker(platform: str, user: str) -> str:
        rig.submit("一", **human("b"))
        rig.runtime.stop(SID, platform=platform, user_id=user)
        rig.settle()
        return rig.of(StopMarkerSaved)[-1].message.content

    rig.sessions.add(SessionInfo(SID, origin_platform="qq", peer="b"))  # b's private chat
    assert "被 owner 停下" in marker("qq", "owner")
    assert "被 owner 停下" in marker("tg", "owner-tg")  # his account on qq
    rig.sessions.add(SessionInfo(SID, origin_platform="qq", peer="owner"))  # his own
    assert "被" not in marker("qq", "owner")


def test_a_turn_that_left_nothing_writes_no_marker(rig: Rig) -> None:  # SAVE6, INS3
    # An idle prompt is not archived: stopped before any tool call, the turn left nothing.
    rig.submit("空闲开话题", source="idle", trigger_type="idle")
    rig.runtime.stop(SID)
    rig.settle()
    assert rig.of(TurnRecorded)[0].outcome == "aborted"
    assert not rig.of(StopMarkerSaved)
    assert history.history_window(rig.runtime.view(SID).history) == []
    turn = turns.turn_info(rig.runtime.view(SID).turns.finished[-1])
    assert not turn.stop_marker


@pytest.mark.parametrize("where", ["agent:turn:after", "outbound"])
def test_an_error_after_the_reply_is_saved_writes_no_second_record(rig: Rig, where: str) -> None:
    """SAVE5:「回复了的记在最后那条回复的元数据上(之后外发或agent:turn:after的中间件出错不再
    另记)」: once the reply is saved with the turn's record, a failing ``agent:turn:after``
    middleware (or a send that fails from inside it) writes no second record: no
    ``turn-record`` marker, and the turn stays recorded as replied."""

    def boom(ctx: Any, next_: Any) -> Any:
        raise RuntimeError("afterwards")

    if where == "agent:turn:after":
        rig.runtime.hooks.use("agent:turn:after", boom)
    else:  # a send that fails; the middleware makes the runner send the reply itself
        rig.runtime.hooks.use("agent:turn:after", lambda ctx, next_: next_())

        class Failing:
            def dispatch_outbound(self, message: Any) -> None:
                if message.kind == "reply":
                    boom(None, None)

        rig.runtime.services.gateway = Failing()
    handle = rig.submit("问", **human("a"))
    rig.model.answer("答")
    rig.settle()
    records = [
        (e.message.role, e.message.kind, e.message.meta.turn_record.outcome)
        for e in rig.of(MessageSaved)
        if e.message.meta.turn_record is not None
    ]
    assert records == [("assistant", None, "replied")]
    assert [e.outcome for e in rig.of(TurnRecorded)] == ["replied"]
    assert handle.result(1).outcome == "replied"
    finished = turns.turn_info(rig.runtime.view(SID).turns.finished[-1])
    assert finished.outcome == "replied"


def test_clear_context_stops_and_releases_unarchived(rig: Rig) -> None:
    rig.submit("一", **human("a"))
    queued = rig.submit("通知", source="schedule")
    rig.runtime.clear(SID, timeout=10)
    assert [(e.input_id, e.reason, e.archived) for e in rig.of(InputReleased)] == [
        (queued.input_id, "clear", False)
    ]
    assert len(rig.runtime.view(SID).history.messages) == 0
    rig.runtime.clear(SID, ("vector",), timeout=10)  # does not stop anything
    assert rig.runtime.view(SID).queue.running is None


def test_passivated_sessions_come_back_from_their_log(rig: Rig) -> None:  # ES4
    rig.submit("一", **human("a"))
    rig.model.answer("好")
    rig.settle()
    assert rig.runtime.active_sessions() == [SID]
    assert rig.runtime.passivate_idle(0) == 1
    assert rig.runtime.active_sessions() == []
    rig.submit("二", **human("a"))
    sent = rig.model.wait_call().request.messages
    conversation = [m.content for m in sent if m.role != "system"]
    assert conversation == [
        "(1/1 08:00) [昵称a(a)]: 一",
        "好",
        "(1/1 08:00) [昵称a(a)]: 二",
    ]


def test_busy_sessions_are_not_passivated(rig: Rig) -> None:  # ES4
    rig.submit("一", **human("a"))
    assert rig.runtime.passivate_idle(0) == 0
    assert rig.runtime.active_sessions() == [SID]


def test_shutdown_refuses_new_inputs(rig: Rig) -> None:
    rig.runtime.shutdown(timeout=10)
    with pytest.raises(RuntimeClosed):
        rig.runtime.submit(SID, Input(id="", content="还在吗"))


def test_final_call_events_order(rig: Rig) -> None:
    rig.submit("你好", **human("a"))
    rig.model.answer("你好呀")
    rig.settle()
    ended = rig.of(ModelCallEnded)
    assert [(e.index, e.status, e.tool_calls) for e in ended] == [(1, "ok", 0)]
    assert not rig.of(InputHeld)


def test_many_sessions_leave_threads_only_for_active_ones() -> None:  # ES4
    store = InMemoryEventStore()
    runtime = Runtime(store, Services(llm=ScriptedModel()), FixedClock(), janitor=False)
    before = threading.active_count()
    try:
        handles = [runtime.submit(f"user:{i}", Input(id="", content="你好")) for i in range(300)]
        assert {h.result(30).outcome for h in handles} == {"replied"}
        assert runtime.wait_idle(30)
        busy = runtime.submit("busy", Input(id="", content="x"))  # still running below
        assert runtime.passivate_idle(0) >= 300
        wait_for(lambda: threading.active_count() <= before + 2)
        assert runtime.active_sessions() in ([], ["busy"])
        busy.result(10)
        # A passivated session comes back from its log with its history.
        again = runtime.submit("user:7", Input(id="", content="又来了"))
        assert again.result(10).outcome == "replied"
        assert len(runtime.view("user:7").history.messages) == 4
    finally:
        runtime.shutdown(timeout=30)


def test_addressed_inserts_in_a_multi_party_room_get_a_focus_guide(rig: Rig) -> None:  # SCH2
    rig.sessions.add(SessionInfo(SID, origin_platform="qq", multi_party=True))
    rig.submit("查一下", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    # Labels are the moment each input entered the turn, not when it arrived (07:00).
    rig.submit("@bot 你看这个", **human("b", addressed=True, timestamp=1_767_222_000_000))
    rig.submit("闲聊一句", **human("c", addressed=False))
    rig.tool.release()
    rig.settle()
    second = rig.model.answer(tool_calls=(ToolCall(id="call-2", name="slow"),)).request
    rig.tool.wait_running()
    rig.submit("@bot 还有我", **human("d", addressed=True, timestamp=1_767_222_000_000))
    assert isinstance(rig.runtime.clock, FixedClock)
    rig.runtime.clock.advance(60_000)  # d joins a minute later
    rig.tool.release()
    rig.settle()
    third = rig.model.wait_call().request
    guides = [m for m in third.messages if m.content.startswith(FOCUS_GUIDE_HEAD)]
    assert len(guides) == 2
    assert guides[0].content.splitlines()[1:] == ["(1/1 08:00) b"]
    assert guides[1].content.splitlines()[1:] == ["(1/1 08:00) b", "(1/1 08:01) d"]
    # The earlier request is a prefix of the later one: the first block did not change.
    assert third.messages[: len(second.messages)] == second.messages
    # Only the addressed messages are listed; nothing of the guide is archived.
    assert not [e for e in rig.of(MessageSaved) if FOCUS_GUIDE_HEAD in e.message.content]


def test_no_focus_guide_outside_multi_party_rooms(rig: Rig) -> None:  # SCH2
    rig.submit("查一下", **human("a"))
    rig.model.answer(tool_calls=(CALL,))
    rig.tool.wait_running()
    rig.submit("@bot 你看这个", **human("b", addressed=True))
    rig.tool.release()
    rig.settle()
    request = rig.model.wait_call().request
    assert not [m for m in request.messages if m.content.startswith(FOCUS_GUIDE_HEAD)]


class FlakyStore(InMemoryEventStore):
    """Refuses the next append of a MessageSaved batch once, as a full disk would."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next_message = False

    def append(
        self, session_id: str, events: Any, expected_seq: int, *, open_work: bool | None = None
    ) -> int:
        if self.fail_next_message and any(isinstance(e, MessageSaved) for e in events):
            self.fail_next_message = False
            raise OSError("disk full")
        return super().append(session_id, events, expected_seq, open_work=open_work)


def test_a_failed_append_stops_the_session_and_its_next_use_rebuilds_it() -> None:
    """Persist, then act: the archive of the opening input fails, so the model is never
    called; the handle gets SessionFailed. The next input rebuilds the session from its
    log: the cut turn is recorded, the unarchived input is put back at the head of the
    queue and runs; nothing is lost, nothing half-applied. (An ``agent:turn:before``
    middleware keeps the archive out of the commit that opens the turn.)"""
    store = FlakyStore()
    model = GatedModel()
    hooks = Hooks()
    hooks.use("agent:turn:before", lambda ctx, next_: next_())
    runtime = Runtime(
        store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False, hooks=hooks
    )
    try:
        store.fail_next_message = True  # the archive of the opening input fails
        first = runtime.submit(SID, Input(id="", content="一"))
        with pytest.raises(SessionFailed, match=r"a write to its log failed.*disk full"):
            first.result(5)
        assert model.calls == []  # nothing acted on what was not durable
        assert runtime.active_sessions() == []  # the fenced actor is gone
        second = runtime.submit(SID, Input(id="", content="二"))
        call = model.answer("好")
        sent = [m.content for m in call.request.messages if m.role == "user"]
        assert sent[0].endswith("一")  # the put-back input runs first
        deadline = time.monotonic() + 5
        while not second.done() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):  # it came too late: its own turn
                model.answer("也好", timeout=0.1)
        assert second.result(5).outcome == "replied"
        log = store.read(SID)
        assert project(log) == runtime.view(SID)  # the actor's view is the log's
        requeued = [e for e in log if isinstance(e, InputRequeued)]
        assert [(e.turn_id, e.reason) for e in requeued] == [("turn-1", "crash")]
        recorded = [(e.turn_id, e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)]
        assert recorded[0] == ("turn-1", "aborted", "crash")
        saved = [
            e.message.content
            for e in log
            if isinstance(e, MessageSaved) and e.message.role in ("user", "assistant")
        ]
        assert saved[:2] == ["一", "二"] or saved[:2] == ["一", "好"]
        assert saved.count("一") == 1  # archived once, in the turn that ran it
    finally:
        runtime.shutdown(timeout=10)


def test_when_the_commit_that_opens_a_turn_fails_the_input_is_refused_whole() -> None:
    """Without middleware between a turn's open and its first call, the input, its turn,
    its archive and the first call's start are one commit. When that write fails, the
    submit itself fails (nothing was accepted), the model is never called, and the next
    input finds a clean log."""
    store = FlakyStore()
    model = GatedModel()
    runtime = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    try:
        store.fail_next_message = True
        with pytest.raises(SessionFailed, match=r"a write to its log failed.*disk full"):
            runtime.submit(SID, Input(id="", content="一")).result(5)
        assert model.calls == []
        assert store.read(SID) == []  # nothing half-applied
        second = runtime.submit(SID, Input(id="", content="二"))
        call = model.answer("好")
        assert [m.content for m in call.request.messages if m.role == "user"][-1].endswith("二")
        assert second.result(5).outcome == "replied"
        log = store.read(SID)
        first_commit = [type(e).__name__ for e in log[:5]]
        assert first_commit == [
            "InputReceived",
            "TurnOpened",
            "InputJoined",
            "MessageSaved",
            "ModelCallStarted",
        ]
        assert project(log) == runtime.view(SID)
    finally:
        runtime.shutdown(timeout=10)


def test_turn_ids_stay_unique_when_the_id_source_restarts() -> None:
    """A turn id is never used twice in a session's log: not within one actor's life (the
    used ids are kept up turn by turn) and not after a restart whose id source starts
    again from the beginning (the log is the authority)."""
    store = InMemoryEventStore()
    for _ in range(3):  # three "processes", each with a fresh SequentialIds
        runtime = Runtime(
            store, Services(llm=ScriptedModel()), FixedClock(), SequentialIds(), janitor=False
        )
        try:
            for k in range(4):
                assert runtime.submit("s", Input(id="", content=f"{k}")).result(10).outcome == (
                    "replied"
                )
            assert runtime.passivate_idle(0) == 1  # the next runtime rebuilds from the log
        finally:
            runtime.shutdown(timeout=10)
    opened = [e.turn_id for e in store.read("s") if isinstance(e, TurnOpened)]
    assert len(opened) == 12 and len(set(opened)) == 12


def _answering(hooks: Hooks, model: ScriptedModel) -> Runtime:
    """A runtime on an in-memory log whose model answers from ``model``, with ``hooks``."""
    return Runtime(
        InMemoryEventStore(),
        Services(llm=model),
        FixedClock(),
        SequentialIds(),
        janitor=False,
        hooks=hooks,
    )


@pytest.mark.parametrize("hook", ["agent:llm:after", "agent:reply:before"])
@pytest.mark.parametrize("how", ["stop", "stop_command", "stop_all"])
def test_a_stop_acknowledged_before_the_reply_is_durable_wins(hook: str, how: str) -> None:
    """「被停下的一轮不落库回复、不外发,结局为aborted」: a stop that arrives while the final
    call's ``agent:llm:after`` or ``agent:reply:before`` runs is acknowledged and wins:
    no reply is saved or sent, the outcome is aborted."""
    hooks = Hooks()
    acked: list[str | None] = []
    runtime = _answering(hooks, ScriptedModel([ScriptedReply(text="回答")]))

    def stop_now(ctx: Any, next_: Any) -> Any:
        if how == "stop":
            acked.append(runtime.stop(SID))
        elif how == "stop_command":
            refused = runtime.stop_command(SID, "cli", "u1")  # None: stopped
            acked.append("stopped" if refused is None else None)
        else:
            acked.append(runtime.stop_all(SID))
        return next_()

    hooks.use(hook, stop_now)
    sent: list[Any] = []
    runtime.subscribe("outbound:message", lambda _t, p: sent.append(p))
    try:
        handle = runtime.submit(SID, Input(id="", content="问", sender=Sender(user_id="u1")))
        outcome = handle.result(5)
        assert acked and acked[0] is not None  # the stop was acknowledged
        assert outcome.outcome == "aborted"
        assert sent == []
        log = runtime.store.read(SID)
        assert not [e for e in log if isinstance(e, MessageSaved) and e.message.role == "assistant"]
        # The call that returned is accounted for even though its reply was refused.
        assert len([e for e in log if isinstance(e, UsageRecorded)]) == 1
    finally:
        runtime.shutdown(timeout=10)


def test_after_the_reply_is_durable_a_stop_finds_no_turn() -> None:
    hooks = Hooks()
    answers: list[str | None] = []
    runtime = _answering(hooks, ScriptedModel([ScriptedReply(text="回答")]))

    def stop_late(ctx: Any, next_: Any) -> Any:
        answers.append(runtime.stop(SID))
        answers.append(runtime.stop_command(SID, "cli", None))
        return next_()

    hooks.use("agent:turn:after", stop_late)
    try:
        outcome = runtime.submit(SID, Input(id="", content="问")).result(5)
        assert outcome.outcome == "replied"
        assert answers == [None, NO_RUNNING_TURN]
        assert not [e for e in runtime.store.read(SID) if isinstance(e, StopRequested)]
    finally:
        runtime.shutdown(timeout=10)


def test_duplicate_call_ids_are_made_unique_before_they_are_stored() -> None:
    """Servers that number calls per response (``call_0`` in every batch) or repeat an id
    inside one message: every request sent still pairs each call with exactly one result."""
    requests: list[Any] = []

    def reply(request: Any, n: int) -> ScriptedReply:
        requests.append(request)
        if n % 3 == 0:
            return ScriptedReply(text="好了")
        same = ToolCall(id="call_0", name="echo", arguments="{}")
        return ScriptedReply(tool_calls=(same, same))

    tools = ToolRegistry([Tool("echo", lambda args, ctx: "回声")])
    runtime = Runtime(
        InMemoryEventStore(),
        Services(llm=ScriptedModel(reply), tools=tools),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    try:
        for text in ("一", "二"):
            assert runtime.submit(SID, Input(id="", content=text)).result(10).outcome == "replied"
        assert len(requests) == 6
        for request in requests:
            assert provider_violations(list(request.messages)) == []
        groups = [
            [c.id for c in e.message.tool_calls]
            for e in runtime.store.read(SID)
            if isinstance(e, MessageSaved) and e.message.tool_calls
        ]
        assert groups == [["call_0", "call_0~2"]] * 4
    finally:
        runtime.shutdown(timeout=10)


def test_a_stop_during_llm_before_means_the_call_is_never_made() -> None:
    hooks = Hooks()
    model = ScriptedModel([ScriptedReply(text="回答")])
    runtime = _answering(hooks, model)
    hooks.use("agent:llm:before", lambda ctx, next_: runtime.stop(SID) and next_())
    try:
        assert runtime.submit(SID, Input(id="", content="问")).result(5).outcome == "aborted"
        assert model.requests == []  # nothing went to the provider
        assert not [e for e in runtime.store.read(SID) if isinstance(e, ModelCallStarted)]
    finally:
        runtime.shutdown(timeout=10)


def test_the_outcome_of_a_replied_input_carries_the_reply_text() -> None:
    """The handle's outcome says what the turn replied (as sent, with or without a
    gateway); a turn that did not reply has none."""
    store = InMemoryEventStore()
    model = ScriptedModel([ScriptedReply(text="你好，我在")])
    runtime = Runtime(store, Services(llm=model), FixedClock(), SequentialIds(), janitor=False)
    try:
        outcome = runtime.submit(SID, Input(id="", content="在吗")).result(10)
        assert (outcome.outcome, outcome.reply) == ("replied", "你好，我在")
        silent = ScriptedModel([ScriptedReply(text="  ")])
        runtime.services.llm = silent
        quiet = runtime.submit("other", Input(id="", content="嗯")).result(10)
        assert (quiet.outcome, quiet.reply) == ("silent", None)
    finally:
        runtime.shutdown(timeout=10)
