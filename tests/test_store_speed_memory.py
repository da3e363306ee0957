"""The append fast path: a row's plaintext encoded and checked in one call
(``store.encode_row``) and rows packed by a writer's in-place ``codec.RowChain`` give the
same bytes, the same refusals and the same rows as the event-by-event path they replace
(``encode_batch``, ``encode_keyless`` and ``pack_row``), which readers rebuild on their own.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from aalis_agent.events import InputQueued, InvalidBatch, SqliteEventStore, codec
from aalis_agent.events.errors import ConcurrencyConflict
from aalis_agent.events.schema import ChatMessage, MessageSaved, SessionEvent
from aalis_agent.events.store import encode_batch, encode_row
from hypothesis import given, settings
from hypothesis import strategies as st

SESSION = "qq:group:会话"


def _events(sizes: Sequence[int], text: str = "你好") -> list[list[SessionEvent]]:
    """Batches of ``sizes`` events, seqs following on from 1."""
    batches: list[list[SessionEvent]] = []
    seq = 0
    for size in sizes:
        batch: list[SessionEvent] = []
        for _ in range(size):
            seq += 1
            batch.append(
                MessageSaved(
                    session_id=SESSION,
                    seq=seq,
                    at=seq,
                    message=ChatMessage(id=f"m{seq}", role="user", content=f"{text} {seq}"),
                )
            )
        batches.append(batch)
    return batches


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 140), min_size=1, max_size=40),
    text=st.sampled_from(["你好", "x" * 3000, "a long line " * 40]),
    drops=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_a_chain_packs_the_rows_pack_row_packs(
    sizes: list[int], text: str, drops: list[bool]
) -> None:
    """The rows pack_row packs, as a reader reads them, across group ends, rows larger
    than the context and counts that take more than one header byte: each row going on
    from the compressor the chain kept from the row before, or (``drops``) from a new
    one. A row that starts a group is the same bytes either way."""
    chain = codec.RowChain(SESSION)
    after: codec.RowContext | None = None
    rows: list[tuple[int, bytes]] = []
    for batch, drop in zip(_events(sizes, text), drops, strict=False):
        last = batch[-1].seq
        body = encode_row(batch)
        assert body == codec._array_header(len(batch)) + b"".join(
            codec.encode_keyless(e) for e in batch
        )
        old, after = codec.pack_row(SESSION, [codec.encode_keyless(e) for e in batch], last, after)
        if drop:
            chain.drop_compressor()
        row, depth, deflate = chain.pack(body, len(batch), last)
        assert codec.row_header(row) == codec.row_header(old)
        assert codec.row_header(row)[0] == depth == after.depth  # type: ignore[index]
        if depth == 0:
            assert row == old
        assert bytes(chain.dictionary(False)) == codec._head(SESSION)
        chain.advance(last, depth, body, deflate)
        assert bytes(chain.dictionary(True)) == after.zdict
        rows.append((last, row))
    reader = codec.RowReader(SESSION)
    assert [e for seq, row in rows for e in reader.read(seq, row)] == [
        e for batch in _events(sizes, text)[: len(rows)] for e in batch
    ]


def test_a_chain_starts_a_group_when_the_row_before_is_not_its_last() -> None:
    first, second = _events([2, 3])
    chain = codec.RowChain(SESSION)
    body = encode_row(first)
    _, depth, deflate = chain.pack(body, 2, 2)
    chain.advance(2, depth, body, deflate)
    body = encode_row(second)
    assert chain.pack(body, 3, 5)[1] == 1  # follows seq 2
    assert chain.pack(body, 3, 6)[1] == 0  # a gap: a new group
    parts = [codec.encode_keyless(e) for e in second]
    assert chain.pack_first(body, 3)[0] == codec.pack_row(SESSION, parts, 5, None)[0]


def test_a_kept_compressor_is_used_once_and_only_for_the_row_it_wrote() -> None:
    """``pack`` takes the compressor the chain kept (a second pack of the same row makes
    its own), and one kept for another row is not used: every row reads back."""
    first, second, third = _events([2, 3, 1])
    chain = codec.RowChain(SESSION)
    body = encode_row(first)
    row1, depth, deflate = chain.pack(body, 2, 2)
    chain.advance(2, depth, body, deflate)
    body2 = encode_row(second)
    row2, _, kept = chain.pack(body2, 3, 5)
    assert kept is deflate  # went on from the row before
    again, _, other = chain.pack(body2, 3, 5)  # the kept one is taken: a new compressor
    assert other is not deflate
    chain.advance(5, 1, body2, None)  # stored without a compressor to keep
    body3 = encode_row(third)
    row3, _, fresh = chain.pack(body3, 1, 6)
    assert fresh is not kept and fresh is not other
    for candidate in (row2, again):
        reader = codec.RowReader(SESSION)
        read = [*reader.read(2, row1), *reader.read(5, candidate), *reader.read(6, row3)]
        assert read == [*first, *second, *third]


@pytest.mark.parametrize(
    "bad",
    [
        {"message": ChatMessage(id="m", role="user", content=None)},  # type: ignore[arg-type]
        {"message": ChatMessage(id="m", role="user", content="x", reasoning=2**70)},  # type: ignore[arg-type]
    ],
    ids=["wrong-type", "too-big"],
)
def test_encode_row_refuses_what_encode_batch_refuses(bad: dict[str, object]) -> None:
    good = _events([2])[0]
    broken = MessageSaved(session_id=SESSION, seq=3, at=3, **bad)  # type: ignore[arg-type]
    batch = [*good, broken]
    with pytest.raises(InvalidBatch) as old:
        encode_batch(batch, keyless=True)
    with pytest.raises(InvalidBatch) as new:
        encode_row(batch)
    assert str(new.value) == str(old.value)
    assert f"session {SESSION!r} seq 3 (MessageSaved)" in str(new.value)


def test_a_refused_or_conflicting_append_writes_nothing_and_the_next_continues(
    tmp_path: Path,
) -> None:
    store = SqliteEventStore(tmp_path / "x.db")
    first, second = _events([2, 2])
    assert store.append(SESSION, first, 0) == 2
    bad = [*second[:1], MessageSaved(session_id=SESSION, seq=4, at=4, message=None)]  # type: ignore[arg-type]
    with pytest.raises(InvalidBatch):
        store.append(SESSION, bad, 2)
    with pytest.raises(ConcurrencyConflict):  # a writer a row behind
        store.append(SESSION, [codec.restamp(e, seq=e.seq - 1) for e in second], 1)
    assert store.append(SESSION, second, 2) == 4
    rows = store._conn.execute("SELECT data FROM log ORDER BY seq").fetchall()
    # The conflict made the store forget what it remembered: the next row starts a group.
    assert [codec.row_header(r[0])[0] for r in rows] == [0, 0]  # type: ignore[index]
    assert store._contexts[SESSION].seq == 4
    store.close()
    again = SqliteEventStore(tmp_path / "x.db", read_only=True)
    assert again.read(SESSION) == first + second
    again.close()


def test_a_store_keeps_one_chain_per_session_and_rewrites_it_in_place(tmp_path: Path) -> None:
    """Appends to a session reuse its chain's buffer (no new dictionary per row), up to
    the store's bound on sessions remembered."""
    store = SqliteEventStore(tmp_path / "x.db")
    last = 0
    for n in range(40):  # past a group's end
        event = InputQueued(session_id="s", seq=last + 1, input_id=f"in-{n}")
        last = store.append("s", [event], last)
        if n == 0:
            chain = store._contexts["s"]
            buffer = chain._buf
    assert store._contexts["s"] is chain and chain._buf is buffer
    assert chain.seq == 40 and chain.depth == 40 - codec.GROUP_ROWS - 1
    store.close()


