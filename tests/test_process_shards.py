"""``ProcessShards``: sessions over worker processes, each shard a SQLite log of its own
(``scale/processes.py``). Real worker processes (spawned), real Unix sockets, real
SIGKILLs; the workers' services are ``tests/shard_services.py``."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import pytest
from aalis_agent.events import Input, InputReceived, SqliteEventStore
from aalis_agent.events.errors import (
    ConfigError,
    InvalidInput,
    RunError,
    RuntimeClosed,
    StoreInUse,
    UsageError,
)
from aalis_agent.scale import processes
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.processes import MANIFEST, ProcessShards, ShardUnavailable

import aalis_agent
from tests import shard_services
from tests.harness import ROOT

OPTIONS = {"janitor": False}


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[ProcessShards]:
    made = ProcessShards(tmp_path / "shards", shard_services.services, 2, runtime_options=OPTIONS)
    yield made
    made.shutdown(timeout=10)


def _received(database: Path, session: str) -> list[str]:
    store = SqliteEventStore(database, read_only=True)
    try:
        return [e.input.id for e in store.read(session) if isinstance(e, InputReceived)]
    finally:
        store.close()


def _in_thread(fn: object, *args: object) -> tuple[threading.Thread, list[object]]:
    box: list[object] = []

    def go() -> None:
        try:
            box.append(fn(*args))  # type: ignore[operator]
        except BaseException as exc:  # the test looks at it
            box.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, box


def _wait_for(predicate: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _blocking(shards: ProcessShards, tmp_path: Path, session: str) -> tuple[Path, int, int]:
    """The flags folder for the ``block`` tool, ``session``'s shard and its worker's pid."""
    flags = tmp_path / "flags"
    flags.mkdir()
    index = shard_of(session, 2)
    return flags, index, shards.info()[index]["pid"]


def _started_in(flags: Path, pid: int) -> None:
    _wait_for(lambda: (flags / f"started-{pid}").exists(), "the tool to start in the worker")


def test_each_session_runs_on_its_shard_and_each_file_holds_only_its_sessions(
    shards: ProcessShards, tmp_path: Path
) -> None:
    sessions = [f"room:{i}" for i in range(8)]
    for s in sessions:
        outcome = shards.run(s, Input(id="", content="你好"))
        assert outcome.outcome == "replied"
        assert outcome.reply is not None and outcome.reply.startswith("好的")
    pids = {info["pid"] for info in shards.info()}
    assert len(pids) == 2 and os.getpid() not in pids
    shards.shutdown(timeout=10)
    for index in range(2):
        store = SqliteEventStore(tmp_path / "shards" / f"shard-{index}.db", read_only=True)
        try:
            assert set(store.sessions()) == {s for s in sessions if shard_of(s, 2) == index}
        finally:
            store.close()


def test_submit_returns_once_accepted_and_an_input_sent_again_never_runs_twice(
    shards: ProcessShards, tmp_path: Path
) -> None:
    handle = shards.submit("room:a", Input(id="x1", content="你好"))
    assert handle.input_id == "x1" and handle.where == "opened"
    first = handle.result(timeout=30)
    assert first.outcome == "replied"
    again = shards.submit("room:a", Input(id="x1", content="你好"))
    assert again.where == "handled"
    assert again.result(timeout=30) == first
    assert shards.run("room:a", Input(id="x1", content="你好")) == first
    with pytest.raises(InvalidInput, match="x1"):  # refused in the worker, same class here
        shards.run("room:a", Input(id="x1", content="另一句"))
    shards.shutdown(timeout=10)
    database = tmp_path / "shards" / f"shard-{shard_of('room:a', 2)}.db"
    assert _received(database, "room:a") == ["x1"]


def test_bad_input_is_refused_naming_what_is_wrong(shards: ProcessShards) -> None:
    with pytest.raises(InvalidInput, match="must not be empty"):
        shards.run("", Input(id="", content="x"))
    with pytest.raises(InvalidInput, match="Input, not str"):
        shards.run("room:a", "你好")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="content"):
        shards.run("room:a", Input(id="", content=5))  # type: ignore[arg-type]
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidInput, match="mentions is nested too deeply"):
        shards.run("room:a", Input(id="", content="x", mentions=deep))  # type: ignore[arg-type]
    # Nothing was accepted by those; the session still serves.
    assert shards.run("room:a", Input(id="", content="你好")).outcome == "replied"


def test_lone_surrogates_in_a_session_calls_text_are_cleaned_as_the_runtime_cleans_them(
    shards: ProcessShards, tmp_path: Path
) -> None:
    """Refused (InvalidInput: msgpack cannot hold them) where a runtime cleans them."""
    shards.set_setting("room:u", "historyLimit", 4, by="管理\ud83d员")
    assert shards.stop("room:u", platform="qq\udc00", user_id="u\ud83d") is None
    assert shards.command("room:u", "/help\ud83d", platform="qq", user_id="u1") is None
    shards.shutdown(timeout=10)
    changed = [e for e in _log(tmp_path, "room:u") if type(e).__name__ == "SettingsChanged"]
    assert [e.by for e in changed] == ["管理\ufffd员"]  # type: ignore[attr-defined]


def test_lone_surrogates_are_cleaned_as_the_runtime_cleans_them(shards: ProcessShards) -> None:
    outcome = shards.run("room:s", Input(id="s1", content="半个\ud83d表情"))
    assert outcome.outcome == "replied"


def test_the_directory_keeps_its_shard_count(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    ProcessShards(folder, shard_services.services, 2, runtime_options=OPTIONS).shutdown(10)
    assert (folder / MANIFEST).exists()
    with pytest.raises(UsageError, match="shards=2"):
        ProcessShards(folder, shard_services.services, 3)
    (folder / MANIFEST).unlink()
    with pytest.raises(UsageError, match=r"no shards\.json"):
        ProcessShards(folder, shard_services.services, 2)


@pytest.mark.parametrize("recorded", ["true", "0", "-2", "1.5", '"2"', "null"])
def test_a_manifest_whose_count_is_not_a_count_is_refused(tmp_path: Path, recorded: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / MANIFEST).write_text(f'{{"format": 1, "shards": {recorded}}}', encoding="utf-8")
    with pytest.raises(UsageError, match="is not a shard manifest"):
        ProcessShards(folder, shard_services.services, 1)


def test_a_second_process_on_the_directory_is_refused_and_the_first_serves_on(
    shards: ProcessShards, tmp_path: Path
) -> None:
    with pytest.raises(StoreInUse, match="open for writing by another process"):
        ProcessShards(tmp_path / "shards", shard_services.services, 2)
    assert shards.run("room:a", Input(id="", content="你好")).outcome == "replied"


def test_services_that_cannot_reach_a_worker_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="picklable"):
        ProcessShards(tmp_path / "a", lambda: shard_services.services(), 1)
    with pytest.raises(RuntimeError, match="no model configured"):
        ProcessShards(tmp_path / "b", shard_services.broken_services, 1)
    with pytest.raises(UsageError, match="shards must be an integer from 1 to 4,096, not 0"):
        ProcessShards(tmp_path / "c", shard_services.services, 0)
    with pytest.raises(UsageError, match="shards must be an integer from 1 to 4,096, not 10000"):
        ProcessShards(tmp_path / "c", shard_services.services, 10_000)
    for bad, match in (
        ({"max_restarts": -1}, "max_restarts must be an integer >= 0, not -1"),
        ({"max_restarts": "3"}, "max_restarts must be an integer >= 0, not '3'"),
        ({"start_timeout_s": 0}, "start_timeout_s must be a number > 0, not 0"),
    ):
        with pytest.raises(UsageError, match=match):
            ProcessShards(tmp_path / "e", shard_services.services, 1, **bad)  # type: ignore[arg-type]


def test_a_slow_call_does_not_hold_up_the_other_sessions_of_its_shard(tmp_path: Path) -> None:
    shards = ProcessShards(tmp_path / "one", shard_services.services, 1, runtime_options=OPTIONS)
    try:
        for n in range(4):  # quick calls: the worker's reading thread now runs them itself
            shards.run("room:quick", Input(id="", content=f"{n}"))
        flags = tmp_path / "flags"
        flags.mkdir()
        slow, slow_box = _in_thread(shards.run, "room:slow", Input(id="", content=f"block {flags}"))
        _wait_for(lambda: any(flags.glob("started-*")), "the blocking tool to start")
        other, other_box = _in_thread(shards.run, "room:other", Input(id="", content="你好"))
        other.join(20)
        assert other_box and getattr(other_box[0], "outcome", None) == "replied", other_box
        assert slow.is_alive()  # still in its tool
        (flags / "release").write_text("", encoding="utf-8")
        slow.join(20)
        assert slow_box and getattr(slow_box[0], "outcome", None) == "replied", slow_box
    finally:
        shards.shutdown(timeout=10)


def test_a_connection_that_fails_its_handshake_does_not_stop_the_shard_accepting(
    tmp_path: Path,
) -> None:
    shards = ProcessShards(tmp_path / "one", shard_services.services, 1, runtime_options=OPTIONS)
    try:
        address = shards._shards[0].address
        with pytest.raises(AuthenticationError):
            Client(address, family="AF_UNIX", authkey=b"not the key")
        raw = socket.socket(socket.AF_UNIX)
        raw.settimeout(20)  # the challenge comes at once while the worker accepts
        raw.connect(address)
        assert raw.recv(4096)  # the challenge: the worker waits for the answer
        raw.close()  # and finds the connection gone
        # No connection is idle yet: this call needs one accepted after those two.
        call, box = _in_thread(shards.run, "room:a", Input(id="", content="你好"))
        call.join(20)
        stuck = call.is_alive()
        if stuck:  # in the handshake, holding its shard: end the worker to shut down
            os.kill(shards.info()[0]["pid"], signal.SIGKILL)
        assert not stuck, "a new connection was not accepted"
        assert box and getattr(box[0], "outcome", None) == "replied", box
    finally:
        shards.shutdown(timeout=10)


def test_a_peer_that_never_answers_the_handshake_does_not_hold_up_new_connections(
    tmp_path: Path,
) -> None:
    shards = ProcessShards(tmp_path / "one", shard_services.services, 1, runtime_options=OPTIONS)
    silent: list[socket.socket] = []
    try:
        address = shards._shards[0].address
        for n in range(2):  # connected, and never answering the challenge
            raw = socket.socket(socket.AF_UNIX)
            raw.settimeout(20)
            raw.connect(address)
            if n == 0:
                assert raw.recv(4096)  # the worker took it first, and waits for its answer
            silent.append(raw)
        # No connection is idle yet: these calls need new ones, accepted after those.
        calls = [
            _in_thread(shards.run, f"room:{n}", Input(id="", content="你好")) for n in range(3)
        ]
        for call, _ in calls:
            call.join(20)
        stuck = any(call.is_alive() for call, _ in calls)
        if stuck:  # in the handshake, holding its shard: end the worker to shut down
            os.kill(shards.info()[0]["pid"], signal.SIGKILL)
        assert not stuck, "new connections waited for a peer that does not answer"
        assert all(getattr(box[0], "outcome", None) == "replied" for _, box in calls), calls
    finally:
        for raw in silent:
            raw.close()
        shards.shutdown(timeout=10)


def test_a_worker_that_does_not_answer_new_connections_holds_each_call_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "_HANDSHAKE_S", 1.0)
    shards = ProcessShards(tmp_path / "one", shard_services.services, 1, runtime_options=OPTIONS)
    pid = shards.info()[0]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # its accept loop too
        start = time.monotonic()
        calls = [
            _in_thread(shards.run, f"room:{n}", Input(id="", content="你好")) for n in range(3)
        ]
        for call, _ in calls:
            call.join(20)
        took = time.monotonic() - start
        stuck = any(call.is_alive() for call, _ in calls)
        os.kill(pid, signal.SIGCONT)
        assert not stuck, "a call waited on a stopped worker with no bound"
        for _, box in calls:  # each its own 1 s, side by side: not one after the other
            assert isinstance(box[0], RunError), box
            assert "did not answer a new connection within 1 s" in str(box[0]), box
        assert took < 2.5, took
        assert shards.run("room:a", Input(id="", content="你好")).outcome == "replied"
        assert shards.info()[0]["pid"] == pid  # a live worker: not started again
    finally:
        os.kill(pid, signal.SIGCONT)
        shards.shutdown(timeout=10)


def test_a_call_cut_by_an_interrupt_leaves_no_half_call_or_unread_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = ProcessShards(tmp_path / "one", shard_services.services, 1, runtime_options=OPTIONS)
    try:
        # Ctrl-C while a long call is being sent: its length went, its body did not.
        real_send = Connection._send

        def send(conn: Connection, buf: bytes, *args: object) -> None:
            if len(buf) > 100_000:
                raise KeyboardInterrupt
            real_send(conn, buf, *args)

        monkeypatch.setattr(Connection, "_send", send)
        with pytest.raises(KeyboardInterrupt) as cut:  # keeps the call's frame, and its socket
            shards.run("room:a", Input(id="big", content="x" * 200_000))
        monkeypatch.setattr(Connection, "_send", real_send)
        call, box = _in_thread(shards.run, "room:b", Input(id="", content="你好"))
        call.join(20)
        stuck = call.is_alive()
        if stuck:  # the worker's reading thread waits for the rest of the cut call
            os.kill(shards.info()[0]["pid"], signal.SIGKILL)
        assert not stuck, "the shard stopped reading calls"
        assert getattr(box[0], "outcome", None) == "replied", box
        assert cut.type is KeyboardInterrupt

        # Ctrl-C once a handle's outcome was read, before it was taken: asked again, the
        # handle has it from the worker (the input sent again under its id).
        handle = shards.submit("room:c", Input(id="c1", content="你好"))
        real_decoder = processes._answer_decoder

        class Interrupted:
            def decode(self, data: bytes) -> object:
                raise KeyboardInterrupt

        monkeypatch.setattr(processes, "_answer_decoder", Interrupted())
        with pytest.raises(KeyboardInterrupt):
            handle.result(timeout=30)
        monkeypatch.setattr(processes, "_answer_decoder", real_decoder)
        outcome = handle.result(timeout=10)
        assert outcome.input_id == "c1" and outcome.outcome == "replied"
    finally:
        shards.shutdown(timeout=10)
    assert _received(tmp_path / "one" / "shard-0.db", "room:c") == ["c1"]


def test_a_killed_worker_is_started_again_and_the_call_under_way_answered_once(
    shards: ProcessShards, tmp_path: Path
) -> None:
    session = "room:k"
    flags, index, pid = _blocking(shards, tmp_path, session)
    call, box = _in_thread(shards.run, session, Input(id="k1", content=f"block {flags}"))
    _started_in(flags, pid)
    os.kill(pid, signal.SIGKILL)
    (flags / "release").write_text("", encoding="utf-8")  # a second run of the tool would end
    call.join(60)
    assert box, "the call did not return"
    outcome = box[0]
    assert getattr(outcome, "input_id", None) == "k1", outcome
    info = shards.info()[index]
    assert info["restarts"] == 1 and info["pid"] != pid and info["alive"]
    assert session in info["recovered"]  # the cut turn was finished by the new worker
    # The tool ran once (the turn was cut in it; a cut turn's input is not run again).
    assert [p.name for p in flags.glob("started-*")] == [f"started-{pid}"]
    assert shards.run(session, Input(id="", content="你好")).outcome == "replied"
    shards.shutdown(timeout=10)
    assert _received(tmp_path / "shards" / f"shard-{index}.db", session).count("k1") == 1


def test_a_handle_whose_worker_died_is_answered_by_the_restarted_worker(
    shards: ProcessShards, tmp_path: Path
) -> None:
    session = "room:h"
    flags, index, pid = _blocking(shards, tmp_path, session)
    handle = shards.submit(session, Input(id="h1", content=f"block {flags}"))
    _started_in(flags, pid)
    os.kill(pid, signal.SIGKILL)
    (flags / "release").write_text("", encoding="utf-8")
    outcome = handle.result(timeout=60)
    assert outcome.input_id == "h1" and outcome.outcome == "aborted"
    assert shards.info()[index]["restarts"] == 1


def test_a_result_that_times_out_raises_timeout_error_and_can_be_asked_again(
    shards: ProcessShards, tmp_path: Path
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    session = "room:w"
    handle = shards.submit(session, Input(id="w1", content=f"block {flags}"))
    _wait_for(lambda: any(flags.glob("started-*")), "the tool to start in the worker")
    with pytest.raises(TimeoutError, match="'w1' has no outcome yet"):
        handle.result(timeout=0.1)
    assert not handle.done()
    (flags / "release").write_text("", encoding="utf-8")
    assert handle.result(timeout=30).outcome == "replied"
    assert shards.info()[shard_of(session, 2)]["restarts"] == 0
    shards.shutdown(timeout=10)
    database = tmp_path / "shards" / f"shard-{shard_of(session, 2)}.db"
    assert _received(database, session) == ["w1"]
    assert len(list(flags.glob("started-*"))) == 1  # the tool ran once


def test_done_and_a_result_with_a_timeout_do_not_wait_for_another_threads_result(
    shards: ProcessShards, tmp_path: Path
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    handle = shards.submit("room:w", Input(id="w1", content=f"block {flags}"))
    waiting, waiting_box = _in_thread(handle.result)
    _wait_for(handle._lock.locked, "result() to wait on its thread")
    done, done_box = _in_thread(handle.done)
    timed, timed_box = _in_thread(handle.result, 0.1)
    done.join(10)
    timed.join(10)
    stuck = done.is_alive() or timed.is_alive()
    (flags / "release").write_text("", encoding="utf-8")
    assert not stuck, "done() or result(timeout=0.1) waited for the other result()"
    assert done_box == [False]
    assert len(timed_box) == 1 and isinstance(timed_box[0], TimeoutError), timed_box
    waiting.join(30)
    assert getattr(waiting_box[0], "outcome", None) == "replied", waiting_box
    assert handle.done() and handle.result(timeout=0) == waiting_box[0]


def test_a_result_timeout_holds_when_the_worker_died_and_the_input_runs_again(
    shards: ProcessShards, tmp_path: Path
) -> None:
    session = "room:t"
    flags, index, pid = _blocking(shards, tmp_path, session)
    first = shards.submit(session, Input(id="t1", content=f"block {flags}"))
    _started_in(flags, pid)
    queued = shards.submit(session, Input(id="t2", content=f"block {flags}"))
    assert queued.where == "pending"  # behind t1's turn
    os.kill(pid, signal.SIGKILL)
    # The restarted worker cuts t1 and runs t2, whose tool waits for the release.
    timed, box = _in_thread(queued.result, 1)
    timed.join(15)
    stuck = timed.is_alive()
    (flags / "release").write_text("", encoding="utf-8")
    assert not stuck, "result(timeout=1) waited for the turn run again"
    assert len(box) == 1 and isinstance(box[0], TimeoutError), box
    assert queued.result(timeout=30).outcome == "replied"
    assert first.result(timeout=30).outcome == "aborted"
    shards.shutdown(timeout=10)
    assert _received(tmp_path / "shards" / f"shard-{index}.db", session) == ["t1", "t2"]


def test_a_worker_killed_while_it_is_started_again_is_started_once_more(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    services = functools.partial(shard_services.gated_services, str(gate))
    shards = ProcessShards(tmp_path / "g", services, 1, runtime_options=OPTIONS)
    try:
        pid = shards.info()[0]["pid"]
        (gate / "hold").write_text("", encoding="utf-8")
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not shards.info()[0]["alive"], "the worker to die")
        call, box = _in_thread(shards.run, "room:a", Input(id="g1", content="你好"))
        _wait_for(lambda: any(gate.glob("starting-*")), "the worker to start again")
        starting = next(gate.glob("starting-*"))
        os.kill(int(starting.name.split("-")[1]), signal.SIGKILL)  # killed as it starts
        starting.unlink()
        (gate / "hold").unlink()
        call.join(60)
        assert box and getattr(box[0], "outcome", None) == "replied", box
        info = shards.info()[0]
        assert info["restarts"] == 2 and info["down"] is None
    finally:
        shards.shutdown(timeout=10)


def test_a_worker_that_does_not_start_in_time_is_started_again_by_a_later_call(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    services = functools.partial(shard_services.slow_once_services, str(gate))
    shards = ProcessShards(
        tmp_path / "t", services, 1, runtime_options=OPTIONS, start_timeout_s=5, max_restarts=2
    )
    try:
        pid = shards.info()[0]["pid"]
        (gate / "slow").write_text("", encoding="utf-8")
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not shards.info()[0]["alive"], "the worker to die")
        with pytest.raises(ShardUnavailable) as caught:
            shards.run("room:a", Input(id="t1", content="你好"))
        message = str(caught.value)
        assert "did not start within 5 s (start_timeout_s)" in message, message
        assert "building its services" in message and "a later call" in message, message
        assert not caught.value.maybe_accepted and not (gate / "slow").exists()
        assert shards.info()[0]["down"] is None
        # The slow start counted as a death: two deaths so far, within max_restarts.
        assert shards.run("room:a", Input(id="t1", content="你好")).outcome == "replied"
        info = shards.info()[0]
        assert info["alive"] and info["down"] is None and info["restarts"] == 2
    finally:
        shards.shutdown(timeout=10)


def test_a_restart_whose_services_raise_fails_that_call_and_a_later_one_starts_it(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    services = functools.partial(shard_services.fails_once_services, str(gate))
    shards = ProcessShards(tmp_path / "f", services, 1, runtime_options=OPTIONS, max_restarts=2)
    try:
        pid = shards.info()[0]["pid"]
        (gate / "fail").write_text("", encoding="utf-8")
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not shards.info()[0]["alive"], "the worker to die")
        with pytest.raises(ShardUnavailable) as caught:
            shards.run("room:a", Input(id="f1", content="你好"))
        message = str(caught.value)
        assert "ConnectionError: the configuration service did not answer" in message, message
        assert "a later call starts it again" in message, message
        assert not caught.value.maybe_accepted and shards.info()[0]["down"] is None
        assert shards.run("room:a", Input(id="f1", content="你好")).outcome == "replied"
        assert shards.info()[0]["restarts"] == 2  # the kill, then the failed start
    finally:
        shards.shutdown(timeout=10)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"max_live_sesions": 3}, "'max_live_sesions' is not an argument of Runtime (it takes"),
        ({"store": None}, "'store' is the shard's own"),
        ([("idle_s", 1)], "runtime_options must be a dict, not list"),
    ],
)
def test_runtime_options_are_checked_before_any_worker_starts(
    tmp_path: Path, options: object, said: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(said)):
        ProcessShards(tmp_path / "o", shard_services.services, 1, runtime_options=options)  # type: ignore[arg-type]
    assert not (tmp_path / "o").exists()  # refused before the directory was made


def test_a_shard_that_keeps_dying_is_given_up_naming_it(tmp_path: Path) -> None:
    shards = ProcessShards(
        tmp_path / "d", shard_services.services, 1, runtime_options=OPTIONS, max_restarts=1
    )
    try:
        for _ in range(2):
            pid = shards.info()[0]["pid"]
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda pid=pid: not shards.info()[0]["alive"], "the worker to die")
            if shards.info()[0]["restarts"] == 0:
                assert shards.run("room:a", Input(id="", content="你好")).outcome == "replied"
        with pytest.raises(ShardUnavailable, match="shard 0 is down") as caught:
            shards.run("room:a", Input(id="d1", content="你好"))
        assert caught.value.input_id == "d1" and not caught.value.maybe_accepted
        with pytest.raises(RunError, match=r"^shard 0 is down") as down:  # not about an input
            shards.wait_idle(5)
        assert not isinstance(down.value, ShardUnavailable)
        with pytest.raises(RunError, match=r"^session 'room:a': its shard 0 is down"):
            shards.stop("room:a")
    finally:
        shards.shutdown(timeout=10)


def test_async_calls(shards: ProcessShards) -> None:
    async def go() -> tuple[str, str]:
        first = await shards.arun("room:x", Input(id="", content="你好"))
        handle = await shards.asubmit("room:y", Input(id="", content="你好"))
        second = await handle
        return first.outcome, second.outcome

    assert asyncio.run(go()) == ("replied", "replied")


def test_calls_after_shutdown_are_refused(tmp_path: Path) -> None:
    shards = ProcessShards(tmp_path / "s", shard_services.services, 1, runtime_options=OPTIONS)
    pid = shards.info()[0]["pid"]
    shards.shutdown(timeout=10)
    assert not shards.info()[0]["alive"]
    with pytest.raises(RuntimeClosed):
        shards.run("room:a", Input(id="", content="你好"))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


_PARENT = """
import sys, time
from aalis_agent.scale.processes import ProcessShards
from tests import shard_services
if __name__ == "__main__":
    shards = ProcessShards(sys.argv[1], shard_services.services, 2)
    print(shards._sockets, *(i["pid"] for i in shards.info()), flush=True)
    time.sleep(120)
