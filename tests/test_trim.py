"""The five-step context trim (TRIM, CFG2, CFG5; plugin-agent.zh「上下文裁剪算法」).

Step tests use ``Chars`` (one token per character, so a message of ``n`` characters costs
``n + 4``) or the fallback estimator where CJK weight matters; each is built so that it
needs exactly the step it tests. Property tests run random conversations through ``trim``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import msgspec
import pytest
from aalis_agent.events.schema import ChatMessage, MessageMeta, ToolCall
from aalis_agent.request.texts import CONTINUATION_HINT, TRUNCATED_SUFFIX
from aalis_agent.request.tokens import EstimateCounter, count_messages, message_tokens
from aalis_agent.request.trim import (
    COLLAPSED_PREFIX,
    TrimAction,
    TrimRequest,
    TrimResult,
    trim,
    trim_budget,
)
from hypothesis import event, given, settings
from hypothesis import strategies as st


class Chars:
    """One token per character: exact arithmetic in the step tests."""

    name = "chars"
    encodes = 0

    def count(self, text: str) -> int:
        return len(text)


CHARS = Chars()
EST = EstimateCounter()
HINT_ID = "continuation-hint"


def enc(m: ChatMessage) -> bytes:
    return msgspec.json.encode(m)


def t(n: int, ch: str = "x") -> str:
    return ch * n


def system(id: str, content: str, injector: str | None = None) -> ChatMessage:
    return ChatMessage(id=id, role="system", content=content, meta=MessageMeta(injector=injector))


def user(id: str, content: str) -> ChatMessage:
    return ChatMessage(id=id, role="user", content=content)


def assistant(
    id: str,
    content: str = "",
    *,
    calls: Sequence[ToolCall] = (),
    reasoning: str | None = None,
) -> ChatMessage:
    return ChatMessage(
        id=id, role="assistant", content=content, tool_calls=tuple(calls), reasoning=reasoning
    )


def result(id: str, call: ToolCall, content: str) -> ChatMessage:
    return ChatMessage(id=id, role="tool", content=content, tool_call_id=call.id, name=call.name)


def sized(m: ChatMessage, tokens: int, counter: Chars = CHARS) -> ChatMessage:
    """``m`` with its content padded so that it costs exactly ``tokens``."""
    base = message_tokens(counter, msgspec.structs.replace(m, content=""))
    assert tokens >= base
    return msgspec.structs.replace(m, content=t(tokens - base))


def cost(messages: Iterable[ChatMessage], counter: object = CHARS) -> int:
    return count_messages(counter, messages)  # type: ignore[arg-type]


def by_id(messages: Iterable[ChatMessage]) -> dict[str, ChatMessage]:
    return {m.id: m for m in messages}


def request_of(
    head: Sequence[ChatMessage],
    history: Sequence[ChatMessage],
    turn: Sequence[ChatMessage],
    budget: int,
    protected: Iterable[str] = (),
    **kw: object,
) -> TrimRequest:
    return TrimRequest(
        head=list(head),
        history=list(history),
        turn=list(turn),
        budget=budget,
        protected=frozenset(protected),
        **kw,  # type: ignore[arg-type]
    )


def cut_text(original: str, keep: int) -> str:
    """How a text cut to ``keep`` characters reads: the start plus the visible suffix."""
    return original[:keep] + TRUNCATED_SUFFIX.format(length=len(original))


def provider_violations(messages: Sequence[ChatMessage]) -> list[str]:
    """Providers' message rules: every assistant tool call is answered by a result with its
    id before any other non-tool message; no result without its call; no empty assistant
    message (content "" and no tool calls)."""
    problems: list[str] = []
    open_calls: dict[str, str] = {}  # call id → the assistant message that made it
    for m in messages:
        if m.role == "tool":
            if m.tool_call_id in open_calls:
                del open_calls[m.tool_call_id]
            else:
                problems.append(f"result {m.id} answers no open call ({m.tool_call_id})")
            continue
        if open_calls:
            problems.append(f"{m.id} comes before the results of {sorted(open_calls)}")
            open_calls.clear()
        if m.role == "assistant":
            if not m.content and not m.tool_calls:
                problems.append(f"empty assistant message {m.id}")
            for c in m.tool_calls:
                open_calls[c.id] = m.id
    if open_calls:
        problems.append(f"calls never answered: {sorted(open_calls)}")
    return problems


def last_group_ids(turn: Sequence[ChatMessage]) -> set[str]:
    """This turn's last tool group: its last assistant with calls, and that one's results."""
    for m in reversed(turn):
        if m.role == "assistant" and m.tool_calls:
            calls = {c.id for c in m.tool_calls}
            return {m.id} | {r.id for r in turn if r.role == "tool" and r.tool_call_id in calls}
    return set()


def named(r: TrimResult, steps: Iterable[int] = (1, 2, 3, 4, 5)) -> set[str]:
    wanted = set(steps)
    return {i for a in r.trace if a.step in wanted for i in a.ids}


# --- the budget (CFG5) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "output", "ratio", "expected"),
    [
        (32_000, 4_096, 1.0, 32_000 - 4_096 - 512),
        (128_000, 8_192, 0.5, 64_000 - 8_192 - 512),
        (10_000, 1_000, 0.75, 7_500 - 1_000 - 512),
        (8_192, 1_000, 0.7, 5_734 - 1_000 - 512),  # 5734.4: a whole number of tokens
        (5_633, 4_096, 1.0, 1_025),  # just above the floor
        (5_632, 4_096, 1.0, 1_024),
        (4_096, 4_096, 1.0, 1_024),  # the floor
        (100_000, 4_096, 0.01, 1_024),  # a low ratio: the floor
        (2_000, 8_192, 1.0, 1_024),  # the output reserve exceeds the window
    ],
)
def test_trim_budget(context: int, output: int, ratio: float, expected: int) -> None:
    assert trim_budget(context, output, ratio) == expected


def test_trim_budget_ratio_defaults_to_one() -> None:
    assert trim_budget(32_000, 4_096) == trim_budget(32_000, 4_096, 1.0) == 27_392


# --- step 1 ----------------------------------------------------------------------------


HEAD = [system("sys", t(96))]  # 100 tokens; budget 1000 → u = 250, history allowance 650


def test_step1_drops_units_from_the_earliest_even_when_the_request_fits() -> None:
    history = [user(f"h{i}", t(96)) for i in range(8)]  # 800: 150 over → k = 1
    turn = [user("in", t(6))]
    req = request_of(HEAD, history, turn, budget=1000, protected={"in"})
    r = trim(req, CHARS)
    # the whole request fits (910 ≤ 1000), yet history over its allowance still drops: the
    # documented cost of prefix stability (TRIM-P)
    assert r.tokens_before == 910 <= req.budget
    assert r.steps == [1]
    assert r.trace == [TrimAction(1, "dropped", ("h0", "h1", "h2"), 300)]
    assert r.cut == r.history_dropped == 3
    assert r.messages == [*HEAD, *history[3:], *turn]
    assert r.tokens_after == 610
    assert r.trimmed


def test_step1_drops_until_k_whole_units() -> None:
    sizes = [120, 200, 100, 150, 60, 100, 100, 100, 100]  # 1030: 380 over → k = 2 → ≥ 500
    history = [sized(user(f"h{i}", ""), n) for i, n in enumerate(sizes)]
    r = trim(request_of(HEAD, history, [user("in", "q")], 1000, {"in"}), CHARS)
    # 120, 320, 420, 570: the fourth message is the first to reach two units
    assert r.trace == [TrimAction(1, "dropped", ("h0", "h1", "h2", "h3"), 570)]
    assert r.cut == 4 and r.steps == [1]


def test_step1_within_allowance_drops_nothing() -> None:
    history = [user(f"h{i}", t(96)) for i in range(6)]  # 600 ≤ 650
    r = trim(request_of(HEAD, history, [user("in", "q")], 1000, {"in"}), CHARS)
    assert r.steps == [1] and r.trace == [] and r.cut == 0
    assert not r.trimmed


def test_step1_cut_inside_a_tool_group_drops_the_rest_of_the_group() -> None:
    c1, c2 = ToolCall(id="c1", name="read", arguments="{}"), ToolCall(id="c2", name="grep")
    history = [
        sized(user("h0", ""), 150),
        sized(assistant("h1", calls=[c1, c2]), 60),
        sized(result("h2", c1, ""), 100),  # 310: the first to reach one unit (250)
        sized(result("h3", c2, ""), 100),  # the rest of the group goes with it
        sized(assistant("h4", "x"), 100),
        sized(user("h5", ""), 100),
        sized(assistant("h6", "x"), 100),
    ]  # 710: 60 over → k = 1
    r = trim(request_of(HEAD, history, [user("in", "q")], 1000, {"in"}), CHARS)
    assert r.trace == [TrimAction(1, "dropped", ("h0", "h1", "h2", "h3"), 410)]
    assert r.cut == 4
    assert [m.id for m in r.messages] == ["sys", "h4", "h5", "h6", "in"]
    assert provider_violations(r.messages) == []


# --- step 2 ----------------------------------------------------------------------------


def test_step2_long_tool_results_keep_500_characters() -> None:
    c1, c2, c3 = (ToolCall(id=f"c{i}", name="fetch") for i in (1, 2, 3))
    long_text = t(2000, "r")
    turn = [
        user("in", t(6)),
        sized(assistant("a1", calls=[c1]), 50),
        result("r1", c1, long_text),  # over 1500: keeps 500
        sized(assistant("a2", calls=[c2]), 50),
        result("r2", c2, t(1500, "s")),  # exactly 1500: not over
        sized(assistant("a3", calls=[c3]), 50),
        result("r3", c3, t(2000, "u")),  # the last group: step 5 only
    ]
    cut_r1 = result("r1", c1, cut_text(long_text, 500))
    saved = cost([turn[2]]) - cost([cut_r1])
    before = cost([*HEAD, *turn])
    r = trim(request_of(HEAD, [], turn, before - saved, {"in"}), CHARS)
    assert r.steps == [1, 2]
    assert r.trace == [TrimAction(2, "truncated", ("r1",), saved)]
    assert r.messages == [*HEAD, *turn[:2], cut_r1, *turn[3:]]
    assert r.messages[3].content == "r" * 500 + TRUNCATED_SUFFIX.format(length=2000)
    assert r.tokens_after == r.tokens_before - saved == before - saved


def _reasoning_turn() -> tuple[list[ChatMessage], list[str]]:
    calls = [ToolCall(id=f"c{i}", name="think") for i in range(4)]
    texts = [t(1000, "a"), t(1000, "b"), t(150, "c"), t(1000, "d")]
    turn = [user("in", t(6))]
    for i, (c, text) in enumerate(zip(calls, texts, strict=True)):
        turn += [assistant(f"g{i}", calls=[c], reasoning=text), result(f"t{i}", c, "ok")]
    return turn, texts


def test_step2_reasoning_is_cut_oldest_first_older_200_newest_400() -> None:
    turn, texts = _reasoning_turn()
    # g0 and g1 are over 200 (g2 is not; g3 is the last group): g0 keeps 200, g1 400, each
    # with the visible suffix, the same truncation rule as tool results (UPSTREAM-FACTS)
    suffix = len(cut_text(texts[0], 0))
    saved0, saved1 = 800 - suffix, 600 - suffix
    r = trim(request_of(HEAD, [], turn, cost([*HEAD, *turn]) - saved0 - saved1, {"in"}), CHARS)
    assert r.steps == [1, 2]
    assert r.trace == [
        TrimAction(2, "truncated", ("g0",), saved0),
        TrimAction(2, "truncated", ("g1",), saved1),
    ]
    out = by_id(r.messages)
    assert out["g0"].reasoning == cut_text(texts[0], 200)
    assert out["g1"].reasoning == cut_text(texts[1], 400)
    for same in ("g2", "g3", "t0", "t1", "t2", "t3", "in"):
        assert enc(out[same]) == enc(by_id(turn)[same])
    assert len(r.messages) == len(turn) + 1


def test_step2_reasoning_stops_once_within_budget() -> None:
    turn, texts = _reasoning_turn()
    saved = 800 - len(cut_text(texts[0], 0))
    r = trim(request_of(HEAD, [], turn, cost([*HEAD, *turn]) - saved, {"in"}), CHARS)
    # the oldest goes first and keeps 200 (it is not the newest of the long ones)
    assert r.trace == [TrimAction(2, "truncated", ("g0",), saved)]
    assert by_id(r.messages)["g0"].reasoning == cut_text(texts[0], 200)
    assert by_id(r.messages)["g1"].reasoning == texts[1]


def test_step2_earlier_tool_groups_collapse_when_that_saves_tokens() -> None:
    assert COLLAPSED_PREFIX == "[历史工具调用]"
    c0 = ToolCall(id="c0", name="f")
    c1 = ToolCall(id="c1", name="search", arguments='{"q":"x"}')
    c2 = ToolCall(id="c2", name="read", arguments='{"p":1}')
    c3 = ToolCall(id="c3", name="grep", arguments="{}")
    c4 = ToolCall(id="c4", name="fetch", arguments="{}")
    r1, r2, r3 = t(1000, "p"), "q" * 50 + t(550, "w"), t(600, "z")
    turn = [
        user("in", "请帮我查一下"),
        assistant("a0", calls=[c0]),
        result("t0", c0, "k"),  # collapsing this one would cost more: left alone
        assistant("a1", calls=[c1]),
        result("t1", c1, r1),
        assistant("a2", calls=[c2, c3]),
        result("t2", c2, r2),
        result("t3", c3, r3),
        assistant("a3", calls=[c4]),  # the last group: never collapsed
        result("t4", c4, t(1000, "m")),
    ]
    line1 = f"[历史工具调用] search → {r1[:100]}"
    line2 = f"[历史工具调用] read → {r2[:100]}\n[历史工具调用] grep → {r3[:100]}"
    g0_line = ChatMessage(id="a0", role="assistant", content="[历史工具调用] f → k")
    assert message_tokens(EST, g0_line) >= cost(turn[1:3], EST)  # no saving
    collapsed1 = ChatMessage(id="a1", role="assistant", content=line1)
    collapsed2 = ChatMessage(id="a2", role="assistant", content=line2)
    saved1 = cost(turn[3:5], EST) - message_tokens(EST, collapsed1)
    saved2 = cost(turn[5:8], EST) - message_tokens(EST, collapsed2)
    budget = cost([*HEAD, *turn], EST) - saved1 - saved2
    r = trim(request_of(HEAD, [], turn, budget, {"in"}), EST)
    assert r.steps == [1, 2]
    assert r.trace == [
        TrimAction(2, "collapsed", ("a1", "t1"), saved1),
        TrimAction(2, "collapsed", ("a2", "t2", "t3"), saved2),
    ]
    out = r.messages
    assert [m.content for m in out[4:6]] == [line1, line2]
    for m in out[4:6]:
        assert m.role == "assistant" and not m.tool_calls and not m.reasoning
    assert [enc(m) for m in out[:4]] == [enc(m) for m in [*HEAD, *turn[:3]]]
    assert [enc(m) for m in out[6:]] == [enc(m) for m in turn[8:]]
    assert r.tokens_after == budget
    assert provider_violations(out) == []


# --- step 3 ----------------------------------------------------------------------------


def test_step3_keeps_dropping_history_unit_by_unit() -> None:
    history = [user(f"h{i}", t(96)) for i in range(8)]  # step 1 drops h0-h2 (one unit)
    turn = [user("in", t(496))]  # 500: still 100 over after step 1
    r = trim(request_of(HEAD, history, turn, 1000, {"in"}), CHARS)
    assert r.steps == [1, 2, 3]
    assert r.trace == [
        TrimAction(1, "dropped", ("h0", "h1", "h2"), 300),
        TrimAction(3, "dropped", ("h3", "h4"), 200),  # up to the second unit (500)
    ]
    assert r.cut == 3 and r.history_dropped == 5
    assert r.messages == [*HEAD, *history[5:], *turn]


def test_step3_starts_at_the_first_unit_when_step1_dropped_nothing() -> None:
    history = [user(f"h{i}", t(96)) for i in range(6)]  # within its allowance
    turn = [user("in", t(396))]  # 1100 in all
    r = trim(request_of(HEAD, history, turn, 1000, {"in"}), CHARS)
    assert r.steps == [1, 2, 3]
    assert r.trace == [TrimAction(3, "dropped", ("h0", "h1", "h2"), 300)]
    assert r.cut == 0 and r.history_dropped == 3


def test_step3_drops_all_of_the_history_if_need_be() -> None:
    history = [user(f"h{i}", t(96)) for i in range(8)]
    turn = [user("in", t(2000))]  # protected and alone over budget
    r = trim(request_of(HEAD, history, turn, 1000, {"in"}), CHARS)
    assert r.steps == [1, 2, 3, 4, 5]
    drops = [a for a in r.trace if a.action == "dropped"]
    assert [a.step for a in drops] == [1, 3, 3]  # one unit, then the next, then the rest
    assert [i for a in drops for i in a.ids] == [m.id for m in history]
    assert r.history_dropped == 8
    # step 4 was reached and eight messages went: the continuation hint follows the input
    assert [m.id for m in r.messages] == ["sys", "in", HINT_ID]


# --- step 4 ----------------------------------------------------------------------------


def _instruction_turn_request(budget: int, memory_budget: int) -> TrimRequest:
    c = ToolCall(id="c1", name="lookup")
    head = [
        system("sys", t(96)),
        system("k1", t(600, "m"), "memory/summary"),
        system("k2", t(400, "s"), "skills/list"),
    ]
    turn = [
        system("vol", t(150, "v"), "agent/volatile"),  # already under 200 characters
        system("instr", "[宿主通知] " + t(800, "n"), "host-notice"),  # protected
        assistant("a1", calls=[c]),
        result("r1", c, t(50)),
        system("fb", t(600, "f")),  # the last message (format-retry feedback)
    ]
    return request_of(head, [], turn, budget, {"instr"}, memory_budget=memory_budget)


def test_step4_shrinks_injected_system_messages_proportionally() -> None:
    probe = _instruction_turn_request(10**6, 500)
    # injected between the first and the last: k1 604, k2 404, vol 154 = 1162 > 500
    ratio = 500 / 1162
    # Each message keeps ``ratio`` of what it costs, its 4 tokens of framing included (so
    # that together they fit the budget): k1 259 tokens, a text of 255; k2's share is
    # under the 200-character floor.
    assert math.floor(604 * ratio) == 259 and math.floor(404 * ratio) - 4 < 200
    # The cut, suffix included, takes about ``ratio`` of the tokens: 255 tokens = 240
    # characters + the 15-character suffix with this one-token-per-character counter.
    suffix = len(cut_text(probe.head[1].content, 0))
    k1 = system("k1", cut_text(probe.head[1].content, 255 - suffix), "memory/summary")
    k2 = system("k2", cut_text(probe.head[2].content, 200), "skills/list")  # the 200 floor
    s1, s2 = cost([probe.head[1]]) - cost([k1]), cost([probe.head[2]]) - cost([k2])
    before = cost([*probe.head, *probe.turn])
    r = trim(_instruction_turn_request(before - s1 - s2, 500), CHARS)
    assert r.steps == [1, 2, 3, 4]
    assert r.trace == [
        TrimAction(4, "shrunk", ("k1",), s1),
        TrimAction(4, "shrunk", ("k2",), s2),
    ]
    assert r.messages == [probe.head[0], k1, k2, *probe.turn]


def test_step4_then_deletes_from_the_front() -> None:
    probe = _instruction_turn_request(10**6, 100)
    # ratio 100/1162: k1 and k2 keep the 200-character minimum; still over: delete k1, k2
    k1 = system("k1", cut_text(probe.head[1].content, 200), "memory/summary")
    k2 = system("k2", cut_text(probe.head[2].content, 200), "skills/list")
    s1, s2 = cost([probe.head[1]]) - cost([k1]), cost([probe.head[2]]) - cost([k2])
    after_deletes = cost([probe.head[0], *probe.turn])
    r = trim(_instruction_turn_request(after_deletes, 100), CHARS)
    assert r.steps == [1, 2, 3, 4]
    assert r.trace == [
        TrimAction(4, "shrunk", ("k1",), s1),
        TrimAction(4, "shrunk", ("k2",), s2),
        TrimAction(4, "deleted", ("k1",), cost([k1])),
        TrimAction(4, "deleted", ("k2",), cost([k2])),
    ]
    assert r.messages == [probe.head[0], *probe.turn]


def test_step4_leaves_injected_messages_within_memory_budget() -> None:
    probe = _instruction_turn_request(10**6, 1162)  # exactly the injected total
    r = trim(_instruction_turn_request(cost([*probe.head, *probe.turn]) - 1, 1162), CHARS)
    assert r.steps == [1, 2, 3, 4, 5]
    assert r.trace == []  # nothing step 4 or 5 may touch
    assert r.messages == [*probe.head, *probe.turn]


# --- step 5 ----------------------------------------------------------------------------


def test_step5_truncates_the_last_group_results_to_500_and_reasoning_to_400() -> None:
    c1, c2 = ToolCall(id="c1", name="fetch"), ToolCall(id="c2", name="read")
    reasoning, r1, r2 = t(1000, "z"), t(3000, "a"), t(800, "b")
    turn = [
        user("in", t(6)),
        assistant("g", calls=[c1, c2], reasoning=reasoning),
        result("r1", c1, r1),
        result("r2", c2, r2),
    ]
    r = trim(request_of(HEAD, [], turn, 1024, {"in"}), CHARS)
    assert r.steps == [1, 2, 3, 4, 5]
    out = by_id(r.messages)
    assert out["g"].reasoning == cut_text(reasoning, 400)  # one rule: the visible suffix
    assert out["r1"].content == cut_text(r1, 500)
    # Step 2's thresholds: a result of 800 characters is not over-long (> 1500).
    assert out["r2"].content == r2
    assert r.trace == [
        TrimAction(5, "truncated", ("g",), 600 - len(cut_text(reasoning, 0))),
        TrimAction(5, "truncated", ("r1",), cost([turn[2]]) - cost([out["r1"]])),
    ]
    assert [m.id for m in r.messages] == ["sys", "in", "g", "r1", "r2"]


# --- TRIM-H ----------------------------------------------------------------------------


SPEC_HINT = (
    "[系统提示] 由于上下文长度限制,部分历史消息已被压缩或移除。请基于当前可见的上下文和最新"
    "用户请求继续完成任务,不要因为看不到之前的细节而停止工作。如果你之前有正在执行的多步骤"
    "任务或计划,请查看对话摘要和 todo-list 工具确认当前进度,然后继续未完成的步骤。"
)


def test_continuation_hint_is_the_source_text() -> None:
    # the spec's punctuation was normalised to ASCII; the constant writes it full-width
    assert CONTINUATION_HINT.replace("，", ",") == SPEC_HINT


def _hint_request(history_len: int, *, snapshot: bool = False) -> TrimRequest:
    c = ToolCall(id="c1", name="lookup")
    head = [system("sys", t(96)), system("k1", t(700, "m"), "memory/summary")]
    history = [
        user(f"h{i}", t(96)) if i % 2 == 0 else assistant(f"h{i}", t(96))
        for i in range(history_len)
    ]
    turn = [
        system("vol", t(150, "v"), "agent/volatile"),
        user("in", t(6)),
        sized(assistant("a1", calls=[c]), 50),
        result("r1", c, t(100)),
    ]
    return request_of(head, history, turn, 1024, {"in"}, memory_budget=300, snapshot=snapshot)


def _hint(r: TrimResult) -> list[int]:
    return [i for i, m in enumerate(r.messages) if m.id == HINT_ID]


def test_hint_after_this_turns_last_input_when_step4_ran_and_six_went() -> None:
    r = trim(_hint_request(6), CHARS)
    # step 1 drops the six history messages (u = 256, allowance 64), then only step 4 helps
    assert r.steps == [1, 2, 3, 4]
    assert [(a.step, a.action) for a in r.trace] == [
        (1, "dropped"),
        (4, "shrunk"),
        (4, "hint"),
    ]
    assert r.trace[-1].ids == (HINT_ID,)
    assert [m.id for m in r.messages] == ["sys", "k1", "vol", "in", HINT_ID, "a1", "r1"]
    hint = r.messages[4]
    assert hint.role == "system" and hint.content == CONTINUATION_HINT
    assert r.trace[-1].saved == -message_tokens(CHARS, hint)
    assert provider_violations(r.messages) == []


def test_hint_goes_at_the_end_of_a_snapshot() -> None:
    r = trim(_hint_request(6, snapshot=True), CHARS)
    assert [m.id for m in r.messages] == ["sys", "k1", "vol", "in", "a1", "r1", HINT_ID]
    assert r.messages[-1].content == CONTINUATION_HINT


def test_no_hint_when_fewer_than_six_went() -> None:
    r = trim(_hint_request(5), CHARS)
    assert 4 in r.steps and "shrunk" in {a.action for a in r.trace}
    assert _hint(r) == [] and HINT_ID not in named(r)


def test_no_hint_when_step4_did_not_run() -> None:
    history = [user(f"h{i}", t(96)) for i in range(14)]  # step 1 drops 11 of them
    r = trim(request_of(HEAD, history, [user("in", "q")], 1000, {"in"}), CHARS)
    assert r.steps == [1] and r.cut >= 6
    assert _hint(r) == []


# --- TRIM-N ----------------------------------------------------------------------------


def _everything_request(last: str) -> TrimRequest:
    c1, c2, c3 = (ToolCall(id=f"c{i}", name="tool") for i in (1, 2, 3))
    head = [system("sys", t(300, "S")), system("k1", t(2000, "m"), "memory/summary")]
    history = [
        user("h0", t(200)),
        assistant("h1", calls=[c1]),
        result("h2", c1, t(3000)),
        assistant("h3", t(200)),
        user("h4", t(200)),
        assistant("h5", t(200)),
    ]
    turn = [
        system("vol", t(300, "v"), "agent/volatile"),
        user("in1", t(200, "U")),
        assistant("g1", calls=[c2], reasoning=t(1000, "r")),
        result("t1", c2, t(3000, "T")),
        user("in2", t(300, "I")),
        assistant("g2", calls=[c3], reasoning=t(1000, "R")),
        result("t2", c3, t(3000, "L")),
    ]
    if last == "feedback":
        turn.append(system("fb", t(900, "F")))
    return request_of(head, history, turn, 1024, {"in1", "in2"}, memory_budget=300)


@pytest.mark.parametrize("last", ["group", "feedback"])
def test_never_touched_and_only_step5_touches_the_last_group(last: str) -> None:
    req = _everything_request(last)
    r = trim(req, CHARS)
    assert r.steps == [1, 2, 3, 4, 5]  # every step ran
    out = by_id(r.messages)
    # the first system message and this turn's inputs, byte for byte
    assert enc(r.messages[0]) == enc(req.head[0])
    for pid in req.protected:
        assert enc(out[pid]) == enc(by_id(req.turn)[pid])
    assert not req.protected & named(r)
    # the last group and the last message: only step 5 names them, and they are all there
    locked = last_group_ids(req.turn) | {req.turn[-1].id}
    assert not locked & named(r, (1, 2, 3, 4))
    changed = {i for i in locked if enc(out[i]) != enc(by_id(req.turn)[i])}
    assert changed == {"g2", "t2"} == named(r, (5,))
    assert provider_violations(r.messages) == []


# --- properties --------------------------------------------------------------------------

LENGTHS = st.one_of(st.integers(0, 60), st.integers(150, 700), st.integers(1400, 3200))


@st.composite
def conversations(draw: st.DrawFn) -> TrimRequest:
    ids = itertools.count()

    def nid(prefix: str) -> str:
        return f"{prefix}{next(ids)}"

    def text(lengths: st.SearchStrategy[int] = LENGTHS, at_least: int = 0) -> str:
        n = max(at_least, draw(lengths))
        return draw(st.sampled_from("xy中")) * n

    def maybe_reasoning() -> str | None:
        return text(at_least=1) if draw(st.booleans()) else None

    def tool_group() -> list[ChatMessage]:
        calls = [
            ToolCall(id=nid("c"), name=draw(st.sampled_from(["read", "web_search", "f"])))
            for _ in range(draw(st.integers(1, 3)))
        ]
        out = [
            ChatMessage(
                id=nid("a"),
                role="assistant",
                content=text(st.integers(0, 40)),
                tool_calls=tuple(calls),
                reasoning=maybe_reasoning(),
            )
        ]
        out += [result(nid("r"), c, text()) for c in calls]
        return out

    head = [system("sys", text(at_least=1))]
    head += [
        system(nid("k"), text(at_least=1), f"plugin/{i}") for i in range(draw(st.integers(0, 3)))
    ]
    history: list[ChatMessage] = []
    for _ in range(draw(st.integers(0, 6))):
        history.append(user(nid("hu"), text(at_least=1)))
        for _ in range(draw(st.integers(0, 2))):
            history += tool_group()
        if draw(st.booleans()):
            history.append(assistant(nid("ha"), text(at_least=1), reasoning=maybe_reasoning()))
        else:
            stopped = system(nid("stop"), "[已停下] 上一轮没答完就停下了。")
            history.append(msgspec.structs.replace(stopped, kind="turn-stopped"))
    snapshot = draw(st.booleans())
    turn = [
        system(nid("tc"), text(at_least=1), f"turn/{i}") for i in range(draw(st.integers(0, 2)))
    ]
    turn.append(system(nid("vol"), text(st.integers(20, 300)), "agent/volatile"))
    protected: set[str] = set()
    if not snapshot:
        if draw(st.booleans()):
            first = user(nid("in"), text(at_least=1))
        else:
            first = system(nid("instr"), "[跨会话委派] " + text(), "cross-session-delegation")
        turn.append(first)
        protected.add(first.id)
        for _ in range(draw(st.integers(0, 3))):
            turn += tool_group()
            if draw(st.booleans()):
                inserted = user(nid("ins"), text(at_least=1))
                turn.append(inserted)
                protected.add(inserted.id)
        if draw(st.booleans()):
            turn.append(system(nid("fb"), text(at_least=1)))  # format-retry feedback
    # tiny to large budgets: a share of the whole request, or a fixed small one
    total = count_messages(EST, [*head, *history, *turn])
    budget = draw(
        st.one_of(
            st.integers(1, 130).map(lambda pct: max(1, total * pct // 100)),
            st.integers(55, 100).map(lambda pct: total * pct // 100),
            st.integers(50, 1024),
        )
    )
    return request_of(
        head,
        history,
        turn,
        budget,
        protected,
        memory_budget=draw(st.integers(0, 3000)),
        tool_tokens=draw(st.integers(0, 300)),
        snapshot=snapshot,
    )


def _inputs(req: TrimRequest) -> list[ChatMessage]:
    return [*req.head, *req.history, *req.turn]


PROPERTY = settings(max_examples=200)


@PROPERTY
@given(conversations())
def test_property_first_system_and_protected_unchanged(req: TrimRequest) -> None:
    r = trim(req, EST)
    assert enc(r.messages[0]) == enc(req.head[0])
    out = by_id(r.messages)
    for m in req.turn:
        if m.id in req.protected:
            assert enc(out[m.id]) == enc(m)
    # in order: this turn's inputs keep their relative order
    kept = [m.id for m in r.messages if m.id in req.protected]
    assert kept == [m.id for m in req.turn if m.id in req.protected]


@PROPERTY
@given(conversations())
def test_property_output_obeys_provider_message_rules(req: TrimRequest) -> None:
    assert provider_violations(_inputs(req)) == []
    r = trim(req, EST)
    assert provider_violations(r.messages) == []
    assert len({m.id for m in r.messages}) == len(r.messages)


@PROPERTY
@given(conversations())
def test_property_within_budget_unless_step5_ran(req: TrimRequest) -> None:
    r = trim(req, EST)
    assert r.tokens_before == count_messages(EST, _inputs(req)) + req.tool_tokens
    assert r.tokens_after == count_messages(EST, r.messages) + req.tool_tokens
    # Even after step 5 the request can stay over: the first system message and this turn's
    # inputs are never cut, the last group keeps 500 characters per result (plus the
    # truncation suffix) and 400 of reasoning, injected messages keep 200 characters or stop
    # being deleted once within memoryTokenBudget, and tool definitions are fixed.
    hint = [m for m in r.messages if m.id == HINT_ID]
    # The continuation hint is added after the steps; see
    # test_bug_hint_pushes_over_budget_without_step5.
    over = r.tokens_after - count_messages(EST, hint) > req.budget
    event(f"steps {r.steps[-1]}, {'over' if over else 'within'}")
    if over:
        assert 5 in r.steps
    assert r.steps == list(range(1, len(r.steps) + 1))


@PROPERTY
@given(conversations())
def test_property_trace_accounts_for_every_difference(req: TrimRequest) -> None:
    r = trim(req, EST)
    before = {m.id: enc(m) for m in _inputs(req)}
    after = {m.id: enc(m) for m in r.messages}
    traced = named(r)
    for mid, data in before.items():
        if after.get(mid) != data:
            assert mid in traced, f"{mid} changed or went without a trace action"
    assert traced <= set(before) | {HINT_ID}
    assert set(after) <= set(before) | {HINT_ID}
    assert (HINT_ID in after) == (HINT_ID in traced)
    # the savings add up to the difference
    assert sum(a.saved for a in r.trace) == r.tokens_before - r.tokens_after
    # history drops are counted
    dropped = {i for a in r.trace if a.action == "dropped" for i in a.ids}
    assert len(dropped) == r.history_dropped
    assert dropped == {m.id for m in req.history[: r.history_dropped]}
    assert r.cut <= r.history_dropped


@PROPERTY
@given(conversations())
def test_property_last_group_and_last_message_only_in_step5(req: TrimRequest) -> None:
    r = trim(req, EST)
    locked = last_group_ids(req.turn) | {req.turn[-1].id}
    assert not locked & named(r, (1, 2, 3, 4))
    out = by_id(r.messages)
    assert locked <= set(out)
    assert not req.protected & named(r)


# --- TRIM-P: prefix stability ------------------------------------------------------------


PAST_TURN = st.tuples(
    st.integers(1, 400),  # the user's message
    st.lists(LENGTHS, min_size=0, max_size=3),  # tool results of one group, if any
    st.integers(1, 900),  # the reply
)


@settings(max_examples=60)
@given(
    turns=st.lists(PAST_TURN, min_size=2, max_size=14),
    budget=st.integers(1024, 6000),
    head_len=st.integers(1, 1000),
    tool_tokens=st.integers(0, 100),
)
def test_property_prefix_stable_between_cuts(
    turns: list[tuple[int, list[int], int]], budget: int, head_len: int, tool_tokens: int
) -> None:
    # a head of at most 400 tokens leaves the turn (≤ 119) and tool definitions (≤ 100) a
    # whole reserved unit (≥ 256) even at the smallest budget
    head = [system("sys", t(head_len, "s")), system("k", t(60, "中"), "memory/summary")]
    assert count_messages(EST, head) <= 400
    unit = -(-budget // 4)
    allowance = budget - count_messages(EST, head) - unit
    history: list[ChatMessage] = []
    previous: tuple[int, list[bytes], int] | None = None  # cut, sent prefix, units
    for n, (asked, results, replied) in enumerate(turns):
        message = user(f"u{n}", t(asked, "q"))  # small: at most 115 tokens < u
        r = trim(
            request_of(head, history, [message], budget, {message.id}, tool_tokens=tool_tokens),
            EST,
        )
        assert r.steps == [1]  # step-1-only conditions: the turn fits its reserved unit
        sent = [enc(m) for m in r.messages[:-1]]
        assert sent[: len(head)] == [enc(m) for m in head]
        assert sent[len(head) :] == [enc(m) for m in history[r.cut :]]
        over = count_messages(EST, history) - allowance
        units = max(0, -(-over // unit))
        if previous is not None:
            cut, prefix, old_units = previous
            assert r.cut >= cut  # only forward
            if r.cut == cut:
                event("cut held" if len(prefix) > len(head) else "cut held, history empty")
                assert sent[: len(prefix)] == prefix  # byte-identical between two moves
            else:
                event("cut moved")
                # it moves when the history grew by another unit (or had been dropped whole)
                assert units > old_units or len(prefix) == len(head)
        previous = (r.cut, sent, units)
        # the turn moves into history
        history.append(message)
        if results:
            calls = [ToolCall(id=f"c{n}-{i}", name="read") for i in range(len(results))]
            history.append(assistant(f"a{n}", calls=calls))
            history += [
                result(f"r{n}-{i}", c, t(k, "r"))
                for i, (c, k) in enumerate(zip(calls, results, strict=True))
            ]
        history.append(assistant(f"re{n}", t(replied, "a")))


# --- bugs found (these fail on purpose; see the report) -----------------------------------


def test_the_hint_counts_against_the_budget_before_step5() -> None:
    """TRIM-H then step 5: the hint goes in before step 5 decides, so a step 4 that left
    the request exactly at the budget does not send it over: step 5 runs."""
    c = ToolCall(id="c1", name="lookup")
    head = [system("sys", t(96)), system("k1", t(1500, "m"), "memory/summary")]
    history = [user(f"h{i}", t(96)) for i in range(6)]
    turn = [
        system("vol", t(150, "v"), "agent/volatile"),
        user("in", t(400)),
        sized(assistant("a1", calls=[c]), 50),
        result("r1", c, t(100)),
    ]
    k1 = system("k1", cut_text(head[1].content, 271), "memory/summary")
    budget = cost([head[0], k1, *turn])
    req = request_of(head, history, turn, budget, {"in"}, memory_budget=300)
    r = trim(req, CHARS)
    assert HINT_ID in [m.id for m in r.messages]
    assert r.steps == [1, 2, 3, 4, 5]
    assert r.tokens_after <= req.budget or 5 in r.steps


def test_step4_shrinks_by_a_few_characters_when_a_little_over() -> None:
    """Step 4 shrinks proportionally, the suffix included: a summary 4 tokens over the
    memory budget in a request 3 tokens over budget loses a few characters, is not
    lengthened, and is not deleted."""
    head = [system("sys", t(350)), system("k1", t(3500, "m"), "memory/summary")]
    req = request_of(head, [], [user("in", "q")], 1110, {"in"}, memory_budget=1000)
    r = trim(req, EST)
    assert r.tokens_before == 1113
    assert [(a.action, a.ids) for a in r.trace] == [("shrunk", ("k1",))]
    assert r.trace[0].saved > 0
    assert r.tokens_after <= req.budget
    assert len(by_id(r.messages)["k1"].content) <= 3500 * 1000 // 1004 + 1


def test_step4_never_lengthens_at_the_200_character_minimum() -> None:
    head = [
        system("sys", t(350)),
        system("k1", t(210, "m"), "memory/summary"),
        system("k2", t(3500, "n"), "skills/list"),
    ]
    r = trim(request_of(head, [], [user("in", "q")], 1024, {"in"}, memory_budget=500), EST)
    out = by_id(r.messages)
    if "k1" in out:
        assert len(out["k1"].content) <= len(head[1].content)
    assert all(a.saved > 0 for a in r.trace if a.action == "shrunk")


def test_step5_leaves_a_result_just_over_500_alone() -> None:
    """Step 5 uses step 2's thresholds: a 510-character result is not over-long, and a
    cut would only have made it longer."""
    c1 = ToolCall(id="c1", name="fetch")
    turn = [user("in", "q"), assistant("g", calls=[c1]), result("r1", c1, t(510))]
    r = trim(request_of([system("sys", t(4000))], [], turn, 1024, {"in"}), EST)
    assert r.steps == [1, 2, 3, 4, 5]
    assert by_id(r.messages)["r1"].content == turn[2].content
    assert r.tokens_after <= r.tokens_before


def test_with_an_empty_turn_the_last_message_is_left_alone_in_step4() -> None:
    """TRIM-N: the last message is only ever truncated, in step 5; step 4 shrinks only the
    injected messages *between* the first and the last. With nothing after the head (a
    snapshot of a session with no history: every message is a leading system message, so
    all of them are head), trim takes the last message for an injected one and shrinks it."""
    head = [
        system("sys", t(400)),
        system("k1", t(3000, "m"), "memory/summary"),
        system("vol", t(800, "v"), "agent/volatile"),  # the last message
    ]
    r = trim(request_of(head, [], [], 1024, (), memory_budget=300, snapshot=True), EST)
    assert 4 in r.steps
    assert "vol" not in named(r, (1, 2, 3, 4))
    assert enc(r.messages[-1]) == enc(head[-1])


class _Counted:
    """One token per character, counting the texts it is asked about."""

    name = "counted"
    encodes = 0

    def __init__(self) -> None:
        self.asked = 0

    def count(self, text: str) -> int:
        self.asked += 1
        return len(text)


def _asked_for(groups: int, results: int) -> tuple[int, TrimResult]:
    """Texts counted by a trim of a turn of ``groups`` earlier tool groups, each with a
    long result (cut at step 2a, then collapsed at 2c), and a last group of ``results``
    results (left as they are: step 2 never changes the last group)."""
    turn: list[ChatMessage] = [user("u", "go")]
    for g in range(groups):
        call = ToolCall(id=f"g{g}", name="look", arguments="{}")
        turn += [assistant(f"a{g}", calls=[call]), result(f"r{g}", call, t(2_000))]
    calls = [ToolCall(id=f"c{k}", name="look", arguments="{}") for k in range(results)]
    turn.append(assistant("last", calls=calls))
    turn += [result(f"l{k}", c, t(20)) for k, c in enumerate(calls)]
    counter = _Counted()
    req = TrimRequest(
        head=[system("sys", "s")], history=[], turn=turn, budget=100, protected=frozenset({"u"})
    )
    r = trim(req, counter)  # type: ignore[arg-type]
    return counter.asked, r


def test_a_turn_of_many_tool_results_trims_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2 over a turn of thousands of tool results and groups counts each text and
    walks each group a bounded number of times: twice the messages, about twice the work
    (each change was followed by a recount of the whole turn, and each message looked
    for the last group again: 4,000 results took 19 s to trim)."""
    from aalis_agent.request import trim as trim_module

    walked = [0]  # results a group's walk went over
    group_results = trim_module.group_results

    def counted(messages: Sequence[ChatMessage], index: int) -> list[int]:
        found = group_results(messages, index)
        walked[0] += len(found) + 1
        return found

    monkeypatch.setattr(trim_module, "group_results", counted)
    small, r_small = _asked_for(100, 200)
    walked_small, walked[0] = walked[0], 0
    large, r_large = _asked_for(200, 400)
    assert 0 < walked[0] <= 2.2 * walked_small, (walked_small, walked[0])
    for r, groups in ((r_small, 100), (r_large, 200)):
        actions = [a.action for a in r.trace]
        assert actions.count("truncated") >= groups and actions.count("collapsed") == groups
        assert r.steps[:2] == [1, 2]
    assert 0 < large <= 2.2 * small, (small, large)
    assert r_large.tokens_after == count_messages(CHARS, r_large.messages)


