"""Fault tests: the runtime persists, then acts; a failed write stops the session.

Contract checked (against a real SQLite log):

A. Nothing is sent (a reply or notice, via the gateway or ``outbound:message``), executed
   (a tool handler) or acknowledged (``submit`` returning) before the events that record
   it have committed. A turn's inputs are archived before the model is called; an input
   that joins mid-turn is archived before the call that carries it. An acknowledged input
   is never silently dropped.
B. A failed write stops the session and never half-applies: its turn has no further
   effect; every waiting handle resolves (an outcome, or a ``StoreError``); the next
   input rebuilds the session from its log; other sessions keep serving; ``shutdown``
   returns.

The sweep runs one tool turn (call 1: a tool call; an input joins while the tool runs;
call 2: the reply) once for every write the turn makes, refusing that write: ``once``
(only that write fails) and ``full`` (every write from it on fails, a full disk, until
healed). The same for a turn stopped while its tool runs. Each position is its own test
id (``write03``...); the positions are counted, at collection, on a healthy run.
Findings are reported by kind: ``A:`` (acted before persisting), ``B:`` (the failure was
not contained) and ``log:`` (the log, after recovery on a fresh runtime, lost or
half-applied something).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pykka
import pytest
from aalis_agent.events import EventStore, MessageSaved, SessionEvent
from aalis_agent.services import ToolRegistry
from structlog.testing import capture_logs

from aalis_agent import Input, Runtime, Services, SqliteEventStore, StoreError, SubmitHandle
from tests.faults import (
    AppendRecord,
    FailingStore,
    LogFacts,
    MountNotPermitted,
    Outbox,
    RecordingModel,
    RecordingTool,
    RunIds,
    Timeline,
    audit_log,
    fill_disk,
    mount_tmpfs,
    tool_then_reply,
    wait_until,
)

SID = "s"  # the session whose writes fail
OTHER = "other"  # a session that must keep serving
WAIT_S = 3.0  # the longest any one thing may take (a healthy turn takes ~0.1 s)
SHUTDOWN_S = 8.0
FALLBACK_POSITIONS = 16  # when the healthy run cannot be measured at collection


@pytest.fixture(autouse=True)
def _stop_leftover_actors() -> Iterator[None]:
    """A runtime a failing test could not shut down leaves no actor to the next test."""
    yield
    pykka.ActorRegistry.stop_all(block=True, timeout=5)


# --- one runtime with recorders ----------------------------------------------------------


@dataclass
class Rig:
    """A runtime over a (failing) SQLite store, its recorders sharing one timeline."""

    inner: SqliteEventStore
    store: FailingStore
    timeline: Timeline
    outbox: Outbox
    tool: RecordingTool
    model: RecordingModel
    runtime: Runtime

    @classmethod
    def open(
        cls,
        db: Path,
        tag: str,
        *,
        stop_mode: bool = False,
        gated: bool = True,
        via_bus: bool = False,
    ) -> Rig:
        timeline = Timeline()
        inner = SqliteEventStore(db)
        store = FailingStore(inner, timeline=timeline)
        outbox = Outbox(inner, timeline)
        tool = RecordingTool(inner, timeline, gated=gated and not stop_mode, until_abort=stop_mode)
        model = RecordingModel(tool_then_reply(tag), inner, timeline)
        services = Services(
            llm=model,
            tools=ToolRegistry([tool.tool()]),
            gateway=None if via_bus else outbox,
        )
        runtime = Runtime(
            store, services, ids=RunIds(tag), janitor=False, ask_timeout_s=WAIT_S, idle_s=3600
        )
        if via_bus:
            runtime.subscribe("outbound:message", outbox)
        return cls(inner, store, timeline, outbox, tool, model, runtime)


def shutdown_within(runtime: Runtime, seconds: float) -> bool:
    """Shut ``runtime`` down on a helper thread; False when it has not returned in time."""
    thread = threading.Thread(
        target=runtime.shutdown, kwargs={"timeout": seconds / 2}, daemon=True, name="shutdown"
    )
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def idle_within(runtime: Runtime, seconds: float, what: str) -> str | None:
    """None when no turn runs within ``seconds``; else the finding."""
    try:
        if runtime.wait_idle(seconds):
            return None
    except Exception as exc:
        return f"B: wait_idle ({what}) raised {type(exc).__name__}: {exc}"
    return f"B: a turn thread still runs {seconds}s on ({what})"


def recover_within(runtime: Runtime, seconds: float) -> list[str]:
    """``recover()``, then wait for the recovered turns; the findings."""
    try:
        runtime.recover()
    except Exception as exc:
        return [f"log: recover() raised {type(exc).__name__}: {exc}"]
    found = idle_within(runtime, seconds, "recovery")
    return [found.replace("B:", "log:", 1)] if found else []


def moment_findings(rig: Rig) -> list[str]:
    """A: what was sent, executed or given to the model before its record committed."""
    found = []
    for d in rig.outbox.delivered:
        if not d.logged_first:
            found.append(
                f"A: {d.kind} {d.content!r} of {d.turn_id} sent before its record committed"
            )
    for run in rig.tool.runs:
        if not run.logged_first:
            found.append(f"A: tool {run.call_id} ran before its ToolStarted committed")
    for call in rig.model.calls:
        for input_id in call.unarchived_inputs:
            found.append(f"A: model called with input {input_id} before its archive committed")
        for call_id in call.unsaved_results:
            found.append(f"A: model called with tool result {call_id} before it was saved")
    return found


def describe(records: list[AppendRecord]) -> str:
    return "\n  ".join(r.describe() for r in records)


# --- the scenario ----------------------------------------------------------------------


@dataclass
class Outcome:
    """What one faulty run found, and what it did."""

    findings: list[str] = field(default_factory=list)
    acked: dict[str, list[str]] = field(default_factory=lambda: {SID: [], OTHER: []})
    records: list[AppendRecord] = field(default_factory=list)
    injected: bool = False
    seen: dict[str, set[str]] = field(default_factory=dict)  # what the recorders saw


class Scenario:
    """One tool turn in session ``SID`` with a write refused, then everything after."""

    def __init__(self, db: Path, *, stop_mode: bool, fail_at: int | None, full: bool) -> None:
        self.db = db
        self.stop_mode = stop_mode
        self.full = full
        self.rig = Rig.open(db, "r1", stop_mode=stop_mode, via_bus=stop_mode)
        self.rig.store.arm(fail_at, until_healed=full)
        self.out = Outcome()
        self.closed_cleanly = False

    def submit(self, session: str, inp: Input) -> SubmitHandle | None:
        """Submit; a refused submit (StoreError) is not acknowledged. A: an acknowledged
        input's InputReceived is committed when submit returns."""
        try:
            handle = self.rig.runtime.submit(session, inp)
        except StoreError:
            return None
        except Exception as exc:
            self.out.findings.append(f"B: submit {inp.id} raised {type(exc).__name__}: {exc}")
            return None
        self.out.acked[session].append(inp.id)
        if inp.id not in LogFacts.of(self.rig.inner.read(session)).received:
            self.out.findings.append(f"A: submit {inp.id} returned before InputReceived committed")
        return handle

    def settle_handles(self, handles: list[SubmitHandle], what: str) -> None:
        """B: every waiting handle resolves (an outcome or a StoreError), none hangs."""
        deadline = time.monotonic() + WAIT_S
        for h in handles:
            try:
                h.result(max(deadline - time.monotonic(), 0.01))
            except StoreError:
                pass
            except TimeoutError:
                self.out.findings.append(f"B: handle {h.input_id} ({what}) hangs after {WAIT_S}s")
            except Exception as exc:
                self.out.findings.append(
                    f"B: handle {h.input_id} raised {type(exc).__name__} (not a StoreError): {exc}"
                )

    def expect_reply(self, session: str, input_id: str, what: str) -> None:
        handle = self.submit(session, Input(id=input_id, content="还在吗"))
        if handle is None:
            self.out.findings.append(f"B: {what}: submit {input_id} refused")
            return
        try:
            outcome = handle.result(WAIT_S)
        except TimeoutError:
            self.out.findings.append(f"B: {what}: {input_id} unanswered after {WAIT_S}s")
        except Exception as exc:
            self.out.findings.append(f"B: {what}: {input_id} raised {type(exc).__name__}: {exc}")
        else:
            if outcome.outcome != "replied":
                self.out.findings.append(f"B: {what}: {input_id} ended {outcome}")

    def run(self) -> Outcome:
        rig, out, findings = self.rig, self.out, self.out.findings
        # The turn: call 1 asks for the tool; while it runs an input joins (or a stop
        # arrives); call 2 answers.
        before = {r.actor_urn for r in pykka.ActorRegistry.get_by_class_name("SessionActor")}
        first = self.submit(SID, Input(id="in-1", content="帮我查一下"))
        handles = [first] if first else []
        actors = [  # the failing session's actor (no other session has one yet)
            r
            for r in pykka.ActorRegistry.get_by_class_name("SessionActor")
            if r.actor_urn not in before
        ]
        wait_until(lambda: rig.tool.started.is_set() or rig.store.failed.is_set(), WAIT_S)
        if not rig.tool.started.is_set():
            # Failed before the tool: a run it should not have now would not block.
            rig.tool.unblock()
        elif self.stop_mode:
            try:
                rig.runtime.stop(SID)
            except StoreError:
                pass
            except Exception as exc:
                findings.append(f"B: stop raised {type(exc).__name__}: {exc}")
        else:
            joiner = self.submit(SID, Input(id="in-2", content="顺便也查查这个"))
            handles += [joiner] if joiner else []
        rig.tool.unblock()  # later turns' tool runs return at once
        self.settle_handles(handles, "the failing turn")
        if found := idle_within(rig.runtime, WAIT_S, "after the handles resolved"):
            findings.append(found)
        failure = rig.timeline.first("append-failed")
        out.injected = failure is not None
        if failure is not None:
            for m in rig.timeline.after(failure.n, ("send", "tool", "model"), SID):
                findings.append(f"B: {m.kind} ({m.detail}) after the failed write {failure.detail}")
            if not wait_until(lambda: not any(r.is_alive() for r in actors), WAIT_S):
                findings.append("B: the session's actor still runs after the failed write")
        if self.full:
            rig.store.heal()
        # Other sessions keep serving; the next input rebuilds the failed session.
        self.expect_reply(OTHER, "o-1", "the other session")
        self.expect_reply(SID, "in-3", "the next input to the failed session")
        self.closed_cleanly = shutdown_within(rig.runtime, SHUTDOWN_S)
        if not self.closed_cleanly:
            findings.append(f"B: shutdown did not return within {SHUTDOWN_S}s")
        findings += moment_findings(rig)
        out.records = list(rig.store.records)
        facts = LogFacts.of(rig.inner.read(SID))
        inputs_of: dict[str | None, set[str]] = {}
        for input_id, turns in facts.joined.items():
            for turn in turns:
                inputs_of.setdefault(turn, set()).add(input_id)
        out.seen = {
            "model inputs": {i for c in rig.model.calls for i in c.input_ids},
            "tool turns": set().union(*(inputs_of.get(r.turn_id, ()) for r in rig.tool.runs)),
            "replied": set().union(*(inputs_of.get(d.turn_id, ()) for d in rig.outbox.delivered)),
        }
        self.recover_and_audit()
        return out

    def recover_and_audit(self) -> None:
        """A fresh runtime on the same file recovers; then the log is audited."""
        first, findings = self.rig, self.out.findings
        second = Rig.open(self.db, "r2", gated=False)
        try:
            findings += recover_within(second.runtime, WAIT_S * 2)
        finally:
            if not shutdown_within(second.runtime, SHUTDOWN_S):
                findings.append("B: shutdown of the recovering runtime did not return")
        findings += moment_findings(second)
        for session in (SID, OTHER):
            report = audit_log(
                second.inner.read(session),
                acked=self.out.acked[session],
                delivered=first.outbox.of(session) + second.outbox.of(session),
                tool_runs=[
                    r for r in first.tool.runs + second.tool.runs if r.session_id == session
                ],
                model_calls=[
                    c for c in first.model.calls + second.model.calls if c.session_id == session
                ],
            )
            for kind, items in report.items():
                findings += [f"log: {kind}: {session}: {item}" for item in items]
        findings += self.head_of_queue(second.inner.read(SID))
        second.inner.close()
        if self.closed_cleanly:  # a runtime still running keeps its store
            first.inner.close()

    def head_of_queue(self, events: list[SessionEvent]) -> list[str]:
        """An input put back by recovery runs at the head of the queue: the inputs
        acknowledged before the failure are archived before the one sent after it."""
        order = [
            e.message.meta.input_id
            for e in events
            if isinstance(e, MessageSaved) and e.message.role == "user"
        ]
        if "in-3" not in order:
            return []
        later = order.index("in-3")
        return [
            f"log: {i} archived after in-3, which arrived after the failure: not put back "
            "at the head of the queue"
            for i in ("in-1", "in-2")
            if i in self.out.acked[SID] and i in order and order.index(i) > later
        ]


