"""``aalis-agent inspect``: the JSON endpoints over a log the runtime wrote, checked
against the log itself (its events and the projections' fold)."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from aalis_agent.cli.demo import run_demo
from aalis_agent.events import (
    FixedClock,
    InputJoined,
    ModelCallStarted,
    SqliteEventStore,
    StopMarkerSaved,
    StopRequested,
    StoreError,
    TokenBreakdown,
    TokenUsage,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
    UsageRecorded,
)
from aalis_agent.inspector import index as inspector_index
from aalis_agent.inspector.server import InspectorServer, make_server
from aalis_agent.projections import project
from aalis_agent.projections.history import history_window
from aalis_agent.testing.sample import SampleWriter, synthetic_turn
from aalis_agent.timeline import state_json

SESSION = "demo:room-1"


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log written by live turns through the real runtime (the demo's conversation)."""
    path = tmp_path_factory.mktemp("inspect") / "demo.db"
    run_demo(str(path), out=io.StringIO())
    return path


@pytest.fixture(scope="module")
def server(demo_db: Path) -> Iterator[InspectorServer]:
    srv = make_server(demo_db)
    srv.start()
    yield srv
    srv.stop()


def get(srv: InspectorServer, path: str, host: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(srv.url.rstrip("/") + path)
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=10) as res:
            body = res.read()
            kind = res.headers["Content-Type"]
            return res.status, json.loads(body) if "json" in kind else body.decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def api(srv: InspectorServer, what: str, **params: Any) -> Any:
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
    status, data = get(srv, f"/api/sessions/{quote(SESSION, safe='')}/{what}?{query}")
    assert status == 200, data
    return data


def log_of(db: Path, session: str = SESSION) -> list[Any]:
    with SqliteEventStore(db, read_only=True) as store:
        return store.read(session)


def test_binds_loopback_on_a_random_port_and_serves_the_page(server: InspectorServer) -> None:
    host, port = server.server_address[:2]
    assert host == "127.0.0.1" and port > 0
    assert server.url == f"http://127.0.0.1:{port}/"
    status, page = get(server, "/")
    assert status == 200 and "/static/uPlot.iife.min.js" in page and "/static/app.js" in page
    for name in ("app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css"):
        status, _ = get(server, f"/static/{name}")
        assert status == 200, name
    assert get(server, "/static/../server.py")[0] == 404
    assert get(server, "/static/index.py")[0] == 404


def test_refuses_requests_not_addressed_to_a_loopback_name(server: InspectorServer) -> None:
    status, data = get(server, "/api/sessions", host=f"attacker.example:{server.server_address[1]}")
    assert status == 403 and "loopback" in data["error"]
    assert get(server, "/api/sessions", host=f"localhost:{server.server_address[1]}")[0] == 200


def test_sessions_list_the_log(server: InspectorServer, demo_db: Path) -> None:
    status, data = get(server, "/api/sessions")
    assert status == 200
    assert data == {
        "sessions": [{"session_id": SESSION, "events": 56, "open": False}],
        "total": 1,
        "offset": 0,
        "next_offset": None,
    }
    assert len(log_of(demo_db)) == 56


