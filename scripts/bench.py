"""Benchmarks of the runtime (run through ``scripts/bench``): the event log and its
projections, request preparation, and whole turns through the runtime.

Each benchmark prints one JSON line: ``{"bench": NAME, "value": X, "unit": U, ...}``.
Figures are wall-clock times on the durable SQLite store in a temporary folder: the
store's own as best-of-N runs, turns as medians. A ratio is taken within one run, its
two sides timed in alternation, as the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from aalis_agent.events import (
    Batch,
    ChatMessage,
    FixedClock,
    Input,
    InputQueued,
    InputReceived,
    MessageMeta,
    MessageSaved,
    SqliteEventStore,
)
from aalis_agent.projections import project
from aalis_agent.testing.sample import synthetic_turn

SESSIONS = 100
EVENTS_PER_SESSION = 1000  # 66 synthetic turns (15 events each) + 5 queued inputs
USER_TEXT = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
REPLY_TEXT = "明天上海多云转小雨,14 到 21 度,东南风 3 级,下午可能有阵雨,出门记得带伞。"


_EMITTED: list[dict[str, Any]] = []  # every line printed, for --targets


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    line = {"bench": name, "value": round(value, 3), "unit": unit, **extra}
    _EMITTED.append(line)
    print(json.dumps(line))
    sys.stdout.flush()


# The speed targets: (benchmark to run, line, field, ">=" or "<=", bound, what it is,
# and for a line printed several times the fields that pick one).
TARGETS: tuple[tuple[str, str, str, str, float, str, dict[str, object]], ...] = (
    ("turns", "turn_overhead_ratio", "value", "<=", 1.2,
     "turn overhead at 1,000 turns of history over 10", {}),
    ("turns_workload", "turns_workload", "p50_ms", "<=", 3.0,
     "tool turn p50 (ms), 200 turns of one session", {}),
    ("floor", "floor_ratio", "value", "<=", 4.0,
     "tool turn over its rows written raw in two commits", {}),
    ("first_token", "first_token_added_ms", "value", "<=", 2.0,
     "time to first token added (ms), 1,061 messages", {"messages": 1061}),
    ("many_sessions", "many_sessions_processes_turns_per_s", "ratio", ">=", 1.0,
     "1,000 sessions x 5 turns from 4 threads (2 worker processes) over one session run "
     "sequentially", {}),
    ("stored_bytes_per_turn", "stored_bytes_per_turn", "value", "<=", 1024.0,
     "stored bytes per tool turn", {}),
    ("replay_eps", "replay_eps", "value", ">=", 400_000.0,
     "replay into all projections (events/s)", {}),
)  # fmt: skip


def report_targets() -> int:
    """Print each speed target beside what this run measured (stderr, as a table; stdout,
    as one ``targets`` line); how many were not met."""
    rows = []
    for _bench, line, field, op, bound, what, where in TARGETS:
        found = [
            e
            for e in _EMITTED
            if e["bench"] == line and all(e.get(k) == v for k, v in where.items())
        ]
        value = found[-1].get(field) if found else None
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        rows.append({"target": f"{line} {field} {op} {bound:g}", "what": what, "value": value,
                     "met": met})  # fmt: skip
    width = max(len(r["target"]) for r in rows)
    for r in rows:
        mark = {True: "met", False: "NOT MET", None: "not measured"}[r["met"]]
        print(f"{r['target']:<{width}}  {r['value']!s:>12}  {mark:<12}  {r['what']}",
              file=sys.stderr)  # fmt: skip
    missed = sum(r["met"] is not True for r in rows)
    print(json.dumps({"bench": "targets", "value": len(rows) - missed, "unit": "met",
                      "of": len(rows), "rows": rows}))  # fmt: skip
    return missed


def fill_session(store: SqliteEventStore, session_id: str, clock: FixedClock) -> None:
    """Write one 1,000-event session: realistic turns, then a few queued inputs."""
    last = 0
    for n in range(66):
        batch = Batch(session_id, last, clock=clock)
        synthetic_turn(batch, n, text=USER_TEXT)
        last = store.append(session_id, batch.events, last)
    batch = Batch(session_id, last, clock=clock)
    for k in range(5):
        batch.add(InputReceived(input=Input(id=f"q-{k}", content=USER_TEXT)))
        batch.add(InputQueued(input_id=f"q-{k}"))
    store.append(session_id, batch.events, last)


def build_100k(path: Path) -> SqliteEventStore:
    store = SqliteEventStore(path)
    clock = FixedClock(step_ms=50)
    for s in range(SESSIONS):
        fill_session(store, f"qq:group:{100000 + s}", clock)
    assert store.count() == SESSIONS * EVENTS_PER_SESSION
    return store


def message_event(session_id: str, seq: int, n: int, at: int) -> MessageSaved:
    user = n % 2 == 0
    return MessageSaved(
        session_id=session_id,
        seq=seq,
        at=at,
        message=ChatMessage(
            id=f"msg-{n}",
            role="user" if user else "assistant",
            content=USER_TEXT if user else REPLY_TEXT,
            meta=MessageMeta(turn_id=f"turn-{n // 2}", entry="opened" if user else None),
        ),
    )


def single_events(n: int) -> list[tuple[str, MessageSaved]]:
    """``n`` messages over 10 sessions, each with its session, in seq order."""
    sessions = [f"s{k}" for k in range(10)]
    events = [
        (sid, message_event(sid, i // 10 + 1, i, i)) for i, sid in enumerate(sessions * (n // 10))
    ]
    events.sort(key=lambda pair: pair[1].seq)
    return events


def bench_append_single(tmp: Path, *, exclusive: bool = False) -> None:
    path = tmp / ("single-x.db" if exclusive else "single.db")
    store = SqliteEventStore(path, exclusive=exclusive)
    n = 20_000
    events = single_events(n)  # built first: this measures the store, not events
    start = time.perf_counter()
    for sid, event in events:
        store.append(sid, (event,), event.seq - 1)
    elapsed = time.perf_counter() - start
    store.close()
    name = "append_single_exclusive_eps" if exclusive else "append_single_eps"
    emit(name, n / elapsed, "events/s", events=n, target=">= 30000")


def bench_append_tail(tmp: Path) -> None:
    """The slowest appends: 20,000 single-event appends over 10 sessions at the default
    WAL mark, with the store's checkpoint thread and with SQLite's inline checkpoints
    (each run twice, alternating); max, p99.9 and p99 of each, and the max's ratio."""
    n = 20_000
    events = single_events(n)
    figures: dict[bool, list[list[float]]] = {True: [], False: []}
    for k, background in enumerate((True, False, True, False)):
        store = SqliteEventStore(tmp / f"tail-{k}.db", background_checkpoint=background)
        times = []
        for sid, event in events:
            t = time.perf_counter()
            store.append(sid, [event], event.seq - 1)
            times.append(time.perf_counter() - t)
        store.close()
        times.sort()
        figures[background].append(
            [times[-1] * 1e3, times[int(n * 0.999)] * 1e3, times[int(n * 0.99)] * 1e3]
        )

    def best(background: bool, i: int) -> float:
        return round(min(f[i] for f in figures[background]), 3)

    emit(
        "append_tail_ms",
        best(True, 0),
        "ms",
        appends=n,
        p999_ms=best(True, 1),
        p99_ms=best(True, 2),
        inline_max_ms=best(False, 0),
        inline_p999_ms=best(False, 1),
        inline_p99_ms=best(False, 2),
        max_over_inline=round(best(True, 0) / best(False, 0), 3),
        note="checkpoints on the store's thread vs inline (SQLite's default); best of 2 each",
    )


