"""Settings layers (SET), the settings fields (SET1-SET3), ``assign_model`` and the paged
listings ``/model`` and ``/persona`` (CMD1-CMD2)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from aalis_agent.actors.commands import PAGE_SIZE, handle_command, page_of, set_setting
from aalis_agent.actors.fields import FieldView, session_fields
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    ConfigError,
    FixedClock,
    InMemoryEventStore,
    Input,
    ModelRef,
    SequentialIds,
    SettingsChanged,
    TurnOpened,
)
from aalis_agent.events.schema import ToolCall, TurnSettings
from aalis_agent.request.texts import (
    THINK_NOT_TUNABLE,
    UNLIMITED,
    follow_preference,
    listing_footer,
    listing_header,
    think_not_in_model,
)
from aalis_agent.services import (
    AgentConfig,
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    SettingsLayers,
    StaticAuthority,
    StaticPersonas,
    StaticSessions,
)
from aalis_agent.services.llm import ThinkLevel
from aalis_agent.services.models import LlmService, Provider
from aalis_agent.services.settings import StaticSettings, validate_setting, venue_of
from aalis_agent.services.tools import Tool, ToolRegistry
from hypothesis import given, settings
from hypothesis import strategies as st

SID = "qq:group:5"
LOW = ThinkLevel(id="low", name="低")
HIGH = ThinkLevel(id="high", name="高")
MAX = ThinkLevel(id="max", name="极致")

MODELS_WHAT = "对话模型"  # the listing's noun for /model (actors/commands.py)
PERSONAS_WHAT = "人设"  # the listing's noun for /persona
IN_USE = "← 此刻在用"  # the marker after the model in use


def model(model_id: str, provider: str = "p", **kwargs: Any) -> ScriptedModel:
    return ScriptedModel(model_id=model_id, provider_id=provider, **kwargs)


# --- runtime plumbing ---------------------------------------------------------------


@pytest.fixture
def make_runtime(runtimes: list[Runtime]) -> Any:
    def make(llm: Any = None, **kwargs: Any) -> Runtime:
        rt = Runtime(
            InMemoryEventStore(),
            Services(llm=llm if llm is not None else model("default"), **kwargs),
            FixedClock(),
            SequentialIds(),
            janitor=False,
        )
        runtimes.append(rt)
        return rt

    return make


def turn(rt: Runtime, sid: str = SID, **input_fields: Any) -> TurnOpened:
    """Run one turn; its TurnOpened event."""
    fields = {"platform": "qq", **input_fields}
    rt.submit(sid, Input(id="", content="你好", **fields)).result(10)
    assert rt.wait_idle(10)
    return [e for e in rt.store.read(sid) if isinstance(e, TurnOpened)][-1]


def field(rt: Runtime, key: str, sid: str = SID, **kwargs: Any) -> FieldView:
    return next(f for f in rt.fields(sid, **kwargs) if f.key == key)


def cmd(rt: Runtime, text: str, sid: str = SID) -> str:
    reply = handle_command(rt, sid, text, platform="qq", user_id="u")
    assert reply is not None
    return reply


# --- the layers, each over the one below (SET) --------------------------------------


def history_limit(
    layers: SettingsLayers,
    platform: str | None,
    venue: str | None = None,
    session: dict[str, Any] | None = None,
) -> int:
    return layers.for_turn("s", platform, session or {}, venue).history_limit


FULL = dict(
    config=AgentConfig(history_limit=1),
    platforms={"onebot:main": {"historyLimit": 2}},
    types={"onebot": {"historyLimit": 3}},
    venues={"onebot:main:77": {"historyLimit": 4}},
)


def test_layers_platform_profile_over_plugin_config() -> None:
    layers = SettingsLayers(
        config=AgentConfig(history_limit=1), platforms={"qq": {"historyLimit": 2}}
    )
    assert history_limit(layers, "qq") == 2
    assert history_limit(layers, "discord") == 1  # no profile: the plugin config


def test_layers_platform_type_profile_over_platform_profile() -> None:
    layers = SettingsLayers(**FULL)
    assert history_limit(layers, "onebot:main") == 3
    without_type = SettingsLayers(**{**FULL, "types": {}})
    assert history_limit(without_type, "onebot:main") == 2


def test_layers_venue_over_platform_type_profile() -> None:
    layers = SettingsLayers(**FULL)
    assert history_limit(layers, "onebot:main", venue="onebot:main:77") == 4
    assert history_limit(layers, "onebot:main", venue="onebot:main:other") == 3


def test_layers_session_over_venue() -> None:
    layers = SettingsLayers(**FULL)
    assert history_limit(layers, "onebot:main", "onebot:main:77", {"historyLimit": 5}) == 5


def test_layers_keep_lower_keys_a_higher_layer_does_not_set() -> None:
    layers = SettingsLayers(
        config=AgentConfig(think="low", max_tool_iterations=9),
        platforms={"qq": {"think": "high"}},
        venues={"qq:1": {"llm": "p/b"}},
    )
    s = layers.for_turn("s", "qq", {"persona": "alice"}, "qq:1")
    assert (s.think, s.max_tool_iterations, s.model, s.persona) == (
        "high",
        9,
        ModelRef(provider="p", model="b"),
        "alice",
    )


def test_effective_names_the_layer_of_each_value() -> None:
    layers = SettingsLayers(**FULL)
    eff = layers.effective("onebot:main", {"think": "low"}, "onebot:main:77")
    assert eff["historyLimit"] == (4, "venue 'onebot:main:77'")
    assert eff["think"] == ("low", "session")
    eff = layers.effective("onebot:other", {})
    assert eff["historyLimit"] == (3, "platform-type profile 'onebot'")
    eff = layers.effective("discord", {})
    assert eff["historyLimit"] == (1, "plugin config")


def test_effective_is_the_layers_folded_in_order_each_time() -> None:
    """The layers below the session's are worked out once per platform and venue: what
    ``effective``, ``for_turn`` and ``locale_for`` give is still the layers folded lowest
    first, for every session layer, and no answer's change reaches the next."""
    full = {**FULL, "venues": {"onebot:main:77": {"historyLimit": 4, "locale": "en"}}}
    layers = SettingsLayers(**full)
    cases = [
        ("onebot:main", "onebot:main:77"),
        ("onebot:other", None),
        ("discord", None),
        (None, None),
    ]
    for _ in range(2):  # the second round from what the first worked out
        for platform, venue in cases:
            for session in ({}, {"think": "low"}, {"historyLimit": 9, "persona": "p"}):
                folded: dict[str, tuple[Any, str]] = {}
                for label, values in layers.layers(platform, venue, session):
                    for key, value in values.items():
                        folded[key] = (value, label)
                eff = layers.effective(platform, session, venue)
                assert list(eff.items()) == list(folded.items())
                eff["think"] = ("changed", "by a caller")  # the caller's own copy
                turn = layers.for_turn("s", platform, session, venue)
                assert turn.history_limit == folded["historyLimit"][0]
                assert turn.think == (folded["think"][0] if "think" in folded else None)
                locale = folded.get("locale")
                assert layers.locale_for(platform, venue) == (locale[0] if locale else None)
    assert layers.locale_for("onebot:main", "onebot:main:77") == "en"
    assert layers == SettingsLayers(**full)  # what it worked out is not part of its value


