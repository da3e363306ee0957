"""Runtime shards on Ray (``scale/ray_shards.py``): a local Ray cluster started by the test
(``ray start --head`` and two worker nodes, each its own raylet and worker processes,
over 127.0.0.1)
and a real, throwaway PostgreSQL cluster (``tests/pg.py``) holding the shared log.

Sessions are routed to shards by a stable hash; a shard killed mid-turn is restarted by
Ray, recovers its sessions from the log, and every acknowledged input ends exactly once.
Skipped, saying why, only when Ray is not installed or its cluster does not start here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")
pytest.importorskip("ray", reason="Ray is not installed (pip install 'aalis-agent[ray]')")

import ray
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.events import Input, TurnRecorded
from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.scale.ownership import shard_of
from aalis_agent.services import ScriptedModel, ScriptedReply, Services

from tests.faults import audit_log
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parent.parent


def slow_services() -> Services:
    """Called in each shard's process: a model whose reply streams for ~0.6 s, so a kill
    lands inside a turn."""

    def reply(request: object, n: int) -> ScriptedReply:
        return ScriptedReply(text=f"答复{n}", chunks=4, chunk_delay_s=0.15)

    return Services(llm=ScriptedModel(reply))


def stubborn_services() -> Services:
    """Called in each shard's process: each input calls the ``wait`` tool, which runs
    until its turn is stopped and then goes on 3 s more (a tool slow to stop)."""
    from aalis_agent.events import ToolCall
    from aalis_agent.services import Tool, ToolRegistry

    def reply(request: Any, n: int) -> ScriptedReply:
        if request.messages[-1].role == "user":
            return ScriptedReply(tool_calls=(ToolCall(id=f"w{n}", name="wait", arguments="{}"),))
        return ScriptedReply(text="done")

    def wait(args: object, ctx: Any) -> str:
        ctx.abort.wait(60)
        time.sleep(3)
        return "stopped late"

    return Services(llm=ScriptedModel(reply), tools=ToolRegistry([Tool("wait", wait)]))


def _ray(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    ray_cli = Path(sys.executable).parent / "ray"
    return subprocess.run(
        [str(ray_cli), "start", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _stop_processes_under(folder: str) -> None:
    """SIGKILL the Ray processes whose command line names ``folder`` (this cluster's
    temp dir): never another cluster's."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if folder in cmdline and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray cluster on loopback: ``ray start --head`` plus two worker nodes
    (``ray start --address``), one CPU each; stopped (its processes only) at the end."""
    from tests.pg import free_port

    folder = tempfile.mkdtemp(prefix="aalis-ray-")  # short: Ray's socket paths have a limit
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*path, str(ROOT)]),  # shards import tests.test_ray
        "RAY_USAGE_STATS_ENABLED": "0",
        # A throwaway cluster on loopback: no token, whatever ~/.ray/auth_token holds.
        "RAY_AUTH_MODE": "disabled",
    }
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    try:
        head = _ray(
            "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={folder}",
            *common, env=env,
        )  # fmt: skip
        if head.returncode != 0:
            pytest.skip(f"the Ray head does not start here: {head.stderr[-1500:]}")
        for _ in range(2):
            # Its own temp dir too: never /tmp/ray, which another cluster may be using.
            node = _ray(f"--address={address}", f"--temp-dir={folder}", *common, env=env)
            if node.returncode != 0:
                pytest.skip(f"a Ray worker node does not start here: {node.stderr[-1500:]}")
        keys = ("PYTHONPATH", "RAY_AUTH_MODE")
        saved = {k: os.environ.get(k) for k in keys}
        os.environ.update({k: env[k] for k in keys})
        try:
            # Ray puts the driver's working directory first on its workers' sys.path:
            # from a neutral one, the shards import the package PYTHONPATH names (the
            # code under test), never one that directory happens to hold.
            with contextlib.chdir(folder):
                ray.init(address=address, logging_level="WARNING")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        yield address
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        _stop_processes_under(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("incarnation_owners", [False, True], ids=["same-owner", "own-owner"])
def test_a_shard_killed_mid_turn_is_restarted_and_nothing_is_lost_or_run_twice(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
    incarnation_owners: bool,
) -> None:
    """With ``incarnation_owners`` the restarted shard owns under a new name: it takes the
    killed one's sessions once their leases expire (ttl 5 s), recovering them then."""
    from aalis_agent.scale.ray_shards import ShardedRuntime

    assert len(ray.nodes()) == 3
    client = ShardedRuntime(
        pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5, incarnation_owners=incarnation_owners
    )
    try:
        before = client.info()
        sessions = [f"room-{i}" for i in range(6)]
        assert {shard_of(s, 2) for s in sessions} == {0, 1}
        handles = [
            client.submit(s, Input(id=f"{s}-{n}", content=f"消息{n}"))
            for n in range(3)
            for s in sessions
        ]
        time.sleep(0.3)  # the first turns are streaming their replies
        victim = shard_of(sessions[0], 2)
        ray.kill(client.actors[victim], no_restart=False)  # its process dies mid-turn
        outcomes = [h.result(timeout=120) for h in handles]  # across the restart
        assert [o.input_id for o in outcomes] == [h.input_id for h in handles]
        assert {o.outcome for o in outcomes} <= {"replied", "aborted"}, outcomes
        after = client.info()
        assert after[victim]["pid"] != before[victim]["pid"]  # restarted by Ray
        renamed = after[victim]["owner"] != before[victim]["owner"]
        assert renamed == incarnation_owners, (before, after)
        victims = sorted(s for s in sessions if shard_of(s, 2) == victim)
        assert set(after[victim]["recovered"]) <= set(victims)
        assert after[victim]["recovered"], after  # it found cut turns in the log

        async def more() -> list[str]:  # the async variant, after the restart
            handles = [
                await client.asubmit(s, Input(id=f"{s}-a", content="再来")) for s in sessions
            ]
            return [(await h).outcome for h in handles]

        assert asyncio.run(more()) == ["replied"] * len(sessions)
        assert client.wait_idle(60)
        outcomes_seen: Counter[str] = Counter()
        with PostgresEventStore(pg_url, read_only=True) as store:
            for s in sessions:
                events = store.read(s)
                acked = [f"{s}-{n}" for n in range(3)] + [f"{s}-a"]
                report = audit_log(events, acked=acked)
                assert not any(report.values()), (s, report)
                for e in events:
                    if isinstance(e, TurnRecorded):
                        outcomes_seen[f"{e.outcome}/{e.reason}" if e.reason else e.outcome] += 1
        print(f"\nray: turns {dict(outcomes_seen)}; restarted shard {victim} recovered {victims}")
        assert any(k.endswith("/crash") for k in outcomes_seen), outcomes_seen
    finally:
        client.shutdown()


