"""Write the golden logs for the current schema version and store format (never overwrites).

Golden logs under tests/golden/ are what every later version must keep decoding:
``v<schema>_session.jsonl`` (the events as JSON) and, per store format, a SQLite file
holding the same events (``v<schema>_session.db`` for store format 2, one row per event;
``v<schema>_session.store<format>.db`` from format 3 on). Run
``.venv/bin/python scripts/golden.py`` once when SCHEMA_VERSION or the store format is
bumped, and commit the new files beside the old ones.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
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
    SessionEvent,
    SettingsChanged,
    SqliteEventStore,
    decode_json,
    encode_json,
)
from aalis_agent.events.sqlite import STORE_FORMAT
from aalis_agent.testing.sample import write_demo_session

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"
SESSION = "golden:room-1"


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


class _Recording(InMemoryEventStore):
    """Remembers how many events each append carried."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def append(
        self,
        session_id: str,
        events: Sequence[SessionEvent],
        expected_seq: int,
        *,
        open_work: bool | None = None,
    ) -> int:
        if events:
            self.sizes.append(len(events))
        return super().append(session_id, events, expected_seq, open_work=open_work)


def golden_session() -> tuple[list[SessionEvent], list[int]]:
    """The golden session as this version writes it, and the size of each batch."""
    store = _Recording()
    clock = FixedClock(1_767_225_600_000, step_ms=250)
    events = write_demo_session(store, SESSION, clock)
    extra = extra_events(SESSION, events[-1].seq, clock)
    store.append(SESSION, extra.events, extra.expected_seq)
    return store.read(SESSION), store.sizes


def main() -> int:
    jsonl = GOLDEN / f"v{SCHEMA_VERSION}_session.jsonl"
    db = GOLDEN / f"v{SCHEMA_VERSION}_session.store{STORE_FORMAT}.db"
    if jsonl.exists() and db.exists():
        print(f"{jsonl.name} and {db.name} exist already; golden files are never rewritten")
        return 1
    GOLDEN.mkdir(parents=True, exist_ok=True)
    events, sizes = golden_session()
    if jsonl.exists():
        # The schema version's events are the ones its JSONL holds; the demo may have
        # changed a text since. Batches as the demo writes them, when the count agrees.
        lines = jsonl.read_bytes().splitlines()
        events = [decode_json(line, seq=n) for n, line in enumerate(lines, 1)]
        if sum(sizes) != len(events):
            sizes = [1] * len(events)
    else:
        jsonl.write_bytes(b"".join(encode_json(e) + b"\n" for e in events))
        print(f"wrote {jsonl} ({len(events)} events)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "golden.db"
        sqlite = SqliteEventStore(path)
        version = sqlite._conn.execute("PRAGMA user_version").fetchone()[0]
        assert version == STORE_FORMAT, f"the store writes format {version}"
        last = 0
        for size in sizes:
            last = sqlite.append(SESSION, events[last : last + size], last)
        assert sqlite.read(SESSION) == events
        sqlite._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        sqlite._conn.execute("PRAGMA journal_mode=DELETE")
        sqlite.close()
        shutil.copyfile(path, db)
    print(f"wrote {db} ({len(events)} events in {len(sizes)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
