"""The fast folds of ``projections.session`` agree with the projections' handler tables.

``evolve`` folds the common event types inline and ``project`` folds the history, the
turns and the queue over local variables: both must give exactly what the handler tables
give, from any view (also one that is no longer the newest of its shared lists), and
leave that view as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
from aalis_agent.events.schema import SessionEvent
from aalis_agent.projections import SessionView, evolve, project
from aalis_agent.projections.chain import Chain
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_projections import OPS, _reference, build_log


def _same(got: SessionView, want: SessionView) -> None:
    assert (got.session_id, got.seq) == (want.session_id, want.seq)
    assert got.history == want.history
    assert got.turns == want.turns
    assert got.queue == want.queue
    assert dict(got.settings) == dict(want.settings)


def _one_by_one(events: list[SessionEvent], view: SessionView) -> list[SessionView]:
    views = []
    for event in events:
        view = evolve(view, event)
        views.append(view)
    return views


@settings(max_examples=80)
@given(
    common=st.lists(OPS, max_size=15),
    left=st.lists(OPS, min_size=1, max_size=10),
    right=st.lists(OPS, min_size=1, max_size=10),
)
def test_evolve_folds_as_the_handler_tables_do_from_any_view(
    common: list[tuple[Any, ...]], left: list[tuple[Any, ...]], right: list[tuple[Any, ...]]
) -> None:
    cut = len(build_log(common))
    left_log = build_log(common + left)
    right_log = build_log(common + right)
    middle = project(left_log[:cut])
    before = project(left_log[:cut])

    left_views = _one_by_one(left_log[cut:], middle)  # extends the shared lists in place
    right_views = _one_by_one(right_log[cut:], middle)  # middle is stale now: must copy
    for i, view in enumerate(left_views):
        _same(view, _reference(left_log[cut : cut + i + 1], before))
    for i, view in enumerate(right_views):
        _same(view, _reference(right_log[cut : cut + i + 1], before))
    assert middle == before
    # Every view returned on the way is still what it was.
    for i, view in enumerate(left_views):
        assert view == project(left_log[: cut + i + 1])


@settings(max_examples=60)
@given(ops=st.lists(OPS, max_size=30), data=st.data())
def test_project_and_evolve_agree_from_a_stale_view(
    ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    events = build_log(ops)
    cut = data.draw(st.integers(0, len(events)), label="cut")
    start = project(events[:cut])
    project(events[cut:], start)  # start is no longer the newest view of its lists
    got = project(events[cut:], start)
    _same(got, _reference(events[cut:], start))
    view = start
    for event in events[cut:]:
        view = evolve(view, event)
    assert view == got


def test_chain_list_to_extend_shares_only_the_newest_view() -> None:
    one = Chain.of([1])
    two = one.append(2)
    assert two.list_to_extend() is two._items
    copy = one.list_to_extend()
    assert copy == [1] and copy is not one._items
    assert list(two) == [1, 2]


def test_chain_views_whole() -> None:
    items = [1, 2]
    chain = Chain(items)
    assert chain.views_whole(items)
    assert not chain.views_whole([1, 2])
    items.append(3)
    assert not chain.views_whole(items)
    assert Chain(items).views_whole(items)


def _running_turn_log(n: int, *, held: bool) -> list[SessionEvent]:
    """A turn opened, then ``n`` inputs submitted while it runs: held for it, or queued."""
    return build_log([("open", None), ("flood", n, held)])


@pytest.mark.parametrize("held", [True, False])
def test_an_input_placed_while_a_turn_runs_extends_the_shared_list(held: bool) -> None:
    """Holding (or queuing) one more input extends the list the view before it holds, as
    ``Chain.append`` does, rather than copying every input already waiting: a run of N
    submits costs N, not N²/2 (16,000 submits into one running turn took 2.1 s). The view
    before is unchanged, and a fold from it later copies first."""
    events = _running_turn_log(50, held=held)
    received, placed = events[-2:]
    before = project(events[:-2])
    view = evolve(evolve(before, received), placed)
    name = "pending" if held else "queued"
    grown, old = getattr(view.queue, name), getattr(before.queue, name)
    assert len(grown) == 50 and len(old) == 49
    assert grown.extends(old)  # one shared list, in place
    assert project(events[:-2]) == before
    # A replay of the same log (recovery) shares it too, chunk after chunk.
    start = project(events[:-2])
    assert getattr(project(events[-2:], start).queue, name).extends(getattr(start.queue, name))
    # From the older view, another fold copies: both stay what they were.
    other = evolve(evolve(before, received), placed)
    assert other == view and not getattr(other.queue, name).extends(grown)
