"""``ProcessShards.subscribe``: the workers' bus events, forwarded to the parent's
subscribers (``scale/processes.py``). Real worker processes, real sockets, real SIGKILLs;
the workers' services are ``tests/shard_services.py``."""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import Input
from aalis_agent.events.errors import InvalidInput, RuntimeClosed, UsageError
from aalis_agent.scale.ownership import shard_of
from aalis_agent.scale.processes import ProcessShards
from aalis_agent.services.bus_events import TurnEnded, subscribe_typed, typed_event

from tests import shard_services

OPTIONS = {"janitor": False}


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[ProcessShards]:
    made = ProcessShards(tmp_path / "shards", shard_services.services, 2, runtime_options=OPTIONS)
    yield made
    made.shutdown(timeout=10)


def _wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _one_per_shard() -> tuple[str, str]:
    names = [f"room:{n}" for n in range(50)]
    return (
        next(s for s in names if shard_of(s, 2) == 0),
        next(s for s in names if shard_of(s, 2) == 1),
    )


class _Seen:
    """What a subscriber received, read from the test's thread."""

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


def test_events_of_sessions_on_every_shard_reach_the_parent_in_order(
    shards: ProcessShards,
) -> None:
    a, b = _one_per_shard()
    seen = _Seen()
    shards.subscribe("*", seen)
    outcomes: dict[str, list[Any]] = {a: [], b: []}
    for n in range(3):
        for session in (a, b):
            outcomes[session].append(shards.run(session, Input(id=f"{session}-{n}", content="hi")))
    for session in (a, b):
        _wait_for(lambda s=session: len(seen.of(s, "turn:ended")) == 3, f"{session}'s turns")
        turns = [o.turn_id for o in outcomes[session]]
        # Per session, in the order the worker published them: each turn opened, then
        # its reply, then ended, one turn after the other.
        trail = [
            (t, p.get("turnId"))
            for t, p, _ in seen.events
            if p.get("sessionId") == session and t in ("turn:opened", "turn:ended")
        ]
        assert trail == [(k, t) for t in turns for k in ("turn:opened", "turn:ended")]
        replies = seen.of(session, "outbound:message")
        assert [r["content"] for r in replies] == [o.reply for o in outcomes[session]]
        ended = typed_event("turn:ended", seen.of(session, "turn:ended")[0])
        assert isinstance(ended, TurnEnded) and ended.outcome == "replied"
    threads = {name for _, _, name in seen.events}
    assert len(threads) == 2, threads  # one delivering thread per shard


def test_a_topic_subscription_gets_only_its_topic_and_typed_subscribers_work(
    shards: ProcessShards,
) -> None:
    a, b = _one_per_shard()
    ended = _Seen()
    typed: list[Any] = []
    shards.subscribe("turn:ended", ended)
    subscribe_typed(shards.bus, typed.append, topics=("turn:opened",))
    shards.run(a, Input(id="", content="hi"))
    shards.run(b, Input(id="", content="hi"))
    _wait_for(lambda: len(ended.events) == 2 and len(typed) == 2, "the turns' events")
    assert {t for t, _, _ in ended.events} == {"turn:ended"}
    assert {e.session_id for e in typed} == {a, b}


def test_after_a_worker_is_killed_and_started_again_its_events_arrive_again(
    shards: ProcessShards,
) -> None:
    a, _ = _one_per_shard()
    seen = _Seen()
    shards.subscribe("turn:ended", seen)
    first = shards.run(a, Input(id="k1", content="hi"))
    _wait_for(lambda: len(seen.of(a)) == 1, "the first turn's end")
    pid = shards.info()[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: not shards.info()[0]["alive"], "the worker to die")
    second = shards.run(a, Input(id="k2", content="hi"))  # starts the worker again
    assert shards.info()[0]["pid"] != pid
    third = shards.run(a, Input(id="k3", content="hi"))
    _wait_for(lambda: len(seen.of(a)) >= 3, "the turns' ends after the restart")
    # The new worker was subscribed before the call that started it went on.
    assert [p["turnId"] for p in seen.of(a)] == [first.turn_id, second.turn_id, third.turn_id]