def test_a_subclass_wording_the_layers_otherwise_is_asked_each_time() -> None:
    """What the lower layers give is kept only for the class's own wording: a subclass's
    ``effective`` is what ``for_turn`` and ``locale_for`` follow; and the platform types
    are the layers' own copy (the caller's mapping changed later changes nothing)."""

    class Site(SettingsLayers):
        def effective(
            self, platform: str | None, session_layer: Any, venue: str | None = None
        ) -> dict[str, tuple[Any, str]]:
            out = super().effective(platform, session_layer, venue)
            out["historyLimit"] = (42, "site")
            out["locale"] = ("en", "site")
            return out

    site = Site(**FULL)
    assert site.for_turn("s", "onebot:main", {}).history_limit == 42
    assert site.locale_for("onebot:main") == "en"
    types = {"qq": "onebot"}
    layers = SettingsLayers(types={"onebot": {"historyLimit": 3}}, platform_types=types)
    assert layers.for_turn("s", "qq", {}).history_limit == 3
    types["qq"] = "other"
    assert layers.type_of("qq") == "onebot"
    assert layers.for_turn("s", "qq", {}).history_limit == 3


def test_platform_type_from_the_mapping_or_the_part_before_the_colon() -> None:
    layers = SettingsLayers(
        types={"onebot": {"historyLimit": 3}, "qq": {"historyLimit": 9}},
        platform_types={"qq": "onebot"},
    )
    assert layers.type_of("qq") == "onebot"  # the mapping wins over the name itself
    assert layers.type_of("onebot:second") == "onebot"
    assert layers.type_of("discord") == "discord"
    assert layers.type_of(None) is None
    assert history_limit(layers, "qq") == 3
    assert history_limit(layers, "onebot:second") == 3


def test_venue_of_an_input() -> None:
    assert venue_of("qq", "12345") == "qq:12345"
    assert venue_of("qq", None) is None
    assert venue_of("qq", "") is None


