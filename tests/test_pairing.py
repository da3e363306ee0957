"""Provider pairing always holds: every request has each assistant tool call answered by
exactly one tool result, right after its message, whatever the call ids are.

Servers that number calls per response reuse ``call_0``, ``call_1``, ... in every
response, and some send two parallel calls with one id. Property tests build archives and
turns with such ids, read the history as a turn does (``historyLimit`` window, tool-call
grouping), trim at random budgets and check every request: with the ids inside a message
made unique (:func:`unique_call_ids`, as the turn runner stores calls) against the
providers' rules (``validate.provider_violations``), and with raw repeated ids against
:func:`pairing_violations`, which counts two calls with one id as two. Results carry
their batch in their id, so a check also sees that each result goes with its own call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
from aalis_agent.events.schema import ChatMessage, MessageMeta, ToolCall
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.history import (
    HistoryState,
    group_tool_calls,
    history_window,
    window_start,
)
from aalis_agent.request.pairing import (
    group_results,
    pair_results,
    pairing_violations,
    unique_call_ids,
)
from aalis_agent.request.tokens import EstimateCounter, count_messages
from aalis_agent.request.trim import COLLAPSED_PREFIX, TrimRequest, trim
from aalis_agent.request.validate import provider_violations
from hypothesis import event, given, settings
from hypothesis import strategies as st


class Chars:
    """One token per character: exact arithmetic in the example tests."""

    name = "chars"
    encodes = 0

    def count(self, text: str) -> int:
        return len(text)


CHARS = Chars()
EST = EstimateCounter()


def tc(call_id: str, name: str = "f") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments="{}")


def system(mid: str, content: str, injector: str | None = None) -> ChatMessage:
    return ChatMessage(id=mid, role="system", content=content, meta=MessageMeta(injector=injector))


def user(mid: str, content: str = "q") -> ChatMessage:
    return ChatMessage(id=mid, role="user", content=content)


def reply(mid: str, content: str = "ok") -> ChatMessage:
    return ChatMessage(id=mid, role="assistant", content=content)


def calling(mid: str, *calls: ToolCall | str) -> ChatMessage:
    made = tuple(c if isinstance(c, ToolCall) else tc(c) for c in calls)
    return ChatMessage(id=mid, role="assistant", content="", tool_calls=made)


def answer(mid: str, call: ToolCall | str, content: str = "x") -> ChatMessage:
    call_id = call.id if isinstance(call, ToolCall) else call
    name = call.name if isinstance(call, ToolCall) else "f"
    return ChatMessage(
        id=mid,
        role="tool",
        content=content,
        tool_call_id=call_id,
        name=name,
        meta=MessageMeta(call_id=call_id),
    )


def ids(messages: Sequence[ChatMessage]) -> list[str]:
    return [m.id for m in messages]


def owner_violations(messages: Sequence[ChatMessage]) -> list[str]:
    """Each result goes with its own call: a result ``B.rN`` follows assistant ``B`` (the
    generators name results after their batch)."""
    problems: list[str] = []
    owner: str | None = None
    for i, m in enumerate(messages):
        if m.role != "tool":
            owner = m.id if m.role == "assistant" and m.tool_calls else None
        elif owner is None or m.id.rsplit(".r", 1)[0] != owner:
            problems.append(f"#{i} result {m.id} follows {owner}, not its own call")
    return problems


# --- unique_call_ids ---------------------------------------------------------------------


def test_unique_call_ids_keeps_unique_ids_and_the_same_objects() -> None:
    calls = [tc("call_0"), tc("call_1"), tc("x")]
    out = unique_call_ids(calls)
    assert out == calls
    assert all(a is b for a, b in zip(out, calls, strict=True))
    assert unique_call_ids([]) == []


def test_unique_call_ids_numbers_repeats_from_two_keeping_the_first() -> None:
    calls = [tc("a", "read"), tc("a", "grep"), tc("b"), tc("a", "fetch")]
    out = unique_call_ids(calls)
    assert [c.id for c in out] == ["a", "a~2", "b", "a~3"]
    assert [(c.name, c.arguments) for c in out] == [(c.name, c.arguments) for c in calls]


def test_unique_call_ids_never_takes_an_id_another_call_has() -> None:
    # a later call already has a~2: the repeat of a becomes a~3, and a~2 keeps its id
    out = unique_call_ids([tc("a"), tc("a"), tc("a~2"), tc("a~2")])
    assert [c.id for c in out] == ["a", "a~3", "a~2", "a~2~2"]
    out = unique_call_ids([tc(""), tc(""), tc("~2")])
    assert [c.id for c in out] == ["", "~3", "~2"]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(["a", "a~2", "a~3", "b", "b~2", "", "~2"]), max_size=12))
def test_property_unique_call_ids(raw: list[str]) -> None:
    calls = [ToolCall(id=i, name=f"n{k}", arguments=str(k)) for k, i in enumerate(raw)]
    out = unique_call_ids(calls)
    assert len({c.id for c in out}) == len(out) == len(calls)
    # names and arguments stay, in order; the first call with an id keeps it
    assert [(c.name, c.arguments) for c in out] == [(c.name, c.arguments) for c in calls]
    firsts = {i: raw.index(i) for i in raw}
    for k, c in enumerate(out):
        if firsts[raw[k]] == k:
            assert c.id == raw[k]
        else:
            assert c.id.startswith(raw[k] + "~") and c.id not in raw
    # deterministic, and a fixed point
    assert unique_call_ids(calls) == out
    assert unique_call_ids(out) == out


# --- group_results / pair_results / pairing_violations -----------------------------------


def test_group_results_are_the_results_right_after_the_message() -> None:
    messages = [
        calling("b1", "call_0", "call_1"),
        answer("b1.r1", "call_1"),
        answer("b1.r0", "call_0"),
        calling("b2", "call_0"),
        answer("b2.r0", "call_0"),
        user("u"),
    ]
    assert group_results(messages, 0) == [1, 2]
    assert group_results(messages, 3) == [4]
    assert group_results(messages, 5) == []
    # two calls with one id take two results, a third is not theirs
    dup = [calling("d", "x", "x"), answer("d.r0", "x"), answer("d.r1", "x"), answer("o", "x")]
    assert group_results(dup, 0) == [1, 2]


def test_pair_results_pairs_repeated_ids_in_order() -> None:
    calls = [tc("x", "read"), tc("y"), tc("x", "grep")]
    r1, r2, r3 = answer("r1", calls[2]), answer("r2", calls[0]), answer("r3", calls[1])
    assert pair_results(calls, [r1, r2, r3]) == [r1, r3, r2]
    assert pair_results(calls, [r3]) == [None, r3, None]


def test_pairing_violations_counts_repeated_ids() -> None:
    ok = [calling("d", "x", "x"), answer("d.r0", "x"), answer("d.r1", "x"), reply("a")]
    assert pairing_violations(ok) == []
    assert pairing_violations(ok[:2] + ok[3:]) == [
        "#2 assistant message before the results of ['x']"
    ]
    assert pairing_violations([*ok[:3], answer("extra", "x")]) == [
        "#3 tool result 'x' without its call"
    ]
    assert pairing_violations([calling("c", "x")]) == ["end: calls without results ['x']"]


# --- regressions -------------------------------------------------------------------------


def test_collapsing_an_earlier_batch_leaves_later_batches_reusing_its_ids_alone() -> None:
    """Step 2 collapses an earlier tool batch with its own results only: with per-response
    numbering every batch has call_0..call_3, and the later batches keep their results
    (it used to drop them all and send two assistant messages with 4 calls, 0 results)."""
    calls = [tc(f"call_{i}") for i in range(4)]
    turn = [user("in")]
    for b in range(3):
        turn.append(calling(f"b{b}", *calls))
        turn += [answer(f"b{b}.r{i}", c, "x" * 400) for i, c in enumerate(calls)]
    head = [system("sys", "s" * 100)]
    req = TrimRequest(head=head, history=[], turn=turn, budget=5000, protected=frozenset({"in"}))
    r = trim(req, CHARS)
    assert r.steps == [1, 2]
    assert [(a.action, a.ids) for a in r.trace] == [
        ("collapsed", ("b0", "b0.r0", "b0.r1", "b0.r2", "b0.r3"))
    ]
    assert ids(r.messages) == ["sys", "in", "b0", *ids(turn[6:])]
    assert provider_violations(r.messages) == []
    assert owner_violations(r.messages) == []


def test_collapsed_lines_pair_parallel_calls_with_one_id_in_order() -> None:
    turn = [
        user("in"),
        calling("b0", tc("x", "read"), tc("x", "grep")),
        answer("b0.r0", "x", "first " + "p" * 600),
        answer("b0.r1", "x", "second " + "q" * 600),
        calling("b1", "x"),
        answer("b1.r0", "x", "last"),
    ]
    head = [system("sys", "s" * 100)]
    budget = count_messages(CHARS, [*head, *turn]) - 500
    r = trim(TrimRequest(head, [], turn, budget, protected=frozenset({"in"})), CHARS)
    assert [(a.action, a.ids) for a in r.trace] == [("collapsed", ("b0", "b0.r0", "b0.r1"))]
    collapsed = r.messages[2]
    assert collapsed.content.splitlines() == [
        f"{COLLAPSED_PREFIX} read → {turn[2].content[:100]}",
        f"{COLLAPSED_PREFIX} grep → {turn[3].content[:100]}",
    ]
    assert ids(r.messages[3:]) == ["b1", "b1.r0"]
    assert pairing_violations(r.messages) == []


def test_an_empty_turn_drops_the_rest_of_a_group_whose_call_went() -> None:
    """Step 1 with no turn part: the cut lands inside the last group; the group's remaining
    results go with its call even though the last of them is the last message (it used to
    send ``sys, h3``: a result without its call)."""
    history = [user("h0", ""), calling("h1", "c1", "c2"), answer("h2", "c1", "x" * 300)]
    history.append(answer("h3", "c2", "x" * 10))
    head = [system("sys", "s" * 600)]
    r = trim(TrimRequest(head, history, [], 1024, snapshot=True), CHARS)
    assert r.steps == [1]
    assert ids(r.messages) == ["sys"]
    assert [(a.step, a.ids) for a in r.trace] == [(1, ("h0", "h1", "h2", "h3"))]
    assert provider_violations(r.messages) == []


def test_an_empty_turn_still_keeps_a_last_message_outside_any_group() -> None:
    history = [user("h0", "u" * 300), calling("h1", "c1"), answer("h2", "c1", "x" * 300)]
    history.append(reply("h3", "done"))
    r = trim(TrimRequest([system("sys", "s" * 600)], history, [], 1024, snapshot=True), CHARS)
    assert ids(r.messages) == ["sys", "h3"]


def test_history_groups_parallel_calls_with_one_id_with_both_results() -> None:
    """Two parallel calls with one id: both results are sent (it used to send the two
    calls with one result in every later request)."""
    messages = [
        user("u1"),
        calling("g", "x", "x"),
        answer("g.r0", "x"),
        answer("g.r1", "x"),
        user("u2"),
    ]
    out = group_tool_calls(messages)
    assert ids(out) == ["u1", "g", "g.r0", "g.r1", "u2"]
    assert pairing_violations(out) == []


def test_history_result_answers_the_latest_open_call_with_its_id() -> None:
    """A batch left without its result (a crash) and the next one reusing its id: the
    result belongs to the later call, which is sent; the earlier one is skipped (the
    earlier call used to take it, and the later batch was lost)."""
    messages = [
        user("u1"),
        calling("g1", "call_0"),
        user("u2"),
        calling("g2", "call_0", "call_1"),
        answer("g2.r1", "call_1"),
        answer("g2.r0", "call_0"),
        reply("a"),
    ]
    out = group_tool_calls(messages)
    assert ids(out) == ["u1", "u2", "g2", "g2.r1", "g2.r0", "a"]
    assert owner_violations(out) == []


def test_history_window_start_inside_a_batch_with_reused_ids() -> None:
    messages = [
        user("u0"),
        calling("g1", "call_0"),
        answer("g1.r0", "call_0"),
        calling("g2", "call_0"),
        answer("g2.r0", "call_0"),
        reply("a"),
    ]
    state = HistoryState(Chain.of(messages))
    # A=6, N=4, h=2: start 2, on g1's result: it goes, g2's group stays whole
    assert ids(history_window(state, 4)) == ["g2", "g2.r0", "a"]


# --- properties ----------------------------------------------------------------------------

POOL = ("call_0", "call_1", "call_2")
TOOL_NAMES = ("read", "web_search", "f")
LENGTHS = st.one_of(st.integers(0, 60), st.integers(150, 700), st.integers(1400, 3200))


class Build:
    """Draws the messages of one conversation with unique message ids."""

    def __init__(self, draw: st.DrawFn, uniquify: bool, part: str) -> None:
        self.draw = draw
        self.uniquify = uniquify
        self.part = part  # archive and turn ids never meet
        self.counter = itertools.count()

    def nid(self, prefix: str) -> str:
        return f"{self.part}{prefix}{next(self.counter)}"

    def text(self, lengths: st.SearchStrategy[int] = LENGTHS, at_least: int = 0) -> str:
        n = max(at_least, self.draw(lengths))
        return self.draw(st.sampled_from("xy中")) * n

    def calls(self) -> list[ToolCall]:
        """One response's calls: numbered per response, or drawn from a small pool (so
        repeated inside the message too); made unique when the runtime would."""
        n = self.draw(st.integers(1, 4))
        if self.draw(st.booleans()):
            call_ids = [f"call_{i}" for i in range(n)]
        else:
            call_ids = self.draw(st.lists(st.sampled_from(POOL), min_size=n, max_size=n))
        raw = [tc(i, self.draw(st.sampled_from(TOOL_NAMES))) for i in call_ids]
        return unique_call_ids(raw) if self.uniquify else raw

    def batch(self, *, archive: bool) -> list[ChatMessage]:
        """An assistant message with calls and its results (named after it). In the
        archive a batch may miss results (a crash) and hold other messages between the
        call and its results; in the turn it is contiguous, as the tool loop builds it."""
        calls = self.calls()
        head_id = self.nid("b")
        reasoning = self.text(at_least=1) if self.draw(st.booleans()) else None
        head = ChatMessage(
            id=head_id,
            role="assistant",
            content=self.text(st.integers(0, 40)),
            tool_calls=tuple(calls),
            reasoning=reasoning,
        )
        order = list(self.draw(st.permutations(range(len(calls)))))
        if archive and self.draw(st.integers(0, 4)) == 0:
            order = order[: self.draw(st.integers(0, len(order) - 1))]
        tail = [answer(f"{head_id}.r{k}", calls[k], self.text()) for k in order]
        if archive and self.draw(st.booleans()):
            role = self.draw(st.sampled_from(["user", "assistant", "system"]))
            between = ChatMessage(id=self.nid("mid"), role=role, content=self.text(at_least=1))
            tail.insert(self.draw(st.integers(0, len(tail))), between)
        return [head, *tail]


@st.composite
def archives(draw: st.DrawFn, uniquify: bool) -> list[ChatMessage]:
    """An archived conversation: turns of a question, tool batches, and a reply or a stop
    marker."""
    b = Build(draw, uniquify, "h")
    out: list[ChatMessage] = []
    for _ in range(draw(st.integers(0, 6))):
        out.append(user(b.nid("hu"), b.text(at_least=1)))
        for _ in range(draw(st.integers(0, 3))):
            out += b.batch(archive=True)
        if draw(st.booleans()):
            out.append(reply(b.nid("ha"), b.text(at_least=1)))
        else:
            stop = system(b.nid("stop"), "[已停下] 上一轮没答完就停下了。")
            out.append(
                ChatMessage(id=stop.id, role="system", content=stop.content, kind="turn-stopped")
            )
    return out


@st.composite
def requests(draw: st.DrawFn, uniquify: bool) -> TrimRequest:
    """A request as a turn builds it: head, the history read through the window and the
    grouping, and this turn's part with its tool batches; a random budget."""
    b = Build(draw, uniquify, "t")
    archive = draw(archives(uniquify))
    limit = draw(st.integers(0, 12))
    history = history_window(HistoryState(Chain.of(archive)), limit)
    head = [system("sys", b.text(at_least=1))]
    head += [
        system(b.nid("k"), b.text(at_least=1), f"plugin/{i}")
        for i in range(draw(st.integers(0, 2)))
    ]
    snapshot = draw(st.booleans())
    turn = [system(b.nid("vol"), b.text(st.integers(20, 300)), "agent/volatile")]
    protected: set[str] = set()
    if not snapshot:
        first = user(b.nid("in"), b.text(at_least=1))
        turn.append(first)
        protected.add(first.id)
        for _ in range(draw(st.integers(0, 4))):
            turn += b.batch(archive=False)
            if draw(st.booleans()):
                inserted = user(b.nid("ins"), b.text(at_least=1))
                turn.append(inserted)
                protected.add(inserted.id)
        if draw(st.booleans()):
            turn.append(system(b.nid("fb"), b.text(at_least=1)))  # format-retry feedback
    elif draw(st.booleans()):
        turn = []  # a snapshot of the history alone
    total = count_messages(EST, [*head, *history, *turn])
    budget = draw(
        st.one_of(
            st.integers(1, 130).map(lambda pct: max(1, total * pct // 100)),
            st.integers(55, 100).map(lambda pct: total * pct // 100),
            st.integers(85, 100).map(lambda pct: total * pct // 100),
            st.integers(50, 1024),
        )
    )
    return TrimRequest(
        head=head,
        history=history,
        turn=turn,
        budget=budget,
        memory_budget=draw(st.integers(0, 3000)),
        protected=frozenset(protected),
        tool_tokens=draw(st.integers(0, 300)),
        snapshot=snapshot,
    )


def check_request(req: TrimRequest, rules: Callable[[Sequence[ChatMessage]], list[str]]) -> None:
    before = [*req.head, *req.history, *req.turn]
    assert rules(before) == []  # the history read pairs, before any trim
    assert owner_violations(before) == []
    r = trim(req, EST)
    event(f"steps to {r.steps[-1]}")
    if any(a.action == "collapsed" for a in r.trace):
        event("a batch collapsed")
    assert rules(r.messages) == []
    assert pairing_violations(r.messages) == []
    assert owner_violations(r.messages) == []
    assert len(set(ids(r.messages))) == len(r.messages)


PROPERTY = settings(max_examples=200)


@PROPERTY
@given(requests(uniquify=True))
def test_property_trimmed_requests_obey_the_providers_rules(req: TrimRequest) -> None:
    """Ids reused across batches (made unique inside each message, as the runtime stores
    them): every request, at every budget, pairs by the providers' rules."""
    check_request(req, provider_violations)


@PROPERTY
@given(requests(uniquify=False))
def test_property_trimmed_requests_pair_with_repeated_ids_in_a_message(
    req: TrimRequest,
) -> None:
    """Raw ids, repeated inside one message too (as stored before unique ids): each call
    still gets exactly one result, right after its message."""
    check_request(req, pairing_violations)


@PROPERTY
@given(archive=archives(uniquify=False), limit=st.integers(0, 12))
def test_property_history_window_pairs_each_result_with_its_own_call(
    archive: list[ChatMessage], limit: int
) -> None:
    sent = history_window(HistoryState(Chain.of(archive)), limit)
    assert pairing_violations(sent) == []
    assert owner_violations(sent) == []
    assert group_tool_calls(sent) == sent
    # a batch archived whole inside the window is sent whole, an incomplete one is not
    window = archive[window_start(len(archive), limit) :]
    sent_ids = set(ids(sent))
    assert sent_ids <= set(ids(window))
    for m in window:
        if m.role == "assistant" and m.tool_calls:
            results = [r for r in window if r.role == "tool" and r.id.startswith(m.id + ".r")]
            if len(results) == len(m.tool_calls):
                assert {m.id, *ids(results)} <= sent_ids, f"complete batch {m.id} not sent"
            else:
                assert m.id not in sent_ids, f"incomplete batch {m.id} sent"


@pytest.mark.parametrize("uniquify", [True, False])
def test_unique_ids_make_raw_batches_valid_for_providers(uniquify: bool) -> None:
    """Two parallel calls with one id break the providers' rule (a result answers an id);
    with the ids made unique before storing, the same batch is valid."""
    calls = [tc("call_0", "read"), tc("call_0", "grep")]
    stored = unique_call_ids(calls) if uniquify else calls
    messages = [
        user("u"),
        calling("g", *stored),
        *(answer(f"g.r{k}", c) for k, c in enumerate(stored)),
    ]
    assert pairing_violations(messages) == []
    assert (provider_violations(messages) == []) is uniquify
