"""The inspector's answers stay bounded in bytes on hostile logs (texts of megabytes, a turn
of 30,000 tool calls, a history of 300 large messages, a usage payload with 50,000
injectors), say what they left out, and leave the whole value one request away."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from aalis_agent.events import (
    ChatMessage,
    FixedClock,
    Input,
    InputJoined,
    InputQueued,
    InputReceived,
    MessageSaved,
    ModelCallEnded,
    ModelCallStarted,
    SettingsChanged,
    SqliteEventStore,
    TokenBreakdown,
    TokenUsage,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    TurnSettings,
    UsageRecorded,
)
from aalis_agent.inspector import index
from aalis_agent.inspector.server import InspectorServer, make_server
from aalis_agent.testing.sample import SampleWriter

from tests.test_inspector import get

BIG_TURN = "big-turn"
PERSONA = "人设" * 600_000  # 1.2M characters
GROUPS = tuple(f"group-{n}" for n in range(20_000))
TOOLS = 30_000
RESULT = "r" * 5_000
HUGE = "x" * 6_000_000  # one message text past any answer's bound
MESSAGES = 300
MESSAGE = "m" * 100_000  # 300 of them: 30 MB of history
QUEUED = 1_000
JOINED = 200
INJECTORS = 50_000
SETTING = "s" * 1_000_000
BOUND = 4_000_000  # index.ANSWER_BOUND, written out: what every answer here stays under
PAGE = 1_000_000  # index.PAGE_BYTES


def _writer(store: SqliteEventStore, session: str) -> SampleWriter:
    return SampleWriter(store, session, FixedClock(1_767_225_600_000, step_ms=1))


def _big_turn(store: SqliteEventStore) -> None:
    """A turn with a 1.2M-character persona, 20,000 tool groups and 30,000 tool calls."""
    w = _writer(store, "big")
    b = w.batch()
    b.add(InputReceived(input=Input(id="in-1", content=HUGE)))
    settings = TurnSettings(persona=PERSONA, tool_groups=GROUPS, history_limit=7)
    b.add(TurnOpened(turn_id=BIG_TURN, input_ids=("in-1",), settings=settings))
    b.add(InputJoined(input_id="in-1", turn_id=BIG_TURN, entry="opened"))
    b.add(ModelCallStarted(turn_id=BIG_TURN, index=1, model="m/1"))
    b.add(ModelCallEnded(turn_id=BIG_TURN, index=1, tool_calls=TOOLS))
    for n in range(TOOLS):
        b.add(ToolStarted(turn_id=BIG_TURN, call_id=f"c{n}", name="t", arguments="{}"))
        b.add(ToolFinished(turn_id=BIG_TURN, call_id=f"c{n}", name="t", result=RESULT))
    b.add(
        MessageSaved(
            message=ChatMessage(
                id="reply", role="assistant", content=HUGE, meta={"turn_id": BIG_TURN}
            )
        )
    )
    b.add(TurnRecorded(turn_id=BIG_TURN, outcome="replied", duration_ms=5))
    w.commit(b)


def _big_state(store: SqliteEventStore) -> None:
    """A session setting of 1M characters, 300 messages of 100k characters, 1,000 queued
    inputs, and a running turn that 200 inputs of 20k characters joined, whose call
    recorded usage with 50,000 injectors."""
    w = _writer(store, "state")
    b = w.batch()
    b.add(SettingsChanged(key="persona", value=SETTING))
    for n in range(MESSAGES):
        role = "user" if n % 2 == 0 else "assistant"
        b.add(MessageSaved(message=ChatMessage(id=f"msg-{n}", role=role, content=MESSAGE)))
    for n in range(QUEUED):
        b.add(InputReceived(input=Input(id=f"q-{n}", content="waiting")))
        b.add(InputQueued(input_id=f"q-{n}"))
    ids = tuple(f"j-{n}" for n in range(JOINED))
    b.add(TurnOpened(turn_id="run", input_ids=ids, settings=TurnSettings(persona=PERSONA)))
    for i in ids:
        b.add(InputReceived(input=Input(id=i, content="j" * 20_000)))
        b.add(InputJoined(input_id=i, turn_id="run", entry="opened"))
    b.add(ModelCallStarted(turn_id="run", index=1, model="m/1"))
    injectors = {f"injector-{n}": n for n in range(INJECTORS)}
    usage = TokenUsage(
        session_id="state",
        turn_id="run",
        used=10,
        token_budget=100,
        breakdown=TokenBreakdown(history=10, injectors=injectors),
    )
    b.add(UsageRecorded(usage=usage))
    w.commit(b)


def _events(store: SqliteEventStore) -> None:
    """One message of 6M characters, 100 messages of 100k characters, a setting of 1M."""
    w = _writer(store, "events")
    b = w.batch()
    b.add(MessageSaved(message=ChatMessage(id="huge", role="user", content=HUGE)))
    for n in range(100):
        b.add(MessageSaved(message=ChatMessage(id=f"m{n}", role="user", content=MESSAGE)))
    b.add(SettingsChanged(key="persona", value=SETTING))
    w.commit(b)


def _many_turns(store: SqliteEventStore) -> None:
    """200 turns of 40 tool calls, each result 400 control characters (six JSON bytes
    each): a page of 200 such turns was 20 MB."""
    w = _writer(store, "many")
    for t in range(200):
        b = w.batch()
        turn = f"t{t}"
        b.add(TurnOpened(turn_id=turn, input_ids=()))
        for n in range(40):
            b.add(ToolStarted(turn_id=turn, call_id=f"c{n}", name="t"))
            b.add(ToolFinished(turn_id=turn, call_id=f"c{n}", name="t", result="\x01" * 400))
        b.add(TurnRecorded(turn_id=turn, outcome="replied"))
        w.commit(b)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InspectorServer]:
    db = tmp_path_factory.mktemp("bounds") / "hostile.db"
    with SqliteEventStore(db) as store:
        _big_turn(store)
        _big_state(store)
        _events(store)
        _many_turns(store)
    srv = make_server(db)
    srv.start()
    yield srv
    srv.stop()


def fetch(srv: InspectorServer, session: str, what: str, **params: Any) -> tuple[int, Any]:
    """The answer's size in bytes, and the answer."""
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
    url = f"{srv.url}api/sessions/{quote(session, safe='')}/{what}?{query}"
    try:
        with urllib.request.urlopen(url, timeout=120) as res:
            body = res.read()
    except urllib.error.HTTPError as exc:
        with exc:
            raise AssertionError(f"{exc.code}: {exc.read()[:300]!r}") from None
    return len(body), json.loads(body)


