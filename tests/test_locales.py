"""The locale packs: same keys and placeholders, zh as before, en chosen per runtime and
per platform, scheduling outcomes as an enum."""

# ruff: noqa: E501  (the frozen pack keeps each text on one line)

from __future__ import annotations

import string
from collections.abc import Iterator
from pathlib import Path

import pykka
import pytest
from aalis_agent.actors.commands import HELP, handle_command
from aalis_agent.actors.logs import handed_on, turn_ended
from aalis_agent.actors.runtime import Runtime
from aalis_agent.actors.scheduler import Where
from aalis_agent.events import ConfigError, InMemoryEventStore, Input, SettingsChanged
from aalis_agent.request import texts as texts_module
from aalis_agent.request.locales import DEFAULT_LOCALE, LOCALES, en, zh
from aalis_agent.request.texts import Texts, texts_for
from aalis_agent.services import AgentConfig, ScriptedModel, Services
from aalis_agent.services.settings import SETTING_FIELDS, SettingsLayers, validate_setting

# The zh pack as it was written from the source's strings: a change to any of them is a
# change to the contract and must be made here on purpose.
FROZEN_ZH: dict[str, str] = {
    "prompt.input_convention": "[输入约定] 用户消息开头的（月/日 时:分）是这条消息进入对话的时间；多人场合里，时间之后的[昵称(账号)]: 是说话的人。这些标注由系统加上，不是对方打的字，回复里不要照抄。",
    "prompt.volatile": "[当前情况] 现在是 {time}，平台 {platform}，{where}。",
    "prompt.volatile.multi_party": "多人群聊",
    "prompt.volatile.one_on_one": "单独对话",
    "prompt.volatile.unknown_platform": "未知",
    "prompt.batch_prefix": "下面几条是你上一轮进行期间到的",
    "prompt.batch_no_reply_needed": "没有需要接的可以不说话",
    "prompt.focus_guide_head": "[焦点指引] 这一轮进行中插进来、点名你的消息：",
    "prompt.focus_guide_line": "({when}) {who}",
    "prompt.delegation_head": "[跨会话委派]",
    "prompt.host_notice_head": "[宿主通知]",
    "prompt.continuation_hint": "[系统提示] 由于上下文长度限制，部分历史消息已被压缩或移除。请基于当前可见的上下文和最新用户请求继续完成任务，不要因为看不到之前的细节而停止工作。如果你之前有正在执行的多步骤任务或计划，请查看对话摘要和 todo-list 工具确认当前进度，然后继续未完成的步骤。",
    "prompt.collapsed_tools": "[历史工具调用]",
    "prompt.truncated_suffix": "…[已截断，原文 {length} 字]",
    "prompt.format_retry": "请按要求的格式重新回答。",
    "stop.marker_prefix": "[已停下]",
    "stop.marker": "{prefix} 上一轮没答完就{who}停下了，没说完的话没有留下，已执行的工具调用以记录为准。",
    "stop.marker_by": "被 {name} ",
    "stop.denied": "只有参与这一轮的人和 owner 能停",
    "stop.no_running_turn": "没有在跑的一轮",
    "notice.error_prefix": "[错误]",
    "notice.system_prefix": "[系统]",
    "notice.turn_failed": "{prefix} 这一轮出错了（{error}），turn={turn_id}",
    "tool.bad_arguments": "[错误] 工具参数不是合法的 JSON 对象，没有执行，请重新生成。原文前 200 字：{raw}",
    "tool.arguments_too_deep": "[错误] 工具参数嵌套超过 {max_depth} 层，没有执行，请换成层次更浅的参数重新生成。原文前 200 字：{raw}",
    "tool.arguments_too_long": "[错误] 工具参数有 {length} 字，超过上限 {max_chars} 字，没有执行，请精简后重新生成。原文前 200 字：{raw}",
    "tool.arguments_number_too_long": "[错误] 工具参数里有超过 {max_digits} 位的数字，没有执行，请写短一些（或写成文本）后重新生成。原文前 200 字：{raw}",
    "tool.arguments_cut": (
        "[错误] 回复在输出长度上限处被截断，这次工具调用的参数不完整，没有执行，"
        "请用更短的参数重新生成。原文前 200 字：{raw}"
    ),
    "tool.result_type": "工具返回了 {type}，不能转成文本（只接受文本、字节、JSON 对象、数组、数字、布尔或 None）",
    "tool.result_too_deep": "工具返回的结果嵌套超过 {max_depth} 层，不能转成文本{where}",
    "tool.result_nan": "工具返回的结果里有 NaN 或无穷大，JSON 表示不了{where}",
    "tool.result_key": "工具返回的结果里有不是文本的键，JSON 表示不了{where}",
    "tool.result_value": "工具返回的结果里有 {type}，JSON 表示不了{where}",
    "tool.result_not_json": "工具返回的结果不能转成 JSON 文本：{error}",
    "tool.result_where": "（位置 {path}）",
    "tool.not_found": "没有这个工具：{name}",
    "tool.blocked": "工具调用被拦下，没有执行",
    "tool.builtin.current_time": "当前日期与时间（可指定 UTC 偏移小时数）",
    "tool.builtin.current_time.utc_offset_hours": "如 8 表示 UTC+8",
    "tool.builtin.calculate": "计算算术表达式：+ - * / // % **、括号、sqrt abs round log sin cos tan pi e",
    "tool.builtin.calculate.expression": "如 (3+4)*2",
    "where.opened": "开轮",
    "where.pending": "待插入",
    "where.queued": "排队",
    "where.released": "放掉",
    "where.joined": "插入",
    "where.dropped": "dropped",
    "where.deferred": "deferred",
    "where.handled": "已处理",
    "log.handed_on": "→ {where}{seq} session={session_id}{turn}",
    "log.turn_ended": "回合结束 turn={turn_id} session={session_id} 结局={outcome}",
    "log.turn_ended.reason": "原因={reason}",
    "log.turn_ended.duration": "用时={duration_ms}ms",
    "log.turn_ended.inputs": "输入 {seqs}",
    "setting.llm": "模型",
    "setting.llm.unset": "跟随服务偏好",
    "setting.think": "深度思考",
    "setting.think.unset": "按模型的默认档",
    "setting.maxToolIterations": "最大工具迭代",
    "setting.maxToolIterations.unset": "不限",
    "setting.historyLimit": "历史条数上限",
    "setting.historyLimit.unset": "0",
    "setting.persona": "人设",
    "setting.persona.unset": "默认人设",
    "setting.enabledToolGroups": "工具分组",
    "setting.enabledToolGroups.unset": "全部",
    "setting.line": "{label}（{key}）：{text}{where}",
    "setting.line.layer": " · {layer}",
    "setting.layer.plugin config": "插件配置",
    "setting.layer.platform profile": "平台档",
    "setting.layer.platform-type profile": "平台类型档",
    "setting.layer.venue": "场所",
    "setting.layer.session": "本会话",
    "setting.think_not_tunable": "当前模型不能调",
    "setting.unlimited": "不限",
    "setting.follow_preference": "跟随服务偏好（此刻：{model}）",
    "setting.think_not_in_model": "当前模型没有这一档，按默认（{default}）",
    "setting.think_default": "按模型的默认档（{default}）",
    "setting.no_model": "没有可用的模型",
    "setting.model_missing": "{wanted}（不在，用的是 {model}）",
    "setting.remark": "{text}（{remark}）",
    "setting.remark_open": "（",
    "setting.all": "全部",
    "setting.none": "无",
    "setting.list_separator": "、",
    "command.help": "/stop  停下在跑的一轮（参与这一轮的人和 owner）\n/session  看本会话的设置：模型、深度思考、最大工具迭代、历史条数上限、人设、工具分组\n/session.set <键> <值>  改本会话的一项设置（如 /session.set llm openai/gpt-4o）\n/session.reset <键>  恢复一项设置\n/model [关键词] [-p 页]  列出 / 搜索对话模型\n/persona [关键词] [-p 页]  列出 / 搜索人设",
    "command.usage": "用法：/session、/session.set <键> <值>、/session.reset <键>、/model [关键词] [-p 页]",
    "command.reset_done": "已恢复{label}（{key}）：{text}",
    "command.set_done": "已设置{label}（{key}）= {given}{note}",
    "command.set_note": "，此刻：{text}",
    "command.owner_only": "{label}（{key}）只有 owner 能改",
    "command.set_failed": "设置失败：{error}",
    "command.page_missing": "-p 后面要跟页码",
    "command.page_not_positive": "页码要是正整数，不是 {given}",
    "command.page_too_large": "页码太大：{given}",
    "command.error": "{command}：{error}",
    "listing.models": "对话模型",
    "listing.personas": "人设",
    "listing.no_persona_service": "没有人设服务，/persona 无可列",
    "listing.context": " · 上下文 {context_length}",
    "listing.none": "没有可用的{what}",
    "listing.none_matching": "没有含“{keyword}”的{what}",
    "listing.no_page": "没有第 {page} 页（共 {pages} 页）",
    "listing.in_use": "  ← 此刻在用",
    "listing.header": "{found}{what}共 {total} 个，第 {page}/{pages} 页",
    "listing.header_found": "含“{keyword}”的",
    "listing.footer_next": "{command} -p {page} 看下一页，",
    "listing.footer_search": "{command} <关键词> 搜索",
    "chat.where.opened": "开了新的一轮",
    "chat.where.pending": "并入正在跑的这一轮",
    "chat.where.queued": "排队，这一轮结束后再答",
    "chat.where.released": "没有送给模型",
    "chat.no_usage": "[用量] 无",
    "chat.usage": "[用量] {used}/{window} ({ratio}%) 历史 {history} 条",
    "chat.usage_trimmed": " 已裁剪",
    "chat.tool": "[工具] {name}{failed}",
    "chat.tool_failed": " 失败：{error}",
    "chat.reason": "（{reason}）",
    "chat.unknown_command": "没有这个命令：{command}（/help 看有哪些）",
    "chat.scripted_reply": "（脚本模型）收到：{said}",
    "chat.resumed": "[恢复] 上次没做完的：记下被中断的那一轮，回答还在等的消息",
}


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def test_both_packs_have_the_same_keys_and_placeholders() -> None:
    assert set(LOCALES) == {"zh", "en"}
    assert zh.TEXTS.keys() == en.TEXTS.keys()
    for key, template in zh.TEXTS.items():
        assert _fields(template) == _fields(en.TEXTS[key]), key
        assert en.TEXTS[key].strip(), key


