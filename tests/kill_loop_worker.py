"""A worker for the kill loop: runs tool turns on a SQLite log until it is SIGKILLed.

Usage: python tests/kill_loop_worker.py DB SIDE_DIR TAG SEED [--settle]

On start it recovers (``runtime.recover()``), creates ``SIDE_DIR/ready-TAG``, then sends
again, under their ids, a seeded sample of the inputs earlier runs sent (acknowledged
ones, and some whose submit a kill cut: a caller retrying after a timeout or a crash).
Then it submits inputs in a loop to a few sessions, each under an id of its own (the
model calls a tool, then answers; some inputs are scheduled injections; now and then a
turn is stopped, a tool raises or its ``agent:tool:after`` fails, a turn is held by a
slow tool while several inputs wait and then all are released by a stop-all, a mute, a
deletion or a ``/clear``, or a session is deleted), sending recent inputs again now and
then, on this thread and on another (a caller retrying, racing the turns). Every other
run (by its seed) has an ``agent:turn:before`` middleware, so that a kill can cut a turn
before a model call carried its inputs. Side files, one JSON line per record, each
fsynced before the worker goes on:

- ``sent.jsonl``: ``{"id", "session", "source"}`` before each first ``submit``;
- ``acked.jsonl``: ``{"id", "session", "where", "source"}`` right after ``submit``
  returned (a resend that was not answered ``handled`` acknowledges too);
- ``resends.jsonl``: ``{"id", "session", "tag", "where"}`` for each input sent again, with
  the answer (``outcome``, ``reason``, ``turn``, ``reply``) when it is ``handled`` or
  when it was sent with ``Runtime.run`` (``where`` ``run``); a line
  ``{"followed": true, ...}`` with the outcome when a resend that followed a live input
  resolves; ``{"error": ...}`` when a resend was refused;
- ``ops.jsonl``: ``{"op", "session", "tag"}`` for each stop-all, mute, deletion and clear
  done;
- ``replies.jsonl``: ``{"session", "turn", "text", "kind"}`` for every message the
  gateway delivers.

With ``--settle`` it recovers, waits until no session has work left, sends every
acknowledged input again (each must be answered ``handled``: nothing is left to run),
shuts down and exits 0 (printing ``SETTLED``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aalis_agent.projections import queue
from aalis_agent.request.tokens import default_counter
from aalis_agent.services import ChatRequest

from aalis_agent import (
    Hooks,
    Input,
    InputOutcome,
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
RESENDS = 6  # acknowledged inputs sent again after each start
RESENDS_CUT = 2  # and inputs whose submit the kill may have cut
SLOW_TOOL_S = 0.5  # how long a held turn's tool waits (a stop ends it sooner)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a side file (a line a kill tore is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def input_of(record: Mapping[str, Any]) -> Input:
    """The input a side-file record names, as it was first sent (an input sent again must
    be the same input: its content and source follow from its id)."""
    return Input(id=record["id"], content=f"消息 {record['id']}", source=record.get("source"))


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


class Faults:
    """The seeded choices turns make on their threads: which tool calls raise (an error
    the model sees; ``SystemExit`` or ``KeyboardInterrupt``, which end the turn), whose
    ``agent:tool:after`` fails, and which sessions' tools are slow (a turn held while
    inputs wait)."""

    def __init__(self, tag: str) -> None:
        self.rng = random.Random(f"{tag}-tool")
        self.lock = threading.Lock()
        self.slow: set[str] = set()

    def draw(self) -> float:
        with self.lock:
            return self.rng.random()

    def duration(self) -> float:
        with self.lock:
            return self.rng.uniform(0.001, 0.01)


def build(
    db: str, side: Path, tag: str, *, turn_before: bool = False
) -> tuple[SqliteEventStore, Runtime, Faults]:
    """The worker's store and runtime. With ``turn_before``, an ``agent:turn:before``
    middleware (which passes the turn on after a moment) runs before each turn's first
    model call: the commit that opens a turn does not archive its inputs then, so a kill
    can cut a turn before any model call carried them (a recovery puts them back)."""
    script = tool_then_reply(tag)

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        # Streamed in pieces with small delays, so a kill can land inside a call.
        return msgspec.structs.replace(script(request, n), chunks=3, chunk_delay_s=0.002)

    faults = Faults(tag)

    def lookup(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        if ctx.session_id in faults.slow:  # held: inputs wait behind this turn
            ctx.abort.wait(SLOW_TOOL_S)
            return "查到了"
        ctx.abort.wait(faults.duration())  # a tool that takes a moment
        draw = faults.draw()
        if draw < 0.03:
            raise RuntimeError("查询失败")  # the model sees the error; the turn goes on
        if draw < 0.04:
            raise SystemExit(3)  # ends the turn: ToolFinished, then TurnRecorded aborted
        if draw < 0.05:
            raise KeyboardInterrupt  # as SystemExit (reason interrupt)
        return "查到了"

    def after(ctx: Any, next_: Callable[[], Any]) -> Any:
        result = next_()
        if faults.draw() < 0.02:
            raise RuntimeError("agent:tool:after failed")  # fails the turn (error)
        return result

    def before(ctx: Any, next_: Callable[[], Any]) -> Any:
        time.sleep(faults.duration())
        return next_()

    hooks = Hooks()
    hooks.use("agent:tool:after", after)
    if turn_before:
        hooks.use("agent:turn:before", before)
    # A small WAL mark: the store's checkpoint thread runs every few turns, so kills
    # land inside checkpoints too.
    store = SqliteEventStore(db, wal_autocheckpoint=16)
    services = Services(
        llm=ScriptedModel(reply),
        tools=ToolRegistry([Tool("lookup", lookup)]),
        gateway=FileGateway(FsyncLines(side / "replies.jsonl")),
    )
    return store, Runtime(store, services, hooks=hooks, janitor=False, ask_timeout_s=10), faults


def settle(store: SqliteEventStore, runtime: Runtime, timeout: float = 30.0) -> bool:
    """Wait until no session has a running turn or a waiting input."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runtime.wait_idle(max(deadline - time.monotonic(), 0.1))
        if not any(queue.has_open_work(runtime.view(s).queue) for s in store.sessions()):
            return True
        time.sleep(0.02)
    return False