def test_an_incarnation_does_not_take_the_sessions_of_one_still_running(
    pg_url: str,  # noqa: F811
) -> None:
    """Two incarnations of shard 0 at once (Ray took the first for dead, but it runs on):
    with owners of their own, the second waits for the first's lease, which the first
    keeps renewing, and is refused naming it; the first's turn runs to its end, once."""
    from aalis_agent.actors.ownership import SessionOwnedElsewhere
    from aalis_agent.scale.ray_shards import RuntimeShard

    first = RuntimeShard(0, 1, pg_url, slow_services, ttl_s=1.0, incarnation_owner=True)
    second = None
    try:
        input_id, _ = first.submit("room-p", Input(id="p-1", content="你好"))
        second = RuntimeShard(0, 1, pg_url, slow_services, ttl_s=1.0, incarnation_owner=True)
        assert second.owner != first.owner and second.owner.startswith("shard-0@")
        started = time.monotonic()
        with pytest.raises(SessionOwnedElsewhere) as refused:
            second.submit("room-p", Input(id="p-2", content="再来"))
        assert refused.value.owner == first.owner
        assert time.monotonic() - started >= 2.0  # waited for it to expire, in vain
        assert first.outcome("room-p", input_id, 30).outcome == "replied"
        with PostgresEventStore(pg_url, read_only=True) as store:
            events = store.read("room-p")
        assert not any(audit_log(events, acked=["p-1"]).values())
        assert [e.outcome for e in events if isinstance(e, TurnRecorded)] == ["replied"]
    finally:
        for shard in (second, first):
            if shard is not None:
                shard.shutdown()


def test_the_client_sends_an_input_again_when_its_shard_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submit whose shard is lost or restarting (Ray's error: the input may or may not
    have been accepted) is sent again by the client, under the same id, until the
    restarted shard answers; an input without an id gets one first, so the retry is the
    same input (the shard answers it, never runs it twice). Past the timeout the error
    is raised. (The shards here stand in for Ray actors; the cluster test below kills a
    real one.)"""
    from aalis_agent.scale import ray_shards
    from ray.exceptions import RayActorError

    sent: list[tuple[str, Input]] = []

    class Shard:
        def __init__(self, failures: int) -> None:
            self.failures = failures
            self.submit = self  # shard.submit.remote(...)

        def remote(self, session_id: str, inp: Input) -> object:
            sent.append((session_id, inp))
            if self.failures:
                self.failures -= 1
                return RayActorError()
            return (inp.id, "opened")

    def get(ref: object) -> object:
        if isinstance(ref, Exception):
            raise ref
        return ref

    monkeypatch.setattr(ray_shards.ray, "get", get)
    monkeypatch.setattr(ray_shards.time, "sleep", lambda s: None)
    client = object.__new__(ray_shards.ShardedRuntime)
    client.shards = 1
    client._dead, client._closed = {}, False
    client.actors = [Shard(failures=3)]
    handle = client.submit("room", Input(id="", content="你好"))
    assert handle.where == "opened" and handle.input_id.startswith("in-")
    assert len(sent) == 4 and {inp for _, inp in sent} == {sent[0][1]}  # the same input
    assert sent[0][1].id == handle.input_id
    sent.clear()
    client.actors = [Shard(failures=1)]
    assert client.submit("room", Input(id="x", content="再来")).input_id == "x"
    assert [inp.id for _, inp in sent] == ["x", "x"]
    client.actors = [Shard(failures=10**6)]
    with pytest.raises(ray_shards.ShardUnavailable) as info:
        client.submit("room", Input(id="y", content="一直失败"), timeout=0)
    error = info.value  # names the session, its shard and the input to send again
    assert isinstance(error, TimeoutError) and isinstance(error.__cause__, RayActorError)
    assert (error.session_id, error.shard, error.input_id) == ("room", 0, "y")
    text = str(error)
    assert text.startswith("session 'room': its shard 0 did not answer within 0 s"), text
    assert "input 'y' may have been accepted" in text and "\n" not in text


def test_calls_after_shutdown_are_refused_as_closed_not_as_a_dead_shard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After ``shutdown()`` the client's calls raise RuntimeClosed, sending nothing (its
    shards were stopped on purpose: ShardDead would send the caller to a new placement of
    a runtime it shut down itself). (A stand-in for the actor.)"""
    from aalis_agent.events.errors import RuntimeClosed
    from aalis_agent.scale import ray_shards

    sent: list[str] = []

    class Shard:
        def __init__(self) -> None:
            self.submit = self.outcome = self.shutdown = self.info = self.wait_idle = self

        def remote(self, *args: object) -> object:
            sent.append(type(args[1]).__name__ if len(args) > 1 else "call")
            return None

    monkeypatch.setattr(ray_shards.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray_shards.ray, "kill", lambda actor, no_restart=True: None)
    client = object.__new__(ray_shards.ShardedRuntime)
    client.shards = 1
    client._dead, client._closed = {}, False
    client.actors = [Shard()]
    client.shutdown()
    sent.clear()
    calls = [
        lambda: client.submit("room", Input(id="x", content="你好")),
        lambda: client.outcome("room", "x", timeout=0),
        lambda: asyncio.run(client.asubmit("room", Input(id="x", content="你好"))),
        lambda: asyncio.run(client.aoutcome("room", "x", timeout=0)),
        client.info,
        client.wait_idle,
    ]
    for call in calls:
        with pytest.raises(RuntimeClosed, match="the sharded runtime is shut down"):
            call()
    assert sent == []


