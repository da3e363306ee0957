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

import contextlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pykka
import structlog
from aalis_agent.actors.hooks import Hooks
from aalis_agent.actors.messages import AppendEvents, CallEnded, InsertionPoint, Settled
from aalis_agent.actors.request import (
    TrimmedCall,
    add_contributions,
    base_prompt,
    call_usage,
    trim_call,
)
from aalis_agent.actors.scheduler import archived_input_message
from aalis_agent.events import (
    ChatMessage,
    Clock,
    IdSource,
    Input,
    MessageMeta,
    MessageSaved,
    ModelCallStarted,
    SessionEvent,
    StoreError,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnOutcome,
    TurnRecord,
    UsageRecorded,
)
from aalis_agent.projections import SessionView
from aalis_agent.projections.labels import time_label
from aalis_agent.projections.limits import (
    clean_text,
    coerce_tool_result,
    find_unloggable,
    parse_tool_arguments,
)
from aalis_agent.projections.pairing import unique_call_ids
from aalis_agent.projections.prompt import (
    TurnPrompt,
    assemble,
    instruction_block,
    is_instruction,
    render_input,
    volatile_for,
)
from aalis_agent.projections.textnorm import strip_leaked_special_tokens, truncate_to_tokens
from aalis_agent.projections.texts import ERROR_PREFIX, focus_guide
from aalis_agent.projections.tokens import (
    default_counter,
)
from aalis_agent.projections.trim import TrimResult
from aalis_agent.projections.turns import Party, input_origin
from aalis_agent.projections.usage import BudgetLog, wire
from aalis_agent.services import (
    AbortSignal,
    ChatRequest,
    OutboundMessage,
    Services,
    ToolCallContext,
)
from aalis_agent.services.llm import ChatModel, Usage
from aalis_agent.services.models import LlmService, entry_id
from aalis_agent.services.outbound import OutboundKind
from aalis_agent.services.secrets import redact
from aalis_agent.services.tools import Inbound

__all__ = [
    "LlmAfter",
    "LlmBefore",
    "NotRecorded",
    "ReplyBefore",
    "ToolAfter",
    "ToolBefore",
    "TurnAfter",
    "TurnBefore",
    "TurnRunner",
    "add_contributions",
    "base_prompt",
    "deliver",
]

log = structlog.get_logger("aalis.turn")

MAX_FORMAT_RETRIES = 2

ASYNC_TOOL = "[错误] 这个工具是异步函数（async def），这里只调用同步函数，没有执行"
"""The result a call gets whose tool handler returned an awaitable."""


# --- hook payloads (the original framework's shapes, UPSTREAM-FACTS) --------------------


class NotRecorded(Exception):
    """The session actor refused a turn's facts (the turn was stopped before its reply
    was durable, deleted, or is not running): the turn ends with no further effects."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(f"turn {turn_id}: the session no longer records this turn")
        self.turn_id = turn_id


def deliver(services: Services, message: OutboundMessage) -> None:
    """OUT1-OUT2: send through the gateway, or as an ``outbound:message`` event without
    one. Called only once the events recording the message are durable."""
    gateway = services.gateway
    if gateway is not None:
        gateway.dispatch_outbound(message)
        return
    services.bus.publish(
        "outbound:message",
        {
            "sessionId": message.session_id,
            "turnId": message.turn_id,
            "content": message.content,
            "kind": message.kind,
            "platform": message.platform,
            "hostNotice": message.host_notice,
            "replyTo": message.reply_to,
        },
    )


@dataclass
class TurnBefore:
    turn_id: str
    session_id: str
    inputs: list[Input]


@dataclass
class LlmBefore:
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    session_id: str
    user_id: str | None
    platform: str | None
    trigger_type: str | None
    dry_run: bool = False


@dataclass
class LlmAfter:
    response: dict[str, Any]
    messages: list[ChatMessage]


@dataclass
class ToolBefore:
    name: str
    args: dict[str, Any]
    tool_call_context: ToolCallContext


@dataclass
class ToolAfter:
    name: str
    result: str | None
    tool_call_context: ToolCallContext
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplyBefore:
    content: str
    session_id: str
    platform: str | None
    user_id: str | None
    trigger_type: str | None
    archive_content: str | None = None
    retry_requested: bool = False
    retry_feedback: str | None = None
    attempt: int = 0
    max_retries: int = MAX_FORMAT_RETRIES


@dataclass
class TurnAfter:
    message: list[Input]
    reply: str | None
    outcome: str
    session_id: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Call:
    """What one streamed model call returned."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    aborted: bool = False
    usage: Usage | None = None