"""


_PACKAGE_PARENT = str(Path(aalis_agent.__file__).parent.parent)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie not reaped yet
    except FileNotFoundError:
        return True


def test_workers_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT, encoding="utf-8")
    with subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "shards")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # The package this process imports (not another checkout's), and tests.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([_PACKAGE_PARENT, str(ROOT)])},
    ) as parent:
        try:
            assert parent.stdout is not None
            sockets, *pids = parent.stdout.readline().split()
            assert len(pids) == 2 and not any(_gone(int(p)) for p in pids)
            assert os.path.isdir(sockets)
            parent.kill()
            parent.wait(10)
            _wait_for(lambda: all(_gone(int(p)) for p in pids), "the workers to end", timeout=30)
            assert not os.path.exists(sockets)  # the last worker out removed it
        finally:
            parent.kill()
    # They shut down cleanly: a new parent opens the directory at once.
    ProcessShards(tmp_path / "shards", shard_services.services, 2).shutdown(10)


_UNGUARDED = """
from aalis_agent.scale.processes import ProcessShards
from tests import shard_services
ProcessShards(__import__("sys").argv[1], shard_services.services, 1)
"""


def test_a_script_without_the_main_guard_is_told_why_its_worker_did_not_start(
    tmp_path: Path,
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "shards")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([_PACKAGE_PARENT, str(ROOT)])},
        timeout=120,
    )
    assert done.returncode == 1
    assert "shard 0" in done.stderr and "did not start: it exited with status 1" in done.stderr
    assert "under if __name__ == '__main__':" in done.stderr


def _log(tmp_path: Path, session: str) -> list[object]:
    store = SqliteEventStore(
        tmp_path / "shards" / f"shard-{shard_of(session, 2)}.db", read_only=True
    )
    try:
        return list(store.read(session))
    finally:
        store.close()


def test_session_methods_run_on_the_sessions_shard(shards: ProcessShards, tmp_path: Path) -> None:
    session = "room:m"
    help_text = shards.command(session, "/help", platform="qq", user_id="u1")
    assert isinstance(help_text, str) and "/stop" in help_text
    assert shards.command(session, "你好", platform="qq", user_id="u1") is None
    shards.set_setting(session, "historyLimit", 5, by="u1")
    with pytest.raises(ConfigError, match="historyLimit"):  # the worker's, same class here
        shards.set_setting(session, "historyLimit", "lots")
    assert shards.run(session, Input(id="", content="你好")).outcome == "replied"
    shards.clear(session)
    assert shards.delete(session) == 1  # the new generation
    assert shards.run(session, Input(id="", content="你好")).outcome == "replied"
    flags, _, pid = _blocking(shards, tmp_path, session)
    call, box = _in_thread(shards.run, session, Input(id="s1", content=f"block {flags}"))
    _started_in(flags, pid)
    assert shards.stop(session, platform="qq", user_id="u1") == box_turn(tmp_path, session)
    (flags / "release").write_text("", encoding="utf-8")
    call.join(30)
    assert getattr(box[0], "outcome", None) == "aborted", box
    with pytest.raises(InvalidInput, match="set_setting: an argument cannot be sent"):
        shards.set_setting(session, "historyLimit", object())
    shards.shutdown(timeout=10)
    kinds = [type(e).__name__ for e in _log(tmp_path, session)]
    for name in ("SettingsChanged", "ContextCleared", "SessionDeleted", "StopRequested"):
        assert name in kinds, name


def test_clear_refuses_kinds_that_are_not_a_tuple_as_the_runtime_does(
    shards: ProcessShards, tmp_path: Path
) -> None:
    session = "room:k"
    assert shards.run(session, Input(id="", content="你好")).outcome == "replied"
    # A bare string would be read letter by letter: refused, as Runtime.clear refuses it.
    with pytest.raises(InvalidInput, match="kinds must be a tuple of names"):
        shards.clear(session, "context")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="kinds must be a tuple of names"):
        shards.clear(session, None)  # type: ignore[arg-type]
    shards.clear(session, ["history"])  # type: ignore[arg-type]  # a list, as the runtime takes
    shards.shutdown(timeout=10)
    cleared = [e for e in _log(tmp_path, session) if type(e).__name__ == "ContextCleared"]
    assert [tuple(e.kinds) for e in cleared] == [("history",)]  # type: ignore[attr-defined]


def box_turn(tmp_path: Path, session: str) -> str:
    """The id of the session's last opened turn, read from its log."""
    opened = [e for e in _log(tmp_path, session) if type(e).__name__ == "TurnOpened"]
    return opened[-1].turn_id  # type: ignore[attr-defined, no-any-return]