def more(text: str, whole: int) -> int:
    """How many characters a preview (ending in "…") leaves out of a text of ``whole``."""
    assert text.endswith("…")
    return whole - (len(text) - 1)


def test_a_turn_of_30000_tool_calls_and_a_huge_persona_makes_a_bounded_page(
    server: InspectorServer,
) -> None:
    size, page = fetch(server, "big", "timeline")
    assert size < BOUND
    (turn,) = page["turns"]
    assert turn["turn_id"] == BIG_TURN and turn["outcome"] == "replied"
    # The persona and the tool groups: previews and counts, the small settings as they are.
    settings, cut = turn["settings"], turn["cut"]
    assert settings["history_limit"] == 7
    assert len(settings["persona"]) == index.PREVIEW and PERSONA.startswith(
        settings["persona"][:-1]
    )
    assert cut["settings.persona"] == len(PERSONA)
    assert cut["settings.tool_groups"] == len(GROUPS)
    assert settings["tool_groups"] == list(GROUPS[: len(settings["tool_groups"])])
    # The first tool calls, and a count of the rest.
    tools = turn["tool_calls"]
    assert 1 <= len(tools) <= index.TURN_ITEMS
    assert [t["call_id"] for t in tools] == [f"c{n}" for n in range(len(tools))]
    assert turn["tool_calls_omitted"] == TOOLS - len(tools)
    first = tools[0]
    assert first["cut"] == {"result": len(RESULT)} and more(first["result"], 5_000) == 4_601
    assert first["duration_ms"] == 1 and first["finished_seq"] == first["started_seq"] + 1
    # The huge input and reply: previews with their whole lengths.
    (inp,) = turn["inputs"]
    assert inp["cut"] == {"content": len(HUGE)} and len(inp["content"]) == index.PREVIEW
    (reply,) = turn["replies"]
    assert reply["cut"] == {"content": len(HUGE)} and turn["replies_omitted"] == 0
    assert turn["model_calls_omitted"] == 0 and turn["model_calls"][0]["tool_calls"] == TOOLS
    # The whole tool result and the whole reply are one request away.
    size, whole = fetch(
        server, "big", "events", **{"from": first["finished_seq"], "to": 10**9, "whole": 1}
    )
    assert [e["seq"] for e in whole["events"]] == [first["finished_seq"]]
    assert whole["events"][0]["data"]["result"] == RESULT and "cut" not in whole["events"][0]
    size, whole = fetch(server, "big", "events", **{"from": reply["seq"], "whole": 1})
    assert whole["events"][0]["data"]["message"]["content"] == HUGE
    assert size > len(HUGE)  # whole: the one answer as large as the log made it


