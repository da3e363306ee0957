"""Conformance of the trim and the tool-result cap to the source (plugin-agent.zh
「上下文裁剪算法」「压缩后延续提示」, CFG4, UPSTREAM-FACTS' truncation rule).

* TRIM-H: the continuation hint goes right after this turn's last input, and the inputs of
  an instruction turn are its instruction block (TRIM-N), also when there is no history
  between the head and the turn.
* CFG4: ``toolResultMaxRatio`` is a share of the context window in tokens, counted by the
  counter in use: ``truncate_to_tokens``.
* One truncation rule: every cut (tool results, reasoning, shrunk blocks) keeps the start
  and ends with the visible suffix naming the original length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from datetime import timedelta, timezone

import msgspec
import pykka
import pytest
from aalis_agent.actors.hooks import Contribution, Hooks
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import FixedClock, HostNotice, InMemoryEventStore, Input, SequentialIds
from aalis_agent.events.schema import ChatMessage, MessageMeta, ToolCall
from aalis_agent.request.prompt import (
    Block,
    TurnPrompt,
    assemble,
    instruction_block,
    split_parts,
    volatile_for,
)
from aalis_agent.request.textnorm import truncate, truncate_to_tokens
from aalis_agent.request.texts import CONTINUATION_HINT, TRUNCATED_SUFFIX
from aalis_agent.request.tokens import (
    EstimateCounter,
    TiktokenCounter,
    TokenCounter,
    count_messages,
    default_counter,
)
from aalis_agent.request.trim import TrimRequest, TrimResult, trim
from aalis_agent.services import (
    AgentConfig,
    ScriptedModel,
    ScriptedReply,
    Services,
    Tool,
    ToolRegistry,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CST = timezone(timedelta(hours=8))
NOW = 1_700_000_000_000
HINT_ID = "continuation-hint"


class Chars:
    """One token per character: exact arithmetic."""

    name = "chars"
    encodes = 0

    def count(self, text: str) -> int:
        return len(text)


class Recording:
    """One token per character, remembering the length of every text it counted."""

    name = "recording"

    def __init__(self) -> None:
        self.lengths: list[int] = []

    @property
    def encodes(self) -> int:
        return len(self.lengths)

    def count(self, text: str) -> int:
        self.lengths.append(len(text))
        return len(text)


CHARS = Chars()
EST = EstimateCounter()
TIKTOKEN = default_counter()


def suffix(original: str) -> str:
    return TRUNCATED_SUFFIX.format(length=len(original))


def cut_text(original: str, keep: int) -> str:
    return original[:keep] + suffix(original)


def ids(messages: Sequence[ChatMessage]) -> list[str]:
    return [m.id for m in messages]


# --- TRIM-H: the hint after this turn's last input -------------------------------------

CALL = ToolCall(id="c1", name="lookup")


def _tool_group(result_chars: int = 600) -> list[ChatMessage]:
    return [
        ChatMessage(id="a1", role="assistant", tool_calls=(CALL,)),
        ChatMessage(id="r1", role="tool", content="x" * result_chars, tool_call_id="c1"),
    ]


def _notice_turn(history: Sequence[ChatMessage] = ()) -> tuple[TurnPrompt, ChatMessage]:
    """A host-notice turn: seven knowledge blocks, turn-anchored material, the instruction
    block and one tool group; too big for the 1024 budget unless step 4 deletes blocks."""
    inp = Input(id="in1", content="该交周报了", source="host", host_notice=HostNotice("r", "n1"))
    block = instruction_block(inp, NOW, CST)
    prompt = TurnPrompt(
        system="s" * 96,
        history=list(history),
        blocks=[
            *(Block("knowledge", f"mem/k{i}", "m" * 300) for i in range(7)),
            Block("turn-context", "p/ctx", "c" * 20),
            Block("turn-hint", "p/hint", "h" * 20),
        ],
        instruction=block,
        tail=_tool_group(),
    )
    return prompt, block


def _trim_assembled(
    prompt: TurnPrompt, protected: set[str], *, snapshot: bool = False
) -> tuple[TrimResult, list[ChatMessage]]:
    messages = assemble(prompt)
    head, hist, turn = split_parts(messages, {m.id for m in prompt.history})
    req = TrimRequest(
        head=head,
        history=hist,
        turn=turn,
        budget=1024,
        memory_budget=100,
        protected=frozenset(protected),
        snapshot=snapshot,
    )
    return trim(req, CHARS), messages


def test_split_parts_keeps_the_instruction_block_in_the_turn_without_history() -> None:
    prompt, block = _notice_turn()
    messages = assemble(prompt)
    head, hist, turn = split_parts(messages, set())
    # the head is the system prompt and the head-anchored blocks; the turn-anchored
    # material and the instruction block (this turn's input, TRIM-N) start the turn part
    assert ids(head) == ["system", *(f"block:mem/k{i}:{i}" for i in range(7))]
    assert hist == []
    assert [m.meta.injector for m in turn[:2]] == ["p/ctx", "p/hint"]
    assert ids(turn[2:]) == [block.id, "a1", "r1"]
    assert head + hist + turn == messages


def test_split_parts_with_history_is_unchanged() -> None:
    history = [
        ChatMessage(id="h0", role="user", content="早"),
        ChatMessage(id="h1", role="assistant", content="早上好"),
    ]
    prompt, block = _notice_turn(history)
    head, hist, turn = split_parts(assemble(prompt), {"h0", "h1"})
    assert ids(head) == ["system", *(f"block:mem/k{i}:{i}" for i in range(7))]
    assert ids(hist) == ["h0", "h1"]
    assert ids(turn)[2:] == [block.id, "a1", "r1"]


def test_hint_right_after_the_instruction_block_without_history() -> None:
    prompt, block = _notice_turn()
    r, before = _trim_assembled(prompt, {block.id})
    assert r.steps[:4] == [1, 2, 3, 4]
    deleted = [a for a in r.trace if a.action == "deleted"]
    assert len(deleted) >= 6  # step 4 deleted six or more blocks: the hint is due
    out = ids(r.messages)
    assert out.count(HINT_ID) == 1
    # after the turn's last input (the instruction block), not after the last tool result
    assert out[out.index(block.id) + 1] == HINT_ID
    assert out[-2:] == ["a1", "r1"]
    hint = r.messages[out.index(HINT_ID)]
    assert hint.role == "system" and hint.content == CONTINUATION_HINT
    assert len(r.messages) == len(before) - len(deleted) + 1


def test_hint_after_the_last_user_input_without_history() -> None:
    """The same placement in a turn opened by speech, inputs joined along the way."""
    first = ChatMessage(id="u1", role="user", content="查一下", meta=MessageMeta(input_id="i1"))
    joined = ChatMessage(id="u2", role="user", content="还有这个", meta=MessageMeta(input_id="i2"))
    group2 = [
        ChatMessage(id="a2", role="assistant", tool_calls=(ToolCall(id="c2", name="f"),)),
        ChatMessage(id="r2", role="tool", content="y" * 600, tool_call_id="c2"),
    ]
    prompt = TurnPrompt(
        system="s" * 96,
        history=[],
        blocks=[Block("knowledge", f"mem/k{i}", "m" * 300) for i in range(7)],
        volatile=volatile_for(NOW, CST, "qq", False),
        inputs=[first],
        tail=[*_tool_group(100), joined, *group2],
    )
    r, _ = _trim_assembled(prompt, {"u1", "u2"})
    out = ids(r.messages)
    assert out[out.index("u2") + 1] == HINT_ID
    assert out[-2:] == ["a2", "r2"]


def test_snapshot_hint_at_the_end_and_the_volatile_context_in_the_turn() -> None:
    prompt = TurnPrompt(
        system="s" * 96,
        history=[],
        blocks=[Block("knowledge", f"mem/k{i}", "m" * 300) for i in range(7)],
        volatile=volatile_for(NOW, CST, "webui", False) + "v" * 700,
    )
    messages = assemble(prompt)
    head, _, turn = split_parts(messages, set())
    assert ids(head) == ["system", *(f"block:mem/k{i}:{i}" for i in range(7))]
    assert ids(turn) == ["volatile"]  # the turn's volatile context is not head
    r, _ = _trim_assembled(prompt, set(), snapshot=True)
    assert ids(r.messages)[-2:] == ["volatile", HINT_ID]


# --- the same, end to end: a host notice on a session with no history --------------------


@pytest.fixture
def runtimes() -> Iterator[list[Runtime]]:
    made: list[Runtime] = []
    yield made
    for rt in made:
        rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def test_host_notice_turn_without_history_gets_the_hint_after_its_block(
    runtimes: list[Runtime],
) -> None:
    # budget = 6000 − 4096 − 512 = 1392; the notice alone is over it, so step 4 deletes
    # the knowledge blocks down to the memory budget (six or more go) and hints
    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="look", arguments="{}"),)),
            ScriptedReply(text="好"),
        ],
        context_length=6000,
    )
    hooks = Hooks()
    blocks = [f"记忆 {i} " + "memory " * 60 for i in range(8)]
    hooks.contribute(Contribution("mem", "k", "knowledge", lambda v: blocks))
    services = Services(
        llm=model,
        tools=ToolRegistry([Tool("look", lambda args, ctx: "结果" * 50)]),
        config=AgentConfig(memory_token_budget=50),
    )
    services.tz = CST
    rt = Runtime(
        InMemoryEventStore(), services, FixedClock(step_ms=1000), SequentialIds(),
        janitor=False, hooks=hooks,
    )  # fmt: skip
    runtimes.append(rt)
    notice = HostNotice(kind="reminder", id="n1")
    notice_input = Input(id="", content="通知" * 1500, source="host", host_notice=notice)
    handle = rt.submit("qq:group:9", notice_input)
    handle.result(10)
    rt.wait_idle(10)
    second = list(model.requests[1].messages)
    kinds = [m.meta.injector or m.role for m in second]
    assert kinds.count("host-notice") == 1
    at = kinds.index("host-notice")
    assert second[at + 1].content == CONTINUATION_HINT
    assert [m.role for m in second[at + 2 :]] == ["assistant", "tool"]


# --- CFG4: the tool-result cap in tokens -------------------------------------------------

ZH = "数据分析结果如下：本季度营收同比增长百分之十二，主要来自海外市场。" * 1500
EN = "The quarterly report shows revenue grew twelve percent, mostly overseas. " * 300


def test_the_share_is_tokens_by_the_counter_in_use() -> None:
    cap = math.floor(32_000 * 0.15)  # 4800 tokens of a 32,000 window
    assert TIKTOKEN.count(ZH) > cap
    cut = truncate_to_tokens(ZH, cap, TIKTOKEN)
    assert cut.startswith(ZH[:1000]) and cut.endswith(suffix(ZH))
    assert cap - 5 <= TIKTOKEN.count(cut) <= cap  # fits, the suffix included, and fills it
    # the departure: 4800 characters of Chinese are well over 4800 tokens
    assert TIKTOKEN.count(truncate(ZH, cap)) > cap


def test_a_result_within_its_share_is_not_cut() -> None:
    cap = math.floor(32_000 * 0.15)
    assert len(EN) > cap >= TIKTOKEN.count(EN)  # longer than the cap in characters only
    assert truncate_to_tokens(EN, cap, TIKTOKEN) == EN
    assert truncate(EN, cap) != EN  # the departure: cut by characters


def test_the_estimator_fallback_is_used_the_same_way() -> None:
    cut = truncate_to_tokens(ZH, 1000, EST)
    assert cut.endswith(suffix(ZH))
    kept = len(cut) - len(suffix(ZH))
    assert EST.count(cut) <= 1000 < EST.count(cut_text(ZH, kept + 1))  # the longest that fits


def test_small_budgets_and_edges() -> None:
    assert truncate_to_tokens("abc", -1, CHARS) == "abc"  # no limit
    assert truncate_to_tokens("abc", 3, CHARS) == "abc"  # fits exactly
    long = "z" * 100
    n = len(suffix(long))
    assert truncate_to_tokens(long, n + 10, CHARS) == cut_text(long, 10)
    assert truncate_to_tokens(long, n, CHARS) == suffix(long)  # the bare suffix fits
    # not even the suffix fits: the budget wins, with the longest plain start
    assert truncate_to_tokens(long, n - 1, CHARS) == long[: n - 1]
    assert truncate_to_tokens(long, 0, CHARS) == ""
    # a floor of characters wins over the budget
    assert truncate_to_tokens(long, 5, CHARS, min_chars=20) == cut_text(long, 20)
    assert truncate_to_tokens(long, 5, CHARS, min_chars=100) == long


def test_large_texts_are_never_encoded_per_character() -> None:
    counter = Recording()
    text = "w" * 1_000_000
    cut = truncate_to_tokens(text, 1000, counter)
    assert cut == cut_text(text, 1000 - len(suffix(text)))
    # a start of the text proves it over budget: the whole million is never counted,
    # and the search counts a few dozen cuts of about the result's size
    assert max(counter.lengths) < 20_000
    assert len(counter.lengths) < 40 and sum(counter.lengths) < 200_000


def test_a_text_that_must_be_counted_is_counted_once_in_full() -> None:
    counter = Recording()
    text = "w" * 30_000
    truncate_to_tokens(text, 10_000, counter)
    assert counter.lengths.count(30_000) == 1
    assert sorted(counter.lengths)[-2] < 11_000  # every other count is of a candidate cut


class Wide(Recording):
    """64 characters a token (a run of dashes in cl100k_base), remembering the length of
    every text it counted."""

    name = "wide"

    def count(self, text: str) -> int:
        return -(-super().count(text) // 64)


class CountingTiktoken(TiktokenCounter):
    """The offline tiktoken counter, remembering the length of every text it encoded."""

    def __init__(self) -> None:
        super().__init__(TIKTOKEN._encoding)  # type: ignore[attr-defined]
        self.lengths: list[int] = []

    def _encode(self, text: str) -> int:
        self.lengths.append(len(text))
        return super()._encode(text)


def test_a_long_text_of_many_characters_a_token_is_never_encoded_whole() -> None:
    # Its first 8 characters a token of the budget fit: the start doubles until it is
    # over, so what is counted follows the budget, not the text (two million here).
    counter = Wide()
    text = "-" * 2_000_000
    cut = truncate_to_tokens(text, 1000, counter)
    kept = 64 * 1000 - len(suffix(text))  # the longest start that fits, with the suffix
    assert cut == cut_text(text, kept)
    assert max(counter.lengths) < 200_000 and sum(counter.lengths) < 2_000_000


def test_a_long_text_of_many_characters_a_token_by_tiktoken() -> None:
    counter = CountingTiktoken()
    text = "-" * 300_000  # 64 dashes a token in cl100k_base: 4,688 tokens in all
    cut = truncate_to_tokens(text, 500, counter)
    assert cut.endswith(suffix(text)) and TIKTOKEN.count(cut) <= 500
    kept = len(cut) - len(suffix(text))
    assert TIKTOKEN.count(cut_text(text, kept + 1)) > 500  # the longest that fits
    assert 300_000 not in counter.lengths and max(counter.lengths) < 70_000


def test_every_cl100k_token_is_one_to_128_bytes() -> None:
    # What lets a text of at most ``max_tokens`` UTF-8 bytes go uncounted: no token of
    # the encoding is empty (and none is longer than 128 bytes).
    sizes = {len(t) for t in TIKTOKEN._encoding.token_byte_values()}  # type: ignore[attr-defined]
    assert min(sizes) == 1 and max(sizes) == 128


def test_a_text_that_fits_by_its_bytes_is_not_counted() -> None:
    counter = CountingTiktoken()
    text = "好" * 100  # 300 bytes
    assert truncate_to_tokens(text, 300, counter) == text
    assert truncate_to_tokens("w" * 300, 300, counter) == "w" * 300
    assert counter.lengths == []
    # a byte over: counted, and it still fits (100 characters, far fewer tokens)
    assert truncate_to_tokens(text, 299, counter) == text
    assert counter.lengths == [100]
    # the estimate is bounded by the bytes too; any other counter is asked
    estimate = EstimateCounter()
    assert truncate_to_tokens(text, 300, estimate) == text and estimate.encodes == 0
    recording = Recording()
    assert truncate_to_tokens("abc", 3, recording) == "abc" and recording.lengths == [3]


TEXTS = st.text(
    alphabet=st.sampled_from([*"abc xyz,.\n数据中文字。", "😀", "\u3000"]), max_size=3000
)


@settings(max_examples=150, deadline=None)
@given(TEXTS, st.integers(0, 800), st.sampled_from(["estimate", "tiktoken"]))
def test_property_every_cut_fits_and_keeps_the_start(text: str, cap: int, which: str) -> None:
    counter: TokenCounter = EST if which == "estimate" else TIKTOKEN
    cut = truncate_to_tokens(text, cap, counter)
    if counter.count(text) <= cap:
        assert cut == text
        return
    assert counter.count(cut) <= cap
    if cut.endswith(suffix(text)):
        kept = len(cut) - len(suffix(text))
        assert text.startswith(cut[:kept])
        if which == "estimate":  # a monotone counter: the longest start that fits
            assert kept == len(text) - 1 or counter.count(cut_text(text, kept + 1)) > cap
    else:  # only when not even the suffix fits
        assert counter.count(suffix(text)) > cap and text.startswith(cut)


# --- one truncation rule for tool results and reasoning (steps 2 and 5) -----------------

SUFFIX_RE = re.compile(re.escape(TRUNCATED_SUFFIX).replace(re.escape("{length}"), r"(\d+)") + "$")


def _reasoning_turn(reasoning: Sequence[str]) -> list[ChatMessage]:
    turn: list[ChatMessage] = [ChatMessage(id="in", role="user", content="go")]
    for i, text in enumerate(reasoning):
        c = ToolCall(id=f"c{i}", name="think")
        turn += [
            ChatMessage(id=f"g{i}", role="assistant", tool_calls=(c,), reasoning=text),
            ChatMessage(id=f"t{i}", role="tool", content="ok", tool_call_id=c.id),
        ]
    return turn


def test_step2_reasoning_cuts_carry_the_visible_suffix() -> None:
    texts = ["a" * 1000, "b" * 1000, "c" * 1000]  # g2 is the last group
    turn = _reasoning_turn(texts)
    head = [ChatMessage(id="sys", role="system", content="s" * 96)]
    budget = count_messages(CHARS, [*head, *turn]) - 1000
    r = trim(TrimRequest(head, [], turn, budget, protected=frozenset({"in"})), CHARS)
    out = {m.id: m for m in r.messages}
    assert out["g0"].reasoning == truncate(texts[0], 200)
    assert out["g1"].reasoning == truncate(texts[1], 400)
    for gid in ("g0", "g1"):
        match = SUFFIX_RE.search(out[gid].reasoning or "")
        assert match is not None and match.group(1) == "1000"


def test_step5_reasoning_cut_carries_the_visible_suffix() -> None:
    c = ToolCall(id="c1", name="fetch")
    turn = [
        ChatMessage(id="in", role="user", content="go"),
        ChatMessage(id="g", role="assistant", tool_calls=(c,), reasoning="r" * 1000),
        ChatMessage(id="t", role="tool", content="T" * 3000, tool_call_id="c1"),
    ]
    head = [ChatMessage(id="sys", role="system", content="s" * 96)]
    r = trim(TrimRequest(head, [], turn, 1024, protected=frozenset({"in"})), CHARS)
    assert r.steps == [1, 2, 3, 4, 5]
    out = {m.id: m for m in r.messages}
    assert out["g"].reasoning == truncate("r" * 1000, 400)
    assert out["t"].content == truncate("T" * 3000, 500)  # the same rule as the result


def test_a_reasoning_cut_that_would_cost_more_tokens_is_skipped() -> None:
    """The suffix costs tokens: a reasoning just over its limit is left whole rather than
    made dearer (as a result just over 500 is in step 5)."""
    texts = ["word " * 42, "b" * 1000, "c" * 1000]  # g0: 210 characters, about 60 tokens
    assert EST.count(truncate(texts[0], 200)) >= EST.count(texts[0])
    turn = _reasoning_turn(texts)
    head = [ChatMessage(id="sys", role="system", content="s" * 96)]
    budget = count_messages(EST, [*head, *turn]) - 100
    r = trim(TrimRequest(head, [], turn, budget, protected=frozenset({"in"})), EST)
    assert r.steps == [1, 2]
    out = {m.id: m for m in r.messages}
    assert out["g0"].reasoning == texts[0]
    assert out["g1"].reasoning == truncate(texts[1], 400)


def test_step4_shrinks_by_tokens_with_the_same_suffix() -> None:
    head = [
        ChatMessage(id="sys", role="system", content="s" * 96),
        ChatMessage(id="k1", role="system", content="记忆" * 400, meta=MessageMeta(injector="m/k")),
    ]
    turn = [ChatMessage(id="in", role="user", content="q" * 400)]
    before = count_messages(EST, [*head, *turn])
    req = TrimRequest(head, [], turn, before - 300, memory_budget=900, protected=frozenset({"in"}))
    r = trim(req, EST)
    assert r.steps == [1, 2, 3, 4]
    k1 = next(m for m in r.messages if m.id == "k1")
    original = head[1].content
    assert k1.content.endswith(suffix(original))
    injected = count_messages(EST, [head[1]])
    target = math.floor(EST.count(original) * 900 / injected)
    assert target - 3 <= EST.count(k1.content) <= target  # about the ratio, suffix included
    assert msgspec.json.encode(r.messages[0]) == msgspec.json.encode(head[0])


class _OneTokenPerChar:
    name = "chars"
    encodes = 0

    def count(self, text: str) -> int:
        return len(text)


def test_step4_proportional_shrink_fits_the_memory_budget_and_deletes_nothing() -> None:
    """「首条与末条之间的注入系统消息(贡献块、易变上下文等,不含本轮的指令块)合计超过
    memoryTokenBudget 时按比例截短,每条最少保留 200 字符;仍超时从最靠前的删起」

    Two 2000-character blocks (2004 tokens each with one token a character) over a
    memory budget of 1000: shrunk in proportion, far above the 200-character minimum, they
    fit the budget together, so none is deleted, although the request (a large input that
    is never touched) is still over the trim budget."""
    chars = _OneTokenPerChar()
    head = [
        ChatMessage(id="sys", role="system", content="S" * 10),
        ChatMessage(id="b1", role="system", content="a" * 2000, meta=MessageMeta(injector="x/1")),
        ChatMessage(id="b2", role="system", content="b" * 2000, meta=MessageMeta(injector="x/2")),
    ]
    turn = [ChatMessage(id="u", role="user", content="q" * 3000)]
    req = TrimRequest(head, [], turn, 4000, memory_budget=1000, protected=frozenset({"u"}))
    r = trim(req, chars)
    assert 4 in r.steps
    assert [a.action for a in r.trace if a.step == 4] == ["shrunk", "shrunk"]
    kept = {m.id: m for m in r.messages}
    assert {"b1", "b2"} <= kept.keys()
    assert count_messages(chars, [kept["b1"], kept["b2"]]) <= 1000
    # in proportion: both the same size, each about half the budget
    assert len(kept["b1"].content) == len(kept["b2"].content)
    assert count_messages(chars, [kept["b1"]]) == 1000 // 2