def answer(outcome: InputOutcome) -> dict[str, Any]:
    return {
        "outcome": outcome.outcome,
        "reason": outcome.reason,
        "turn": outcome.turn_id,
        "reply": outcome.reply,
    }


class Resender:
    """Sends inputs again under their ids and records each answer (``resends.jsonl``)."""

    def __init__(self, runtime: Runtime, side: Path, tag: str) -> None:
        self.runtime = runtime
        self.tag = tag
        self.lines = FsyncLines(side / "resends.jsonl")
        self.acked = FsyncLines(side / "acked.jsonl")

    def resend(self, record: Mapping[str, Any], *, wait: bool = False) -> str | None:
        """Send the input of ``record`` again (``Runtime.run`` with ``wait``, else
        ``submit``); returns where it went, None when refused."""
        session, inp = record["session"], input_of(record)
        base = {"id": inp.id, "session": session, "tag": self.tag}
        try:
            if wait:  # run: waits for how it ended (at once for one that had ended)
                outcome = self.runtime.run(session, inp)
                self.lines.write({**base, "where": "run", **answer(outcome)})
                self.acked.write({**base, "where": "run", "source": inp.source})
                return "run"
            handle = self.runtime.submit(session, inp)
        except StoreError:
            return None  # refused (a write failed): nothing acknowledged
        except Exception as exc:  # InvalidInput would be a defect: recorded, audited
            self.lines.write({**base, "error": f"{type(exc).__name__}: {exc}"})
            return None
        if handle.where == "handled":
            self.lines.write({**base, "where": "handled", **answer(handle.result(0))})
        else:
            self.lines.write({**base, "where": handle.where})
            self.acked.write({**base, "where": handle.where, "source": inp.source})
            handle.future.add_done_callback(self._followed(base))
        return handle.where

    def _followed(self, base: dict[str, Any]) -> Callable[[Future[InputOutcome]], None]:
        def done(future: Future[InputOutcome]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            self.lines.write({**base, "followed": True, **answer(future.result())})

        return done


def resend_sample(resender: Resender, side: Path, rng: random.Random) -> None:
    """After a restart: send again a sample of what earlier runs acknowledged, and some
    of the last inputs each run sent (a kill may have cut their submit, or the write of
    their acknowledgement)."""
    acked = read_lines(side / "acked.jsonl")
    sent = read_lines(side / "sent.jsonl")
    done = {a["id"] for a in acked}
    cut = [s for s in sent[-40:] if s["id"] not in done]
    picks = rng.sample(acked, min(RESENDS, len(acked))) + rng.sample(
        cut, min(RESENDS_CUT, len(cut))
    )
    for record in picks:
        resender.resend(record, wait=rng.random() < 0.2)


def main() -> int:
    db, side, tag, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    settle_only = "--settle" in sys.argv[5:]
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    default_counter().count("预热")  # load the tokenizer now, not inside the first turn
    # Every other run (by its seed) has an agent:turn:before middleware.
    store, runtime, faults = build(db, side, tag, turn_before=seed % 2 == 1)
    runtime.recover()
    (side / f"ready-{tag}").touch()
    resender = Resender(runtime, side, tag)
    if settle_only:
        settled = settle(store, runtime)
        if settled:  # nothing left to run: every acknowledged input is answered from the log
            for record in read_lines(side / "acked.jsonl"):
                resender.resend(record)
            settled = settle(store, runtime)
        runtime.shutdown(timeout=10)
        store.close()
        print("SETTLED" if settled else "UNSETTLED", flush=True)
        return 0 if settled else 1
    rng = random.Random(seed)
    resend_sample(resender, side, rng)
    sent = FsyncLines(side / "sent.jsonl")
    ops = FsyncLines(side / "ops.jsonl")
    recent: list[dict[str, Any]] = []  # the last inputs this run acknowledged
    lock = threading.Lock()
    n = 0

    def submit(session: str, source: str | None) -> dict[str, Any] | None:
        nonlocal n
        n += 1
        record = {"id": f"{tag}-{n}", "session": session, "source": source}
        sent.write(record)
        try:
            handle = runtime.submit(session, input_of(record))
        except StoreError:
            return None  # refused: not acknowledged
        resender.acked.write({**record, "where": handle.where})
        with lock:
            recent.append(record)
            del recent[:-8]
        return record

    def retry_loop(rng: random.Random) -> None:
        # A caller on another thread retrying recent inputs (most still waiting or
        # running), racing the turns' ends, the releases and the deletions.
        while True:
            time.sleep(rng.uniform(0.005, 0.04))
            with lock:
                record = rng.choice(recent) if recent else None
            if record is not None:
                resender.resend(record)

    threading.Thread(
        target=retry_loop, args=(random.Random(seed + 1),), name="retry", daemon=True
    ).start()
    while True:
        session = f"k{rng.randrange(SESSIONS)}"
        draw = rng.random()
        if draw < 0.03:
            # A turn held by a slow tool, several inputs waiting behind it (some sent
            # again while they wait), all released at once (queued and pending): by a
            # stop-all or a mute (archived in one folded batch), a deletion or a /clear
            # (not archived).
            faults.slow.add(session)
            try:
                burst = [submit(session, "schedule" if rng.random() < 0.3 else None)]
                burst += [
                    submit(session, "schedule" if rng.random() < 0.3 else None)
                    for _ in range(rng.randint(3, 6))
                ]
                waiting = [r for r in burst if r is not None]
                for record in rng.sample(waiting, min(len(waiting), rng.randint(1, 3))):
                    resender.resend(record)
                time.sleep(rng.uniform(0.01, 0.05))
                op = rng.choices(["stop-all", "mute", "delete", "clear"], [5, 3, 2, 1])[0]
                release: dict[str, Callable[[str], Any]] = {
                    "stop-all": runtime.stop_all,
                    "mute": runtime.mute,
                    "delete": functools.partial(runtime.delete, timeout=10),
                    "clear": functools.partial(runtime.clear, timeout=10),
                }
                with contextlib.suppress(StoreError):
                    release[op](session)
                    ops.write({"op": op, "session": session, "tag": tag})
            finally:
                faults.slow.discard(session)
        elif draw < 0.037:
            with contextlib.suppress(StoreError):
                runtime.delete(session, timeout=10)
                ops.write({"op": "delete", "session": session, "tag": tag})
        elif draw < 0.05:
            resend_sample(resender, side, rng)
        else:
            submit(session, "schedule" if rng.random() < 0.15 else None)
            if rng.random() < 0.1:  # sent again at once: it still waits or runs
                with lock:
                    record = rng.choice(recent)
                resender.resend(record, wait=rng.random() < 0.3)
            if rng.random() < 0.04:
                with contextlib.suppress(StoreError):
                    runtime.stop(session)
        time.sleep(rng.uniform(0.0, 0.02))


if __name__ == "__main__":
    sys.exit(main())