def test_a_session_method_whose_worker_dies_is_not_sent_again(
    shards: ProcessShards, tmp_path: Path
) -> None:
    session = "room:d"
    flags, index, pid = _blocking(shards, tmp_path, session)
    call, box = _in_thread(shards.run, session, Input(id="d1", content=f"block {flags}"))
    _started_in(flags, pid)
    # The deletion waits for the turn, whose tool ignores the stop: the worker dies then.
    deleting, deleted = _in_thread(shards.delete, session)
    _wait_for(
        lambda: any(type(e).__name__ == "StopRequested" for e in _log(tmp_path, session)),
        "the deletion to begin in the log",
    )
    os.kill(pid, signal.SIGKILL)
    (flags / "release").write_text("", encoding="utf-8")
    deleting.join(30)
    assert deleted and isinstance(deleted[0], RunError), deleted
    assert "worker died during delete; it may or may not have taken effect" in str(deleted[0])
    call.join(30)
    assert getattr(box[0], "outcome", None) == "aborted", box
    # The restarted worker finished the deletion begun (once: one SessionDeleted).
    assert shards.info()[index]["restarts"] == 1
    assert shards.run(session, Input(id="", content="你好")).outcome == "replied"
    shards.shutdown(timeout=10)
    assert [type(e).__name__ for e in _log(tmp_path, session)].count("SessionDeleted") == 1


def test_a_call_cut_by_shutdown_says_its_input_may_have_been_accepted(tmp_path: Path) -> None:
    shards = ProcessShards(tmp_path / "shards", shard_services.services, 2, runtime_options=OPTIONS)
    session = "room:z"
    flags, _, pid = _blocking(shards, tmp_path, session)
    call, box = _in_thread(shards.run, session, Input(id="z1", content=f"block {flags}"))
    _started_in(flags, pid)
    shards.shutdown(timeout=1)  # the tool ignores the stop: the worker ends with it running
    (flags / "release").write_text("", encoding="utf-8")
    call.join(30)
    assert box and isinstance(box[0], RuntimeClosed), box
    assert "input 'z1' of session 'room:z' may have been accepted" in str(box[0])
    with pytest.raises(RuntimeClosed, match=r"^the shards are shut down$"):  # not sent: plain
        shards.run(session, Input(id="z2", content="你好"))
