"""A worker for the kill loop: runs tool turns on a SQLite log until it is SIGKILLed.

Usage: python tests/kill_loop_worker.py DB SIDE_DIR TAG SEED [--settle]

On start it recovers (``runtime.recover()``), then creates ``SIDE_DIR/ready-TAG``. Then it
submits inputs in a loop to a few sessions (the model calls a tool, then answers; some
inputs are scheduled injections, now and then a turn is stopped). Side files, one JSON
line per record, each fsynced before the worker goes on:

- ``acked.jsonl``: ``{"id", "session", "where"}`` right after ``submit`` returned;
- ``replies.jsonl``: ``{"session", "turn", "text", "kind"}`` for every message the
  gateway delivers.

With ``--settle`` it recovers, waits until no session has work left, shuts down and
exits 0 (printing ``SETTLED``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aalis_agent.projections import queue
from aalis_agent.request.tokens import default_counter
from aalis_agent.services import ChatRequest

from aalis_agent import (
    Input,
    OutboundMessage,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    SqliteEventStore,
    StoreError,
    Tool,
    ToolCallContext,
    ToolRegistry,
)
from tests.faults import tool_then_reply

SESSIONS = 3


class FsyncLines:
    """Appends JSON lines to a file, each fsynced before ``write`` returns."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            os.write(self._fd, data)
            os.fsync(self._fd)


class FileGateway:
    """Delivers by writing each message to ``replies.jsonl`` (durably)."""

    def __init__(self, lines: FsyncLines) -> None:
        self.lines = lines

    def dispatch_outbound(self, message: OutboundMessage) -> None:
        self.lines.write(
            {
                "session": message.session_id,
                "turn": message.turn_id,
                "text": message.content,
                "kind": message.kind,
            }
        )


def build(db: str, side: Path, tag: str) -> tuple[SqliteEventStore, Runtime]:
    script = tool_then_reply(tag)

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        # Streamed in pieces with small delays, so a kill can land inside a call.
        return msgspec.structs.replace(script(request, n), chunks=3, chunk_delay_s=0.002)

    rng = random.Random(f"{tag}-tool")

    def lookup(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        ctx.abort.wait(rng.uniform(0.001, 0.01))  # a tool that takes a moment
        return "查到了"

    # A small WAL mark: the store's checkpoint thread runs every few turns, so kills
    # land inside checkpoints too.
    store = SqliteEventStore(db, wal_autocheckpoint=16)
    services = Services(
        llm=ScriptedModel(reply),
        tools=ToolRegistry([Tool("lookup", lookup)]),
        gateway=FileGateway(FsyncLines(side / "replies.jsonl")),
    )
    return store, Runtime(store, services, janitor=False, ask_timeout_s=10)


def settle(store: SqliteEventStore, runtime: Runtime, timeout: float = 30.0) -> bool:
    """Wait until no session has a running turn or a waiting input."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runtime.wait_idle(max(deadline - time.monotonic(), 0.1))
        if not any(queue.has_open_work(runtime.view(s).queue) for s in store.sessions()):
            return True
        time.sleep(0.02)
    return False


def main() -> int:
    db, side, tag, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    settle_only = "--settle" in sys.argv[5:]
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    default_counter().count("预热")  # load the tokenizer now, not inside the first turn
    store, runtime = build(db, side, tag)
    runtime.recover()
    (side / f"ready-{tag}").touch()
    if settle_only:
        settled = settle(store, runtime)
        runtime.shutdown(timeout=10)
        store.close()
        print("SETTLED" if settled else "UNSETTLED", flush=True)
        return 0 if settled else 1
    acked = FsyncLines(side / "acked.jsonl")
    rng = random.Random(seed)
    for n in range(1_000_000):
        session = f"k{rng.randrange(SESSIONS)}"
        source = "schedule" if rng.random() < 0.15 else None
        inp = Input(id=f"{tag}-{n}", content=f"消息 {tag}-{n}", source=source)
        try:
            handle = runtime.submit(session, inp)
        except StoreError:
            continue  # refused: not acknowledged
        acked.write({"id": handle.input_id, "session": session, "where": handle.where})
        if rng.random() < 0.04:
            with contextlib.suppress(StoreError):
                runtime.stop(session)
        time.sleep(rng.uniform(0.0, 0.02))
    return 0


if __name__ == "__main__":
    sys.exit(main())
