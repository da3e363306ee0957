"""The examples (examples/asyncio_bot.py, examples/process_shards.py) run offline and show
what they say they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from aalis_agent.events import InputReceived, SqliteEventStore

from tests.harness import ROOT


def transcript(out: str, room: str) -> list[str]:
    """The lines of ``room``'s transcript, as the bot prints them at the end."""
    lines = out.split("--- transcripts ---", 1)[1].splitlines()
    start = lines.index(f"== {room} ==") + 1
    taken = []
    for line in lines[start:]:
        if line.startswith("== "):
            break
        taken.append(line.strip())
    return taken


def in_order(lines: list[str], *wanted: str) -> bool:
    at = 0
    for want in wanted:
        found = [i for i, line in enumerate(lines[at:], at) if line.startswith(want)]
        if not found:
            return False
        at = found[0] + 1
    return True


def test_the_asyncio_bot_serves_two_rooms() -> None:
    done = subprocess.run(
        [sys.executable, "examples/asyncio_bot.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    lobby = transcript(out, "lobby")
    assert in_order(
        lobby,
        "alice: What is 17 times 23?",
        "(tool multiply started)",
        "bob: ...and add 1 to it, please",
        "(tool multiply finished)",
        "bot: 17 × 23 = 391, and adding 1 makes 392.",  # bob's message joined the turn
        "(turn ended: replied)",
    ), lobby
    assert "-> bob's message joins the running turn" in lobby
    assert sum(line.startswith("(turn opened") for line in lobby) == 1
    garden = transcript(out, "garden")
    assert in_order(
        garden,
        "carol: Tell me a long story",
        "(bot is typing...)",
        "bob: /stop",
        "carol: /stop",
        "(turn ended: aborted, stop)",
        "(turn opened with 1 message(s))",  # the queued reminder, as its own turn
        "bot: Time to water the plants!",
        "(turn ended: replied)",
    ), garden
    assert "-> reminder's message queued" in garden
    assert "-> stopped" in garden  # carol's /stop; bob's was refused with a reply
    assert sum(line.startswith("bot: ") for line in garden) == 2
    assert not any("Once upon a time" in line for line in garden)  # stopped, never sent
    assert "result" in out and "'Time to water the plants!'" in out


def test_the_process_shards_example_serves_rooms_and_survives_a_killed_worker(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "shards"
    done = subprocess.run(
        [sys.executable, "examples/process_shards.py", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "120 turns from 4 threads in" in out and "{'replied': 120}" in out
    assert "submit: opened; then replied" in out
    assert "killed in the tool; the call was answered 'aborted'" in out
    assert "the same input sent again: 'aborted', from the same turn: True" in out
    assert "next message: replied" in out
    # The killed worker's input was received once, its cut turn recorded once.
    found = [p for p in directory.glob("shard-*.db")]
    received = 0
    for database in found:
        store = SqliteEventStore(database, read_only=True)
        try:
            for event in store.read("qq:group:3"):
                received += isinstance(event, InputReceived) and event.input.id == "cut-1"
        finally:
            store.close()
    assert len(found) == 2 and received == 1