def test_the_turns_of_a_page_stop_at_its_byte_budget_and_the_next_page_goes_on(
    server: InspectorServer,
) -> None:
    seen: list[str] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        size, page = fetch(server, "many", "timeline", offset=offset, limit=500)
        assert size < PAGE + 200_000
        assert page["offset"] == offset and page["turns"]
        seen += [t["turn_id"] for t in page["turns"]]
        for t in page["turns"]:
            shown = t["tool_calls"]
            assert len(shown) + t["tool_calls_omitted"] == 40
            assert 0 < len(shown) < 40  # 40 results of 2.4 kB pass TURN_LIST_BYTES
            assert sum(len(json.dumps(x)) for x in shown) <= index.TURN_LIST_BYTES + 3_000
            assert shown[0]["result"] == "\x01" * index.PREVIEW and "cut" not in shown[0]
        offset = page["next_offset"]
        pages += 1
    assert seen == [f"t{n}" for n in range(200)] and pages > 1


def test_the_state_of_a_huge_history_queue_and_running_turn_is_bounded(
    server: InspectorServer,
) -> None:
    size, s = fetch(server, "state", "state", seq=10**9)
    assert size < BOUND
    # The history: the newest messages that fit, content previewed, whole lengths stated.
    shown = s["history_window"]
    assert len(shown) + s["history_window_omitted"] == MESSAGES
    assert [m["id"] for m in shown] == [f"msg-{n}" for n in range(MESSAGES - len(shown), MESSAGES)]
    last = shown[-1]
    assert last["cut"] == {"content": len(MESSAGE)} and more(last["content"], 100_000) == 99_601
    # ... and the event that holds it whole.
    _, whole = fetch(server, "state", "events", **{"from": last["saved_seq"], "whole": 1})
    assert whole["events"][0]["data"]["message"] == {
        "id": f"msg-{MESSAGES - 1}",
        "role": "assistant",
        "content": MESSAGE,
    }
    # The queue: its first ids, and a count.
    assert s["queued"] == [f"q-{n}" for n in range(index.QUEUE_SHOWN)]
    assert s["queued_omitted"] == QUEUED - index.QUEUE_SHOWN and s["pending_omitted"] == 0
    # The setting and the running turn's inputs: cut, their sizes in cut.
    assert s["cut"]["settings.persona"] == len(SETTING)
    assert len(s["settings"]["persona"]) == index.PREVIEW
    running = s["running_turn"]
    assert running["turn_id"] == "run"
    joined = running["joined"]
    assert [w["arrival"] for w in joined] == sorted(w["arrival"] for w in joined)
    assert joined[0]["input"]["id"] == "j-0" and len(joined[0]["input"]["content"]) == 400
    assert s["cut"]["running_turn.joined[0].input.content"] == 20_000
    # Breadth first: every joined input is there, the last ones without their fields.
    assert len(joined) == JOINED and joined[-1]["input"] == {}
    # The running turn names 100 cut places; its "…" entry counts the others.
    assert len([p for p in s["cut"] if p.startswith("running_turn.")]) == 100 + 1
    assert s["cut"]["running_turn.…"] > 0


