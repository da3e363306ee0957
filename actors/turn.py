"""``TurnRunner``: one turn, on its own thread, reporting every fact back to its actor.

The runner never writes the log: it tells the session actor what happened (the actor
stays the only writer) and asks it, at each insertion point, which pending inputs join.
It checks the turn's abort signal between stream chunks and hands it to tools (SCH6).

One turn (FLOW2-FLOW15): ``agent:turn:before`` around everything; inputs archived;
system prompt, history, tools and ``agent:prompt`` contributions assembled; then per
model call: insertion point, ``agent:llm:before``, the streamed call, ``agent:llm:after``,
and either a tool batch (``agent:tool:before`` → execute → ``agent:tool:after``) or the
reply (``agent:reply:before``, with format retries), saved and sent; ``agent:turn:after``.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import pykka
import structlog
from aalis_agent.actors.hooks import (
    LlmAfter,
    LlmBefore,
    ReplyBefore,
    ToolAfter,
    ToolBefore,
    TurnAfter,
    TurnBefore,
)
from aalis_agent.actors.messages import CallEnded, InsertionPoint, Settled
from aalis_agent.actors.request import (
    add_contributions,
    base_prompt,
)
from aalis_agent.actors.scheduler import archived_input_message
from aalis_agent.actors.turn_base import (
    NotRecorded,
    OwnershipLost,
    TurnBase,
    _Call,
    deliver,
    exception_text,
    reply_limit,
)
from aalis_agent.actors.turn_reply import ReplyStep
from aalis_agent.actors.turn_tools import ToolBatch
from aalis_agent.events import (
    ChatMessage,
    Input,
    ModelCallEnded,
    ModelCallStarted,
    StoreError,
    ToolCall,
    TurnOutcome,
)
from aalis_agent.events.codec import clean_value
from aalis_agent.request.limits import (
    clean_text,
)
from aalis_agent.request.pairing import unique_call_ids
from aalis_agent.request.prompt import (
    TurnPrompt,
    assemble_at,
    instruction_block,
    is_instruction,
    render_input,
    volatile_for,
)
from aalis_agent.request.validate import provider_violations
from aalis_agent.services import (
    ChatModel,
    ChatRequest,
    OutboundMessage,
    Usage,
)
from aalis_agent.services.models import LlmService, entry_id
from aalis_agent.services.secrets import redact

__all__ = [
    "LlmAfter",
    "LlmBefore",
    "NotRecorded",
    "ReplyBefore",
    "ToolAfter",
    "ToolBefore",
    "TurnAfter",
    "TurnBase",
    "TurnBefore",
    "TurnRunner",
    "deliver",
]

log = structlog.get_logger("aalis.turn")


_running_here = threading.local()  # ``sessions``: those whose turn this thread runs


def in_a_turn() -> bool:
    """Whether this thread is running a turn (its tools, middleware and callbacks run on
    it)."""
    return bool(getattr(_running_here, "sessions", ()))


# The sessions whose turn the current context runs in: a turn's own thread, and what it
# hands work to with its context (an async tool's task, ``asyncio.to_thread``, the
# AsyncRuntime's calls), where the thread-local above does not reach.
class _TurnMark:
    """One turn in the context: its session, and whether it still runs (a task or thread
    it started with its context may outlive it)."""

    __slots__ = ("running", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.running = True


_turn_of: contextvars.ContextVar[tuple[_TurnMark, ...]] = contextvars.ContextVar(
    "aalis_turn_of", default=()
)


def in_turn_of(session_id: str) -> bool:
    """Whether this code runs within a running turn of ``session_id`` (a tool, a
    middleware, a callback of it): a call that waits for that turn to end would wait for
    itself."""
    return any(m.running and m.session_id == session_id for m in _turn_of.get())


class TurnRunner(ToolBatch, ReplyStep):
    """Drives one turn: model calls, tool batches and insertion points (FLOW1-FLOW15)."""

    def _main(self) -> None:
        sessions: list[str] | None = getattr(_running_here, "sessions", None)
        if sessions is None:
            sessions = _running_here.sessions = []
        sessions.append(self.session_id)
        self.begun = True  # see Runtime.session_failed
        mark = _TurnMark(self.session_id)
        token = _turn_of.set((*_turn_of.get(), mark))
        try:
            if self._before_acting is not None:  # a cut turn of the session still runs?
                self._before_acting(self)
            self._main_here()
        finally:
            mark.running = False
            _turn_of.reset(token)
            sessions.pop()

    def _main_here(self) -> None:
        started = self._started_ms = self.clock.now_ms()
        outcome: TurnOutcome = "error"
        reason: str | None = None
        notice: OutboundMessage | None = None
        settle = True
        interrupted: BaseException | None = None
        try:
            outcome, reason = self._run()
        except (pykka.ActorDeadError, StoreError, OwnershipLost) as exc:
            # The session's actor is gone (stopped under the turn, after a failed write,
            # or its ownership lost): nobody records the turn now, and nothing more may
            # happen in it. The log records it when the session next starts.
            settle = False
            outcome, reason = "aborted", "crash"
            if isinstance(exc, OwnershipLost):
                log.warning(
                    "turn ended before acting: its session is no longer owned here",
                    session=self.session_id,
                    turn=self.turn_id,
                )
            elif isinstance(exc, StoreError):
                log.warning(
                    "turn ended: its session stopped after a failed write",
                    session=self.session_id,
                    turn=self.turn_id,
                )
        except NotRecorded:
            # The actor refused this turn's facts: it was stopped before its reply was
            # durable, or deleted. It ends without further effects.
            outcome, reason = "aborted", self.abort.reason or "stop"
        except (KeyboardInterrupt, SystemExit) as exc:
            # Raised by code the turn ran (a tool, a middleware): passed on, once the
            # turn's end is recorded (below), as a stop's is; no notice is sent.
            interrupted = exc
            outcome = "aborted"
            reason = "interrupt" if isinstance(exc, KeyboardInterrupt) else "exit"
            raise
        except BaseException as exc:
            # Any other exception, a library's own BaseException (asyncio.CancelledError,
            # GeneratorExit) too, fails the turn: recorded with its name, the user told.
            log.exception("turn failed", session=self.session_id, turn=self.turn_id)
            outcome, reason = "error", type(exc).__name__
            if not self.abort.aborted:
                # Sent by the actor once the turn's record is durable (persist, then act).
                notice = self._outbound(
                    self.texts.turn_failed(type(exc).__name__, self.turn_id),
                    "error",
                )
        finally:
            if self.abort.aborted and outcome != "replied":
                outcome, reason = "aborted", self.abort.reason
            duration = max(self.clock.now_ms() - started, 0)
            events, self._drafts = tuple(self._drafts), []
            if settle and not self._settled:  # else it ended with its reply
                try:
                    self.actor.tell(
                        Settled(self.turn_id, outcome, reason, duration, events, notice)
                    )
                except pykka.ActorDeadError:
                    pass
                except Exception:
                    if interrupted is None:
                        raise
                    # Recording failed: the interrupt (or exit) is what goes on.
                    log.exception(
                        "recording the interrupted turn failed",
                        session=self.session_id,
                        turn=self.turn_id,
                    )
            if self._on_exit is not None:
                self._on_exit(self)

    def _run(self) -> tuple[TurnOutcome, str | None]:
        if not self.hooks.has_middleware("agent:turn:before"):
            return self._turn(self.inputs)  # nothing to run around it: no payload built
        ctx = TurnBefore(self.turn_id, self.session_id, list(self.inputs))
        result: list[tuple[TurnOutcome, str | None]] = []

        def body(c: TurnBefore) -> None:
            result.append(self._turn(c.inputs))

        ran, _ = self.hooks.run("agent:turn:before", ctx, body)
        if not ran:
            # Not run: no archive, no model call, no agent:turn:after (FLOW2).
            self.services.bus.publish(
                "outbound:stream-end", {"sessionId": self.session_id, "turnId": self.turn_id}
            )
            return "silent", "turn:before"
        return result[0]

    def _turn(self, turn_inputs: Sequence[Input]) -> tuple[TurnOutcome, str | None]:
        """The turn's body, on its inputs as ``agent:turn:before`` left them."""
        services = self.services
        settings = self.opened.settings
        now = self.clock.now_ms()
        tz = services.tz
        inputs = list(turn_inputs)
        instruction_input = inputs[0] if len(inputs) == 1 and is_instruction(inputs[0]) else None

        # SAVE1: inputs archived first, in order, entry "opened". An idle prompt is not
        # archived (INS3); a host notice is archived without its untrusted part (INS2).
        rendered: list[ChatMessage] = []
        entered = self.opened.at  # their time label: the moment they entered the turn
        first = self._first_call
        if first is not None and [m.meta.input_id for m in first.messages] == [
            i.id for i in inputs
        ]:
            # Archived in the commit that opened the turn.
            rendered = [render_input(m, now, tz) for m in first.messages]
        else:
            self._first_call = None
            for inp in inputs:
                message = archived_input_message(
                    inp, self.turn_id, "opened", self.ids.new("msg"), entered
                )
                if inp.trigger_type != "idle":
                    self._archive(message)
                rendered.append(render_input(message, now, tz))

        # FLOW3-FLOW6: system prompt, history, tools, contributions.
        prompt, self._persona, self._history = base_prompt(
            services,
            self.session_id,
            self.view.history,
            settings,
            now,
            exclude_turn=self.turn_id,
            cache=self._history_cache,
            texts=self.texts,
        )
        prompt.batch_prefix = self.opened.batch_prefix
        self._protected.update(m.id for m in rendered)
        if instruction_input is not None:
            prompt.instruction = instruction_block(instruction_input, now, tz, texts=self.texts)
            self._protected.add(prompt.instruction.id)
            if instruction_input.trigger_type == "idle":
                prompt.volatile = volatile_for(
                    now, tz, self.opened.platform, settings.multi_party, texts=self.texts
                )
        else:
            prompt.inputs = rendered
            prompt.volatile = volatile_for(
                now, tz, self.opened.platform, settings.multi_party, texts=self.texts
            )
        if self.hooks.has_contributions():  # else none to build (nor their view)
            add_contributions(
                self.hooks,
                services,
                prompt,
                session_id=self.session_id,
                user_id=self._user_id(),
                platform=self.opened.platform,
                trigger_type=self._trigger(),
                dry_run=False,
            )
        tools = services.tools.available(settings.tool_groups)
        tool_defs = [t.definition() for t in tools]

        batches = 0
        while True:
            if self.abort.aborted:
                return "aborted", self.abort.reason
            cap = settings.max_tool_iterations
            final_only = cap is not None and batches >= cap
            call = self._model_call(prompt, [] if final_only else tool_defs, final=final_only)
            if call.aborted:
                return "aborted", self.abort.reason
            if call.tool_calls and not final_only:
                batches += 1
                prompt.tail.extend(self._run_tools(call))
                if self.abort.aborted:
                    return "aborted", self.abort.reason
                continue
            return self._reply(prompt, call)

    def _take_inserts(self, prompt: TurnPrompt, started: ModelCallStarted) -> bool:
        """FLOW8, one round of the insertion point: the pending inputs join this turn and
        are archived (entry ``joined``) in one commit with the facts queued so far; when
        none is pending, the call's ``ModelCallStarted`` is committed instead. Returns
        whether any joined (their messages are appended to the prompt)."""
        events, self._drafts = tuple(self._drafts), []
        answer: tuple[list[Input], list[ChatMessage], bool] | None = self.actor.ask(
            InsertionPoint(self.turn_id, events, started)
        )
        if answer is None:
            raise NotRecorded(self.turn_id)
        joined, messages, recorded = answer
        self._call_refused = not joined and not recorded
        if not joined:
            return False
        guide = self._focus_guide(joined, messages)
        if guide is not None:
            prompt.tail.append(guide)
        now = self.clock.now_ms()
        for inp, message in zip(joined, messages, strict=True):
            prompt.tail.append(render_input(message, now, self.services.tz))
            self._protected.add(message.id)
            self.inputs.append(inp)
        return True

    def _llm_before(
        self, prompt: TurnPrompt, tool_defs: list[dict[str, Any]]
    ) -> tuple[Sequence[ChatMessage], list[dict[str, Any]]]:
        """FLOW7: assemble the request and run ``agent:llm:before`` over it; returns its
        messages and tools. With no middleware on the hook, the messages are the tuple
        the request will carry (nothing can change it) and the trim is told where its
        history is; a middleware gets them as a list of its own to change."""
        messages, at = assemble_at(prompt)
        if not self.hooks.has_middleware("agent:llm:before"):
            self._history_at = at
            return messages, list(tool_defs)
        self._history_at = None
        before = LlmBefore(
            messages=list(messages),
            tools=list(tool_defs),
            session_id=self.session_id,
            user_id=self._user_id(),
            platform=self.opened.platform,
            trigger_type=self._trigger(),
        )
        self.hooks.run("agent:llm:before", before, lambda c: c)
        return _checked_messages(before.messages, messages), _checked_tools(before.tools)

    def _call_event(
        self,
        phase: str,
        index: int,
        model: ChatModel,
        entry: str,
        status: str | None = None,
        *,
        error: str | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """Publish ``llm:call`` (services/bus_events.py: :class:`ModelCall`)."""
        payload: dict[str, Any] = {
            "phase": phase,
            "sessionId": self.session_id,
            "turnId": self.turn_id,
            "index": index,
            "model": model.id,
            "entry": entry,
        }
        if phase == "end":
            payload["status"] = status
            payload["error"] = error
            payload["outputTokens"] = output_tokens
        self.services.bus.publish("llm:call", payload)

    def _model_call(
        self,
        prompt: TurnPrompt,
        tool_defs: list[dict[str, Any]],
        *,
        retry: bool = False,
        final: bool = False,
    ) -> _Call:
        """FLOW7-FLOW12: ``agent:llm:before``; in a turn opened by human messages the
        insertion point (take, archive, assemble again, run ``agent:llm:before`` again,
        until none is pending; not for format retries); the call's start committed; trim;
        the streamed call; ``agent:llm:after``. ``final``: the call capped by
        ``maxToolIterations``, whose reply ends the turn: tool calls it returns are not run."""
        services = self.services
        settings = self.opened.settings
        messages, tools = self._llm_before(prompt, tool_defs)
        self._call_index += 1
        index = self._call_index
        info = services.sessions.info(self.session_id)
        model = self.model
        purpose = "子任务" if info.is_child else "对话"  # ACC1
        started = ModelCallStarted(
            turn_id=self.turn_id,
            index=index,
            model=entry_id(model),
            purpose=purpose,
            format_retry=retry,
        )
        call = _Call()
        first = self._first_call if index == 1 else None
        if first is not None:
            started = first.started  # recorded when the turn opened
            self._flush()  # anything reported since goes out first (nothing, as a rule)
        elif self.abort.aborted:
            call.aborted = True  # stopped before the call went out: no call
            return call
        elif self.opened.source is None and not retry:
            while self._take_inserts(prompt, started):
                messages, tools = self._llm_before(prompt, tool_defs)
            if self._call_refused:
                call.aborted = True  # a stop came first: the call was never started
                return call
        else:
            self._report(started)
            self._flush()
        if self.abort.aborted:  # stopped after the start was recorded: nothing is sent
            self.actor.tell(CallEnded(self.turn_id, index, "aborted"))
            call.aborted = True
            return call
        text: list[str] = []
        reasoning: list[str] = []
        call_ids: dict[int, str] = {}
        announced = False  # llm:call "start" published: an "end" follows
        entry = started.model or entry_id(model)
        self._still_owned()  # not sent for a session another runtime has taken
        try:
            sent = self._trim(prompt, messages, tools, index, model)
            request = ChatRequest(
                messages=tuple(sent),
                tools=tuple(tools),
                model=started.model,
                think=LlmService.think_for(model, settings.think),  # SET2
                session_id=self.session_id,
                purpose=purpose,
            )
            if services.bus.wants("llm:call"):
                announced = True
                self._call_event("start", index, model, entry)
            limit = reply_limit(model)
            received = 0  # characters of text and reasoning so far
            with self._outside(("model", started.model)):  # waited on with the gate open
                for chunk in model.chat_stream(request, self.abort):
                    if self.abort.aborted:
                        break
                    if chunk.content_delta:
                        received += len(chunk.content_delta)
                        text.append(chunk.content_delta)
                        if services.bus.wants("outbound:stream"):  # else no payload built
                            services.bus.publish(
                                "outbound:stream",
                                {
                                    "sessionId": self.session_id,
                                    "turnId": self.turn_id,
                                    "contentDelta": chunk.content_delta,
                                },
                            )
                    if chunk.reasoning_delta:
                        received += len(chunk.reasoning_delta)
                        reasoning.append(chunk.reasoning_delta)
                    progress = chunk.tool_call_progress
                    if progress is not None:
                        # FLOW10: the callId announced while the call is generated is the one
                        # it executes and is stored with.
                        # Cleaned as the stored id is (a lone surrogate cannot be stored).
                        call_id = call_ids.setdefault(progress.index, clean_text(progress.call_id))
                        if services.bus.wants("outbound:stream"):
                            services.bus.publish(
                                "outbound:stream",
                                {
                                    "sessionId": self.session_id,
                                    "turnId": self.turn_id,
                                    "toolCallProgress": {
                                        "index": progress.index,
                                        "name": progress.name,
                                        "callId": call_id,
                                        "charsAccumulated": progress.chars_accumulated,
                                    },
                                },
                            )
                    if chunk.tool_calls:
                        call.tool_calls.extend(chunk.tool_calls)
                    if chunk.cut:
                        call.cut = True
                    if received > limit:
                        # More than the model's output limit can hold: the rest is not read.
                        log.warning(
                            "model reply cut: longer than its output limit can hold",
                            session=self.session_id,
                            turn=self.turn_id,
                            chars=received,
                            limit=limit,
                        )
                        call.cut = True
                        break
                    if chunk.usage is not None:
                        if not isinstance(chunk.usage, Usage):
                            raise TypeError(
                                f"the model's usage is a {type(chunk.usage).__name__}, not a Usage"
                            )
                        call.usage = chunk.usage.sane()  # a server's nonsense dropped
        except BaseException as exc:
            # Any exception ends the call in the log: a library's own BaseException
            # (asyncio.CancelledError from a client built on asyncio) and an interrupt too.
            ended = CallEnded(self.turn_id, index, "error", 0, redact(exception_text(exc))[:200])
            try:
                self.actor.tell(ended)
            except pykka.ActorDeadError:
                if isinstance(exc, Exception):
                    raise
                # An interrupt (or exit) is what goes on; its turn ends as a crash's.
            if announced:
                error = redact(exception_text(exc, named=True))[:200]
                self._call_event("end", index, model, entry, "error", error=error)
            raise
        if self.abort.aborted:
            self.actor.tell(CallEnded(self.turn_id, index, "aborted"))
            if announced:
                self._call_event("end", index, model, entry, "aborted")
            call.aborted = True
            return call
        if announced:
            usage = call.usage
            self._call_event(
                "end",
                index,
                model,
                entry,
                "ok",
                output_tokens=usage.completion_tokens if usage is not None else None,
            )
        # Two calls of one message with one id are told apart before anything is stored,
        # so each is answered exactly once in every later request. A call's id and name
        # are cleaned as its text is (a lone surrogate cannot be stored); its arguments
        # when its tool starts.
        if call.tool_calls:
            call.tool_calls = unique_call_ids(
                [
                    ToolCall(
                        id=clean_text(call_ids.get(i, tc.id) or tc.id),
                        name=clean_text(tc.name),
                        arguments=tc.arguments,
                    )
                    for i, tc in enumerate(call.tool_calls)
                ]
            )
        # Text enters here: a surrogate pair split across chunks is joined, a lone half
        # replaced, so what is sent and saved can always be stored.
        if received > limit:  # each part kept within the limit (together at most twice)
            call.text = clean_text("".join(text)[:limit])
            call.reasoning = clean_text("".join(reasoning)[:limit]) or None
        else:
            call.text = clean_text("".join(text))
            call.reasoning = clean_text("".join(reasoning)) or None if reasoning else None
        if final:
            # Capped (maxToolIterations): its reply is the last; the tool calls the model
            # still returned are not run, so this is the final call, and inserts are over
            # once it returns (SCH2).
            call.tool_calls = []
        if call.tool_calls:
            # Its record rides in the batch that starts the first tool (one commit fewer
            # per batch); it changes nothing the scheduler decides.
            self._report(
                ModelCallEnded(turn_id=self.turn_id, index=index, tool_calls=len(call.tool_calls))
            )
        else:
            # The final call: inserts are over from now on (SCH2), so the actor hears at once.
            self.actor.tell(CallEnded(self.turn_id, index, "ok", 0))
        self._usage(prompt, sent, tools, call, model)  # FLOW11
        if not self.hooks.has_middleware("agent:llm:after"):
            return call  # no one to see a copy of the request
        after = LlmAfter(
            response={
                "content": call.text,
                "reasoning": call.reasoning,
                "toolCalls": list(call.tool_calls),
            },
            messages=list(request.messages),
        )
        self.hooks.run("agent:llm:after", after, lambda c: c)
        return call


def _checked_messages(messages: object, assembled: Sequence[ChatMessage]) -> Sequence[ChatMessage]:
    """The messages an ``agent:llm:before`` middleware left, or a clear error naming
    what is wrong with them (the turn then fails before its call is recorded or sent):
    not a list of ChatMessage, a message that would not read back (checked for those
    the runtime did not assemble itself), none at all, or a breach of the providers'
    message rules (a tool result without its call, a call without its result, ...)."""
    if not isinstance(messages, list | tuple):
        raise TypeError(f"agent:llm:before left messages is {type(messages).__name__}, not a list")
    if not messages:
        raise ValueError("agent:llm:before left no messages")
    ours = {id(m) for m in assembled}
    out: list[ChatMessage] | None = None  # a copy, once a message of its own is cleaned
    for i, m in enumerate(messages):
        if not isinstance(m, ChatMessage):
            raise TypeError(
                f"agent:llm:before left messages[{i}] is {type(m).__name__}, not a ChatMessage"
            )
        if id(m) not in ours:  # a message of the middleware's own: every field's type
            try:
                msgspec.convert(msgspec.to_builtins(m), ChatMessage)
            except (msgspec.ValidationError, TypeError) as exc:
                raise TypeError(f"agent:llm:before left messages[{i}]: {exc}") from None
            cleaned = clean_value(m)  # lone surrogates replaced, as in inputs and personas
            if cleaned != m:
                if out is None:
                    out = list(messages)
                out[i] = cleaned
    if out is not None:
        messages = out
    problems = provider_violations(messages)
    if problems:
        raise ValueError(
            "agent:llm:before left the request breaking the providers' message rules: "
            + "; ".join(problems[:5])
        )
    return messages


def _checked_tools(tools: object) -> list[dict[str, Any]]:
    """The tool definitions an ``agent:llm:before`` middleware left, or a TypeError
    naming the one that is not a definition (a dict)."""
    if not isinstance(tools, list | tuple):
        raise TypeError(f"agent:llm:before left tools is {type(tools).__name__}, not a list")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise TypeError(f"agent:llm:before left tools[{i}] is {type(t).__name__}, not a dict")
    return list(tools)
