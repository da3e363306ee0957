"""Nothing unreadable is ever written to the event log, and deep or hostile input gets a
clear error (``request/limits.py``): tool arguments, tool results, text that is not
valid Unicode, settings values, and configuration and scenario text nested past a sane
depth — all checked without recursing."""

from __future__ import annotations

import contextlib
import json
import math
import tomllib
from typing import Any

import msgspec
import pytest
from aalis_agent.events import ConfigError, SettingsChanged, ToolFinished, ToolStarted
from aalis_agent.events.codec import decode, encode
from aalis_agent.request.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    check_depth,
    clean_text,
    coerce_tool_result,
    find_unloggable,
    json_too_deep,
    parse_tool_arguments,
    show_path,
    toml_too_deep,
    tool_arguments_too_deep,
    tool_arguments_too_long,
)
from aalis_agent.request.texts import tool_bad_arguments
from aalis_agent.services.config import toml_path
from aalis_agent.services.settings import SETTING_FIELDS, validate_setting
from hypothesis import example, given, settings
from hypothesis import strategies as st

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
ANY_TEXT = st.text(alphabet=st.one_of(st.characters(codec=None), SURROGATES), max_size=60)
"""Text that may hold lone surrogates (``st.text()`` never does)."""

ASTRAL = st.integers(0x10000, 0x10FFFF).map(chr)


def nested(depth: int, opener: str = "[", closer: str = "]", core: str = "") -> str:
    return opener * depth + core + closer * depth


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def old_parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """``actors/turn.py``'s ``_parse_arguments`` before this module: the oracle for
    text that is not too deep."""
    if raw == "":
        return {}, None
    try:
        value = json.loads(raw)
    except ValueError:
        return {}, tool_bad_arguments(raw)
    if not isinstance(value, dict):
        return {}, tool_bad_arguments(raw)
    return value, None


def round_trips(event: Any) -> bool:
    """The event encodes, and decodes back to itself: what the log may hold."""
    return decode(encode(event)) == event


# --- parse_tool_arguments (FLOW13) -------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "args"),
    [
        ("", {}),
        ("{}", {}),
        ('{"city": "上海", "days": [1, 2]}', {"city": "上海", "days": [1, 2]}),
        ('  {"a": {"b": "[[[[{{{{"}}  ', {"a": {"b": "[[[[{{{{"}}),
        ('{"q": "\\"[[["}', {"q": '"[[['}),
    ],
)
def test_a_json_object_is_the_arguments(raw: str, args: dict[str, Any]) -> None:
    assert parse_tool_arguments(raw) == (args, None)


@pytest.mark.parametrize(
    "raw", ["{", "null", "[1, 2]", '"text"', "3", "{'a': 1}", "{} {}", "]]]", "1" * 5000]
)
def test_anything_else_gets_the_bad_arguments_error_as_before(raw: str) -> None:
    assert parse_tool_arguments(raw) == ({}, tool_bad_arguments(raw))


def test_nesting_is_refused_past_the_limit_without_recursing() -> None:
    at_limit = nested(MAX_DEPTH - 1, '{"a":', "}", "{}")
    assert parse_tool_arguments(at_limit)[1] is None
    for depth in (MAX_DEPTH + 1, 1_000, 100_000):
        raw = nested(depth, '{"a":', "}", "1")
        assert parse_tool_arguments(raw) == ({}, tool_arguments_too_deep(raw, MAX_DEPTH))
    raw = nested(100_000)  # an array too: the depth is checked before the type
    assert parse_tool_arguments(raw) == ({}, tool_arguments_too_deep(raw, MAX_DEPTH))
    assert parse_tool_arguments(nested(5, '{"a":', "}", "1"), max_depth=4)[1] == (
        tool_arguments_too_deep(nested(5, '{"a":', "}", "1"), 4)
    )


def test_brackets_inside_strings_do_not_count() -> None:
    raw = '{"a": "' + "[" * 10_000 + '", "b": "\\"' + "{" * 10_000 + '"}'
    args, error = parse_tool_arguments(raw)
    assert error is None and args["a"] == "[" * 10_000


def test_the_too_deep_and_too_long_errors_read_like_the_bad_arguments_one() -> None:
    raw = nested(100)
    text = tool_arguments_too_deep(raw, 64)
    assert text.startswith("[错误] 工具参数嵌套超过 64 层，没有执行")
    assert text.endswith("原文前 200 字：" + raw[:200])
    long = '{"a": "' + "x" * 50 + '"}'
    assert parse_tool_arguments(long, max_chars=20) == ({}, tool_arguments_too_long(long, 20))
    assert tool_arguments_too_long(long, 20).startswith(f"[错误] 工具参数有 {len(long)} 字")
    assert parse_tool_arguments(long, max_chars=len(long))[1] is None


