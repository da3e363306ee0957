"""Session settings commands (SET3, SET4, SET1's command form) and their validation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pykka
import pytest
from aalis_agent.actors.commands import HELP, handle_command
from aalis_agent.actors.runtime import Runtime
from aalis_agent.cli.fork import parse_sets
from aalis_agent.events import (
    ConfigError,
    FixedClock,
    InMemoryEventStore,
    Input,
    SequentialIds,
    SettingsChanged,
    TurnOpened,
)
from aalis_agent.events.codec import decode, encode
from aalis_agent.services import (
    AgentConfig,
    ScriptedModel,
    Services,
    StaticAuthority,
    StaticPersonas,
)
from aalis_agent.services.config import json_value

SID = "qq:group:5"


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=ScriptedModel(), authority=StaticAuthority([("qq", "boss")])),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    yield rt
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def cmd(rt: Runtime, text: str, user: str = "boss") -> str | None:
    return handle_command(rt, SID, text, platform="qq", user_id=user)


def test_session_lists_every_field_with_its_unset_text(runtime: Runtime) -> None:
    assert cmd(runtime, "/session") == (
        "模型（llm）：跟随服务偏好（此刻：scripted）\n深度思考（think）：当前模型不能调\n"
        "最大工具迭代（maxToolIterations）：不限\n历史条数上限（historyLimit）：0\n"
        "人设（persona）：默认人设\n工具分组（enabledToolGroups）：全部"
    )


def test_owner_sets_and_the_next_turn_reads_it(runtime: Runtime) -> None:
    assert cmd(runtime, "/session.set historyLimit 4") == "已设置历史条数上限（historyLimit）= 4"
    assert cmd(runtime, "/session.set llm demo/scripted") == "已设置模型（llm）= demo/scripted"
    runtime.submit(SID, Input(id="", content="你好", platform="qq")).result(10)
    runtime.wait_idle(10)
    opened = next(e for e in runtime.store.read(SID) if isinstance(e, TurnOpened))
    assert opened.settings.history_limit == 4
    assert str(opened.settings.model) == "demo/scripted"
    changes = [
        (e.key, e.value, e.by) for e in runtime.store.read(SID) if isinstance(e, SettingsChanged)
    ]
    assert changes[0] == ("historyLimit", 4, "boss")
    assert "历史条数上限（historyLimit）：4" in (cmd(runtime, "/session") or "")
    assert cmd(runtime, "/session.reset historyLimit") == "已恢复历史条数上限（historyLimit）：0"
    assert dict(runtime.view(SID).settings) == {"llm": {"provider": "demo", "model": "scripted"}}


@pytest.mark.parametrize("key", ["maxToolIterations", "historyLimit"])
def test_owner_only_fields_refuse_others(runtime: Runtime, key: str) -> None:  # SET3, SET4
    label = "最大工具迭代" if key == "maxToolIterations" else "历史条数上限"
    assert (
        cmd(runtime, f"/session.set {key} 3", user="someone") == f"{label}（{key}）只有 owner 能改"
    )
    assert dict(runtime.view(SID).settings) == {}


def test_anyone_may_set_the_thinking_level(runtime: Runtime) -> None:
    assert cmd(runtime, "/session.set think high", user="someone") == (
        "已设置深度思考（think）= high，此刻：当前模型不能调"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/session.set historyLimit -1", '"historyLimit": must be >= 0'),
        ("/session.set maxToolIterations 0", '"maxToolIterations": must be >= 1'),
        ("/session.set historyLimit many", '"historyLimit": expected an integer'),
        ("/session.set llm onlymodel", '"llm": expected <provider>/<model>'),
        ("/session.set colour blue", 'unknown session setting "colour"'),
    ],
)
def test_bad_values_name_the_key_and_change_nothing(
    runtime: Runtime, text: str, message: str
) -> None:
    reply = cmd(runtime, text)
    assert reply is not None and reply.startswith("设置失败：") and message in reply
    assert dict(runtime.view(SID).settings) == {}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("true", "expected an integer, got true"),
        ("null", "expected an integer, got null"),
        ('{"a": 1}', 'expected an integer, got {"a": 1}'),
        ('"x"', 'expected an integer, got "x"'),
        ("many", 'expected an integer, got "many"'),
        ("[1, 2.5]", "expected an integer, got [1, 2.5]"),
        ("1e999", "expected an integer, got Infinity"),
    ],
)
@pytest.mark.parametrize("locale", ["zh", "en"])
def test_a_wrong_value_is_shown_as_the_json_typed(locale: str, value: str, shown: str) -> None:
    """/session.set reads its value as JSON: a wrong one is shown so (true, null,
    {"a": 1}, "x"), not as Python spells it (True, None, {'a': 1}, 'x'), in every locale."""
    services = Services(
        llm=ScriptedModel(),
        authority=StaticAuthority([("qq", "boss")]),
        config=AgentConfig(locale=locale),
    )
    rt = Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)
    try:
        failed = "设置失败：" if locale == "zh" else "Setting failed: "
        reply = cmd(rt, f"/session.set historyLimit {value}")
        assert reply == f'{failed}session setting "historyLimit": {shown}'
        reply = cmd(rt, '/session.set enabledToolGroups {"a": true}')
        assert reply == (
            f'{failed}session setting "enabledToolGroups": '
            'expected a list of group names ("*" for all)'
        )
        assert cmd(rt, "/session.set llm big") == (
            f'{failed}session setting "llm": expected <provider>/<model>, got "big"'
        )
        assert dict(rt.view(SID).settings) == {}
    finally:
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_fork_set_shows_a_wrong_value_as_json_too() -> None:
    """``aalis-agent replay --fork N --set KEY=VALUE`` reads VALUE as /session.set does."""
    with pytest.raises(ConfigError) as err:
        parse_sets(["historyLimit=true"])
    assert str(err.value) == (
        "--set 'historyLimit=true': session setting \"historyLimit\": expected an integer, got true"
    )
    with pytest.raises(ConfigError) as err:
        parse_sets(["colour=1"])
    assert str(err.value) == (
        "--set 'colour=1': unknown session setting \"colour\"; known: llm, think, "
        "maxToolIterations, historyLimit, persona, enabledToolGroups"
    )


def test_json_value_is_json_that_reads_back() -> None:
    for value in ['a"b\\\n\x00\u200b', "\U0001f600\U000e0001", [None, True, 1.5], {"k y": [1]}]:
        assert json.loads(json_value(value)) == value
    assert json_value("\ud800") == '"\\ud800"'  # escaped, as JSON would carry it
    assert json_value(float("-inf")) == "-Infinity"


def test_usage_and_unknown_commands(runtime: Runtime) -> None:
    assert cmd(runtime, "/session.set historyLimit") is not None
    assert cmd(runtime, "/unknown") is None


def test_help_lists_every_command(runtime: Runtime) -> None:
    reply = cmd(runtime, "/help")
    assert reply == HELP
    for name in ("/stop", "/session", "/session.set", "/session.reset", "/model", "/persona"):
        assert any(line.startswith(name + " ") for line in reply.splitlines()), name


def test_a_model_or_persona_that_is_not_there_is_refused(runtime: Runtime) -> None:
    reply = cmd(runtime, "/session.set llm deepseek/deepseek-chat")
    assert reply == (
        '设置失败：session setting "llm": there is no model "deepseek/deepseek-chat"; '
        "/model lists the models"
    )
    assert cmd(runtime, "/session.set persona helper") == (
        '设置失败：session setting "persona": no personas are configured'
    )
    assert dict(runtime.view(SID).settings) == {}
    assert cmd(runtime, "/session.reset llm") == "已恢复模型（llm）：跟随服务偏好（此刻：scripted）"


@pytest.fixture
def with_personas() -> Iterator[Runtime]:
    rt = Runtime(
        InMemoryEventStore(),
        Services(
            llm=ScriptedModel(),
            authority=StaticAuthority([("qq", "boss")]),
            persona=StaticPersonas({"123": ("一二三", "你是一二三。"), "cat": ("猫", "喵。")}),
        ),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    yield rt
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def test_a_persona_is_set_by_its_listed_id_and_an_unknown_one_refused(
    with_personas: Runtime,
) -> None:
    assert (
        cmd(with_personas, "/session.set persona 123")
        == "已设置人设（persona）= 123，此刻：一二三（123）"
    )
    assert cmd(with_personas, "/session.set persona dog") == (
        '设置失败：session setting "persona": there is no persona "dog"; '
        "/persona lists the personas"
    )
    assert with_personas.view(SID).settings["persona"] == "123"


def test_text_settings_are_taken_as_typed_and_lists_read_well(with_personas: Runtime) -> None:
    runtime = with_personas
    assert (
        cmd(runtime, "/session.set persona 123")
        == "已设置人设（persona）= 123，此刻：一二三（123）"
    )
    assert runtime.view(SID).settings["persona"] == "123"
    assert cmd(runtime, '/session.set enabledToolGroups ["web", "files"]') == (
        "已设置工具分组（enabledToolGroups）= web、files"
    )
    assert runtime.view(SID).settings["enabledToolGroups"] == ["web", "files"]
    assert cmd(runtime, "/session.set historyLimit 4") == "已设置历史条数上限（historyLimit）= 4"
    assert runtime.view(SID).settings["historyLimit"] == 4


# --- hostile values: a clear refusal, nothing unreadable in the log ------------------------


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("key", ["maxToolIterations", "historyLimit", "enabledToolGroups"])
def test_a_non_owners_deeply_nested_value_is_refused_without_reading_it(
    runtime: Runtime, key: str
) -> None:
    reply = cmd(runtime, f"/session.set {key} {deep(100_000)}", user="someone")
    assert reply is not None and reply.endswith(f"（{key}）只有 owner 能改")
    assert dict(runtime.view(SID).settings) == {}


HOSTILE: list[tuple[str, str, str]] = [
    ("deep", f"/session.set historyLimit {deep(10_000)}", "nested deeper than 8 levels"),
    ("deep-list", f"/session.set enabledToolGroups {deep(9)}", "nested deeper than 8 levels"),
    ("20-digits", "/session.set historyLimit 99999999999999999999", "must be <= 922337203"),
    ("2**63", "/session.set maxToolIterations 9223372036854775808", "must be <= 922337203"),
    ("5000-digits", "/session.set historyLimit " + "9" * 5000, "must be <= 9223372036854775807"),
    ("infinite", "/session.set historyLimit 1e999", "expected an integer"),
    ("lone-surrogate", "/session.set think \ud800", "not valid text"),
    ("lone-surrogate-llm", "/session.set llm p/\udc00", "not valid text"),
    ("long-id", "/session.set persona " + "p" * 300, "at most 256 characters"),
    ("many-groups", "/session.set enabledToolGroups " + ",".join(["g"] * 300), "at most 256"),
    ("long-value", "/session.set enabledToolGroups " + "x" * 200_000, "too long"),
]


@pytest.mark.parametrize(("text", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_values_get_a_clear_error_and_change_nothing(
    runtime: Runtime, text: str, message: str
) -> None:
    reply = cmd(runtime, text)
    assert reply is not None and reply.startswith("设置失败：") and message in reply, reply[:200]
    reply.encode("utf-8")  # printable
    assert dict(runtime.view(SID).settings) == {}
    for event in runtime.store.read(SID):  # the log still reads back, event by event
        assert decode(encode(event)) == event


def test_the_largest_64_bit_value_is_kept_and_a_turn_reads_it(runtime: Runtime) -> None:
    top = 2**63 - 1
    assert cmd(runtime, f"/session.set historyLimit {top}") == (
        f"已设置历史条数上限（historyLimit）= {top}"
    )
    runtime.submit(SID, Input(id="", content="你好", platform="qq")).result(10)
    runtime.wait_idle(10)
    opened = next(e for e in runtime.store.read(SID) if isinstance(e, TurnOpened))
    assert opened.settings.history_limit == top


def test_a_page_number_of_thousands_of_digits_is_refused_clearly(runtime: Runtime) -> None:
    reply = cmd(runtime, "/model -p " + "9" * 5000)
    assert reply is not None and reply.startswith("/model：页码太大") and len(reply) < 100
