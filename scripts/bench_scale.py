"""Turns per second and latency with 1, 2 and 4 runtime shards on Ray over one PostgreSQL
log (``scale/ray_shards.py``): ``INPUTS`` inputs over ``SESSIONS`` sessions, ``SESSIONS``
in flight at once (one per session: each waits for its turn before the next), a model
that answers at once, so the figure is the runtime, the log and the leases.

``.venv/bin/python scripts/bench_scale.py [INPUTS]`` prints one JSON line per figure, as
``scripts/bench`` does. It starts a local Ray (on 127.0.0.1, ``num_cpus`` = 4) and a
throwaway PostgreSQL cluster (``tests/pg.py``, fsync on) unless ``AALIS_PG_URL`` names a
database. Every shard, Ray's own processes and the server share this machine's cores:
past the core count more shards add contention, not throughput.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for tests.pg, the throwaway cluster

from aalis_agent.events import Input  # noqa: E402
from aalis_agent.services import ScriptedModel, ScriptedReply, Services  # noqa: E402

INPUTS = 400
SESSIONS = 16
SHARDS = (1, 2, 4)

Emit = Callable[..., None]


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": name, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


def _services() -> Services:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return Services(llm=ScriptedModel(lambda request, n: ScriptedReply(text=f"好的 {n}")))


async def _drive(client: object, inputs: int) -> tuple[float, list[float]]:
    from aalis_agent.scale.ray_shards import ShardedRuntime

    assert isinstance(client, ShardedRuntime)
    latencies: list[float] = []
    per_session = inputs // SESSIONS

    async def session(k: int) -> None:
        for n in range(per_session):
            t0 = time.perf_counter()
            handle = await client.asubmit(f"room-{k}", Input(id=f"r{k}-{n}", content="你好"))
            await handle
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(k) for k in range(SESSIONS)))
    return time.perf_counter() - t0, latencies


def bench_shards(tmp: Path, emit: Emit, inputs: int = INPUTS) -> None:
    """For 1, 2 and 4 shards: turns/s and p50/p99 (submit to outcome) over ``inputs``."""
    try:
        import ray
        from aalis_agent.scale.ray_shards import ShardedRuntime
    except ImportError as exc:
        emit("shard_turns_per_s", 0, "turns/s", skipped=f"Ray is not installed: {exc}")
        return
    import psycopg

    from tests.pg import Cluster, ClusterUnavailable, url_with

    cluster: Cluster | None = None
    url = os.environ.get("AALIS_PG_URL")
    if url is None:
        try:
            cluster = Cluster(database="aalis_bench")
            url = cluster.start()
        except ClusterUnavailable as exc:
            emit("shard_turns_per_s", 0, "turns/s", skipped=str(exc))
            return
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a throwaway local Ray on loopback
    ray.init(
        address="local",  # a new local Ray, never one already running here
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        for shards in SHARDS:
            schema = f"scale_{os.getpid()}_{shards}"
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"CREATE SCHEMA {schema}")
            client = ShardedRuntime(
                url_with(url, search_path=schema), shards, _services, num_cpus=0.5
            )
            try:
                client.info()  # every shard is up
                asyncio.run(_drive(client, SESSIONS))  # warm-up: one turn per session
                elapsed, latencies = asyncio.run(_drive(client, inputs))
            finally:
                client.shutdown()
            latencies.sort()
            emit(
                "shard_turns_per_s",
                len(latencies) / elapsed,
                "turns/s",
                shards=shards,
                sessions=SESSIONS,
                turns=len(latencies),
                p50_ms=round(statistics.median(latencies) * 1000, 2),
                p99_ms=round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
                cores=os.cpu_count(),
            )
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.stop()


def main() -> int:
    inputs = int(sys.argv[1]) if len(sys.argv) > 1 else INPUTS
    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        bench_shards(Path(tmpdir), emit, inputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