def test_timeline_turns_match_the_log(server: InspectorServer, demo_db: Path) -> None:
    events = log_of(demo_db)
    page = api(server, "timeline")
    assert page["turns_total"] == 4 and page["offset"] == 0 and page["last_seq"] == 56
    assert page["summary"]["events"] == 56 and page["summary"]["corrupt"] == []
    turns = page["turns"]
    opened = [e for e in events if isinstance(e, TurnOpened)]
    recorded = {e.turn_id: e for e in events if isinstance(e, TurnRecorded)}
    assert [t["turn_id"] for t in turns] == [e.turn_id for e in opened]
    # The spans partition the log.
    assert turns[0]["first_seq"] == 1
    for before, after in itertools.pairwise(turns):
        assert after["first_seq"] == before["last_seq"] + 1
    assert turns[-1]["last_seq"] == 56 and page["tail"] is None
    for t in turns:
        tid = t["turn_id"]
        rec = recorded[tid]
        assert (t["outcome"], t["reason"], t["duration_ms"], t["recorded_seq"]) == (
            rec.outcome,
            rec.reason,
            rec.duration_ms,
            rec.seq,
        )
        joined = [e for e in events if isinstance(e, InputJoined) and e.turn_id == tid]
        assert [(i["input_id"], i["entry"], i["seq"]) for i in t["inputs"]] == [
            (e.input_id, e.entry, e.seq) for e in joined
        ]
        calls = [e for e in events if isinstance(e, ModelCallStarted) and e.turn_id == tid]
        assert [(c["index"], c["started_seq"]) for c in t["model_calls"]] == [
            (e.index, e.seq) for e in calls
        ]
        tools = [e for e in events if isinstance(e, ToolStarted) and e.turn_id == tid]
        assert [(c["call_id"], c["name"]) for c in t["tool_calls"]] == [
            (e.call_id, e.name) for e in tools
        ]
    t1, t2, t3, t4 = turns
    assert [i["entry"] for i in t1["inputs"]] == ["opened", "joined"]
    assert t1["inputs"][1]["sender"] == "Bob" and t1["inputs"][1]["content"] == "顺便看看杭州"
    assert t2["source"] == "schedule" and t2["from_queue"]
    assert "参数不是合法的 JSON 对象" in t2["tool_calls"][0]["error"]
    stop = next(e for e in events if isinstance(e, StopRequested))
    marker = next(e for e in events if isinstance(e, StopMarkerSaved))
    assert t3["stops"] == [{"seq": stop.seq, "by": "10001", "reason": "stop"}]
    assert {"seq": marker.seq, "kind": "turn-stopped", "content": marker.message.content} in t3[
        "markers"
    ]
    assert t3["model_calls"][0]["status"] == "aborted" and t3["replies"] == []
    assert t4["replies"] and t4["outcome"] == "replied"
    usage = [e for e in events if isinstance(e, UsageRecorded)]
    shown = [c["usage"]["seq"] for t in turns for c in t["model_calls"] if c["usage"]]
    assert shown == [e.seq for e in usage]


def test_timeline_pages_by_turns(server: InspectorServer) -> None:
    first = api(server, "timeline", offset=0, limit=3)
    assert [t["ordinal"] for t in first["turns"]] == [0, 1, 2] and first["tail"] is None
    last = api(server, "timeline", offset=-2, limit=3)
    assert last["offset"] == 2 and [t["turn_id"] for t in last["turns"]] == ["turn-3", "turn-4"]
    beyond = api(server, "timeline", offset=10)
    assert beyond["offset"] == 4 and beyond["turns"] == []


def test_request_is_the_call_as_recorded(server: InspectorServer, demo_db: Path) -> None:
    events = log_of(demo_db)
    started = next(
        e
        for e in events
        if isinstance(e, ModelCallStarted) and e.turn_id == "turn-1" and e.index == 2
    )
    usage = next(
        e for e in events if isinstance(e, UsageRecorded) and e.seq > started.seq
    )  # recorded after the call ends
    r = api(server, "request", turn="turn-1", index=2)
    assert (r["started_seq"], r["model"], r["status"]) == (started.seq, started.model, "ok")
    assert r["usage_seq"] == usage.seq
    assert r["usage"] == json.loads(msgspec.json.encode(usage.usage))
    view = project(e for e in events if e.seq <= started.seq)
    window = history_window(view.history, r["history_limit"])
    assert r["history"] == json.loads(msgspec.json.encode(list(window)))
    # The joined input is in the second call's history, with the first call's tool round.
    assert [m["role"] for m in r["history"]] == ["user", "assistant", "tool", "user"]
    assert r["history"][-1]["content"] == "顺便看看杭州"
    # What is not there is named (it said "no such record in this session" for each).
    status, data = get(server, f"/api/sessions/{quote(SESSION, safe='')}/request?turn=x&index=1")
    assert (status, data["error"]) == (404, "no turn 'x' in this session")
    status, data = get(
        server, f"/api/sessions/{quote(SESSION, safe='')}/request?turn=turn-1&index=3"
    )
    assert (status, data["error"]) == (
        404,
        "turn 'turn-1' has no model call 3 (calls count from 1)",
    )
    status, data = get(server, f"/api/sessions/{quote(SESSION, safe='')}/request?turn=turn-1")
    assert status == 400 and "index" in data["error"]
    # By its place in the timeline (as the page asks): the same answer.
    assert api(server, "request", ordinal=0, index=2) == r
    for bad in (4, -1):
        status, data = get(
            server, f"/api/sessions/{quote(SESSION, safe='')}/request?ordinal={bad}&index=1"
        )
        assert status == 404, bad
        assert data["error"] == (
            f"no turn at ordinal {bad}: the session has 4 turn(s) (ordinals 0 to 3)"
        )
    status, data = get(server, f"/api/sessions/{quote(SESSION, safe='')}/request?index=1")
    assert status == 400 and "'turn' (or 'ordinal')" in data["error"]