def test_a_request_of_a_huge_history_settings_and_usage_is_bounded(
    server: InspectorServer,
) -> None:
    size, r = fetch(server, "state", "request", turn="run", index=1)
    assert size < BOUND
    assert len(r["history"]) + r["history_omitted"] == MESSAGES
    assert all(m["cut"] == {"content": len(MESSAGE)} for m in r["history"])
    assert r["cut"]["settings.persona"] == len(PERSONA)
    assert r["cut"]["usage.breakdown.injectors"] == INJECTORS
    injectors = r["usage"]["breakdown"]["injectors"]
    assert 0 < len(injectors) < INJECTORS and injectors["injector-0"] == 0
    assert (r["usage"]["used"], r["usage"]["tokenBudget"]) == (10, 100)


def test_an_events_page_cuts_a_huge_event_and_stops_at_its_byte_budget(
    server: InspectorServer,
) -> None:
    size, page = fetch(server, "events", "events", **{"from": 1})
    assert size < BOUND
    first = page["events"][0]
    assert first["cut"] == {"data.message.content": len(HUGE)}
    content = first["data"]["message"]["content"]
    assert len(content) == index.EVENT_TEXT and more(content, len(HUGE)) == 6_000_000 - 19_999
    # 100 events of 100k characters are 10 MB: the page stops, and says where to go on.
    seqs = [e["seq"] for e in page["events"]]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) < 101
    assert page["next_from"] == len(seqs) + 1
    while page["next_from"] is not None:
        size, page = fetch(server, "events", "events", **{"from": page["next_from"]})
        assert size < index.EVENTS_BYTES + index.EVENT_BYTES
        seqs += [e["seq"] for e in page["events"]]
        for e in page["events"]:
            if e["type"] == "settings_changed":
                assert e["cut"]["data.value"] == len(SETTING)
                continue
            assert e["cut"] == {"data.message.content": len(MESSAGE)}
            assert e["data"]["message"]["content"] == MESSAGE[: index.EVENT_TEXT - 1] + "…"
    assert seqs == list(range(1, 103))
    # The huge one, whole.
    _, whole = fetch(server, "events", "events", **{"from": 1, "to": 1, "whole": 1})
    assert whole["events"][0]["data"]["message"]["content"] == HUGE


def test_a_line_of_a_huge_setting_is_cut_in_the_tail_and_the_state(
    server: InspectorServer,
) -> None:
    _, page = fetch(server, "events", "timeline")
    line = page["tail"]["events"][-1]
    assert (line["seq"], line["type"]) == (102, "settings_changed")
    whole = f"setting persona = {SETTING!r}"
    assert line["text"] == whole[: index.PREVIEW - 1] + "…"
    assert line["cut"] == {"text": len(whole)}
    assert "cut" not in page["tail"]["events"][0]  # a short line is as it was
    _, s = fetch(server, "events", "state", seq=102)
    assert s["event"]["text"] == line["text"] and s["cut"]["event.text"] == len(whole)
    assert s["cut"]["settings.persona"] == len(SETTING)


