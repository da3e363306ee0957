"""Whether a WAL file adds anything to its database file (``wal_adds_nothing``): what
decides if a database in a folder that cannot be written is read as its file alone.

A writer killed after a checkpoint copied its WAL back leaves the WAL file behind, every
commit in it already in the database file. That database was refused read-only on a
read-only mount, as if the WAL held commits the file lacks; it is now read. One whose
WAL holds a commit not yet copied back is still refused (the file alone is stale).
(tests/test_replay_cli.py runs both through ``replay`` on a real read-only mount.)
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from pathlib import Path

from aalis_agent.events import FixedClock, InputQueued, SqliteEventStore
from aalis_agent.events.sqlite import _no_writer, _wal_checksum, wal_adds_nothing
from aalis_agent.testing.sample import write_demo_session

SESSION = "demo:room-1"


def _kept(src: Path, dest: Path) -> tuple[Path, Path]:
    """The database and its WAL as they are now (as a kill would leave them)."""
    dest.mkdir()
    shutil.copy(src, dest / src.name)
    shutil.copy(f"{src}-wal", dest / f"{src.name}-wal")
    return dest / src.name, dest / f"{src.name}-wal"


def _seqs(db: Path, *, immutable: bool) -> list[int]:
    """The session's seqs as SQLite reads them: with the WAL beside the file, or the
    file alone (a copy of it in a folder of its own, as an ``immutable`` open reads)."""
    if immutable:
        alone = db.parent / "alone"
        alone.mkdir(exist_ok=True)
        db = Path(shutil.copy(db, alone / db.name))
    with SqliteEventStore(db, read_only=True) as store:
        return [e.seq for e in store.read(SESSION)]


def test_a_wal_copied_back_adds_nothing_and_one_with_a_new_commit_does(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    # No checkpoint of its own: the test says when the WAL is copied back.
    store = SqliteEventStore(db, background_checkpoint=False, wal_autocheckpoint=0)
    try:
        write_demo_session(store, SESSION, FixedClock())
        last = store.last_seq(SESSION)
        assert not _no_writer(str(db))  # the open store holds the writer lock
        new = _kept(db, tmp_path / "new")  # commits in the WAL only
        with contextlib.closing(sqlite3.connect(db)) as conn:
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()
        assert busy == 0 and frames == copied > 0
        back = _kept(db, tmp_path / "back")  # every commit copied back, WAL still there
        store.append(
            SESSION, [InputQueued(session_id=SESSION, seq=last + 1, at=1, input_id="x")], last
        )
        one_more = _kept(db, tmp_path / "one-more")  # one commit past the checkpoint
    finally:
        store.close()
    assert _no_writer(str(db))

    assert not wal_adds_nothing(str(new[0]), str(new[1]))
    assert wal_adds_nothing(str(back[0]), str(back[1]))
    assert not wal_adds_nothing(str(one_more[0]), str(one_more[1]))
    # What SQLite itself reads agrees: the file alone is the database only when copied back.
    assert _seqs(back[0], immutable=True) == _seqs(back[0], immutable=False)
    assert _seqs(one_more[0], immutable=False)[-1] == last + 1
    assert _seqs(one_more[0], immutable=True)[-1] == last


def test_frames_past_the_last_commit_and_headers_sqlite_would_not_take(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    store = SqliteEventStore(db, background_checkpoint=False, wal_autocheckpoint=0)
    try:
        write_demo_session(store, SESSION, FixedClock())
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()
        database, wal = (str(p) for p in _kept(db, tmp_path / "back"))
    finally:
        store.close()
    whole = Path(wal).read_bytes()
    page = int.from_bytes(whole[8:12], "big")
    assert wal_adds_nothing(database, wal)
    # An unfinished frame after the last commit (a write cut short) is not a commit.
    Path(wal).write_bytes(whole + whole[32 : 32 + 24 + 100])
    assert wal_adds_nothing(database, wal)
    # The first frame failing its checksum ends the valid frames there, as SQLite's
    # recovery does: no commit counts, and SQLite reads the file alone too.
    damaged = bytearray(whole)
    damaged[32 + 24] ^= 0xFF
    Path(wal).write_bytes(bytes(damaged))
    assert wal_adds_nothing(database, wal)
    # A header that is not a WAL's makes an empty WAL (SQLite ignores it) ...
    Path(wal).write_bytes(b"\0" * 32 + whole[32:])
    assert wal_adds_nothing(database, wal)
    # ... a WAL of a version SQLite refuses to open is not taken for one adding nothing.
    header = bytearray(whole[:32])
    header[4:8] = (3007001).to_bytes(4, "big")
    order = "<" if header[3] == 0x82 else ">"
    header[24:32] = b"".join(x.to_bytes(4, "big") for x in _wal_checksum(header[:24], 0, 0, order))
    Path(wal).write_bytes(bytes(header) + whole[32:])
    assert not wal_adds_nothing(database, wal)
    # The file shorter than the last commit left it: not all copied back.
    Path(wal).write_bytes(whole)
    with open(database, "r+b") as f:
        f.truncate(page)
    assert not wal_adds_nothing(database, wal)


def test_a_wal_whose_last_commit_shrank_the_database_and_was_copied_back_adds_nothing(
    tmp_path: Path,
) -> None:
    """A commit that shrinks the database (a VACUUM after rows were deleted) leaves the
    pages past its new end in earlier commits' frames; a checkpoint copies the rest back
    and cuts the file to the new size. Those pages are no longer the database's: SQLite
    reading the WAL does not read them. They were compared with the file, which no longer
    has them, and the database was refused though the file alone is the database."""
    db = tmp_path / "d.db"
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE t (x)")
        for n in range(200):
            conn.execute("INSERT INTO t VALUES (?)", (f"{n:04}" * 100,))
        conn.execute("DELETE FROM t WHERE rowid > 3")
        conn.execute("VACUUM")
        shrunk = _kept(db, tmp_path / "shrunk")  # the VACUUM's commit in the WAL only
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and frames == copied > 0
        back = _kept(db, tmp_path / "back")
    finally:
        conn.close()

    def rows(path: Path, *, immutable: bool) -> list[tuple[str]]:
        uri = f"file:{path}?mode=ro" + ("&immutable=1" if immutable else "")
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as c:
            return c.execute("SELECT x FROM t ORDER BY rowid").fetchall()

    assert not wal_adds_nothing(str(shrunk[0]), str(shrunk[1]))
    assert wal_adds_nothing(str(back[0]), str(back[1]))
    # What SQLite reads agrees: the file alone is the database once copied back.
    alone = tmp_path / "alone"
    alone.mkdir()
    copy = Path(shutil.copy(back[0], alone / "d.db"))
    assert rows(copy, immutable=True) == rows(back[0], immutable=False)
    assert len(rows(copy, immutable=True)) == 3
