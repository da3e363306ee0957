"""The five-step context trim (TRIM), as a pure function with a trace of what it did.

Budget ``B = max(contextLength × ratio − maxOutputTokens − 512, 1024)`` (CFG5). The
request has three parts: head, history and this turn. ``u = ⌈B/4⌉``; history may use
``B − head − u``.

1. always: history over its allowance drops from the earliest message until at least
   ``k = ⌈(history − allowance)/u⌉`` units are dropped; a cut inside a tool group drops the
   rest of the group (even the last message, when the turn part is empty). The cut depends
   only on head and history, and moves only when the history grows by another unit
   (TRIM-P).
2. still over: this turn's tool results over 1500 characters keep 500; reasoning over 200
   characters is cut oldest first (older keep 200, the newest 400); both cuts carry the
   visible truncation suffix (one rule, ``textnorm.truncate``) and are skipped when they
   would not save tokens; earlier tool groups collapse into one ``[历史工具调用]`` line
   each when that saves tokens.
3. still over: the history keeps dropping, unit by unit, or all of it.
4. still over: injected system messages between the first and the last (not this turn's
   instruction block) over ``memoryTokenBudget`` shrink proportionally (at least 200
   characters each), then the frontmost go.
5. still over: the last tool group's results keep 500 characters, its reasoning 400.

Tool groups are found by position: an assistant message with calls and the results right
after it, ids matched within that message only (``pairing``), so no step leaves a call
without its result or a result without its call, whatever the call ids are.

Never touched: the first system message and this turn's inputs. The last tool group and
the last message are only ever truncated, in step 5. After a trim that reached step 4 and
removed six or more messages, the continuation hint goes after this turn's last input
(at the end for a snapshot) (TRIM-H).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import msgspec
from aalis_agent.events.schema import ChatMessage, MessageMeta
from aalis_agent.request.pairing import group_results, pair_results
from aalis_agent.request.textnorm import truncate, truncate_to_tokens
from aalis_agent.request.texts import ZH, Texts
from aalis_agent.request.tokens import TokenCounter, message_tokens

__all__ = [
    "COLLAPSED_PREFIX",
    "TrimAction",
    "TrimRequest",
    "TrimResult",
    "trim",
    "trim_budget",
]

COLLAPSED_PREFIX = ZH("prompt.collapsed_tools")
RESULT_LIMIT = 1500
RESULT_KEEP = 500
REASONING_LIMIT = 200
REASONING_KEEP_OLD = 200
REASONING_KEEP_NEW = 400
INJECTED_MIN_CHARS = 200
HINT_MIN_REMOVED = 6


def trim_budget(context_length: int, max_output_tokens: int, ratio: float = 1.0) -> int:
    """CFG5: ``contextLength × ratio − maxOutputTokens − 512``, at least 1024."""
    return max(math.floor(context_length * ratio) - max_output_tokens - 512, 1024)


class TrimRequest(msgspec.Struct, frozen=True):
    """The assembled request, split into its parts. (A frozen struct: made twice a turn,
    it costs 0.3 µs against 3.7 for a frozen dataclass.)"""

    head: Sequence[ChatMessage]
    history: Sequence[ChatMessage]
    turn: Sequence[ChatMessage]
    budget: int
    memory_budget: int = 4096
    protected: frozenset[str] = frozenset()  # this turn's inputs and instruction block
    tool_tokens: int = 0  # tool definitions sent with the request
    snapshot: bool = False
    # The history's token prefix sums (len(history) + 1 items), when already known.
    history_prefix: Sequence[int] | None = None
    # The list ``head``, ``history`` and ``turn`` were split from (their concatenation),
    # when there is one: returned as it is when the trim changes nothing, not copied.
    whole: Sequence[ChatMessage] | None = None
    # The language of the texts a trim adds (truncation suffix, collapsed tool calls,
    # continuation hint).
    texts: Texts = ZH


@dataclass(frozen=True)
class TrimAction:
    """One change: which step, what it did, to which messages, and the tokens saved."""

    step: int
    action: str  # dropped | truncated | collapsed | shrunk | deleted | hint
    ids: tuple[str, ...]
    saved: int


@dataclass
class TrimResult:
    messages: Sequence[ChatMessage]
    trace: list[TrimAction] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    cut: int = 0  # history messages dropped by step 1
    history_dropped: int = 0  # by steps 1 and 3
    tokens_before: int = 0
    tokens_after: int = 0
    untrimmed_history: int = 0  # history and tool results before trimming (ACC2)
    head: list[ChatMessage] = field(default_factory=list)  # the parts as sent
    turn: list[ChatMessage] = field(default_factory=list)
    history_tokens: int = 0  # what the history kept costs
    # Each message's tokens of ``head`` and ``turn``, in order, when the trim left them
    # as they came (None otherwise): ``token:usage`` then splits them without recounting.
    head_counts: list[int] | None = None
    turn_counts: list[int] | None = None

    @property
    def trimmed(self) -> bool:
        """A hard trim: history was dropped, or any step after 1 changed something."""
        return bool(self.trace) or len(self.steps) > 1


class _State:
    def __init__(self, req: TrimRequest, counter: TokenCounter) -> None:
        self.req = req
        self.counter = counter
        self.head = list(req.head)
        self.history = req.history  # read, never changed: dropping moves ``dropped``
        self.turn = list(req.turn)
        self.dropped = 0
        self.result = TrimResult(messages=[])
        # Head, turn and tool definitions are only changed by steps 2 to 5 (``touched``),
        # each change noted with the tokens it saved: their tokens are counted once, and
        # what the changes saved is taken off (a recount after each change made a trim of
        # a turn of thousands of tool results take seconds to minutes).
        self.touched = False
        self.saved = 0  # tokens the changes to head and turn saved so far
        # (map, not a comprehension: a call fewer each; trimmed twice a tool turn)
        self.head_counts = list(map(message_tokens, repeat(counter), self.head))
        self.turn_counts = list(map(message_tokens, repeat(counter), self.turn))  # as req.turn
        self.head_tokens = sum(self.head_counts)
        self.fixed = self.head_tokens + sum(self.turn_counts) + req.tool_tokens
        # Prefix sums of the history's tokens: dropping from the front is a subtraction.
        if req.history_prefix is not None and len(req.history_prefix) == len(self.history) + 1:
            self.prefix: Sequence[int] = req.history_prefix
        else:
            prefix = [0]
            for m in self.history:
                prefix.append(prefix[-1] + message_tokens(counter, m))
            self.prefix = prefix

    def tokens(self, messages: Sequence[ChatMessage]) -> int:
        return sum(message_tokens(self.counter, m) for m in messages)

    def history_tokens(self) -> int:
        """Tokens of the history still kept (the history itself never changes in a trim)."""
        return self.prefix[-1] - self.prefix[self.dropped]

    def total(self) -> int:
        prefix = self.prefix  # the history's part as history_tokens() gives it
        return self.fixed - self.saved + prefix[-1] - prefix[self.dropped]

    def over(self) -> bool:
        return self.total() > self.req.budget

    def note(self, step: int, action: str, ids: Sequence[str], saved: int) -> None:
        """Record a change: ``saved`` is exactly what it took off the request's tokens
        (negative for a message added)."""
        self.result.trace.append(TrimAction(step, action, tuple(ids), saved))
        if action != "dropped":  # history drops are counted by the prefix sums
            self.saved += saved


def _cut_at(state: _State, units: int, unit: int) -> int:
    """First index after the message where the dropped tokens first reach ``units`` units;
    a cut inside a tool group extends past the rest of the group."""
    history = state.history
    need = units * unit
    prefix = state.prefix
    if prefix[-1] < need:
        return len(history)
    cut = bisect.bisect_left(prefix, need)  # the first message where the sum reaches it
    while cut < len(history) and history[cut].role == "tool":
        cut += 1  # the group's remaining results go with their call
    return cut


def _drop_to(state: _State, step: int, cut: int) -> None:
    history = state.history
    if not state.turn and cut >= len(history) and history and history[-1].role != "tool":
        # The last message is never dropped, unless it is a result of a group whose call
        # goes: then the rest of that group goes with it, as at any other cut.
        cut = len(history) - 1
    if cut <= state.dropped:
        return
    gone = state.history[state.dropped : cut]
    saved = state.prefix[cut] - state.prefix[state.dropped]
    state.note(step, "dropped", [m.id for m in gone], saved)
    state.dropped = cut


def _last_group(turn: Sequence[ChatMessage]) -> set[int]:
    """Indexes of the turn's last tool group: its last assistant with calls and the
    results right after it (matched within that message, never by id across the turn)."""
    start, end = _last_group_span(turn)
    return set(range(start, end))


def _last_group_span(turn: Sequence[ChatMessage]) -> tuple[int, int]:
    """The turn's last tool group as ``turn[start:end]`` (its results follow its
    assistant message without a gap); empty when the turn has none."""
    for i in range(len(turn) - 1, -1, -1):
        if turn[i].role == "assistant" and turn[i].tool_calls:
            return i, i + 1 + len(group_results(turn, i))
    return 0, 0


def _replace(message: ChatMessage, **changes: object) -> ChatMessage:
    return msgspec.structs.replace(message, **changes)


def _suffix(state: _State) -> str:
    """The truncation suffix template of the request's locale (``{length}``)."""
    return state.req.texts("prompt.truncated_suffix")