def test_usage_series_is_every_recorded_usage(server: InspectorServer, demo_db: Path) -> None:
    usage = [e for e in log_of(demo_db) if isinstance(e, UsageRecorded)]
    u = api(server, "usage")
    assert u["points"] == len(usage) == 5
    assert u["seq"] == [e.seq for e in usage]
    assert u["used"] == [e.usage.used for e in usage]
    assert u["token_budget"] == [e.usage.token_budget for e in usage]
    assert u["trimmed"] == [e.usage.trimmed for e in usage]
    for name, values in u["parts"].items():
        assert values == [getattr(e.usage.breakdown, name) for e in usage], name


def test_state_at_every_seq_is_the_fold_of_the_prefix(
    server: InspectorServer, demo_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inspector_index, "CHECKPOINT_EVERY", 7)  # cross checkpoints
    events = log_of(demo_db)
    for seq in [*range(1, 57), 30, 3]:  # and back again, from the checkpoints
        s = api(server, "state", seq=seq)
        expected = state_json(project(e for e in events if e.seq <= seq))
        assert {k: s[k] for k in expected} == json.loads(json.dumps(expected)), seq
        assert s["event"]["seq"] == seq
    s = api(server, "state", seq=10)
    assert s["pending"] == ["in-2"] and s["running_turn"]["turn_id"] == "turn-1"
    assert s["event"]["type"] == "input_held" and s["span"]["turn_id"] == "turn-1"
    assert api(server, "state", seq=999)["seq"] == 56


def test_events_page(server: InspectorServer, demo_db: Path) -> None:
    events = log_of(demo_db)
    page = api(server, "events", **{"from": 5, "to": 9})
    assert [e["seq"] for e in page["events"]] == [5, 6, 7, 8, 9]
    assert page["events"][0]["data"] == {
        "type": "model_call_started",
        **msgspec.to_builtins(events[4]),
    }


