"""An input sent again under an id its session already received, past one process: over
the PostgreSQL store (a real, throwaway cluster, ``tests/pg.py``), with session leases
(``PostgresLeases``), runtimes in other processes SIGKILLed, and the Ray routing client.

Whichever runtime the retry reaches (the owner, the next owner after a takeover, a
second process after the first was killed mid-turn or after its turn), the input never
runs twice: the retry follows it, or is answered from the log with how it ended.

This file is also the worker killed by the tests: ``python
tests/test_resubmit_distributed.py URL SIDE MODE`` (see :func:`worker`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")

import msgspec
import psycopg
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    FixedClock,
    Input,
    InputReceived,
    MessageSaved,
    ModelCallStarted,
    SessionFailed,
    TurnRecorded,
)
from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.scale.leases import PostgresLeases
from aalis_agent.scale.ownership import SessionOwnedElsewhere
from aalis_agent.services import ChatRequest, ScriptedModel, ScriptedReply, Services

from tests.faults import RunIds, wait_until
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures

ROOT = Path(__file__).resolve().parent.parent
SID = "qq:group:9"
TTL_S = 1.0


class Gate:
    """A model whose calls wait for ``go`` (set by default), counting them; its replies
    name the runtime (``甲1``, ``乙1``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.go = threading.Event()
        self.go.set()
        self.called = threading.Event()
        self.model = ScriptedModel(self._reply)

    def _reply(self, request: ChatRequest, n: int) -> ScriptedReply:
        self.called.set()
        assert self.go.wait(30)
        return ScriptedReply(text=f"{self.name}{n}")

    @property
    def calls(self) -> int:
        return self.model.calls


class Node:
    """A runtime over the shared log, with leases of its own (owner ``node-<tag>``)."""

    def __init__(self, url: str, tag: str, name: str, *, leases: bool = True) -> None:
        self.store = PostgresEventStore(url)
        self.leases = (
            PostgresLeases(self.store, owner=f"node-{tag}", ttl_s=TTL_S) if leases else None
        )
        self.gate = Gate(name)
        self.runtime = Runtime(
            self.store,
            Services(llm=self.gate.model),
            FixedClock(),
            RunIds(tag),
            janitor=False,
            ownership=self.leases,
        )

    def close(self) -> None:
        self.gate.go.set()
        self.runtime.shutdown(timeout=10)
        if self.leases is not None:
            self.leases.close()
        self.store.close()


@pytest.fixture
def nodes(pg_url: str) -> Iterator[list[Node]]:  # noqa: F811
    made: list[Node] = []
    yield made
    for node in reversed(made):
        node.close()


def _expire_leases(url: str) -> None:
    """As if every holder had stopped renewing a ttl ago (it paused, or died)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE aalis_leases SET expires_at = now() - interval '1 s'")


def _received(store: PostgresEventStore, input_id: str) -> int:
    return sum(
        1 for e in store.read(SID) if isinstance(e, InputReceived) and e.input.id == input_id
    )


def _model_calls(store: PostgresEventStore) -> int:
    return sum(1 for e in store.read(SID) if isinstance(e, ModelCallStarted))


X = Input(id="x", content="你好")


# --- one process, two runtimes -----------------------------------------------------------


def test_a_retry_at_the_next_owner_after_a_takeover_is_answered_from_the_log(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
) -> None:
    """A runs x to its end; its lease lapses and B takes the session over when x comes
    again: B answers it with A's turn (A's reply text, read back from the log), writes
    nothing and calls no model."""
    a = Node(pg_url, "a", "甲")
    b = Node(pg_url, "b", "乙")
    nodes += [a, b]
    first = a.runtime.submit(SID, X).result(30)
    assert first.outcome == "replied" and first.reply == "甲1"
    with pytest.raises(SessionOwnedElsewhere, match="node-a"):
        b.runtime.submit(SID, X)  # A still holds it: refused, nothing written
    _expire_leases(pg_url)
    before = b.store.read(SID)
    again = b.runtime.submit(SID, Input(id="x", content="你好", timestamp=99))
    assert again.where == "handled"
    assert again.result(0) == first
    assert b.store.read(SID) == before
    assert (a.gate.calls, b.gate.calls) == (1, 0)
    assert b.leases is not None and b.leases.held() == [SID]


def test_a_retry_at_the_next_owner_while_the_first_owner_is_mid_turn_runs_nothing_twice(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
) -> None:
    """A's turn of x waits inside its model call when A's lease lapses (A paused) and x
    comes again to B: B takes the session over and records A's turn as cut (its input
    was carried by a model call: not run again), and the retry is answered with that.
    A, resuming, is fenced: its reply is never recorded; x was sent to a model once."""
    a = Node(pg_url, "a", "甲")
    b = Node(pg_url, "b", "乙")
    nodes += [a, b]
    a.gate.go.clear()
    handle = a.runtime.submit(SID, X)
    assert a.gate.called.wait(30)
    _expire_leases(pg_url)
    again = b.runtime.submit(SID, X)
    outcome = again.result(30)
    assert (outcome.input_id, outcome.outcome, outcome.reason) == ("x", "aborted", "crash")
    a.gate.go.set()
    with pytest.raises(SessionFailed, match="ConcurrencyConflict"):  # A is fenced
        handle.result(30)
    assert _received(b.store, "x") == 1
    assert (a.gate.calls, b.gate.calls) == (1, 0)
    recorded = [e for e in b.store.read(SID) if isinstance(e, TurnRecorded)]
    assert [(e.outcome, e.reason) for e in recorded] == [("aborted", "crash")]
    # and sent once more, B answers it from its log at once
    assert b.runtime.submit(SID, X).result(0) == outcome


def test_two_runtimes_racing_the_same_id_run_it_once(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
) -> None:
    """x sent to A and to B at the same moment: one takes the session's lease and runs
    x, the other is refused naming it, nothing written; sent again there once the
    first let go of the session, x is answered with the first one's outcome.
    (Without an ownership, runtimes sharing a log are not supported: the second one
    takes the first's live turn for one cut by a crash.)"""
    a = Node(pg_url, "a", "甲")
    b = Node(pg_url, "b", "乙")
    nodes += [a, b]
    start = threading.Barrier(2)
    got: dict[str, Any] = {}

    def send(node: Node) -> None:
        start.wait(10)
        try:
            got[node.gate.name] = node.runtime.submit(SID, X)
        except Exception as exc:
            got[node.gate.name] = exc

    threads = [threading.Thread(target=send, args=(n,)) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    accepted = {k: v for k, v in got.items() if not isinstance(v, Exception)}
    refused = {k: v for k, v in got.items() if isinstance(v, Exception)}
    assert len(accepted) == 1 and len(refused) == 1, got
    (winner_name, handle), (_, error) = *accepted.items(), *refused.items()
    assert isinstance(error, SessionOwnedElsewhere), error
    first = handle.result(30)
    assert first.outcome == "replied" and first.reply == f"{winner_name}1"
    winner, loser = (a, b) if winner_name == "甲" else (b, a)
    assert winner.runtime.passivate_idle(0) == 1  # lets go: the other may take it now
    again = loser.runtime.submit(SID, X)
    assert (again.where, again.result(0)) == ("handled", first)
    assert _received(a.store, "x") == 1 and _model_calls(a.store) == 1
    assert (winner.gate.calls, loser.gate.calls) == (1, 0)


# --- a reply that does not read back ----------------------------------------------------


def _damage_row_holding(url: str, seq: int) -> None:
    """Overwrite the log row holding ``seq`` with bytes that do not decode (its header
    kept: the row still says how many events it holds)."""
    from aalis_agent.events.codec import row_header

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT seq, data FROM aalis_log WHERE seq >= %s ORDER BY seq LIMIT 1", (seq,)
        ).fetchone()
        assert row is not None
        data = bytes(row[1])
        header = row_header(data)
        assert header is not None
        bad = data[: header[2]] + b"\xff" * 24
        conn.execute("UPDATE aalis_log SET data = %s WHERE seq = %s", (bad, row[0]))


def test_a_retry_whose_reply_row_is_corrupt_is_a_clear_error_and_the_session_goes_on(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
) -> None:
    """The row holding x's reply was damaged after x ran. x sent again: the caller gets a
    CorruptEvent naming the session and the seq, nothing is written, no model is
    called, and the session still takes new inputs."""
    a = Node(pg_url, "a", "甲", leases=False)
    nodes.append(a)
    first = a.runtime.submit(SID, X).result(30)
    assert first.outcome == "replied"
    reply_seq = next(
        e.seq
        for e in a.store.read(SID)
        if isinstance(e, MessageSaved) and e.message.role == "assistant"
    )
    last = a.store.last_seq(SID)
    _damage_row_holding(pg_url, reply_seq)
    from aalis_agent.events.errors import CorruptEvent

    with pytest.raises(CorruptEvent) as info:
        a.runtime.submit(SID, X)
    assert info.value.session_id == SID
    assert info.value.seq <= reply_seq and "cannot decode" in str(info.value)
    assert a.store.last_seq(SID) == last  # nothing written
    assert a.gate.calls == 1
    assert a.runtime.quarantined() == []
    after = a.runtime.submit(SID, Input(id="y", content="还在吗")).result(30)
    assert after.outcome == "replied" and a.gate.calls == 2


# --- a log copied from SQLite: rows that continue a group ------------------------------


def _copy_sqlite_log(path: Path, url: str, session_id: str) -> list[int]:
    """Copy the session's rows from a SQLite file into the PostgreSQL log as they are
    (each row continuing its group as SQLite wrote it); the depth of each row."""
    import sqlite3

    from aalis_agent.events.codec import row_header

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT l.seq, l.data FROM log l JOIN sessions s ON s.id = l.sid "
            "WHERE s.name = ? ORDER BY l.seq",
            (session_id,),
        ).fetchall()
    finally:
        conn.close()
    depths, last = [], 0
    with psycopg.connect(url, autocommit=True) as pg:
        PostgresEventStore(url).close()  # its tables
        for seq, data in rows:
            header = row_header(bytes(data))
            assert header is not None and seq - header[1] == last
            depths.append(header[0])
            row = pg.execute(
                "SELECT aalis_append(%s, %s, %s, false, %s)",
                (session_id.encode(), last, header[1], bytes(data)),
            ).fetchone()
            assert row is not None and row[0] > 0
            last = seq
    return depths


