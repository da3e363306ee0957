"""The inspector on a 100k-event session: how soon its first timeline page answers.

``.venv/bin/python scripts/bench_inspector.py`` prints one JSON line per figure, as
``scripts/bench`` does: ``{"bench": NAME, "value": X, "unit": U, ...}``.

The session is written as the runtime writes one: ordinary tool turns (15 events each,
one batch a turn) until it holds 100,000 events. The server is started on a loopback port
over the file opened read-only, then asked over HTTP, as the page asks: the first
timeline page (cold: the log is decoded and indexed on that first request), the last
page, the token-usage series, the state at the middle of the log (cold and warm) and one
model call's request.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from aalis_agent.events import FixedClock, SqliteEventStore
from aalis_agent.inspector.server import make_server
from aalis_agent.testing.sample import SampleWriter, synthetic_turn

EVENTS = 100_000
SESSION = "qq:group:100k"

Emit = Callable[..., None]


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": name, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


def build_session(path: Path, events: int = EVENTS) -> int:
    """Write one session of ``events`` or a few more; returns its last seq."""
    with SqliteEventStore(path) as store:
        writer = SampleWriter(store, SESSION, FixedClock(1_767_225_600_000, step_ms=10))
        n = 0
        while writer.last_seq < events:
            n += 1
            batch = writer.batch()
            synthetic_turn(batch, n)
            writer.commit(batch)
        return writer.last_seq


def _get(url: str) -> tuple[float, int, dict[str, object]]:
    """Seconds to the whole answer, its bytes, and the decoded JSON."""
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as res:
        body = res.read()
    return time.perf_counter() - start, len(body), json.loads(body)


def bench_inspector_100k(tmp: Path, emit: Emit) -> None:
    db = tmp / "inspect-100k.db"
    started = time.perf_counter()
    last = build_session(db)
    print(f"built {last:,} events in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    server = make_server(db)
    server.start()
    try:
        base = f"{server.url}api/sessions/{quote(SESSION, safe='')}"
        seconds, size, page = _get(f"{base}/timeline?offset=0&limit=50")
        turns = page["turns_total"]
        emit(
            "inspector_first_page_ms_100k",
            seconds * 1000,
            "ms",
            events=last,
            turns=turns,
            bytes=size,
            target="< 1000 (cold: decode and index the log)",
        )
        seconds, size, _ = _get(f"{base}/timeline?offset=-50&limit=50")
        emit("inspector_last_page_ms_100k", seconds * 1000, "ms", bytes=size)
        seconds, size, usage = _get(f"{base}/usage")
        emit("inspector_usage_ms_100k", seconds * 1000, "ms", points=usage["points"], bytes=size)
        middle = last // 2
        seconds, size, _ = _get(f"{base}/state?seq={middle}")
        emit("inspector_state_cold_ms_100k", seconds * 1000, "ms", seq=middle, bytes=size)
        seconds, size, _ = _get(f"{base}/state?seq={middle + 7}")
        emit("inspector_state_warm_ms_100k", seconds * 1000, "ms", seq=middle + 7, bytes=size)
        turn = f"turn-{turns // 2}"
        seconds, size, _ = _get(f"{base}/request?turn={turn}&index=2")
        emit("inspector_request_ms_100k", seconds * 1000, "ms", turn=turn, bytes=size)
    finally:
        server.stop()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        bench_inspector_100k(Path(tmpdir), emit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
