"""Golden logs: every log an earlier version wrote must keep decoding and replaying.

``v<schema>_session.jsonl`` holds a schema version's events as JSON; each SQLite file
beside it holds the same events as one store format wrote them: ``v1_session.db`` store
format 2 (one row per event, row format 1), ``v1_session.store3.db`` store format 3 (one
row per batch, row format 2).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from aalis_agent.events import FixedClock, SqliteEventStore, codec, decode_json, encode_json
from aalis_agent.events.batch import Batch
from aalis_agent.events.schema import SessionEvent
from aalis_agent.projections import evolve, history, project, turns
from aalis_agent.testing.sample import synthetic_turn

GOLDEN = Path(__file__).parent / "golden"
JSONL = sorted(GOLDEN.glob("v*_session.jsonl"))
DBS = sorted(GOLDEN.glob("v*_session*.db"))


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
        assert [r.event for r in store.read_all()] == events
    jsonl = GOLDEN / f"{path.name.split('.')[0]}.jsonl"
    assert [encode_json(e) for e in events] == jsonl.read_bytes().splitlines()
    with SqliteEventStore(path, read_only=True) as reader:  # read in place, as it is
        assert reader.read(session) == events
        # A page of its sessions, as the inspector lists them, in any of the formats.
        assert reader.session_page(0, 10) == (1, [(session, len(events), True)])
        assert reader.session_page(1, 10) == (1, [])


def _rows(path: Path) -> list[bytes]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT data FROM events ORDER BY position")]
    finally:
        conn.close()


def test_old_rows_and_new_rows_decode_to_equal_events() -> None:
    old, new = GOLDEN / "v1_session.db", GOLDEN / "v1_session.store3.db"
    old_rows, new_rows = _rows(old), _rows(new)
    assert len(old_rows) == 64 and all(codec.row_header(r) is None for r in old_rows)
    assert len(new_rows) < 64 and all(r[0] == codec.ROW_FORMAT for r in new_rows)
    assert sum(len(r) for r in new_rows) * 3 < sum(len(r) for r in old_rows)
    with SqliteEventStore(old, read_only=True) as a, SqliteEventStore(new, read_only=True) as b:
        assert a.read("golden:room-1") == b.read("golden:room-1")
        assert a.read_all() == b.read_all()
        assert [a.read("golden:room-1", n) for n in range(66)] == [
            b.read("golden:room-1", n) for n in range(66)
        ]


def _more_turns(session_id: str, last_seq: int, turns_n: int) -> list[list[SessionEvent]]:
    clock = FixedClock(1_767_300_000_000, step_ms=40)
    batches = []
    for n in range(turns_n):
        batch = Batch(session_id, last_seq, clock=clock)
        synthetic_turn(batch, 100 + n)
        batches.append(batch.events)
        last_seq += len(batch.events)
    return batches


def test_a_log_of_old_rows_then_new_rows_replays(tmp_path: Path) -> None:
    """The v1 golden file, upgraded on opening, goes on with rows in the new format: the
    whole log reads back and folds to what folding its parts one after the other gives."""
    copy = tmp_path / "mixed.db"
    shutil.copyfile(GOLDEN / "v1_session.db", copy)
    lines = (GOLDEN / "v1_session.jsonl").read_bytes().splitlines()
    old = [decode_json(line) for line in lines]
    with SqliteEventStore(copy) as store:
        (session,) = store.sessions()
        new_batches = _more_turns(session, len(old), 3)
        for events in new_batches:
            store.append(session, events, events[0].seq - 1)
        log = store.read(session)
    new = [e for events in new_batches for e in events]
    assert log == old + new
    rows = _rows(copy)
    assert [codec.row_header(r) is None for r in rows] == [True] * 64 + [False] * 3
    view = project(log)
    assert view == project(new, project(old))
    step = project(old)
    for event in new:
        step = evolve(step, event)
    assert step == view
    assert view.seq == len(old) + len(new) and len(view.turns.finished) == 4 + 3
    # The session was deleted at the end of the old rows: the history is the new turns'.
    assert len(view.history.messages) == 3 * 4 and view.queue.generation == 1


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