def test_an_input_sent_again_through_the_client_runs_once_and_answers_alike(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """x sent again through the routing client while it runs (sync), after it ended
    (async) and after its shard was killed and restarted by Ray: every handle answers
    the one turn, its reply included, and x is received and run once."""
    from aalis_agent.events import InputReceived, ModelCallStarted
    from aalis_agent.scale.ray_shards import ShardedRuntime

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    session, x = "room-again", Input(id="x", content="你好")
    try:
        first = client.submit(session, x)
        again = client.submit(session, x)  # while its reply streams: follows it
        assert (first.input_id, again.input_id) == ("x", "x")
        assert again.where != "handled"
        outcome = again.result(timeout=60)
        assert outcome.outcome == "replied" and outcome.reply == "答复1"
        assert first.result(timeout=60) == outcome

        async def later() -> tuple[str, object]:
            handle = await client.asubmit(session, x)
            return handle.where, await handle

        assert asyncio.run(later()) == ("handled", outcome)
        ray.kill(client.shard(session), no_restart=False)
        assert client.outcome(session, "x", timeout=120) == outcome  # read from the log
        # A submit may meet the restart ("may or may not have been executed"): the client
        # sends x again by itself until the restarted shard answers it.
        ray.kill(client.shard(session), no_restart=False)
        restarted = client.submit(session, x)
        assert (restarted.where, restarted.result(timeout=60)) == ("handled", outcome)
        with PostgresEventStore(pg_url, read_only=True) as store:
            events = store.read(session)
        assert sum(isinstance(e, InputReceived) for e in events) == 1
        assert sum(isinstance(e, ModelCallStarted) for e in events) == 1
    finally:
        client.shutdown()


def test_a_died_error_is_retried_only_while_the_gcs_lists_the_shard_restarting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's ``ActorDiedError`` for a shard the GCS still lists as restarting (one query
    per failure) is retried as before; one listed DEAD raises ShardDead at once, naming
    the session, the shard and Ray's reason, and the next submit to that shard is refused
    without being sent. (Stand-ins for the actors; the cluster tests below kill real
    ones.)"""
    from aalis_agent.scale import ray_shards
    from aalis_agent.scale.ray_shards import ShardDead
    from ray.exceptions import ActorDiedError

    died = ActorDiedError()
    died.actor_id = "ab12"
    died.error_msg = f"{ActorDiedError.BASE_ERROR_MSG}\n\tpid: 7\nThe actor is dead because X."
    states = ["RESTARTING", "DEAD"]
    queried: list[str | None] = []

    def actor_state(actor_id: str | None) -> dict[str, object]:
        queried.append(actor_id)
        return {"State": states.pop(0), "NumRestarts": 3}

    sent: list[str] = []

    class Shard:
        def __init__(self) -> None:
            self.submit = self

        def remote(self, session_id: str, inp: Input) -> object:
            sent.append(inp.id)
            assert len(sent) < 10, "a shard dead for good is sent the input again and again"
            raise died

    monkeypatch.setattr(ray_shards, "_actor_state", actor_state)
    monkeypatch.setattr(ray_shards.ray, "get", lambda ref: ref)
    monkeypatch.setattr(ray_shards.time, "sleep", lambda s: None)
    client = object.__new__(ray_shards.ShardedRuntime)
    client.shards = 1
    client._dead, client._closed = {}, False
    client.actors = [Shard()]
    with pytest.raises(ShardDead) as dead:
        client.submit("room", Input(id="x", content="你好"), timeout=None)
    assert sent == ["x", "x"] and queried == ["ab12", "ab12"]  # retried once, then DEAD
    assert (dead.value.session_id, dead.value.shard, dead.value.input_id) == ("room", 0, "x")
    assert dead.value.reason == "The actor is dead because X. (after 3 restart(s))"
    assert dead.value.maybe_accepted and dead.value.__cause__ is died
    assert "session 'room': its shard 0 is dead and will not be restarted" in str(dead.value)
    assert "input 'x' may have been accepted before it died" in str(dead.value)
    with pytest.raises(ShardDead) as again:
        client.submit("room", Input(id="y", content="再来"))
    assert sent == ["x", "x"] and not again.value.maybe_accepted  # not sent
    assert "input 'y' was not sent to it" in str(again.value)
    client.actors = [Shard()]  # the shard's place taken by a new actor: sent to it
    states.append("ALIVE")
    states.append("DEAD")
    with pytest.raises(ShardDead):
        client.submit("room", Input(id="y", content="再来"), timeout=None)
    assert sent == ["x", "x", "y", "y"]


def _new_placement_answers(
    pg_url: str,  # noqa: F811
    session: str,
    inp: Input,
) -> tuple[str, InputOutcome]:
    """``inp`` sent again under its id through a new client (a new placement of every
    session): where it went, and its outcome."""
    from aalis_agent.scale.ray_shards import ShardedRuntime

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    try:
        handle = client.submit(session, inp, timeout=20)
        return handle.where, handle.result(timeout=60)
    finally:
        client.shutdown()


def test_a_shard_killed_for_good_fails_a_submit_at_once_naming_it(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """A shard killed with ``no_restart=True`` (and dead): a submit to it raises ShardDead (not the
    ``ActorDiedError`` its 20 s timeout would end in), naming the session, the shard and
    Ray's reason, as does asking an outcome of it; the other shard serves on. The input
    sent again under its id to a new placement is answered from the log (one accepted
    before) or run once (one never accepted)."""
    from aalis_agent.events import InputReceived, ModelCallStarted
    from aalis_agent.scale.ray_shards import ShardDead, ShardedRuntime
    from ray._private import state as ray_state

    from tests.faults import wait_until

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    session = "room-gone"
    other = next(
        f"room-{i}" for i in range(100) if shard_of(f"room-{i}", 2) != shard_of(session, 2)
    )
    x, y = Input(id="gone-x", content="你好"), Input(id="gone-y", content="再来")
    try:
        first = client.submit(session, x).result(timeout=60)
        assert first.outcome == "replied"
        victim = client.shard(session)
        ray.kill(victim, no_restart=True)  # returns before the actor is dead: awaited

        def dead_in_gcs() -> bool:
            return bool(ray_state.actors(victim._actor_id.hex())["State"] == "DEAD")

        assert wait_until(dead_in_gcs, timeout=20)
        with pytest.raises(ShardDead) as dead:
            client.submit(session, y, timeout=20)
        shard = shard_of(session, 2)
        assert (dead.value.session_id, dead.value.shard, dead.value.input_id) == (
            session,
            shard,
            "gone-y",
        )
        assert "killed by `ray.kill`" in dead.value.reason, dead.value.reason
        text = str(dead.value)
        assert f"session {session!r}: its shard {shard} is dead and will not be restarted" in text
        assert dead.value.reason in text and dead.value.maybe_accepted
        with pytest.raises(ShardDead) as again:  # known dead: not sent
            asyncio.run(client.asubmit(session, y, timeout=20))
        assert not again.value.maybe_accepted
        with pytest.raises(ShardDead, match="the outcome of input 'gone-x' cannot be asked"):
            client.outcome(session, "gone-x", timeout=20)
        assert client.submit(other, Input(id="o", content="在吗")).result(60).outcome == "replied"
    finally:
        client.shutdown()
    assert _new_placement_answers(pg_url, session, x) == ("handled", first)
    where, outcome = _new_placement_answers(pg_url, session, y)
    # The shard's process may still take y between Ray's listing it dead and its end (the
    # error said it may have been accepted): the new placement then answers y from the
    # log (its turn cut by the kill is recorded aborted), else runs it once.
    if where == "handled":
        assert outcome.outcome in ("replied", "aborted"), outcome
    else:
        assert outcome.outcome == "replied", (where, outcome)
    with PostgresEventStore(pg_url, read_only=True) as store:
        events = store.read(session)
    assert not any(audit_log(events, acked=["gone-x", "gone-y"]).values())
    assert sum(isinstance(e, InputReceived) for e in events) == 2
    assert sum(isinstance(e, ModelCallStarted) for e in events) == 2


def test_a_shard_killed_for_good_mid_submit_fails_it_at_once(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """A submit in flight inside its shard (held on the session's lease row, which the
    test keeps locked) when the shard is killed with ``no_restart=True``: the caller gets
    ShardDead saying the input may have been accepted, not the timeout; sent again to a
    new placement it runs once."""
    from concurrent.futures import ThreadPoolExecutor

    import psycopg
    from aalis_agent.events import InputReceived
    from aalis_agent.scale.leases import session_key
    from aalis_agent.scale.ray_shards import ShardDead, ShardedRuntime

    from tests.faults import wait_until

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    session, z = "room-cut", Input(id="cut-z", content="你好")
    client.info()  # the shards are up (their lease table made)
    holder = psycopg.connect(pg_url)
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE 'INSERT INTO aalis_leases%%' AND pid <> pg_backend_pid()"
    )
    try:
        holder.execute(
            "INSERT INTO aalis_leases (session, owner, expires_at)"
            " VALUES (%s, 'test-holder', now() + interval '1 minute')",
            [session_key(session)],
        )  # uncommitted: the shard's acquire of the session waits for it
        with ThreadPoolExecutor(1) as pool, psycopg.connect(pg_url, autocommit=True) as watch:
            submitted = pool.submit(client.submit, session, z, 20)

            def stuck() -> bool:
                row = watch.execute(waiting).fetchone()
                return row is not None and row[0] > 0

            assert wait_until(stuck, timeout=20)  # the submit is inside the shard
            ray.kill(client.shard(session), no_restart=True)
            with pytest.raises(ShardDead) as dead:
                submitted.result(timeout=30)
        assert dead.value.maybe_accepted and dead.value.input_id == "cut-z"
        assert "may have been accepted before it died" in str(dead.value)
        assert "killed by `ray.kill`" in dead.value.reason
    finally:
        holder.rollback()
        holder.close()
        client.shutdown()
    outcome = _new_placement_answers(pg_url, session, z)[1]
    assert outcome.outcome == "replied"
    with PostgresEventStore(pg_url, read_only=True) as store:
        events = store.read(session)
    assert sum(isinstance(e, InputReceived) for e in events) == 1
    assert not any(audit_log(events, acked=["cut-z"]).values())


def test_a_shard_whose_restarts_are_used_up_fails_a_submit_at_once(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """``max_restarts=1``: the shard's process SIGKILLed once is restarted and a submit
    meanwhile retried and answered (as before); killed again, it is dead for good, and a
    submit raises ShardDead with Ray's reason and the restart count, not the timeout's
    ``ActorDiedError``."""
    from aalis_agent.scale.ray_shards import ShardDead, ShardedRuntime
    from ray._private import state as ray_state

    from tests.faults import wait_until

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5, max_restarts=1)
    session = "room-worn"
    index = shard_of(session, 2)
    victim = client.actors[index]
    try:
        os.kill(client.info()[index]["pid"], signal.SIGKILL)
        handle = client.submit(session, Input(id="worn-1", content="你好"), timeout=20)
        assert handle.result(timeout=60).outcome == "replied"  # the restarted shard
        os.kill(client.info()[index]["pid"], signal.SIGKILL)

        def dead_in_gcs() -> bool:
            return bool(ray_state.actors(victim._actor_id.hex())["State"] == "DEAD")

        assert wait_until(dead_in_gcs, timeout=20)
        with pytest.raises(ShardDead) as dead:
            client.submit(session, Input(id="worn-2", content="再来"), timeout=20)
        assert dead.value.shard == index and dead.value.session_id == session
        assert "worker process has died" in dead.value.reason, dead.value.reason
        assert dead.value.reason.endswith("(after 1 restart(s))")
    finally:
        client.shutdown()


class _DyingShard:
    """A stand-in for a shard's actor whose submits fail ``failures`` times with
    ``died``, then open; its Ray id is ``hex``."""

    class _Id:
        def __init__(self, hex_: str) -> None:
            self._hex = hex_

        def hex(self) -> str:
            return self._hex

    def __init__(self, died: BaseException, failures: int, hex_: str = "cd34") -> None:
        self.died = died
        self.failures = failures
        self.sent: list[str] = []
        self.submit = self  # shard.submit.remote(...)
        self._actor_id = self._Id(hex_)

    def remote(self, session_id: str, inp: Input) -> object:
        self.sent.append(inp.id)
        assert len(self.sent) < 10, "sent again and again"
        if self.failures:
            self.failures -= 1
            raise self.died
        return (inp.id, "opened")


def _client_of(monkeypatch: pytest.MonkeyPatch, shard: object) -> Any:
    from aalis_agent.scale import ray_shards

    monkeypatch.setattr(ray_shards.ray, "get", lambda ref: ref)
    monkeypatch.setattr(ray_shards.time, "sleep", lambda s: None)
    client = object.__new__(ray_shards.ShardedRuntime)
    client.shards = 1
    client._dead, client._closed = {}, False
    client.actors = [shard]
    return client


def test_a_died_error_without_an_actor_id_is_checked_under_the_shards_own_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's ``ActorDiedError`` may come without the actor's id (its cause unknown): the
    GCS is asked about the shard the call was sent to, by that actor's id, and a shard it
    lists as restarting is waited for, not declared dead for good."""
    from aalis_agent.scale import ray_shards
    from ray.exceptions import ActorDiedError

    died = ActorDiedError()
    assert died.actor_id is None
    queried: list[str | None] = []

    def actor_state(actor_id: str | None) -> dict[str, object] | None:
        queried.append(actor_id)
        return {"State": "RESTARTING"} if actor_id == "cd34" else None

    monkeypatch.setattr(ray_shards, "_actor_state", actor_state)
    shard = _DyingShard(died, failures=2)
    client = _client_of(monkeypatch, shard)
    handle = client.submit("room", Input(id="x", content="你好"), timeout=None)
    assert (handle.input_id, handle.where) == ("x", "opened")
    assert shard.sent == ["x", "x", "x"] and queried == ["cd34", "cd34"]


