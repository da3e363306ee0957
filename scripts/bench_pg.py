"""The cost of a turn on the PostgreSQL event store against SQLite: the same ``TURNS`` tool
turns (a user message, one tool call, the tool, a reply) through the real runtime, once on
each store.

``.venv/bin/python scripts/bench_pg.py [TURNS]`` prints one JSON line per figure, as
``scripts/bench`` does. It starts a throwaway cluster on loopback (``tests/pg.py``; fsync
on, as a server would run) unless ``AALIS_PG_URL`` names a database to use. Postgres runs
twice: ``synchronous_commit=on`` (an append waits for its WAL flush, the default) and
``off`` (the WAL is flushed in the background within ~0.2 s, as SQLite's
``synchronous=NORMAL`` in WAL mode does not flush at each commit either).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for tests.pg, the throwaway cluster

from aalis_agent.events import Input, SqliteEventStore, ToolCall  # noqa: E402
from aalis_agent.events.store import EventStore  # noqa: E402

TURNS = 200
SESSION = "qq:group:123456"
USER_TEXT = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
REPLY_TEXT = "明天上海多云转小雨,14 到 21 度,东南风 3 级,下午可能有阵雨,出门记得带伞。"

Emit = Callable[..., None]


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": name, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


def _quiet_logs() -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


class _Timed:
    """Wraps a store, timing each append (what a turn waits on: persist, then act)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.appends: list[float] = []

    def append(self, *args: Any, **kwargs: Any) -> int:
        t0 = time.perf_counter()
        try:
            return self.store.append(*args, **kwargs)
        finally:
            self.appends.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _run_turns(store: EventStore, turns: int) -> tuple[list[float], list[float]]:
    """Seconds per turn and per append over ``turns`` tool turns in one session."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    def reply(request: object, n: int) -> ScriptedReply:
        if n % 2:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text=f"{n}: {REPLY_TEXT}")  # every reply a new text

    timed = _Timed(store)
    services = Services(
        llm=ScriptedModel(reply, context_length=1_000_000, keep_requests=0),
        tools=ToolRegistry([Tool("echo", lambda args, ctx: "好")]),
    )
    runtime = Runtime(timed, services, janitor=False)  # type: ignore[arg-type]
    try:
        # One turn in another session first: loading the encoding is not a turn's cost.
        runtime.submit("warm-up", Input(id="", content=USER_TEXT)).result(60)
        timed.appends.clear()
        samples: list[float] = []
        for n in range(turns):
            t0 = time.perf_counter()
            runtime.submit(SESSION, Input(id="", content=f"{n}: {USER_TEXT}")).result(60)
            samples.append(time.perf_counter() - t0)
    finally:
        runtime.shutdown(timeout=60)
    return samples, list(timed.appends)


def _report(
    emit: Emit, store_name: str, turns: int, samples: list[float], appends: list[float]
) -> None:
    ms = [s * 1000 for s in samples]
    emit(
        "turn_ms",
        statistics.median(ms),
        "ms",
        store=store_name,
        turns=turns,
        mean=round(statistics.fmean(ms), 3),
        p90=round(statistics.quantiles(ms, n=10)[-1], 3),
        appends_per_turn=round(len(appends) / turns, 2),
        append_ms_p50=round(statistics.median(appends) * 1000, 3),
        store_ms_per_turn=round(sum(appends) * 1000 / turns, 3),
    )


def bench_pg_turn(tmp: Path, emit: Emit, turns: int = TURNS) -> None:
    """``turns`` tool turns on SQLite (a file in ``tmp``), then on Postgres with
    ``synchronous_commit`` on and off; per turn: p50, mean, p90, the appends and the time
    spent in them; and the Postgres turn over the SQLite one."""
    from aalis_agent.events.postgres import PostgresEventStore

    from tests.pg import Cluster, ClusterUnavailable, url_with

    _quiet_logs()
    sqlite = SqliteEventStore(tmp / "turns.db")
    try:
        base_samples, appends = _run_turns(sqlite, turns)
    finally:
        sqlite.close()
    _report(emit, "sqlite", turns, base_samples, appends)

    cluster: Cluster | None = None
    url = os.environ.get("AALIS_PG_URL")
    if url is None:
        try:
            cluster = Cluster(database="aalis_bench")
            url = cluster.start()
        except ClusterUnavailable as exc:
            emit("turn_ms", 0, "ms", store="postgres", skipped=str(exc))
            return
    try:
        import psycopg

        for n, sync in enumerate(("on", "off")):
            schema = f"bench_{os.getpid()}_{n}"
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"CREATE SCHEMA {schema}")
            target = url_with(url, search_path=schema, settings={"synchronous_commit": sync})
            store = PostgresEventStore(target)
            try:
                samples, appends = _run_turns(store, turns)
                with psycopg.connect(target) as conn:
                    row = conn.execute(
                        "SELECT pg_total_relation_size('aalis_log'), sum(length(data)) "
                        "FROM aalis_log"
                    ).fetchone()
            finally:
                store.close()
            assert row is not None
            _report(emit, f"postgres synchronous_commit={sync}", turns, samples, appends)
            emit(
                "pg_over_sqlite_turn",
                statistics.median(samples) / statistics.median(base_samples),
                "x",
                synchronous_commit=sync,
                extra_ms_per_turn=round(
                    (statistics.median(samples) - statistics.median(base_samples)) * 1000, 3
                ),
                log_bytes_per_turn=round(int(row[0]) / (turns + 1), 1),
                payload_bytes_per_turn=round(int(row[1]) / (turns + 1), 1),
                server="throwaway cluster, fsync on" if cluster else "AALIS_PG_URL",
            )
    finally:
        if cluster is not None:
            cluster.stop()


def main() -> int:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        bench_pg_turn(Path(tmpdir), emit, turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