def test_zh_is_the_default_and_unchanged() -> None:
    assert DEFAULT_LOCALE == "zh"
    assert zh.TEXTS == FROZEN_ZH
    assert texts_for() is texts_for("zh")


def test_zh_texts_are_the_source_strings() -> None:
    t = texts_module
    assert t.INPUT_CONVENTION.startswith("[输入约定] 用户消息开头的（月/日 时:分）")
    assert t.volatile_context("05/01 10:00", None, True) == (
        "[当前情况] 现在是 05/01 10:00，平台 未知，多人群聊。"
    )
    assert t.stop_marker_text("alice") == (
        "[已停下] 上一轮没答完就被 alice 停下了，没说完的话没有留下，已执行的工具调用以记录为准。"
    )
    assert t.listing_header("人设", 3, 1, 2, "kw") == "含“kw”的人设共 3 个，第 1/2 页"
    assert t.listing_footer("/model", 1, 2) == "/model -p 2 看下一页，/model <关键词> 搜索"
    assert HELP.splitlines()[0] == "/stop  停下在跑的一轮（参与这一轮的人和 owner）"
    for key, field in SETTING_FIELDS.items():  # the settings' labels stay in one place
        assert FROZEN_ZH[f"setting.{key}"] == field.label
        assert FROZEN_ZH[f"setting.{key}.unset"] == field.unset_text


