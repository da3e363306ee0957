"""Running a loaded scenario through the real runtime (:func:`run_scenario`).

The model parks every call at a gate until the driver answers it from the script, and slow
tools park until the driver releases them; a turn also parks in a hook, or between two
chunks of a streamed reply, where a step is placed. After each step the driver waits until
every turn is parked again or has ended, then moves the clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.messages import InputOutcome
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import (
    EventStore,
    FixedClock,
    InMemoryEventStore,
    ModelCallStarted,
    ModelRef,
    SequentialIds,
    TurnSettings,
)
from aalis_agent.events.errors import ScenarioError, ToolError
from aalis_agent.events.open import open_store
from aalis_agent.scenarios.load import load_scenario
from aalis_agent.scenarios.result import CallRecord, InputRecord, ScenarioResult, StepRecord
from aalis_agent.scenarios.spec import (
    HOOK_POINTS,
    Point,
    ReplySpec,
    Scenario,
    StepSpec,
    ToolOutcome,
    ToolSpec,
)
from aalis_agent.services import (
    AbortSignal,
    ChatRequest,
    LogArchive,
    Services,
    SessionInfo,
    StaticAuthority,
    StaticSessions,
    StaticSettings,
    StreamChunk,
    Tool,
    ToolCallContext,
    ToolRegistry,
)
from aalis_agent.services.config import toml_value
from aalis_agent.services.llm import ThinkLevel
from aalis_agent.services.models import LlmService, Provider

PARK_LIMIT_S = 600.0
"""Safety net: a parked model call or tool gives up after this long without the driver."""


# --- the parked model and tools --------------------------------------------------------


@dataclass(eq=False)
class _ModelCall:
    session: str
    index: int
    request: ChatRequest
    abort: AbortSignal
    order: int
    state: Literal["parked", "answered", "abandoned", "cut"] = "parked"
    reply: ReplySpec | None = None
    streamed: int = 0  # text chunks the turn has received

    @property
    def parked(self) -> bool:
        return self.state == "parked" and not self.abort.aborted


@dataclass(eq=False)
class _ToolRun:
    spec: ToolSpec
    index: int
    arguments: dict[str, Any]
    ctx: ToolCallContext
    order: int
    outcome: ToolOutcome | None
    state: Literal["parked", "released", "done"] = "parked"

    @property
    def parked(self) -> bool:
        return (
            self.spec.slow
            and self.state == "parked"
            and not (self.spec.abortable and self.ctx.abort.aborted)
        )


@dataclass(eq=False)
class _Hold:
    """A turn held at a step's point inside a hook (``while agent:llm:after of call 2
    runs``) or between two chunks of a streamed reply (``after chunk 1 of call 2``).

    A hook holds until the driver releases it, stop or not (a hook does not watch the
    stop); a stream also ends when its turn is stopped, as a provider's stream is cut."""

    point: Point
    session: str
    turn_id: str | None
    order: int
    abort: AbortSignal | None = None  # a stream's: a stop ends the hold
    state: Literal["parked", "released", "cut"] = "parked"
    text: str = ""  # the chunk just streamed (stream holds)

    @property
    def parked(self) -> bool:
        return self.state == "parked" and not (self.abort is not None and self.abort.aborted)

    def describe(self) -> str:
        at = self.point
        if at.kind == "chunk":
            return f"the stream of call {at.n} of {self.session} after chunk {at.chunk}"
        rounds = f" round {at.round}" if at.round > 1 else ""
        return f"{at.hook}{rounds} of {at.unit} {at.n} of {self.session}"


