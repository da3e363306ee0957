"""``ProcessShards`` under kills: worker processes SIGKILLed at random (seeded) moments
while four threads drive sessions through them; every call must end with an outcome,
and the shards' logs must agree with what each call answered: no input lost, run twice
or answered otherwise than its log says (``tests/faults.py``'s audit)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import Input, SqliteEventStore
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.processes import ProcessShards

import aalis_agent
from tests import shard_kill_services
from tests.faults import audit_log
from tests.harness import ROOT

SESSIONS = [f"room:{n}" for n in range(6)]
PER_THREAD = 30  # at least; each thread goes on until the kills are done
KILLS = 5


def test_workers_killed_at_random_lose_nothing_and_run_nothing_twice(tmp_path: Path) -> None:
    rng = random.Random(20261205)
    shards = ProcessShards(
        tmp_path / "shards",
        shard_kill_services.services,
        2,
        runtime_options={"janitor": False},
        max_restarts=100,
    )
    answers: dict[str, list[dict[str, Any]]] = {s: [] for s in SESSIONS}
    errors: list[str] = []
    lock = threading.Lock()
    done = threading.Event()

    def drive(thread: int) -> None:
        mine = random.Random(thread)
        n = -1
        while n < 400:
            n += 1
            if n >= PER_THREAD and done.is_set():
                break
            session = mine.choice(SESSIONS)
            inp = Input(id=f"t{thread}-{n}", content=f"第 {n} 句")
            try:
                if n % 3:
                    outcome = shards.run(session, inp)
                else:
                    outcome = shards.submit(session, inp).result(timeout=120)
            except Exception as exc:
                with lock:
                    errors.append(f"{inp.id}: {type(exc).__name__}: {exc}")
                continue
            record = {
                "id": inp.id,
                "where": "run",
                "outcome": outcome.outcome,
                "reason": outcome.reason,
                "turn": outcome.turn_id,
                "reply": outcome.reply,
            }
            with lock:
                answers[session].append(record)

    kills = 0

    def kill() -> None:
        nonlocal kills
        try:
            while kills < KILLS:
                time.sleep(rng.uniform(0.02, 0.2))
                info = shards.info()[rng.randrange(2)]
                if info["alive"] and info["pid"]:  # not while it is started again
                    os.kill(info["pid"], signal.SIGKILL)
                    kills += 1
        finally:
            done.set()  # the drivers end once each made its PER_THREAD calls

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(drive, range(4)))
    finally:
        killer.join(60)
        restarts = sum(i["restarts"] for i in shards.info())
        shards.shutdown(timeout=30)
    assert errors == []
    assert kills == KILLS and restarts >= 1, (kills, restarts)
    findings: dict[str, list[str]] = {}
    for session in SESSIONS:
        store = SqliteEventStore(
            tmp_path / "shards" / f"shard-{shard_of(session, 2)}.db", read_only=True
        )
        try:
            events = store.read(session)
        finally:
            store.close()
        acked = [a["id"] for a in answers[session]]
        for kind, found in audit_log(events, acked=acked, resends=answers[session]).items():
            if found:
                findings.setdefault(kind, []).extend(found)
    assert findings == {}
    assert sum(len(a) for a in answers.values()) >= 4 * PER_THREAD


_PARENT = """
import os, sys, threading
from aalis_agent.events import Input
from aalis_agent.scale.processes import ProcessShards
from tests import shard_kill_services

if __name__ == "__main__":
    shards = ProcessShards(sys.argv[1], shard_kill_services.services, 2,
                           runtime_options={"janitor": False})
    print(" ".join(str(i["pid"]) for i in shards.info()), flush=True)
    acked = open(sys.argv[2], "a", encoding="utf-8")
    lock = threading.Lock()

    def drive(thread):
        n = 0
        while True:
            session, text = f"room:{(thread + n) % 6}", f"第 {n} 句"
            handle = shards.submit(session, Input(id=f"p{thread}-{n}", content=text))
            with lock:  # acknowledged: durable in its shard
                acked.write(f"{session}\\t{handle.input_id}\\t{text}\\n")
                acked.flush()
                os.fsync(acked.fileno())
            n += 1

    for t in range(4):
        threading.Thread(target=drive, args=(t,), daemon=True).start()
    threading.Event().wait()
"""


@pytest.mark.parametrize("workers_too", [False, True], ids=["parent", "parent-and-workers"])
def test_a_killed_parent_loses_no_acknowledged_input(tmp_path: Path, workers_too: bool) -> None:
    """The parent is SIGKILLed while four threads submit (and its workers with it, as a
    crash of the whole group would); a new ``ProcessShards`` on the directory answers
    every input the first acknowledged, each run once (sent again under its id: answered
    from the log, or run now)."""
    script = tmp_path / "parent.py"
    script.write_text(_PARENT, encoding="utf-8")
    acked_file = tmp_path / "acked.tsv"
    acked_file.touch()
    directory = tmp_path / "shards"
    package_parent = str(Path(aalis_agent.__file__).parent.parent)
    with subprocess.Popen(
        [sys.executable, str(script), str(directory), str(acked_file)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([package_parent, str(ROOT)])},
    ) as parent:
        try:
            assert parent.stdout is not None
            pids = [int(p) for p in parent.stdout.readline().split()]
            deadline = time.monotonic() + 60
            while len(acked_file.read_text(encoding="utf-8").splitlines()) < 60:
                assert time.monotonic() < deadline, "the parent acknowledged too little"
                time.sleep(0.01)
        finally:
            parent.kill()
            if workers_too:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, "the workers did not end"
        time.sleep(0.05)
    acked: dict[str, list[tuple[str, str]]] = {}
    for line in acked_file.read_text(encoding="utf-8").splitlines():
        session, input_id, text = line.split("\t")
        acked.setdefault(session, []).append((input_id, text))
    shards = ProcessShards(directory, shard_kill_services.services, 2)
    resends: dict[str, list[dict[str, Any]]] = {}
    try:
        for session, inputs in acked.items():
            for input_id, text in inputs:
                outcome = shards.run(session, Input(id=input_id, content=text))
                resends.setdefault(session, []).append(
                    {
                        "id": input_id,
                        "where": "run",
                        "outcome": outcome.outcome,
                        "reason": outcome.reason,
                        "turn": outcome.turn_id,
                        "reply": outcome.reply,
                    }
                )
        assert shards.wait_idle(60)
        recovered = [s for info in shards.info() for s in info["recovered"]]
    finally:
        shards.shutdown(timeout=30)
    findings: dict[str, list[str]] = {}
    for session, inputs in acked.items():
        store = SqliteEventStore(directory / f"shard-{shard_of(session, 2)}.db", read_only=True)
        try:
            events = store.read(session)
        finally:
            store.close()
        ids = [i for i, _ in inputs]
        for kind, found in audit_log(events, acked=ids, resends=resends[session]).items():
            if found:
                findings.setdefault(kind, []).extend(found)
    assert findings == {}
    if workers_too:  # cut with work open: the new workers' recovery picked it up
        assert recovered, "no session had open work when the workers were killed"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie not reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