def test_every_text_fills_in_both_locales() -> None:
    for name in LOCALES:
        texts = texts_for(name)
        for key, template in LOCALES[name].items():
            values = dict.fromkeys(_fields(template), "X")
            assert "{" not in texts(key, **values), (name, key)


def test_an_unknown_locale_is_refused() -> None:
    with pytest.raises(ConfigError, match='unknown locale "fr"'):
        AgentConfig(locale="fr")
    with pytest.raises(ConfigError, match="platform profile 'x' setting 'locale'"):
        SettingsLayers(platforms={"x": {"locale": "klingon"}})
    with pytest.raises(ConfigError):
        Texts("de")
    assert validate_setting("locale", "en", layer="venue") == "en"
    assert AgentConfig.from_mapping({"locale": "en"}).locale == "en"


def test_where_is_an_enum_shown_in_the_locale() -> None:
    assert Where.OPENED == "opened" and isinstance(Where.QUEUED, str)
    zh_words = {"opened": "开轮", "pending": "待插入", "queued": "排队", "released": "放掉"}
    for value, word in zh_words.items():
        assert texts_for("zh").where(Where(value)) == word
        assert Where.of(word) is Where(value)
        assert texts_for("en").where(Where(value)) == value
    # the log line (SCH8) keeps its words in zh, and takes either form of the outcome
    assert handed_on("开轮", 7, "s", "turn-1") == "→ 开轮 #7 session=s turn=turn-1"
    assert handed_on(Where.PENDING, None, "s") == "→ 待插入 session=s"
    assert handed_on(Where.PENDING, 3, "s", texts=texts_for("en")) == "→ pending #3 session=s"
    assert turn_ended("t", "s", "aborted", "stop", 5, [1, None]) == (
        "回合结束 turn=t session=s 结局=aborted 原因=stop 用时=5ms 输入 #1"
    )