class _Gate:
    """What is parked, in the order it parked, and the journal of what happened."""

    def __init__(self, targets: frozenset[Point] = frozenset()) -> None:
        self.cv = threading.Condition()
        self.closed = False
        self.calls: dict[str, list[_ModelCall]] = {}
        self.runs: dict[str, list[_ToolRun]] = {}
        self.targets = targets  # the hook and chunk points steps are placed at
        self.holds: dict[Point, _Hold] = {}
        self.hook_runs: dict[tuple[str, str, int], int] = {}  # (hook, session, n): runs
        self.current_turn: dict[str, str] = {}
        self.last_call: dict[threading.Thread, _ModelCall] = {}  # per turn thread
        self.journal: list[tuple[str, Any]] = []
        self.problems: list[str] = []
        self.opened: dict[str, int] = {}
        self.ended: dict[str, int] = {}
        self.outbound: dict[str, list[dict[str, Any]]] = {}
        self._order = 0

    def order(self) -> int:
        self._order += 1
        return self._order

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def note(self, kind: str, item: Any) -> None:
        with self.cv:
            self.journal.append((kind, item))

    def wait(self, done: Callable[[], bool]) -> bool:
        """With ``cv`` held, wait until ``done()``; False if the gate closed (or the park
        limit passed) first."""
        deadline = time.monotonic() + PARK_LIMIT_S
        while not done():
            remaining = deadline - time.monotonic()
            if self.closed or remaining <= 0:
                return False
            self.cv.wait(remaining)
        return True

    def hold(self, point: Point, session: str, abort: AbortSignal | None, text: str = "") -> bool:
        """Hold the calling turn thread at ``point`` (a step's point, the first time it
        comes) until the driver releases it; False when a stop (``abort``) or the end of
        the run ended the hold instead."""
        with self.cv:
            if point not in self.targets or point in self.holds:
                return True
            turn = self.current_turn.get(session)
            item = _Hold(point, session, turn, self.order(), abort, text=text)
            self.holds[point] = item
            self.journal.append(("hold", item))
            self.cv.notify_all()
        if abort is not None:
            abort.add_callback(self.wake)
        with self.cv:
            self.wait(lambda: not item.parked)
            if item.state == "released":
                return True
            item.state = "cut"
            if abort is not None and abort.aborted:
                self.journal.append(("cut", item))
            return False

    def on_bus(self, topic: str, payload: Any) -> None:
        sid = payload.get("sessionId", "") if isinstance(payload, Mapping) else ""
        with self.cv:
            if topic == "turn:opened":
                self.opened[sid] = self.opened.get(sid, 0) + 1
                self.current_turn[sid] = str(payload.get("turnId"))
            elif topic == "turn:ended":
                self.ended[sid] = self.ended.get(sid, 0) + 1
                self.journal.append(("ended", dict(payload)))
            elif topic == "outbound:message":
                self.outbound.setdefault(sid, []).append(dict(payload))
                self.journal.append(("out", dict(payload)))


class _Model:
    """A chat model whose every call parks until the driver answers it (or a stop)."""

    def __init__(self, gate: _Gate, spec: Mapping[str, Any]) -> None:
        self._gate = gate
        self.id: str = spec["id"]
        self.provider_id: str = spec["provider"]
        self.context_length: int = spec["context_length"]
        self.max_output_tokens: int = spec["max_output_tokens"]
        self.think_levels = tuple(ThinkLevel(id=level) for level in spec["think_levels"])
        self.default_think: str | None = spec["default_think"]

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        gate = self._gate
        sid = request.session_id or ""
        with gate.cv:
            calls = gate.calls.setdefault(sid, [])
            call = _ModelCall(sid, len(calls) + 1, request, abort, gate.order())
            calls.append(call)
            gate.last_call[threading.current_thread()] = call
            gate.journal.append(("call", call))
            gate.cv.notify_all()
        abort.add_callback(gate.wake)
        with gate.cv:
            gate.wait(lambda: call.state != "parked" or abort.aborted)
            if call.state != "answered":
                call.state = "abandoned"
                gate.journal.append(("abandoned", call))
                if abort.aborted or gate.closed:
                    return
                raise ScenarioError(f"model call {call.index} of {sid} was never answered")
        assert call.reply is not None
        for chunk in call.reply.chunks():
            yield chunk
            if not chunk.content_delta:
                continue
            # The turn has taken this chunk (the consumer asked for the next one): a step
            # placed "after chunk K of call N" happens here.
            with gate.cv:
                call.streamed += 1
                point = Point("chunk", session=sid, n=call.index, chunk=call.streamed)
            if not gate.hold(point, sid, abort, chunk.content_delta):
                with gate.cv:
                    call.state = "cut"
                return


