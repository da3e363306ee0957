"""A worker for the deletion crash test: deletes a session on a SQLite log and is killed
between the deletion's commits.

Usage: python tests/delete_crash_worker.py DB. A replied turn, then a turn parked at its
model call with an input pending for it; then ``delete``. The store holds the deletion's
last commit (the one with ``SessionDeleted``) back and prints ``CUT`` once it is on its
way (the release before it durable); the test then kills the process with SIGKILL.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import Input, SessionDeleted, SessionEvent, SqliteEventStore
from aalis_agent.services import Services

from tests.harness import GatedModel


class HoldsTheDeletion(SqliteEventStore):
    """Writes everything but the commit with ``SessionDeleted``: that one waits forever."""

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        if any(isinstance(e, SessionDeleted) for e in events):
            print("CUT", flush=True)
            threading.Event().wait()  # killed here
        return super().append(session_id, events, expected_seq, open_work=open_work)


def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    model = GatedModel()
    runtime = Runtime(HoldsTheDeletion(sys.argv[1]), Services(llm=model), janitor=False)
    first = runtime.submit("s", Input(id="a", content="一"))
    model.answer("答一")
    first.result(10)
    runtime.submit("s", Input(id="b", content="二"))
    model.wait_call()
    runtime.submit("s", Input(id="c", content="三"))
    runtime.delete("s")  # never returns: the process is killed in its last commit
    raise AssertionError("the deletion returned")


if __name__ == "__main__":
    main()