@pytest.fixture
def rig() -> Iterator[tuple[Runtime, ScriptedModel]]:
    model = ScriptedModel()
    layers = SettingsLayers(config=AgentConfig(), platforms={"discord": {"locale": "en"}})
    rt = Runtime(InMemoryEventStore(), Services(llm=model, settings=layers), janitor=False)
    yield rt, model
    rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def _system_texts(model: ScriptedModel) -> list[str]:
    return [m.content for m in model.requests[-1].messages if m.role == "system"]


def test_a_platform_layer_picks_en_for_that_platform_only(
    rig: tuple[Runtime, ScriptedModel],
) -> None:
    rt, model = rig
    handle = rt.submit("discord:1", Input(id="", content="hi", platform="discord"))
    assert handle.where is Where.OPENED
    handle.result(10)
    system = _system_texts(model)
    assert system[0].endswith(texts_for("en").input_convention)
    assert any(s.startswith("[Current situation] It is ") for s in system)
    assert not any("[输入约定]" in s or "[当前情况]" in s for s in system)

    other = rt.submit("qq:1", Input(id="", content="你好", platform="qq"))
    other.result(10)
    system = _system_texts(model)
    assert system[0].endswith(texts_module.INPUT_CONVENTION)
    assert any(s.startswith("[当前情况] 现在是 ") for s in system)

    assert handle_command(rt, "discord:1", "/help", platform="discord", user_id="u") == (
        texts_for("en")("command.help")
    )
    assert handle_command(rt, "qq:1", "/help", platform="qq", user_id="u") == HELP
    shown = handle_command(rt, "discord:1", "/session", platform="discord", user_id="u")
    assert shown is not None and shown.startswith("Model (llm): follows the service preference")