def run_healthy(stop_mode: bool) -> tuple[list[AppendRecord], Outcome]:
    """The scenario with no failure: its appends (only those of the turn) and findings."""
    with tempfile.TemporaryDirectory() as tmp, capture_logs():
        scenario = Scenario(Path(tmp) / "healthy.db", stop_mode=stop_mode, fail_at=None, full=False)
        out = scenario.run()
    turn = [r for r in out.records if r.session_id == SID]
    # The turn's writes end with its record; what follows is the other inputs' turns.
    last = next((i for i, r in enumerate(turn) if "TurnRecorded" in r.kinds), len(turn) - 1)
    return turn[: last + 1], out


@functools.cache
def turn_writes(stop_mode: bool) -> int:
    try:
        return len(run_healthy(stop_mode)[0])
    except Exception:  # reported by test_a_healthy_turn_persists_before_it_acts
        return FALLBACK_POSITIONS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name, stop_mode in (("reply_write", False), ("stop_write", True)):
        if name in metafunc.fixturenames:
            n = turn_writes(stop_mode)
            metafunc.parametrize(
                name, range(1, n + 1), ids=[f"write{i:02d}" for i in range(1, n + 1)]
            )


def check(db: Path, position: int, mode: str, *, stop_mode: bool) -> None:
    scenario = Scenario(db, stop_mode=stop_mode, fail_at=position, full=mode == "full")
    out = scenario.run()
    if not out.injected:
        pytest.skip(f"the turn made fewer than {position} writes this time")
    assert not out.findings, (
        f"write {position} refused ({mode}); {len(out.findings)} findings:\n  "
        + "\n  ".join(out.findings)
        + "\nappends:\n  "
        + describe(out.records)
    )


