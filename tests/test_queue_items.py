"""``agent:queue``'s items kept between changes (``actors/session.py`` ``_QueueItems``):
whatever the queue did, they are what ordering the whole queue gives (SCH7), and a flood
of submits with a listener is not quadratic."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
from aalis_agent.actors.runtime import Runtime
from aalis_agent.actors.session import _queue_item, _QueueItems
from aalis_agent.events import Input
from aalis_agent.events.sqlite import SqliteEventStore
from aalis_agent.projections import queue
from aalis_agent.projections.chain import Chain
from aalis_agent.services import ScriptedModel, ScriptedReply, Services
from hypothesis import given
from hypothesis import strategies as st


def _waiting(n: int, arrival: int, *, front: bool = False, pending: bool = False) -> queue.Waiting:
    return queue.Waiting(
        input=Input(id=f"in-{n}", content=f"m{n}", source="s" if n % 3 == 0 else None),
        arrival=arrival,
        generation=0,
        held_for="turn-1" if pending else None,
        front=front,
    )


def _expected(state: queue.QueueState) -> list[dict[str, Any]]:
    return [_queue_item(w) for w in queue.waiting(state)]


# One step: place an input in the queue or pending (arriving after all, or earlier, or
# put in front as recovery does), or take the one at some index out of either.
_step = st.one_of(
    st.tuples(
        st.just("place"),
        st.sampled_from(["queued", "pending"]),
        st.sampled_from(["after", "earlier", "front"]),
    ),
    st.tuples(st.just("take"), st.sampled_from(["queued", "pending"]), st.integers(0, 30)),
    st.tuples(st.just("same"), st.just(""), st.just("")),
)


@given(st.lists(_step, max_size=40))
def test_items_are_the_queue_in_its_order_after_any_changes(
    steps: list[tuple[str, str, Any]],
) -> None:
    kept = _QueueItems()
    state = queue.QueueState()
    arrival = 100
    n = 0
    for op, part, how in steps:
        if op == "place":
            n += 1
            arrival += 1
            at = {"after": arrival, "earlier": n, "front": arrival}[how]
            w = _waiting(n, at, front=how == "front", pending=part == "pending")
            chain: Chain[queue.Waiting] = getattr(state, part)
            state = msgspec_replace(state, **{part: chain.append(w)})
        elif op == "take":
            chain = getattr(state, part)
            if chain:
                gone = chain[how % len(chain)]
                left = Chain([w for w in chain if w is not gone])
                state = msgspec_replace(state, **{part: left})
        assert kept.now(state) == _expected(state)


def msgspec_replace(state: queue.QueueState, **changes: Any) -> queue.QueueState:
    return msgspec.structs.replace(state, **changes)


def test_each_payload_is_a_list_of_its_own() -> None:
    kept = _QueueItems()
    state = queue.QueueState(queued=Chain([_waiting(1, 1)]))
    first = kept.now(state)
    state = msgspec_replace(state, queued=state.queued.append(_waiting(2, 2)))
    second = kept.now(state)
    assert [i["inputId"] for i in first] == ["in-1"]  # not grown by the next change
    assert [i["inputId"] for i in second] == ["in-1", "in-2"]


def test_a_flood_of_submits_with_a_listener_reports_every_change(tmp_path: Path) -> None:
    """Inputs submitted while a turn runs: each placing is reported with the whole
    queue in arrival order, the last with all of them; then the queue drains."""
    release = threading.Event()

    def reply(request: object, n: int) -> ScriptedReply:
        release.wait(30)
        return ScriptedReply(text="ok")

    store = SqliteEventStore(tmp_path / "q.db")
    rt = Runtime(store, Services(llm=ScriptedModel(reply, keep_requests=0)), janitor=False)
    seen: list[list[str]] = []
    rt.subscribe("agent:queue", lambda topic, p: seen.append([i["inputId"] for i in p["items"]]))
    try:
        first = rt.submit("s", Input(id="first", content="hi"))
        handles = [rt.submit("s", Input(id=f"q{i}", content=f"m{i}")) for i in range(300)]
        ids = [f"q{i}" for i in range(300)]
        # Each submit's report holds the inputs waiting so far, in arrival order.
        placed = [s for s in seen if s and s[0] == "q0"]
        assert placed[: len(ids)] == [ids[: k + 1] for k in range(len(ids))]
        release.set()
        first.result(timeout=60)
        for h in handles:
            h.result(timeout=60)
        assert seen[-1] == []
    finally:
        release.set()
        rt.shutdown(timeout=60)
        store.close()
