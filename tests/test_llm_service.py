"""The llm service (services/models.py) and its use by turns: SET1 model choice, SET5
fallback warnings, SET2 thinking levels, the trim budget from the model's context length,
and a turn with no model at all."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from aalis_agent.actors.commands import set_setting
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    ConfigError,
    FixedClock,
    InMemoryEventStore,
    Input,
    ModelCallStarted,
    ModelRef,
    SequentialIds,
    TurnRecorded,
)
from aalis_agent.events.schema import ToolCall
from aalis_agent.request.texts import ERROR_PREFIX
from aalis_agent.request.trim import trim_budget
from aalis_agent.services import ScriptedModel, ScriptedReply, Services
from aalis_agent.services.llm import ThinkLevel
from aalis_agent.services.models import (
    LlmService,
    ModelChoice,
    Provider,
    entry_id,
    model_name,
    parse_model_ref,
    think_default,
    think_levels,
)
from aalis_agent.services.tools import Tool, ToolRegistry

SID = "qq:group:5"
FALLBACK_EVENT = "preferred model missing; using the fallback"
LOW = ThinkLevel(id="low", name="低")
HIGH = ThinkLevel(id="high", name="高")


def model(model_id: str, provider: str = "p", **kwargs: Any) -> ScriptedModel:
    return ScriptedModel(model_id=model_id, provider_id=provider, **kwargs)


def ref(text: str) -> ModelRef:
    provider, name = text.split("/", 1)
    return ModelRef(provider=provider, model=name)


def fallback_warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == FALLBACK_EVENT]


class BareModel:
    """A chat model that declares nothing optional: no name, no levels, no default."""

    def __init__(self, model_id: str = "bare", provider_id: str = "p") -> None:
        self.id = model_id
        self.provider_id = provider_id
        self.context_length = 1000
        self.max_output_tokens = 100

    def chat_stream(self, request: Any, abort: Any) -> Iterator[Any]:  # pragma: no cover
        return iter(())


# --- runtime plumbing ---------------------------------------------------------------


@pytest.fixture
def make_runtime(runtimes: list[Runtime]) -> Any:
    def make(llm: Any, **kwargs: Any) -> Runtime:
        rt = Runtime(
            InMemoryEventStore(),
            Services(llm=llm, **kwargs),
            FixedClock(),
            SequentialIds(),
            janitor=False,
        )
        runtimes.append(rt)
        return rt

    return make


def turn(rt: Runtime, content: str = "你好", sid: str = SID) -> Any:
    outcome = rt.submit(sid, Input(id="", content=content, platform="qq")).result(10)
    assert rt.wait_idle(10)
    return outcome


def calls(rt: Runtime, sid: str = SID) -> list[ModelCallStarted]:
    return [e for e in rt.store.read(sid) if isinstance(e, ModelCallStarted)]


# --- entry ids and model references (SET1) ------------------------------------------


def test_entry_id_is_provider_slash_model() -> None:
    assert entry_id(model("qwen2.5", provider="local")) == "local/qwen2.5"


def test_model_name_prefers_the_declared_name_else_the_id() -> None:
    assert model_name(model("m1", name="千问")) == "千问"
    assert model_name(BareModel("m2")) == "m2"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("openai/gpt-4o", ModelRef(provider="openai", model="gpt-4o")),
        # Only the first '/' separates: model ids may contain slashes themselves.
        ("or/meta/llama-3", ModelRef(provider="or", model="meta/llama-3")),
        ({"provider": "local", "model": "qwen"}, ModelRef(provider="local", model="qwen")),
        (ModelRef(provider="a", model="b"), ModelRef(provider="a", model="b")),
    ],
)
def test_parse_model_ref_accepts_both_forms(value: object, expected: ModelRef) -> None:
    assert parse_model_ref(value, where="prefs.llm") == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "onlymodel",
        "/gpt-4o",
        "openai/",
        "/",
        None,
        42,
        {"provider": "", "model": "m"},
        {"provider": "p", "model": ""},
        {"provider": "p"},
        {"provider": 1, "model": "m"},
    ],
)
def test_parse_model_ref_refuses_empty_or_missing_parts_naming_where(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^agent\.toml: pluginServicePreferences\.llm: "):
        parse_model_ref(value, where="agent.toml: pluginServicePreferences.llm")


@pytest.mark.parametrize(
    "value", [ModelRef(provider="", model="m"), ModelRef(provider="p", model="")]
)
def test_parse_model_ref_refuses_a_model_ref_with_empty_parts(value: ModelRef) -> None:
    with pytest.raises(ConfigError, match="where-it-was"):
        parse_model_ref(value, where="where-it-was")


# --- providers ----------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["", "a/b"])
def test_provider_id_must_be_non_empty_without_slash(bad_id: str) -> None:
    with pytest.raises(ConfigError, match="provider id"):
        Provider(bad_id)


def test_provider_refuses_a_model_of_another_provider() -> None:
    with pytest.raises(ConfigError, match="says its provider is 'q'"):
        Provider("p", [model("m", provider="q")])


def test_a_provider_is_registered_once() -> None:
    service = LlmService([Provider("p", [model("a")])])
    with pytest.raises(ConfigError, match="registered twice"):
        service.register(Provider("p", [model("b")]))


def test_models_lists_providers_by_priority_then_registration() -> None:
    service = LlmService(
        [
            Provider("first", [model("f1", "first"), model("f2", "first")]),
            Provider("top", [model("t1", "top")], priority=5),
            Provider("second", [model("s1", "second")]),
        ]
    )
    assert [entry_id(m) for m in service.models()] == [
        "top/t1",
        "first/f1",
        "first/f2",
        "second/s1",
    ]


def test_find_by_reference_and_unregister() -> None:
    a = model("a")
    service = LlmService([Provider("p", [a])])
    assert service.find(ref("p/a")) is a
    assert service.find(ref("p/zz")) is None
    assert service.find(ref("q/a")) is None
    service.unregister("p")
    assert service.find(ref("p/a")) is None
    assert service.models() == []


def test_single_serves_one_model_and_services_wrap_a_bare_model() -> None:
    a = model("a", provider="solo")
    assert [p.id for p in LlmService.single(a).providers] == ["solo"]
    services = Services(llm=a)
    assert services.models.preferred() is a
    service = LlmService.single(a)
    assert Services(llm=service).models is service


# --- SET1: the order of choice ------------------------------------------------------


def order_service(**prefs: ModelRef | None) -> LlmService:
    """Providers in registration order: ``reg`` (models r1, r2), ``hi`` (priority 3),
    ``mid`` (priority 1)."""
    return LlmService(
        [
            Provider("reg", [model("r1", "reg"), model("r2", "reg")]),
            Provider("hi", [model("h1", "hi")], priority=3),
            Provider("mid", [model("m1", "mid")], priority=1),
        ],
        **prefs,
    )


def test_set1_the_setting_beats_this_plugins_preference() -> None:
    service = order_service(plugin_preference=ref("reg/r2"), global_preference=ref("mid/m1"))
    choice = service.resolve(ref("reg/r1"))
    assert (choice.entry_id, choice.source, choice.fell_back) == ("reg/r1", "setting", False)
    # Without the setting, the plugin preference decides.
    assert service.resolve(None).entry_id == "reg/r2"


def test_set1_this_plugins_preference_beats_the_global_preference() -> None:
    service = order_service(plugin_preference=ref("reg/r2"), global_preference=ref("mid/m1"))
    choice = service.resolve(None)
    assert (choice.entry_id, choice.source) == ("reg/r2", "plugin-preference")
    service.plugin_preference = None
    choice = service.resolve(None)
    assert (choice.entry_id, choice.source) == ("mid/m1", "global-preference")


def test_set1_the_global_preference_beats_provider_priority() -> None:
    service = order_service(global_preference=ref("reg/r2"))
    assert service.resolve(None).entry_id == "reg/r2"
    service.global_preference = None
    choice = service.resolve(None)
    assert (choice.entry_id, choice.source) == ("hi/h1", "provider-priority")


def test_set1_higher_provider_priority_beats_registration_order() -> None:
    service = order_service()
    assert service.preferred() is service.find(ref("hi/h1"))
    service.unregister("hi")  # next highest priority, though registered after 'reg'
    assert service.resolve(None).entry_id == "mid/m1"


def test_set1_equal_priorities_keep_registration_order() -> None:
    service = LlmService(
        [Provider("b", [model("b1", "b"), model("b2", "b")]), Provider("a", [model("a1", "a")])]
    )
    assert service.resolve(None).entry_id == "b/b1"
    service.unregister("b")
    assert service.resolve(None).entry_id == "a/a1"


def test_set1_a_provider_without_models_is_skipped_even_with_top_priority() -> None:
    service = LlmService([Provider("low", [model("l1", "low")]), Provider("empty", priority=9)])
    assert service.resolve(None).entry_id == "low/l1"


def test_no_model_at_all_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no chat model"):
        LlmService().resolve(None)
    with pytest.raises(ConfigError):
        LlmService([Provider("empty")]).preferred()


def test_model_choice_reports_its_entry_id_and_whether_it_fell_back() -> None:
    a = model("a")
    assert ModelChoice(a, "setting").entry_id == "p/a"
    assert not ModelChoice(a, "setting").fell_back
    assert ModelChoice(a, "provider-priority", ref("x/y"), "setting").fell_back


# --- SET5: a missing preferred model falls back, warned once per pair --------------


@pytest.mark.parametrize(
    ("prefs", "setting", "expected", "wanted", "wanted_from"),
    [
        # A missing setting: the plugin preference is next.
        ({"plugin_preference": ref("reg/r2")}, ref("reg/gone"), "reg/r2", "reg/gone", "setting"),
        # A missing plugin preference: the global preference is next.
        (
            {"plugin_preference": ref("gone/x"), "global_preference": ref("mid/m1")},
            None,
            "mid/m1",
            "gone/x",
            "plugin-preference",
        ),
        # A missing global preference: provider priority.
        ({"global_preference": ref("reg/gone")}, None, "hi/h1", "reg/gone", "global-preference"),
        # Everything missing: what was asked for first is what is reported.
        (
            {"plugin_preference": ref("x/1"), "global_preference": ref("x/2")},
            ref("x/0"),
            "hi/h1",
            "x/0",
            "setting",
        ),
    ],
)
def test_set5_a_missing_model_falls_back_to_the_next_step(
    prefs: dict[str, ModelRef],
    setting: ModelRef | None,
    expected: str,
    wanted: str,
    wanted_from: str,
) -> None:
    choice = order_service(**prefs).resolve(setting, warn=False)
    assert choice.entry_id == expected
    assert (str(choice.wanted), choice.wanted_source) == (wanted, wanted_from)
    assert choice.fell_back


def test_set5_an_unregistered_provider_falls_back_and_comes_back() -> None:
    service = order_service(plugin_preference=ref("mid/m1"))
    mid = service.providers[2]
    service.unregister("mid")
    assert service.resolve(None, warn=False).entry_id == "hi/h1"
    service.register(mid)
    choice = service.resolve(None, warn=False)
    assert (choice.entry_id, choice.fell_back) == ("mid/m1", False)


def test_set5_one_warning_per_wanted_and_actual_pair() -> None:
    service = order_service()
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            assert service.resolve(ref("reg/gone")).entry_id == "hi/h1"
    warned = fallback_warnings(logs)
    assert len(warned) == 1
    assert warned[0]["log_level"] == "warning"
    assert (warned[0]["wanted"], warned[0]["actual"]) == ("reg/gone", "hi/h1")
    assert warned[0]["plugin_preference"] is False


def test_set5_a_new_warning_when_the_actual_model_changes() -> None:
    service = order_service()
    with structlog.testing.capture_logs() as logs:
        service.resolve(ref("reg/gone"))
        service.unregister("hi")  # the fallback is now mid/m1
        service.resolve(ref("reg/gone"))
        service.resolve(ref("reg/gone"))
    assert [(w["wanted"], w["actual"]) for w in fallback_warnings(logs)] == [
        ("reg/gone", "hi/h1"),
        ("reg/gone", "mid/m1"),
    ]


def test_set5_a_new_warning_for_another_wanted_model() -> None:
    service = order_service()
    with structlog.testing.capture_logs() as logs:
        service.resolve(ref("reg/gone"))
        service.resolve(ref("reg/other"))
    assert [w["wanted"] for w in fallback_warnings(logs)] == ["reg/gone", "reg/other"]


@pytest.mark.parametrize(
    ("prefs", "wanted_from", "is_plugin"),
    [
        ({"plugin_preference": ref("gone/x")}, "plugin-preference", True),
        ({"global_preference": ref("gone/x")}, "global-preference", False),
    ],
)
def test_set5_the_warning_says_whether_it_was_this_plugins_preference(
    prefs: dict[str, ModelRef], wanted_from: str, is_plugin: bool
) -> None:
    with structlog.testing.capture_logs() as logs:
        order_service(**prefs).resolve(None)
    (warning,) = fallback_warnings(logs)
    assert warning["plugin_preference"] is is_plugin
    assert warning["wanted_from"] == wanted_from
    assert warning["wanted"] == "gone/x"


def test_set5_no_warning_when_nothing_fell_back_or_when_asked_not_to() -> None:
    service = order_service(plugin_preference=ref("reg/gone"))
    with structlog.testing.capture_logs() as logs:
        service.resolve(ref("reg/r1"))  # the setting is there: the preference is unused
        service.preferred()  # no warning for a look
        service.resolve(None, warn=False)
    assert fallback_warnings(logs) == []


# --- SET2: thinking levels ----------------------------------------------------------


def test_think_levels_and_default() -> None:
    assert think_levels(BareModel()) == ()
    assert think_default(BareModel()) is None
    assert think_levels(model("t", think_levels=[LOW, HIGH])) == (LOW, HIGH)
    assert think_default(model("t", think_levels=[LOW, HIGH])) == LOW  # the first
    assert think_default(model("t", think_levels=[LOW, HIGH], default_think="high")) == HIGH
    # A default naming no declared level: the first.
    assert think_default(model("t", think_levels=[LOW, HIGH], default_think="max")) == LOW


def test_think_for_sends_only_a_declared_level() -> None:
    tunable = model("t", think_levels=[LOW, HIGH])
    assert LlmService.think_for(tunable, "high") == "high"
    assert LlmService.think_for(tunable, "max") is None
    assert LlmService.think_for(tunable, None) is None
    assert LlmService.think_for(model("plain"), "high") is None


def test_set2_a_turn_sends_the_level_only_when_its_model_declares_it(make_runtime: Any) -> None:
    tunable = model("tunable", think_levels=[LOW, HIGH])
    other = model("other", think_levels=[LOW])  # has levels, not this one
    plain = model("plain")  # no levels at all
    rt = make_runtime(LlmService([Provider("p", [tunable, other, plain])]))
    rt.assign_model(SID, "p/tunable")
    set_setting(rt, SID, "think", "high")
    turn(rt)
    rt.assign_model(SID, "p/other")
    turn(rt)
    rt.assign_model(SID, "p/plain")
    turn(rt)
    assert [(r.model, r.think) for r in tunable.requests] == [("p/tunable", "high")]
    assert [(r.model, r.think) for r in other.requests] == [("p/other", None)]
    assert [(r.model, r.think) for r in plain.requests] == [("p/plain", None)]


# --- SET1 / SET5 through turns ------------------------------------------------------


def test_set1_a_turn_calls_the_preferred_model_by_its_entry_id(make_runtime: Any) -> None:
    a, b = model("a", "pa"), model("b", "pb")
    rt = make_runtime(
        LlmService([Provider("pa", [a]), Provider("pb", [b])], plugin_preference=ref("pb/b"))
    )
    turn(rt)
    assert a.requests == []
    assert [r.model for r in b.requests] == ["pb/b"]
    assert [c.model for c in calls(rt)] == ["pb/b"]


def test_set5_many_turns_on_a_missing_setting_warn_once(make_runtime: Any) -> None:
    a = model("a")
    rt = make_runtime(LlmService([Provider("p", [a])]))
    rt.assign_model(SID, "gone/model")
    with structlog.testing.capture_logs() as logs:
        for i in range(3):
            turn(rt, f"第{i}条")
    assert len(a.requests) == 3  # every turn used the fallback
    warned = fallback_warnings(logs)
    assert [(w["wanted"], w["actual"], w["plugin_preference"]) for w in warned] == [
        ("gone/model", "p/a", False)
    ]


def test_set5_a_missing_plugin_preference_is_warned_as_this_plugins(make_runtime: Any) -> None:
    a = model("a")
    rt = make_runtime(LlmService([Provider("p", [a])], plugin_preference=ref("p/gone")))
    with structlog.testing.capture_logs() as logs:
        turn(rt)
        turn(rt)
    (warning,) = fallback_warnings(logs)
    assert (warning["wanted"], warning["actual"], warning["plugin_preference"]) == (
        "p/gone",
        "p/a",
        True,
    )


def test_the_model_is_resolved_once_per_turn(make_runtime: Any) -> None:
    """SCH5: the settings are read when the turn opens; a change during the turn (here
    between its two model calls) applies from the next turn on."""
    entered, release = threading.Event(), threading.Event()

    def gate(args: Any, ctx: Any) -> str:
        entered.set()
        assert release.wait(10)
        return "ok"

    a = model(
        "a",
        replies=[
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="gate", arguments="{}"),)),
            ScriptedReply(text="完成"),
        ],
    )
    b = model("b")
    rt = make_runtime(LlmService([Provider("p", [a, b])]), tools=ToolRegistry([Tool("gate", gate)]))
    handle = rt.submit(SID, Input(id="", content="你好", platform="qq"))
    assert entered.wait(10)
    rt.assign_model(SID, "p/b")
    release.set()
    assert handle.result(10).outcome == "replied"
    assert rt.wait_idle(10)
    assert [r.model for r in a.requests] == ["p/a", "p/a"]
    assert b.requests == []
    turn(rt)
    assert [r.model for r in b.requests] == ["p/b"]


# --- the trim budget comes from the turn's model ------------------------------------


def test_context_window_and_budget_come_from_the_resolved_model(make_runtime: Any) -> None:
    small = model("small", context_length=8_000, max_output_tokens=1_000)
    large = model("large", context_length=128_000, max_output_tokens=4_096)
    rt = make_runtime(LlmService([Provider("p", [small, large])]))
    usages: list[dict[str, Any]] = []
    rt.subscribe("token:usage", lambda topic, payload: usages.append(payload))
    turn(rt)  # no setting: the first registered model
    rt.assign_model(SID, "p/large")
    turn(rt)
    assert [(u["contextWindow"], u["maxTokens"], u["tokenBudget"]) for u in usages] == [
        (8_000, 1_000, trim_budget(8_000, 1_000)),
        (128_000, 4_096, trim_budget(128_000, 4_096)),
    ]


def test_a_small_model_trims_what_a_large_one_keeps(make_runtime: Any) -> None:
    """The trim itself runs on the resolved model's budget, not only the report."""
    small = model("small", context_length=1_000, max_output_tokens=100)
    large = model("large", context_length=200_000, max_output_tokens=100)
    rt = make_runtime(LlmService([Provider("p", [large, small])]))
    usages: list[dict[str, Any]] = []
    rt.subscribe("token:usage", lambda topic, payload: usages.append(payload))
    for i in range(12):
        turn(rt, f"第{i}条：" + "很长的一段话" * 60)
    assert usages[-1]["trimmed"] is False
    rt.assign_model(SID, "p/small")
    turn(rt, "再来")
    assert usages[-1]["contextWindow"] == 1_000
    assert usages[-1]["trimmed"] is True
    assert len(small.requests[-1].messages) < len(large.requests[-1].messages)


# --- no model at all ----------------------------------------------------------------


def test_a_turn_with_no_model_ends_in_error_with_a_notice(make_runtime: Any) -> None:
    rt = make_runtime(LlmService())
    notices: list[dict[str, Any]] = []
    rt.subscribe("outbound:message", lambda topic, payload: notices.append(payload))
    outcome = turn(rt)
    assert outcome.outcome == "error"
    (recorded,) = [e for e in rt.store.read(SID) if isinstance(e, TurnRecorded)]
    assert recorded.outcome == "error"
    assert [n["kind"] for n in notices] == ["error"]
    assert notices[0]["content"].startswith(ERROR_PREFIX)
    assert notices[0]["turnId"] == recorded.turn_id
    # The session is not stuck: a provider registered later serves the next turn.
    late = model("late", "late")
    rt.services.llm.register(Provider("late", [late]))
    assert turn(rt).outcome == "replied"
    assert [r.model for r in late.requests] == ["late/late"]
