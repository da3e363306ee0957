"""The inspector page in a real headless Chromium: the timeline's turns, one expanded
model-call request, the budget chart's points and the state slider, against the log.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and the ``playwright``
package, which drives that browser (no browser of its own is downloaded). Skips with the
reason when either is missing. The screenshot goes to ``$AALIS_TEST_ARTIFACTS`` when set,
else to the test's temporary folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.cli.demo import run_demo
from aalis_agent.events import (
    ModelCallStarted,
    SqliteEventStore,
    TurnOpened,
    UsageRecorded,
)
from aalis_agent.inspector.server import InspectorServer, make_server
from aalis_agent.projections import project
from aalis_agent.projections.history import history_window

SESSION = "demo:room-1"


def _chromium() -> str | None:
    for name in (os.environ.get("AALIS_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
CHROMIUM = _chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium executable (apt-get install -y chromium, or set AALIS_CHROMIUM)",
    ),
]


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inspect-browser") / "demo.db"
    run_demo(str(path), out=io.StringIO())
    return path


@pytest.fixture(scope="module")
def server(demo_db: Path) -> Iterator[InspectorServer]:
    srv = make_server(demo_db)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server: InspectorServer) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            # The test polls with evaluated predicates, which the page's CSP forbids.
            pg = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
            errors: list[str] = []
            pg.on("pageerror", lambda exc: errors.append(str(exc)))
            pg.goto(server.url, wait_until="load")
            pg.wait_for_function("window.inspector && window.inspector.ready === true")
            yield pg
            assert errors == []
        finally:
            browser.close()


def _log(db: Path) -> list[Any]:
    with SqliteEventStore(db, read_only=True) as store:
        return store.read(SESSION)


@contextlib.contextmanager
def _opened(page: Any, db: Path, fragment: str = "") -> Iterator[tuple[Any, list[str]]]:
    """``db`` served by an inspector of its own and opened (``fragment``: the part after
    ``#``) in a new page of the module's browser; the page and the errors it raised."""
    srv = make_server(db)
    srv.start()
    pg = page.context.browser.new_page(bypass_csp=True)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        pg.goto(srv.url + (f"#{fragment}" if fragment else ""), wait_until="load")
        yield pg, errors
    finally:
        pg.close()
        srv.stop()


def _one_message_sessions(db: Path, texts: dict[str, str]) -> None:
    """A log of sessions each holding one user message: ``{session id: its text}``."""
    from aalis_agent.events import FixedClock, MessageSaved
    from aalis_agent.events.schema import ChatMessage
    from aalis_agent.testing.sample import SampleWriter

    with SqliteEventStore(db) as store:
        for sid, text in texts.items():
            writer = SampleWriter(store, sid, FixedClock(1_767_225_600_000, step_ms=1))
            b = writer.batch()
            b.add(MessageSaved(message=ChatMessage(id="m", role="user", content=text)))
            writer.commit(b)


def test_timeline_shows_the_turns_of_the_log(page: Any, demo_db: Path) -> None:
    events = _log(demo_db)
    turns = page.locator("#timeline > li.turn")
    ids = [turns.nth(i).get_attribute("data-turn-id") for i in range(turns.count())]
    assert ids == [e.turn_id for e in events if isinstance(e, TurnOpened)]
    first = page.locator('li.turn[data-turn-id="turn-1"]')
    entries = first.locator("li.input").evaluate_all("els => els.map(e => e.dataset.entry)")
    assert entries == ["opened", "joined"]
    assert first.locator("li.tool").get_attribute("data-call-id") == "call-weather"
    assert "replied" in first.locator(".turn-head").inner_text()
    third = page.locator('li.turn[data-turn-id="turn-3"]')
    assert "aborted" in third.locator(".turn-head").inner_text()
    assert "stop requested by 10001" in third.locator("li.stop").inner_text()
    assert third.locator("li.marker").count() >= 1


def test_an_expanded_request_is_the_call_as_recorded(page: Any, demo_db: Path) -> None:
    events = _log(demo_db)
    started = next(
        e
        for e in events
        if isinstance(e, ModelCallStarted) and e.turn_id == "turn-1" and e.index == 2
    )
    usage = next(e for e in events if isinstance(e, UsageRecorded) and e.seq > started.seq)
    call = page.locator('li.turn[data-turn-id="turn-1"] li.call[data-index="2"]')
    call.locator("button.expand-request").click()
    box = call.locator(".request")
    box.locator("table.usage").wait_for()
    used = box.locator('table.usage tr[data-key="used"] td').inner_text()
    budget = box.locator('table.usage tr[data-key="token budget"] td').inner_text()
    assert (int(used), int(budget)) == (usage.usage.used, usage.usage.token_budget)
    labels = box.locator("table.parts td:first-child").all_inner_texts()
    assert labels == [p.label for p in usage.usage.parts]
    view = project(e for e in events if e.seq <= started.seq)
    opened = next(e for e in events if isinstance(e, TurnOpened) and e.turn_id == "turn-1")
    window = history_window(view.history, opened.settings.history_limit)
    ids = box.locator(".history .msg").evaluate_all("els => els.map(e => e.dataset.id)")
    assert ids == [m.id for m in window]


def test_chart_points_are_the_recorded_usage(page: Any, demo_db: Path) -> None:
    usage = [e.usage for e in _log(demo_db) if isinstance(e, UsageRecorded)]
    data = page.evaluate(
        """() => {
            const c = window.inspector.chart;
            return { labels: c.series.map(s => s.label), data: c.data };
        }"""
    )
    labels, columns = data["labels"], data["data"]
    assert columns[0] == list(range(1, len(usage) + 1))
    assert columns[labels.index("used")] == [u.used for u in usage]
    assert columns[labels.index("budget")] == [u.token_budget for u in usage]
    assert columns[labels.index("trimmed")] == [u.used if u.trimmed else None for u in usage]
    # The lowest band of the stack is the first part; the top one adds up every part.
    parts = ("system", "persona", "memory_summary", "memory_vector", "skills", "platform")
    parts += ("subtask", "system_other", "tool_defs", "tool_results", "history")
    shown = [p for p in parts if any(getattr(u.breakdown, p) for u in usage)]
    top = columns[labels.index(shown[-1])]
    assert top == [sum(getattr(u.breakdown, p) for p in shown) for u in usage]
    assert page.locator("#chart canvas").count() == 1


def test_slider_shows_the_state_at_an_event(
    page: Any, demo_db: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    page.fill("#seq-input", "10")
    page.dispatch_event("#seq-input", "change")
    page.wait_for_function("window.inspector.state && window.inspector.state.seq === 10")
    view = page.locator("#state-view")
    assert "pending inserts (1): in-2" in view.locator(".pending").inner_text()
    assert "running turn: turn-1" in view.locator(".running").inner_text()
    assert page.input_value("#seq-slider") == "10"
    msgs = view.locator(".history .msg").evaluate_all("els => els.map(e => e.dataset.id)")
    events = [e for e in _log(demo_db) if e.seq <= 10]
    assert msgs == [m.id for m in history_window(project(events).history, 0)]
    out = Path(os.environ.get("AALIS_TEST_ARTIFACTS") or tmp_path_factory.mktemp("shots"))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "inspector.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_a_chart_of_100k_usage_points_loads(page: Any, tmp_path: Path) -> None:
    """100k recorded calls: the answer carries at most ``index.USAGE_POINTS`` of them,
    each stretch's least and most, numbered by call; the chart draws them up to the last
    call and says how many it shows. (Its scale is found with a loop: ``Math.max(...)``
    overflowed the call stack past about 100k points.)"""
    from aalis_agent.events import FixedClock, TokenUsage
    from aalis_agent.inspector import index
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "usage.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "u", FixedClock(1_767_225_600_000, step_ms=1))
        for block in range(100):
            b = writer.batch()
            for n in range(1_000):
                used = block * 1_000 + n
                b.add(UsageRecorded(usage=TokenUsage(session_id="u", used=used, token_budget=10)))
            writer.commit(b)
    with _opened(page, db, "session=u") as (pg, errors):
        pg.wait_for_function(
            "window.inspector && window.inspector.ready === true && window.inspector.chart",
            timeout=60_000,
        )
        assert errors == []
        shown = pg.evaluate("window.inspector.usage.points")
        assert pg.evaluate("window.inspector.usage.points_total") == 100_000
        assert 0 < shown <= index.USAGE_POINTS
        assert pg.evaluate("window.inspector.chart.data[0].length") == shown
        xs = pg.evaluate("Array.from(window.inspector.chart.data[0])")
        assert xs[0] == 1 and xs[-1] == 100_000 and xs == sorted(set(xs))
        used = pg.evaluate("window.inspector.usage.used")
        assert used[-1] == 99_999 and used == [x - 1 for x in xs]  # used = call - 1 here
        note = pg.locator("#chart-note")
        assert note.is_visible() and f"{shown:,} of 100,000 model calls shown" in note.inner_text()


def test_a_cut_text_and_a_capped_list_are_shown_with_what_is_left_out(
    page: Any, tmp_path: Path
) -> None:
    """A turn of 120 tool calls with results of 5,000 characters and a reply of 100,000:
    the page lists the first tool calls and says how many more there are, shows each cut
    text's preview with how many characters it leaves out and a link to its whole event,
    and the state's history does the same for a cut message."""
    from aalis_agent.events import (
        ChatMessage,
        FixedClock,
        MessageMeta,
        MessageSaved,
        ToolFinished,
        ToolStarted,
        TurnRecorded,
    )
    from aalis_agent.inspector import index
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "big.db"
    reply = "答" * 100_000
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "big", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        b.add(TurnOpened(turn_id="t1", input_ids=()))
        for n in range(120):
            b.add(ToolStarted(turn_id="t1", call_id=f"c{n}", name="look", arguments="{}"))
            b.add(ToolFinished(turn_id="t1", call_id=f"c{n}", name="look", result="r" * 5_000))
        saved = b.add(
            MessageSaved(
                message=ChatMessage(
                    id="reply", role="assistant", content=reply, meta=MessageMeta(turn_id="t1")
                )
            )
        )
        b.add(TurnRecorded(turn_id="t1", outcome="replied"))
        writer.commit(b)
    with _opened(page, db, "session=big") as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")
        turn = pg.locator('li.turn[data-turn-id="t1"]')
        tools = turn.locator("li.tool")
        assert tools.count() == 50  # index.TURN_ITEMS
        omitted = turn.locator("li.omitted")
        assert omitted.inner_text() == ("70 more tool calls not shown (the events API has them)")
        first = tools.nth(0).locator(".cut").inner_text()
        assert first.startswith(f" ({5_000 - index.PREVIEW + 1:,} more characters)")
        note = turn.locator("li.reply .cut")
        assert note.inner_text().startswith(f" ({100_000 - index.PREVIEW + 1:,} more characters)")
        href = note.locator("a").get_attribute("href")
        assert href == f"/api/session/events?id=big&from={saved.seq}&to={saved.seq}&whole=1"
        whole = pg.evaluate(f"fetch({href!r}).then(r => r.json())")
        assert whole["events"][0]["data"]["message"]["content"] == reply
        # The state at the end: the reply in the history, cut the same way.
        msg = pg.locator('#state-view .history .msg[data-id="reply"]')
        assert (
            msg.locator(".cut")
            .inner_text()
            .startswith(f" ({100_000 - index.PREVIEW + 1:,} more characters)")
        )
        assert errors == [] and index.TURN_ITEMS == 50


def test_sessions_named_dot_and_dot_dot_open(page: Any, tmp_path: Path) -> None:
    """A session id of "." or ".." in a URL's path is a step a browser resolves (even as
    %2E): the page asks with the id in the query, so such a session opens like any."""
    db = tmp_path / "dots.db"
    _one_message_sessions(db, {sid: f"in {sid}" for sid in (".", "..")})
    with _opened(page, db) as (pg, errors):
        url = pg.url.split("#")[0]
        for sid in (".", ".."):
            pg.goto(url + "#session=" + sid.replace(".", "%2E"), wait_until="load")
            pg.wait_for_function(
                "window.inspector && window.inspector.ready === true "
                f"&& window.inspector.session === {sid!r}",
                timeout=30_000,
            )
            pg.wait_for_function("document.body.innerText.includes('in " + sid + "')")
        assert errors == []


def test_the_session_list_loads_a_page_at_a_time(page: Any, tmp_path: Path) -> None:
    """600 sessions: the list shows the first 500 and a button for the rest, which adds
    them; the first session opens."""
    db = tmp_path / "many.db"
    _one_message_sessions(db, {f"room:{i:03d}": f"hi {i}" for i in range(600)})
    with _opened(page, db) as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")
        links = pg.locator("#sessions a[data-session]")
        assert links.count() == 500
        more = pg.locator("#sessions li.more button")
        assert more.inner_text() == "more sessions (100 not shown)"
        more.click()
        pg.wait_for_function(
            "document.querySelectorAll('#sessions a[data-session]').length === 600"
        )
        assert pg.locator("#sessions li.more").count() == 0
        assert pg.evaluate("window.inspector.session") == links.nth(0).get_attribute("data-session")
        assert errors == []


def test_prev_goes_back_to_where_the_page_before_started(page: Any, tmp_path: Path) -> None:
    """Turns large enough that a page holds fewer than it asks for (its byte budget):
    "next" follows where each page ends, and "prev" returns to where the page before
    started, not a fixed number of turns back."""
    from aalis_agent.events import FixedClock, ToolFinished, ToolStarted, TurnRecorded
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "pages.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "p", FixedClock(1_767_225_600_000, step_ms=1))
        for t in range(40):
            b = writer.batch()
            b.add(TurnOpened(turn_id=f"t{t}", input_ids=()))
            for n in range(50):
                call = f"c{t}-{n}"
                b.add(
                    ToolStarted(turn_id=f"t{t}", call_id=call, name="look", arguments="a" * 1_000)
                )
                b.add(ToolFinished(turn_id=f"t{t}", call_id=call, name="look", result="r" * 1_000))
            b.add(TurnRecorded(turn_id=f"t{t}", outcome="silent"))
            writer.commit(b)
    with _opened(page, db, "session=p") as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")

        def at(offset: int) -> None:
            pg.wait_for_function(f"window.inspector.timeline.offset === {offset}")

        starts = [0]
        for _ in range(2):
            following = pg.evaluate("window.inspector.timeline.next_offset")
            assert following is not None and 0 < following - starts[-1] < 50  # cut by bytes
            pg.click("#page-next")
            at(following)
            starts.append(following)
        pg.click("#page-prev")
        at(starts[1])
        pg.click("#page-prev")
        at(0)
        assert errors == []


def test_a_call_of_a_turn_whose_id_is_cut_opens(page: Any, tmp_path: Path) -> None:
    """A turn id of 2,000 characters is shown cut in the timeline; its model call's
    request still opens (the page asks for the turn by its place, not by the cut id)."""
    from aalis_agent.events import FixedClock, ModelCallEnded, TurnRecorded
    from aalis_agent.inspector import index
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "long.db"
    long_id = "turn-" + "长" * 2_000
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "s", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        b.add(TurnOpened(turn_id=long_id, input_ids=()))
        started = b.add(ModelCallStarted(turn_id=long_id, index=1, model="m"))
        b.add(ModelCallEnded(turn_id=long_id, index=1))
        b.add(TurnRecorded(turn_id=long_id, outcome="replied"))
        writer.commit(b)
    with _opened(page, db, "session=s") as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")
        turn = pg.locator("li.turn").first
        shown = turn.get_attribute("data-turn-id")
        assert shown is not None and len(shown) <= index.PREVIEW < len(long_id)
        call = turn.locator('li.call[data-index="1"]')
        call.locator("button.expand-request").click()
        box = call.locator(".request")
        box.locator("table.call-facts").wait_for()
        facts = box.locator("table.call-facts").inner_text()
        assert f"#{started.seq}" in facts and "not ended" not in facts
        text = box.inner_text()  # the call was found by its turn's place, not missed
        assert "no turn" not in text and "has no model call" not in text
        assert errors == []


def test_rows_that_do_not_decode_are_counted_all_and_listed_first(
    page: Any, tmp_path: Path
) -> None:
    """The summary lists the first rows that do not decode: the page says how many there
    are in all, and how many it does not list."""
    import sqlite3

    from aalis_agent.events import FixedClock
    from aalis_agent.inspector import index
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "broken.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "s", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        b.add(TurnOpened(turn_id="t", input_ids=()))
        writer.commit(b)
    broken = index.CORRUPT_SHOWN + 50
    conn = sqlite3.connect(db)
    with conn:
        sid, pos = conn.execute("SELECT sid, max(position) FROM log").fetchone()
        conn.executemany(
            "INSERT INTO log (sid, seq, position, data) VALUES (?, ?, ?, ?)",
            ((sid, n, pos + n, b"\xc1") for n in range(2, 2 + broken)),
        )
    conn.close()
    with _opened(page, db, "session=s") as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")
        text = pg.locator("#corrupt").inner_text()
        assert text.startswith(f"{broken} row(s) did not decode and are left out: seq 2 (")
        assert text.endswith("; 50 more not listed")
        assert text.count("seq ") == index.CORRUPT_SHOWN
        assert errors == []


def test_a_usage_ratio_of_zero_shows_as_zero(page: Any, tmp_path: Path) -> None:
    """A usage payload leaves out its fields at zero (a model of unknown context window
    records a ratio of 0): the request showed "NaN%"."""
    from aalis_agent.events import (
        FixedClock,
        ModelCallEnded,
        TokenUsage,
        TurnRecorded,
    )
    from aalis_agent.testing.sample import SampleWriter

    db = tmp_path / "ratio.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "s", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        b.add(TurnOpened(turn_id="t", input_ids=()))
        b.add(ModelCallStarted(turn_id="t", index=1, model="m"))
        b.add(ModelCallEnded(turn_id="t", index=1))
        b.add(UsageRecorded(usage=TokenUsage(session_id="s", turn_id="t", used=7)))
        b.add(TurnRecorded(turn_id="t", outcome="replied"))
        writer.commit(b)
    with _opened(page, db, "session=s") as (pg, errors):
        pg.wait_for_function("window.inspector && window.inspector.ready === true")
        call = pg.locator('li.turn li.call[data-index="1"]')
        call.locator("button.expand-request").click()
        box = call.locator(".request")
        box.locator("table.usage").wait_for()
        assert box.locator('tr[data-key="used"] td').inner_text() == "7"
        assert box.locator('tr[data-key="usage ratio"] td').inner_text() == "0.0%"
        assert errors == []
