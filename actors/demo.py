"""``aalis-agent demo``: write the sample conversation and show what a replay rebuilds."""

from __future__ import annotations

import sys
from typing import TextIO

from actors.replay import render_state, run_replay
from actors.sample import write_demo_session
from events import FixedClock, SqliteEventStore, SystemClock

__all__ = ["run_demo"]

DEMO_SESSION = "demo:room-1"


def _free_session_id(store: SqliteEventStore) -> str:
    existing = set(store.sessions())
    if DEMO_SESSION not in existing:
        return DEMO_SESSION
    n = 2
    while f"{DEMO_SESSION}-{n}" in existing:
        n += 1
    return f"{DEMO_SESSION}-{n}"


def run_demo(db_path: str, out: TextIO | None = None) -> int:
    """Write the sample session to ``db_path``, print its timeline and final state."""
    out = sys.stdout if out is None else out
    from actors.replay import replay_session

    with SqliteEventStore(db_path) as store:
        session_id = _free_session_id(store)
        # Simulated time: starts now, 150 ms between events, so the timeline reads naturally.
        clock = FixedClock(SystemClock().now_ms(), step_ms=150)
        events = write_demo_session(store, session_id, clock)
        out.write(
            f"Wrote {len(events)} events for session {session_id} to {db_path}\n"
            "(a scripted sample log: the events a session writes for these turns)\n\n"
        )
        run_replay(store, [session_id], at=None, as_json=False, out=out)
        out.write("\n")
        out.write(render_state(replay_session(store, session_id)) + "\n\n")
    out.write(
        "Replay it yourself:\n"
        f"  aalis-agent replay {db_path} --session {session_id}\n"
        f"  aalis-agent replay {db_path} --session {session_id} --at 20\n"
        f"  aalis-agent replay {db_path} --session {session_id} --json\n"
    )
    return 0