def test_quoted_text_in_an_error_is_valid_unicode() -> None:
    raw = "{\ud83d" + nested(100)
    _, error = parse_tool_arguments(raw)
    assert error is not None and "\ud83d" not in error
    error.encode("utf-8")


JSON_LEAF = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=20,
)
BRACKET_SOUP = st.text(alphabet='[]{}"\\,: 1ax\n', max_size=200)


@settings(max_examples=300)
@given(st.one_of(st.text(), ANY_TEXT, BRACKET_SOUP))
@example("[" * 100_000)
@example("{" * 100_000 + "}" * 100_000)
@example('{"a":' * 100_000)
@example('"' + "[" * 100_000)
@example("\\" * 1000 + "[" * 100_000)
def test_parse_tool_arguments_never_raises(raw: str) -> None:
    args, error = parse_tool_arguments(raw)
    assert isinstance(args, dict) and (error is None or isinstance(error, str))
    if error is not None:
        assert args == {}
        error.encode("utf-8")  # the error is stored: it must be valid text


@settings(max_examples=300)
@given(st.one_of(st.text(), BRACKET_SOUP, JSON.map(json.dumps)))
def test_it_answers_as_before_for_text_that_is_not_too_deep(raw: str) -> None:
    if json_too_deep(raw, MAX_DEPTH):
        return
    assert parse_tool_arguments(raw) == old_parse_arguments(raw)


@given(st.integers(1, 3000), st.sampled_from(["[", '{"k":']))
def test_the_limit_is_exact_at_any_depth(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    raw = opener * depth + "1" + closer * depth
    error = parse_tool_arguments(raw, max_depth=100)[1]
    if depth > 100:
        assert error == tool_arguments_too_deep(raw, 100)
    elif opener == "[":
        assert error == tool_bad_arguments(raw)  # an array: not an object
    else:
        assert error is None


# --- clean_text -----------------------------------------------------------------------


@settings(max_examples=300)
@given(ANY_TEXT)
def test_clean_text_always_encodes_to_utf8(s: str) -> None:
    cleaned = clean_text(s)
    cleaned.encode("utf-8")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cleaned)) == cleaned


@given(st.text())
def test_text_without_surrogates_is_unchanged(s: str) -> None:
    assert clean_text(s) is s


@given(st.text(), ASTRAL, st.text())
def test_a_pair_split_in_two_halves_is_joined(before: str, char: str, after: str) -> None:
    units = char.encode("utf-16-le")
    high = units[:2].decode("utf-16-le", "surrogatepass")
    low = units[2:].decode("utf-16-le", "surrogatepass")
    assert (len(high), len(low)) == (1, 1)
    assert clean_text(before + high + low + after) == before + char + after


@given(st.text(), SURROGATES, st.text())
def test_a_lone_surrogate_becomes_the_replacement_character(
    before: str, lone: str, after: str
) -> None:
    assert clean_text(before + lone + after) == before + "\ufffd" + after


def test_clean_text_examples() -> None:
    assert clean_text("a\ud83d\ude00b") == "a😀b"
    assert clean_text("\ude00\ud83d") == "\ufffd\ufffd"  # the wrong order is no pair
    assert clean_text("\ud83d\ud83d\ude00") == "\ufffd😀"
    assert clean_text("\ufeffx\ud800") == "\ufeffx\ufffd"  # a leading BOM character stays


# --- values already built -------------------------------------------------------------


def test_check_depth_is_iterative_and_exact() -> None:
    assert check_depth(deep_list(64), 64) is None
    assert check_depth({"a": deep_list(63)}, 64) is None
    error = check_depth(deep_list(65), 64)
    assert error is not None and error.startswith("嵌套超过 64 层（位置 [0][0]")
    assert check_depth(deep_list(100_000), 64) is not None
    assert check_depth({"a": [1, {"b": ({"c": 1},)}]}, 3) == "嵌套超过 3 层（位置 a[1].b）"
    assert check_depth(5, 0) is None and check_depth([], 0) == "嵌套超过 0 层"
    loop: list[Any] = []
    loop.append(loop)
    assert check_depth(loop, 64) is not None  # a cycle is refused, not followed forever


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("晴，21 度", "晴，21 度"),
        (None, None),
        (b"\xe6\x99\xb4\xff", "晴\ufffd"),
        (bytearray(b"ok"), "ok"),
        (
            {"temp": 21.5, "城市": "上海", "ok": True, "n": None},
            '{"temp":21.5,"城市":"上海","ok":true,"n":null}',
        ),
        ([1, 2, [3]], "[1,2,[3]]"),
        ((1, "a"), '[1,"a"]'),
        (42, "42"),
        (2**70, str(2**70)),
        (0.5, "0.5"),
        (True, "true"),
        ({1: "a"}, '{"1":"a"}'),
        ("bad\ud800", "bad\ufffd"),
        ({"s": "\ud83d\ude00\udfff"}, '{"s":"😀\ufffd"}'),
    ],
)
def test_coerce_tool_result_gives_text(value: object, text: str | None) -> None:
    assert coerce_tool_result(value) == (text, None)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (float("nan"), "NaN 或无穷大"),
        ({"a": [1, float("inf")]}, "NaN 或无穷大，JSON 表示不了（位置 a[1]）"),
        ({"a": {1, 2}}, "set，JSON 表示不了（位置 a）"),
        ({("k",): 1}, "不是文本的键"),
        (object(), "工具返回了 object，不能转成文本"),
        ({1.5, 2.5}, "工具返回了 set"),
        (deep_list(65), "嵌套超过 64 层"),
        (deep_list(100_000), "嵌套超过 64 层"),
        pytest.param(10**5000, "不能转成 JSON 文本", id="huge-int"),
    ],
)
def test_coerce_tool_result_refuses_with_a_clear_error(value: object, needle: str) -> None:
    text, error = coerce_tool_result(value)
    assert text is None and error is not None and needle in error, error
    error.encode("utf-8")


RESULTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | ANY_TEXT
    | st.binary(max_size=20)
    | st.sets(st.integers(), max_size=2),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.one_of(ANY_TEXT, st.integers(), st.floats()), inner, max_size=3)
    ),
    max_leaves=15,
)


@settings(max_examples=300)
@given(RESULTS)
def test_whatever_a_tool_returns_the_log_can_hold_what_is_stored(value: object) -> None:
    text, error = coerce_tool_result(value)
    assert error is None or text is None
    event = ToolFinished(
        session_id="s", seq=1, at=0, turn_id="t", call_id="c", name="n", result=text, error=error
    )
    assert round_trips(event)


# --- settings values (SET) --------------------------------------------------------------

SETTING_VALUES = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([INT64_MAX, INT64_MAX + 1, INT64_MIN, 2**64, 10**30]),
    ANY_TEXT,
    st.floats(),
    st.lists(ANY_TEXT, max_size=4),
    st.builds(lambda n: ["g"] * n, st.integers(0, 400)),
    st.builds(deep_list, st.integers(1, 5000)),
    st.dictionaries(st.sampled_from(["provider", "model"]), ANY_TEXT),
)


@settings(max_examples=400)
@given(st.sampled_from(sorted(SETTING_FIELDS)), SETTING_VALUES)
def test_a_setting_that_validates_is_one_the_log_holds(key: str, value: Any) -> None:
    try:
        stored = validate_setting(key, value)
    except ConfigError as exc:
        str(exc).encode("utf-8")  # the message is printable, however hostile the value
        return
    assert round_trips(SettingsChanged(session_id="s", seq=1, at=0, key=key, value=stored))


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("historyLimit", 99_999_999_999_999_999_999, "must be <= 9223372036854775807"),
        ("historyLimit", "99999999999999999999", "must be <= 9223372036854775807"),
        ("historyLimit", "9" * 5000, "must be <= 9223372036854775807"),
        pytest.param("historyLimit", 10**5000, "an integer of about 5001 digits", id="huge"),
        ("maxToolIterations", INT64_MAX + 1, "must be <= 9223372036854775807"),
        ("historyLimit", deep_list(100_000), "expected an integer, got [[[[...]]]]"),
        ("think", "\ud800", "not valid text"),
        ("persona", "p" * 1000, "at most 256 characters"),
        ("llm", "openai/\udfff", "not valid text"),
        ("enabledToolGroups", ["g"] * 1000, "at most 256 groups"),
        ("enabledToolGroups", ["ok", "\ud800"], "not valid text"),
    ],
)
def test_hostile_setting_values_are_refused_by_key(key: str, value: Any, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_setting(key, value)
    assert f"session setting '{key}'" in str(err.value) and problem in str(err.value)


def test_the_int64_bounds_themselves_are_accepted() -> None:
    assert validate_setting("historyLimit", INT64_MAX) == INT64_MAX
    assert validate_setting("maxToolIterations", str(INT64_MAX)) == INT64_MAX
    assert validate_setting("historyLimit", " 007 ") == 7


# --- configuration and scenario text ----------------------------------------------------


def test_find_unloggable_names_the_dotted_key() -> None:
    assert find_unloggable({"a": {"b": [1, 2]}, "c": "ok"}) is None
    assert find_unloggable({"a": {"b": [1, 2**64]}}) == (
        "a.b[1]",
        f"integer out of range: it must fit in 64 bits ({INT64_MIN} to {INT64_MAX})",
    )
    assert find_unloggable({"x": {"k\ud800": 1}}) == (
        "x.k\ufffd",
        "text that is not valid Unicode (a lone surrogate)",
    )
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(10_000):
        node["k"] = {}
        node = node["k"]
    found = find_unloggable(deep)
    assert found is not None and found[1] == "nested deeper than 64 levels"
    assert found[0].startswith("k.k.k") and len(found[0]) <= 200
    assert find_unloggable({"n": -(2**63), "m": 2**63 - 1, "f": math.inf}) is None


def test_toml_path_quotes_what_toml_quotes() -> None:
    assert toml_path(("settings", "venue", "qq:1", "x", 2, "a b")) == (
        'settings.venue."qq:1".x[2]."a b"'
    )
    assert toml_path(("k" * 100, "")) == "k" * 60 + '....""'
    assert toml_path(("p", "\ud800\n")) == 'p."\\ud800\\n"'
    assert len(toml_path(("abc",) * 500)) == 200
    text = '[settings.venue."qq:1"]\n"w.x".y = ' + nested(65) + "\n"
    assert toml_too_deep(text, 64, shown=toml_path) == ('settings.venue."qq:1"."w.x".y', 2)
    assert find_unloggable({"a/b": [1, {"c d": 2**64}]}, shown=toml_path) == (
        '"a/b"[1]."c d"',
        f"integer out of range: it must fit in 64 bits ({INT64_MIN} to {INT64_MAX})",
    )


def test_show_path() -> None:
    assert show_path(("a", "b", 2, "c")) == "a.b[2].c"
    assert show_path((0, "x")) == "[0].x"
    assert show_path(("k" * 100,)) == "k" * 39 + "…"
    assert len(show_path(("abc",) * 500)) == 200


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("a = " + nested(100) + "\n", ("a", 1)),
        ("[agent]\n\nsystemPrompt = " + nested(100) + "\n", ("agent.systemPrompt", 3)),
        (
            "[[steps]]\nx=1\n[[steps]]\ny = [\n" + nested(70, "{a=", "}", "1") + "]\n",
            ("steps[1].y", 5),
        ),
        (
            '[settings.venue."qq:1"]\n"w.x".y = ' + nested(65) + "\n",
            ("settings.venue.qq:1.w.x.y", 2),
        ),
        ("[[a]]\n[[a.b]]\n[[a]]\n[[a.b]]\nk = " + nested(65) + "\n", ("a[1].b[0].k", 5)),
        ("a = " + nested(64) + "\n", None),
        ('a = "' + "[" * 100 + '"\n', None),
        ("a = '" + "[" * 100 + "'\n", None),
        ('a = """\n' + "[" * 100 + '\\"""\n"""\n', None),
        ("a = '''" + "{" * 100 + "''''\n", None),
        ("# " + "[" * 100 + "\na = [ # " + "[" * 100 + "\n1]\n", None),
        ('["' + "[" * 100 + '"]\nb = 1\n', None),
        ('a = """' + "[" * 100, None),  # unterminated: tomllib says so
        ("a = " + "[" * 100_000, ("a", 1)),
    ],
)
def test_toml_too_deep_finds_the_key_and_line(text: str, found: tuple[str, int] | None) -> None:
    assert toml_too_deep(text, 64) == found


