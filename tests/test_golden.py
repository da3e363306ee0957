"""Golden logs: every log an earlier version wrote must keep decoding and replaying."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from aalis_agent.events import SqliteEventStore, decode_json, encode_json
from aalis_agent.projections import history, project, turns

GOLDEN = Path(__file__).parent / "golden"
JSONL = sorted(GOLDEN.glob("v*_session.jsonl"))
DBS = sorted(GOLDEN.glob("v*_session.db"))


def test_golden_files_exist() -> None:
    assert JSONL, "no golden JSONL logs"
    assert DBS, "no golden SQLite logs"


@pytest.mark.parametrize("path", JSONL, ids=lambda p: p.name)
def test_jsonl_golden_decodes_and_reencodes_identically(path: Path) -> None:
    lines = path.read_bytes().splitlines()
    events = [decode_json(line, seq=n) for n, line in enumerate(lines, 1)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # Re-encoding gives the same bytes: no field was renamed or retyped.
    assert [encode_json(e) for e in events] == lines


@pytest.mark.parametrize("path", DBS, ids=lambda p: p.name)
def test_sqlite_golden_reads_and_matches_jsonl(path: Path, tmp_path: Path) -> None:
    copy = tmp_path / path.name  # opening writes -wal/-shm files: never beside the golden one
    shutil.copyfile(path, copy)
    with SqliteEventStore(copy) as store:
        (session,) = store.sessions()
        events = store.read(session)
    jsonl = GOLDEN / path.name.replace(".db", ".jsonl")
    assert [encode_json(e) for e in events] == jsonl.read_bytes().splitlines()


def test_v1_golden_replays_to_the_known_state() -> None:
    lines = (GOLDEN / "v1_session.jsonl").read_bytes().splitlines()
    events = [decode_json(line) for line in lines]
    # Just before the extra events (settings, release, compaction, clear, delete).
    at_demo_end = project(e for e in events if e.seq <= 56)
    finished = [turns.turn_info(t) for t in at_demo_end.turns.finished]
    assert [(t.turn_id, t.outcome) for t in finished] == [
        ("turn-1", "replied"),
        ("turn-2", "replied"),
        ("turn-3", "aborted"),
        ("turn-4", "replied"),
    ]
    assert finished[0].inputs == (("in-1", "opened"), ("in-2", "joined"))
    assert finished[2].stop_marker and finished[2].stopped_by == "10001"
    window = history.history_window(at_demo_end.history, 20)
    assert len(window) == 13
    assert window[10].kind == "turn-stopped"
    end = project(events)
    assert end.queue.generation == 1
    assert len(end.history.messages) == 0  # cleared, then deleted
    assert dict(end.settings) == {}  # deletion drops session settings