def test_the_plugin_config_ignores_an_llm_key() -> None:
    """SET1: the global layer for ``llm`` is the service preference, not the config."""
    config = AgentConfig.from_mapping({"llm": "p/b", "historyLimit": 2})
    assert SettingsLayers(config=config).for_turn("s", "qq", {}).model is None


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (
            {"platforms": {"qq": {"historyLimit": -1}}},
            "platform profile 'qq' setting 'historyLimit': must be >= 0",
        ),
        (
            {"types": {"onebot": {"maxToolIterations": 0}}},
            "platform-type profile 'onebot' setting 'maxToolIterations': must be >= 1",
        ),
        (
            {"venues": {"qq:1": {"llm": "nomodel"}}},
            "venue 'qq:1' setting 'llm': expected <provider>/<model>",
        ),
        ({"venues": {"qq:1": {"think": ""}}}, "venue 'qq:1' setting 'think'"),
        (
            {"platforms": {"qq": {"colour": "blue"}}},
            "unknown platform profile 'qq' setting 'colour'",
        ),
        ({"platforms": {"qq": 3}}, "platform profile 'qq': expected a table"),
    ],
)
def test_a_bad_value_names_the_layer_its_key_and_the_setting(
    layers: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        SettingsLayers(**layers)
    assert message in str(caught.value)


def test_values_are_normalised_when_the_layers_are_built() -> None:
    layers = SettingsLayers(
        platforms={"qq": {"historyLimit": "6", "llm": "p/b", "enabledToolGroups": "web, files"}}
    )
    s = layers.for_turn("s", "qq", {})
    assert (s.history_limit, s.model, s.tool_groups) == (
        6,
        ModelRef(provider="p", model="b"),
        ("web", "files"),
    )


@pytest.mark.parametrize(
    ("key", "value", "stored"),
    [
        ("llm", "openai/gpt-4o", {"provider": "openai", "model": "gpt-4o"}),
        ("llm", {"provider": "a", "model": "b"}, {"provider": "a", "model": "b"}),
        ("think", "high", "high"),
        ("maxToolIterations", "3", 3),
        ("historyLimit", 0, 0),
    ],
)
def test_validate_setting_accepts(key: str, value: Any, stored: Any) -> None:
    assert validate_setting(key, value) == stored


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llm", "openai/"),
        ("llm", "/gpt"),
        ("llm", {"provider": "a"}),
        ("maxToolIterations", 0),
        ("historyLimit", True),
        ("historyLimit", 1.5),
        ("think", 3),
    ],
)
def test_validate_setting_refuses_naming_layer_and_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"venue 'qq:1' setting '{key}'"):
        validate_setting(key, value, layer="venue 'qq:1'")


# --- the layers as a turn reads them (SCH5) -----------------------------------------


def test_a_turn_reads_every_layer_with_the_venue_of_its_opening_input(make_runtime: Any) -> None:
    layers = SettingsLayers(
        config=AgentConfig(history_limit=1, think="low"),
        platforms={"qq": {"historyLimit": 2}},
        venues={"qq:77": {"historyLimit": 4, "maxToolIterations": 3}},
    )
    rt = make_runtime(settings=layers)
    opened = turn(rt, group_id="77")
    assert (opened.settings.history_limit, opened.settings.max_tool_iterations) == (4, 3)
    assert opened.settings.think == "low"
    opened = turn(rt, group_id="88")  # another group: no venue layer
    assert (opened.settings.history_limit, opened.settings.max_tool_iterations) == (2, None)


def test_the_venue_falls_back_to_the_session_directory(make_runtime: Any) -> None:
    layers = SettingsLayers(venues={"qq:77": {"historyLimit": 4}, "qq:88": {"historyLimit": 8}})
    sessions = StaticSessions({SID: SessionInfo(SID, origin_platform="qq", venue="qq:77")})
    rt = make_runtime(settings=layers, sessions=sessions)
    assert turn(rt).settings.history_limit == 4
    # The opening input's own group wins over the directory's venue.
    assert turn(rt, group_id="88").settings.history_limit == 8


def test_the_platform_type_profile_applies_to_a_turn(make_runtime: Any) -> None:
    layers = SettingsLayers(
        platforms={"qq": {"historyLimit": 2}},
        types={"onebot": {"historyLimit": 3}},
        platform_types={"qq": "onebot"},
    )
    rt = make_runtime(settings=layers)
    assert turn(rt).settings.history_limit == 3


def test_the_session_layer_wins_in_a_turn(make_runtime: Any) -> None:
    layers = SettingsLayers(venues={"qq:77": {"historyLimit": 4}})
    rt = make_runtime(settings=layers, authority=StaticAuthority([("qq", "boss")]))
    set_setting(rt, SID, "historyLimit", 6, platform="qq", user_id="boss")
    assert turn(rt, group_id="77").settings.history_limit == 6


