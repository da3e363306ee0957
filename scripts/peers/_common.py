"""What the peer benchmarks share: the workload's texts, a guard that keeps every socket
off the network, the timed loop, the storage measure and the JSON line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The same texts as the project's own ``turns`` benchmark (scripts/bench.py).
USER_TEXT = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
REPLY_TEXT = "明天上海多云转小雨,14 到 21 度,东南风 3 级,下午可能有阵雨,出门记得带伞。"
TOOL_RESULT = "好"
SESSION_ID = "s"

# Tracing and telemetry off before any framework is imported.
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["LANGSMITH_TRACING_V2"] = "false"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
for _key in ("LANGSMITH_API_KEY", "LANGCHAIN_API_KEY", "LANGSMITH_ENDPOINT", "OPENAI_BASE_URL"):
    os.environ.pop(_key, None)

blocked: list[str] = []


def _is_local(address: Any) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = str(address[0]) if isinstance(address, tuple) and address else ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _guard(method: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: socket.socket, address: Any) -> Any:
        if not _is_local(address):
            blocked.append(repr(address))
            raise OSError(f"peer benchmark: network access blocked ({address!r})")
        return method(self, address)

    return guarded


def block_network() -> None:
    """Refuse every socket connection off this machine, and remember the attempts."""
    socket.socket.connect = _guard(socket.socket.connect)  # type: ignore[method-assign]
    socket.socket.connect_ex = _guard(socket.socket.connect_ex)  # type: ignore[method-assign]


def parse_args(peer: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=f"The turns workload on {peer}: one session, N turns, each a user "
        "message, one `echo` tool call and a final reply, on durable SQLite."
    )
    parser.add_argument("--turns", type=int, default=200, metavar="N", help="default 200")
    parser.add_argument(
        "--db",
        type=Path,
        metavar="PATH",
        help="SQLite file to create and keep (must not exist); default: a temporary file",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="K",
        help="untimed turns first, on a separate throwaway database (default 1)",
    )
    args = parser.parse_args()
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if args.db is not None and args.db.exists():
        parser.error(f"--db {args.db}: already exists; give a new path")
    return args


@contextlib.contextmanager
def db_paths(db: Path | None) -> Iterator[tuple[Path, Path]]:
    """(throwaway database for warm-up, database for the measured run)."""
    with tempfile.TemporaryDirectory(prefix="aalis-peers-") as tmpdir:
        tmp = Path(tmpdir)
        yield tmp / "warmup.db", (db if db is not None else tmp / "turns.db")


def user_text(turn: int) -> str:
    return f"{turn}: {USER_TEXT}"


def time_turns(turns: int, run_turn: Callable[[int], None]) -> list[float]:
    """Seconds for each of ``turns`` calls of ``run_turn(i)``."""
    gc.collect()
    samples: list[float] = []
    for i in range(turns):
        t0 = time.perf_counter()
        run_turn(i)
        samples.append(time.perf_counter() - t0)
    return samples


def stored_bytes(path: Path) -> int:
    """The database file's size once its WAL is checkpointed into it (all connections of
    the framework closed first)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()
    return path.stat().st_size


def report(peer: str, samples: list[float], db_bytes: int) -> None:
    n = len(samples)
    k = min(10, n)
    first = statistics.fmean(samples[:k])
    last = statistics.fmean(samples[-k:])
    line = {
        "name": "turns_workload",
        "peer": peer,
        "turns": n,
        "p50_ms": round(statistics.median(samples) * 1000, 3),
        "last10_over_first10": round(last / first, 3),
        "bytes_per_turn": round(db_bytes / n, 1),
    }
    print(json.dumps(line), flush=True)
    if blocked:
        print(f"{peer}: {len(blocked)} network attempt(s) blocked: {blocked[:5]}", file=sys.stderr)
        sys.exit(3)