def _cut(counter: TokenCounter, text: str, keep: int, suffix: str) -> str | None:
    """``text`` cut to ``keep`` characters with the visible suffix (one truncation rule
    for tool results and reasoning), or None when that would not make it shorter or
    cheaper: a cut must never lengthen a message, in characters or in tokens."""
    if len(text) <= keep:
        return None
    cut = truncate(text, keep, suffix=suffix)
    if len(cut) >= len(text) or counter.count(cut) >= counter.count(text):
        return None
    return cut


def _shrink(counter: TokenCounter, m: ChatMessage, ratio: float, suffix: str) -> str | None:
    """``m``'s content cut, suffix included, so that the whole message costs at most
    ``ratio`` of its tokens (its framing included: the shrunk messages together then fit
    the budget the ratio was taken against), keeping at least 200 characters; None when
    no such cut has fewer tokens than the text."""
    text = m.content
    if len(text) <= INJECTED_MIN_CHARS:
        return None
    original = counter.count(text)
    whole = message_tokens(counter, m)
    target = max(math.floor(whole * ratio) - (whole - original), 0)
    cut = truncate_to_tokens(text, target, counter, min_chars=INJECTED_MIN_CHARS, suffix=suffix)
    return cut if cut != text and counter.count(cut) < original else None


def _step2(state: _State) -> bool:
    """Returns True once within budget."""
    turn = state.turn
    locked = _last_group(turn) | {len(turn) - 1}
    protected = state.req.protected
    # a) long tool results keep 500 characters
    for i, m in enumerate(turn):
        if i in locked or m.role != "tool" or len(m.content) <= RESULT_LIMIT:
            continue
        cut = _cut(state.counter, m.content, RESULT_KEEP, _suffix(state))
        if cut is None:
            continue
        before = message_tokens(state.counter, m)
        turn[i] = _replace(m, content=cut)
        state.note(2, "truncated", [m.id], before - message_tokens(state.counter, turn[i]))
        if not state.over():
            return True
    # b) reasoning, oldest first: older keep 200, the newest 400
    long = [
        i
        for i, m in enumerate(turn)
        if i not in locked and m.reasoning and len(m.reasoning) > REASONING_LIMIT
    ]
    for n, i in enumerate(long):
        m = turn[i]
        assert m.reasoning is not None
        keep = REASONING_KEEP_NEW if n == len(long) - 1 else REASONING_KEEP_OLD
        cut = _cut(state.counter, m.reasoning, keep, _suffix(state))
        if cut is None:
            continue
        before = message_tokens(state.counter, m)
        turn[i] = _replace(m, reasoning=cut)
        state.note(2, "truncated", [m.id], before - message_tokens(state.counter, turn[i]))
        if not state.over():
            return True
    # c) earlier tool groups collapse into one assistant line, when that saves tokens
    start, end = _last_group_span(turn)  # moved back as earlier groups collapse
    i = 0
    while i < len(turn):
        m = turn[i]
        last = start <= i < end or i == len(turn) - 1
        if last or m.role != "assistant" or not m.tool_calls or m.id in protected:
            i += 1
            continue
        # the group: this message and the results right after it, never a later batch's
        # results that reuse its ids
        members = [i, *group_results(turn, i)]
        answers = pair_results(m.tool_calls, [turn[j] for j in members[1:]])
        prefix = state.req.texts("prompt.collapsed_tools")
        lines = [
            f"{prefix} {c.name} → {(r.content if r is not None else '')[:100]}"
            for c, r in zip(m.tool_calls, answers, strict=True)
        ]
        collapsed = ChatMessage(
            id=m.id,
            role="assistant",
            content="\n".join(lines),
            meta=MessageMeta(turn_id=m.meta.turn_id),
        )
        before = state.tokens([turn[j] for j in members])
        after = message_tokens(state.counter, collapsed)
        if after >= before:
            i += 1
            continue
        group_ids = [turn[j].id for j in members]
        del turn[i + 1 : members[-1] + 1]  # its results, right after it
        if start > i:  # the last group comes after it (it is never before)
            start, end = start - (len(members) - 1), end - (len(members) - 1)
        turn[i] = collapsed
        state.note(2, "collapsed", group_ids, before - after)
        if not state.over():
            return True
        i += 1
    return not state.over()