def test_a_shard_not_confirmed_dead_is_not_remembered_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the GCS cannot be asked, an ``ActorDiedError`` raises ShardDead (its type
    decides) but the shard is not taken as dead for later calls: the next submit is sent
    to it, and a shard that came back takes it."""
    from aalis_agent.scale import ray_shards
    from aalis_agent.scale.ray_shards import ShardDead
    from ray.exceptions import ActorDiedError

    monkeypatch.setattr(ray_shards, "_actor_state", lambda actor_id: None)
    shard = _DyingShard(ActorDiedError(), failures=1)
    client = _client_of(monkeypatch, shard)
    with pytest.raises(ShardDead) as dead:
        client.submit("room", Input(id="x", content="你好"), timeout=None)
    assert dead.value.maybe_accepted
    handle = client.submit("room", Input(id="x", content="你好"), timeout=None)
    assert (handle.input_id, handle.where) == ("x", "opened")
    assert shard.sent == ["x", "x"]


def test_an_error_raised_in_a_shard_names_the_shard_and_keeps_its_class(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """An error a shard's runtime raises (Ray wraps it as ``RayTaskError``, whose text is
    the shard's traceback) reaches the caller as its own class, in its own words (naming
    the session) followed by the shard it came from: a session held by another runtime
    (``SessionOwnedElsewhere``, its owner kept) and one whose id is too long for a lease
    (``InvalidInput``), by submit and by asubmit."""
    from aalis_agent.actors.ownership import SessionOwnedElsewhere
    from aalis_agent.events.errors import InvalidInput
    from aalis_agent.scale.leases import PostgresLeases
    from aalis_agent.scale.ray_shards import ShardedRuntime
    from ray.exceptions import RayTaskError

    from tests.test_store_postgres import _unindexable_id

    held, long = "room-held", _unindexable_id()
    other = PostgresLeases(pg_url, owner="elsewhere", ttl_s=60)
    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    try:
        other.acquire(held)
        for submit in (
            client.submit,
            lambda s, inp: asyncio.run(client.asubmit(s, inp)),
        ):
            with pytest.raises(SessionOwnedElsewhere) as owned:
                submit(held, Input(id="h", content="你好"))
            error = owned.value
            assert type(error) is SessionOwnedElsewhere and not isinstance(error, RayTaskError)
            assert (error.session_id, error.owner) == (held, "elsewhere")
            assert error.shard == shard_of(held, 2)
            text = str(error)
            assert text.startswith(f"session {held!r} is owned by 'elsewhere'"), text
            assert text.endswith(f" (raised by shard {shard_of(held, 2)})"), text
            assert "\n" not in text and "Traceback" not in text, text
            assert isinstance(error.__cause__, RayTaskError)  # Ray's traceback, for the log
            with pytest.raises(InvalidInput) as invalid:
                submit(long, Input(id="l", content="你好"))
            text = str(invalid.value)
            assert text.startswith(f"session {long!r:.80}: no lease can be taken on it"), text
            assert text.endswith(f" (raised by shard {shard_of(long, 2)})"), text
            assert invalid.value.shard == shard_of(long, 2)
    finally:
        client.shutdown()
        other.close()


def test_a_session_stopped_in_its_shard_is_told_through_the_handle_naming_the_shard(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """A write refused mid-turn (a trigger, as a full disk would) stops the session in its
    shard: ``handle.result()`` and ``await handle`` raise ``SessionFailed`` (its session
    and reason kept), naming the shard, where Ray could not rebuild it (its ``__init__``
    takes the session and the reason) and raised ``UnserializableException``."""
    import psycopg
    from aalis_agent.events.errors import SessionFailed
    from aalis_agent.scale.ray_shards import ShardedRuntime

    session = "room-full"
    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    try:
        assert client.submit(session, Input(id="f1", content="一")).result(60).outcome == "replied"
        with PostgresEventStore(pg_url, read_only=True) as store:
            armed = store.last_seq(session) + 5  # the next input is taken, its reply is not
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.seq > {armed} THEN RAISE EXCEPTION 'disk full at seq %', NEW.seq; "
                "END IF; RETURN NEW; END $$"
            )
            admin.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON aalis_log "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        handle = client.submit(session, Input(id="f2", content="二"))
        for wait in (handle.result, lambda timeout: asyncio.run(handle.aresult(timeout))):
            with pytest.raises(SessionFailed) as info:
                wait(60)
            error = info.value
            assert type(error) is SessionFailed and error.session_id == session
            assert "disk full at seq" in error.reason, error.reason
            assert error.shard == shard_of(session, 2)
            text = str(error)
            assert text.startswith(f"session {session!r} stopped: a write to its log failed")
            assert text.endswith(f" (raised by shard {shard_of(session, 2)})"), text
    finally:
        client.shutdown()


def _one_per_shard(shards: int = 2) -> list[str]:
    names = [f"room-bus-{n}" for n in range(50)]
    return [next(s for s in names if shard_of(s, shards) == i) for i in range(shards)]


class _Seen:
    """What a subscriber received (topic, payload, the delivering thread's name), read
    from the test's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, dict[str, Any], str]] = []

    def __call__(self, topic: str, payload: Any) -> None:
        with self.lock:
            self.events.append((topic, payload, threading.current_thread().name))

    def of(self, session: str, topic: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [
                p
                for t, p, _ in self.events
                if p.get("sessionId") == session and (topic is None or t == topic)
            ]


def _wait_for(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _pid(client: Any, index: int) -> int | None:
    """The process id of shard ``index``; None while Ray restarts it."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    try:
        return int(ray.get(client.actors[index].info.remote(), timeout=5)["pid"])
    except (RayActorError, ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def _turns(outcomes: list[InputOutcome]) -> list[str | None]:
    """The turns that ran ``outcomes``' inputs, in order (inputs queued together join
    one turn)."""
    return list(dict.fromkeys(o.turn_id for o in outcomes))


def _turns_in_order(seen: _Seen, session: str, outcomes: list[InputOutcome]) -> None:
    """Per turn of ``session``, in the order the shard published them: opened, its reply
    streamed piece by piece, the reply sent, ended; one turn after the other."""
    kinds = ("turn:opened", "outbound:message", "turn:ended")
    trail = [
        (t, p.get("turnId"))
        for t, p, _ in list(seen.events)
        if p.get("sessionId") == session and t in kinds
    ]
    turns = _turns(outcomes)
    assert trail == [(k, t) for t in turns for k in kinds], trail
    for o in {o.turn_id: o for o in outcomes}.values():
        deltas = [
            p["contentDelta"]
            for p in seen.of(session, "outbound:stream")
            if p["turnId"] == o.turn_id
        ]
        assert "".join(deltas) == o.reply and len(deltas) > 1, (deltas, o.reply)
        sent = [
            p["content"] for p in seen.of(session, "outbound:message") if p["turnId"] == o.turn_id
        ]
        assert sent == [o.reply]


def test_bus_events_of_both_shards_reach_the_driver_in_order_across_a_restart(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """``ShardedRuntime.subscribe``: nothing is forwarded (no topic followed, no thread)
    until someone subscribes; then the events of sessions on both shards reach the
    driver's subscribers, each shard's on a thread of its own in the order it published
    them; a subscriber that raises is logged and the others still get the event; a shard
    ``ray.kill``-ed and restarted by Ray forwards the events of the inputs sent after;
    unsubscribing stops delivery, and the shards stop following what nobody wants."""
    from aalis_agent.events.errors import InvalidInput, RuntimeClosed
    from aalis_agent.scale.ray_shards import ShardedRuntime
    from aalis_agent.services.bus_events import TurnStarted, subscribe_typed
    from structlog.testing import capture_logs

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    a, b = _one_per_shard()
    feeds = ("aalis-ray-shard-0-events", "aalis-ray-shard-1-events")
    try:
        assert [i["bus_topics"] for i in client.info()] == [[], []]
        assert not {t.name for t in threading.enumerate()} & set(feeds)
        with pytest.raises(InvalidInput, match="topic"):
            client.subscribe("", print)
        with pytest.raises(InvalidInput, match="fn must be callable"):
            client.subscribe("*", "print")  # type: ignore[arg-type]
        seen, kept, typed = _Seen(), _Seen(), []

        def raises(topic: str, payload: Any) -> None:
            raise RuntimeError("a broken subscriber")

        with capture_logs() as logs:
            client.subscribe("turn:ended", raises)
            unsubscribe = client.subscribe("*", seen)
            client.subscribe("turn:ended", kept)
            untyped = subscribe_typed(client.bus, typed.append, topics=("turn:opened",))
            assert [i["bus_topics"] for i in client.info()] == [["*"], ["*"]]
            handles = {
                s: [client.submit(s, Input(id=f"{s}-{n}", content=f"消息{n}")) for n in range(3)]
                for s in (a, b)
            }
            outcomes = {s: [h.result(timeout=60) for h in hs] for s, hs in handles.items()}
            turns = {s: _turns(outcomes[s]) for s in (a, b)}
            ended = len(turns[a]) + len(turns[b])  # inputs sent while a turn ran join the next
            _wait_for(lambda: len(kept.events) == ended, "the turns' ends")
        for s in (a, b):
            _turns_in_order(seen, s, outcomes[s])
        assert {name for _, _, name in seen.events} == set(feeds)  # one thread a shard
        failed = [e for e in logs if e["event"] == "subscriber failed"]
        assert len(failed) == ended and {e["topic"] for e in failed} == {"turn:ended"}, failed
        assert all(isinstance(e, TurnStarted) for e in typed) and len(typed) == ended

        # A shard killed and restarted by Ray: the events of what is sent after arrive.
        victim = shard_of(a, 2)
        before = client.info()[victim]
        ray.kill(client.actors[victim], no_restart=False)
        # (The kill lands later: an input sent at once may be cut in the old process,
        # and the new one's recovery of it is not forwarded; see subscribe.)
        _wait_for(lambda: _pid(client, victim) not in (None, before["pid"]), "the restart")
        later = [client.submit(a, Input(id=f"{a}-r{n}", content="再来")) for n in range(2)]
        later_outcomes = [h.result(timeout=120) for h in later]
        assert {o.outcome for o in later_outcomes} == {"replied"}, later_outcomes
        assert client.info()[victim]["bus_topics"] == ["*"]
        ended += len(_turns(later_outcomes))
        _wait_for(lambda: len(kept.events) == ended, "the restarted shard's events")
        _turns_in_order(seen, a, outcomes[a] + later_outcomes)

        unsubscribe()
        unsubscribe()  # a second call does nothing
        untyped()
        assert [i["bus_topics"] for i in client.info()] == [["turn:ended"], ["turn:ended"]]
        count = len(seen.events)
        last = [client.submit(s, Input(id=f"{s}-last", content="最后")) for s in (a, b)]
        assert [h.result(timeout=60).outcome for h in last] == ["replied", "replied"]
        # ``kept`` and ``seen`` ran on the same thread a shard, in order: once ``kept``
        # has both turns' ends, ``seen`` would have had them too.
        _wait_for(lambda: len(kept.events) == ended + 2, "the last turns' ends")
        assert len(seen.events) == count and len(typed) == ended
    finally:
        client.shutdown()
    assert not {t.name for t in threading.enumerate()} & set(feeds)  # the feeds ended
    with pytest.raises(RuntimeClosed):
        client.subscribe("*", print)


def test_a_slow_bus_subscriber_holds_up_no_turn_and_the_events_dropped_are_counted(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """The driver's long poll of a shard's events takes none of the ``max_concurrency``
    threads of its other calls. A subscriber stuck in its first event: the shard's turns
    go on, the shard holds ``event_backlog`` events for the driver and drops the next
    ones, counted (``info()``) and logged in the driver; once the subscriber returns,
    what was held and what is published later arrive."""
    from aalis_agent.events.errors import InvalidInput
    from aalis_agent.scale.ray_shards import ShardedRuntime
    from structlog.testing import capture_logs

    with pytest.raises(InvalidInput, match="event_backlog must be at least 1, not 0"):
        ShardedRuntime(pg_url, 1, slow_services, event_backlog=0)
    client = ShardedRuntime(
        pg_url, 1, slow_services, ttl_s=5.0, num_cpus=0.5, event_backlog=8, max_concurrency=1
    )
    release = threading.Event()
    calls: list[tuple[str, str | None]] = []

    def slow(topic: str, payload: Any) -> None:
        calls.append((topic, payload.get("turnId")))
        release.wait(120)

    try:
        with capture_logs() as logs:
            client.subscribe("*", slow)
            time.sleep(0.5)  # the driver's long poll waits in the idle shard (up to 5 s) ...
            start = time.monotonic()
            client.info()  # ... on a thread of its own: not the one thread of the others
            assert time.monotonic() - start < 2.0
            try:
                start = time.monotonic()
                ran: list[str | None] = []
                for n in range(5):
                    inp = Input(id=f"slow-{n}", content=f"{n}")
                    outcome = client.submit("room-slow", inp).result(60)
                    assert outcome.outcome == "replied"
                    ran.append(outcome.turn_id)
                took = time.monotonic() - start
                assert took < 20, took  # 5 turns of ~0.6 s each, not held up
                assert len(calls) == 1  # still in its first event
                dropped = client.info()[0]["events_dropped"]
                assert dropped > 0
            finally:
                release.set()
            last = client.submit("room-slow", Input(id="slow-last", content="再来")).result(60)
            _wait_for(lambda: ("turn:ended", last.turn_id) in calls, "the turn after the release")
        warned = [e for e in logs if e["event"].startswith("the shard dropped bus events")]
        total = client.info()[0]["events_dropped"]
        assert total >= dropped and sum(e["dropped"] for e in warned) == total, (warned, total)
        # What was held, and not dropped, came in the order the turns ran.
        ran.append(last.turn_id)
        turns = [t for _, t in calls if t is not None]
        assert turns == sorted(turns, key=ran.index), calls
    finally:
        client.shutdown()


def test_a_new_shard_forwards_the_events_of_a_first_submit_that_names_the_topics(
    pg_url: str,  # noqa: F811
) -> None:
    """A shard Ray restarted knows no topics: the submit that reaches it first names them
    (as every submit does once someone subscribes), and it follows them before it takes
    the input, so that input's events are held for the driver. A fetch naming an older
    version of the topics does not change them; a fetch after an event lets it go, and
    one naming another incarnation (the driver's first from a restarted shard) gets all
    the shard holds. (The shard's class itself, in this process.)"""
    import pickle

    from aalis_agent.scale.ray_shards import RuntimeShard

    shard = RuntimeShard(0, 1, pg_url, slow_services, ttl_s=5.0)
    try:
        assert shard.info()["bus_topics"] == []
        inp = Input(id="f1", content="你好")
        input_id, _ = shard.submit("room-follow", inp, follow=(3, ["turn:ended"]))
        outcome = shard.outcome("room-follow", input_id, 30)
        assert outcome is not None and outcome.outcome == "replied"
        incarnation, items, dropped = shard.events("", 0, 2, ["*"], 10)
        assert shard.info()["bus_topics"] == ["turn:ended"]  # version 2 < 3: ignored
        ended = [(t, pickle.loads(d)["turnId"]) for _, t, d in items]
        assert ended == [("turn:ended", outcome.turn_id)] and dropped == 0
        assert shard.events("another", 0, 3, ["turn:ended"], 0.1)[1] == items
        assert shard.events(incarnation, items[-1][0], 3, ["turn:ended"], 0.1) == (
            incarnation,
            [],
            0,
        )
    finally:
        shard.shutdown()


def test_a_subscriber_may_shut_the_client_down_from_its_callback(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """A subscriber runs on a shard's event thread: one that subscribes again and then
    shuts the client down from its callback gets no error (shutdown joined every event
    thread, its own included: 'cannot join current thread'), and every event thread
    ends."""
    from aalis_agent.events.errors import RuntimeClosed
    from aalis_agent.scale.ray_shards import ShardedRuntime
    from structlog.testing import capture_logs

    client = ShardedRuntime(pg_url, 2, slow_services, ttl_s=5.0, num_cpus=0.5)
    feeds = ("aalis-ray-shard-0-events", "aalis-ray-shard-1-events")
    done = threading.Event()
    raised: list[BaseException] = []

    def stops(topic: str, payload: Any) -> None:
        if topic != "turn:ended" or done.is_set():
            return
        try:
            client.subscribe("turn:opened", lambda t, p: None)
            client.shutdown()
        except BaseException as exc:
            raised.append(exc)
        done.set()

    try:
        with capture_logs() as logs:
            client.subscribe("*", stops)
            client.submit("room-stops", Input(id="s1", content="你好"))
            assert done.wait(60), "no turn:ended"
            _wait_for(
                lambda: not {t.name for t in threading.enumerate()} & set(feeds),
                "the event threads' end",
                timeout=15,
            )
        assert raised == [], raised
        assert not [e for e in logs if e["event"] == "subscriber failed"], logs
        with pytest.raises(RuntimeClosed):
            client.submit("room-stops", Input(id="s2", content="再来"))
    finally:
        client.shutdown()


class HeldError(Exception):
    """An error whose ``__init__`` takes other arguments than its message and which
    carries an attribute that does not pickle (a lock)."""

    def __init__(self, who: str, n: int) -> None:
        super().__init__(f"held by {who} ({n})")
        self.who = who
        self.n = n
        self.lock = threading.Lock()


@ray.remote(max_retries=0)
def _raises_held() -> None:
    """As a shard's call does: the error sent back as ``_Raised``."""
    from aalis_agent.scale.ray_shards import _Raised

    try:
        raise HeldError("elsewhere", 3)
    except HeldError as exc:
        raise _Raised.of(exc) from exc


def test_an_error_with_an_attribute_that_does_not_pickle_keeps_its_class(
    ray_cluster: str,
) -> None:
    """An error raised in a shard with an attribute that does not pickle reaches the
    caller as its own class still, its other attributes kept and the one left out named
    (it came as a ``RunError`` holding only its text)."""
    from aalis_agent.scale.ray_shards import _raise_from_shard
    from ray.exceptions import RayTaskError

    with pytest.raises(RayTaskError) as sent:
        ray.get(_raises_held.remote(), timeout=60)
    with pytest.raises(HeldError) as raised:
        _raise_from_shard(sent.value, 1)
    error = raised.value
    assert type(error) is HeldError and (error.who, error.n, error.shard) == ("elsewhere", 3, 1)
    assert not hasattr(error, "lock")
    assert str(error) == (
        "held by elsewhere (3) [attributes not sent, as they do not pickle: lock] "
        "(raised by shard 1)"
    )


def test_shutdown_stops_every_shard_at_once_and_delivers_their_last_events(
    ray_cluster: str,
    pg_url: str,  # noqa: F811
) -> None:
    """Two shards whose turns each take 3 s to stop: shut down together, about 3 s (one
    shard after the other took 6: with N busy shards, N times a shard's time); the
    events of the turns it stopped reach the subscribers before it returns."""
    from aalis_agent.scale.ray_shards import ShardedRuntime

    client = ShardedRuntime(pg_url, 2, stubborn_services, ttl_s=5.0, num_cpus=0.5)
    closed = False
    try:
        sessions = _one_per_shard()
        seen = _Seen()
        client.subscribe("tool:execute", seen)
        client.subscribe("turn:ended", seen)
        for session in sessions:
            client.submit(session, Input(id=f"{session}/w", content="等等"), timeout=30)
        _wait_for(lambda: all(seen.of(s) for s in sessions), "both tools to start")
        t0 = time.monotonic()
        client.shutdown()
        closed = True
        took = time.monotonic() - t0
        assert took < 5.5, took
        # The turns the shutdown stopped ended within it: their events were delivered
        # before it returned (the shards' buffers were dropped as they shut down).
        for session in sessions:
            ended = seen.of(session, "turn:ended")
            assert len(ended) == 1 and ended[0]["outcome"] == "aborted", seen.of(session)
    finally:
        if not closed:
            client.shutdown()


def test_a_shards_event_that_does_not_pickle_is_counted_for_the_driver() -> None:
    """A bus event a shard cannot pickle (a hook's lambda) is not sent: the next fetch
    counts it among the events dropped (``info()["events_dropped"]``), and the events
    after it still come. (The shard's buffer itself, over a real bus.)"""
    from aalis_agent.scale.ray_shards import _EventBuffer
    from aalis_agent.services.bus import EventBus

    bus = EventBus()
    buffer = _EventBuffer(bus, 0)
    buffer.follow(1, ["hook:event"])
    bus.publish("hook:event", lambda: None)
    bus.publish("hook:event", {"n": 1})
    _, items, dropped = buffer.fetch(buffer.incarnation, 0, 0)
    assert dropped == 1 and buffer.dropped_total == 1
    assert [(seq, topic) for seq, topic, _ in items] == [(1, "hook:event")]


def test_the_clients_bus_refuses_a_subscription_after_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``subscribe_typed(client.bus, ...)`` after ``shutdown()`` raises RuntimeClosed, as
    ``client.subscribe`` does (it was taken, and nothing ever came). (A stand-in for the
    actors, as in the test of calls after shutdown.)"""
    from aalis_agent.events.errors import RuntimeClosed
    from aalis_agent.scale import ForwardedBus, ray_shards
    from aalis_agent.services.bus_events import subscribe_typed

    monkeypatch.setattr(ray_shards.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray_shards.ray, "kill", lambda actor, no_restart=True: None)
    client = object.__new__(ray_shards.ShardedRuntime)
    client.shards = 0
    client._dead, client._closed = {}, False
    client.actors = []
    client.bus = ForwardedBus(client)
    client.shutdown()
    with pytest.raises(RuntimeClosed):
        subscribe_typed(client.bus, print)
    with pytest.raises(RuntimeClosed):
        client.subscribe("*", print)