def test_every_route_docs_list_answers(server: InspectorServer) -> None:
    """docs/debugging.md lists the JSON API's routes for scripts: each answers, with the
    session id and a turn id of the demo's log put in, here and in the query form."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "debugging.md").read_text()
    routes = re.findall(r"^\| `(/api/[^`]+)` \|", page, re.M)
    assert len(routes) == 6, routes
    status, timeline = get(server, f"/api/sessions/{quote(SESSION, safe='')}/timeline")
    assert status == 200
    turn_id = timeline["turns"][0]["turn_id"]
    for route in routes:
        path = route.replace("<id>", quote(SESSION, safe="")).replace("<turn id>", turn_id)
        status, data = get(server, path)
        assert status == 200 and isinstance(data, dict), (route, status, data)
        if "/api/sessions/" in route:  # each also in the query form the page uses
            what, _, query = path.split("/", 4)[4].partition("?")
            query_form = f"/api/session/{what}?id={quote(SESSION, safe='')}"
            status, again = get(server, query_form + (f"&{query}" if query else ""))
            assert status == 200 and again == data, route


def test_unknown_session_and_route_are_404(server: InspectorServer) -> None:
    assert get(server, "/api/sessions/nope/timeline")[0] == 404
    assert get(server, f"/api/sessions/{quote(SESSION, safe='')}/nothing")[0] == 404
    assert get(server, "/api/other")[0] == 404
    assert get(server, f"/api/sessions/{quote(SESSION, safe='')}/state?seq=x")[0] == 400


def test_the_session_id_in_the_query_answers_as_in_the_path(server: InspectorServer) -> None:
    """``/api/session/<what>?id=...`` (what the page asks) answers as the path form."""
    sid = quote(SESSION, safe="")
    for what, query in (
        ("timeline", "&offset=0&limit=5"),
        ("events", "&from=3&to=6"),
        ("usage", ""),
        ("state", "&seq=10"),
        ("request", "&turn=turn-1&index=1"),
    ):
        by_path = get(server, f"/api/sessions/{sid}/{what}?{query.lstrip('&')}")
        by_query = get(server, f"/api/session/{what}?id={sid}{query}")
        assert by_query == by_path and by_path[0] == 200, what
    assert get(server, "/api/session/timeline")[0] == 400  # no id
    assert get(server, "/api/session/timeline?id=nope")[0] == 404
    assert get(server, f"/api/session/nothing?id={sid}")[0] == 404


def _usage(sid: str, turn: str, used: int, trimmed: bool) -> UsageRecorded:
    return UsageRecorded(
        usage=TokenUsage(
            session_id=sid,
            turn_id=turn,
            context_window=8000,
            token_budget=6000,
            used=used,
            trimmed=trimmed,
            breakdown=TokenBreakdown(system=100, history=used - 300, tool_defs=200),
        )
    )


def test_pages_a_long_log_sees_appends_and_reads_only(tmp_path: Path) -> None:
    db = tmp_path / "long.db"
    store = SqliteEventStore(db)
    writer = SampleWriter(store, "s:long", FixedClock(1_767_225_600_000, step_ms=10))
    for n in range(1, 121):
        b = writer.batch()
        synthetic_turn(b, n)
        writer.commit(b)
    srv = make_server(db)
    srv.start()
    try:
        base = f"/api/sessions/{quote('s:long', safe='')}"
        status, page = get(srv, f"{base}/timeline?offset=100&limit=50")
        assert status == 200 and page["turns_total"] == 120
        assert [t["turn_id"] for t in page["turns"]] == [f"turn-{n}" for n in range(101, 121)]
        assert page["turns"][0]["first_seq"] == 100 * 15 + 1
        # A live writer appends a turn cut short, an input after it, and usage with a trim.
        b = writer.batch()
        b.add(TurnOpened(turn_id="turn-x", input_ids=()))
        b.add(ModelCallStarted(turn_id="turn-x", index=1))
        b.add(_usage("s:long", "turn-x", 7000, True))
        writer.commit(b)
        status, page = get(srv, f"{base}/timeline?offset=-1")
        assert page["turns_total"] == 121 and page["last_seq"] == 1803
        last = page["turns"][0]
        assert last["turn_id"] == "turn-x" and last["running"] and last["outcome"] is None
        assert last["model_calls"][0]["usage"]["trimmed"] is True
        status, u = get(srv, f"{base}/usage")
        assert u["points"] == 121 and u["trimmed"][-1] is True and u["used"][-1] == 7000
        b = writer.batch()
        b.add(TurnRecorded(turn_id="turn-x", outcome="error", reason="model"))
        synthetic_turn(b, 999)
        b.events.pop()  # the second turn is cut: no record
        writer.commit(b)
        status, page = get(srv, f"{base}/timeline?offset=-2")
        x, running = page["turns"]
        assert x["outcome"] == "error" and x["reason"] == "model"
        assert running["running"] and not running["cut_off"] and running["outcome"] is None
    finally:
        srv.stop()
        store.close()
    # Nothing was written by the inspector: the read-only store refuses writes.
    with SqliteEventStore(db, read_only=True) as ro, pytest.raises(StoreError, match="read-only"):
        ro.append("s:long", [TurnOpened(turn_id="t", input_ids=())], ro.last_seq("s:long"))


def test_cli_prints_the_url_and_serves(demo_db: Path) -> None:
    code = (
        "import argparse, sys\n"
        "from aalis_agent.inspector import cli\n"
        "p = argparse.ArgumentParser()\n"
        "cli.add_arguments(p)\n"
        "sys.exit(cli.run(p.parse_args(sys.argv[1:])))\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(demo_db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "read-only" in line and "http://127.0.0.1:" in line
        url = line.split(" at ", 1)[1].strip()
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(url + "api/sessions", timeout=5) as res:
                    assert json.loads(res.read())["sessions"][0]["session_id"] == SESSION
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_cli_reports_a_missing_database(tmp_path: Path) -> None:
    import argparse

    from aalis_agent.inspector import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(StoreError, match="no event database"):
        cli.run(parser.parse_args([str(tmp_path / "none.db")]))
    assert cli.run(parser.parse_args([str(tmp_path / "none.db"), "--port", "70000"])) == 2


def _raw(srv: InspectorServer, request: bytes) -> bytes:
    import socket

    with socket.create_connection(srv.server_address, timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    return answer


def test_a_second_host_header_or_another_host_in_the_target_is_refused(
    server: InspectorServer,
) -> None:
    here = f"127.0.0.1:{server.server_address[1]}".encode()
    two_hosts = b"GET /api/sessions HTTP/1.1\r\nHost: " + here + b"\r\nHost: evil\r\n\r\n"
    assert _raw(server, two_hosts).startswith(b"HTTP/1.1 403")
    absolute = b"GET http://evil.com/api/sessions HTTP/1.1\r\nHost: " + here + b"\r\n\r\n"
    assert _raw(server, absolute).startswith(b"HTTP/1.1 403")
    ours = b"GET http://" + here + b"/api/sessions HTTP/1.1\r\nHost: " + here + b"\r\n\r\n"
    assert _raw(server, ours).startswith(b"HTTP/1.1 200")


def test_methods_other_than_get_and_head_get_405_naming_them(server: InspectorServer) -> None:
    here = f"127.0.0.1:{server.server_address[1]}".encode()
    answer = _raw(server, b"POST /api/sessions HTTP/1.1\r\nHost: " + here + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405")
    assert b"\r\nAllow: GET, HEAD\r\n" in answer


def test_on_port_80_a_host_without_its_port_is_ours() -> None:
    """Browsers leave the default port out of the Host header: ``--port 80`` must still
    serve its own page (it answered 403)."""
    from email.message import Message
    from types import SimpleNamespace

    from aalis_agent.inspector.server import _Handler

    def host_ok(host: str, port: int) -> bool:
        headers = Message()
        headers["Host"] = host
        fake = SimpleNamespace(
            headers=headers, server=SimpleNamespace(server_address=("127.0.0.1", port)), path="/"
        )
        return bool(_Handler._host_ok(fake))  # type: ignore[arg-type]

    assert host_ok("127.0.0.1", 80) and host_ok("localhost", 80) and host_ok("127.0.0.1:80", 80)
    assert not host_ok("127.0.0.1", 8080) and not host_ok("evil.example", 80)


def test_a_bad_number_is_named_without_being_echoed_whole(server: InspectorServer) -> None:
    status, data = get(
        server, f"/api/sessions/{quote(SESSION, safe='')}/timeline?limit={'9' * 5000}x"
    )
    assert status == 400 and len(data["error"]) < 200
    assert data["error"].startswith("parameter 'limit' must be an integer, got '9999")


def test_the_events_after_the_last_turn_are_the_latest_500_and_a_count(tmp_path: Path) -> None:
    """A session without turns had its whole log on every timeline page (a 100k-event
    one made a 13.6 MB page); the rest is left to the events API, and counted."""
    from aalis_agent.events import FixedClock, TokenUsage, UsageRecorded

    db = tmp_path / "no-turns.db"
    with SqliteEventStore(db) as store:
        writer = SampleWriter(store, "u", FixedClock(1_767_225_600_000, step_ms=1))
        b = writer.batch()
        for n in range(1_200):
            b.add(UsageRecorded(usage=TokenUsage(session_id="u", used=n, token_budget=10)))
        writer.commit(b)
    srv = make_server(db)
    srv.start()
    try:
        status, page = get(srv, "/api/sessions/u/timeline")
        assert status == 200
        tail = page["tail"]
        assert (tail["first_seq"], tail["last_seq"], tail["omitted"]) == (1, 1_200, 700)
        assert [e["seq"] for e in tail["events"]] == list(range(701, 1_201))
    finally:
        srv.stop()


def test_a_number_past_what_the_database_holds_is_a_400_naming_it(
    server: InspectorServer,
) -> None:
    """An offset of 20 digits reached SQLite as it was and came back as a 500
    (``OverflowError: Python int too large to convert to SQLite INTEGER``)."""
    big = "9" * 20
    sid = quote(SESSION, safe="")
    for path, name in (
        (f"/api/sessions?offset={big}", "offset"),
        (f"/api/sessions?limit=-{big}", "limit"),
        (f"/api/sessions/{sid}/timeline?offset=-{big}", "offset"),
        (f"/api/sessions/{sid}/state?seq={big}", "seq"),
        (f"/api/sessions/{sid}/events?from=1&to={big}", "to"),
        (f"/api/sessions/{sid}/request?ordinal={big}&index=1", "ordinal"),
    ):
        status, data = get(server, path)
        assert status == 400, (path, data)
        assert data["error"].startswith(f"parameter {name!r} is out of range"), data
    assert get(server, f"/api/sessions?offset={2**63 - 1}")[0] == 200


def _until_closed(srv: InspectorServer, request: bytes) -> bytes:
    """Everything the server writes back on one connection, until it closes it."""
    import socket

    with socket.create_connection(srv.server_address, timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    return answer


def test_a_request_body_is_never_taken_for_the_next_request(server: InspectorServer) -> None:
    """A body is not read (nothing here takes one): the connection is closed after the
    answer. Kept open, the body's bytes were read as the next request and answered, a
    request with a Host header of its own inside a body a rebinding page may send."""
    here = f"127.0.0.1:{server.server_address[1]}".encode()
    inner = b"GET /api/sessions HTTP/1.1\r\nHost: " + here + b"\r\nConnection: close\r\n\r\n"
    for method in (b"POST", b"GET", b"PUT"):
        request = (
            method
            + b" /api/sessions HTTP/1.1\r\nHost: "
            + here
            + b"\r\nContent-Length: "
            + str(len(inner)).encode()
            + b"\r\n\r\n"
            + inner
        )
        answer = _until_closed(server, request)
        assert answer.count(b"HTTP/1.1 ") == 1, answer
        assert b"\r\nConnection: close\r\n" in answer
    chunked = b"POST / HTTP/1.1\r\nHost: " + here + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = _until_closed(server, chunked + b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1, answer


def test_the_api_answers_no_page_of_another_origin(server: InspectorServer) -> None:
    """A page of another site (or another port here) may send requests to the API: the
    browser keeps it from reading the answers, but the server did the work (a heavy fold
    on every request) and how long it took told whether a session exists. The API
    answers only its own page (and clients that are not browsers); the page itself may
    still be opened from a link anywhere."""
    here = f"127.0.0.1:{server.server_address[1]}"
    api_path = f"/api/session/state?id={quote(SESSION, safe='')}&seq=1"

    def status(path: str, *headers: str) -> int:
        extra = "".join(f"{h}\r\n" for h in headers)
        answer = _raw(server, f"GET {path} HTTP/1.1\r\nHost: {here}\r\n{extra}\r\n".encode())
        return int(answer.split(b" ", 2)[1])

    for refused in (
        ("Sec-Fetch-Site: cross-site",),
        ("Sec-Fetch-Site: same-site",),
        ("Origin: http://evil.example",),
        (f"Origin: http://localhost:{server.server_address[1] + 1}",),
        ("Origin: null",),
        ("Sec-Fetch-Site: same-origin", "Origin: http://evil.example"),
    ):
        assert status(api_path, *refused) == 403, refused
        assert status("/api/sessions", *refused) == 403, refused
    for allowed in (
        (),
        ("Sec-Fetch-Site: same-origin",),
        ("Sec-Fetch-Site: none",),
        (f"Origin: http://{here}", "Sec-Fetch-Site: same-origin"),
    ):
        assert status(api_path, *allowed) == 200, allowed
    assert status("/", "Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: navigate") == 200


def _inspect_then_signal(db: Path, signum: int) -> tuple[int, str]:
    """``aalis-agent inspect DB`` as a process, sent ``signum`` once it serves: its exit
    status and stderr."""
    with subprocess.Popen(
        [sys.executable, "-m", "aalis_agent.cli", "inspect", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # As from a terminal: a test run started in the background (CI) ignores SIGINT,
        # and so would the inspector (Python then leaves it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line
        url = line.split(" at ", 1)[1].strip()
        deadline = time.monotonic() + 10
        while True:  # answering: in its serving loop, past the lines printed before it
            try:
                with urllib.request.urlopen(url + "api/sessions", timeout=5):
                    break
            except urllib.error.URLError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        proc.send_signal(signum)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left hanging: the assertions fail instead
            proc.wait(10)
        return proc.returncode, proc.stderr.read()


def test_sigterm_ends_inspect_with_143_as_it_ends_the_other_commands(demo_db: Path) -> None:
    """A service manager's SIGTERM: the server is closed and the command leaves with 143
    and a 'terminated' line, as chat and replay do (it left with 0, as if stopped by
    hand)."""
    import signal

    status, err = _inspect_then_signal(demo_db, signal.SIGTERM)
    assert status == 143, err
    assert err == "\naalis-agent inspect: terminated\n"


def test_ctrl_c_ends_inspect_with_0(demo_db: Path) -> None:
    """Ctrl-C is how the page is stopped by hand ("Ctrl-C stops it"): status 0."""
    import signal

    status, err = _inspect_then_signal(demo_db, signal.SIGINT)
    assert status == 0, err
    assert "Traceback" not in err