def test_unsubscribe_stops_delivery_and_a_subscriber_that_raises_stops_nothing(
    shards: ProcessShards,
) -> None:
    a, _ = _one_per_shard()
    gone = _Seen()
    kept = _Seen()

    def raises(topic: str, payload: Any) -> None:
        raise RuntimeError("a broken subscriber")

    shards.subscribe("turn:ended", raises)
    unsubscribe = shards.subscribe("turn:ended", gone)
    shards.subscribe("turn:ended", kept)
    shards.run(a, Input(id="", content="hi"))
    _wait_for(lambda: len(kept.events) == 1, "the first turn's end")
    assert len(gone.events) == 1
    unsubscribe()
    unsubscribe()  # a second call does nothing
    shards.run(a, Input(id="", content="hi"))
    # Both run on the shard's one delivering thread, in order: once ``kept`` has the
    # second turn's end, ``gone`` would have had it too.
    _wait_for(lambda: len(kept.events) == 2, "the second turn's end")
    assert len(gone.events) == 1


def test_a_slow_subscriber_does_not_hold_up_the_shard(shards: ProcessShards) -> None:
    a, _ = _one_per_shard()
    release = threading.Event()
    calls: list[str] = []

    def slow(topic: str, payload: Any) -> None:
        calls.append(topic)
        release.wait(60)

    shards.subscribe("*", slow)
    try:
        start = time.monotonic()
        for n in range(5):
            assert shards.run(a, Input(id="", content=f"{n}")).outcome == "replied"
        assert time.monotonic() - start < 20
        _wait_for(lambda: calls, "the subscriber to be called")
        assert len(calls) == 1  # still in its first event
    finally:
        release.set()
    _wait_for(lambda: calls.count("turn:ended") == 5, "the events held back")


def test_events_past_the_backlog_are_dropped_logged_and_counted(tmp_path: Path) -> None:
    """A subscriber held up: the worker queues ``event_backlog`` events (past what the
    socket holds), drops the next ones with a warning in its log, and says how many
    before the next event it sends: ``info()`` counts them once the parent reads again."""
    log_file = tmp_path / "worker.log"
    services = functools.partial(shard_services.logged_services, str(log_file))
    shards = ProcessShards(tmp_path / "s", services, 1, runtime_options=OPTIONS, event_backlog=5)

    def logged() -> str:
        return log_file.read_text(encoding="utf-8") if log_file.exists() else ""

    def told() -> int:
        counts = re.findall(r"events dropped for the parent dropped=(\d+)", logged())
        return sum(int(n) for n in counts)

    try:
        release = threading.Event()
        seen = _Seen()

        def slow(topic: str, payload: Any) -> None:
            seen(topic, payload)
            release.wait(60)

        shards.subscribe("*", slow)
        try:
            # The subscriber holds up its first event before the worker fills its backlog
            # (a worker's sending thread slow to run could fill it before sending any).
            shards.run("room", Input(id="first", content="hi"))
            _wait_for(lambda: len(seen.events) == 1, "the first event")
            turns = 0
            while "dropping events until they catch up backlog=5" not in logged():
                assert turns < 3_000, "no event was dropped"
                shards.run("room", Input(id=f"in-{turns}", content="hi"))
                turns += 1
            assert len(seen.events) == 1  # still in its first event
        finally:
            release.set()
        last = shards.run("room", Input(id="last", content="hi"))
        assert last.outcome == "replied"
        # Each count the worker logged reaches the parent, before the events after it.
        _wait_for(lambda: 0 < shards.info()[0]["events_dropped"] == told(), "the drops counted")
        assert len(seen.events) > 1 and shards.info()[0]["alive"]
    finally:
        shards.shutdown(timeout=10)


def test_event_backlog_is_checked(tmp_path: Path) -> None:
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(UsageError, match="event_backlog must be an integer >= 1"):
            ProcessShards(tmp_path / "s", shard_services.services, 1, event_backlog=bad)  # type: ignore[arg-type]