def test_a_runtime_in_en() -> None:
    model = ScriptedModel()
    services = Services(llm=model, config=AgentConfig(locale="en"))
    rt = Runtime(InMemoryEventStore(), services, janitor=False)
    try:
        rt.submit("s", Input(id="", content="hi")).result(10)
        system = _system_texts(model)
        assert system[0] == texts_for("en").input_convention
        assert any(s.endswith(", a one-on-one conversation.") for s in system)
        assert handle_command(rt, "s", "/help", platform=None, user_id=None) == (
            texts_for("en")("command.help")
        )
        assert handle_command(rt, "s", "/model -p x", platform=None, user_id=None) == (
            "/model: the page must be a positive integer, not 'x'"
        )
    finally:
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_a_session_has_no_locale_of_its_own() -> None:
    """A platform, platform-type or venue layer picks a language, a session's own layer
    does not: Runtime.set_setting refuses locale, naming it, as /session.set does (it was
    written to the log and never read)."""
    rt = Runtime(InMemoryEventStore(), Services(llm=ScriptedModel()), janitor=False)
    try:
        with pytest.raises(ConfigError) as err:
            rt.set_setting("s", "locale", "en")
        assert str(err.value) == (
            "session setting 'locale': a session's own layer takes no locale; set it in a "
            "platform, platform-type or venue layer, or AgentConfig.locale"
        )
        reply = handle_command(rt, "s", "/session.set locale en", platform="qq", user_id="u")
        assert reply is not None and 'unknown session setting "locale"' in reply
        assert dict(rt.view("s").settings) == {}
        rt.set_setting("s", "historyLimit", 3)  # the session's own keys still go in
        assert dict(rt.view("s").settings) == {"historyLimit": 3}
    finally:
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_a_reset_refuses_an_unknown_key_and_clears_a_locale_an_older_log_holds() -> None:
    """``Runtime.set_setting(..., reset=True)`` checks its key as a set does (a typo was
    written to the log as a reset of nothing); ``locale``, which a session's own layer
    once took, is still cleared from a log that holds it."""
    store = InMemoryEventStore()
    older = SettingsChanged(session_id="s", seq=1, at=0, key="locale", value="en")
    store.append("s", [older], 0)
    rt = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    try:
        assert dict(rt.view("s").settings) == {"locale": "en"}
        written = len(store.read("s"))
        for key in ("colour", 3):
            with pytest.raises(ConfigError) as err:
                rt.set_setting("s", key, reset=True)  # type: ignore[arg-type]
            assert str(err.value) == (
                f"unknown session setting {key!r}; known: llm, think, maxToolIterations, "
                "historyLimit, persona, enabledToolGroups, locale"
            )
        assert len(store.read("s")) == written  # nothing written for them
        rt.set_setting("s", "locale", reset=True)
        assert dict(rt.view("s").settings) == {}
        rt.set_setting("s", "historyLimit", reset=True)  # a key never set: reset, no error
        assert dict(rt.view("s").settings) == {}
    finally:
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def _cjk(text: str) -> bool:
    return any("\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef" for ch in text)


@pytest.mark.parametrize(
    ("value", "english"),
    [
        (object(), "The tool returned object, which cannot be made text"),
        ({1.5, 2.5}, "The tool returned set, which cannot be made text"),
        ({"a": [1, float("inf")]}, "holds NaN or infinity, which JSON cannot hold (at a[1])"),
        ({"a": {1, 2}}, "holds set, which JSON cannot hold (at a)"),
        ({("k",): 1}, "holds a key that is not text, which JSON cannot hold"),
        ([[[1]]], "nests deeper than 2 levels, so it cannot be made text (at [0][0])"),
        (10**5000, "cannot be made JSON text: "),
    ],
    ids=["object", "set", "nan", "inner-set", "key", "deep", "huge-int"],
)
def test_a_tool_results_error_is_in_the_locale(value: object, english: str) -> None:
    """What is wrong with a tool's return value reaches the model in the session's
    language: the ``en`` texts for an ``en`` runtime (they were Chinese whatever the
    locale), the ``zh`` ones unchanged by default."""
    from aalis_agent.request.limits import coerce_tool_result

    text, error = coerce_tool_result(value, max_depth=2, texts=texts_for("en"))
    assert text is None and error is not None and english in error, error
    assert not _cjk(error), error
    text, error = coerce_tool_result(value, max_depth=2)
    assert text is None and error is not None and error.startswith("工具返回"), error


def test_an_en_runtime_tells_the_model_in_english_what_a_tool_returned_wrong(
    tmp_path: Path,
) -> None:
    from aalis_agent.events import SqliteEventStore, ToolCall, ToolFinished
    from aalis_agent.services import ScriptedReply, Tool, ToolRegistry

    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="odd", arguments="{}"),)),
            ScriptedReply(text="done"),
        ]
    )
    services = Services(
        llm=model,
        tools=ToolRegistry([Tool("odd", lambda args, ctx: {"when": {1, 2}})]),
        config=AgentConfig(locale="en"),
    )
    store = SqliteEventStore(tmp_path / "en.db")
    rt = Runtime(store, services, janitor=False)
    try:
        assert rt.submit("s", Input(id="", content="hi")).result(10).outcome == "replied"
        (finished,) = [e for e in store.read("s") if isinstance(e, ToolFinished)]
        assert finished.error == (
            "The tool's result holds set, which JSON cannot hold (at when)"
        ), finished.error
        sent = [m.content for m in model.requests[-1].messages if m.role == "tool"]
        assert any("holds set, which JSON cannot hold" in s for s in sent), sent
    finally:
        rt.shutdown(timeout=10)
        store.close()