def test_without_a_settings_service_the_plugin_config_is_the_only_layer_below_the_session(
    make_runtime: Any,
) -> None:
    """No platform, type or venue layers: the plugin config, under the session's own
    layer (kept in its log, so /session.set still works)."""
    rt = make_runtime(config=AgentConfig(history_limit=3, think="high"))
    opened = turn(rt, group_id="77")
    assert (opened.settings.history_limit, opened.settings.think) == (3, "high")
    set_setting(rt, SID, "think", "low")
    assert turn(rt).settings.think == "low"


def test_an_llm_in_a_layer_picks_the_turns_model(make_runtime: Any) -> None:
    a, b = model("a"), model("b")
    layers = SettingsLayers(platforms={"qq": {"llm": "p/b"}})
    rt = make_runtime(LlmService([Provider("p", [a, b])]), settings=layers)
    opened = turn(rt)
    assert opened.settings.model == ModelRef(provider="p", model="b")
    assert (a.requests, [r.model for r in b.requests]) == ([], ["p/b"])


def test_settings_are_read_once_when_the_turn_opens(make_runtime: Any) -> None:
    """SCH5: a setting changed while a turn runs applies from the next turn; the running
    turn's second model call still sends what was read at its opening."""
    entered, release = threading.Event(), threading.Event()

    def gate(args: Any, ctx: Any) -> str:
        entered.set()
        assert release.wait(10)
        return "ok"

    tunable = model(
        "t",
        think_levels=[LOW, HIGH],
        replies=[
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="gate", arguments="{}"),)),
            ScriptedReply(text="完成"),
        ],
    )
    rt = make_runtime(
        tunable, config=AgentConfig(think="low"), tools=ToolRegistry([Tool("gate", gate)])
    )
    handle = rt.submit(SID, Input(id="", content="你好", platform="qq"))
    assert entered.wait(10)
    set_setting(rt, SID, "think", "high")
    release.set()
    assert handle.result(10).outcome == "replied"
    assert rt.wait_idle(10)
    assert [r.think for r in tunable.requests] == ["low", "low"]
    assert turn(rt).settings.think == "high"
    assert tunable.requests[-1].think == "high"


# --- fields(): the model (SET1, SET5) -----------------------------------------------


def test_fields_llm_unset_follows_the_preference_by_name(make_runtime: Any) -> None:
    a, b = model("a", name="甲"), model("qwen", name="千问")
    rt = make_runtime(
        LlmService([Provider("p", [a, b])], plugin_preference=ModelRef(provider="p", model="qwen"))
    )
    llm = field(rt, "llm")
    assert (llm.value, llm.layer, llm.text) == ("p/qwen", None, follow_preference("千问"))


def test_fields_llm_reports_the_fallback_when_the_set_model_is_missing(make_runtime: Any) -> None:
    a = model("a", name="甲")
    rt = make_runtime(LlmService([Provider("p", [a])]))
    rt.assign_model(SID, "gone/model")
    llm = field(rt, "llm")
    assert (llm.value, llm.layer) == ("p/a", "session")
    assert "gone/model" in llm.text and "甲" in llm.text
    assert llm.text != "gone/model"


def test_fields_llm_set_and_present(make_runtime: Any) -> None:
    rt = make_runtime(LlmService([Provider("p", [model("a"), model("b")])]))
    rt.assign_model(SID, ModelRef(provider="p", model="b"))
    llm = field(rt, "llm")
    assert (llm.value, llm.layer, llm.text) == ("p/b", "session", "p/b")


def test_fields_llm_from_a_platform_profile_names_the_layer(make_runtime: Any) -> None:
    layers = SettingsLayers(platforms={"qq": {"llm": "p/b"}})
    rt = make_runtime(LlmService([Provider("p", [model("a"), model("b")])]), settings=layers)
    llm = field(rt, "llm", platform="qq")
    assert (llm.value, llm.layer) == ("p/b", "platform profile 'qq'")
    assert llm.line().endswith(" · 平台档")
    assert field(rt, "llm", platform="discord").value == "p/a"


def test_fields_use_the_sessions_origin_platform_and_venue(make_runtime: Any) -> None:
    layers = SettingsLayers(
        platforms={"qq": {"historyLimit": 2}}, venues={"qq:77": {"historyLimit": 7}}
    )
    sessions = StaticSessions({SID: SessionInfo(SID, origin_platform="qq", venue="qq:77")})
    rt = make_runtime(settings=layers, sessions=sessions)
    limit = field(rt, "historyLimit")
    assert (limit.value, limit.layer) == (7, "venue 'qq:77'")
    limit = field(rt, "historyLimit", venue="qq:other")
    assert (limit.value, limit.layer) == (2, "platform profile 'qq'")


def test_fields_with_no_model_at_all_still_show(make_runtime: Any) -> None:
    rt = make_runtime(LlmService())
    views = {f.key: f for f in rt.fields(SID)}
    assert views["llm"].value is None
    assert views["think"].text == THINK_NOT_TUNABLE
    assert views["maxToolIterations"].text == UNLIMITED