def test_retries_over_a_log_copied_from_sqlite_read_their_replies_inside_groups(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A session run on SQLite (rows continuing their groups, some holding several events)
    copied into PostgreSQL: ``read_range`` gives what ``read`` gives for every range,
    one starting inside a row or a group included, and each of its inputs sent again to
    a runtime over PostgreSQL is answered with its reply as on SQLite, nothing written."""
    from aalis_agent.events import SqliteEventStore

    path = tmp_path / "agent.db"
    gate = Gate("原")
    with SqliteEventStore(path) as sqlite_store:
        rt = Runtime(
            sqlite_store, Services(llm=gate.model), FixedClock(), RunIds("s"), janitor=False
        )
        inputs = [Input(id=f"i{n}", content=f"第{n}句") for n in range(6)]
        first = [rt.run(SID, inp) for inp in inputs]
        rt.shutdown(timeout=10)
    depths = _copy_sqlite_log(path, pg_url, SID)
    assert max(depths) >= 2, depths  # rows deep inside a group
    b = Node(pg_url, "b", "乙")
    nodes.append(b)
    events = b.store.read(SID)
    last = events[-1].seq
    assert [e.seq for e in events] == list(range(1, last + 1))
    for after_seq in range(-1, last + 2):
        for until_seq in range(after_seq, last + 2):
            expected = [e for e in events if after_seq < e.seq <= until_seq]
            assert b.store.read_range(SID, after_seq, until_seq) == expected, (after_seq, until_seq)
    for inp, outcome in zip(inputs, first, strict=True):
        again = b.runtime.submit(SID, inp)
        assert (again.where, again.result(0)) == ("handled", outcome)
        assert outcome.reply == f"原{int(inp.id[1:]) + 1}"
    assert b.store.read(SID) == events
    assert b.gate.calls == 0


# --- shards (scale/ray_shards.py), without Ray -------------------------------------------


def test_a_shard_answers_an_input_and_its_retry_alike_whichever_is_asked_first(
    pg_url: str,  # noqa: F811
) -> None:
    """Through a shard (what the Ray client's handles ask), x and x sent again while it
    ran are two handles of one outcome: asked for in either order, and asked again, each
    answers the turn with its reply. So does the next incarnation of the shard, which
    reads it from the log (x accepted by its predecessor), and answers x sent to it
    again without writing."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'aalis-agent[ray]')")
    from aalis_agent.scale.ray_shards import RuntimeShard

    gate = Gate("片")
    gate.go.clear()
    shard = RuntimeShard(0, 1, pg_url, lambda: Services(llm=gate.model), ttl_s=TTL_S)
    try:
        assert shard.submit(SID, X) == ("x", "opened")
        assert gate.called.wait(30)
        assert shard.submit(SID, X)[0] == "x"  # follows the first
        gate.go.set()
        first = shard.outcome(SID, "x", 30)
        assert first is not None and first.outcome == "replied" and first.reply == "片1"
        assert shard.outcome(SID, "x", 30) == first  # the retry's handle
        assert shard.submit(SID, X) == ("x", "handled")
        assert shard.outcome(SID, "x", 30) == first
        assert shard.outcome(SID, "x", 30) == first
    finally:
        shard.shutdown()
    later = Gate("后")
    shard = RuntimeShard(0, 1, pg_url, lambda: Services(llm=later.model), ttl_s=TTL_S)
    try:
        assert shard.outcome(SID, "x", 30) == first  # from the log
        before = shard.store.read(SID)
        assert shard.submit(SID, X) == ("x", "handled")
        assert shard.outcome(SID, "x", 30) == first
        assert shard.store.read(SID) == before and later.calls == 0 and gate.calls == 1
    finally:
        shard.shutdown()


# --- another process, SIGKILLed ---------------------------------------------------------

W = Input(id="w", content="先来的")


def worker(url: str, side: Path, mode: str) -> int:
    """A runtime owning the session by lease (owner ``worker``, ttl ``TTL_S``), killed by
    the test. ``mid-turn``: x's turn waits in its model call (``SIDE/called`` made once
    the call started). ``finished``: x runs to its end (``SIDE/done`` holds its outcome).
    ``queued``: w's turn waits in its model call and x is accepted behind it
    (``SIDE/accepted``). Then it waits to be killed, its lease unreleased."""
    called = threading.Event()

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        called.set()
        if mode != "finished":
            threading.Event().wait()  # until killed
        return ScriptedReply(text=f"工{n}")

    store = PostgresEventStore(url)
    leases = PostgresLeases(store, owner="worker", ttl_s=TTL_S)
    runtime = Runtime(
        store, Services(llm=ScriptedModel(reply)), FixedClock(), RunIds("w"), janitor=False,
        ownership=leases,
    )  # fmt: skip
    if mode == "finished":
        outcome = runtime.submit(SID, X).result(30)
        (side / "done.tmp").write_bytes(msgspec.json.encode(outcome))
        (side / "done.tmp").rename(side / "done")
    elif mode == "mid-turn":
        runtime.submit(SID, X)
        assert called.wait(30)
        (side / "called").touch()
    else:
        runtime.submit(SID, W)
        assert called.wait(30)
        assert runtime.submit(SID, X).where in ("pending", "queued")
        (side / "accepted").touch()
    threading.Event().wait()
    return 0


def _spawn_worker(url: str, side: Path, mode: str) -> subprocess.Popen[bytes]:
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    with (side / "worker.log").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, __file__, url, str(side), mode], stderr=err, cwd=ROOT, env=env
        )


