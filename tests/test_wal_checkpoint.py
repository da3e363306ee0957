"""The SQLite store checkpoints its WAL on a thread of its own (events/sqlite.py): no
append pays for a checkpoint, the WAL stays bounded, and a failing checkpoint is logged
while the appends go on."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from aalis_agent.events import SqliteEventStore
from aalis_agent.events.schema import ChatMessage, MessageSaved, SessionEvent
from aalis_agent.events.sqlite import _Checkpointer
from structlog.testing import capture_logs


def _append(store: SqliteEventStore, session: str, n: int, size: int = 300) -> None:
    """``n`` batches of one message each (``size`` characters of varied text)."""
    for _ in range(n):
        last = store.last_seq(session)
        text = "".join(chr(0x4E00 + (last * 7 + i) % 20000) for i in range(size))
        event: SessionEvent = MessageSaved(
            session_id=session,
            seq=last + 1,
            at=last + 1,
            message=ChatMessage(id=f"m{last}", role="user", content=text),
        )
        store.append(session, [event], last)


def _wal(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def _autocheckpoint(path: Path, store: SqliteEventStore) -> int:
    return int(store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])


def _opened(path: Path | str, mark: int) -> tuple[SqliteEventStore, _Checkpointer]:
    """A store checkpointing on its thread at ``mark`` pages, and its checkpointer."""
    store = SqliteEventStore(path, wal_autocheckpoint=mark)
    checkpointer = store._checkpointer
    assert checkpointer is not None
    return store, checkpointer


def _wait_for(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_the_wal_is_checkpointed_on_the_stores_thread_and_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SqliteEventStore(path, wal_autocheckpoint=40)
    try:
        assert _autocheckpoint(path, store) == 0  # the writer never checkpoints inline
        for round_ in range(6):
            _append(store, "s", 60)
            assert _wait_for(lambda r=round_: store.checkpoints > r)
        # Each checkpoint let the writer start the WAL over: it holds about one round.
        assert _wal(path).stat().st_size < 120 * 4096 * 3
        names = [t.name for t in threading.enumerate()]
        assert names.count("aalis-wal-checkpoint") == 1
        # What the checkpoints copied is in the database file itself.
        other = sqlite3.connect(path)
        try:
            assert other.execute("SELECT count(*) FROM log").fetchone()[0] == 360
        finally:
            other.close()
    finally:
        store.close()
    assert not _wal(path).exists()  # the last connection checkpointed and removed it
    assert "aalis-wal-checkpoint" not in [t.name for t in threading.enumerate()]
    with SqliteEventStore(path, read_only=True) as reader:
        assert reader.last_seq("s") == 360


def test_without_many_writes_no_thread_is_started(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "a.db") as store:
        _append(store, "s", 5)
        assert store.checkpoints == 0 and store._checkpointer is not None
        assert store._checkpointer._thread is None


@pytest.mark.parametrize("how", ["exclusive", "inline"])
def test_exclusive_or_inline_stores_checkpoint_as_sqlite_does(tmp_path: Path, how: str) -> None:
    path = tmp_path / "events.db"
    kwargs = {"exclusive": True} if how == "exclusive" else {"background_checkpoint": False}
    with SqliteEventStore(path, wal_autocheckpoint=40, **kwargs) as store:  # type: ignore[arg-type]
        assert _autocheckpoint(path, store) == 40 and store._checkpointer is None
        _append(store, "s", 200)
        assert store.checkpoints == 0
        assert "aalis-wal-checkpoint" not in [t.name for t in threading.enumerate()]


def test_a_failing_checkpoint_is_logged_and_the_appends_go_on(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store, checkpointer = _opened(path, 20)
    real_connect = sqlite3.connect
    failures = {"left": 2}

    def connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        if threading.current_thread().name == "aalis-wal-checkpoint" and failures["left"]:
            failures["left"] -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return real_connect(*args, **kwargs)  # type: ignore[arg-type]

    try:
        with capture_logs() as logs:
            sqlite3.connect = connect  # type: ignore[assignment]
            try:
                for _ in range(8):
                    _append(store, "s", 30)
                    time.sleep(0.02)
                assert _wait_for(lambda: checkpointer.failed == 2 and store.checkpoints >= 1)
            finally:
                sqlite3.connect = real_connect  # type: ignore[assignment]
        failed = [e for e in logs if e["event"].startswith("WAL checkpoint failed")]
        assert len(failed) == 2 and "disk I/O error" in failed[0]["error"]
        assert store.last_seq("s") == 240  # every append went on
    finally:
        store.close()
    with SqliteEventStore(path, read_only=True) as reader:
        assert len(reader.read("s")) == 240


class _FailingLog:
    """A logger whose every call fails (its own disk full, say)."""

    def warning(self, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")


def test_a_failing_logger_neither_stops_the_checkpoints_nor_fails_an_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aalis_agent.events.sqlite as sqlite_store

    monkeypatch.setattr(sqlite_store, "log", _FailingLog())
    path = tmp_path / "events.db"
    store, checkpointer = _opened(path, 20)
    real = checkpointer.checkpoint
    failing = {"left": 3}

    def checkpoint(conn: sqlite3.Connection, *, inline: bool = False) -> str:
        if failing["left"]:
            failing["left"] -= 1
            checkpointer._failed(sqlite3.OperationalError("disk I/O error"), inline)
            return "failed"
        return real(conn, inline=inline)

    checkpointer.checkpoint = checkpoint  # type: ignore[method-assign]
    try:
        checkpointer.catch_up = True  # the next append's own checkpoint fails too
        for n in range(6):
            _append(store, f"s{n % 2}", 30)  # every append returns: none raises
            time.sleep(0.02)
        assert checkpointer.failed == 3
        assert _wait_for(lambda: store.checkpoints >= 1)
        assert checkpointer._thread is not None and checkpointer._thread.is_alive()
        assert store.last_seq("s0") == store.last_seq("s1") == 90
    finally:
        store.close()
    with SqliteEventStore(path, read_only=True) as reader:
        assert len(reader.read("s0")) == len(reader.read("s1")) == 90


def test_the_checkpointer_finds_the_file_it_was_opened_with_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    store = SqliteEventStore("events.db", wal_autocheckpoint=20)  # a relative path
    try:
        monkeypatch.chdir(tmp_path / "b")
        _append(store, "s", 60)
        assert _wait_for(lambda: store.checkpoints >= 1)
        assert store._checkpointer is not None and store._checkpointer.failed == 0
        assert list((tmp_path / "b").iterdir()) == []  # no stray empty database here
    finally:
        store.close()


def test_a_store_dropped_without_close_stops_its_thread(tmp_path: Path) -> None:
    import gc

    store = SqliteEventStore(tmp_path / "events.db", wal_autocheckpoint=20)
    _append(store, "s", 40)
    checkpointer = store._checkpointer
    assert checkpointer is not None and _wait_for(lambda: checkpointer.done >= 1)
    thread = checkpointer._thread
    assert thread is not None and thread.is_alive()
    store._release_owner()  # as a process would at exit; the writer lock is not the point
    del store
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_each_checkpoint_cycle_starts_the_wal_over(tmp_path: Path) -> None:
    """The thread copies the WAL back, the next append copies what was added meanwhile,
    and the append after that starts the WAL over from its beginning: what it holds then
    is that append's pages alone, however many cycles went before."""
    path = tmp_path / "events.db"
    store, checkpointer = _opened(path, 100_000)  # woken here, by hand
    observer = sqlite3.connect(path, isolation_level=None)
    try:
        for cycle in range(5):
            _append(store, "s", 12)
            checkpointer.wake()  # as the appends do at the mark
            assert _wait_for(lambda: checkpointer.catch_up), cycle
            _append(store, "s", 1)  # copies back what the thread left
            assert not checkpointer.catch_up and checkpointer.restart_due
            _append(store, "s", 1)  # begins on a WAL copied back whole: starts it over
            busy, frames, _ = observer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            assert busy == 0 and frames <= 8, (cycle, frames)
        assert checkpointer.done >= 10 and checkpointer.caught_up == 5
    finally:
        observer.close()
        store.close()


def test_a_reader_holding_the_wal_back_is_said_once_per_doubling(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SqliteEventStore(path, wal_autocheckpoint=10)
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        _append(store, "s", 5)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM log").fetchone()  # holds this snapshot
        with capture_logs() as logs:
            for _ in range(30):
                _append(store, "s", 10)
                time.sleep(0.01)
            assert _wait_for(lambda: store.checkpoints >= 10)
        held = [e for e in logs if e["event"].startswith("WAL held back by a reader")]
        assert 1 <= len(held) <= 5  # 40 pages, then 80, 160...: not at every checkpoint
        assert held[0]["wal_pages"] >= 40 and held[0]["copied_pages"] < held[0]["wal_pages"]
        reader.execute("COMMIT")  # let go: the WAL is copied back, starts over, is cut

        def cut_back() -> bool:
            _append(store, "s", 1)
            return _wal(path).stat().st_size <= 10 * _PAGE_FRAME * 2 + 32

        assert _wait_for(cut_back)
    finally:
        reader.close()
        store.close()


_PAGE_FRAME = 4096 + 24