# --- fields(): the thinking level (SET2) --------------------------------------------


def test_think_is_not_tunable_on_a_model_without_levels(make_runtime: Any) -> None:
    rt = make_runtime(model("plain"))
    think = field(rt, "think")
    assert (think.text, think.options) == (THINK_NOT_TUNABLE, ())
    set_setting(rt, SID, "think", "high")
    assert field(rt, "think").text == THINK_NOT_TUNABLE


def test_think_options_are_the_current_models_levels(make_runtime: Any) -> None:
    two = model("two", think_levels=[LOW, HIGH], default_think="high")
    one = model("one", think_levels=[MAX])
    rt = make_runtime(LlmService([Provider("p", [two, one])]))
    think = field(rt, "think")
    assert think.options == (("low", "低"), ("high", "高"))
    assert "高" in think.text  # unset: the model's default level, by name
    rt.assign_model(SID, "p/one")  # re-fetched when llm changes
    assert field(rt, "think").options == (("max", "极致"),)


def test_think_set_and_declared_shows_the_level_name(make_runtime: Any) -> None:
    rt = make_runtime(model("t", think_levels=[LOW, HIGH]))
    set_setting(rt, SID, "think", "high")
    think = field(rt, "think")
    assert (think.value, think.text) == ("high", "高")


def test_think_set_but_missing_from_the_model_says_so(make_runtime: Any) -> None:
    has_max = model("big", think_levels=[LOW, MAX])
    lacks_max = model("small", think_levels=[LOW, HIGH], default_think="high")
    rt = make_runtime(LlmService([Provider("p", [lacks_max, has_max])]))
    set_setting(rt, SID, "think", "max")
    think = field(rt, "think")
    # The name comes from the model that declares the level; the default by its name.
    assert think.text == "极致（" + think_not_in_model("高") + "）"
    assert think.options == (("low", "低"), ("high", "高"))
    rt.assign_model(SID, "p/big")
    assert field(rt, "think").text == "极致"


def test_think_unknown_everywhere_shows_its_id(make_runtime: Any) -> None:
    rt = make_runtime(model("t", think_levels=[LOW]))
    set_setting(rt, SID, "think", "turbo")
    assert field(rt, "think").text == "turbo（" + think_not_in_model("低") + "）"


# --- assign_model (SET1) ------------------------------------------------------------


def test_assign_model_writes_the_session_layer_and_the_next_turn_uses_it(
    make_runtime: Any,
) -> None:
    a, b = model("a"), model("b", provider="q")
    rt = make_runtime(LlmService([Provider("p", [a]), Provider("q", [b])]))
    rt.assign_model(SID, "q/b")
    changes = [e for e in rt.store.read(SID) if isinstance(e, SettingsChanged)]
    assert [(c.key, c.value, c.reset) for c in changes] == [
        ("llm", {"provider": "q", "model": "b"}, False)
    ]
    assert dict(rt.view(SID).settings) == {"llm": {"provider": "q", "model": "b"}}
    opened = turn(rt)
    assert opened.settings.model == ModelRef(provider="q", model="b")
    assert (a.requests, [r.model for r in b.requests]) == ([], ["q/b"])


@pytest.mark.parametrize("bad", ["nomodel", "p/", "/a", ""])
def test_assign_model_refuses_a_bad_reference(make_runtime: Any, bad: str) -> None:
    rt = make_runtime()
    with pytest.raises(ConfigError, match="'llm'"):
        rt.assign_model(SID, bad)
    assert [e for e in rt.store.read(SID) if isinstance(e, SettingsChanged)] == []


# --- /model (CMD1) ------------------------------------------------------------------


def many_models() -> LlmService:
    """45 models: 25 ``local/qwen-NN`` then 20 ``openai/gpt-NN`` (one named DeepSeek)."""
    local = [model(f"qwen-{i:02}", "local") for i in range(25)]
    remote = [model(f"gpt-{i:02}", "openai") for i in range(19)]
    remote.append(model("ds-v3", "openai", name="DeepSeek V3"))
    return LlmService([Provider("local", local), Provider("openai", remote)])


def body(reply: str) -> list[str]:
    """The entry ids of a listing: the lines between header and footer."""
    return [line.split()[0] for line in reply.splitlines()[1:-1]]


ALL_IDS = [f"local/qwen-{i:02}" for i in range(25)] + [
    *(f"openai/gpt-{i:02}" for i in range(19)),
    "openai/ds-v3",
]


