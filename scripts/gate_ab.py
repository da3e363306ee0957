"""A/B of two gates (actors/gate.py) on the many-sessions workload, in one process.

    scripts/gate_ab.py OTHER_GATE.py [--rounds N]

A is this checkout's ``Gate``, B the ``Gate`` class of the file given (say
``git show main:actors/gate.py > /tmp/gate_main.py``). Each has a runtime and a store of
its own; rounds of 200 sessions x 5 turns, driven from 4 threads with ``Runtime.run`` as
``scripts/bench many_sessions`` drives them, alternate A B B A ... between stretches of
40 turns of one session run sequentially (the machine's speed drifts: only rounds run
side by side compare). Per gate: the ratio to the sequential rate around each round, wall
and CPU time (getrusage) per turn, context switches per turn, changes of hands per 1,000
turns (a ``held()`` that finds the gate last taken by another thread), latency p50/p99,
and the gate's own counts; then B's wall and CPU per turn over A's, round pair by pair.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench
from aalis_agent.actors.gate import Gate
from aalis_agent.events import Input, SqliteEventStore

PER_ROUND, TURNS, STRETCH = 200, 5, 40


class Counted:
    """A gate that counts changes of hands at ``held()``; all else goes to the gate."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate
        self.changes = 0
        self.last: int | None = None

    def held(self) -> _CountedHeld:
        return _CountedHeld(self)

    def released(self, key: Any = None) -> Any:
        return self.gate.released(key)

    def holder(self) -> int | None:
        return self.gate.holder()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gate, name)


class _CountedHeld:
    __slots__ = ("counted", "inner")

    def __init__(self, counted: Counted) -> None:
        self.counted = counted

    def __enter__(self) -> None:
        counted = self.counted
        self.inner = counted.gate.held()
        self.inner.__enter__()
        holder = counted.gate.holder()
        if holder is not None and holder != counted.last:
            counted.last = holder
            counted.changes += 1

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)


def load_gate(path: str) -> type:
    spec = importlib.util.spec_from_file_location("gate_b", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gate_b"] = module
    spec.loader.exec_module(module)
    return module.Gate  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="a file defining the Gate to compare (B)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per gate (default 6)")
    args = parser.parse_args()
    bench._quiet_logs()
    tmp = Path(tempfile.mkdtemp(prefix="gate-ab-"))
    alone_store = SqliteEventStore(tmp / "alone.db")
    alone = bench._tool_turn_runtime(alone_store)
    alone.run("alone", Input(id="", content=bench.USER_TEXT))
    sequential = [0]

    def one_session() -> float:
        start = time.perf_counter()
        for _ in range(STRETCH):
            sequential[0] += 1
            alone.run("alone", Input(id="", content=f"{sequential[0]}: {bench.USER_TEXT}"))
        return time.perf_counter() - start

    runtimes: dict[str, Any] = {}
    for name, cls in (("A", Gate), ("B", load_gate(args.other))):
        store = SqliteEventStore(tmp / f"{name}.db")
        runtime = bench._tool_turn_runtime(store, max_live_sessions=256)
        runtime.workers.gate = Counted(cls(0.05))
        runtime.run("warm-up", Input(id="", content=bench.USER_TEXT))
        runtimes[name] = runtime
    rows: dict[str, dict[str, list[float]]] = {
        name: {"ratio": [], "wall_us": [], "cpu_us": [], "switches": [], "changes": []}
        for name in runtimes
    }
    latencies: dict[str, list[float]] = {name: [] for name in runtimes}
    order = [
        name for r in range(args.rounds) for name in (("A", "B") if r % 2 == 0 else ("B", "A"))
    ]
    done = dict.fromkeys(runtimes, 0)
    lock = threading.Lock()
    seq = [one_session()]
    # A pool of threads per gate: what a gate leaves on its threads (their CPU affinity,
    # say) does not reach the other's rounds.
    pools = {name: ThreadPoolExecutor(max_workers=4) for name in runtimes}
    try:
        for name in order:
            runtime, k, pool = runtimes[name], done[name], pools[name]
            done[name] += 1

            def drive(session: str, runtime: Any = runtime, name: str = name) -> None:
                mine = []
                for n in range(TURNS):
                    start = time.perf_counter()
                    runtime.run(session, Input(id="", content=f"{n}: {bench.USER_TEXT}"))
                    mine.append(time.perf_counter() - start)
                with lock:
                    latencies[name].extend(mine)

            sessions = [f"room:{i}" for i in range(k * PER_ROUND, (k + 1) * PER_ROUND)]
            gate = runtime.workers.gate
            changes = gate.changes
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            list(pool.map(drive, sessions))
            took = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            seq.append(one_session())
            turns = PER_ROUND * TURNS
            cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            switches = after.ru_nvcsw - before.ru_nvcsw + after.ru_nivcsw - before.ru_nivcsw
            around = (seq[-2] + seq[-1]) / (2 * STRETCH)
            row = rows[name]
            row["ratio"].append(round(turns / took * around, 3))
            row["wall_us"].append(round(took / turns * 1e6))
            row["cpu_us"].append(round(cpu / turns * 1e6))
            row["switches"].append(round(switches / turns, 2))
            row["changes"].append(round((gate.changes - changes) * 1000 / turns))
    finally:
        for pool in pools.values():
            pool.shutdown()
    for name, runtime in runtimes.items():
        gate = runtime.workers.gate
        lat = sorted(latencies[name])
        summary = {key: round(statistics.mean(values), 3) for key, values in rows[name].items()}
        print(
            name,
            json.dumps(
                {
                    "mean": summary,
                    "rounds": rows[name],
                    "p50_ms": round(lat[len(lat) // 2] * 1000, 3),
                    "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 3),
                    "max_ms": round(lat[-1] * 1000, 3),
                    "handoffs": gate.handoffs,
                    "waited_out": gate.waited_out,
                }
            ),
        )
    pairs = {
        key: [b / a for a, b in zip(rows["A"][key], rows["B"][key], strict=True)]
        for key in ("wall_us", "cpu_us")
    }
    print(
        "B/A per round pair:",
        json.dumps({key: round(statistics.mean(v), 3) for key, v in pairs.items()}),
    )
    for runtime in runtimes.values():
        runtime.shutdown(timeout=60)
    alone.shutdown(timeout=60)


if __name__ == "__main__":
    main()