def _hooks(gate: _Gate) -> Hooks:
    """Middleware that holds a turn inside the hooks steps are placed in, the first time
    the hook runs for the step's call (or turn, or round); other runs pass straight on.

    A hook's call is the session's next model call for ``agent:llm:before`` (it runs
    before the call is made, once per round of the insertion point), the call just
    answered on this thread for ``agent:llm:after``, and the session's last call for
    ``agent:reply:before``; a turn hook's turn is the session's latest opened turn."""
    hooks = Hooks()
    used = {p.hook for p in gate.targets if p.kind == "hook"}

    def point_of(key: str, ctx: Any) -> tuple[Point, str] | None:
        if getattr(ctx, "dry_run", False):
            return None  # a token:request snapshot, not a turn
        with gate.cv:
            if key == "agent:llm:after":
                call = gate.last_call.get(threading.current_thread())
                if call is None:
                    return None
                sid, n = call.session, call.index
            else:
                sid = str(getattr(ctx, "session_id", ""))
                made = len(gate.calls.get(sid, []))
                if HOOK_POINTS[key] == "turn":
                    n = gate.opened.get(sid, 0)
                else:
                    n = made + 1 if key == "agent:llm:before" else made
            runs = gate.hook_runs[(key, sid, n)] = gate.hook_runs.get((key, sid, n), 0) + 1
        rounds = runs if key == "agent:llm:before" else 1
        return Point("hook", session=sid, n=n, hook=key, round=rounds), sid

    def middleware(key: str) -> Callable[[Any, Callable[[], Any]], Any]:
        def hold_here(ctx: Any, proceed: Callable[[], Any]) -> Any:
            found = point_of(key, ctx)
            if found is not None:
                gate.hold(found[0], found[1], None)
            return proceed()

        return hold_here

    for key in HOOK_POINTS:
        if key in used:
            hooks.use(key, middleware(key))
    return hooks


def _llm_service(gate: _Gate, specs: tuple[Mapping[str, Any], ...]) -> LlmService:
    """The scenario's models as providers, in declaration order; the first is the default."""
    providers: dict[str, Provider] = {}
    for spec in specs:
        provider = providers.setdefault(spec["provider"], Provider(spec["provider"]))
        provider.models.append(_Model(gate, spec))
    return LlmService(providers.values())


class _Tools:
    """Tool handlers from the scenario; slow ones park until the driver releases them."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate

    def handler(self, spec: ToolSpec) -> Callable[[Mapping[str, Any], ToolCallContext], str]:
        def run(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
            gate = self._gate
            with gate.cv:
                runs = gate.runs.setdefault(spec.name, [])
                k = len(runs) + 1
                outcome = spec.outcome(k)
                state: Literal["parked", "done"] = "parked" if spec.slow else "done"
                item = _ToolRun(spec, k, dict(args), ctx, gate.order(), outcome, state)
                runs.append(item)
                gate.journal.append(("tool", item))
                if outcome is None:
                    gate.problems.append(
                        f"tool {toml_value(spec.name)}: call {k} (callId {ctx.call_id} in "
                        f"{ctx.session_id}) has no scripted result: results has "
                        f"{len(spec.results)}, and there is no result or error for later calls"
                    )
                gate.cv.notify_all()
            if spec.slow:
                if spec.abortable:
                    ctx.abort.add_callback(gate.wake)
                with gate.cv:
                    gate.wait(
                        lambda: item.state != "parked" or (spec.abortable and ctx.abort.aborted)
                    )
                    item.state = "done"
            if outcome is None:
                raise ScenarioError(f"tool {toml_value(spec.name)} call {k}: no scripted result")
            if outcome.error is not None:
                raise ToolError(outcome.error)
            return outcome.result or ""

        return run


@dataclass(frozen=True)
class _Settings:
    """Settings layers, lowest first: the plugin config, the session's scripted
    ``settings``, then what the session's log set (SCH5)."""

    base: StaticSettings
    layers: Mapping[str, Mapping[str, Any]]

    def for_turn(
        self,
        session_id: str,
        platform: str | None,
        session_layer: Mapping[str, Any],
        venue: str | None = None,
    ) -> TurnSettings:
        layer = {**self.layers.get(session_id, {}), **session_layer}
        settings = self.base.for_turn(session_id, platform, layer, venue)
        model = layer.get("model")
        if isinstance(model, ModelRef):
            settings = msgspec.structs.replace(settings, model=model)
        return settings


# --- the driver ------------------------------------------------------------------------