def test_clip_cuts_texts_lists_and_depth_and_says_where() -> None:
    assert (index.ANSWER_BOUND, index.PAGE_BYTES) == (BOUND, PAGE)
    value = {
        "short": "ok",
        "long": "a" * 1_000,
        "k" * 100: 1,
        "many": list(range(100_000)),
        "after": "x",
    }
    shown, cut = index.clip(value, text=10, budget=5_000)
    assert shown["short"] == "ok" and shown["long"] == "a" * 9 + "…" and cut["long"] == 1_000
    assert shown["k" * 9 + "…"] == 1  # a long key is cut as a text is
    assert cut["k" * 9 + "… (key)"] == 100
    assert cut["many"] == 100_000 and 0 < len(shown["many"]) < 5_000
    assert shown["many"] == list(range(len(shown["many"])))
    assert shown["after"] == "x"  # breadth first: the long list does not crowd it out
    assert len(msgspec.json.encode([shown, cut])) < 5_000 + 100
    # Nesting past the depth is shown empty, its size in cut.
    deep: Any = "bottom"
    for _ in range(30):
        deep = [deep, 1]
    shown, cut = index.clip({"deep": deep}, depth=8)
    level = shown["deep"]
    for _ in range(7):
        level, one = level
        assert one == 1
    assert level == [] and cut == {"deep" + "[0]" * 7: 2}
    # Empty containers spend bytes too: a million of them do not pass the budget.
    shown, cut = index.clip([[] for _ in range(1_000_000)], budget=1_000)
    assert 0 < len(shown) <= 500 and cut == {"": 1_000_000}
    # A value of a billion entries (the same list many times) costs the budget, no more.
    inner = list(range(30_000))
    shown, cut = index.clip({"x": [inner] * 30_000, "y": [[[1]]] * 100_000}, budget=64_000)
    assert len(msgspec.json.encode([shown, cut])) < 64_000 + 1_000
    assert cut["x"] == 30_000 and len(cut) == 101 and cut["…"] > 0
    # Text that is not valid Unicode comes out valid.
    text, cut = index.clip("\ud800 lone")
    assert text == "\ufffd lone" and cut == {}


def test_clip_keeps_every_key_and_counts_what_numbers_and_bytes_spend() -> None:
    """Keys longer than 40 characters stay whole (up to ``text``), and keys that come out
    the same (a long shared start, ``1`` and ``"1"``) are told apart, none lost; numbers
    spend their JSON's bytes, bytes are shown as base64 text and cut as a text is."""
    a, b = "memory/user-profile-summary-injector", "memory/user-profile-summary-refresher"
    shown, cut = index.clip({"injectors": {a: 10, b: 20}})
    assert shown == {"injectors": {a: 10, b: 20}} and cut == {}
    shown, cut = index.clip({"k" * 41: 1, "k" * 42: 2, 1: "int", "1": "str"}, text=10)
    assert sorted(shown.values(), key=str) == sorted([1, 2, "int", "str"], key=str)
    assert set(shown) == {"k" * 9 + "…", "k" * 9 + "… #2", "1", "1 #2"}
    assert cut == {"k" * 9 + "… (key)": 41, "k" * 9 + "… #2 (key)": 42}
    # 100,000 big numbers: the budget is spent by their bytes, not 8 a number.
    for number in (2**62, 1.2345678901234567e-300):
        shown, cut = index.clip([number] * 100_000, budget=64_000)
        assert 60_000 < len(msgspec.json.encode(shown)) <= 64_000 + 100
        assert cut == {"": 100_000}
    shown, cut = index.clip({"n": 10**100})  # past 32 JSON bytes: its digits, as text
    assert shown == {"n": "1" + "0" * 100} and cut == {}
    shown, cut = index.clip({"blob": b"\x00" * 3_000_000, "small": b"ab"})
    assert shown["small"] == "YWI=" and shown["blob"] == "A" * (index.PREVIEW - 1) + "…"
    assert cut == {"blob": 4_000_000}  # base64's length
    assert len(msgspec.json.encode(shown)) < 2_000


