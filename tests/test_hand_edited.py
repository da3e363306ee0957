"""A database edited by hand in ways no write makes: a row's seq turned into text, a
session's name into bytes. Each is reported (the row as corrupt, the name cleaned), and
the store, ``replay`` and the inspector go on with the rest instead of failing whole."""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path

from aalis_agent.cli.demo import DEMO_SESSION, run_demo
from aalis_agent.events import SqliteEventStore
from aalis_agent.inspector.server import make_server

from tests.harness import run_cli
from tests.test_inspector import get


def _demo(tmp_path: Path, edit: str) -> Path:
    db = tmp_path / "demo.db"
    run_demo(str(db), out=io.StringIO())
    with sqlite3.connect(db) as conn:
        conn.execute(edit)
    return db


def test_a_seq_edited_into_text_reads_as_one_corrupt_row(tmp_path: Path) -> None:
    db = _demo(tmp_path, "UPDATE log SET seq = 'abc' WHERE seq = (SELECT max(seq) FROM log)")
    with SqliteEventStore(db, read_only=True) as store:
        bad: list[object] = []
        events = store.read(DEMO_SESSION, on_corrupt=bad.append)
        assert [b.reason for b in bad] == ["a row whose seq is 'abc', not a number"]  # type: ignore[attr-defined]
        assert events and store.last_seq(DEMO_SESSION) == events[-1].seq
        assert store.count() == events[-1].seq
    result = run_cli("replay", str(db))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "a row whose seq is 'abc', not a number" in result.stderr
    server = make_server(db)
    server.start()
    try:
        status, sessions = get(server, "/api/sessions")
        assert status == 200 and [s["session_id"] for s in sessions["sessions"]] == [DEMO_SESSION]
    finally:
        server.stop()


def test_a_session_name_edited_into_bytes_is_listed_and_replayed_cleaned(tmp_path: Path) -> None:
    db = _demo(tmp_path, f"UPDATE sessions SET name = x'ff00fe' WHERE name = '{DEMO_SESSION}'")
    result = run_cli("replay", str(db), "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr  # its rows do not decode
    assert all(json.loads(line) for line in result.stdout.splitlines())
    server = make_server(db)
    server.start()
    try:
        status, sessions = get(server, "/api/sessions")
        assert status == 200
        assert [s["session_id"] for s in sessions["sessions"]] == ["\ufffd\x00\ufffd"]
    finally:
        server.stop()