def bench_append_batch(tmp: Path) -> None:
    store = SqliteEventStore(tmp / "batch.db")
    clock = FixedClock(step_ms=1)
    turns = 4000
    last = 0
    batches = []
    for n in range(turns):
        batch = Batch("s1", last, clock=clock)
        synthetic_turn(batch, n)
        batches.append(batch.events)
        last += len(batch.events)
    last = 0
    start = time.perf_counter()
    for events in batches:
        last = store.append("s1", events, last)
    elapsed = time.perf_counter() - start
    store.close()
    emit("append_batch_eps", last / elapsed, "events/s", events=last, batch_size=15)


def best_of(runs: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_replay(store: SqliteEventStore) -> None:
    sessions = store.sessions()

    def replay_all() -> int:
        total = 0
        for sid in sessions:
            events = store.read(sid)
            view = project(events)
            total += view.seq
        return total

    assert replay_all() == SESSIONS * EVENTS_PER_SESSION
    elapsed = best_of(3, replay_all)
    n = SESSIONS * EVENTS_PER_SESSION
    emit(
        "replay_eps",
        n / elapsed,
        "events/s",
        events=n,
        sessions=len(sessions),
        projections="history+turns+queue+settings",
        target=">= 400000",
    )


def bench_recover(store: SqliteEventStore) -> None:
    sid = store.sessions()[SESSIONS // 2]
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        view = project(store.read(sid))
        samples.append(time.perf_counter() - start)
        assert view.seq == EVENTS_PER_SESSION
    emit(
        "recover_1k_ms",
        statistics.median(samples) * 1000,
        "ms",
        events=EVENTS_PER_SESSION,
        db_events=store.count(),
        best_ms=round(min(samples) * 1000, 3),
        target="<= 5",
    )


def bench_startup(tmp: Path, sessions: int = 2000, turns: int = 10, busy: int = 10) -> None:
    """``Runtime.recover()`` on a database of many finished sessions and a few with
    queued work: with the idle index it folds only those; the first start of a database
    written without the index (as after an upgrade) folds every session once."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, Services

    _quiet_logs()
    path = tmp / "startup.db"
    clock = FixedClock()
    store = SqliteEventStore(path)
    for k in range(sessions):
        sid = f"s-{k:05d}"
        last = 0
        for n in range(turns):
            batch = Batch(sid, last, clock=clock)
            synthetic_turn(batch, n, text=USER_TEXT)
            last = store.append(sid, batch.events, last, open_work=False)
        if k >= sessions - busy:
            batch = Batch(sid, last, clock=clock)
            batch.add(InputReceived(input=Input(id="q", content=USER_TEXT)))
            batch.add(InputQueued(input_id="q"))
            store.append(sid, batch.events, last, open_work=True)
    total = store.count()
    store.close()

    def start() -> tuple[float, int]:
        s = SqliteEventStore(path)  # as a new process would open it
        runtime = Runtime(s, Services(llm=ScriptedModel()), janitor=False)
        begin = time.perf_counter()
        started = runtime.recover()
        elapsed = time.perf_counter() - begin
        runtime.wait_idle(60)
        runtime.shutdown(timeout=30)
        s.close()
        return elapsed, len(started)

    def forget_marks() -> None:
        import sqlite3

        conn = sqlite3.connect(path)
        with conn:
            conn.execute("DELETE FROM idle_sessions")
        conn.close()

    forget_marks()
    first, started = start()  # folds every session once, then marks the idle ones
    assert started == busy
    again, started = start()
    assert started == 0  # the busy ones finished their turns in the first start
    emit(
        "startup_recover_ms",
        again * 1000,
        "ms",
        sessions=sessions,
        events=total,
        first_start_ms=round(first * 1000, 1),
        note="recover() with the idle index; first_start_ms: unmarked, every session folded",
    )


def bench_bytes_per_message(tmp: Path) -> None:
    path = tmp / "messages.db"
    store = SqliteEventStore(path)
    n = 20_000
    last = 0
    for start in range(0, n, 500):
        events = [message_event("qq:group:123456", last + 1 + i, start + i, 0) for i in range(500)]
        last = store.append("qq:group:123456", events, last)
    store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store._conn.execute("VACUUM")
    store.close()
    size = path.stat().st_size
    emit(
        "bytes_per_message",
        size / n,
        "bytes",
        events=n,
        db_bytes=size,
        content_chars=(len(USER_TEXT) + len(REPLY_TEXT)) / 2,
        target="<= 1024",
    )


def _quiet_logs() -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def bench_sched_decision(tmp: Path) -> None:
    """Scheduler decision plus durable append, per input, while a turn runs."""
    from aalis_agent.actors.scheduler import OpenContext, Step, decide_submit
    from aalis_agent.events import TurnSettings
    from aalis_agent.projections import SessionView

    store = SqliteEventStore(tmp / "sched.db")
    turn_ids = iter(range(1, 10**9))
    ctx = OpenContext(
        settings_for=lambda inp: TurnSettings(), new_turn_id=lambda: f"turn-{next(turn_ids)}"
    )
    clock = FixedClock(step_ms=1)
    view = SessionView()
    n = 5000
    inputs = [
        Input(id=f"in-{i}", content=USER_TEXT, source="schedule" if i % 3 == 2 else None)
        for i in range(n)
    ]
    start = time.perf_counter()
    for inp in inputs:  # the first opens a turn; the rest wait to join it or queue
        step = Step(view, Batch("s1", view.seq, clock=clock))
        decide_submit(step, inp, view.queue.generation, ctx)
        store.append("s1", step.events, step.batch.expected_seq)
        view = step.view
    elapsed = time.perf_counter() - start
    store.close()
    emit("sched_decision_us", elapsed / n * 1e6, "us", inputs=n, store="sqlite")


def bench_submit_while_queued(tmp: Path) -> None:
    """``Runtime.submit`` while a turn runs and inputs pile up behind it (a flood into
    one session): the median submit among the first 200 and the last 200 of 3,000, and
    their ratio (flat is 1; each submit's own work should not grow with the queue).
    Then the same with a subscriber to ``agent:queue`` (``listened_*``): each submit
    then reports the whole queue, which must not make it grow either."""
    first, last = _submits_while_queued(tmp / "flood.db", listened=False)
    heard_first, heard_last = _submits_while_queued(tmp / "flood-listened.db", listened=True)
    emit(
        "submit_while_queued_us",
        last,
        "us",
        waiting=3000,
        first_200_us=round(first, 1),
        last_over_first=round(last / first, 2),
        listened_first_200_us=round(heard_first, 1),
        listened_last_200_us=round(heard_last, 1),
        listened_last_over_first=round(heard_last / heard_first, 2),
    )


def _submits_while_queued(path: Path, *, listened: bool) -> tuple[float, float]:
    """The median of the first and of the last 200 submits of 3,000 (us), into a
    session whose turn waits."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services

    _quiet_logs()
    gate = threading.Event()

    def reply(request: object, n: int) -> ScriptedReply:
        if n == 1:
            gate.wait(120)
        return ScriptedReply(text="好")

    store = SqliteEventStore(path)
    runtime = Runtime(store, Services(llm=ScriptedModel(reply)), janitor=False)
    heard: list[int] = []
    if listened:
        runtime.subscribe("agent:queue", lambda topic, p: heard.append(len(p["items"])))
    try:
        runtime.submit("s", Input(id="", content="占着"))
        n, times = 3000, []
        for i in range(n):  # half human (pending), half injections (queued)
            inp = Input(id="", content=f"{i}", source="schedule" if i % 2 else None)
            t = time.perf_counter()
            runtime.submit("s", inp)
            times.append(time.perf_counter() - t)
        if listened and max(heard, default=0) < n:
            raise SystemExit(f"submit_while_queued: agent:queue reported {max(heard)} of {n}")
        return statistics.median(times[:200]) * 1e6, statistics.median(times[-200:]) * 1e6
    finally:
        gate.set()
        runtime.shutdown(timeout=120)
        store.close()


def bench_submit_during_turn(tmp: Path) -> None:
    """N inputs submitted to one session while its turn's tool blocks (held to join that
    turn), or while an injection's turn runs (queued for the next), then the tool
    released; for N = 1,000 and 16,000: the submits, the wait from the release until
    every input's turn ended, and the replay (``project``) of the log with the N waiting.
    Each step should cost N: a per-submit time that grows with N is a fold that copies.
    Then (``stop_all_release_ms``) N queued released by a stop-all, and archived when the
    stopped turn settles: the stop-all until every handle resolved, and the replay of
    the log as it stands then (every load of the session folds it)."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.events import ToolCall
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    _quiet_logs()

    def blocked(name: str) -> tuple[Any, SqliteEventStore, threading.Event, threading.Event]:
        """A runtime whose first turn's tool blocks until ``gate`` is set (``in_tool`` is
        set once it does), on a store of its own."""
        gate, in_tool = threading.Event(), threading.Event()

        def reply(request: object, n: int) -> ScriptedReply:
            if n == 1:
                return ScriptedReply(tool_calls=(ToolCall(id="c1", name="block", arguments="{}"),))
            return ScriptedReply(text="好")

        def block(args: object, ctx: object) -> str:
            in_tool.set()
            gate.wait(600)
            return "好"

        store = SqliteEventStore(tmp / f"{name}.db")
        llm = ScriptedModel(reply, context_length=100_000_000, keep_requests=0)
        services = Services(llm=llm, tools=ToolRegistry([Tool("block", block)]))
        return Runtime(store, services, janitor=False), store, gate, in_tool

    def run(n: int, held: bool, k: int) -> tuple[float, float, float]:
        runtime, store, gate, in_tool = blocked(f"during-{k}")
        try:
            first = runtime.submit(
                "s", Input(id="", content="占着", source=None if held else "schedule")
            )
            in_tool.wait(60)
            t0 = time.perf_counter()
            handles = [runtime.submit("s", Input(id="", content=f"{i}")) for i in range(n)]
            submits = time.perf_counter() - t0
            assert {h.where for h in handles} == {"pending" if held else "queued"}
            events = store.read("s")
            t0 = time.perf_counter()
            project(events)
            replay = time.perf_counter() - t0
            t0 = time.perf_counter()
            gate.set()
            first.result(600)
            for h in handles:
                h.result(600)
            released = time.perf_counter() - t0
        finally:
            gate.set()
            runtime.shutdown(timeout=120)
            store.close()
        return submits, released, replay

    def stop_all(n: int, k: int) -> tuple[float, float]:
        runtime, store, gate, in_tool = blocked(f"stop-all-{k}")
        try:
            first = runtime.submit("s", Input(id="", content="占着", source="schedule"))
            in_tool.wait(60)
            handles = [runtime.submit("s", Input(id="", content=f"{i}")) for i in range(n)]
            t0 = time.perf_counter()
            runtime.stop_all("s")
            for h in handles:
                h.result(600)
            released = time.perf_counter() - t0
            gate.set()
            first.result(600)
            runtime.wait_idle(60)
            events = store.read("s")
            t0 = time.perf_counter()
            project(events)
            replay = time.perf_counter() - t0
        finally:
            gate.set()
            runtime.shutdown(timeout=120)
            store.close()
        return released, replay

    k = 0
    for held in (True, False):
        figures = {}
        for n in (1000, 16000):
            k += 1
            figures[n] = run(n, held, k)
        (s1, _, _), (s16, r16, p16) = figures[1000], figures[16000]
        emit(
            "submit_during_turn_ms",
            (s16 + r16) * 1000,
            "ms",
            inputs=16000,
            waiting="pending" if held else "queued",
            submits_ms=round(s16 * 1000, 1),
            released_ms=round(r16 * 1000, 1),
            project_ms=round(p16 * 1000, 1),
            submit_us_1k=round(s1 / 1000 * 1e6, 1),
            submit_us_16k=round(s16 / 16000 * 1e6, 1),
        )
    (r1, p1), (r16, p16) = stop_all(1000, k + 1), stop_all(16000, k + 2)
    emit(
        "stop_all_release_ms",
        r16 * 1000,
        "ms",
        inputs=16000,
        project_ms=round(p16 * 1000, 1),
        release_us_each_1k=round(r1 / 1000 * 1e6, 2),
        release_us_each_16k=round(r16 / 16000 * 1e6, 2),
        project_ms_1k=round(p1 * 1000, 1),
    )


def bench_stop_latency(tmp: Path) -> None:
    """From a stop request to the turn settled, while a model call streams."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services

    _quiet_logs()
    started = threading.Event()

    def reply(request: object, n: int) -> ScriptedReply:
        started.set()
        return ScriptedReply(text="很长的回答" * 200, chunks=200, chunk_delay_s=0.05)

    store = SqliteEventStore(tmp / "stop.db")
    runtime = Runtime(store, Services(llm=ScriptedModel(reply)), janitor=False)
    samples = []
    for i in range(20):
        started.clear()
        handle = runtime.submit(f"s{i}", Input(id="", content=USER_TEXT))
        started.wait(5)
        time.sleep(0.01)  # well inside the stream
        t0 = time.perf_counter()
        runtime.stop(f"s{i}")
        outcome = handle.result(10)
        samples.append(time.perf_counter() - t0)
        assert outcome.outcome == "aborted", outcome
    runtime.shutdown(timeout=10)
    store.close()
    emit(
        "stop_latency_ms",
        statistics.median(samples) * 1000,
        "ms",
        runs=len(samples),
        max_ms=round(max(samples) * 1000, 3),
        chunk_delay_ms=50,
    )


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_passivated_10k(tmp: Path) -> None:
    """10,000 sessions that each got one message, after passivation: threads and memory."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, Services

    _quiet_logs()
    store = SqliteEventStore(tmp / "passivate.db")
    runtime = Runtime(store, Services(llm=ScriptedModel()), idle_s=0.2)
    base_threads = threading.active_count()
    n = 10_000
    handles = [runtime.submit(f"user:{i}", Input(id="", content=USER_TEXT)) for i in range(n)]
    for h in handles:
        h.result(60)
    peak = threading.active_count()
    runtime.wait_idle(60)
    runtime.passivate_idle(0)
    deadline = time.monotonic() + 30
    while runtime.active_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    time.sleep(0.2)  # let the stopped actors' threads finish
    threads = threading.active_count()
    emit(
        "passivated_10k_threads",
        threads,
        "threads",
        sessions=n,
        before=base_threads,
        peak_after_submits=peak,
        active_sessions=len(runtime.active_sessions()),
    )
    emit("passivated_10k_rss_mb", _rss_mb(), "MiB", sessions=n)
    runtime.shutdown(timeout=30)
    store.close()


def bench_inputs_per_s_1k(tmp: Path) -> None:
    """One runtime, 1,000 concurrent sessions, the instant scripted model, SQLite log."""
    from concurrent.futures import ThreadPoolExecutor

    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, Services

    _quiet_logs()
    store = SqliteEventStore(tmp / "load.db")
    runtime = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    sessions = [f"room:{i}" for i in range(1000)]
    per_session = 5

    def drive(session: str) -> None:
        handles = [
            runtime.submit(session, Input(id="", content=USER_TEXT)) for _ in range(per_session)
        ]
        for h in handles:
            h.result(120)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(drive, sessions))
    elapsed = time.perf_counter() - start
    n = len(sessions) * per_session
    runtime.shutdown(timeout=60)
    store.close()
    emit(
        "inputs_per_s_1k_sessions",
        n / elapsed,
        "inputs/s",
        inputs=n,
        sessions=len(sessions),
        note="each input accepted and its turn ended",
    )


def _conversation(n: int) -> list[ChatMessage]:
    """``n`` history messages: user/assistant pairs with a tool group every tenth turn."""
    from aalis_agent.events import ToolCall

    out: list[ChatMessage] = []
    i = 0
    while len(out) < n:
        at = 1_767_000_000_000 + i * 60_000  # archived inputs carry their time
        meta = MessageMeta(timestamp=at, platform="qq")
        out.append(ChatMessage(id=f"u{i}", role="user", content=f"({i}) {USER_TEXT}", meta=meta))
        if i % 10 == 9:
            call = ToolCall(id=f"c{i}", name="weather", arguments='{"city": "上海"}')
            out.append(ChatMessage(id=f"a{i}", role="assistant", tool_calls=(call,)))
            out.append(
                ChatMessage(id=f"t{i}", role="tool", content=REPLY_TEXT * 3, tool_call_id=call.id)
            )
        out.append(ChatMessage(id=f"r{i}", role="assistant", content=REPLY_TEXT))
        i += 1
    return out[:n]


def bench_trim(tmp: Path) -> None:
    """Trim of a 1,000-message history: with counts kept, and counting from scratch."""
    from aalis_agent.request.tokens import TiktokenCounter, default_counter
    from aalis_agent.request.trim import TrimRequest, trim, trim_budget

    history = _conversation(1000)
    head = [ChatMessage(id="sys", role="system", content="你是一个助手。" * 20)]
    turn = [ChatMessage(id="in", role="user", content=USER_TEXT)]
    req = TrimRequest(
        head=head,
        history=history,
        turn=turn,
        budget=trim_budget(32_000, 4096),
        protected=frozenset({"in"}),
    )
    counter = default_counter()
    trim(req, counter)  # counts kept from here on
    cached = best_of(20, lambda: trim(req, counter))
    encoding = getattr(counter, "_encoding", None)

    def cold() -> None:
        fresh = TiktokenCounter(encoding) if encoding is not None else type(counter)()
        trim(req, fresh)

    cold_s = best_of(5, cold)
    emit(
        "trim_1k_cached_ms", cached * 1000, "ms", messages=1000, counter=counter.name, target="<= 1"
    )
    emit("trim_1k_cold_ms", cold_s * 1000, "ms", messages=1000, counter=counter.name)


def bench_history_prep(tmp: Path) -> None:
    """The history part of a request at 1,000 messages: from scratch (window, tool groups,
    labels, token prefix sums) and through a session's history cache after one more turn
    (4 messages) was archived."""
    from datetime import timedelta, timezone

    from aalis_agent.actors.history_cache import HistoryCache
    from aalis_agent.projections.history import HistoryState, history_window
    from aalis_agent.request.prompt import render_history
    from aalis_agent.request.tokens import default_counter, message_tokens

    counter = default_counter()
    history = _conversation(1004)
    tz = timezone(timedelta(hours=8))
    now = 1_767_300_000_000
    state = HistoryState()
    for m in history[:1000]:
        state = HistoryState(state.messages.append(m))
    grown = state
    for m in history[1000:]:
        grown = HistoryState(grown.messages.append(m))

    def scratch() -> None:
        sent = render_history(history_window(grown, 0), now, tz)
        prefix = [0]
        for m in sent:
            prefix.append(prefix[-1] + message_tokens(counter, m))

    def incremental() -> None:
        cache = HistoryCache(counter)
        cache.prepare(state, 0, None, now, tz)  # the turns before (not timed below)
        t0 = time.perf_counter()
        cache.prepare(grown, 0, None, now, tz)
        timings.append(time.perf_counter() - t0)

    scratch()
    timings: list[float] = []
    for _ in range(20):
        incremental()
    full = best_of(20, scratch)
    emit(
        "history_prep_1k_us",
        min(timings) * 1e6,
        "us",
        messages=1004,
        from_scratch_us=round(full * 1e6, 1),
        ratio=round(full / min(timings), 1),
        note="one turn's history preparation through the session's cache vs from scratch",
    )


def bench_turns(tmp: Path) -> None:
    """Tokens encoded per turn as history grows, and the whole orchestration cost of a turn
    (a user message, one tool call, a final reply) on the instant scripted model with the
    durable SQLite log, at 10, 100 and 1,000 turns of history (about 4 messages each).
    The scripted model keeps no requests (``keep_requests=0``), as a real one keeps none:
    keeping its last 1,000 (the default, for tests) holds 1,000 tuples of the whole
    history, which the cyclic GC walks (3-5 ms a young-generation pass at 1,000 turns)."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.events import ToolCall
    from aalis_agent.request.tokens import default_counter
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    _quiet_logs()

    def reply(request: object, n: int) -> ScriptedReply:
        if n % 2:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text=f"{n}: {REPLY_TEXT}")  # every reply a new text

    class CountingStore(SqliteEventStore):
        appends = 0

        def append(self, *args: Any, **kwargs: Any) -> int:
            CountingStore.appends += 1
            return super().append(*args, **kwargs)

    store = CountingStore(tmp / "turns.db")
    services = Services(
        llm=ScriptedModel(reply, context_length=1_000_000, keep_requests=0),
        tools=ToolRegistry([Tool("echo", lambda args, ctx: "好")]),
    )
    runtime = Runtime(store, services, janitor=False)
    counter = default_counter()
    encoded: list[int] = []
    # One session per history size, grown to that many turns (4 history messages each);
    # their turns are then timed in alternation, so the machine's drift during the run
    # falls on every size alike.
    sizes = (10, 100, 1000)
    done = dict.fromkeys(sizes, 0)

    def turn(size: int) -> None:
        text = f"growth {done[size]}: {USER_TEXT}"
        runtime.run(f"s{size}", Input(id="", content=text))
        done[size] += 1

    for size in sizes:
        while done[size] < size:
            turn(size)
            if done[size] % 25 == 0:
                before = counter.encodes
                turn(size)
                encoded.append(counter.encodes - before)
    messages = {size: len(runtime.view(f"s{size}").history.messages) for size in sizes}
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    appends = 0
    for _ in range(100):  # 100 each: with 30, five runs here gave ratios of 1.12 to 1.27
        for size in sizes:
            appends_before = CountingStore.appends
            t0 = time.perf_counter()
            turn(size)
            samples[size].append(time.perf_counter() - t0)
            if size == sizes[-1]:
                appends += CountingStore.appends - appends_before
    runtime.shutdown(timeout=60)
    store.close()
    emit(
        "tokens_encoded_per_turn",
        statistics.median(encoded),
        "texts",
        samples=encoded,
        note="texts newly encoded by one turn as the history grows; flat means only new ones",
    )
    overhead = {size: statistics.median(samples[size]) for size in sizes}
    for size in sizes:
        emit(
            "turn_overhead_ms",
            overhead[size] * 1000,
            "ms",
            history_turns=size,
            history_messages=messages[size],
            calls=2,
            tool_calls=1,
        )
    emit(
        "turn_overhead_ratio",
        overhead[sizes[-1]] / overhead[sizes[0]],
        "x",
        note=f"median turn at {sizes[-1]} turns of history over the median at {sizes[0]}, "
        "timed in alternation",
        target="<= 1.2",
    )
    emit(
        "commits_per_tool_turn",
        appends / 100,
        "commits",
        note="durable appends a tool turn waits on (open with its archive and first call; "
        "the tool's start; its result with the next call; the reply with the turn's end)",
    )


def tool_turn_services() -> Any:
    """The side-by-side workload's services: an instant scripted model that answers each
    user message with one tool call, then (after the tool) with a new reply text. A
    module-level function, so that worker processes can build them too."""
    from aalis_agent.events import ToolCall
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    def reply(request: object, n: int) -> ScriptedReply:
        if n % 2:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text=f"{n}: {REPLY_TEXT}")

    return Services(
        llm=ScriptedModel(reply, context_length=1_000_000, keep_requests=0),
        tools=ToolRegistry([Tool("echo", lambda args, ctx: "好")]),
    )


