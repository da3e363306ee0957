"""A stateful property test: the SQLite store behaves exactly like the in-memory one.

Two writers append small batches to a few sessions, each from its own (possibly stale)
idea of where every log ends, so appends race and conflict; readers poke at every query.
Both stores must give the same answer, or refuse with the same error, every time, and
both must agree with a plain-Python model of the logs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from aalis_agent.events import codec
from aalis_agent.events.codec import restamp
from aalis_agent.events.errors import ConcurrencyConflict, InvalidBatch
from aalis_agent.events.schema import ChatMessage, InputQueued, MessageSaved, SessionEvent
from aalis_agent.events.sqlite import SqliteEventStore
from aalis_agent.events.store import InMemoryEventStore, Recorded
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

SESSIONS = ("a", "B", "会话", "")
UNKNOWN = ("nobody", "A", "会")
WRITERS = (0, 1)

TEXT = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["你好", "对话开始了", "😀", "é", "\u0000", "ｆｕｌｌ"]),
)
AT = st.integers(min_value=0, max_value=2**53)
# A payload is a function of (session_id, seq): the event a writer would log there.
PAYLOADS = st.one_of(
    st.builds(
        lambda input_id, at: (
            lambda sid, seq: InputQueued(session_id=sid, seq=seq, at=at, input_id=input_id)
        ),
        TEXT,
        AT,
    ),
    st.builds(
        lambda mid, role, content, at: (
            lambda sid, seq: MessageSaved(
                session_id=sid,
                seq=seq,
                at=at,
                message=ChatMessage(id=mid, role=role, content=content),
            )
        ),
        TEXT,
        st.sampled_from(["user", "assistant", "system", "tool"]),
        TEXT,
        AT,
    ),
)


def outcome(call: Any) -> tuple[Any, ...]:
    """What a store call did: its result, or which refusal (with its details)."""
    try:
        return ("ok", call())
    except ConcurrencyConflict as exc:
        return ("conflict", exc.session_id, exc.expected_seq, exc.actual_seq)
    except InvalidBatch as exc:
        return ("invalid", str(exc))


class StoreMachine(RuleBasedStateMachine):
    """The in-memory store against one SQLite connection to an in-memory database."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = InMemoryEventStore()
        self.sqls = self.open_sqlite()
        self.current = 0  # which SQLite connection serves the next call
        self.model: dict[str, list[SessionEvent]] = {}
        self.order: list[SessionEvent] = []
        # Each writer's belief of every log's last seq: stale after the other one writes.
        self.known: list[dict[str, int]] = [dict.fromkeys(SESSIONS, 0) for _ in WRITERS]

    def open_sqlite(self) -> list[SqliteEventStore]:
        return [SqliteEventStore(":memory:")]

    @property
    def sql(self) -> SqliteEventStore:
        return self.sqls[self.current]

    def teardown(self) -> None:
        for store in self.sqls:
            store.close()
        self.mem.close()

    def _last(self, session_id: str) -> int:
        return len(self.model.get(session_id, []))

    def _append_both(
        self, session_id: str, events: list[SessionEvent], expected_seq: int
    ) -> tuple[Any, ...]:
        got_mem = outcome(lambda: self.mem.append(session_id, events, expected_seq))
        got_sql = outcome(lambda: self.sql.append(session_id, events, expected_seq))
        assert got_mem == got_sql, (session_id, expected_seq, events)
        return got_mem

    def _commit(self, session_id: str, events: list[SessionEvent]) -> None:
        if events:
            self.model.setdefault(session_id, []).extend(events)
            self.order.extend(events)

    # --- writing ---------------------------------------------------------------------

    @rule(
        writer=st.sampled_from(WRITERS),
        session_id=st.sampled_from(SESSIONS),
        payloads=st.lists(PAYLOADS, max_size=5),
        skew=st.sampled_from([0, 0, 0, 0, 1, 2, -1]),
    )
    def writer_appends(self, writer: int, session_id: str, payloads: list[Any], skew: int) -> None:
        """A writer appends after the seq it believes is last (skewed: ahead or behind)."""
        expected = self.known[writer][session_id] + skew
        events = [p(session_id, expected + i) for i, p in enumerate(payloads, start=1)]
        result = self._append_both(session_id, events, expected)
        actual = self._last(session_id)
        if expected < 0:
            assert result[0] == "invalid"
        elif expected == actual:
            assert result == ("ok", actual + len(events))
            self._commit(session_id, events)
            event("append: ok" if events else "append: ok, empty")
            self.known[writer][session_id] = actual + len(events)
        else:
            assert result == ("conflict", session_id, expected, actual)
            event("append: conflict")
            self.known[writer][session_id] = actual  # the conflict tells it where the log is

    @initialize(
        seeds=st.lists(
            st.tuples(st.sampled_from(SESSIONS), st.lists(PAYLOADS, max_size=6)), max_size=4
        )
    )
    def seed_logs(self, seeds: list[tuple[str, list[Any]]]) -> None:
        """Start from a few non-empty logs, so reads and pages have something to cover."""
        for session_id, payloads in seeds:
            self.up_to_date_writer_appends(session_id, payloads)

    @rule(session_id=st.sampled_from(SESSIONS), payloads=st.lists(PAYLOADS, max_size=5))
    def up_to_date_writer_appends(self, session_id: str, payloads: list[Any]) -> None:
        """A writer that has just read the log appends: it never conflicts."""
        expected = self._last(session_id)
        events = [p(session_id, expected + i) for i, p in enumerate(payloads, start=1)]
        assert self._append_both(session_id, events, expected) == ("ok", expected + len(events))
        self._commit(session_id, events)

    @rule(writer=st.sampled_from(WRITERS), session_id=st.sampled_from(SESSIONS))
    def writer_refreshes(self, writer: int, session_id: str) -> None:
        last = self.mem.last_seq(session_id)
        assert last == self.sql.last_seq(session_id) == self._last(session_id)
        self.known[writer][session_id] = last

    @rule(
        session_id=st.sampled_from(SESSIONS),
        payloads=st.lists(PAYLOADS, min_size=2, max_size=4),
        flaw=st.sampled_from(["gap", "repeat", "foreign", "start"]),
        where=st.integers(min_value=0, max_value=3),
    )
    def malformed_batch(self, session_id: str, payloads: list[Any], flaw: str, where: int) -> None:
        """A batch with a seq gap, a repeated seq or another session's event is refused."""
        expected = self._last(session_id)
        events = [p(session_id, expected + i) for i, p in enumerate(payloads, start=1)]
        k = where % len(events)
        bad = events[k]
        if flaw == "gap":
            events[k] = restamp(bad, seq=bad.seq + 1)
        elif flaw == "repeat":
            events[k] = restamp(bad, seq=bad.seq - 1)
        elif flaw == "foreign":
            events[k] = restamp(bad, seq=bad.seq, session_id=session_id + "-x")
        else:
            events = [restamp(e, seq=e.seq + 1) for e in events]
        event(f"malformed: {flaw}")
        result = self._append_both(session_id, events, expected)
        assert result[0] == "invalid"

    @rule(session_id=st.sampled_from(SESSIONS + UNKNOWN), skew=st.sampled_from([0, -1, 1]))
    def empty_append(self, session_id: str, skew: int) -> None:
        expected = self._last(session_id) + skew
        result = self._append_both(session_id, [], expected)
        if expected < 0:
            assert result[0] == "invalid"
        elif skew == 0:
            assert result == ("ok", expected)
        else:
            assert result[0] == "conflict"

    @rule(which=st.integers(min_value=0, max_value=1))
    def switch_connection(self, which: int) -> None:
        """Later calls go through another connection (a no-op with only one)."""
        self.current = which % len(self.sqls)

    # --- reading ---------------------------------------------------------------------

    @rule(
        session_id=st.sampled_from(SESSIONS + UNKNOWN),
        after_seq=st.integers(min_value=-2, max_value=14),
    )
    def read(self, session_id: str, after_seq: int) -> None:
        got = self.mem.read(session_id, after_seq)
        assert got == self.sql.read(session_id, after_seq)
        assert got == [e for e in self.model.get(session_id, []) if e.seq > after_seq]

    @rule(data=st.data(), limit=st.none() | st.integers(min_value=0, max_value=8))
    def read_all(self, data: st.DataObject, limit: int | None) -> None:
        after_position = data.draw(
            st.integers(min_value=-1, max_value=len(self.order) + 2), label="after_position"
        )
        got = self.mem.read_all(after_position, limit)
        assert got == self.sql.read_all(after_position, limit)
        start = max(after_position, 0)
        stop = None if limit is None else start + limit
        want = [Recorded(i + 1, e) for i, e in enumerate(self.order)][start:stop]
        assert got == want

    @rule(data=st.data())
    def page_through_read_all(self, data: st.DataObject) -> None:
        """Paging with a small limit from any position yields the rest of the log once."""
        page_size = data.draw(st.integers(min_value=1, max_value=5), label="page_size")
        after = data.draw(st.integers(min_value=0, max_value=len(self.order)), label="after")
        for store in (self.mem, self.sql):
            seen: list[Recorded] = []
            position = after
            while page := store.read_all(position, page_size):
                assert len(page) <= page_size
                seen.extend(page)
                position = page[-1].position
            assert [r.position for r in seen] == list(range(after + 1, len(self.order) + 1))
            assert [r.event for r in seen] == self.order[after:]

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def last_seqs_agree(self) -> None:
        for session_id in SESSIONS + UNKNOWN:
            last = self.mem.last_seq(session_id)
            assert last == self._last(session_id)
            assert all(sql.last_seq(session_id) == last for sql in self.sqls)

    @invariant()
    def sessions_agree(self) -> None:
        names = self.mem.sessions()
        assert names == sorted(s for s, log in self.model.items() if log)
        assert all(sql.sessions() == names for sql in self.sqls)

    @invariant()
    def counts_agree(self) -> None:
        for sql in self.sqls:
            assert sql.count() == len(self.order)
            for session_id in SESSIONS:
                assert sql.count(session_id) == self._last(session_id)