class TurnRunner:
    """Drives one turn: model calls, tool batches and insertion points (FLOW1-FLOW15)."""

    def __init__(
        self,
        *,
        actor: pykka.ActorRef[Any],
        session_id: str,
        opened: TurnOpened,
        inputs: list[Input],
        view: SessionView,
        services: Services,
        hooks: Hooks,
        clock: Clock,
        ids: IdSource,
        abort: AbortSignal,
        on_exit: Callable[[TurnRunner], None] | None = None,
        on_archive_missed: Callable[[], None] | None = None,
        budget_log: BudgetLog | None = None,
    ) -> None:
        self.actor = actor
        self.session_id = session_id
        self.opened = opened
        self.turn_id = opened.turn_id
        self.inputs = list(inputs)
        self.view = view
        self.services = services
        self.hooks = hooks
        self.clock = clock
        self.ids = ids
        self.abort = abort
        self._on_exit = on_exit
        self._on_archive_missed = on_archive_missed
        self._addressed: list[tuple[str, str]] = []
        self._drafts: list[SessionEvent] = []
        self._call_index = 0
        self._call_refused = False  # the last insertion point refused the call's start
        self._protected: set[str] = set()  # this turn's inputs and instruction block (TRIM-N)
        self.trimmed = False
        self.last_trim: TrimResult | None = None
        self._persona: str | None = None
        self._history_ids: frozenset[str] | None = None
        self._last_call: TrimmedCall | None = None  # the last call, as trimmed
        self._active_count = 0
        self._budget_log = budget_log
        self._model: ChatModel | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"turn:{session_id}:{self.turn_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    @property
    def model(self) -> ChatModel:
        """The model of this turn, resolved once from the settings read when it opened
        (SET1, SCH5); a missing preferred model falls back with a warning (SET5)."""
        if self._model is None:
            self._model = self.services.models.resolve(self.opened.settings.model).model
        return self._model

    # --- reporting -------------------------------------------------------------------

    def _report(self, *drafts: SessionEvent) -> None:
        """Queue facts for the actor; they go out together at the next :meth:`_flush`."""
        self._drafts.extend(drafts)

    def _flush(self, *, final: bool = False) -> None:
        """Persist, then act: commit the queued facts as one batch and wait until they
        are durable, before anything that acts on them (a model call, a tool, sending).

        ``final`` marks the batch that saves the reply: the actor refuses it when a stop
        came first, and after it commits no stop applies. A refused batch (the turn was
        stopped, deleted or is no longer running) raises :class:`NotRecorded`; a failed
        write raises the store's error (the actor has stopped). Either way the turn ends
        without further effects."""
        if not self._drafts and not final:
            return
        events, self._drafts = tuple(self._drafts), []
        if not self.actor.ask(AppendEvents(self.turn_id, events, final=final)):
            raise NotRecorded(self.turn_id)

    def _archive(self, message: ChatMessage) -> None:
        """Archive through the message archive: the session log by default; when the
        archive is absent nothing is written (ARC1) and the runtime warns once."""
        if self.services.archive is None:
            if self._on_archive_missed is not None:
                self._on_archive_missed()
            return
        self._report(MessageSaved(message=message))

    def _outbound(self, content: str, kind: OutboundKind = "reply") -> OutboundMessage:
        """OUT2: a message leaving this turn, carrying its turn id (and the host notice it
        answers, if any)."""
        head = self.inputs[-1] if self.inputs else None
        notice = head.host_notice if head is not None else None
        return OutboundMessage(
            session_id=self.session_id,
            turn_id=self.turn_id,
            content=content,
            kind=kind,
            platform=self.opened.platform,
            host_notice={"kind": notice.kind, "id": notice.id} if notice else None,
            reply_to=notice.reply_to if notice else None,
        )

    # --- the turn --------------------------------------------------------------------

    def _main(self) -> None:
        started = self.clock.now_ms()
        outcome: TurnOutcome = "error"
        reason: str | None = None
        notice: OutboundMessage | None = None
        settle = True
        try:
            outcome, reason = self._run()
        except (pykka.ActorDeadError, StoreError) as exc:
            # The session's actor is gone (stopped under the turn, or after a failed
            # write): nobody records the turn now, and nothing more may happen in it.
            # The log records it when the session next starts.
            settle = False
            outcome, reason = "aborted", "crash"
            if isinstance(exc, StoreError):
                log.warning(
                    "turn ended: its session stopped after a failed write",
                    session=self.session_id,
                    turn=self.turn_id,
                )
        except NotRecorded:
            # The actor refused this turn's facts: it was stopped before its reply was
            # durable, or deleted. It ends without further effects.
            outcome, reason = "aborted", self.abort.reason or "stop"
        except Exception as exc:
            log.exception("turn failed", session=self.session_id, turn=self.turn_id)
            outcome, reason = "error", type(exc).__name__
            if not self.abort.aborted:
                # Sent by the actor once the turn's record is durable (persist, then act).
                notice = self._outbound(
                    f"{ERROR_PREFIX} 这一轮出错了（{type(exc).__name__}），turn={self.turn_id}",
                    "error",
                )
        finally:
            if self.abort.aborted and outcome != "replied":
                outcome, reason = "aborted", self.abort.reason
            duration = max(self.clock.now_ms() - started, 0)
            events, self._drafts = tuple(self._drafts), []
            if settle:
                with contextlib.suppress(pykka.ActorDeadError):
                    self.actor.tell(
                        Settled(self.turn_id, outcome, reason, duration, events, notice)
                    )
            if self._on_exit is not None:
                self._on_exit(self)

    def _run(self) -> tuple[TurnOutcome, str | None]:
        ctx = TurnBefore(self.turn_id, self.session_id, list(self.inputs))
        result: list[tuple[TurnOutcome, str | None]] = []

        def body(c: TurnBefore) -> None:
            result.append(self._turn(c))

        ran, _ = self.hooks.run("agent:turn:before", ctx, body)
        if not ran:
            # Not run: no archive, no model call, no agent:turn:after (FLOW2).
            self.services.bus.publish(
                "outbound:stream-end", {"sessionId": self.session_id, "turnId": self.turn_id}
            )
            return "silent", "turn:before"
        return result[0]

    def _trigger(self) -> str | None:
        return self.inputs[0].trigger_type if self.inputs else None

    def _origin(self, inp: Input) -> tuple[tuple[Party, ...], str | None]:
        """``originTurnOf`` of one of this turn's inputs: the derivation its
        ``InputJoined`` recorded, read over the turns before this one."""
        return input_origin(self.view.turns, inp)

    def _user_id(self) -> str | None:
        """The physical speaker of the inputs sent so far, when they all have the same
        one; a continuation counts as the speaker of the turn it came from."""
        speakers = {self._origin(i)[1] for i in self.inputs}
        return next(iter(speakers)) if len(speakers) == 1 else None

    def _turn(self, ctx: TurnBefore) -> tuple[TurnOutcome, str | None]:
        services = self.services
        settings = self.opened.settings
        now = self.clock.now_ms()
        tz = services.tz
        inputs = list(ctx.inputs)
        instruction_input = inputs[0] if len(inputs) == 1 and is_instruction(inputs[0]) else None

        # SAVE1: inputs archived first, in order, entry "opened". An idle prompt is not
        # archived (INS3); a host notice is archived without its untrusted part (INS2).
        rendered: list[ChatMessage] = []
        entered = self.opened.at  # their time label: the moment they entered the turn
        for inp in inputs:
            message = archived_input_message(
                inp, self.turn_id, "opened", self.ids.new("msg"), entered
            )
            if inp.trigger_type != "idle":
                self._archive(message)
            rendered.append(render_input(message, now, tz))

        # FLOW3-FLOW6: system prompt, history, tools, contributions.
        prompt, self._persona, self._active_count = base_prompt(
            services, self.session_id, self.view.history, settings, now, exclude_turn=self.turn_id
        )
        prompt.batch_prefix = self.opened.batch_prefix
        self._protected.update(m.id for m in rendered)
        if instruction_input is not None:
            prompt.instruction = instruction_block(instruction_input, now, tz)
            self._protected.add(prompt.instruction.id)
            if instruction_input.trigger_type == "idle":
                prompt.volatile = volatile_for(now, tz, self.opened.platform, settings.multi_party)
        else:
            prompt.inputs = rendered
            prompt.volatile = volatile_for(now, tz, self.opened.platform, settings.multi_party)
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
            call = self._model_call(prompt, [] if final_only else tool_defs)
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
        )  # type: ignore[assignment]
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

    def _llm_before(self, prompt: TurnPrompt, tool_defs: list[dict[str, Any]]) -> LlmBefore:
        """FLOW7: assemble the request and run ``agent:llm:before`` over it."""
        before = LlmBefore(
            messages=assemble(prompt),
            tools=list(tool_defs),
            session_id=self.session_id,
            user_id=self._user_id(),
            platform=self.opened.platform,
            trigger_type=self._trigger(),
        )
        self.hooks.run("agent:llm:before", before, lambda c: c)
        return before

    def _model_call(
        self, prompt: TurnPrompt, tool_defs: list[dict[str, Any]], *, retry: bool = False
    ) -> _Call:
        """FLOW7-FLOW12: ``agent:llm:before``; in a turn opened by human messages the
        insertion point (take, archive, assemble again, run ``agent:llm:before`` again,
        until none is pending; not for format retries); the call's start committed; trim;
        the streamed call; ``agent:llm:after``."""
        services = self.services
        settings = self.opened.settings
        before = self._llm_before(prompt, tool_defs)
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
        if self.abort.aborted:
            call.aborted = True  # stopped before the call went out: no call
            return call
        if self.opened.source is None and not retry:
            while self._take_inserts(prompt, started):
                before = self._llm_before(prompt, tool_defs)
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
        try:
            sent = self._trim(prompt, before.messages, before.tools, index)
            request = ChatRequest(
                messages=tuple(sent),
                tools=tuple(before.tools),
                model=started.model,
                think=LlmService.think_for(model, settings.think),  # SET2
                session_id=self.session_id,
                purpose=purpose,
            )
            for chunk in model.chat_stream(request, self.abort):
                if self.abort.aborted:
                    break
                if chunk.content_delta:
                    text.append(chunk.content_delta)
                    services.bus.publish(
                        "outbound:stream",
                        {
                            "sessionId": self.session_id,
                            "turnId": self.turn_id,
                            "contentDelta": chunk.content_delta,
                        },
                    )
                if chunk.reasoning_delta:
                    reasoning.append(chunk.reasoning_delta)
                progress = chunk.tool_call_progress
                if progress is not None:
                    # FLOW10: the callId announced while the call is generated is the one
                    # it executes and is stored with.
                    call_ids.setdefault(progress.index, progress.call_id)
                    services.bus.publish(
                        "outbound:stream",
                        {
                            "sessionId": self.session_id,
                            "turnId": self.turn_id,
                            "toolCallProgress": {
                                "index": progress.index,
                                "name": progress.name,
                                "callId": progress.call_id,
                                "charsAccumulated": progress.chars_accumulated,
                            },
                        },
                    )
                if chunk.tool_calls:
                    call.tool_calls.extend(chunk.tool_calls)
                if chunk.usage is not None:
                    call.usage = chunk.usage
        except Exception as exc:
            self.actor.tell(CallEnded(self.turn_id, index, "error", 0, redact(str(exc))[:200]))
            raise
        if self.abort.aborted:
            self.actor.tell(CallEnded(self.turn_id, index, "aborted"))
            call.aborted = True
            return call
        # Two calls of one message with one id are told apart before anything is stored,
        # so each is answered exactly once in every later request.
        call.tool_calls = unique_call_ids(
            [
                ToolCall(id=call_ids.get(i, tc.id) or tc.id, name=tc.name, arguments=tc.arguments)
                for i, tc in enumerate(call.tool_calls)
            ]
        )
        # Text enters here: a surrogate pair split across chunks is joined, a lone half
        # replaced, so what is sent and saved can always be stored.
        call.text = clean_text("".join(text))
        call.reasoning = clean_text("".join(reasoning)) or None
        self.actor.tell(CallEnded(self.turn_id, index, "ok", len(call.tool_calls)))
        self._usage(prompt, sent, before.tools, call)  # FLOW11
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

    def _usage(
        self,
        prompt: TurnPrompt,
        sent: list[ChatMessage],
        tools: list[dict[str, Any]],
        call: _Call,
    ) -> None:
        """ACC2: ``token:usage`` after a call that returned, and the budget log (ACC4)."""
        services = self.services
        assert self._last_call is not None  # every call is trimmed before it is made
        appended = sum(1 for m in prompt.tail if m.role == "tool" or m.tool_calls)
        usage = call_usage(
            self.model,
            self._last_call,
            session_id=self.session_id,
            turn_id=self.turn_id,
            platform=self.opened.platform,
            persona=self._persona,
            provider_input_tokens=call.usage.prompt_tokens if call.usage else None,
            trimmed=self.trimmed,
            history_messages=self._active_count + appended,
        )
        self._report(UsageRecorded(usage=usage))
        services.bus.publish("token:usage", wire(usage))
        if self._budget_log is not None:
            line = self._budget_log.observe(usage)
            if line is not None:
                log.info(line)

    def _trim(
        self,
        prompt: TurnPrompt,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]],
        index: int,
    ) -> list[ChatMessage]:
        """FLOW9: trim the assembled list to the budget (TRIM); keep the trace."""
        services = self.services
        if self._history_ids is None or len(self._history_ids) != len(prompt.history):
            self._history_ids = frozenset(m.id for m in prompt.history)
        trimmed = trim_call(
            services,
            self.model,
            messages,
            tools,
            self._history_ids,
            protected=frozenset(self._protected),
        )
        self._last_call = trimmed
        result, budget = trimmed.result, trimmed.budget
        self.trimmed = self.trimmed or result.trimmed
        self.last_trim = result
        if result.trace:
            before, after = len(messages), len(result.messages)
            if after < before:
                log.info(
                    "hard trim removed messages",
                    session=self.session_id,
                    before=before,
                    after=after,
                )
            services.bus.publish(
                "agent:trim",
                {
                    "sessionId": self.session_id,
                    "turnId": self.turn_id,
                    "call": index,
                    "budget": budget,
                    "steps": list(result.steps),
                    "trace": [
                        {"step": a.step, "action": a.action, "ids": list(a.ids), "saved": a.saved}
                        for a in result.trace
                    ],
                },
            )
        return result.messages

    def _reply(self, prompt: TurnPrompt, call: _Call) -> tuple[TurnOutcome, str | None]:
        """FLOW14 and saving: ``agent:reply:before`` (with format retries), then the reply
        saved with the turn record (SAVE2, SAVE5) and sent (OUT1); empty replies are not
        saved (SAVE4)."""
        content = strip_leaked_special_tokens(call.text)
        attempt = 0
        while True:
            ctx = ReplyBefore(
                content=content,
                session_id=self.session_id,
                platform=self.opened.platform,
                user_id=self._user_id(),
                trigger_type=self._trigger(),
                attempt=attempt,
            )
            self.hooks.run("agent:reply:before", ctx, lambda c: c)
            if not ctx.retry_requested or attempt >= ctx.max_retries:
                break
            attempt += 1
            # A format retry: feedback, then the model again without tools; no inserts.
            prompt.tail.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="assistant",
                    content=content,
                )
            )
            prompt.tail.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="system",
                    content=ctx.retry_feedback or "请按要求的格式重新回答。",
                )
            )
            retry = self._model_call(prompt, [], retry=True)
            if retry.aborted:
                return "aborted", self.abort.reason
            content = strip_leaked_special_tokens(retry.text)
        final = ctx.content
        outcome: TurnOutcome = "replied" if final.strip() else "silent"
        if outcome == "replied":
            stored = ctx.archive_content if ctx.archive_content is not None else final
            self._archive(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="assistant",
                    content=stored,
                    reasoning=call.reasoning,
                    meta=MessageMeta(
                        turn_id=self.turn_id,
                        visible_content=final if stored != final else None,
                        turn_record=TurnRecord(
                            turn_id=self.turn_id, outcome="replied", source=self.opened.source
                        ),
                    ),
                )
            )
            self._flush(final=True)  # refused when a stop came first (NotRecorded)
            deliver(self.services, self._outbound(final))
        after = TurnAfter(
            message=list(self.inputs),
            reply=final if outcome == "replied" else None,
            outcome=outcome,
            session_id=self.session_id,
        )
        self.hooks.run("agent:turn:after", after, lambda c: c)
        return outcome, None

    def _focus_guide(self, joined: list[Input], messages: list[ChatMessage]) -> ChatMessage | None:
        """Before addressed inserts in a multi-party room: a block listing every addressed
        insert so far (SCH2), each timed as it entered the turn. Earlier blocks stay as
        they were, so requests keep their prefix; the block is part of this turn's requests
        only, never archived."""
        if not self.opened.settings.multi_party:
            return None
        addressed = [(i, m) for i, m in zip(joined, messages, strict=True) if i.was_addressed]
        if not addressed:
            return None
        now = self.clock.now_ms()
        for inp, message in addressed:
            when = time_label(message.meta.timestamp or now, now, self.services.tz)
            self._addressed.append((when, inp.sender.user_id or "?"))
        return ChatMessage(
            id=self.ids.new("msg"), role="system", content=focus_guide(list(self._addressed))
        )

    def _tool_context(self, call_id: str) -> ToolCallContext:
        """TCX1: from the inputs already sent to the model; the owner's identities are one
        participant; ``userId`` only when every input has the same physical speaker."""
        authority = self.services.authority
        participants: list[str] = []
        owner_seen = False
        for inp in self.inputs:
            for platform, who in self._origin(inp)[0]:
                if authority.is_owner(platform, who):
                    if owner_seen:
                        continue  # the owner's identities are one participant
                    owner_seen = True
                if who not in participants:
                    participants.append(who)
        last = self.inputs[-1] if self.inputs else None
        return ToolCallContext(
            session_id=self.session_id,
            turn_id=self.turn_id,
            call_id=call_id,
            abort=self.abort,
            platform=self.opened.platform,
            participants=tuple(participants),
            inbound=Inbound(
                source=self.opened.source,
                from_turn=last.from_turn if last else None,
                message_id=last.message_id if last else None,
            ),
            user_id=self._user_id(),
        )

    def _run_tools(self, call: _Call) -> list[ChatMessage]:
        """One tool batch (FLOW13): every call gets a ``tool:execute`` start/end pair and a
        result; then the group (assistant + results) is saved (SAVE2, SAVE3)."""
        services = self.services
        stored: list[ToolCall] = []
        results: list[ChatMessage] = []
        max_tokens = _max_result_tokens(services, self.model)
        for tc in call.tool_calls:
            if self.abort.aborted:
                # Stopped: the calls not yet started never run. The group keeps only the
                # calls that ran, so it stays a complete call-and-results group.
                break
            # Arguments must be a JSON object, nested no deeper than the log can hold;
            # otherwise the call does not run and the model gets the error (FLOW13).
            raw = clean_text(tc.arguments)
            args, error = parse_tool_arguments(raw)
            kept = raw if error is None else "{}"
            stored.append(ToolCall(id=tc.id, name=tc.name, arguments=kept))
            context = self._tool_context(tc.id)
            self._report(
                ToolStarted(turn_id=self.turn_id, call_id=tc.id, name=tc.name, arguments=kept)
            )
            services.bus.publish(
                "tool:execute",
                {
                    "phase": "start",
                    "sessionId": self.session_id,
                    "turnId": self.turn_id,
                    "callId": tc.id,
                    "name": tc.name,
                },
            )
            self._flush()
            result: str | None = None
            metadata: dict[str, Any] = {}
            if error is None:
                result, error, metadata = self._execute(tc, args, context)
            if result is not None and max_tokens is not None:
                result = truncate_to_tokens(result, max_tokens, default_counter())  # CFG4
            self._report(
                ToolFinished(
                    turn_id=self.turn_id,
                    call_id=tc.id,
                    name=tc.name,
                    result=result,
                    error=error,
                    metadata=metadata,
                )
            )
            services.bus.publish(
                "tool:execute",
                {
                    "phase": "end",
                    "sessionId": self.session_id,
                    "turnId": self.turn_id,
                    "callId": tc.id,
                    "name": tc.name,
                    "error": error,
                },
            )
            results.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="tool",
                    content=error if error is not None else (result or ""),
                    tool_call_id=tc.id,
                    name=tc.name,
                    meta=MessageMeta(turn_id=self.turn_id, call_id=tc.id, extra=metadata),
                )
            )
        head = ChatMessage(
            id=self.ids.new("msg"),
            role="assistant",
            content=strip_leaked_special_tokens(call.text),
            tool_calls=tuple(stored),
            reasoning=call.reasoning,
            meta=MessageMeta(turn_id=self.turn_id),
        )
        if not stored:
            return []
        for message in (head, *results):
            self._archive(message)
        return [head, *results]

    def _execute(
        self, tc: ToolCall, args: dict[str, Any], context: ToolCallContext
    ) -> tuple[str | None, str | None, dict[str, Any]]:
        """``agent:tool:before`` → execute → ``agent:tool:after``; errors go to the model."""
        tool = self.services.tools.get(tc.name)
        before = ToolBefore(tc.name, args, context)
        holder: dict[str, Any] = {}

        def execute(c: ToolBefore) -> None:
            if tool is None:
                holder["error"] = f"没有这个工具：{c.name}"
                return
            try:
                value = tool.handler(c.args, c.tool_call_context)
                if inspect.isawaitable(value):
                    if inspect.iscoroutine(value):
                        value.close()  # never awaited: tools are called synchronously
                    holder["error"] = ASYNC_TOOL
                else:
                    holder["result"] = value
            except Exception as exc:
                holder["error"] = redact(f"{type(exc).__name__}: {exc}")

        try:
            ran, _ = self.hooks.run("agent:tool:before", before, execute)
        except Exception as exc:
            return None, redact(f"{type(exc).__name__}: {exc}"), {}
        if not ran and "result" not in holder and "error" not in holder:
            holder["error"] = "工具调用被拦下，没有执行"
        after = ToolAfter(tc.name, holder.get("result"), context, error=holder.get("error"))
        self.hooks.run("agent:tool:after", after, lambda c: c)
        return self._recordable(tc, after)

    def _recordable(
        self, tc: ToolCall, after: ToolAfter
    ) -> tuple[str | None, str | None, dict[str, Any]]:
        """What a tool (and its middleware) gave, as values the log can hold: the result
        as text (a JSON value becomes compact JSON, bytes are decoded; anything else, or
        nesting too deep, is an error for the model), text cleaned of lone surrogates,
        metadata dropped (and logged) when it could not be stored."""
        result, problem = coerce_tool_result(after.result)
        error = after.error if after.error is None else clean_text(str(after.error))
        if problem is not None and error is None:
            error = problem
        metadata = dict(after.metadata)
        unloggable = find_unloggable(metadata)
        if unloggable is not None:
            log.warning(
                "tool metadata dropped: the log cannot hold it",
                session=self.session_id,
                turn=self.turn_id,
                tool=tc.name,
                where=unloggable[0],
                problem=unloggable[1],
            )
            metadata = {}
        return result, error, metadata


def _max_result_tokens(services: Services, model: ChatModel) -> int | None:
    """CFG4: one tool result may take ``toolResultMaxRatio`` of the context window, in
    tokens by the counter in use (``truncate_to_tokens`` keeps the suffix within it)."""
    ratio = services.config.tool_result_max_ratio
    window = getattr(model, "context_length", 0) or 0
    if window <= 0:
        return None
    return max(int(window * ratio), 1)
