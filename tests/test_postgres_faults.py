"""The Postgres store when connections fail, on a real server: pooled connections left dead
by a restart, an append whose answer is lost after the server committed it, a statement
that would wait forever on a lock. Persist, then act: an append is reported written only
when it is in the log, and reported failed only when it is not (or said to be unknown)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from aalis_agent.events import ConcurrencyConflict, RuntimeClosed, SessionFailed, StoreError
from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.events.schema import InputReceived, ToolCall, ToolStarted, TurnRecorded
from aalis_agent.scale.leases import PostgresLeases

from aalis_agent import Input, Runtime, ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry
from tests.faults import audit_log
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures
from tests.tcp_proxy import Cut, TcpProxy
from tests.test_store_contract import queued


def _with_app(url: str, name: str) -> str:
    return url + ("&" if "?" in url else "?") + f"application_name={name}"


def _through(url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(url)
    user = parts.netloc.rsplit("@", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{proxy.port}"))


def _upstream(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _terminate(url: str, app: str) -> int:
    """End every server process serving a connection named ``app`` (as a restart does)."""
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (app,),
        ).fetchall()
    return len(rows)


@pytest.fixture
def proxy(pg_url: str) -> Iterator[TcpProxy]:  # noqa: F811
    proxy = TcpProxy(_upstream(pg_url))
    yield proxy
    proxy.close()


def _batch(at: int, n: int = 2, tag: str = "x") -> list[Any]:
    return [queued("s", at + i + 1, f"{tag}{at + i}") for i in range(n)]


# --- dead pooled connections ----------------------------------------------------------


def test_calls_after_the_pooled_connections_died_go_through(pg_url: str) -> None:  # noqa: F811
    url = _with_app(pg_url, "stale")
    with PostgresEventStore(url, min_size=3, max_size=3) as store:
        store.append("s", _batch(0), 0)
        assert store.read("s")
        assert _terminate(pg_url, "stale") == 3  # all of the pool's connections
        # Each call finds a dead connection first; none of them fails for it.
        assert [e.seq for e in store.read("s")] == [1, 2]
        assert _terminate(pg_url, "stale") >= 1
        assert store.append("s", _batch(2), 2) == 4
        assert _terminate(pg_url, "stale") >= 1
        assert store.mark_idle([("s", 4)]) == 1
        assert _terminate(pg_url, "stale") >= 1
        assert store.last_seq("s") == 4 and store.open_sessions() == []
    with PostgresEventStore(pg_url, read_only=True) as reader:
        assert [e.seq for e in reader.read("s")] == [1, 2, 3, 4]


def test_once_the_server_is_back_calls_go_through_though_the_pool_backs_off(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outage empties the pool, which then reconnects with a doubling backoff; calls
    meanwhile connect for themselves, so they work as soon as the server does."""
    from psycopg_pool.base import AttemptWithBackoff

    # The pool's backoff on a shorter clock (0.25 s, then doubling, instead of 1 s), so
    # that a few seconds of outage put its next try seconds past the server's return.
    monkeypatch.setattr(AttemptWithBackoff, "INITIAL_DELAY", 0.25)
    with PostgresEventStore(_through(pg_url, proxy), timeout_s=2, min_size=1) as store:
        store.append("s", _batch(0), 0)
        proxy.refuse = True  # the server goes away...
        proxy.cut_all()
        with pytest.raises(StoreError):
            store.read("s")
        time.sleep(2.5)  # ...and the pool's tries come further and further apart
        proxy.refuse = False  # back
        started = time.monotonic()
        assert store.append("s", _batch(2), 2) == 4
        assert [e.seq for e in store.read("s")] == [1, 2, 3, 4]
        assert time.monotonic() - started < 1.5


def test_no_more_calls_connect_for_themselves_than_the_pool_may_hold(
    pg_url: str,  # noqa: F811
) -> None:
    with PostgresEventStore(pg_url, min_size=1, max_size=2, timeout_s=1) as store:
        store.append("s", _batch(0), 0)
        with store._pool.connection(), store._pool.connection():  # nothing left to give
            store._degraded = True  # as after an outage
            taken = [store._direct_slots.acquire(blocking=False) for _ in range(2)]
            assert taken == [True, True]  # two calls connected for themselves already
            with pytest.raises(StoreError, match="couldn't get a connection"):
                store.last_seq("s")  # a third waits for the pool instead
            store._degraded = True
            store._direct_slots.release()
            assert store.last_seq("s") == 2  # with a slot free, it connects for itself
            store._direct_slots.release()