def _asked_for_blocks(blocks: int) -> tuple[int, TrimResult]:
    """Texts counted by a trim whose step 4 deletes most of ``blocks`` injected system
    messages (a contribution that built thousands of blocks)."""
    head = [system("sys", "s"), *(system(f"k{i}", "kk", "plug/k") for i in range(blocks))]
    counter = _Counted()
    req = TrimRequest(
        head=head,
        history=[],
        turn=[user("u", "go")],
        budget=blocks,  # one token a block fits: about five in six go
        memory_budget=10,
        protected=frozenset({"u"}),
    )
    r = trim(req, counter)  # type: ignore[arg-type]
    return counter.asked, r


def test_step4_deleting_thousands_of_injected_messages_is_linear_work() -> None:
    """Each deletion of step 4 walked and counted every injected message again: a
    contribution of 16,000 blocks made a turn's trim take 52 s."""
    small, r_small = _asked_for_blocks(1_000)
    large, r_large = _asked_for_blocks(2_000)
    for r, blocks in ((r_small, 1_000), (r_large, 2_000)):
        deleted = [a for a in r.trace if a.action == "deleted"]
        assert len(deleted) > blocks // 2 and r.steps[:4] == [1, 2, 3, 4]
        assert r.tokens_after == count_messages(CHARS, r.messages)
        assert [m.id for m in r.messages if not m.meta.injector] == ["sys", "u", HINT_ID]
    assert 0 < large <= 2.2 * small, (small, large)