TOML_PIECES = st.sampled_from(
    [
        *("[", "]", "{", "}", "{a=", "a = ", "a.b = ", "[[t]]\n", "[t]\n", '"', "'", '"""'),
        *("'" * 3, "#", "\n", "\\", ",", "1", " ", "[" * 400, "{a=" * 400, "x = " + "[" * 400),
    ]
)
TOML_SOUP = st.lists(TOML_PIECES, max_size=40).map("".join)


@settings(max_examples=500)
@given(st.one_of(TOML_SOUP, st.text(alphabet="[]{}\"'#\\=.a\n ", max_size=300)))
def test_toml_too_deep_never_raises_and_protects_tomllib(text: str) -> None:
    if toml_too_deep(text, MAX_DEPTH) is not None:
        return
    # Whatever toml_too_deep lets through parses or fails: it never recurses too deep.
    with contextlib.suppress(tomllib.TOMLDecodeError):
        tomllib.loads(text)


def test_tool_events_with_what_parse_tool_arguments_keeps_round_trip() -> None:
    for raw in ("", "{}", nested(100_000), "{\ud800"):
        _, error = parse_tool_arguments(raw)
        kept = raw if error is None else "{}"
        started = ToolStarted(
            session_id="s", seq=1, at=0, turn_id="t", call_id="c", name="n", arguments=kept
        )
        finished = ToolFinished(
            session_id="s", seq=2, at=0, turn_id="t", call_id="c", name="n", error=error
        )
        assert round_trips(started) and round_trips(finished)