def test_a_statement_the_server_refuses_is_not_run_twice(pg_url: str) -> None:  # noqa: F811
    with PostgresEventStore(pg_url) as store:
        store.append("s", _batch(0), 0)
        with pytest.raises(ConcurrencyConflict):
            store.append("s", _batch(0, tag="y"), 0)
        with pytest.raises(StoreError, match="reading failed"):
            store._query("SELECT 1/0")
        assert [e.seq for e in store.read("s")] == [1, 2]


# --- an append whose answer is lost ----------------------------------------------------


@pytest.mark.parametrize("cut", ["answer", "request"])
def test_an_append_whose_connection_broke_is_written_once_and_reported_written(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
    cut: Cut,
) -> None:
    """``answer``: the server committed it and its answer was lost; ``request``: it never
    reached the server. Either way it is settled on a fresh connection: in the log once."""
    with PostgresEventStore(_through(pg_url, proxy), timeout_s=5) as store:
        store.append("s", _batch(0), 0)
        proxy.cut_next(cut)
        assert store.append("s", _batch(2), 2) == 4
        assert proxy.cuts == 1
        assert store.append("s", _batch(4), 4) == 6  # and the store goes on
    with PostgresEventStore(pg_url, read_only=True) as reader:
        assert [e.seq for e in reader.read("s")] == [1, 2, 3, 4, 5, 6]
        assert [r.position for r in reader.read_all()] == [1, 2, 3, 4, 5, 6]


def test_a_settling_read_that_breaks_is_read_again(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
) -> None:
    with PostgresEventStore(_through(pg_url, proxy), timeout_s=5) as store:
        store.append("s", _batch(0), 0)
        real_call = store._call
        cut: list[str] = []

        def call(doing: str, fn: Any, *, retry: bool = True) -> Any:
            if getattr(fn, "__name__", "") == "look" and not cut:
                cut.append(doing)
                proxy.cut_next("request")  # the read that settles it is cut off too
            return real_call(doing, fn, retry=retry)

        store._call = call  # type: ignore[method-assign]
        proxy.cut_next("answer")
        assert store.append("s", _batch(2), 2) == 4
        assert cut == ["append"] and proxy.cuts == 2
    with PostgresEventStore(pg_url, read_only=True) as reader:
        assert [e.seq for e in reader.read("s")] == [1, 2, 3, 4]


def test_a_lost_append_that_another_writer_beat_is_a_conflict(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
) -> None:
    with (
        PostgresEventStore(_through(pg_url, proxy), timeout_s=5) as store,
        PostgresEventStore(pg_url) as other,
    ):
        store.append("s", _batch(0), 0)
        proxy.cut_next("request")
        # The other writer appends while this one's connection is being cut.
        real_check = store._pool.check

        def check() -> None:
            other.append("s", _batch(2, tag="other"), 2)
            real_check()

        store._pool.check = check  # type: ignore[method-assign]
        with pytest.raises(ConcurrencyConflict) as caught:
            store.append("s", _batch(2), 2)
        assert caught.value.actual_seq == 4
    with PostgresEventStore(pg_url, read_only=True) as reader:
        ids = [e.input_id for e in reader.read("s")]
        assert ids == ["in-1x0", "in-2x1", "in-3other2", "in-4other3"]


def test_when_it_cannot_be_settled_the_error_says_the_fate_is_unknown(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
) -> None:
    store = PostgresEventStore(_through(pg_url, proxy), timeout_s=1, min_size=1, max_size=1)
    try:
        store.append("s", _batch(0), 0)
        proxy.refuse = True  # the server is out of reach from now on
        proxy.cut_next("answer")
        with pytest.raises(StoreError, match="could not be settled") as caught:
            store.append("s", _batch(2), 2)
        assert "read the log to know" in str(caught.value)
        assert not isinstance(caught.value, ConcurrencyConflict)
    finally:
        store.close()
    with PostgresEventStore(pg_url, read_only=True) as reader:
        assert reader.last_seq("s") == 4  # it had committed


# --- through the runtime ----------------------------------------------------------------