def test_model_lists_twenty_per_page_with_header_and_footer(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, "/model")
    lines = reply.splitlines()
    assert lines[0] == listing_header(MODELS_WHAT, 45, 1, 3, None)
    assert lines[-1] == listing_footer("/model", 1, 3)
    assert body(reply) == ALL_IDS[:PAGE_SIZE] and PAGE_SIZE == 20


def test_model_second_and_last_pages(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    second = cmd(rt, "/model -p 2")
    assert second.splitlines()[0] == listing_header(MODELS_WHAT, 45, 2, 3, None)
    assert body(second) == ALL_IDS[20:40]
    last = cmd(rt, "/model -p 3")
    assert body(last) == ALL_IDS[40:]
    assert last.splitlines()[-1] == listing_footer("/model", 3, 3)
    assert "-p 4" not in last  # no next page to offer


def test_model_lists_the_settable_id_form(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    listed = body(cmd(rt, "/model -p 3"))[-1]
    reply = cmd(rt, f"/session.set llm {listed}")
    assert "不在" not in reply
    assert field(rt, "llm").value == listed


def test_model_keyword_filters_case_insensitively_on_id(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, "/model QWEN")
    assert reply.splitlines()[0] == listing_header(MODELS_WHAT, 25, 1, 2, "QWEN")
    assert body(reply) == ALL_IDS[:20]
    assert body(cmd(rt, "/model QWEN -p 2")) == ALL_IDS[20:25]
    assert body(cmd(rt, "/model -p 2 qwen")) == ALL_IDS[20:25]
    assert body(cmd(rt, "/model OpenAI/GPT-1")) == [f"openai/gpt-{i}" for i in range(10, 19)]


def test_model_keyword_matches_the_model_name(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, "/model deepseek")
    assert reply.splitlines()[0] == listing_header(MODELS_WHAT, 1, 1, 1, "deepseek")
    assert body(reply) == ["openai/ds-v3"]


def test_model_keyword_does_not_match_the_context_length_annotation(make_runtime: Any) -> None:
    rt = make_runtime(many_models())  # every model has context_length 32000
    assert "没有" in cmd(rt, "/model 32000")


def test_model_no_match_says_so(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, "/model zzz")
    assert "zzz" in reply and "没有" in reply
    assert body(reply) == []
    assert reply.splitlines()[-1] == listing_footer("/model", 1, 1)


def test_model_marks_the_model_in_use(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    marked = [line for line in cmd(rt, "/model").splitlines() if IN_USE in line]
    assert [m.split()[0] for m in marked] == ["local/qwen-00"]
    rt.assign_model(SID, "openai/gpt-03")
    assert IN_USE not in cmd(rt, "/model")
    marked = [line for line in cmd(rt, "/model -p 2").splitlines() if IN_USE in line]
    assert [m.split()[0] for m in marked] == ["openai/gpt-03"]


def test_model_marks_the_fallback_when_the_set_model_is_missing(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    rt.assign_model(SID, "gone/model")
    marked = [line for line in cmd(rt, "/model").splitlines() if IN_USE in line]
    assert [m.split()[0] for m in marked] == ["local/qwen-00"]


@pytest.mark.parametrize("args", ["-p 0", "-p x", "-p", "-p -1", "qwen -p"])
def test_model_bad_page_gives_a_clear_message(make_runtime: Any, args: str) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, f"/model {args}")
    assert reply.startswith("/model：") and "页码" in reply
    assert body(reply) == [] and MODELS_WHAT not in reply


def test_model_page_beyond_the_last_says_so(make_runtime: Any) -> None:
    rt = make_runtime(many_models())
    reply = cmd(rt, "/model -p 4")
    assert reply.splitlines()[0] == "没有第 4 页（共 3 页）"
    assert "local/" not in reply and "openai/" not in reply
    assert "没有第 3 页（共 2 页）" in cmd(rt, "/model qwen -p 3")


def test_model_with_no_model_at_all(make_runtime: Any) -> None:
    rt = make_runtime(LlmService())
    reply = cmd(rt, "/model")
    assert "没有" in reply and MODELS_WHAT in reply


# --- /persona (CMD2) ----------------------------------------------------------------


def personas() -> StaticPersonas:
    table = {f"p{i:02}": (f"角色{i:02}", f"你是角色{i:02}。") for i in range(22)}
    table["zz-alice"] = ("Alice", "You are Alice.")
    return StaticPersonas(table)


PERSONA_IDS = [f"p{i:02}" for i in range(22)] + ["zz-alice"]


def test_persona_lists_twenty_per_page(make_runtime: Any) -> None:
    rt = make_runtime(persona=personas())
    first = cmd(rt, "/persona")
    assert first.splitlines()[0] == listing_header(PERSONAS_WHAT, 23, 1, 2, None)
    assert first.splitlines()[-1] == listing_footer("/persona", 1, 2)
    assert body(first) == PERSONA_IDS[:20]
    second = cmd(rt, "/persona -p 2")
    assert body(second) == PERSONA_IDS[20:]
    assert second.splitlines()[-1] == listing_footer("/persona", 2, 2)


def test_persona_keyword_on_id_and_name(make_runtime: Any) -> None:
    rt = make_runtime(persona=personas())
    assert body(cmd(rt, "/persona ALICE")) == ["zz-alice"]  # the name, any case
    assert body(cmd(rt, "/persona P1")) == [f"p{i}" for i in range(10, 20)]  # the id
    reply = cmd(rt, "/persona 角色2")
    assert reply.splitlines()[0] == listing_header(PERSONAS_WHAT, 2, 1, 1, "角色2")


@pytest.mark.parametrize("args", ["-p 0", "-p abc", "-p"])
def test_persona_bad_page(make_runtime: Any, args: str) -> None:
    rt = make_runtime(persona=personas())
    reply = cmd(rt, f"/persona {args}")
    assert reply.startswith("/persona：") and "页码" in reply


def test_persona_page_beyond_the_last(make_runtime: Any) -> None:
    rt = make_runtime(persona=personas())
    assert cmd(rt, "/persona -p 3").splitlines()[0] == "没有第 3 页（共 2 页）"


def test_persona_without_a_persona_service(make_runtime: Any) -> None:
    rt = make_runtime()
    reply = cmd(rt, "/persona")
    assert reply.startswith("没有人设服务")
    assert "/persona" in reply


# --- page_of (CMD1-CMD2), property-based ---------------------------------------------


entry_lists = st.lists(
    st.tuples(st.text("abcXYZ-", min_size=1, max_size=6), st.text("abcXYZ ", max_size=6)),
    max_size=75,
)


@settings(derandomize=True)
@given(entries=entry_lists)
def test_pages_partition_the_entries_in_order(entries: list[tuple[str, str]]) -> None:
    _, _, total, _, pages = page_of(entries, [])
    assert total == len(entries)
    assert pages == max(-(-len(entries) // 20), 1)
    cut = [page_of(entries, ["-p", str(n)])[0] for n in range(1, pages + 1)]
    assert [e for page in cut for e in page] == entries
    assert all(len(page) == 20 for page in cut[:-1])
    assert 0 < len(cut[-1]) <= 20 or not entries
    assert page_of(entries, ["-p", str(pages + 1)])[0] == []


@settings(derandomize=True)
@given(entries=entry_lists, keyword=st.text("abcxyzABCXYZ", min_size=1, max_size=2))
def test_the_filter_is_a_case_insensitive_substring_on_id_or_text(
    entries: list[tuple[str, str]], keyword: str
) -> None:
    _, shown_keyword, total, _, pages = page_of(entries, [keyword])
    everything = [
        e for n in range(1, pages + 1) for e in page_of(entries, [keyword, "-p", str(n)])[0]
    ]
    needle = keyword.lower()
    assert shown_keyword == keyword
    assert everything == [e for e in entries if needle in e[0].lower() or needle in e[1].lower()]
    assert total == len(everything)


@settings(derandomize=True)
@given(
    raw=st.one_of(
        st.sampled_from(["0", "-1", "x", "1.5", "", "00", "²", "١"]), st.text("ab-", max_size=3)
    )
)
def test_a_bad_page_number_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="页码"):
        page_of([("a", "b")], ["-p", raw])


def test_keyword_words_around_the_page_option_join() -> None:
    shown, keyword, total, page, pages = page_of(
        [("x", "deep seek"), ("y", "deepseek")], ["deep", "-p", "1", "seek"]
    )
    assert (shown, keyword, total, page, pages) == ([("x", "deep seek")], "deep seek", 1, 1, 1)


def test_session_fields_without_a_runtime() -> None:
    """session_fields reads the layers directly: a session layer beats the venue."""
    services = Services(
        llm=model("a"),
        settings=SettingsLayers(venues={"qq:1": {"maxToolIterations": 2}}),
    )
    views = {f.key: f for f in session_fields(services, "s", {}, platform="qq", venue="qq:1")}
    assert (views["maxToolIterations"].value, views["maxToolIterations"].text) == (2, "2")
    views = {
        f.key: f
        for f in session_fields(
            services, "s", {"maxToolIterations": 5}, platform="qq", venue="qq:1"
        )
    }
    assert (views["maxToolIterations"].value, views["maxToolIterations"].layer) == (5, "session")


def test_commands_show_the_venue_layer_of_the_room_they_come_from() -> None:
    """``handle_command(..., venue=...)``: /session reads the venue layer of that room."""
    rt = Runtime(
        InMemoryEventStore(),
        Services(
            llm=ScriptedModel(),
            settings=SettingsLayers(venues={"qq:g1": {"historyLimit": 7}}),
        ),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    try:
        here = handle_command(rt, "qq:group:g1", "/session", platform="qq", user_id="u")
        there = handle_command(
            rt, "qq:group:g1", "/session", platform="qq", user_id="u", venue="qq:g1"
        )
    finally:
        rt.shutdown(timeout=10)
    assert here is not None and "历史条数上限（historyLimit）：0" in here.splitlines()
    assert there is not None and "历史条数上限（historyLimit）：7 · 场所" in there.splitlines()


def test_snapshot_and_fields_read_the_venue_the_turns_read() -> None:
    """The venue comes from the opening input's group: ``token:request`` (ACC3: the same
    settings as a real turn) and ``/session`` use the venue the latest turn was read for."""
    sid = "qq:group:77"
    big = ScriptedModel(model_id="a", provider_id="p", context_length=32_000)
    small = ScriptedModel(model_id="b", provider_id="p", context_length=8_000)
    rt = Runtime(
        InMemoryEventStore(),
        Services(
            llm=LlmService([Provider("p", [big, small])]),
            settings=SettingsLayers(venues={"qq:77": {"llm": "p/b", "historyLimit": 2}}),
            sessions=StaticSessions({sid: SessionInfo(sid, origin_platform="qq")}),
        ),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    try:
        for i in range(3):
            rt.submit(sid, Input(id="", content=f"你好{i}", platform="qq", group_id="77")).result(
                10
            )
        rt.wait_idle(10)
        opened = [e for e in rt.store.read(sid) if isinstance(e, TurnOpened)]
        assert {e.venue for e in opened} == {"qq:77"}
        assert small.requests and not big.requests  # the turns used the venue's model
        usage = rt.token_request(sid)
        assert usage.context_window == 8_000
        lines = (handle_command(rt, sid, "/session", platform="qq", user_id="u") or "").split("\n")
        assert "模型（llm）：p/b · 场所" in lines
        assert "历史条数上限（historyLimit）：2 · 场所" in lines
    finally:
        rt.shutdown(timeout=10)


def test_fields_ask_a_custom_resolver_for_the_session_itself() -> None:
    """A resolver that answers per session: fields() report what that session's turns get."""

    class PerSession:
        def for_turn(
            self, session_id: str, platform: Any, layer: Any, venue: Any = None
        ) -> TurnSettings:
            model = ModelRef(provider="p", model="b") if session_id == "s1" else None
            return TurnSettings(model=model)

    a = ScriptedModel(model_id="a", provider_id="p")
    b = ScriptedModel(model_id="b", provider_id="p")
    rt = Runtime(
        InMemoryEventStore(),
        Services(llm=LlmService([Provider("p", [a, b])]), settings=PerSession()),
        FixedClock(),
        SequentialIds(),
        janitor=False,
    )
    try:
        fields = {f.key: f for f in rt.fields("s1")}
        assert (fields["llm"].value, fields["llm"].text) == ("p/b", "p/b")
        other = {f.key: f for f in rt.fields("s2")}
        assert other["llm"].value == "p/a"
    finally:
        rt.shutdown(timeout=10)


# --- values the log cannot hold are refused where the layers are built ---------------------


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("historyLimit", 2**63, "must be <= 9223372036854775807"),
        ("maxToolIterations", "99999999999999999999", "must be <= 9223372036854775807"),
        ("think", "\ud800", "not valid text"),
        ("persona", "p" * 257, "at most 256 characters"),
        ("llm", {"provider": "p", "model": "\udfff"}, "not valid text"),
        ("enabledToolGroups", ["g"] * 257, "at most 256 groups"),
    ],
)
def test_validate_setting_refuses_what_the_log_cannot_hold(
    key: str, value: Any, problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_setting(key, value, layer="venue 'qq:1'")
    assert f"venue 'qq:1' setting '{key}'" in str(err.value) and problem in str(err.value)


def test_the_layers_refuse_values_and_keys_the_log_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="platform profile 'qq' setting 'historyLimit'"):
        SettingsLayers(platforms={"qq": {"historyLimit": 2**64}})
    with pytest.raises(ConfigError, match=r"venue '.*': the key must be valid text"):
        SettingsLayers(venues={"qq:\ud800": {"historyLimit": 1}})
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match=r"expected a table of settings, got \[\[\[\[\.{3}\]"):
        SettingsLayers(types={"onebot": deep})
    with pytest.raises(ConfigError, match="static settings setting 'historyLimit'"):
        StaticSettings(history_limit=2**63)
    with pytest.raises(ConfigError, match="static settings setting 'maxToolIterations'"):
        StaticSettings(max_tool_iterations=0)
    top = StaticSettings(history_limit=2**63 - 1).for_turn("s", None, {})
    assert top.history_limit == 2**63 - 1
