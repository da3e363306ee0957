"""The ``aalis-agent`` command: demo and replay, as a user runs them."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from aalis_agent.cli import main
from aalis_agent.events import Batch, FixedClock, InputQueued, SqliteEventStore
from aalis_agent.testing.sample import synthetic_turn, write_demo_session

SESSION = "demo:room-1"


@pytest.fixture
def demo_db(tmp_path: Path) -> Path:
    path = tmp_path / "demo.db"
    with SqliteEventStore(path) as store:
        write_demo_session(store, SESSION, FixedClock(1_767_225_600_000, step_ms=100))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_writes_a_log_and_says_how_to_replay_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "d.db"
    code, out, _ = run(capsys, "demo", "--db", str(db))
    assert code == 0
    assert f"aalis-agent replay {db} --session {SESSION}" in out
    assert "TURN turn-3 ended: aborted reason=stop" in out
    with SqliteEventStore(db) as store:
        assert store.sessions() == [SESSION]
        first = store.count()
    # Running it again keeps the first session and writes a second one.
    code, out, _ = run(capsys, "demo", "--db", str(db))
    assert code == 0
    with SqliteEventStore(db) as store:
        assert store.sessions() == [SESSION, f"{SESSION}-2"]
        assert store.count() == 2 * first


def test_timeline_shows_turns_inputs_tools_outcomes_and_stops(
    demo_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "replay", str(demo_db))
    assert code == 0, err
    assert f"== session {SESSION} (56 events) ==" in out
    for expected in (
        "TURN turn-1 opened (human; inputs in-1, historyLimit=20)",
        "input in-1 → turn-1 (opened)",
        "input in-2 → pending insert into turn-1",
        "input in-2 → turn-1 (joined)",
        "input in-3 → queued",
        "TURN turn-2 opened (source=schedule, from queue; inputs in-3, historyLimit=20)",
        "tool weather callId=call-1 started",
        "tool remind callId=call-2 failed '参数不是合法的 JSON 对象",
        "TURN turn-1 ended: replied in 2310ms",
        "stop requested by 10001 (stop)",
        "stop marker '[已停下]",
        "TURN turn-3 ended: aborted reason=stop in 420ms",
    ):
        assert expected in out, expected
    # Lines carry the seq in order.
    seqs = [int(line.split()[0][1:]) for line in out.splitlines() if line.startswith("#")]
    assert seqs == list(range(1, 57))


def test_at_shows_the_state_as_of_that_event(
    demo_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # seq 10: in-2 waits to join turn-1; nothing queued yet.
    code, out, _ = run(capsys, "replay", str(demo_db), "--session", SESSION, "--at", "10")
    assert code == 0
    assert "at seq 10" in out
    assert "running turn: turn-1 (human-opened, accepts inserts)" in out
    assert "in-2 pending → turn-1 (human)" in out
    assert "queue (0 queued, 1 pending)" in out
    # seq 18: in-2 joined, the scheduled injection queued.
    code, out, _ = run(capsys, "replay", str(demo_db), "--at", "18", "--json")
    state = json.loads(out)
    assert state["seq"] == 18
    assert state["queued"] == ["in-3"] and state["pending"] == []
    assert [m["id"] for m in state["history_window"]] == [
        "msg-in-1-1",
        "msg-call-1",
        "msg-result-1",
        "msg-in-2-2",
    ]


def test_json_prints_one_event_object_per_line(
    demo_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "replay", str(demo_db), "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 56
    assert [r["seq"] for r in rows] == list(range(1, 57))
    assert rows[1]["type"] == "turn_opened" and rows[1]["turn_id"] == "turn-1"
    assert rows[2] == {**rows[2], "type": "input_joined", "entry": "opened", "seq": 3}


def _insert_raw(db: Path, seq: int, data: bytes, type_: str = "message_saved") -> None:
    conn = sqlite3.connect(db)
    with conn:
        pos = conn.execute("SELECT max(position) FROM events").fetchone()[0] + 1
        conn.execute(
            "INSERT INTO events (position, session_id, seq, type, data) VALUES (?, ?, ?, ?, ?)",
            (pos, SESSION, seq, type_, data),
        )
    conn.close()


def test_corrupt_rows_are_named_and_the_rest_replays(
    demo_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _insert_raw(demo_db, 57, b"\xc1 not msgpack")
    unknown = msgspec.msgpack.encode({"type": "from_the_future", "session_id": SESSION})
    _insert_raw(demo_db, 58, unknown, "from_the_future")
    code, out, err = run(capsys, "replay", str(demo_db))
    assert code == 1
    assert f"session '{SESSION}' seq 57: cannot decode event" in err
    assert f"session '{SESSION}' seq 58: cannot decode event" in err
    assert "2 row(s) could not be decoded" in err
    assert "TURN turn-4 ended: replied in 980ms" in out  # the rest still replays
    code, out, err = run(capsys, "replay", str(demo_db), "--json")
    assert code == 1
    rows = [json.loads(line) for line in out.splitlines()]
    errors = [r for r in rows if "type" not in r]
    assert [(e["session_id"], e["seq"]) for e in errors] == [(SESSION, 57), (SESSION, 58)]


def test_rows_deleted_by_hand_are_named_by_the_seqs_they_held(
    demo_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = sqlite3.connect(demo_db)
    with conn:
        rows = [seq for (seq,) in conn.execute("SELECT seq FROM log ORDER BY seq")]
        assert rows[:4] == [5, 8, 10, 16]  # rows of seqs 1-5, 6-8, 9-10, 11-16
        conn.execute("DELETE FROM log WHERE seq IN (8, 10)")
    conn.close()
    code, out, err = run(capsys, "replay", str(demo_db))
    assert code == 1
    first = err.splitlines()[0]
    assert first == (
        f"error: session '{SESSION}' seq 11: cannot decode event: a row of seqs 11-16: "
        "it continues the row before seq 11, which was not read; "
        "seqs 6-10 are missing (rows deleted?)"
    )
    assert "#5 " in out and "#6 " not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--session", "nope"], "no session 'nope'"),
        (["--at", "0"], "--at must be a seq of 1 or more"),
    ],
)
def test_bad_arguments_get_clear_errors(
    demo_db: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, "replay", str(demo_db), *argv)
    assert code == 2
    assert message in err
    assert out == ""


def test_missing_database_is_an_error_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    code, _, err = run(capsys, "replay", str(missing))
    assert code == 2
    assert "no event database at" in err
    assert not missing.exists()


@pytest.mark.parametrize(
    "argv",
    [["replay"], ["replay", "--session", "s", "--fork", "3"], ["inspect"]],
    ids=["replay", "fork", "inspect"],
)
def test_a_directory_is_named_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, argv[0], str(tmp_path), *argv[1:])
    assert code == 2 and out == ""
    assert f"{str(tmp_path)!r} is a directory, not an event database" in err


@pytest.mark.parametrize("argv", [["replay"], ["inspect"]], ids=["replay", "inspect"])
def test_a_directory_of_process_shards_names_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    (tmp_path / "shards.json").write_text('{"format": 1, "shards": 2}\n')
    for n in range(2):
        (tmp_path / f"shard-{n}.db").write_bytes(b"")
    code, out, err = run(capsys, argv[0], str(tmp_path))
    assert code == 2 and out == ""
    assert "is a directory of process shards, not an event database" in err
    assert "open one of its shard files (shard-0.db, shard-1.db)" in err


def test_not_a_database_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello, this is not sqlite\n" * 100)
    code, _, err = run(capsys, "replay", str(bogus))
    assert code == 2
    assert "is not a usable event database" in err


def test_long_replays_show_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "big.db"
    with SqliteEventStore(db) as store:
        last = 0
        for n in range(700):  # 10,500 events
            batch = Batch("s1", last, now_ms=0)
            synthetic_turn(batch, n)
            last = store.append("s1", batch.events, last)
    code, _, err = run(capsys, "replay", str(db))
    assert code == 0
    progress = [line for line in err.splitlines() if line.startswith("replay: ")]
    assert progress and progress[-1] == "replay: 10,500/10,500 events (100%)"


def test_console_script_runs(demo_db: Path) -> None:
    exe = Path(sys.executable).parent / "aalis-agent"
    command = [str(exe)] if exe.exists() else [shutil.which("aalis-agent") or "aalis-agent"]
    result = subprocess.run(
        [*command, "replay", str(demo_db), "--session", SESSION, "--at", "56"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "state of demo:room-1 at seq 56" in result.stdout


def test_replay_reads_an_older_database_without_changing_it(
    demo_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replay opens the file read-only: a format-1 file (no session index) is not migrated."""
    old = tmp_path / "old.db"
    shutil.copy(demo_db, old)
    conn = sqlite3.connect(old)
    conn.executescript("DROP TABLE idle_sessions; PRAGMA user_version=1;")
    conn.close()
    before = old.read_bytes()
    code, out, err = run(capsys, "replay", str(old), "--session", SESSION)
    assert code == 0, err
    assert f"== session {SESSION} (56 events) ==" in out
    assert old.read_bytes() == before


