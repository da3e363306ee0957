"""``aalis-agent reshard``: a ProcessShards directory's sessions moved to another shard
count (scale/reshard.py), over real shard files written by real worker processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aalis_agent.events import Input, SqliteEventStore
from aalis_agent.events.errors import StoreError, StoreInUse, UsageError
from aalis_agent.scale import reshard as reshard_module
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.processes import ProcessShards
from aalis_agent.scale.reshard import JOURNAL, MANIFEST, reshard

from tests import shard_services

SESSIONS = [f"room:{n}" for n in range(12)]


def _made(folder: Path, shards: int = 2, turns: int = 2) -> dict[str, list[object]]:
    """A ProcessShards directory whose sessions ran ``turns`` turns each; their events."""
    with ProcessShards(folder, shard_services.services, shards=shards) as ps:
        for n in range(turns):
            for sid in SESSIONS:
                assert ps.run(sid, Input(id=f"{sid}/{n}", content=f"hi {n}")).outcome == "replied"
    return _events(folder, shards)


def _events(folder: Path, shards: int) -> dict[str, list[object]]:
    """Every session's events, read from the shard file its id hashes to (and checked
    absent from the others)."""
    out: dict[str, list[object]] = {}
    for i in range(shards):
        store = SqliteEventStore(folder / f"shard-{i}.db", read_only=True)
        try:
            for sid in store.sessions():
                assert shard_of(sid, shards) == i, (sid, i)
                out[sid] = store.read(sid)
        finally:
            store.close()
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[object]]]:
    folder = tmp_path_factory.mktemp("template") / "shards"
    return folder, _made(folder)


def _copy_of(template: tuple[Path, dict[str, list[object]]], tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    shutil.copytree(template[0], folder, ignore=shutil.ignore_patterns("*.lock"))
    return folder


@pytest.mark.parametrize("to", [3, 1])
def test_every_session_moves_whole_and_its_turns_go_on(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path, to: int
) -> None:
    folder = _copy_of(template, tmp_path)
    before = template[1]
    seen: list[reshard_module.Progress] = []
    done = reshard(folder, to, progress=seen.append)
    assert (done.old_shards, done.shards, done.sessions) == (2, to, len(SESSIONS))
    assert done.events == sum(len(e) for e in before.values())
    assert seen[-1].sessions == seen[-1].sessions_total == len(SESSIONS)
    assert json.loads((folder / MANIFEST).read_text())["shards"] == to
    assert not (folder / JOURNAL).exists()
    assert _events(folder, to) == before  # each in its new file, event for event
    assert sorted(p.name for p in folder.glob("shard-*.db")) == [f"shard-{i}.db" for i in range(to)]
    # The old files are kept whole.
    assert done.kept is not None
    assert _events(done.kept, 2) == before
    # Opened with the new count, each session goes on from its log (seq follows on).
    with ProcessShards(folder, shard_services.services, shards=to) as ps:
        for sid in SESSIONS:
            assert ps.run(sid, Input(id=f"{sid}/again", content="again")).outcome == "replied"
    after = _events(folder, to)
    for sid, events in before.items():
        assert after[sid][: len(events)] == events
        assert after[sid][len(events)].seq == events[-1].seq + 1


def test_stray_shard_files_are_refused_before_anything_changes(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    shutil.copy(folder / "shard-1.db", folder / "shard-2.db")
    with pytest.raises(UsageError, match=r"records 2 shards but also holds shard-2\.db"):
        reshard(folder, 3)
    assert not (folder / JOURNAL).exists()
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".db") == [
        "shard-0.db",
        "shard-1.db",
        "shard-2.db",
    ]


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal", ".lock"])
def test_stray_files_of_a_shard_file_are_refused_before_anything_changes(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path, suffix: str
) -> None:
    """A WAL file left where a new shard file goes would be read as the new file's
    (SQLite does not tell whose WAL it is: the new shard-2.db read as the other database);
    a rollback journal likewise; a lock file there would stop the moving half-way."""
    folder = _copy_of(template, tmp_path)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE log (x)")  # its WAL now holds another database's pages
        made = f"{other}{suffix}" if suffix in ("-wal", "-shm") else other
        shutil.copy(made, f"{folder}/shard-2.db{suffix}")
    finally:
        conn.close()
    with pytest.raises(UsageError, match=rf"records 2 shards but also holds shard-2\.db{suffix}"):
        reshard(folder, 3)
    assert not (folder / JOURNAL).exists()
    assert json.loads((folder / MANIFEST).read_text())["shards"] == 2
    assert _events(folder, 2) == template[1]


def test_two_reshards_keep_their_old_files_apart(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    first = reshard(folder, 3).kept
    reshard(folder, 2)
    second = reshard(folder, 3).kept  # within the same second, likely: another folder
    assert first is not None and second is not None and first != second
    assert _events(first, 2) == _events(second, 2) == template[1]


def test_many_shards_within_a_small_limit_of_open_files(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    """A new shard file is open only while its sessions are copied: a count of 40 under
    a limit of 64 open files (each store holds four) goes as 3 does."""
    folder = _copy_of(template, tmp_path)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "from aalis_agent.scale.reshard import reshard\n"
        "print(reshard(sys.argv[1], 40).sessions)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(len(SESSIONS))
    assert _events(folder, 40) == template[1]


def _made_with(folder: Path, shards: int) -> dict[str, list[object]]:
    with ProcessShards(folder, shard_services.services, shards=shards) as ps:
        for sid in SESSIONS:
            assert ps.run(sid, Input(id=f"{sid}/0", content="hi")).outcome == "replied"
    return _events(folder, shards)


@pytest.mark.parametrize(("hard", "works"), [(4096, True), (64, False)])
def test_many_old_shards_raise_the_open_file_limit_or_are_refused(
    tmp_path: Path, hard: int, works: bool
) -> None:
    """40 old shard files are open together while they are copied (five files each):
    under a soft limit of 64 the reshard raises it toward the hard limit; when the hard
    limit is too low it is refused before anything changes, naming it."""
    folder = tmp_path / "shards"
    before = _made_with(folder, 40)
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard}))\n"
        "from aalis_agent.scale.reshard import reshard\n"
        "print(reshard(sys.argv[1], 2).sessions)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120
    )
    if works:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == str(len(SESSIONS))
        assert _events(folder, 2) == before
    else:
        assert done.returncode != 0
        assert "needs about 232 open files" in done.stderr, done.stderr[-2000:]
        assert "may open 64 at most (ulimit -Hn)" in done.stderr
        assert not (folder / JOURNAL).exists()
        assert json.loads((folder / MANIFEST).read_text())["shards"] == 40
        assert _events(folder, 40) == before


def test_the_old_files_stay_locked_until_moved_aside(
    template: tuple[Path, dict[str, list[object]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the copy and the moves no other process may write an old shard file
    (``chat --db`` on one): what it wrote would be left in the kept copy only."""
    folder = _copy_of(template, tmp_path)
    real = reshard_module._move_old
    tried: list[subprocess.CompletedProcess[str]] = []

    def moving_old(directory: Path, journal: object) -> None:
        code = (
            "import sys\n"
            "from aalis_agent.events import SqliteEventStore\n"
            "SqliteEventStore(sys.argv[1]).close()\n"
        )
        tried.append(
            subprocess.run(
                [sys.executable, "-c", code, str(directory / "shard-0.db")],
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        real(directory, journal)  # type: ignore[arg-type]

    monkeypatch.setattr(reshard_module, "_move_old", moving_old)
    reshard(folder, 3)
    assert tried and tried[0].returncode != 0, tried
    assert "StoreInUse" in tried[0].stderr, tried[0].stderr
    assert _events(folder, 3) == template[1]


def test_a_count_past_the_limit_is_refused(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    with pytest.raises(UsageError, match="from 1 to 4,096, not 4097"):
        reshard(folder, 4097)
    assert not (folder / JOURNAL).exists()


def test_the_same_count_changes_nothing(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    done = reshard(folder, 2)
    assert done.kept is None and done.sessions == 0
    assert _events(folder, 2) == template[1]


def test_refused_while_its_shards_run_and_the_other_way(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    with ProcessShards(folder, shard_services.services, shards=2):
        code = (
            "import sys; from aalis_agent.scale.reshard import reshard\nreshard(sys.argv[1], 3)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0
        assert "StoreInUse" in done.stderr and "in use by another process" in done.stderr
    # And a ProcessShards while a reshard holds the directory (another process).
    with reshard_module.held_directory(folder):
        code = (  # (refused before its workers would build services)
            "import sys\n"
            "from aalis_agent.scale.processes import ProcessShards\n"
            "ProcessShards(sys.argv[1], print, shards=2)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "in use by another process" in done.stderr
    assert json.loads((folder / MANIFEST).read_text())["shards"] == 2


def test_refused_in_the_process_that_runs_its_shards(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    """The directory's hold keeps other processes out; within this one, a reshard is
    refused too while its ProcessShards is open (its workers killed, between restarts:
    the shard files free), and a second reshard while the first one runs."""
    folder = _copy_of(template, tmp_path)
    with ProcessShards(folder, shard_services.services, shards=2) as ps:
        for shard in ps.info():
            os.kill(shard["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(shard["alive"] for shard in ps.info()) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(StoreInUse, match="in use by this process"):
            reshard(folder, 3)
        assert not (folder / JOURNAL).exists()
        assert json.loads((folder / MANIFEST).read_text())["shards"] == 2
        # It goes on over the files of its count.
        assert ps.run("room:0", Input(id="room:0/after", content="hi")).outcome == "replied"
    nested: list[BaseException] = []

    def progress(p: reshard_module.Progress) -> None:
        if not nested:
            with pytest.raises(StoreInUse, match="in use by this process") as raised:
                reshard(folder, 3)
            nested.append(raised.value)

    reshard(folder, 3, progress=progress)
    assert nested
    after = _events(folder, 3)
    assert after["room:0"][: len(template[1]["room:0"])] == template[1]["room:0"]
    assert {sid: after[sid] for sid in SESSIONS if sid != "room:0"} == {
        sid: template[1][sid] for sid in SESSIONS if sid != "room:0"
    }


def test_a_move_that_fails_is_finished_by_running_it_again(
    template: tuple[Path, dict[str, list[object]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file move failing (a full disk, an I/O error) at each point of the moving: the
    directory is refused until the same reshard runs again, which finishes it."""
    moves = 0
    real = os.replace

    def counting(src: object, dst: object) -> None:
        nonlocal moves
        moves += 1
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(reshard_module, "_move", counting)
    reshard(_copy_of(template, tmp_path / "count"), 3)
    total = moves
    assert total >= 5  # 2 old files and 3 new ones at least (with their lock files)
    for cut in range(total):
        folder = _copy_of(template, tmp_path / f"cut{cut}")
        made = 0

        def failing(src: object, dst: object, cut: int = cut) -> None:
            nonlocal made
            if made == cut:
                raise OSError(28, "No space left on device")
            made += 1
            real(src, dst)  # type: ignore[arg-type]

        monkeypatch.setattr(reshard_module, "_move", failing)
        with pytest.raises(OSError, match="No space"):
            reshard(folder, 3)
        with pytest.raises(UsageError, match="reshard to 3 shards was begun"):
            ProcessShards(folder, shard_services.services, shards=2)
        with pytest.raises(UsageError, match="finish it first: --shards 3"):
            reshard(folder, 4)
        monkeypatch.setattr(reshard_module, "_move", real)
        reshard(folder, 3)
        assert _events(folder, 3) == template[1], cut


def test_a_row_that_does_not_decode_gives_the_reshard_up(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    folder = _copy_of(template, tmp_path)
    conn = sqlite3.connect(folder / "shard-0.db")
    try:
        sid, seq, data = conn.execute("SELECT sid, seq, data FROM log ORDER BY position").fetchone()
        conn.execute(
            "UPDATE log SET data = ? WHERE sid = ? AND seq = ?", (b"\xff" * len(data), sid, seq)
        )
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(Exception, match="seq") as raised:
        reshard(folder, 3)
    assert "session" in str(raised.value)
    # Nothing moved, no record left: the directory opens with its count as before.
    assert not (folder / JOURNAL).exists() and not (folder / "reshard-3").exists()
    assert json.loads((folder / MANIFEST).read_text())["shards"] == 2
    assert sorted(p.name for p in folder.glob("shard-*.db")) == ["shard-0.db", "shard-1.db"]


def test_events_it_would_leave_behind_give_the_reshard_up(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    """Rows whose session number the sessions table does not name (a hand edit) are in
    no session it lists: left behind, the copy would not hold every event; and one
    session in two shard files would be copied twice. Either gives the reshard up,
    named, with nothing moved."""
    orphan = _copy_of(template, tmp_path / "orphan")
    conn = sqlite3.connect(orphan / "shard-0.db")
    try:
        sid, last = conn.execute("SELECT sid, max(seq) FROM log GROUP BY sid LIMIT 1").fetchone()
        conn.execute("UPDATE log SET sid = 9999 WHERE sid = ?", (sid,))
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(StoreError, match=rf"shard-0\.db' holds {last} events .*no session"):
        reshard(orphan, 3)
    twice = _copy_of(template, tmp_path / "twice")
    name = sorted(_events(twice, 2))[0]
    conn = sqlite3.connect(twice / "shard-0.db")
    try:
        conn.execute("ATTACH ? AS other", (str(twice / "shard-1.db"),))
        here = shard_of(name, 2) == 0
        source, target = ("main", "other") if here else ("other", "main")
        number = "SELECT id FROM {}.sessions WHERE name = ?"
        (sid,) = conn.execute(number.format(source), (name,)).fetchone()
        conn.execute(f"INSERT INTO {target}.sessions (name) VALUES (?)", (name,))
        (new,) = conn.execute(number.format(target), (name,)).fetchone()
        conn.execute(
            f"INSERT INTO {target}.log SELECT ?, seq, position + 100000, data "
            f"FROM {source}.log WHERE sid = ?",
            (new, sid),
        )
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(StoreError, match=rf"session {name!r} is in both shard-0\.db and shard-1"):
        reshard(twice, 3)
    for folder in (orphan, twice):
        assert not (folder / JOURNAL).exists() and not (folder / "reshard-3").exists()
        assert json.loads((folder / MANIFEST).read_text())["shards"] == 2


_KILLED = """
import sys, time
from aalis_agent.scale.reshard import reshard

def progress(p):
    print(p.sessions, flush=True)
    time.sleep(0.02)

reshard(sys.argv[1], 3, progress=progress)
print("done", flush=True)
"""


@pytest.mark.parametrize("after", [1, 6, 12])
def test_killed_while_copying_it_is_finished_or_given_up(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path, after: int
) -> None:
    """SIGKILL of a reshard in another process once it copied ``after`` sessions (of 12:
    the copy's end, then the moving): the directory is then refused with a line saying
    how to go on; running the reshard again finishes it, or (while it was still
    copying) running it with the old count gives it up."""
    for give_up in (False, True):
        folder = _copy_of(template, tmp_path / f"give-up-{give_up}")
        with subprocess.Popen(
            [sys.executable, "-c", _KILLED, str(folder)], stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == str(after):
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        state = json.loads((folder / JOURNAL).read_text())["state"]
        assert state == "copying"  # (the progress of the last session precedes the moving)
        with pytest.raises(UsageError, match="aalis-agent reshard"):
            ProcessShards(folder, shard_services.services, shards=2)
        if give_up:
            assert reshard(folder, 2).kept is None
            assert not (folder / JOURNAL).exists() and not (folder / "reshard-3").exists()
            assert _events(folder, 2) == template[1]
        else:
            assert reshard(folder, 3).sessions == len(SESSIONS)
            assert _events(folder, 3) == template[1]


def test_cli(template: tuple[Path, dict[str, list[object]]], tmp_path: Path) -> None:
    folder = _copy_of(template, tmp_path)
    cli = [sys.executable, "-m", "aalis_agent.cli", "reshard"]
    done = subprocess.run([*cli, str(folder), "--shards", "3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 -> 3 shards; 12 sessions" in done.stdout and "before-reshard-2-" in done.stdout
    assert "copied 12/12 sessions" in done.stderr
    done = subprocess.run([*cli, str(folder), "--shards", "3"], capture_output=True, text=True)
    assert done.returncode == 0 and "nothing to do" in done.stdout
    done = subprocess.run(
        [*cli, str(tmp_path / "none"), "--shards", "3"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "is not a directory" in done.stderr
    done = subprocess.run([*cli, str(tmp_path), "--shards", "3"], capture_output=True, text=True)
    assert done.returncode == 2 and "no shards.json" in done.stderr
    done = subprocess.run([*cli, str(folder), "--shards", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "expected a positive integer" in done.stderr


def test_cli_progress_in_lines_when_stderr_is_not_a_terminal(
    template: tuple[Path, dict[str, list[object]]], tmp_path: Path
) -> None:
    """Captured (a log file, a pipe), the progress is lines, not a line redrawn with
    carriage returns; an error after some progress starts a line of its own. On a
    terminal the line is redrawn."""
    folder = _copy_of(template, tmp_path)
    conn = sqlite3.connect(folder / "shard-1.db")
    try:  # the last session copied does not decode
        conn.execute("UPDATE log SET data = X'ff' WHERE sid = (SELECT max(sid) FROM log)")
        conn.commit()
    finally:
        conn.close()
    cli = [sys.executable, "-m", "aalis_agent.cli", "reshard", str(folder), "--shards", "3"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "\r" not in done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("copied 1/12 sessions"), lines
    assert lines[-1].startswith("aalis-agent reshard: error: "), lines
    # On a terminal (a pseudo-terminal here), one line redrawn, ended before the error.
    main, side = os.openpty()
    try:
        with subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=side) as proc:
            os.close(side)
            out = b""
            while chunk := _read_pty(main):
                out += chunk
            assert proc.wait(timeout=60) == 2
    finally:
        os.close(main)
    text = out.decode()
    assert text.startswith("\rcopied 1/12 sessions"), text
    assert "\naalis-agent reshard: error: " in text, text


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the other side closed (EIO)
        return b""