def _tool_turn_runtime(store: SqliteEventStore, max_live_sessions: int | None = None) -> Any:
    """The side-by-side workload's runtime (:func:`tool_turn_services`)."""
    from aalis_agent.actors.runtime import Runtime

    services = tool_turn_services()
    return Runtime(store, services, janitor=False, max_live_sessions=max_live_sessions)


def _db_bytes(store: SqliteEventStore, path: Path) -> tuple[int, int]:
    """The database file's size after a checkpoint and a VACUUM, and the stored payload."""
    conn = store._conn
    payload = conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM events").fetchone()[0]
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("VACUUM")
    return path.stat().st_size, int(payload)


def bench_turns_workload(tmp: Path, turns: int) -> None:
    """The side-by-side workload (see scripts/peers): one session, ``turns`` turns of a
    user message, one tool call, the tool and a reply, on the durable SQLite log; p50 per
    turn, the last 10 turns over the first 10, and the bytes stored per turn. Each turn is
    driven with ``Runtime.run`` (the synchronous call: the turn runs on this thread)."""
    _quiet_logs()
    path = tmp / f"workload-{turns}.db"
    store = SqliteEventStore(path)
    runtime = _tool_turn_runtime(store)
    # One turn in another session first: loading the encoding is not a turn's cost.
    runtime.run("warm-up", Input(id="", content=USER_TEXT))
    samples: list[float] = []
    for n in range(turns):
        t0 = time.perf_counter()
        runtime.run("s", Input(id="", content=f"{n}: {USER_TEXT}"))
        samples.append(time.perf_counter() - t0)
    runtime.shutdown(timeout=60)
    size, payload = _db_bytes(store, path)
    store.close()
    first, last = samples[:10], samples[-10:]
    emit(
        "turns_workload",
        statistics.median(samples) * 1000,
        "ms",
        peer="aalis-agent",
        via="Runtime.run",
        turns=turns,
        p50_ms=round(statistics.median(samples) * 1000, 3),
        last10_over_first10=round(statistics.mean(last) / statistics.mean(first), 3),
        bytes_per_turn=round(size / turns),
        payload_bytes_per_turn=round(payload / turns),
    )