def _injected(state: _State) -> list[tuple[list[ChatMessage], int]]:
    """Injected system messages between the first and the last message, as (part, index),
    not this turn's instruction block and not protected ones."""
    out: list[tuple[list[ChatMessage], int]] = []
    kept = state.history[state.dropped :]
    last = state.turn[-1] if state.turn else kept[-1] if kept else state.head[-1]
    for part in (state.head, state.turn):
        for i, m in enumerate(part):
            if part is state.head and i == 0:
                continue  # the first system message
            if m is last:
                continue  # the last message
            if m.role == "system" and m.id not in state.req.protected and m.kind is None:
                out.append((part, i))
    return out


def _step4(state: _State) -> None:
    budget = state.req.memory_budget
    injected = _injected(state)
    total = sum(message_tokens(state.counter, part[i]) for part, i in injected)
    if total <= budget:
        return
    ratio = budget / total
    for part, i in injected:
        m = part[i]
        cut = _shrink(state.counter, m, ratio, _suffix(state))
        if cut is None:
            continue
        before = message_tokens(state.counter, m)
        part[i] = _replace(m, content=cut)
        state.note(4, "shrunk", [m.id], before - message_tokens(state.counter, part[i]))
    if not state.over():
        return
    # Then deleted from the front while over. Deleting one leaves the others injected
    # (the last message, never one of them, stays the last): they are walked and counted
    # once, and the deleted ones taken out of their parts together (a walk and a recount
    # after each deletion made a contribution of 16,000 blocks take 52 s to trim).
    injected = _injected(state)
    counts = [message_tokens(state.counter, part[i]) for part, i in injected]
    total = sum(counts)
    gone: dict[int, set[int]] = {}  # id(part) -> its indexes deleted
    for (part, i), n in zip(injected, counts, strict=True):
        if total <= budget or not state.over():
            break
        state.note(4, "deleted", [part[i].id], n)
        total -= n
        gone.setdefault(id(part), set()).add(i)
    for part in (state.head, state.turn):
        deleted = gone.get(id(part))
        if deleted:
            part[:] = [m for j, m in enumerate(part) if j not in deleted]