def test_subscribe_refuses_what_it_cannot_call(tmp_path: Path) -> None:
    shards = ProcessShards(tmp_path / "s", shard_services.services, 1, runtime_options=OPTIONS)
    try:
        with pytest.raises(InvalidInput, match="topic"):
            shards.subscribe("", print)
        with pytest.raises(InvalidInput, match="fn must be callable"):
            shards.subscribe("*", "print")  # type: ignore[arg-type]
    finally:
        shards.shutdown(timeout=10)
    with pytest.raises(RuntimeClosed):
        shards.subscribe("*", print)
    with pytest.raises(RuntimeClosed):  # its bus too: nothing would come any more
        subscribe_typed(shards.bus, print)


def test_a_subscriber_subscribing_from_its_own_callback_does_not_wait_for_itself(
    shards: ProcessShards,
) -> None:
    """A callback runs on its shard's event thread, which is also what reads the worker's
    acknowledgement of a new topic: subscribing there must not wait for it."""
    first, _ = _one_per_shard()
    later = _Seen()
    took: list[float] = []

    def on_turn(topic: str, payload: Any) -> None:
        if not took:
            t0 = time.monotonic()
            shards.subscribe("turn:ended", later)
            took.append(time.monotonic() - t0)

    shards.subscribe("turn:opened", on_turn)
    assert shards.run(first, Input(id="a", content="你好")).outcome == "replied"
    _wait_for(lambda: bool(took), "the callback to subscribe")
    assert took[0] < 2.0, took  # it waited out the acknowledgement's 5 s before
    assert shards.run(first, Input(id="b", content="你好")).outcome == "replied"
    _wait_for(lambda: any(p.get("turnId") for _, p, _ in later.events), "the later subscriber")


def test_a_callback_unsubscribing_while_another_thread_subscribes_waits_for_neither(
    tmp_path: Path,
) -> None:
    """A subscriber that ends its own subscription from its callback (a wait for one
    turn's end, say) while another thread subscribes: the other thread waits for the
    worker's acknowledgement, which the callback's thread reads once the callback
    returns; the callback must not wait for the other thread meanwhile. Both waited
    5 s: the other thread held the subscriptions' lock while it waited."""
    shards = ProcessShards(tmp_path / "s", shard_services.services, 1, runtime_options=OPTIONS)
    try:
        entered = threading.Event()
        took: dict[str, float] = {}
        box: dict[str, Any] = {}

        def once(topic: str, payload: Any) -> None:
            if "callback" in took or "unsubscribe" not in box:
                return
            entered.set()
            time.sleep(0.5)  # the other thread subscribes meanwhile
            t0 = time.monotonic()
            box["unsubscribe"]()
            took["callback"] = time.monotonic() - t0

        box["unsubscribe"] = shards.subscribe("turn:opened", once)
        assert shards.run("room", Input(id="", content="hi")).outcome == "replied"
        assert entered.wait(30)
        t0 = time.monotonic()
        shards.subscribe("turn:ended", lambda topic, payload: None)
        took["other"] = time.monotonic() - t0
        _wait_for(lambda: "callback" in took, "the callback to unsubscribe")
        assert took["callback"] < 1.0 and took["other"] < 2.0, took
    finally:
        shards.shutdown(timeout=10)


def test_callbacks_on_two_shards_subscribing_at_once_do_not_wait_for_each_other(
    shards: ProcessShards,
) -> None:
    """Each shard's callbacks run on its own thread, which reads its worker's
    acknowledgements: a callback waiting for the other shard's while that one's
    callback waits for its shard's held both for 5 s."""
    a, b = _one_per_shard()
    barrier = threading.Barrier(2, timeout=30)
    took: list[float] = []
    added: list[Any] = []

    def on_opened(topic: str, payload: Any) -> None:
        if len(added) >= 2:
            return
        barrier.wait()
        t0 = time.monotonic()
        added.append(shards.subscribe("turn:ended", lambda t, p: None))
        took.append(time.monotonic() - t0)

    shards.subscribe("turn:opened", on_opened)
    shards.run(a, Input(id="", content="hi"))
    shards.run(b, Input(id="", content="hi"))
    _wait_for(lambda: len(took) == 2, "both callbacks to subscribe")
    assert max(took) < 2.0, took


