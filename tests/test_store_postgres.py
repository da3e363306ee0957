"""``PostgresEventStore`` on a real, throwaway PostgreSQL cluster (``tests/pg.py``): the
same ``EventStore`` contract as every store, then what only a shared server shows
(concurrent writers, rollback, read-only readers, a runtime turn, ``open_store``)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")

import psycopg
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    ConcurrencyConflict,
    CorruptEvent,
    Input,
    InvalidBatch,
    SqliteEventStore,
    StoreError,
    ToolCall,
    ToolFinished,
    TurnRecorded,
    codec,
)
from aalis_agent.events.open import is_postgres_url, open_store
from aalis_agent.events.postgres import PostgresEventStore, redact_url
from aalis_agent.events.store import EventStore
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures
from tests.test_store_contract import (
    StoreContract,
    batch,
    one_of_every_event,
    queued,
    snapshot,
)


class TestPostgresStore(StoreContract):
    """The whole contract, each test on an empty schema of its own."""

    @pytest.fixture
    def store(self, pg_url: str) -> Iterator[EventStore]:  # noqa: F811
        store = PostgresEventStore(pg_url)
        yield store
        store.close()


# --- helpers -----------------------------------------------------------------------------


def _raw_append(url: str, session_id: str, expected_seq: int, count: int, data: Any) -> int:
    """A row written as the store writes it, but with any ``data`` (a damaged row)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT aalis_append(%s, %s, %s, false, %s)",
            (session_id.encode(), expected_seq, count, data),
        ).fetchone()
    assert row is not None and row[0] > 0
    return int(row[0])


@pytest.fixture
def store(pg_url: str) -> Iterator[PostgresEventStore]:  # noqa: F811
    with PostgresEventStore(pg_url) as store:
        yield store


# --- concurrent writers ------------------------------------------------------------------


def _race(
    gate: threading.Barrier,
    results: dict[str, Any],
    name: str,
    store: PostgresEventStore,
    size: int,
    at: int,
) -> None:
    events = [queued("s", at + i + 1, name) for i in range(size)]
    gate.wait()
    try:
        results[name] = store.append("s", events, at)
    except ConcurrencyConflict as exc:
        results[name] = exc


