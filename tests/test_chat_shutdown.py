"""``aalis-agent chat`` closes its store even when a second signal comes while it leaves.

A SIGTERM (or Ctrl-C) makes the chat leave: the runtime is shut down, then the store is
closed, and SQLite's last connection closed copies the WAL back and removes it. A second
SIGTERM during the shutdown (a service manager repeating itself, a second Ctrl-C) used
to raise out of it, past the store's closing: the process left its ``-wal`` and ``-shm``
files behind. It now cuts the shutdown short, the store is closed (a further signal is
held until it is), and the chat still leaves with 143.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from aalis_agent.events import SqliteEventStore, TurnRecorded

ROOT = Path(__file__).resolve().parent.parent

# The real command, its runtime's shutdown made slow (a turn that ignores its stop would
# hold it up to its timeout) and saying when it begins: the second SIGTERM lands in it.
_DRIVER = """
import sys, time
from aalis_agent.actors.runtime import Runtime
from aalis_agent.cli.main import main

shutdown = Runtime.shutdown

def slow(self, timeout=None):
    sys.stderr.write("shutdown begun\\n")
    sys.stderr.flush()
    time.sleep(60)
    return shutdown(self, timeout)

Runtime.shutdown = slow
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_sigterm_during_the_shutdown_still_closes_the_store(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    with subprocess.Popen(
        [sys.executable, "-c", _DRIVER, "chat", "--db", str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write("你好\n")
        proc.stdin.flush()
        status = ""
        while not status.startswith("[用量]"):  # the turn is over: its commits are in
            status = proc.stdout.readline()
            assert status, "the chat ended before answering"
        assert (tmp_path / "c.db-wal").exists()  # open: the WAL holds them
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr.readline() == "shutdown begun\n"
        proc.send_signal(signal.SIGTERM)  # the second, while the runtime shuts down
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left hanging: the assertions below fail instead
            proc.wait(10)
        out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 143, (out, err)
    assert "Traceback" not in err
    # Closed: the WAL copied back into the file and removed with its index.
    assert not (tmp_path / "c.db-wal").exists()
    assert not (tmp_path / "c.db-shm").exists()
    with SqliteEventStore(db, read_only=True) as store:
        recorded = [e for e in store.read("cli:console") if isinstance(e, TurnRecorded)]
    assert [e.outcome for e in recorded] == ["replied"]
