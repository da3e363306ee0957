"""Stored bytes per turn: a tool turn run through the real runtime on the durable store.

``.venv/bin/python scripts/bench_store.py`` prints one JSON line per figure, as
``scripts/bench`` does: ``{"bench": NAME, "value": X, "unit": U, ...}``.

The workload is the one ``bench turns`` times: a user message, the model calls one tool,
the tool runs, a final reply; the runtime's own ids and clock; one session, ``TURNS``
turns, on :class:`SqliteEventStore`. Every message and reply is a new text: CJK
characters drawn at random (from a fixed seed), as long as ``bench turns``'s texts, so
that no row finds a text of another turn to refer to.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aalis_agent.events import Input, SqliteEventStore, ToolCall, encode

TURNS = 200
SESSION = "qq:group:123456"
USER_TEXT = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
REPLY_TEXT = "明天上海多云转小雨,14 到 21 度,东南风 3 级,下午可能有阵雨,出门记得带伞。"

Emit = Callable[..., None]


def texts(seed: int = 2026) -> Callable[[int, int], str]:
    """``text(n, length)``: ``"<n>: "`` and ``length`` random CJK characters."""
    rng = random.Random(seed)

    def text(n: int, length: int) -> str:
        return f"{n}: " + "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(length))

    return text


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": name, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


def _quiet_logs() -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def bench_stored_bytes_per_turn(tmp: Path, emit: Emit, turns: int = TURNS) -> None:
    """Run ``turns`` tool turns in one session, then measure the database file (after a
    WAL checkpoint and VACUUM) and the stored event bytes, per turn."""
    from aalis_agent.actors.runtime import Runtime
    from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

    _quiet_logs()
    text = texts()

    def reply(request: object, n: int) -> ScriptedReply:
        if n % 2:
            return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="echo", arguments="{}"),))
        return ScriptedReply(text=text(n, len(REPLY_TEXT)))

    path = tmp / "stored.db"
    store = SqliteEventStore(path)
    services = Services(
        llm=ScriptedModel(reply, context_length=1_000_000, keep_requests=0),
        tools=ToolRegistry([Tool("echo", lambda args, ctx: "好")]),
    )
    runtime = Runtime(store, services, janitor=False)
    try:
        for n in range(turns):
            content = text(n, len(USER_TEXT))
            runtime.submit(SESSION, Input(id="", content=content)).result(60)
        assert runtime.wait_idle(60)
    finally:
        runtime.shutdown(timeout=60)
    events = store.read(SESSION)
    payload = _stored_payload(store)
    store.close()
    # As the file would be copied or backed up: the WAL folded in, free pages dropped.
    store = SqliteEventStore(path)
    store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store._conn.execute("VACUUM")
    store.close()
    size = path.stat().st_size
    emit(
        "stored_bytes_per_turn",
        size / turns,
        "bytes",
        turns=turns,
        events=len(events),
        db_bytes=size,
        payload_bytes_per_turn=round(payload / turns, 1),
        unpacked_bytes_per_turn=round(sum(len(encode(e)) for e in events) / turns, 1),
        target="<= 1024",
    )
    emit("payload_bytes_per_turn", payload / turns, "bytes", turns=turns, rows=_rows(store))


def _stored_payload(store: SqliteEventStore) -> int:
    """The bytes of the ``data`` column: the events as stored, without SQLite's own."""
    row: Any = store._conn.execute("SELECT sum(length(data)) FROM events").fetchone()
    return int(row[0] or 0)


def _rows(store: SqliteEventStore) -> int:
    con = __import__("sqlite3").connect(store.path)
    try:
        return int(con.execute("SELECT count(*) FROM events").fetchone()[0])
    finally:
        con.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        bench_stored_bytes_per_turn(Path(tmpdir), emit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