# --- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop_mode", [False, True], ids=["reply", "stopped"])
def test_a_healthy_turn_persists_before_it_acts(stop_mode: bool) -> None:
    """With no failure: everything acted on was committed first, and the log is whole.
    Also counts the turn's writes (the sweep's positions)."""
    writes, out = run_healthy(stop_mode)
    print(f"\n{len(writes)} writes:\n  " + describe(writes))
    assert writes, "the healthy turn wrote nothing"
    assert not out.findings, "\n  ".join(["findings:", *out.findings])
    # The checks above saw what they check: inputs on model calls, tool runs, replies.
    seen = out.seen
    assert "in-1" in seen["model inputs"], seen
    assert "in-1" in seen["tool turns"], seen
    if not stop_mode:
        assert "in-2" in seen["model inputs"], seen
        assert "in-1" in seen["replied"] and "in-2" in seen["replied"], seen


@pytest.mark.parametrize("mode", ["once", "full"])
def test_a_refused_write_in_a_tool_turn_stops_the_session_cleanly(
    tmp_path: Path, reply_write: int, mode: str
) -> None:
    check(tmp_path / "faulty.db", reply_write, mode, stop_mode=False)


@pytest.mark.parametrize("mode", ["once", "full"])
def test_a_refused_write_in_a_stopped_turn_stops_the_session_cleanly(
    tmp_path: Path, stop_write: int, mode: str
) -> None:
    check(tmp_path / "faulty.db", stop_write, mode, stop_mode=True)