def _killed_after(url: str, side: Path, mode: str, mark: str) -> None:
    """Start the worker in ``mode``, wait for ``SIDE/<mark>``, SIGKILL it."""
    proc = _spawn_worker(url, side, mode)
    try:
        made = wait_until(lambda: (side / mark).exists() or proc.poll() is not None, 60)
        assert made and proc.poll() is None, (side / "worker.log").read_text(errors="replace")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def _submit_once_free(node: Node, inp: Input) -> Any:
    """``submit``, refused while the dead worker's lease lasts: the lease is expired by
    hand first (as ``TTL_S`` would), so the test need not wait for it."""
    with pytest.raises(SessionOwnedElsewhere, match="worker"):
        node.runtime.submit(SID, inp)
    assert node.store.read(SID)  # nothing more than the worker wrote
    _expire_leases(node.store.path)
    return node.runtime.submit(SID, inp)


def test_a_retry_after_the_owner_was_killed_having_finished_the_turn(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The worker ran x to its end, then was SIGKILLed (its lease held). x sent again to
    this process: once the lease lapses it is answered with the worker's outcome, reply
    text included, read from the log; nothing is written and no model called here."""
    _killed_after(pg_url, tmp_path, "finished", "done")
    done = msgspec.json.decode((tmp_path / "done").read_bytes(), type=InputOutcome)
    b = Node(pg_url, "b", "乙")
    nodes.append(b)
    before = b.store.read(SID)
    handle = _submit_once_free(b, X)
    assert handle.where == "handled"
    outcome = handle.result(0)
    assert outcome == done and outcome.outcome == "replied" and outcome.reply == "工1"
    assert b.store.read(SID) == before
    assert b.gate.calls == 0


def test_a_retry_after_the_owner_was_killed_mid_turn(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The worker was SIGKILLed inside x's model call. x sent again here: the cut turn is
    recorded (x was carried by that call: it is not run again) and the retry answered
    ``aborted``/``crash``; sent again once more, the same, with nothing written."""
    _killed_after(pg_url, tmp_path, "mid-turn", "called")
    b = Node(pg_url, "b", "乙")
    nodes.append(b)
    outcome = _submit_once_free(b, X).result(30)
    assert (outcome.input_id, outcome.outcome, outcome.reason) == ("x", "aborted", "crash")
    assert b.gate.calls == 0 and _received(b.store, "x") == 1
    before = b.store.read(SID)
    again = b.runtime.submit(SID, X)
    assert (again.where, again.result(0)) == ("handled", outcome)
    assert b.store.read(SID) == before


def test_a_retry_after_the_owner_was_killed_with_it_queued(
    nodes: list[Node],
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The worker accepted x behind w's turn, then was SIGKILLed inside w's model call.
    x sent again here follows x, which no model call carried: it runs here, once."""
    _killed_after(pg_url, tmp_path, "queued", "accepted")
    b = Node(pg_url, "b", "乙")
    nodes.append(b)
    handle = _submit_once_free(b, X)
    assert handle.where != "handled"
    outcome = handle.result(30)
    assert outcome.outcome == "replied" and outcome.reply == "乙1"
    assert b.gate.calls == 1 and _received(b.store, "x") == 1
    assert b.runtime.submit(SID, X).result(0) == outcome
    recorded = [(e.outcome, e.reason) for e in b.store.read(SID) if isinstance(e, TurnRecorded)]
    assert recorded == [("aborted", "crash"), ("replied", None)]


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