class _Driver:
    """Runs one scenario: fires steps at their points, answers calls, releases tools."""

    def __init__(self, sc: Scenario, store: EventStore, timeout_s: float) -> None:
        self.sc = sc
        self.store = store
        self.timeout_s = timeout_s
        self.gate = _Gate(frozenset(s.at for s in sc.steps if s.at.kind in ("hook", "chunk")))
        self.clock = FixedClock(sc.start_ms, 0)
        self.actions = 0
        self.handles: list[tuple[StepSpec, SubmitHandle]] = []
        self.records: list[StepRecord] = []
        tools = _Tools(self.gate)
        registry = ToolRegistry(
            Tool(
                t.name,
                tools.handler(t),
                description=t.description,
                parameters=t.parameters,
                groups=t.groups,
            )
            for t in sc.tools
        )
        config = sc.config
        services = Services(
            llm=_llm_service(self.gate, sc.models),
            tools=registry,
            authority=StaticAuthority(sc.owners),
            sessions=StaticSessions(
                {
                    s.id: SessionInfo(
                        s.id, s.platform, multi_party=s.multi_party, parent_id=s.parent
                    )
                    for s in sc.sessions
                }
            ),
            settings=_Settings(
                StaticSettings(
                    think=config.think,
                    max_tool_iterations=config.max_tool_iterations,
                    history_limit=config.history_limit,
                ),
                {s.id: s.settings for s in sc.sessions},
            ),
            config=config,
            archive=LogArchive() if sc.archive else None,
            tz=sc.tz,
        )
        self.runtime = Runtime(
            store,
            services,
            self.clock,
            SequentialIds(),
            hooks=_hooks(self.gate),
            janitor=False,
            ask_timeout_s=timeout_s,
        )
        for topic in ("turn:opened", "turn:ended", "outbound:message"):
            self.runtime.subscribe(topic, self.gate.on_bus)
        self.trims: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.runtime.subscribe("agent:trim", self._on_trim)

    def _on_trim(self, topic: str, payload: Any) -> None:
        key = (payload["sessionId"], payload["turnId"], payload["call"])
        self.trims[key] = {
            "budget": payload["budget"],
            "steps": payload["steps"],
            "trace": payload["trace"],
        }

    def error(self, reason: str, step: StepSpec | None = None) -> ScenarioError:
        return ScenarioError(reason, file=self.sc.file, where=step.label() if step else None)

    # --- running --------------------------------------------------------------------

    def run(self) -> ScenarioResult:
        ok = False
        try:
            self.settle("the start")
            for step in self.sc.steps:
                self.reach(step)
                self.fire(step)
            self.finish()
            inputs = self.outcomes()
            ok = True
        finally:
            if not ok:  # stopped turns leave their parked calls quietly
                for s in self.sc.sessions:
                    with contextlib.suppress(Exception):
                        self.runtime.stop(s.id)
            self.gate.close()  # parked tools return
            try:
                self.runtime.shutdown(timeout=self.timeout_s)
            except Exception:
                if ok:
                    raise
        return self.result(inputs)

    def settle(self, after: str) -> None:
        """Wait until every actor has handled its mail and every running turn is parked
        at a model call or a slow tool (or has ended)."""
        deadline = time.monotonic() + self.timeout_s
        stable = 0
        sessions = [s.id for s in self.sc.sessions]
        while True:
            for sid in sessions:
                self.runtime.view(sid)  # answered after every message before it
            threads = self.runtime.turn_threads()
            with self.gate.cv:
                live = sum(self.gate.opened.get(s, 0) - self.gate.ended.get(s, 0) for s in sessions)
                parked = (
                    len(self.parked_calls()) + len(self.parked_runs()) + len(self.parked_holds())
                )
                problems = list(self.gate.problems)
            if problems:
                raise self.error(problems[0])
            # Every opened turn parked, and no turn thread still working (one that ended
            # may still be winding down, one that opened may not have announced it yet).
            if live == parked and threads <= parked:
                stable += 1
                if stable >= 2:
                    return
                continue
            stable = 0
            if time.monotonic() > deadline:
                raise self.error(
                    f"the runtime did not settle within {self.timeout_s:g}s after {after}: "
                    f"{live} turn(s) running, {parked} parked at a model call or a slow tool"
                )
            time.sleep(0.0005)

    def parked_calls(self) -> list[_ModelCall]:
        return [c for calls in self.gate.calls.values() for c in calls if c.parked]

    def parked_runs(self) -> list[_ToolRun]:
        return [r for runs in self.gate.runs.values() for r in runs if r.parked]

    def parked_holds(self) -> list[_Hold]:
        return [h for h in self.gate.holds.values() if h.parked]

    def reply_for(self, call: _ModelCall) -> ReplySpec | None:
        replies = self.sc.replies.get(call.session, ())
        return replies[call.index - 1] if call.index <= len(replies) else None

    def advance(self, only: str | None = None) -> bool:
        """Answer the call or release the tool that parked first (of session ``only``,
        when given); False when nothing can move. Calls without a reply stay parked."""
        with self.gate.cv:
            items: list[_ModelCall | _ToolRun | _Hold] = [
                c for c in self.parked_calls() if self.reply_for(c) is not None
            ]
            items += self.parked_runs()
            items += self.parked_holds()
            items = [x for x in items if only is None or _session_of(x) == only]
            if not items:
                return False
            item = min(items, key=lambda x: x.order)
            if isinstance(item, _ModelCall):
                item.reply = self.reply_for(item)
                item.state = "answered"
                self.gate.journal.append(("answer", item))
                what = f"answering call {item.index} of {item.session}"
            elif isinstance(item, _Hold):
                item.state = "released"
                self.gate.journal.append(("resume", item))
                what = f"releasing {item.describe()}"
            else:
                item.state = "released"
                self.gate.journal.append(("release", item))
                what = f"releasing tool {item.spec.name} call {item.index}"
            self.gate.cv.notify_all()
        self.actions += 1
        self.settle(what)
        self.clock.advance(self.sc.tick_ms)
        return True

    def point_state(self, at: Point) -> Literal["reached", "passed", "pending", "missed"]:
        with self.gate.cv:
            if at.kind == "now":
                return "reached"
            if at.kind in ("hook", "chunk"):
                hold = self.gate.holds.get(at)
                if hold is not None:
                    return "reached" if hold.parked else "passed"
                return "missed" if self.missed(at) is not None else "pending"
            if at.kind == "start":
                return "reached" if self.actions == 0 else "passed"
            if at.kind == "after-turn":
                ended = self.gate.ended.get(at.session or "", 0)
                return "reached" if ended >= at.n else "pending"
            items: list[Any] = (
                self.gate.calls.get(at.session or "", [])
                if at.kind == "before-call"
                else self.gate.runs.get(at.tool or "", [])
            )
            if len(items) < at.n:
                return "pending"
            return "reached" if items[at.n - 1].parked else "passed"

    def reach(self, step: StepSpec) -> None:
        """Drive the runtime forward until the step's point, or fail clearly."""
        while True:
            state = self.point_state(step.at)
            if state == "reached":
                return
            if state == "passed":
                raise self.error(
                    "that point has already passed when the steps before it were done "
                    "(steps happen in file order)",
                    step,
                )
            if state == "missed":
                raise self.error(f"can never happen: {self.missed(step.at)}", step)
            if not self.advance():
                raise self.error(f"can never happen: {self.stuck(step.at)}", step)

    def missed(self, at: Point) -> str | None:
        """Why a hook or chunk point can no longer come although it never came (the run
        went past it), or None."""
        with self.gate.cv:
            return self._missed(at)

    def _missed(self, at: Point) -> str | None:
        sid = at.session or ""
        calls = self.gate.calls.get(sid, [])
        runs = self.gate.hook_runs.get((at.hook or "", sid, at.n), 0)
        if at.kind == "hook" and at.unit == "turn":
            if self.gate.ended.get(sid, 0) < at.n:
                return None
            return f"turn {at.n} of {sid} ended without running {at.hook}"
        if at.kind == "hook" and at.hook == "agent:llm:before":
            if len(calls) < at.n:
                return None
            return (
                f"call {at.n} of {sid} was made after {runs} round(s) of agent:llm:before "
                "(it runs again only when inputs joined in the round before)"
            )
        # agent:llm:after, agent:reply:before, a chunk: call N must come and stream whole.
        if len(calls) > at.n:
            what = at.hook if at.kind == "hook" else f"chunk {at.chunk}"
            return f"the session went on to call {at.n + 1} without {what} of call {at.n}"
        if len(calls) == at.n and calls[-1].state in ("abandoned", "cut"):
            return f"call {at.n} of {sid} was stopped before that"
        return None

    def stuck(self, at: Point) -> str:
        """Why nothing can move any more, for an error message."""
        with self.gate.cv:
            waiting = [c for c in self.parked_calls() if self.reply_for(c) is None]
            calls = len(self.gate.calls.get(at.session or "", []))
            runs = len(self.gate.runs.get(at.tool or "", []))
            ended = self.gate.ended.get(at.session or "", 0)
        if waiting:
            c = waiting[0]
            scripted = len(self.sc.replies.get(c.session, ()))
            return (
                f"call {c.index} of {c.session} waits for a reply, {_scripted(scripted, c.session)}"
            )
        if at.kind == "tool":
            return f"nothing runs any more, and tool {at.tool} ran {runs} time(s)"
        if at.kind == "after-turn":
            return f"nothing runs any more, and session {at.session} ended {ended} turn(s)"
        if at.kind == "hook" and at.unit == "turn":
            return (
                f"nothing runs any more, and {at.hook} did not run for turn {at.n} of "
                f"{at.session} (it opened {self.gate.opened.get(at.session or '', 0)} turn(s))"
            )
        if at.kind in ("hook", "chunk"):
            what = at.hook if at.kind == "hook" else f"chunk {at.chunk}"
            return (
                f"nothing runs any more, and {what} of call {at.n} of {at.session} did not "
                f"come (the session made {calls} model call(s))"
            )
        return f"nothing runs any more, and session {at.session} made {calls} model call(s)"

    def fire(self, step: StepSpec) -> None:
        sid = step.session
        rt = self.runtime
        result: dict[str, Any] = {}  # filled in below; noted first so the journal's order
        record = StepRecord(step, result)  # puts the step before what it causes
        self.records.append(record)
        self.gate.note("step", record)
        platform = step.platform or self.sc.session(sid).platform
        match step.do:
            case "say" | "inject":
                assert step.input is not None
                room = self.sc.session(sid)
                inp = msgspec.structs.replace(
                    step.input,
                    platform=step.input.platform or room.platform,
                    group_id=room.group_id,
                )
                handle = rt.submit(sid, inp)
                self.handles.append((step, handle))
                result.update(input_id=handle.input_id, where=handle.where)
            case "stop":
                result["turn_id"] = rt.stop(sid, platform=platform, user_id=step.by)
            case "stop_command":
                result["reply"] = rt.stop_command(sid, platform, step.by)
            case "stop_all":
                result["turn_id"] = rt.stop_all(sid, platform=platform, user_id=step.by)
            case "mute":
                result["turn_id"] = rt.mute(sid)
            case "delete":
                generation = self.blocking(step, lambda: rt.delete(sid, timeout=self.timeout_s))
                result["generation"] = generation
            case "clear":
                kinds = step.kinds
                self.blocking(step, lambda: rt.clear(sid, kinds, timeout=self.timeout_s))
            case "wait":
                self.clock.advance(step.ms)
                result["now_ms"] = self.clock.now_ms()
        self.settle(step.label())
        self.clock.advance(self.sc.tick_ms)

    def blocking(self, step: StepSpec, fn: Callable[[], Any]) -> Any:
        """Run a call that waits for the running turn to wind down (delete, clear), while
        driving the runtime so that a parked tool can return."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        worker = threading.Thread(target=work, name=f"scenario:{step.do}", daemon=True)
        worker.start()
        deadline = time.monotonic() + self.timeout_s
        sid = step.session
        while worker.is_alive():
            self.settle(step.label())
            with self.gate.cv:
                running = self.gate.opened.get(sid, 0) > self.gate.ended.get(sid, 0)
            # Only the session's own turn holds the call up; once it has ended the call
            # returns by itself, and moving anything else would race with it.
            if running and self.advance(only=sid):
                continue
            worker.join(max(deadline - time.monotonic(), 0))
            if worker.is_alive():
                raise self.error(f"{step.do} did not finish within {self.timeout_s:g}s", step)
        if "error" in box:
            raise self.error(f"{step.do} failed: {box['error']}", step)
        return box.get("value")

    def finish(self) -> None:
        """After the last step: answer and release everything until all is idle."""
        while self.advance():
            pass
        with self.gate.cv:
            waiting = [c for c in self.parked_calls() if self.reply_for(c) is None]
        if waiting:
            c = waiting[0]
            scripted = len(self.sc.replies.get(c.session, ()))
            raise self.error(
                f"after the last step, call {c.index} of {c.session} waits for a reply, "
                f"{_scripted(scripted, c.session)}: add a [[replies]] entry"
            )

    def outcomes(self) -> dict[str, list[InputRecord]]:
        out: dict[str, list[InputRecord]] = {s.id: [] for s in self.sc.sessions}
        deadline = time.monotonic() + self.timeout_s
        for step, handle in self.handles:
            outcome: InputOutcome | None = None
            with contextlib.suppress(TimeoutError):
                outcome = handle.result(max(deadline - time.monotonic(), 0))
            out[step.session].append(
                InputRecord(
                    step=step.index,
                    session_id=step.session,
                    input_id=handle.input_id,
                    where=handle.where,
                    turn_id=outcome.turn_id if outcome else None,
                    outcome=str(outcome.outcome) if outcome else None,
                    reason=outcome.reason if outcome else None,
                )
            )
        return out

    def result(self, inputs: dict[str, list[InputRecord]]) -> ScenarioResult:
        sc = self.sc
        logs = {s.id: self.store.read(s.id) for s in sc.sessions}
        calls: dict[str, list[CallRecord]] = {}
        warnings: list[str] = []
        for s in sc.sessions:
            started = [e for e in logs[s.id] if isinstance(e, ModelCallStarted)]
            made = self.gate.calls.get(s.id, [])
            calls[s.id] = [
                CallRecord(
                    session_id=s.id,
                    index=c.index,
                    request=c.request,
                    status=c.state,
                    reply=c.reply,
                    streamed=c.streamed if c.state == "cut" else None,
                    turn_id=started[i].turn_id if i < len(started) else None,
                    trim=self.trims.get((s.id, started[i].turn_id, started[i].index))
                    if i < len(started)
                    else None,
                )
                for i, c in enumerate(made)
            ]
            scripted = len(sc.replies.get(s.id, ()))
            if scripted > len(made):
                warnings.append(
                    f"session {s.id}: {scripted - len(made)} scripted repl"
                    f"{'y was' if scripted - len(made) == 1 else 'ies were'} never used "
                    f"({len(made)} model call(s) were made)"
                )
        for records in inputs.values():
            for r in records:
                if r.outcome is None:
                    warnings.append(f"input {r.input_id} (step {r.step}) never resolved")
        return ScenarioResult(
            scenario=sc,
            calls=calls,
            inputs=inputs,
            outbound={s.id: list(self.gate.outbound.get(s.id, [])) for s in sc.sessions},
            logs=logs,
            steps=list(self.records),
            warnings=warnings,
            journal=list(self.gate.journal),
        )


def _scripted(n: int, session: str) -> str:
    return f"but only {n} {'reply is' if n == 1 else 'replies are'} scripted for {session}"


def _session_of(item: _ModelCall | _ToolRun | _Hold) -> str:
    return item.ctx.session_id if isinstance(item, _ToolRun) else item.session


def run_scenario(
    source: str | Path | Mapping[str, Any] | Scenario,
    *,
    db: str | Path | None = None,
    timeout_s: float | None = None,
) -> ScenarioResult:
    """Run a scenario (a file, its parsed table, or a loaded :class:`Scenario`).

    The log goes to an in-memory store, or to the SQLite file ``db`` (which must not
    hold the scenario's sessions yet). ``timeout_s`` overrides the file's ``timeout_s``.
    """
    sc = source if isinstance(source, Scenario) else load_scenario(source)
    store: EventStore
    if db is None:
        store = InMemoryEventStore()
    else:
        store = open_store(str(db))
        taken = sorted(set(store.sessions()) & {s.id for s in sc.sessions})
        if taken:
            store.close()
            raise ScenarioError(
                f"{db} already holds session {toml_value(taken[0])}: use a new database file",
                file=sc.file,
            )
    try:
        result = _Driver(sc, store, timeout_s or sc.timeout_s).run()
    finally:
        if db is not None:
            store.close()
    result.db = None if db is None else str(db)
    return result