def test_unsubscribe_does_not_wait_for_a_stopped_worker(shards: ProcessShards) -> None:
    """Ending a subscription waits for no worker (the parent's bus stops calling it at
    once); a new topic waits for a worker that does not answer (SIGSTOP) 5 s at most."""
    a, _ = _one_per_shard()
    seen = _Seen()
    shards.subscribe("turn:ended", seen)
    pid = shards.info()[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        unsubscribe = shards.subscribe("turn:opened", seen)
        subscribing = time.monotonic() - t0
        t0 = time.monotonic()
        unsubscribe()
        unsubscribing = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert subscribing < 7.0 and unsubscribing < 1.0, (subscribing, unsubscribing)
    shards.run(a, Input(id="", content="hi"))  # the worker follows again
    _wait_for(lambda: len(seen.of(a, "turn:ended")) == 1, "the turn's end")


def test_a_worker_that_did_not_answer_the_subscription_is_followed_once_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped (SIGSTOP) when the first subscription is made does not answer
    it: once it runs again, its events are forwarded. They never were: the shard's
    events thread waited for the next worker the shard would start."""
    from aalis_agent.scale import processes

    monkeypatch.setattr(processes, "_HANDSHAKE_S", 1.0)  # the parent's wait, shortened
    shards = ProcessShards(tmp_path / "s", shard_services.services, 2, runtime_options=OPTIONS)
    try:
        _, b = _one_per_shard()
        pid = shards.info()[1]["pid"]
        seen = _Seen()
        os.kill(pid, signal.SIGSTOP)
        try:
            shards.subscribe("turn:ended", seen)
        finally:
            os.kill(pid, signal.SIGCONT)
        shards.run(b, Input(id="", content="hi"))
        _wait_for(lambda: len(seen.of(b)) == 1, "the stopped worker's events", timeout=15)
        assert shards.info()[1]["pid"] == pid  # the same worker
    finally:
        shards.shutdown(timeout=10)


def test_shutdown_delivers_the_events_sent_before_it_and_none_after(tmp_path: Path) -> None:
    """A slow subscriber still has events of turns that ended when ``shutdown()`` is
    called: they are delivered before it returns, and no callback runs after it. They
    were delivered for seconds after shutdown() returned."""
    shards = ProcessShards(tmp_path / "s", shard_services.services, 1, runtime_options=OPTIONS)
    calls: list[tuple[float, str]] = []

    def slow(topic: str, payload: Any) -> None:
        time.sleep(0.05)
        calls.append((time.monotonic(), topic))

    shards.subscribe("*", slow)
    for n in range(5):
        shards.run("room", Input(id=f"in-{n}", content="hi"))
    shards.shutdown(timeout=10)
    returned = time.monotonic()
    delivered = len(calls)
    time.sleep(1.0)
    assert len(calls) == delivered, f"{len(calls) - delivered} callbacks after shutdown"
    assert all(at <= returned for at, _ in calls)
    assert [t for _, t in calls].count("turn:ended") == 5


def test_an_event_msgpack_cannot_carry_is_counted_and_the_next_ones_still_come(
    tmp_path: Path,
) -> None:
    """A hook publishing a payload of its own (an object msgpack cannot carry): that
    event is not sent, and ``info()`` counts it with the dropped ones; the worker's
    later events still come. It was left out with no trace in the parent."""
    shards = ProcessShards(
        tmp_path / "s", shard_services.odd_payload_services, 1, runtime_options=OPTIONS
    )
    try:
        seen: list[tuple[str, Any]] = []
        shards.subscribe("*", lambda topic, payload: seen.append((topic, payload)))
        for n in range(3):
            shards.run("room", Input(id=f"in-{n}", content="hi"))
        _wait_for(lambda: [t for t, _ in seen].count("turn:ended") == 3, "the turns' ends")
        custom = [(t, p) for t, p in seen if t.startswith("custom:")]
        assert custom == [
            (topic, payload)
            for n in (1, 2, 3)
            for topic, payload in (("custom:set", {"n": n, "tags": ["a"]}), ("custom:ok", {"n": n}))
        ]
        assert shards.info()[0]["events_dropped"] == 3
    finally:
        shards.shutdown(timeout=10)