def test_json_prints_metadata_whose_keys_json_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tool's metadata keyed by tuples (msgpack holds it; an older runtime stored it):
    ``--json`` prints the key as its repr instead of failing with a traceback."""
    from aalis_agent.events import ToolFinished

    path = tmp_path / "keys.db"
    with SqliteEventStore(path) as store:
        finished = ToolFinished(
            session_id="room",
            seq=1,
            at=1,
            turn_id="t",
            call_id="c",
            name="n",
            result="r",
            metadata={"coords": {(1, 2): "a", 3: "int key"}},
        )
        store.append("room", [finished], 0)
    code, out, err = run(capsys, "replay", str(path), "--json")
    assert code == 0, err
    line = json.loads(out.splitlines()[0])
    assert line["metadata"] == {"coords": {"(1, 2)": "a", "3": "int key"}}


def test_a_session_id_with_control_characters_cannot_forge_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ids.db"
    forged = "a\n== session fake (0 events) ==\x1b[31m"
    with SqliteEventStore(path) as store:
        write_demo_session(store, forged, FixedClock(1_767_225_600_000, step_ms=100))
    code, out, err = run(capsys, "replay", str(path))
    assert code == 0, err
    assert "\x1b" not in out
    headers = [line for line in out.splitlines() if line.startswith("== session")]
    assert headers == [f"== session {forged!r} ({headers[0].rsplit('(', 1)[1]}"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--session", "nobody"],
        ["--session", "nobody", "--fork", "3"],
        ["--fork", "3"],  # two sessions: --fork needs one named
    ],
    ids=["replay", "fork", "fork-unnamed"],
)
def test_the_sessions_an_error_lists_cannot_forge_lines_either(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """The error for a session not in the log lists the ones there: it printed their
    ids raw, so one holding a newline or an escape sequence forged lines or coloured the
    terminal."""
    path = tmp_path / "ids.db"
    forged = "a\nreplay: ok\x1b[2J"
    with SqliteEventStore(path) as store:
        write_demo_session(store, forged, FixedClock(1_767_225_600_000, step_ms=100))
        write_demo_session(store, "plain", FixedClock(1_767_225_600_000, step_ms=100))
    code, out, err = run(capsys, "replay", str(path), *argv)
    assert code == 2 and out == ""
    assert "\x1b" not in err and len(err.splitlines()) == 1
    assert f"{forged!r}, plain" in err


@pytest.mark.parametrize(
    "flags",
    [("--script", "x.json"), ("--config", "x.toml"), ("--set", "llm=a/b"), ("--timeout", "5")],
)
def test_fork_options_without_fork_are_refused(
    demo_db: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, str]
) -> None:
    code, out, err = run(capsys, "replay", str(demo_db), *flags)
    assert code == 2 and out == ""
    assert err.strip() == f"aalis-agent replay: error: {flags[0]}: only with --fork SEQ"


def _read_only_mount_works(tmp_path: Path) -> bool:
    """Whether this machine lets a test bind a folder read-only in a mount namespace of
    its own (``unshare -m``: root, or user namespaces allowed)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount --bind {probe} {probe} && "
            f"mount -o remount,bind,ro {probe} && ! touch {probe}/x",
        ],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def test_replay_reads_a_database_on_a_read_only_mount(tmp_path: Path) -> None:
    """A WAL database in a folder that cannot be written (a read-only mount, a backup):
    SQLite cannot make the file it reads WAL with, and replay failed with "unable to open
    database file". Left cleanly (no WAL file), it is read as it is; with commits still in
    a WAL file, the error says so and what to do."""
    if shutil.which("unshare") is None or not _read_only_mount_works(tmp_path):
        pytest.skip("no read-only bind mount here (unshare -m and mount need root)")
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "d.db"
    with SqliteEventStore(db) as store:
        write_demo_session(store, SESSION, FixedClock())
    assert not (folder / "d.db-wal").exists()

    def replay_read_only() -> subprocess.CompletedProcess[str]:
        script = (
            f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
            f"exec {sys.executable} -m aalis_agent.cli replay {db} --session {SESSION}"
        )
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )

    done = replay_read_only()
    assert done.returncode == 0, done.stderr
    assert f"== session {SESSION} (" in done.stdout
    # A WAL file left whose commits a checkpoint copied back (a writer killed after it):
    # the file alone is the database, and it is read.
    kept = tmp_path / "kept"
    kept.mkdir()
    with SqliteEventStore(db, background_checkpoint=False, wal_autocheckpoint=0) as store:
        last = store.last_seq(SESSION)
        store.append(
            SESSION, [InputQueued(session_id=SESSION, seq=last + 1, at=1, input_id="x")], last
        )
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()[0] == 0
        for name in ("d.db", "d.db-wal"):  # as a kill would leave them now
            shutil.copy(folder / name, kept / name)
        last += 1
        store.append(
            SESSION, [InputQueued(session_id=SESSION, seq=last + 1, at=1, input_id="y")], last
        )
        uncopied = tmp_path / "uncopied"  # y in the WAL only, as a kill would leave it
        uncopied.mkdir()
        for name in ("d.db", "d.db-wal"):
            shutil.copy(folder / name, uncopied / name)
    assert not (folder / "d.db-wal").exists() and not (folder / "d.db-shm").exists()
    for name in ("d.db", "d.db-wal"):
        shutil.copy(kept / name, folder / name)
    done = replay_read_only()
    assert done.returncode == 0, done.stderr
    assert f"== session {SESSION} ({last} events)" in done.stdout
    # Commits left in a WAL file (a writer that was killed): named, not read stale.
    for name in ("d.db", "d.db-wal"):
        shutil.copy(uncopied / name, folder / name)
    done = replay_read_only()
    assert done.returncode == 2, done.stdout
    assert "its WAL file holds commits" in done.stderr