def test_a_kept_compressor_out_of_step_with_the_dictionary_is_not_trusted() -> None:
    """A compressor whose window no longer ends as the dictionary does (a pack racing
    an advance of the same chain) would write a row no reader can inflate: the pack
    notices when it inflates the row back, and packs it afresh."""
    first, second = _events([2, 3])
    chain = codec.RowChain(SESSION)
    body = encode_row(first)
    row1, depth, deflate = chain.pack(body, 2, 2)
    chain.advance(2, depth, body, deflate)
    deflate.compress(b"\x93" + b"bytes the reader never saw " * 40)
    deflate.flush(zlib.Z_SYNC_FLUSH)
    body2 = encode_row(second)
    row2, depth2, used = chain.pack(body2, 3, 5)
    assert depth2 == 1 and used is not deflate
    reader = codec.RowReader(SESSION)
    assert [*reader.read(2, row1), *reader.read(5, row2)] == [*first, *second]


def _append_one(store: SqliteEventStore, name: str, open_work: bool | None) -> None:
    """One user message appended to ``name``'s log, after its last event."""
    last = store.last_seq(name)
    event = MessageSaved(
        session_id=name,
        seq=last + 1,
        at=last + 1,
        message=ChatMessage(id=f"m{last}", role="user", content=f"{name} {last}"),
    )
    store.append(name, [event], last, open_work=open_work)