def _step5_changes(counter: TokenCounter, m: ChatMessage, suffix: str) -> dict[str, object]:
    """Step 2's thresholds and truncation rule: results over 1500 characters keep 500,
    reasoning over 200 keeps 400, both with the visible suffix; never lengthening."""
    changes: dict[str, object] = {}
    if m.role == "tool" and len(m.content) > RESULT_LIMIT:
        cut = _cut(counter, m.content, RESULT_KEEP, suffix)
        if cut is not None:
            changes["content"] = cut
    if m.reasoning and len(m.reasoning) > REASONING_LIMIT:
        cut = _cut(counter, m.reasoning, REASONING_KEEP_NEW, suffix)
        if cut is not None:
            changes["reasoning"] = cut
    return changes


def _step5(state: _State) -> None:
    turn = state.turn
    group = sorted(_last_group(turn))
    last = len(turn) - 1
    targets = group + ([last] if last >= 0 and last not in group else [])
    for i in targets:
        m = turn[i]
        if m.id in state.req.protected:
            continue
        changes = _step5_changes(state.counter, m, _suffix(state))
        if changes:
            before = message_tokens(state.counter, m)
            turn[i] = _replace(m, **changes)
            state.note(5, "truncated", [m.id], before - message_tokens(state.counter, turn[i]))


