"""Write the golden logs for the current schema version (never overwrites).

Golden logs under tests/golden/ are what every later version must keep decoding. Run
``.venv/bin/python scripts/golden.py`` once when SCHEMA_VERSION is bumped, and commit the
new files beside the old ones.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from aalis_agent.events import (
    SCHEMA_VERSION,
    Batch,
    ChatMessage,
    ContextCleared,
    FixedClock,
    InMemoryEventStore,
    Input,
    InputQueued,
    InputReceived,
    InputReleased,
    MessageMeta,
    MessageSaved,
    SessionDeleted,
    SettingsChanged,
    SqliteEventStore,
    encode_json,
)
from aalis_agent.testing.sample import write_demo_session

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"


def extra_events(session_id: str, last_seq: int, clock: FixedClock) -> Batch:
    """Events the demo does not write: settings, releases, compaction, clear, deletion."""
    b = Batch(session_id, last_seq, clock=clock)
    b.add(SettingsChanged(key="historyLimit", value=40, by="10001"))
    b.add(SettingsChanged(key="think", reset=True))
    inp = Input(id="in-9", content="还在吗", platform="qq", group_id="g1", addressed=False)
    b.add(InputReceived(input=inp, generation=0))
    b.add(InputQueued(input_id=inp.id))
    b.add(InputReleased(input_id=inp.id, reason="mute", archived=True))
    b.add(
        MessageSaved(
            message=ChatMessage(id="msg-sep", role="system", kind="compaction", meta=MessageMeta())
        )
    )
    b.add(ContextCleared(kinds=("context",)))
    b.add(SessionDeleted(generation=1))
    return b


def main() -> int:
    jsonl = GOLDEN / f"v{SCHEMA_VERSION}_session.jsonl"
    db = GOLDEN / f"v{SCHEMA_VERSION}_session.db"
    if jsonl.exists() or db.exists():
        print(f"{jsonl.name} or {db.name} exists already; golden files are never rewritten")
        return 1
    clock = FixedClock(1_767_225_600_000, step_ms=250)
    store = InMemoryEventStore()
    events = write_demo_session(store, "golden:room-1", clock)
    extra = extra_events("golden:room-1", events[-1].seq, clock)
    store.append("golden:room-1", extra.events, extra.expected_seq)
    events = store.read("golden:room-1")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    jsonl.write_bytes(b"".join(encode_json(e) + b"\n" for e in events))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "golden.db"
        sqlite = SqliteEventStore(path)
        sqlite.append("golden:room-1", events, 0)
        sqlite._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        sqlite._conn.execute("PRAGMA journal_mode=DELETE")
        sqlite.close()
        shutil.copyfile(path, db)
    print(f"wrote {jsonl} and {db} ({len(events)} events)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