def test_only_sessions_with_open_work_written_last_keep_a_compressor(tmp_path: Path) -> None:
    """A kept compressor is about 30 KiB: a session keeps one while it has open work (the
    appends of a turn), at most the 64 written last do, and of the idle sessions only the
    two written last keep theirs (memory does not grow with sessions passivated and
    revived); every row reads back."""
    from aalis_agent.events import sqlite as sqlite_store

    store = SqliteEventStore(tmp_path / "many.db")
    names = [f"s{i}" for i in range(sqlite_store._COMPRESSORS + 6)]

    def append(name: str, open_work: bool | None = None) -> None:
        _append_one(store, name, open_work)

    try:
        for _ in range(2):
            for name in names:
                append(name, open_work=True)
        kept = [n for n in names if store._contexts[n]._deflate is not None]
        assert kept == names[-sqlite_store._COMPRESSORS :]
        for name in names[-3:]:
            append(name, open_work=False)  # the turn ended: the session idles
        kept = [n for n in names if store._contexts[n]._deflate is not None]
        assert kept == names[-sqlite_store._COMPRESSORS : -3] + names[-2:]
        assert list(store._compressing) == names[-sqlite_store._COMPRESSORS : -3]
        assert list(store._idle_compressing) == names[-2:]
        idle_kept = store._contexts[names[-1]]._deflate
        append(names[-1], open_work=True)  # its next turn goes on from the one it kept
        assert store._contexts[names[-1]]._deflate is idle_kept
        assert list(store._idle_compressing) == [names[-2]]
        append(names[-3], open_work=True)  # idle without one: its next turn makes a new one
        assert store._contexts[names[-3]]._deflate is not None
        assert list(store._compressing)[-2:] == [names[-1], names[-3]]
        assert [len(store.read(n)) for n in names] == [2] * (len(names) - 3) + [4, 3, 4]
    finally:
        store.close()


def test_a_store_keeps_bounded_memory_of_the_sessions_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that serves new sessions for weeks: the store's per-session numbers, last
    seqs and idle marks are kept for a bounded number of sessions; what it let go is read
    again from the database, so appends still continue (and a stale one still
    conflicts), idle marks still land and readers in log order still name every row."""
    from aalis_agent.events import sqlite as sqlite_store

    monkeypatch.setattr(sqlite_store, "_SESSIONS", 8)
    path = tmp_path / "many.db"
    store = SqliteEventStore(path)
    names = [f"s{i}" for i in range(40)]

    def append(name: str, open_work: bool) -> None:
        _append_one(store, name, open_work)

    try:
        for open_work in (True, False):  # a turn's open, then its end (idle)
            for name in names:
                append(name, open_work)
                for cache in (store._seq_cache, store._idle_cache, store._sids, store._names):
                    assert len(cache) <= 8
            assert store.open_sessions() == (sorted(names) if open_work else [])
        stale = MessageSaved(
            session_id="s0", seq=2, at=2, message=ChatMessage(id="x", role="user", content="x")
        )
        with pytest.raises(ConcurrencyConflict):
            store.append("s0", [stale], 1)  # s0 holds 2 events: its seq was read back
        assert [len(store.read(n)) for n in names] == [2] * len(names)
        assert [(r.event.session_id, r.event.seq) for r in store.read_all()] == [
            (n, seq) for seq in (1, 2) for n in names
        ]
    finally:
        store.close()
    reader = SqliteEventStore(path, read_only=True)  # a reader with nothing cached
    try:
        assert len(reader.read_all()) == 80
    finally:
        reader.close()