def test_two_connections_race_one_wins_the_other_conflicts(pg_url: str) -> None:  # noqa: F811
    """Two stores (two pools) append to the same session from the same seq at once:
    every round, exactly one wins and the other gets ConcurrencyConflict naming the
    winner's seq; nothing of the loser's batch is written."""
    with PostgresEventStore(pg_url) as first, PostgresEventStore(pg_url) as second:
        last = 0
        for _ in range(20):
            gate = threading.Barrier(2)
            results: dict[str, Any] = {}

            threads = [
                threading.Thread(target=_race, args=(gate, results, "a", first, 1, last)),
                threading.Thread(target=_race, args=(gate, results, "b", second, 2, last)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            won = [n for n, r in results.items() if isinstance(r, int)]
            lost = [r for r in results.values() if isinstance(r, ConcurrencyConflict)]
            assert len(won) == 1 and len(lost) == 1, results
            assert lost[0].expected_seq == last and lost[0].actual_seq == results[won[0]]
            assert all(e.input_id.endswith(won[0]) for e in first.read("s", last))
            last = results[won[0]]
        assert first.last_seq("s") == second.last_seq("s") == last
        assert [r.position for r in second.read_all()] == list(range(1, last + 1))


def test_a_writer_waiting_on_an_open_transaction_conflicts_once_it_commits(
    pg_url: str,  # noqa: F811
) -> None:
    """The seq check holds the session's row until commit: a second writer waits, then
    sees the first one's seq (and wins if the first rolls back)."""
    with PostgresEventStore(pg_url) as store:
        store.append("s", batch("s", 1, 1), 0)
        for commit in (True, False):
            at = store.last_seq("s")
            holder = psycopg.connect(pg_url)  # a transaction left open
            try:
                row = codec.pack_row("s", [codec.encode_keyless(queued("s", at + 1))], at + 1, None)
                holder.execute("SELECT aalis_append(%s, %s, 1, false, %s)", (b"s", at, row[0]))
                outcome: list[Any] = []
                waiter = threading.Thread(
                    target=_append_into, args=(outcome, store, batch("s", at + 1, 2), at)
                )
                waiter.start()
                time.sleep(0.3)
                assert outcome == [] and waiter.is_alive()  # blocked on the row lock
                holder.commit() if commit else holder.rollback()
                waiter.join(timeout=30)
            finally:
                holder.close()
            if commit:
                assert isinstance(outcome[0], ConcurrencyConflict)
                assert (outcome[0].expected_seq, outcome[0].actual_seq) == (at, at + 1)
                assert store.read("s", at) == [queued("s", at + 1)]
            else:
                assert outcome == [at + 2]
                assert store.read("s", at) == batch("s", at + 1, 2)
        assert [r.position for r in store.read_all()] == [1, 2, 3, 4]


def _append_into(outcome: list[Any], store: PostgresEventStore, events: Any, at: int) -> None:
    try:
        outcome.append(store.append("s", events, at))
    except ConcurrencyConflict as exc:
        outcome.append(exc)


def test_concurrent_writers_get_dense_ordered_positions(pg_url: str) -> None:  # noqa: F811
    """Eight threads over two pools, each appending to its own session: every position
    is handed out once, with no gaps, and each session's events keep their order."""
    with PostgresEventStore(pg_url, max_size=4) as a, PostgresEventStore(pg_url) as b:

        def writer(n: int) -> None:
            store = a if n % 2 else b
            sid = f"w{n}"
            for i in range(25):
                store.append(sid, batch(sid, 2 * i + 1, 2), 2 * i)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        recorded = a.read_all()
        assert [r.position for r in recorded] == list(range(1, 8 * 50 + 1))
        for n in range(8):
            seqs = [r.event.seq for r in recorded if r.event.session_id == f"w{n}"]
            assert seqs == list(range(1, 51))
        assert a.count() == 400 and b.sessions() == sorted(f"w{n}" for n in range(8))


# --- atomicity ---------------------------------------------------------------------------


def test_a_rolled_back_batch_leaves_nothing(pg_url: str, store: PostgresEventStore) -> None:  # noqa: F811
    """The log row is refused after the session row and the head moved, in the same
    transaction: nothing of the batch stays, not its seq, position nor idle mark."""
    store.append("s", batch("s", 1, 1), 0)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused by test trigger'; END $$"
        )
        admin.execute(
            "CREATE TRIGGER refuse_row BEFORE INSERT ON aalis_log "
            "FOR EACH ROW WHEN (NEW.seq = 5) EXECUTE FUNCTION refuse()"
        )
        before = snapshot(store)
        with pytest.raises(StoreError, match="refused by test trigger"):
            store.append("s", batch("s", 2, 4), 1, open_work=False)
        assert snapshot(store) == before
        assert store.open_sessions() == ["s"]
        admin.execute("DROP TRIGGER refuse_row ON aalis_log")
    assert store.append("s", batch("s", 2, 4), 1, open_work=False) == 5
    assert [r.position for r in store.read_all()] == [1, 2, 3, 4, 5]
    assert store.open_sessions() == []


# --- damaged rows ------------------------------------------------------------------------


def test_a_garbage_row_is_a_corrupt_event_naming_session_and_seq(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    store.append("s", batch("s", 1, 1), 0)
    _raw_append(pg_url, "s", 1, 1, b"\xc1\x00garbage")
    assert store.append("s", batch("s", 3, 1), 2) == 3  # the bad row still counts
    with pytest.raises(CorruptEvent) as info:
        store.read("s")
    assert (info.value.session_id, info.value.seq) == ("s", 2)
    assert "'s'" in str(info.value) and "seq 2" in str(info.value)
    assert store.read("s", after_seq=2) == batch("s", 3, 1)
    with pytest.raises(CorruptEvent) as info_all:
        store.read_all()
    assert (info_all.value.session_id, info_all.value.seq) == ("s", 2)
    assert [r.position for r in store.read_all(2)] == [3]


def test_on_corrupt_receives_bad_rows_and_the_rest_are_returned(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    store.append("s", batch("s", 1, 1), 0)
    _raw_append(pg_url, "s", 1, 1, b"\xc1garbage")
    store.append("s", batch("s", 3, 2), 2)
    good = codec.pack_row("s", [codec.encode_keyless(queued("s", 5))], 5, None)[0]
    _raw_append(pg_url, "s", 4, 1, good[:-3] + b"\xff\xff\xff")  # a cut format-2 row
    seen: list[CorruptEvent] = []
    assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 1) + batch("s", 3, 2)
    assert [(c.session_id, c.seq) for c in seen] == [("s", 2), ("s", 5)]
    assert all(c.reason for c in seen)


def test_rows_deleted_by_hand_are_reported_missing_not_read_past(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    for at in (0, 2, 4):
        store.append("s", batch("s", at + 1, 2), at)  # rows ending at seqs 2, 4, 6
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM aalis_log WHERE seq = 4")
    with pytest.raises(CorruptEvent) as info:
        store.read("s")
    assert info.value.seq == 3 and "seqs 3-4 missing" in str(info.value)
    seen: list[CorruptEvent] = []
    assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2) + batch("s", 5, 2)
    assert [c.seq for c in seen] == [3]
    assert store.read("s", after_seq=4) == batch("s", 5, 2)
    seen.clear()
    assert store.read("s", after_seq=3, on_corrupt=seen.append) == batch("s", 5, 2)
    assert [c.reason for c in seen] == ["seq 4 missing: no row holds it"]
    # The last row gone: the session's row still says where its log ends.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM aalis_log WHERE seq = 6")
    seen.clear()
    assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2)
    assert [c.reason for c in seen] == ["seqs 3-6 missing: no row holds them"]
    with pytest.raises(CorruptEvent, match="seqs 5-6 missing"):
        store.read("s", after_seq=4)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM aalis_log")
    with pytest.raises(CorruptEvent, match="seqs 1-6 missing"):
        store.read("s")


def test_a_bad_row_after_rows_deleted_by_hand_names_the_missing_seqs_too(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    for at in (0, 2, 4):
        store.append("s", batch("s", at + 1, 2), at)  # rows ending at seqs 2, 4, 6
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM aalis_log WHERE seq = 4")
        # The row of seqs 5-6 cut short: its header still says where it starts.
        conn.execute("UPDATE aalis_log SET data = substring(data FOR length(data) - 3) WHERE seq=6")
    with pytest.raises(CorruptEvent) as info:
        store.read("s")
    assert info.value.seq == 5
    assert info.value.reason.startswith("a row of seqs 5-6: ")
    assert info.value.reason.endswith("; seqs 3-4 are missing (rows deleted?)")
    seen: list[CorruptEvent] = []
    assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2)
    assert [c.reason for c in seen] == [info.value.reason]


def test_a_row_repeating_seqs_read_before_is_reported_and_skipped(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    store.append("s", batch("s", 1, 2), 0)
    # Three events in a row keyed seq 3: it says it holds seqs 1-3, two of them read.
    parts = [codec.encode_keyless(e) for e in batch("s", 1, 3)]
    _raw_append(pg_url, "s", 2, 1, codec.pack_row("s", parts, 3, None)[0])
    store.append("s", batch("s", 4, 1), 3)
    with pytest.raises(CorruptEvent) as info:
        store.read("s")
    assert info.value.seq == 1 and "repeats seqs up to 2" in str(info.value)
    seen: list[CorruptEvent] = []
    assert store.read("s", on_corrupt=seen.append) == batch("s", 1, 2) + batch("s", 4, 1)
    assert [c.seq for c in seen] == [1]
    # Read from past the repeated seqs, the row holds the one asked for.
    assert [e.seq for e in store.read("s", after_seq=2)] == [3, 4]


def test_rows_in_format_1_are_read_with_the_others(
    pg_url: str,  # noqa: F811
    store: PostgresEventStore,
) -> None:
    store.append("s", batch("s", 1, 2), 0)
    _raw_append(pg_url, "s", 2, 1, codec.encode(queued("s", 3)))
    assert store.append("s", batch("s", 4, 2), 3) == 5
    assert store.read("s") == [*batch("s", 1, 2), queued("s", 3), *batch("s", 4, 2)]
    assert [r.position for r in store.read_all()] == [1, 2, 3, 4, 5]


def test_a_batch_is_one_compressed_row(pg_url: str, store: PostgresEventStore) -> None:  # noqa: F811
    events = one_of_every_event("s")
    store.append("s", events, 0)
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT seq, position, data FROM aalis_log").fetchall()
    assert [(seq, position) for seq, position, _ in rows] == [(20, 20)]
    data = rows[0][2]
    assert data[0] == codec.ROW_FORMAT and codec.row_header(data)[:2] == (0, 20)
    assert len(data) < sum(len(codec.encode(e)) for e in events) / 2


# --- read-only, reopening, opening -------------------------------------------------------


def _unindexable_id() -> str:
    """A session id whose UTF-8 bytes (about 4,000, not compressible) are more than a
    PostgreSQL b-tree index holds (2,704 bytes a row)."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    rng = random.Random(7)
    return "".join(rng.choice(letters) for _ in range(4000))


def test_a_session_id_too_long_to_index_is_refused_naming_its_size(
    store: PostgresEventStore,
) -> None:
    long_id = _unindexable_id()
    with pytest.raises(InvalidBatch) as info:
        store.append(long_id, batch(long_id, 1, 2), 0)
    message = str(info.value)
    assert "session id is 4,000 bytes" in message and "too long" in message
    assert len(message) < 1000  # the id is not repeated whole
    assert store.last_seq(long_id) == 0 and store.sessions() == []
    assert store.append("s", batch("s", 1, 1), 0) == 1  # the store goes on


def test_a_runtime_refuses_an_input_whose_session_id_is_too_long_to_index(
    store: PostgresEventStore,
) -> None:
    long_id = _unindexable_id()
    runtime = Runtime(store, Services(llm=ScriptedModel([ScriptedReply(text="好")])), janitor=False)
    try:
        with pytest.raises(InvalidBatch, match="session id is 4,000 bytes"):
            runtime.submit(long_id, Input(id="i1", content="在吗")).result(timeout=30)
        assert store.sessions() == []
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_read_only_reads_and_refuses_writes(pg_url: str) -> None:  # noqa: F811
    with PostgresEventStore(pg_url) as writer:
        writer.append("s", [queued("s", 1)], 0, open_work=False)
        with PostgresEventStore(pg_url, read_only=True) as reader:
            assert reader.read("s") == [queued("s", 1)]
            assert reader.open_sessions() == []
            with pytest.raises(StoreError, match="read-only"):
                reader.append("s", [queued("s", 2)], 1)
            with pytest.raises(StoreError, match="read-only"):
                reader.mark_idle([("s", 1)])
            writer.append("s", [queued("s", 2)], 1)  # the reader sees what the writer adds
            assert reader.read("s") == [queued("s", 1), queued("s", 2)]
            assert reader.open_sessions() == ["s"]
            # Its sessions are read-only on the server too, whatever runs on them.
            with (
                reader._pool.connection() as conn,
                pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
            ):
                conn.execute("DELETE FROM aalis_log")
        assert writer.count() == 2


def test_read_only_needs_the_tables(pg_url: str) -> None:  # noqa: F811
    with pytest.raises(StoreError, match="no event table"):
        PostgresEventStore(pg_url, read_only=True)
    with psycopg.connect(pg_url) as conn:  # nothing was created
        assert conn.execute("SELECT to_regclass('aalis_log')").fetchone() == (None,)


def test_data_survives_close_and_reopen(pg_url: str) -> None:  # noqa: F811
    events = one_of_every_event("s")
    with PostgresEventStore(pg_url) as store:
        store.append("s", events, 0)
        store.append("t", batch("t", 1, 2), 0, open_work=False)
        before = snapshot(store)
    with PostgresEventStore(pg_url) as store:
        assert snapshot(store) == before
        assert store.append("s", batch("s", 21, 1), 20) == 21
        assert [r.position for r in store.read_all()] == list(range(1, 24))
        assert store.open_sessions() == ["s"]
        assert store.count() == 23 and store.count("t") == 2


def test_an_unreachable_server_is_a_store_error_without_the_password() -> None:
    url = "postgresql://someone:hunter2@127.0.0.1:1/nowhere"
    with pytest.raises(StoreError, match="cannot open event database") as info:
        PostgresEventStore(url, timeout_s=2)
    assert "hunter2" not in str(info.value) and "***" in str(info.value)
    assert redact_url("host=x password='a b' user=y") == "host=x password=*** user=y"
    assert (
        redact_url("postgresql://u@h/db?password=p&x=1") == "postgresql://u@h/db?password=***&x=1"
    )


def test_open_store_chooses_by_target(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    assert is_postgres_url(pg_url) and is_postgres_url("postgres://h/db")
    assert not is_postgres_url(str(tmp_path / "x.db")) and not is_postgres_url(tmp_path)
    with open_store(pg_url) as store:
        assert isinstance(store, PostgresEventStore) and not store.read_only
        store.append("s", [queued("s", 1)], 0)
    with open_store(pg_url, read_only=True) as store:
        assert isinstance(store, PostgresEventStore) and store.read_only
        assert store.read("s") == [queued("s", 1)]
    with open_store(tmp_path / "events.db") as sqlite_store:
        assert isinstance(sqlite_store, SqliteEventStore)
        sqlite_store.append("s", [queued("s", 1)], 0)
    with open_store(str(tmp_path / "events.db"), read_only=True) as sqlite_store:
        assert isinstance(sqlite_store, SqliteEventStore) and sqlite_store.read_only
        with pytest.raises(StoreError, match="read-only"):
            sqlite_store.append("s", [queued("s", 2)], 1)


# --- the runtime over Postgres -----------------------------------------------------------


def test_a_runtime_turn_end_to_end(pg_url: str) -> None:  # noqa: F811
    """A turn with a tool call and a reply, its log in Postgres; a second runtime on the
    same database finds nothing to recover and reads the same history."""
    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="call-1", name="echo", arguments="{}"),)),
            ScriptedReply(text="你好！"),
        ]
    )
    tools = ToolRegistry([Tool("echo", lambda args, ctx: "回声")])
    store = PostgresEventStore(pg_url)
    runtime = Runtime(store, Services(llm=model, tools=tools), janitor=False)
    try:
        handle = runtime.submit("qq:group:1", Input(id="", content="在吗"))
        outcome = handle.result(timeout=60)
        assert outcome.outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()
        store.close()
    with PostgresEventStore(pg_url) as again:
        log = again.read("qq:group:1")
        assert [e.seq for e in log] == list(range(1, len(log) + 1))
        assert any(isinstance(e, ToolFinished) and e.result == "回声" for e in log)
        assert [e.outcome for e in log if isinstance(e, TurnRecorded)] == ["replied"]
        assert [r.event for r in again.read_all()] == log
        second = Runtime(again, Services(llm=ScriptedModel([])), janitor=False)
        try:
            assert second.recover() == []
        finally:
            second.shutdown(timeout=10)
            pykka.ActorRegistry.stop_all()
