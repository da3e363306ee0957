"""SET and CMD clauses that no other test pinned down: each test here fails when its clause
is broken (found by mutating the code one clause at a time)."""

from __future__ import annotations

from typing import Any

import pytest
from aalis_agent.actors.commands import handle_command
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    Sender,
    SequentialIds,
    SettingsChanged,
    ToolCall,
    ToolStarted,
    TurnRecorded,
)
from aalis_agent.request.texts import (
    NO_RUNNING_TURN,
    STOP_DENIED,
    THINK_NOT_TUNABLE,
    UNLIMITED,
    follow_preference,
    think_not_in_model,
)
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    StaticAuthority,
    Tool,
    ToolRegistry,
)
from aalis_agent.services.config import AgentConfig
from aalis_agent.services.llm import ChatRequest
from aalis_agent.services.models import LlmService, Provider
from aalis_agent.services.settings import SettingsLayers, validate_setting

from tests.harness import GatedModel, settle

SID = "qq:group:9"


def make(runtimes: list[Runtime], llm: Any, **kwargs: Any) -> Runtime:
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=llm, authority=StaticAuthority([("qq", "boss")]), **kwargs),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    runtimes.append(rt)
    return rt


def cmd(rt: Runtime, text: str, user: str) -> str | None:
    return handle_command(rt, SID, text, platform="qq", user_id=user)


# --- the UI texts, word for word (SET1-SET3, CMD3) ------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (follow_preference("千问"), "跟随服务偏好（此刻：千问）"),  # SET1
        (think_not_in_model("高"), "当前模型没有这一档，按默认（高）"),  # SET2
        (THINK_NOT_TUNABLE, "当前模型不能调"),  # SET2
        (UNLIMITED, "不限"),  # SET3
        (STOP_DENIED, "只有参与这一轮的人和 owner 能停"),  # CMD3
        (NO_RUNNING_TURN, "没有在跑的一轮"),  # CMD3
    ],
    ids=[
        "SET1-follow",
        "SET2-not-in-model",
        "SET2-not-tunable",
        "SET3-unset",
        "CMD3-denied",
        "CMD3-idle",
    ],
)
def test_ui_texts_are_the_requirements_words(text: str, expected: str) -> None:
    assert text == expected


# --- SET1: the command form ---------------------------------------------------------


def test_llm_splits_at_the_first_slash_as_provider_ids_have_none(
    runtimes: list[Runtime],
) -> None:  # SET1
    assert validate_setting("llm", "router/meta/llama-3") == {
        "provider": "router",
        "model": "meta/llama-3",
    }
    llama = ScriptedModel(model_id="meta/llama-3", provider_id="router")
    providers = [Provider("demo", [ScriptedModel()]), Provider("router", [llama])]
    rt = make(runtimes, LlmService(providers))
    assert cmd(rt, "/session.set llm router/meta/llama-3", "u") == (
        "已设置模型（llm）= router/meta/llama-3"
    )
    rt.submit(SID, Input(id="", content="你好", platform="qq")).result(10)
    assert rt.wait_idle(10)
    assert [r.model for r in llama.requests] == ["router/meta/llama-3"]


# --- SET3: unset is unlimited -------------------------------------------------------


def test_unset_max_tool_iterations_lets_the_tool_loop_run_on(runtimes: list[Runtime]) -> None:
    batches = 25

    def loop(request: ChatRequest, n: int) -> ScriptedReply:
        if n <= batches:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text="完")

    looping = ScriptedModel(loop)
    tools = ToolRegistry([Tool("echo", lambda args, ctx: "ok")])
    rt = make(runtimes, looping, tools=tools)
    rt.submit(SID, Input(id="", content="一直调工具", platform="qq")).result(30)
    assert rt.wait_idle(30)
    events = rt.store.read(SID)
    assert len([e for e in events if isinstance(e, ToolStarted)]) == batches
    assert all(r.tools for r in looping.requests[:batches])  # never forced to a final call
    assert [e.outcome for e in events if isinstance(e, TurnRecorded)] == ["replied"]


# --- SET3, SET4: owner-only covers resetting too ------------------------------------


@pytest.mark.parametrize(
    ("key", "label"),
    [("maxToolIterations", "最大工具迭代"), ("historyLimit", "历史条数上限")],
    ids=["maxToolIterations", "historyLimit"],
)
def test_only_the_owner_may_reset_an_owner_only_setting(
    runtimes: list[Runtime], key: str, label: str
) -> None:  # SET3, SET4
    rt = make(runtimes, ScriptedModel())
    assert cmd(rt, f"/session.set {key} 3", "boss") == f"已设置{label}（{key}）= 3"
    assert cmd(rt, f"/session.reset {key}", "someone") == f"{label}（{key}）只有 owner 能改"
    assert dict(rt.view(SID).settings) == {key: 3}
    assert [e.reset for e in rt.store.read(SID) if isinstance(e, SettingsChanged)] == [False]


# --- CMD3: /stop as a command -------------------------------------------------------


def test_slash_stop_follows_the_stop_rules(runtimes: list[Runtime]) -> None:  # CMD3
    model = GatedModel()
    rt = make(runtimes, model)
    assert cmd(rt, "/stop", "a") == NO_RUNNING_TURN
    rt.submit(SID, Input(id="", content="一", platform="qq", sender=Sender(user_id="a")))
    settle(rt, model)
    assert cmd(rt, "/stop", "stranger") == STOP_DENIED
    assert [e for e in rt.store.read(SID) if isinstance(e, TurnRecorded)] == []
    assert cmd(rt, "/stop", "a") is None  # a participant stops it: nothing to say
    settle(rt, model)
    assert [e.outcome for e in rt.store.read(SID) if isinstance(e, TurnRecorded)] == ["aborted"]


# --- SET4: dropped messages are only not sent ----------------------------------------


def test_messages_the_history_limit_drops_stay_in_history_and_come_back(
    runtimes: list[Runtime],
) -> None:  # SET4
    model = ScriptedModel([ScriptedReply(text=f"答{i}") for i in range(7)])
    layers = SettingsLayers(config=AgentConfig(history_limit=4))
    rt = make(runtimes, model, settings=layers)

    def say(text: str) -> list[str]:
        rt.submit(SID, Input(id="", content=text, platform="qq")).result(10)
        assert rt.wait_idle(10)
        return [m.content for m in model.requests[-1].messages if m.role == "assistant"]

    for i in range(5):
        say(f"问{i}")
    # A=10 before this turn (N=4, h=2): start = ceil(6/2)*2 = 6.
    assert say("问5") == ["答3", "答4"]
    assert len(rt.view(SID).history.messages) == 12  # the dropped ones are still archived
    # A larger limit sends them again: A=12, N=8, h=4: start = ceil(4/4)*4 = 4.
    assert cmd(rt, "/session.set historyLimit 8", "boss") == "已设置历史条数上限（historyLimit）= 8"
    assert say("问6") == ["答2", "答3", "答4", "答5"]