class TwoConnectionStoreMachine(StoreMachine):
    """As above, but the SQLite side is two stores on one file, used in turn.

    Each connection caches last seqs and the last position between appends; the other
    connection's commits must invalidate those caches, or positions collide or a stale
    seq is accepted.
    """

    def open_sqlite(self) -> list[SqliteEventStore]:
        self.tmpdir = tempfile.mkdtemp(prefix="store-machine-")
        path = os.path.join(self.tmpdir, "events.db")
        return [SqliteEventStore(path), SqliteEventStore(path)]

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    @rule(which=st.integers(min_value=0, max_value=1))
    def reopen(self, which: int) -> None:
        """A connection is closed and opened again, as after a restart: it has forgotten
        the rows it wrote, so its next batch starts a new group."""
        path = self.sqls[which].path
        self.sqls[which].close()
        self.sqls[which] = SqliteEventStore(path)


class SmallGroupStoreMachine(TwoConnectionStoreMachine):
    """As above, with groups of at most two rows: reads from inside a group, groups that
    end and start again, all the more often."""

    def __init__(self) -> None:
        self.group_rows = codec.GROUP_ROWS
        codec.GROUP_ROWS = 2
        super().__init__()

    def teardown(self) -> None:
        codec.GROUP_ROWS = self.group_rows
        super().teardown()


FAST = settings(max_examples=60, stateful_step_count=30, deadline=None)
StoreMachine.TestCase.settings = FAST
TwoConnectionStoreMachine.TestCase.settings = FAST
SmallGroupStoreMachine.TestCase.settings = FAST
TestStoreMachine = StoreMachine.TestCase
TestTwoConnectionStoreMachine = TwoConnectionStoreMachine.TestCase
TestSmallGroupStoreMachine = SmallGroupStoreMachine.TestCase
