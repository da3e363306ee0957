"""A worker for the crash test: runs turns on a SQLite log until it is killed.

Usage: python tests/crash_worker.py DB SESSIONS. Prints ``ACK <session> <input>`` once
each input is durably accepted, so the killer knows what was acknowledged.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import Input, SqliteEventStore, ToolCall
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry


def work(args: Any, ctx: Any) -> str:
    ctx.abort.wait(0.02)  # a tool that takes a moment
    return "ok"


def reply(request: Any, n: int) -> ScriptedReply:
    # Odd calls use a tool, even calls answer: every turn has a tool batch in the middle.
    if n % 2:
        return ScriptedReply(tool_calls=(ToolCall(id=f"c{n}", name="work", arguments="{}"),))
    return ScriptedReply(text="好", chunks=3, chunk_delay_s=0.005)


def main() -> None:
    db, sessions = sys.argv[1], int(sys.argv[2])
    # Logs go to stderr: stdout carries only the acknowledgements.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    store = SqliteEventStore(db)
    services = Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("work", work)]))
    runtime = Runtime(store, services, janitor=False)
    for n in itertools.count():
        session = f"s{n % sessions}"
        source = "schedule" if n % 5 == 4 else None
        handle = runtime.submit(session, Input(id=f"in-{n}", content=f"消息 {n}", source=source))
        print(f"ACK {session} {handle.input_id}", flush=True)
        time.sleep(0.003)


if __name__ == "__main__":
    main()
