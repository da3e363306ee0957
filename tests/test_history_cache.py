"""The session's prepared history (actors/history_cache.py) equals the history computed
from scratch, whatever happened to the log between two requests."""

from __future__ import annotations

from datetime import timedelta, timezone

from aalis_agent.actors.history_cache import HistoryCache, PreparedHistory
from aalis_agent.events import ChatMessage, MessageMeta, Sender, ToolCall
from aalis_agent.projections.history import HistoryState, active_history, history_window
from aalis_agent.request.prompt import render_history
from aalis_agent.request.tokens import EstimateCounter, message_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

COUNTER = EstimateCounter()
CST = timezone(timedelta(hours=8))
NOW = 1_767_225_600_000  # 2026-01-01 08:00 +08:00
YEAR_MS = 366 * 24 * 3600 * 1000

CALL_IDS = ("call_0", "call_1", "x")
TURNS = ("t1", "t2", "t3", None)


@st.composite
def messages(draw: st.DrawFn) -> ChatMessage:
    n = draw(st.integers(0, 10**6))
    turn = draw(st.sampled_from(TURNS))
    kind = draw(
        st.sampled_from(
            ("user",) * 3 + ("reply", "visible") + ("call", "result") * 3 + ("user-untimed",)
        )
        if draw(st.booleans())
        else st.sampled_from(("user", "reply", "call", "result"))
    )
    if kind.startswith("user"):
        return ChatMessage(
            id=f"u{n}",
            role="user",
            content=f"hello {n}",
            meta=MessageMeta(
                turn_id=turn,
                timestamp=None if kind == "user-untimed" else NOW - draw(st.integers(0, YEAR_MS)),
                sender=Sender(user_id=f"p{n % 3}", nickname="nick"),
                platform="qq",
            ),
        )
    if kind == "call":
        ids = draw(st.lists(st.sampled_from(CALL_IDS), min_size=1, max_size=2))
        return ChatMessage(
            id=f"a{n}",
            role="assistant",
            tool_calls=tuple(ToolCall(id=i, name="echo", arguments="{}") for i in ids),
            meta=MessageMeta(turn_id=turn),
        )
    if kind == "result":
        return ChatMessage(
            id=f"r{n}",
            role="tool",
            content="好",
            tool_call_id=draw(st.sampled_from(CALL_IDS)),
            meta=MessageMeta(turn_id=turn),
        )
    visible = "shown" if kind == "visible" else None
    return ChatMessage(
        id=f"a{n}",
        role="assistant",
        content=f"reply {n}",
        meta=MessageMeta(turn_id=turn, visible_content=visible),
    )


append = st.tuples(st.just("append"), st.lists(messages(), min_size=1, max_size=6))
prepare = st.tuples(
    st.just("prepare"),
    st.sampled_from((0, 0, 0, 3, 4, 7)),
    st.sampled_from(("t9", "t9", "t9", "t1", None)),  # mostly a turn with no messages yet
    st.sampled_from((0, 0, 0, YEAR_MS)),
)
# Mostly growth and requests, as a session lives; now and then a clear, a compaction, or
# an older view extended anew.
steps = st.one_of(
    append,
    append,
    append,
    prepare,
    prepare,
    prepare,
    st.tuples(st.just("clear")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("rewind"), st.integers(0, 5)),
)


def expected(state: HistoryState, limit: int, exclude: str | None, now: int) -> tuple:
    sent = tuple(render_history(history_window(state, limit, exclude_turn=exclude), now, CST))
    prefix = [0]
    for m in sent:
        prefix.append(prefix[-1] + message_tokens(COUNTER, m))
    return sent, tuple(prefix), len(active_history(state, exclude_turn=exclude))


@settings(max_examples=150, deadline=None)
@given(st.lists(steps, min_size=20, max_size=60))
def test_prepared_history_equals_the_history_computed_from_scratch(plan: list) -> None:
    cache = HistoryCache(COUNTER)
    state = HistoryState()
    states = [state]
    earlier: list[tuple[PreparedHistory, set[str]]] = []
    for step in plan:
        if step[0] == "append":
            for m in step[1]:
                state = HistoryState(state.messages.append(m), state.active_from)
        elif step[0] == "clear":
            state = HistoryState()
        elif step[0] == "compact":
            state = HistoryState(state.messages, len(state.messages))
        elif step[0] == "rewind":
            state = states[max(len(states) - 1 - step[1], 0)]  # an older view, extended anew
        else:
            _, limit, exclude, later = step
            now = NOW + later
            got = cache.prepare(state, limit, exclude, now, CST)
            want = expected(state, limit, exclude, now)
            assert (tuple(got.messages), tuple(got.prefix or ()), got.active) == want
            earlier.append((got, {m.id for m in want[0]}))
            for prepared, ids in earlier[-3:]:  # still right after the cache moved on
                assert all(i in prepared.ids for i in ids)
                assert not any(f"{i}-x" in prepared.ids for i in ids) | ("u-1" in prepared.ids)
        states.append(state)


def test_a_growing_history_is_prepared_from_its_new_messages_only() -> None:
    """Each turn's input is archived before its request is prepared (the turn in flight
    is left out); the next turn reads it as history: nothing starts over."""
    cache = HistoryCache(COUNTER)
    state = HistoryState()

    def add(m: ChatMessage) -> None:
        nonlocal state
        state = HistoryState(state.messages.append(m), state.active_from)

    for turn in range(50):
        tid = f"t{turn}"
        add(
            ChatMessage(
                id=f"u{turn}",
                role="user",
                content="hi",
                meta=MessageMeta(turn_id=tid, timestamp=NOW, platform="qq"),
            )
        )
        got = cache.prepare(state, 0, tid, NOW, CST)
        assert tuple(got.messages) == expected(state, 0, tid, NOW)[0]
        assert len(got.messages) == 4 * turn  # the turns before, not this one's input
        for m in (
            ChatMessage(
                id=f"a{turn}",
                role="assistant",
                tool_calls=(ToolCall(id="call_0", name="echo", arguments="{}"),),
                meta=MessageMeta(turn_id=tid),
            ),
            ChatMessage(
                id=f"r{turn}",
                role="tool",
                content="好",
                tool_call_id="call_0",
                meta=MessageMeta(turn_id=tid),
            ),
            ChatMessage(
                id=f"f{turn}", role="assistant", content="ok", meta=MessageMeta(turn_id=tid)
            ),
        ):
            add(m)
    assert cache.rebuilds == 0
    # a year later every label is rendered again; a clear starts over
    cache.prepare(state, 0, None, NOW + YEAR_MS, CST)
    assert cache.rebuilds == 1
    assert cache.prepare(HistoryState(), 0, None, NOW, CST).messages == ()
    assert cache.rebuilds == 2