def test_a_clear_begun_and_not_finished_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log cut between a clear's two commits (its stop and release written, not its
    ``ContextCleared``): the events name the clear's kinds, and the state at that point
    (text, ``--json``, the inspector's) says the clear is begun and not finished, as the
    session's next start finishes it; once written, the state says nothing of it."""
    from aalis_agent.events import (
        ContextCleared,
        Input,
        InputJoined,
        InputReceived,
        InputReleased,
        StopRequested,
        TurnOpened,
    )
    from aalis_agent.inspector.index import SessionIndex

    path = tmp_path / "cut.db"
    kinds = ("context", "memory")
    b = Batch(SESSION, 0, now_ms=1_000)
    b.add(InputReceived(input=Input(id="b", content="二", timestamp=1_000)))
    b.add(TurnOpened(turn_id="turn-1", input_ids=("b",)))
    b.add(InputJoined(input_id="b", turn_id="turn-1", entry="opened"))
    b.add(InputReceived(input=Input(id="c", content="三", timestamp=1_000)))
    b.add(StopRequested(turn_id="turn-1", reason="clear", kinds=kinds))
    b.add(InputReleased(input_id="c", reason="clear", kinds=kinds))
    b.add(ContextCleared(kinds=kinds))
    with SqliteEventStore(path) as store:
        store.append(SESSION, b.events, 0)
    code, out, _ = run(capsys, "replay", str(path))
    assert code == 0
    assert "stop requested (clear of context, memory)" in out
    assert "input c released (clear of context, memory, not archived)" in out
    code, out, _ = run(capsys, "replay", str(path), "--at", "6")
    assert "clear of context, memory begun, not finished" in out
    code, out, _ = run(capsys, "replay", str(path), "--at", "6", "--json")
    assert json.loads(out)["winding_down"] == {"kind": "clear", "kinds": list(kinds)}
    code, out, _ = run(capsys, "replay", str(path), "--at", "7")
    assert "begun, not finished" not in out
    index = SessionIndex(SESSION)
    index.feed(b.events)
    assert index.state(6)["winding_down"] == {"kind": "clear", "kinds": list(kinds)}
    assert index.state(7)["winding_down"] is None