def _hint(state: _State, count_before: int) -> None:
    """TRIM-H: after step 4, when six or more messages went, the continuation hint goes
    after this turn's last input (at the end for a snapshot). It is placed before step 5
    decides, so its own tokens count against the budget."""
    now = len(state.head) + len(state.history) - state.dropped + len(state.turn)
    if count_before - now < HINT_MIN_REMOVED:
        return
    text = state.req.texts("prompt.continuation_hint")
    hint = ChatMessage(id="continuation-hint", role="system", content=text)
    position = len(state.turn)
    if not state.req.snapshot:
        inputs = [i for i, m in enumerate(state.turn) if m.id in state.req.protected]
        if inputs:
            position = inputs[-1] + 1
    state.turn.insert(position, hint)
    state.note(4, "hint", [hint.id], -message_tokens(state.counter, hint))


def trim(req: TrimRequest, counter: TokenCounter) -> TrimResult:
    """Trim the request to its budget; the result lists every change it made."""
    state = _State(req, counter)
    result = state.result
    result.tokens_before = state.total()
    count_before = len(req.head) + len(req.history) + len(req.turn)
    budget = req.budget
    unit = -(-budget // 4)
    head_tokens = state.head_tokens
    allowance = budget - head_tokens - unit
    history_tokens = state.prefix[-1]
    # Step 1: always, looking only at head and history (TRIM-P).
    result.steps.append(1)
    units = 0
    if history_tokens > allowance:
        units = -(-(history_tokens - allowance) // unit)
        _drop_to(state, 1, _cut_at(state, units, unit))
    result.cut = state.dropped
    if state.over():
        result.steps.append(2)
        state.touched = True  # steps 2 to 5 change the head and the turn
        if not _step2(state) and state.over():
            result.steps.append(3)
            most = len(state.history) if state.turn else max(len(state.history) - 1, 0)
            while state.over() and state.dropped < most:
                units += 1
                _drop_to(state, 3, _cut_at(state, units, unit))
            if state.over():
                result.steps.append(4)
                _step4(state)
                _hint(state, count_before)
                if state.over():
                    result.steps.append(5)
                    _step5(state)
    if req.whole is not None and not state.touched and not state.dropped:
        messages = req.whole  # nothing changed (the common case): no copy of the history
    elif state.dropped:
        messages = [*state.head, *state.history[state.dropped :], *state.turn]
    else:
        messages = [*state.head, *state.history, *state.turn]
    result.messages = messages
    result.history_dropped = state.dropped
    result.tokens_after = state.total()
    result.head, result.turn = state.head, state.turn
    if not state.touched:
        result.head_counts, result.turn_counts = state.head_counts, state.turn_counts
    result.history_tokens = state.history_tokens()
    tool_results = 0  # this turn's tool results, as they came
    for m, n in zip(req.turn, state.turn_counts, strict=True):
        if m.role == "tool":
            tool_results += n
    result.untrimmed_history = state.prefix[-1] + tool_results
    return result
