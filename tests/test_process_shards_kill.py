"""``ProcessShards`` under kills: worker processes SIGKILLed at random (seeded) moments
while four threads drive sessions through them; every call must end with an outcome,
and the shards' logs must agree with what each call answered: no input lost, run twice
or answered otherwise than its log says (``tests/faults.py``'s audit)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aalis_agent.events import Input, SqliteEventStore
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.processes import ProcessShards

from tests import shard_kill_services
from tests.faults import audit_log

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