@pytest.mark.parametrize("lost", ["InputReceived", "ToolStarted"])
def test_a_turn_whose_commit_answer_is_lost_runs_once_and_answers(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
    lost: str,
) -> None:
    calls: list[str] = []

    class Cutting(PostgresEventStore):
        def append(self, session_id: str, events: Any, expected_seq: int, **kw: Any) -> int:
            if any(type(e).__name__ == lost for e in events) and not calls.count("cut"):
                calls.append("cut")
                proxy.cut_next("answer")
            return super().append(session_id, events, expected_seq, **kw)

    def reply(request: Any, n: int) -> ScriptedReply:
        calls.append("model")
        if n == 1:  # the first call
            return ScriptedReply(tool_calls=(ToolCall(id="c1", name="t", arguments="{}"),))
        return ScriptedReply(text="好了")

    def tool(args: Any, ctx: Any) -> str:
        calls.append("tool")
        return "ok"

    store = Cutting(_through(pg_url, proxy), timeout_s=5)
    runtime = Runtime(
        store,
        Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("t", tool)])),
        janitor=False,
    )
    try:
        result = runtime.submit("s", Input(id="i1", content="查一下")).result(20)
        assert result.outcome == "replied"
        assert proxy.cuts == 1
        expected = ["model", "cut", "tool", "model"]  # the tool's commit comes after a call
        if lost == "InputReceived":
            expected = ["cut", "model", "tool", "model"]
        assert calls == expected  # each once: nothing ran twice, nothing was skipped
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    with PostgresEventStore(pg_url, read_only=True) as reader:
        events = reader.read("s")
    assert sum(isinstance(e, InputReceived) for e in events) == 1
    assert sum(isinstance(e, ToolStarted) for e in events) == 1


# --- waits that would not end ---------------------------------------------------------


def test_a_statement_held_by_a_lock_ends_in_an_error_and_writes_nothing(
    pg_url: str,  # noqa: F811
) -> None:
    with PostgresEventStore(pg_url, statement_timeout_s=0.5) as store:
        store.append("s", _batch(0), 0)
        with psycopg.connect(pg_url) as admin:
            admin.execute("LOCK TABLE aalis_head IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(StoreError, match="statement timeout"):
                store.append("s", _batch(2), 2)
            assert time.monotonic() - started < 10
            admin.rollback()
        assert store.last_seq("s") == 2
        assert store.append("s", _batch(2), 2) == 4  # the same batch, once the lock is gone


def test_a_write_the_server_refuses_mid_turn_stops_the_session_naming_it_and_why(
    pg_url: str,  # noqa: F811
) -> None:
    """A trigger refuses the log's rows past a chosen seq (as a full disk would): the turn
    under way stops, its caller hears which session stopped and the server's reason in
    one line (not the statements it ran in), nothing of the refused batch is in the log,
    and once the server takes rows again a new runtime runs the acknowledged input once."""

    def tools() -> ToolRegistry:
        return ToolRegistry([Tool("t", lambda args, ctx: "ok")])

    def reply(request: Any, n: int) -> ScriptedReply:
        if not any(m.role == "tool" for m in request.messages):
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="t", arguments="{}"),))
        return ScriptedReply(text="好了")

    store = PostgresEventStore(pg_url)
    runtime = Runtime(store, Services(llm=ScriptedModel(reply), tools=tools()), janitor=False)
    try:
        assert runtime.submit("s", Input(id="i1", content="一")).result(20).outcome == "replied"
        armed = store.last_seq("s") + 6  # past the next input's first commit
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.seq > {armed} THEN RAISE EXCEPTION 'disk full at seq %', NEW.seq; "
                "END IF; RETURN NEW; END $$"
            )
            admin.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON aalis_log "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        handle = runtime.submit("s", Input(id="i2", content="二"))  # acknowledged
        with pytest.raises(SessionFailed) as info:
            handle.result(20)
        text = str(info.value)
        assert text.startswith("session 's' stopped: a write to its log failed"), text
        assert "append failed: disk full at seq" in text, text
        assert "\n" not in text and "aalis_append" not in text, text
        assert store.last_seq("s") <= armed  # the refused batch left nothing
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("DROP TRIGGER refuse ON aalis_log")
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    with PostgresEventStore(pg_url) as again_store:
        again = Runtime(again_store, Services(llm=ScriptedModel(reply), tools=tools()))
        try:
            assert again.recover() == ["s"]
            assert again.wait_idle(20)
            events = again_store.read("s")
        finally:
            again.shutdown(timeout=10)
    assert audit_log(events, acked=["i1", "i2"]) == audit_log([], acked=[])
    # i2's turn is recorded once, as cut (its model call had carried it: not run again).
    outcomes = [e.outcome for e in events if isinstance(e, TurnRecorded)]
    assert outcomes == ["replied", "aborted"], outcomes


def test_bad_statement_timeouts_are_refused(pg_url: str) -> None:  # noqa: F811
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="statement_timeout_s"):
            PostgresEventStore(pg_url, statement_timeout_s=bad)


def test_connections_send_keepalives_unless_the_url_says_otherwise(
    pg_url: str,  # noqa: F811
) -> None:
    with PostgresEventStore(pg_url) as store, store._pool.connection() as conn:
        params = conn.info.get_parameters()
        assert params["keepalives_idle"] == "10" and params["keepalives_count"] == "3"
        assert params["tcp_user_timeout"] == "30000"
    with (
        PostgresEventStore(pg_url + "&keepalives_idle=42") as store,
        store._pool.connection() as conn,
    ):
        assert conn.info.get_parameters()["keepalives_idle"] == "42"
        assert conn.execute("SHOW statement_timeout").fetchone() == ("1min",)