class _FloorWork:
    """The floor's workload: a runtime whose session "s" has 12 history messages (4 tool
    turns), the rows of its last turn and the history before it, and a second store the
    floor writes those rows to raw: on into one session of its own, as a turn's rows go
    on into its session (the first commits with work open, the last with none: the store
    marks the session idle, as after a turn, and keeps its row compressor as it does for
    the two idle sessions written last); or, for comparison, each time as a new session
    (which adds the session's own row, its first lookup and a new compressor: about
    60 us)."""

    def __init__(self, tmp: Path) -> None:
        _quiet_logs()
        self.store = SqliteEventStore(tmp / "floor-turns.db")
        self.runtime = _tool_turn_runtime(self.store)
        append = self.store.append
        sizes: list[int] = []  # the events of each of a turn's commits, in order

        def counted(session_id: str, batch: Any, *args: Any, **kwargs: Any) -> int:
            sizes.append(len(batch))
            return append(session_id, batch, *args, **kwargs)

        self.store.append = counted  # type: ignore[method-assign]
        for n in range(4):  # 12 history messages before the turn the floor writes raw
            sizes.clear()
            self.runtime.run("s", Input(id="", content=f"{n}: {USER_TEXT}"))
        self.store.append = append  # type: ignore[method-assign]
        self.turns = 4
        events = self.store.read("s")
        # One turn's rows: everything from the last user input on.
        last = max(i for i, e in enumerate(events) if isinstance(e, InputReceived))
        self.rows = events[last:]
        self.history = [e.message for e in events[:last] if isinstance(e, MessageSaved)][-12:]
        # The same rows in the commits persist-then-act needs (before the first call,
        # before the tool, before the second call, before the outcome), as the turn cuts
        # them.
        self.cuts4 = list(itertools.accumulate(sizes))
        assert self.cuts4[-1] == len(self.rows), (sizes, len(self.rows))
        self.sizes = sizes
        self.raw = SqliteEventStore(tmp / "floor-raw.db")
        self._seq = 0  # new sessions written
        self._raw_seq = 0  # the last seq of the session the floor goes on into

    def turn(self) -> None:
        """One more turn of session "s" through the runtime (``Runtime.run``)."""
        self.runtime.run("s", Input(id="", content=f"{self.turns}: {USER_TEXT}"))
        self.turns += 1

    def raw_turn(self, cuts: Sequence[int], *, new_session: bool = False) -> None:
        """The turn's rows, written raw in commits ending at ``cuts`` (on into the
        floor's session, or as a new one), and its two request lists."""
        rows, history = self.rows, self.history
        if new_session:
            session, base, open_work = f"raw{self._seq}", 0, None
            self._seq += 1
        else:
            session, base, open_work = "raw", self._raw_seq, True
        batch = [msgspec.structs.replace(e, session_id=session) for e in rows]
        for i, e in enumerate(batch):
            batch[i] = msgspec.structs.replace(e, seq=base + i + 1)
        start = 0
        for end in cuts:
            last = end == cuts[-1]
            work = False if last and open_work else open_work  # the turn's end: idle
            self.raw.append(session, batch[start:end], base + start, open_work=work)
            start = end
        for _ in range(2):  # the two calls' request lists
            request = [history[0], *history, rows[0]]
            assert request
        if not new_session:
            self._raw_seq = base + len(rows)

    def floor(self) -> None:
        """The floor: the turn's rows in two commits, on into the floor's session."""
        self.raw_turn((len(self.rows) // 2, len(self.rows)))

    def floor_new_session(self) -> None:
        """The same, each time as a new session (the floor as first defined)."""
        self.raw_turn((len(self.rows) // 2, len(self.rows)), new_session=True)

    def floor_4(self) -> None:
        """The same rows in the turn's own four commits."""
        self.raw_turn(self.cuts4)

    def close(self) -> None:
        self.runtime.shutdown(timeout=60)
        self.store.close()
        self.raw.close()


def bench_floor(tmp: Path) -> None:
    """The unavoidable work of one tool turn at 10 history messages: its rows written raw
    in two commits (msgpack encoding included) and its two request lists built, beside
    the whole turn through the runtime (``Runtime.run``), for the ratio (target <= 4).
    The two are timed in alternating blocks (10 turns, then the floor 10 times; 4 of
    each, each block after one untimed run of its own), so a slow stretch of a shared
    machine weighs on both alike and each is timed warm, as it runs back to back.
    Beside it, not the target's: the same rows in the four commits the turn makes
    (persist-then-act: before each model call, before the tool, before the outcome),
    timed the same way after each block's floors; and the floor written each time as a
    new session (``floor_new_session_ms``, as it was first defined): that adds work no
    turn of a session does (about 60 us) and lowers the ratio (``over_floor_new_session``).

    The process is warmed first: 200 turns and floors of a workload of its own, closed
    before the timed one starts. CPython specializes a function's bytecode only once it
    has run a number of times, and a runtime serving sessions runs warm; from a cold
    process the turn measured about 15% slower here (0.78-0.80 ms against 0.68-0.72),
    the floor the same. ``cold_turn_ms`` is the median of the warm-up's first 40 turns,
    for comparison (it grows the warm-up's own session as the timed turns do theirs).
    ``commit_in_turn_us`` and ``commit_in_floor_4_us``: a commit's median time where it
    runs, inside turns and in the floor's loop (same rows, same store code), timed after
    the blocks above: the turn's commits run cache-cold after its own work."""
    (tmp / "warm-up").mkdir(exist_ok=True)
    warm = _FloorWork(tmp / "warm-up")
    cold: list[float] = []
    for n in range(200):
        t0 = time.perf_counter()
        warm.turn()
        if n < 40:
            cold.append(time.perf_counter() - t0)
        warm.floor()
        warm.floor_4()
        warm.floor_new_session()
    warm.close()
    work = _FloorWork(tmp)
    one_turn, one_turn_4, one_new = work.floor, work.floor_4, work.floor_new_session
    samples: list[float] = []
    floors: list[float] = []
    after_turns: list[float] = []  # the floor's first run in a block, straight after turns
    floors4: list[float] = []
    floors_new: list[float] = []
    for _ in range(4):
        for k in range(11):
            t0 = time.perf_counter()
            work.turn()
            if k:  # the block's first turn follows the floor's runs: untimed
                samples.append(time.perf_counter() - t0)
        after_turns.append(_timed(one_turn))
        floors += [_timed(one_turn) for _ in range(10)]
        _timed(one_turn_4)
        floors4 += [_timed(one_turn_4) for _ in range(10)]
        _timed(one_new)
        floors_new += [_timed(one_new) for _ in range(10)]
    # Then each commit timed where it runs: inside turns, and in the floor's loop (the same
    # rows in the same four cuts), in blocks as above; reported beside the ratio.
    in_turns: list[float] = []
    in_floor: list[float] = []

    def commits_timed(store: SqliteEventStore, into: list[float]) -> Callable[[], None]:
        append = store.append

        def timed(*args: Any, **kwargs: Any) -> int:
            t0 = time.perf_counter()
            try:
                return append(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - t0)

        store.append = timed  # type: ignore[method-assign]
        return lambda: setattr(store, "append", append)

    restore = [commits_timed(work.store, in_turns), commits_timed(work.raw, in_floor)]
    for _ in range(10):
        for _ in range(10):
            work.turn()
        for _ in range(10):
            one_turn_4()
    for undo in restore:
        undo()
    work.close()
    floor = min(floors)
    turn = statistics.median(samples)
    emit(
        "floor_ratio",
        turn / floor,
        "x",
        turn_ms=round(turn * 1000, 3),
        floor_ms=round(floor * 1000, 3),
        # The headline is the turn's median over the floor's best; like for like:
        median_over_median=round(turn / statistics.median(floors), 2),
        best_over_best=round(min(samples) / floor, 2),
        floor_after_turns_ms=round(statistics.median(after_turns) * 1000, 3),
        # Not the target's floor: the same rows in the turn's own four commits.
        floor_4_commits_ms=round(min(floors4) * 1000, 3),
        over_floor_4_commits=round(turn / min(floors4), 2),
        cold_turn_ms=round(statistics.median(cold) * 1000, 3),
        # Nor this: the floor written each time as a new session (as first defined).
        floor_new_session_ms=round(min(floors_new) * 1000, 3),
        over_floor_new_session=round(turn / min(floors_new), 2),
        # One commit's median where it runs: in a turn (cache-cold after the turn's own
        # work) and in the floor's back-to-back loop (the same rows, the same code).
        commit_in_turn_us=round(statistics.median(in_turns) * 1e6, 1),
        commit_in_floor_4_us=round(statistics.median(in_floor) * 1e6, 1),
        commits=len(work.sizes),
        rows=len(work.rows),
        history=len(work.history),
        via="Runtime.run",
        timed="in alternating blocks",
        target="<= 4",
    )


def _floor_child(spec: str) -> None:
    """``--child KIND:N``: the floor's workload, then N more of KIND (``turn``, ``floor``
    or ``floor_4``), for :func:`bench_floor_instructions` to count under valgrind."""
    kind, _, n = spec.partition(":")
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        work = _FloorWork(Path(tmpdir))
        run = {"turn": work.turn, "floor": work.floor, "floor_4": work.floor_4}[kind]
        for _ in range(int(n)):
            run()
        work.close()


def bench_floor_instructions(tmp: Path) -> None:
    """The floor's ratio counted in instructions instead of seconds: each side's work
    run under valgrind's callgrind, which counts the instructions a process executes
    (repeatable, whatever else the machine does). Each side runs twice, 8 and 48 times
    after the same setup, in processes of their own; the difference over 40 is one
    turn's (one floor's) instructions. Not the target's figure (floor_ratio, in time,
    is): beside it, it tells how much of that ratio is work done and how much is work
    done slower (a turn's Python runs at fewer instructions a second than the floor's
    native loop). Skipped where valgrind is not installed."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(json.dumps({"bench": "floor_instructions", "value": None, "skipped": "no valgrind"}))
        return
    from concurrent.futures import ThreadPoolExecutor

    lo, hi = 8, 48

    def count(job: tuple[str, int]) -> int:
        kind, n = job
        out = tmp / f"callgrind.{kind}.{n}"
        done = subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                f"{kind}:{n}",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
            check=False,
        )
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode or found is None:
            raise SystemExit(f"floor_instructions: {kind} x{n} failed:\n{done.stderr[-2000:]}")
        return int(found.group(1))

    jobs = [(kind, n) for kind in ("turn", "floor", "floor_4") for n in (lo, hi)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counted = dict(zip(jobs, pool.map(count, jobs), strict=True))
    per = {
        kind: (counted[kind, hi] - counted[kind, lo]) / (hi - lo)
        for kind in ("turn", "floor", "floor_4")
    }
    emit(
        "floor_instructions",
        per["turn"] / per["floor"],
        "x",
        turn_instructions=round(per["turn"]),
        floor_instructions=round(per["floor"]),
        floor_4_commits_instructions=round(per["floor_4"]),
        over_floor_4_commits=round(per["turn"] / per["floor_4"], 2),
        counted="callgrind, (48 - 8 runs) / 40, each side in its own process",
        note="not the target (floor_ratio, in time, is)",
    )


_PHASES = (
    "submit: entry, checks, the open decided",
    "commit 1: the input, its turn opened and archived, the first call",
    "to model call 1: the prompt, history, trim",
    "model call 1 to commit 2: usage, the reply taken",
    "commit 2: the tool call and the tool's start",
    "to the tool",
    "the tool to commit 3: its result, the second call",
    "commit 3: the result and the second call",
    "to model call 2: the request, trim",
    "model call 2 to commit 4: usage, the reply taken",
    "commit 4: the reply and the turn's end",
    "after commit 4: effects, the outcome returned",
)


def bench_turn_phases(tmp: Path) -> None:
    """Where a tool turn's time goes, on the floor's workload (``Runtime.run``, 4 to 40
    turns of history): the median time of each of its four commits (``append`` as the
    store runs it) and of each stretch between them, the model call and the tool, with
    the turn's median, the commits' sum and the rest (the runtime's own work). Each
    stretch is timed from marks the scripted model, the tool and the store's ``append``
    leave as the turn goes; timing adds two clock reads per mark."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.events import ToolCall
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    _quiet_logs()
    clock = time.perf_counter_ns
    marks: list[tuple[str, int]] = []

    def reply(request: object, n: int) -> ScriptedReply:
        marks.append(("model", clock()))
        if n % 2:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text=f"{n}: {REPLY_TEXT}")

    def tool(args: object, ctx: object) -> str:
        marks.append(("tool", clock()))
        return "好"

    store = SqliteEventStore(tmp / "phases.db")
    append = store.append

    def timed_append(*args: Any, **kwargs: Any) -> int:
        marks.append(("commit", clock()))
        try:
            return append(*args, **kwargs)
        finally:
            marks.append(("committed", clock()))

    store.append = timed_append  # type: ignore[method-assign]
    services = Services(
        llm=ScriptedModel(reply, context_length=1_000_000, keep_requests=0),
        tools=ToolRegistry([Tool("echo", tool)]),
    )
    runtime = Runtime(store, services, janitor=False)
    runtime.run("warm-up", Input(id="", content=USER_TEXT))
    expected = ["run", "commit", "committed", "model", "commit", "committed", "tool"]
    expected += ["commit", "committed", "model", "commit", "committed", "returned"]
    stretches: list[list[int]] = [[] for _ in _PHASES]
    totals: list[int] = []
    other = 0
    for session in range(20):
        for n in range(40):
            marks.clear()
            marks.append(("run", clock()))
            runtime.run(f"s{session}", Input(id="", content=f"{n}: {USER_TEXT}"))
            marks.append(("returned", clock()))
            if n < 4:
                continue  # the session's first turns: too little history
            if [name for name, _ in marks] != expected:
                other += 1
                continue
            for i, stretch in enumerate(stretches):
                stretch.append(marks[i + 1][1] - marks[i][1])
            totals.append(marks[-1][1] - marks[0][1])
    runtime.shutdown(timeout=60)
    store.close()
    if not totals:
        raise SystemExit(f"turn_phases: no turn had the expected shape ({other} others)")
    medians = [statistics.median(s) / 1000 for s in stretches]
    commits = sum(medians[i] for i in (1, 4, 7, 10))
    emit(
        "turn_phases",
        statistics.median(totals) / 1000,
        "us",
        turns=len(totals),
        other_shapes=other,
        commits_us=round(commits, 1),
        rest_us=round(sum(medians) - commits, 1),
        phases_us={name: round(m, 1) for name, m in zip(_PHASES, medians, strict=True)},
        note="medians of each stretch; the turn's median beside their sum",
    )


def quiet_tool_turn_services() -> Any:
    """:func:`tool_turn_services` in a worker process, its warnings only logged."""
    _quiet_logs()
    return tool_turn_services()


def bench_many_sessions(tmp: Path) -> None:
    """The side-by-side workload spread over 1,000 sessions × 5 turns, driven from 4
    threads (each runs a session's turns one after another), against one session's turns
    run sequentially (on a runtime and a store of its own). Twice: in this process
    (``Runtime.run``: no worker threads; one core's worth of Python at most), and over
    2 worker processes (``ProcessShards.run``, a SQLite log per shard). The machine's
    speed drifts, so each is interleaved with the sequential runs: five rounds of 200
    sessions, each between two stretches of 40 sequential turns; a ratio is the sessions'
    throughput over the sequential one around its rounds (target >= 1 for the workers),
    with the rounds' own ratios beside it, and latency p50/p99.
    Then memory (in this process): RSS once every session is passivated, and after three
    cycles of reviving each session for one more turn and passivating it again (no
    growth expected). The runtime keeps at most 256 sessions live
    (``max_live_sessions``; 128 in each of the two workers), as a host of thousands of
    sessions would: memory is bounded by the live ones, not by all."""
    from concurrent.futures import ThreadPoolExecutor

    from aalis_agent.request.tokens import default_counter
    from aalis_agent.scale.processes import ProcessShards

    _quiet_logs()
    store = SqliteEventStore(tmp / "many.db")
    live_cap = 256
    runtime = _tool_turn_runtime(store, max_live_sessions=live_cap)
    runtime.run("warm-up", Input(id="", content=USER_TEXT))
    workers = 2
    shards = ProcessShards(
        tmp / "shards",
        quiet_tool_turn_services,
        workers,
        runtime_options={"janitor": False, "max_live_sessions": live_cap // workers},
    )
    alone_store = SqliteEventStore(tmp / "alone.db")
    alone = _tool_turn_runtime(alone_store)
    alone.run("alone", Input(id="", content=USER_TEXT))
    sequential_turns = 0

    def one_session(turns: int) -> float:
        nonlocal sequential_turns
        t0 = time.perf_counter()
        for _ in range(turns):
            sequential_turns += 1
            alone.run("alone", Input(id="", content=f"{sequential_turns}: {USER_TEXT}"))
        return time.perf_counter() - t0

    sessions = [f"room:{i}" for i in range(1000)]
    rounds, per_round, stretch = 5, 200, 40
    seq = [one_session(stretch)]

    def drive_rounds(run: Callable[[str, Input], Any]) -> dict[str, Any]:
        latencies: list[float] = []
        lock = threading.Lock()

        def drive(session: str) -> None:
            mine = []
            for n in range(5):
                t = time.perf_counter()
                run(session, Input(id="", content=f"{n}: {USER_TEXT}"))
                mine.append(time.perf_counter() - t)
            with lock:
                latencies.extend(mine)

        took_all, round_ratios = 0.0, []
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(drive, [f"warm:{i}" for i in range(8)]))  # connections, caches
            latencies.clear()
            for r in range(rounds):
                t0 = time.perf_counter()
                list(pool.map(drive, sessions[r * per_round : (r + 1) * per_round]))
                took = time.perf_counter() - t0
                took_all += took
                seq.append(one_session(stretch))
                around = (seq[-2] + seq[-1]) / (2 * stretch)  # seconds a sequential turn
                round_ratios.append(round(per_round * 5 / took * around, 3))
        first = len(seq) - rounds - 1  # the stretches around these rounds
        sequential = (rounds + 1) * stretch / sum(seq[first:])
        rate = len(latencies) / took_all
        latencies.sort()
        return {
            "rate": rate,
            "sessions": len(sessions),
            "turns": len(latencies),
            "threads": 4,
            "one_session_sequential": round(sequential, 1),
            "ratio": round(rate / sequential, 3),
            "round_ratios": round_ratios,
            "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
            "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 3),
        }

    try:
        here = drive_rounds(runtime.run)
        gate = runtime.workers.gate
        emit(
            "many_sessions_turns_per_s",
            here.pop("rate"),
            "turns/s",
            **here,
            via="Runtime.run, in this process",
            gate_handoffs=gate.handoffs,
            gate_waited_out=gate.waited_out,
            max_live_sessions=live_cap,
            note="one process runs one thread's Python at a time: see the processes line",
        )
        over = drive_rounds(shards.run)
        emit(
            "many_sessions_processes_turns_per_s",
            over.pop("rate"),
            "turns/s",
            **over,
            via=f"ProcessShards.run, {workers} worker processes, a SQLite log each",
            max_live_sessions_per_worker=live_cap // workers,
            target="ratio >= 1",
        )
    finally:
        shards.shutdown(timeout=60)
    alone.shutdown(timeout=60)
    alone_store.close()

    counter = default_counter()
    cached: list[int] = []

    def passivate_all() -> tuple[float, int]:
        runtime.wait_idle(60)
        runtime.passivate_idle(0)
        deadline = time.monotonic() + 60
        while runtime.active_sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
        time.sleep(0.3)  # the stopped actors' threads finish
        mb = _rss_mb()
        # The process-wide token-count cache (bounded, 50,000 texts) keeps each turn's new
        # texts; it is counted, then dropped, so the live blocks are what sessions keep.
        cached.append(getattr(counter, "cached_texts", 0))
        if hasattr(counter, "cache_clear"):
            counter.cache_clear()
        gc.collect()
        return mb, sys.getallocatedblocks()

    rss, blocks = [], []
    for cycle in range(4):
        if cycle:
            for session in sessions:
                runtime.submit(session, Input(id="", content=f"again {cycle}")).result(120)
        mb, live = passivate_all()
        rss.append(mb)
        blocks.append(live)
    runtime.shutdown(timeout=60)
    store.close()
    emit(
        "passivated_rss_mb",
        rss[0],
        "MiB",
        sessions=len(sessions),
        after_cycles=[round(r, 1) for r in rss[1:]],
        growth_per_cycle_kib_per_session=round((rss[-1] - rss[0]) / 3 * 1024 / len(sessions), 2),
        live_blocks_after=blocks,
        live_block_growth_per_cycle_per_session=round(
            (blocks[-1] - blocks[0]) / 3 / len(sessions), 2
        ),
        token_cache_texts=cached,
        max_live_sessions=live_cap,
        threads_after=threading.active_count(),
        note="each cycle revives every session for one turn, then passivates it; live "
        "blocks are the Python objects still allocated, counted with the bounded token "
        "cache emptied (RSS keeps the allocator's peak)",
    )


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ALL = (
    "append_single_eps",
    "append_single_exclusive_eps",
    "append_tail_ms",
    "append_batch_eps",
    "replay_eps",
    "recover_1k_ms",
    "startup_recover_ms",
    "bytes_per_message",
    "sched_decision_us",
    "submit_while_queued_us",
    "submit_during_turn_ms",
    "stop_latency_ms",
    "passivated_10k",
    "inputs_per_s_1k_sessions",
    "trim_1k",
    "history_prep_1k_us",
    "turns",
    "turns_workload",
    "floor",
    "floor_instructions",
    "turn_phases",
    "many_sessions",
    "first_token",
    "inspector_100k",
    "stored_bytes_per_turn",
    "pg_turn",
    "shards",
)


def _positive_int(text: str) -> int:
    """``--turns``: a whole number of turns, at least 1 (the workload's median needs one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(ALL)}")
    parser.add_argument(
        "--turns",
        type=_positive_int,
        default=200,
        metavar="N",
        help="turns of the side-by-side workload (turns_workload; default 200)",
    )
    parser.add_argument(
        "--targets",
        action="store_true",
        help="run the benchmarks that measure the speed targets (with any NAMEs given), "
        "then print each target beside what was measured; exits 1 when one is not met",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # floor_instructions' runs
    args = parser.parse_args(argv)
    if args.child:
        _floor_child(args.child)
        return 0
    unknown = [n for n in args.names if n not in ALL]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(ALL)}")
    names = args.names or list(ALL)
    if args.targets:
        wanted = {t[0] for t in TARGETS}
        names = [n for n in ALL if n in wanted or n in args.names]
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        tmp = Path(tmpdir)
        big: SqliteEventStore | None = None
        for name in names:
            if name in ("replay_eps", "recover_1k_ms") and big is None:
                print(
                    f"building a {SESSIONS * EVENTS_PER_SESSION:,}-event database…", file=sys.stderr
                )
                build_100k(tmp / "big.db").close()
                big = SqliteEventStore(tmp / "big.db")  # as a new process would open it
            gc.collect()
            if name == "append_single_eps":
                bench_append_single(tmp)
            elif name == "append_single_exclusive_eps":
                bench_append_single(tmp, exclusive=True)
            elif name == "append_tail_ms":
                bench_append_tail(tmp)
            elif name == "append_batch_eps":
                bench_append_batch(tmp)
            elif name == "replay_eps":
                assert big is not None
                bench_replay(big)
            elif name == "recover_1k_ms":
                assert big is not None
                bench_recover(big)
            elif name == "startup_recover_ms":
                bench_startup(tmp)
            elif name == "bytes_per_message":
                bench_bytes_per_message(tmp)
            elif name == "sched_decision_us":
                bench_sched_decision(tmp)
            elif name == "submit_while_queued_us":
                bench_submit_while_queued(tmp)
            elif name == "submit_during_turn_ms":
                bench_submit_during_turn(tmp)
            elif name == "stop_latency_ms":
                bench_stop_latency(tmp)
            elif name == "passivated_10k":
                bench_passivated_10k(tmp)
            elif name == "inputs_per_s_1k_sessions":
                bench_inputs_per_s_1k(tmp)
            elif name == "trim_1k":
                bench_trim(tmp)
            elif name == "history_prep_1k_us":
                bench_history_prep(tmp)
            elif name == "turns":
                bench_turns(tmp)
            elif name == "turns_workload":
                bench_turns_workload(tmp, args.turns)
            elif name == "floor":
                bench_floor(tmp)
            elif name == "floor_instructions":
                bench_floor_instructions(tmp)
            elif name == "turn_phases":
                bench_turn_phases(tmp)
            elif name == "many_sessions":
                bench_many_sessions(tmp)
            elif name == "first_token":
                from bench_stream import bench_first_token

                bench_first_token(tmp, emit)
            elif name == "inspector_100k":
                from bench_inspector import bench_inspector_100k

                bench_inspector_100k(tmp, emit)
            elif name == "stored_bytes_per_turn":
                from bench_store import bench_stored_bytes_per_turn

                bench_stored_bytes_per_turn(tmp, emit)
            elif name == "pg_turn":  # starts a throwaway PostgreSQL cluster
                from bench_pg import bench_pg_turn

                bench_pg_turn(tmp, emit)
            elif name == "shards":  # starts a local Ray cluster and PostgreSQL
                from bench_scale import bench_shards

                bench_shards(tmp, emit)
        if big is not None:
            big.close()
    if args.targets:
        return 1 if report_targets() else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