def test_a_long_usage_series_keeps_each_stretchs_least_most_and_first_trim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``USAGE_POINTS`` recorded calls, each stretch of the series keeps its points
    of least and most ``used`` and its first trimmed one (numbered by call, in order);
    below it, every point."""
    monkeypatch.setattr(index, "USAGE_POINTS", 30)  # 10 stretches
    sid = "u"
    used = [(i * 7919) % 1000 for i in range(1_000)]  # up and down, no order
    trimmed = {i for i in range(1_000) if i % 137 == 5}
    events = [
        UsageRecorded(
            session_id=sid,
            seq=i + 1,
            usage=TokenUsage(session_id=sid, used=u, token_budget=900, trimmed=i in trimmed),
        )
        for i, u in enumerate(used)
    ]
    ix = index.SessionIndex(sid)
    ix.feed(events)
    series = ix.usage_series()
    assert series["points_total"] == 1_000
    calls = series["index"]
    assert calls == sorted(set(calls)) and series["points"] == len(calls) <= 30
    assert series["used"] == [used[c - 1] for c in calls]
    assert series["seq"] == calls  # seq i + 1 is call i + 1 here
    for k in range(10):
        stretch = range(k * 100, (k + 1) * 100)
        mine = {c - 1 for c in calls if c - 1 in stretch}
        # The first of the least and of the most (min and max keep the first of ties).
        want = {min(stretch, key=lambda i: used[i]), max(stretch, key=lambda i: used[i])}
        first_trim = next((i for i in stretch if i in trimmed), None)
        if first_trim is not None:
            want.add(first_trim)
        assert mine == want, k
    monkeypatch.setattr(index, "USAGE_POINTS", 1_000)
    whole = ix.usage_series()
    assert whole["points"] == whole["points_total"] == 1_000
    assert whole["index"] == list(range(1, 1_001)) and whole["used"] == used


def _many_sessions(path: Any, n: int, long_id: str) -> list[str]:
    names = [f"room:{i:05d}" for i in range(n)] + [long_id]
    with SqliteEventStore(path) as store:
        for sid in names:
            writer = SampleWriter(store, sid, FixedClock(1_767_225_600_000, step_ms=1))
            b = writer.batch()
            b.add(MessageSaved(message=ChatMessage(id="m", role="user", content="hi")))
            writer.commit(b)
    return names


def test_the_session_list_is_paged_and_cuts_a_huge_id(tmp_path: Any) -> None:
    """1,200 sessions and one whose id is 5,000 characters: the list comes a page at a
    time (``total``, ``next_offset``), each page within its limit; the long id is cut,
    its length in ``cut``, and its session still opens by its whole id."""
    from aalis_agent.inspector import server as inspector_server

    long_id = "x" * 5_000
    names = _many_sessions(tmp_path / "many.db", 1_200, long_id)
    srv = make_server(tmp_path / "many.db")
    srv.start()
    try:
        seen: list[dict[str, Any]] = []
        offset: int | None = 0
        pages = 0
        while offset is not None:
            status, data = get(srv, f"/api/sessions?offset={offset}")
            assert status == 200 and data["total"] == len(names)
            assert len(data["sessions"]) <= inspector_server.SESSIONS_PAGE
            seen += data["sessions"]
            offset = data["next_offset"]
            pages += 1
        assert pages == 3 and len(seen) == len(names)
        by_cut = [s for s in seen if "cut" in s]
        assert len(by_cut) == 1 and by_cut[0]["cut"] == {"session_id": 5_000}
        assert len(by_cut[0]["session_id"]) == inspector_server.SESSION_ID_SHOWN
        shown = {s["session_id"] for s in seen if "cut" not in s}
        assert shown == set(names) - {long_id}
        assert get(srv, "/api/sessions?limit=7&offset=1195")[1]["sessions"][0]["events"] == 1
        status, timeline = get(srv, f"/api/session/timeline?id={long_id}")
        assert status == 200 and timeline["session_id"] == long_id
    finally:
        srv.stop()


def test_a_page_of_sessions_is_read_without_listing_them_all(tmp_path: Any) -> None:
    """The session list asks the store for one page (``session_page``): it never loads
    every name to cut a page from them (a million sessions took 3 s a page). A store
    without it is paged from its whole listing, with the same answer."""
    from aalis_agent.inspector.server import Inspector

    names = _many_sessions(tmp_path / "many.db", 30, "last")
    with SqliteEventStore(tmp_path / "many.db", read_only=True) as store:
        ins = Inspector(store)
        whole = ins.sessions(0, 100)
        assert whole["total"] == len(names) == len(whole["sessions"])

        def listed() -> list[str]:
            raise AssertionError("every session listed for one page")

        store.sessions = listed  # type: ignore[method-assign]
        store.open_sessions = listed  # type: ignore[method-assign]
        page = ins.sessions(10, 7)
        assert page["sessions"] == whole["sessions"][10:17]
        assert (page["total"], page["offset"], page["next_offset"]) == (len(names), 10, 17)
        assert ins.sessions(99, 7)["offset"] == len(names)  # past the end: at the end

    class Plain:  # a store of another kind: no session_page
        def __init__(self, inner: SqliteEventStore) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "session_page":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with SqliteEventStore(tmp_path / "many.db", read_only=True) as store:
        assert Inspector(Plain(store)).sessions(10, 7) == page  # type: ignore[arg-type]


def test_a_value_json_has_no_form_for_is_answered_as_its_repr(tmp_path: Any) -> None:
    """A setting whose value is a MessagePack extension (a hand-written row): every answer
    shows it as its repr instead of failing with 500."""
    db = tmp_path / "ext.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "s", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        b.add(SettingsChanged(key="x", value=msgspec.msgpack.Ext(5, b"abc")))
        writer.commit(b)
    srv = make_server(db)
    srv.start()
    try:
        status, page = get(srv, "/api/session/events?id=s&from=1&to=1")
        assert status == 200
        assert page["events"][0]["data"]["value"] == "msgpack.Ext(code=5, data=b'abc')"
        status, whole = get(srv, "/api/session/events?id=s&from=1&to=1&whole=1")
        assert status == 200 and whole["events"][0]["data"]["value"].startswith("msgpack.Ext")
        for what in ("state?seq=1&", "timeline?", "usage?"):
            assert get(srv, f"/api/session/{what}id=s")[0] == 200, what
    finally:
        srv.stop()


def test_the_rows_that_do_not_decode_are_listed_first_100_each_reason_cut(
    tmp_path: Any,
) -> None:
    """Every undecodable row was listed, each with its whole reason, in every timeline
    page: 100,000 broken rows made an 8.8 MB page, and ten rows whose type tag was a
    megabyte (the decoder quotes it in its reason) a 10 MB one."""
    import sqlite3

    db = tmp_path / "broken.db"
    with SqliteEventStore(db) as store:
        writer = _writer(store, "s")
        b = writer.batch()
        b.add(TurnOpened(turn_id="t", input_ids=()))
        writer.commit(b)
    conn = sqlite3.connect(db)
    with conn:
        sid, pos = conn.execute("SELECT sid, max(position) FROM log").fetchone()
        tag = msgspec.msgpack.encode({"type": "y" * 1_000_000})
        rows = [(n, tag if n < 12 else b"\xc1") for n in range(2, 3_002)]
        conn.executemany(
            "INSERT INTO log (sid, seq, position, data) VALUES (?, ?, ?, ?)",
            ((sid, n, pos + n, data) for n, data in rows),
        )
    conn.close()
    srv = make_server(db)
    srv.start()
    try:
        size, page = fetch(srv, "s", "timeline")
        summary = page["summary"]
        shown = summary["corrupt"]
        assert [c["seq"] for c in shown] == list(range(2, 2 + index.CORRUPT_SHOWN))
        assert summary["corrupt_omitted"] == 3_000 - index.CORRUPT_SHOWN
        assert all(len(c["reason"]) <= index.PREVIEW for c in shown)
        assert shown[0]["reason"].endswith("…") and "yyy" in shown[0]["reason"]
        assert size < 100_000
    finally:
        srv.stop()