def test_shutdown_returns_in_time_while_a_session_waits_on_the_store_and_it_runs_no_turn(
    pg_url: str,  # noqa: F811
) -> None:
    """A submit stuck in its append (a lock held elsewhere): ``shutdown(timeout)`` returns
    within about its timeout, raising nothing; once the lock is gone the input is in the
    log, but the shut-down runtime runs no turn for it: the next start finds the turn cut
    and records it, as after a crash."""
    store = PostgresEventStore(pg_url, statement_timeout_s=None)
    model = ScriptedModel()
    runtime = Runtime(store, Services(llm=model), janitor=False, ask_timeout_s=3)
    admin = psycopg.connect(pg_url)
    try:
        runtime.submit("s", Input(id="w", content="热身")).result(10)
        calls = model.calls
        admin.execute("LOCK TABLE aalis_head IN ACCESS EXCLUSIVE MODE")
        outcome: dict[str, Any] = {}

        def submit() -> None:
            try:
                outcome["handle"] = runtime.submit("s", Input(id="i", content="你好"))
            except Exception as exc:  # what the caller sees once the lock is gone
                outcome["error"] = exc

        waiting = threading.Thread(target=submit, daemon=True)
        waiting.start()
        time.sleep(0.3)  # it is inside its append, waiting on the lock
        assert waiting.is_alive()
        started = time.monotonic()
        runtime.shutdown(timeout=2)  # returns, raising nothing
        assert time.monotonic() - started < 4  # not 2 x ask_timeout_s more
    finally:
        admin.rollback()
        admin.close()
        waiting.join(20)
    assert not waiting.is_alive()
    time.sleep(0.3)
    assert model.calls == calls  # no turn ran after the runtime was shut down
    handle = outcome.get("handle")
    if handle is not None:  # accepted as the lock went: told the runtime had stopped
        with pytest.raises(RuntimeClosed):
            handle.result(10)
    events = store.read("s")
    assert [e.input.id for e in events if isinstance(e, InputReceived)] == ["w", "i"]
    again = Runtime(store, Services(llm=model), janitor=False)
    try:
        assert again.recover() == ["s"]
        assert again.wait_idle(10)
        records = [e for e in store.read("s") if isinstance(e, TurnRecorded)]
        assert [(r.outcome, r.reason) for r in records] == [("replied", None), ("aborted", "crash")]
        assert model.calls == calls  # its first call was recorded as started: not sent now
    finally:
        again.shutdown(timeout=10)
        store.close()


def test_a_lease_statement_held_by_a_lock_ends_within_the_leases_timeout(
    pg_url: str,  # noqa: F811
) -> None:
    leases = PostgresLeases(pg_url, owner="a", ttl_s=30, timeout_s=0.5)
    try:
        with psycopg.connect(pg_url) as admin:
            admin.execute("LOCK TABLE aalis_leases IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(StoreError, match="statement timeout") as info:
                leases.acquire("s")
            assert time.monotonic() - started < 1.5  # once: not run again on a new connection
            # The refusal names the session and what it means for it.
            assert str(info.value).startswith("session 's': no lease could be taken"), info.value
            assert "not started here" in str(info.value)
            admin.rollback()
        leases.acquire("s")  # once the lock is gone
        leases.release("s")
    finally:
        leases.close()


def test_a_lease_failure_gives_the_servers_message_in_one_line(
    pg_url: str,  # noqa: F811
    proxy: TcpProxy,
) -> None:
    """The server gone: libpq's message carries hint lines ("This probably means the
    server terminated abnormally ..."); a lease's refusal keeps its first line only, as the
    store's errors do."""
    url = _through(pg_url, proxy)
    leases = PostgresLeases(url, owner="a", ttl_s=30, timeout_s=1)
    try:
        proxy.refuse = True  # the server goes away
        proxy.cut_all()
        with pytest.raises(StoreError) as info:
            leases.acquire("s")
        text = str(info.value)
        assert text.startswith("session 's': no lease could be taken ("), text
        assert "leases failed: connection failed:" in text, text
        assert "\n" not in text and "probably means" not in text, text
        assert text.endswith("): the session is not started here, and nothing was written for it")
        with pytest.raises(StoreError) as info:  # the table cannot even be made
            PostgresLeases(url, owner="b", ttl_s=30, timeout_s=1)
        assert "leases failed: connection failed:" in str(info.value)
        assert "\n" not in str(info.value), info.value
    finally:
        proxy.refuse = False
        leases.close()