def test_the_failing_store_refuses_on_cue(tmp_path: Path) -> None:
    """The helper itself: the Nth append fails, nothing is written; full mode until healed."""
    from aalis_agent.events import SettingsChanged

    def event(seq: int) -> SettingsChanged:
        return SettingsChanged(session_id="x", seq=seq, at=0, key="historyLimit", value=seq)

    inner = SqliteEventStore(tmp_path / "x.db")
    store: EventStore = FailingStore(inner, fail_at=2)
    assert isinstance(store, EventStore)
    assert isinstance(store, FailingStore)
    store.append("x", [event(1)], 0)
    with pytest.raises(StoreError, match="injected write failure"):
        store.append("x", [event(2)], 1)
    assert inner.last_seq("x") == 1
    store.append("x", [event(2)], 1)
    store.arm(4, until_healed=True)
    with pytest.raises(StoreError):
        store.append("x", [event(3)], 2)
    with pytest.raises(StoreError):
        store.append("x", [event(3)], 2)
    store.heal()
    assert store.append("x", [event(3)], 2) == 3
    assert [r.result for r in store.records] == [
        "ok",
        "injected",
        "ok",
        "injected",
        "injected",
        "ok",
    ]
    assert store.appends == 6
    inner.close()


# --- a real full disk --------------------------------------------------------------------


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 6 MiB tmpfs, or a skip saying why none can be mounted."""
    with contextlib.ExitStack() as stack:
        try:
            where = stack.enter_context(mount_tmpfs("6m"))
        except MountNotPermitted as exc:
            pytest.skip(f"a small tmpfs cannot be mounted here, so no real full disk: {exc}")
        yield where


def test_a_full_disk_fails_writes_and_sessions_run_again_once_space_returns(
    small_tmpfs: Path,
) -> None:
    """On a small tmpfs: two turns wait in their tool while the disk fills; more inputs
    arrive; the tools finish; then the space is freed. Every handle resolves, no session
    acts after its failed write, sessions answer again once there is room, the runtime
    shuts down, and the log is whole after recovery on a fresh runtime."""
    db = small_tmpfs / "agent.db"
    rig = Rig.open(db, "d1", via_bus=True)
    rig.tool.unblock()
    findings: list[str] = []
    acked: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    handles: list[SubmitHandle] = []

    def submit(session: str, input_id: str) -> SubmitHandle | None:
        try:
            handle = rig.runtime.submit(session, Input(id=input_id, content="满了吗"))
        except StoreError:
            return None
        acked[session].append(input_id)
        handles.append(handle)
        return handle

    def expect_reply(session: str, input_id: str) -> None:
        handle = submit(session, input_id)
        if handle is None:
            findings.append(f"B: {session}: submit {input_id} refused after space returned")
            return
        try:
            outcome = handle.result(WAIT_S)
        except Exception as exc:
            findings.append(f"B: {session}: {input_id} {type(exc).__name__} after space returned")
        else:
            if outcome.outcome != "replied":
                findings.append(f"B: {session}: {input_id} ended {outcome} after space returned")

    try:
        warm = submit("a", "a-0")
        assert warm is not None and warm.result(WAIT_S).outcome == "replied"
        rig.tool.block_next(2)
        submit("a", "a-1")
        submit("b", "b-1")
        assert wait_until(lambda: len(rig.tool.runs) == 3, WAIT_S), "the tools did not start"
        filler = fill_disk(small_tmpfs)
        for input_id in ("a-2", "b-2", "c-1"):  # while full: refused, or accepted
            submit(input_id[0], input_id)
        rig.tool.unblock()  # the turns go on, onto a full disk
        deadline = time.monotonic() + WAIT_S
        for h in handles:
            try:
                h.result(max(deadline - time.monotonic(), 0.01))
            except StoreError:
                pass
            except TimeoutError:
                findings.append(f"B: handle {h.input_id} hangs on a full disk")
            except Exception as exc:
                findings.append(f"B: handle {h.input_id} raised {type(exc).__name__}: {exc}")
        if found := idle_within(rig.runtime, WAIT_S, "the full disk"):
            findings.append(found)
        refused = [r for r in rig.store.records if r.result == "error"]
        print(f"\nfull disk: {len(refused)} of {rig.store.appends} writes refused:")
        print("  " + describe(refused))
        assert refused, "the full disk refused no write: the test did not fill it"
        healed = rig.timeline.mark("heal", "")
        for session in ("a", "b"):
            failed = rig.timeline.first("append-error", session)
            if failed is None:
                continue
            for m in rig.timeline.after(failed.n, ("send", "tool", "model"), session):
                if m.n < healed:
                    findings.append(
                        f"B: {session}: {m.kind} after the failed write {failed.detail}"
                    )
        filler.unlink()
        for session in ("a", "b", "c"):
            expect_reply(session, f"{session}-after")
        if not shutdown_within(rig.runtime, SHUTDOWN_S):
            findings.append("B: shutdown did not return")
        findings += moment_findings(rig)
        second = Rig.open(db, "d2", gated=False)
        findings += recover_within(second.runtime, WAIT_S * 2)
        if not shutdown_within(second.runtime, SHUTDOWN_S):
            findings.append("B: shutdown of the recovering runtime did not return")
        findings += moment_findings(second)
        for session, ids in acked.items():
            report = audit_log(
                second.inner.read(session),
                acked=ids,
                delivered=rig.outbox.of(session) + second.outbox.of(session),
                tool_runs=[r for r in rig.tool.runs + second.tool.runs if r.session_id == session],
                model_calls=[
                    c for c in rig.model.calls + second.model.calls if c.session_id == session
                ],
            )
            findings += [f"log: {k}: {session}: {i}" for k, items in report.items() for i in items]
        second.inner.close()
    finally:
        rig.tool.unblock()
        pykka.ActorRegistry.stop_all(block=True, timeout=5)
        rig.inner.close()
    assert not findings, "\n  ".join([f"{len(findings)} findings:", *findings])


def test_while_writes_fail_every_submit_is_refused_with_the_sessions_failure(
    tmp_path: Path,
) -> None:
    """A session fenced by a failed write is rebuilt from its log at its next use; while
    writes still fail, that rebuild's own recovery write fails too. Each submit then gets
    the session's failure (``SessionFailed``, naming the session and the cause), never an
    error about a stopped actor; once the disk has room the session answers again."""
    from aalis_agent.events import SessionFailed
    from aalis_agent.services import ScriptedModel

    store = FailingStore(SqliteEventStore(tmp_path / "full.db"))
    runtime = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    try:
        assert runtime.run("s", Input(id="", content="暖场")).outcome == "replied"
        store.arm(store.appends + 2, until_healed=True)  # full from the next turn's 2nd write
        with pytest.raises(SessionFailed, match="'s' stopped: a write to its log failed"):
            runtime.run("s", Input(id="", content="写不下"))
        for n in range(5):
            with pytest.raises(SessionFailed, match="injected write failure"):
                runtime.submit("s", Input(id="", content=f"还是满的 {n}"))
        store.heal()
        assert runtime.run("s", Input(id="", content="有空间了")).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)


def test_a_deletion_whose_write_failed_did_not_happen(tmp_path: Path) -> None:
    """DEL2: a deletion raises the session's generation before its write; when that
    write fails, the deletion did not happen, and later inputs belong to the generation
    the log still holds (they used to be dropped as stale until the process restarted)."""
    from aalis_agent.events import SessionDeleted, SessionFailed
    from aalis_agent.services import ScriptedModel

    store = FailingStore(SqliteEventStore(tmp_path / "del.db"))
    runtime = Runtime(store, Services(llm=ScriptedModel()), janitor=False)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        store.arm(store.appends + 1)  # the deletion's write
        with pytest.raises(SessionFailed):
            runtime.delete("s", timeout=10)
        assert not any(isinstance(e, SessionDeleted) for e in store.inner.read("s"))
        for n in range(2):
            assert runtime.run("s", Input(id="", content=f"还在 {n}")).outcome == "replied"
            runtime.passivate_idle(0)
    finally:
        runtime.shutdown(timeout=10)
