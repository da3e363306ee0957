"""The state and plumbing every part of a turn shares (:class:`TurnBase`): reporting
facts to the session actor and waiting until they are durable (persist, then act), the
message archive, outbound messages, who the turn's inputs come from, and each model
call's trim and ``token:usage`` (through actors/request.py, as ``token:request`` does)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog
from aalis_agent.actors.budget import BudgetLog
from aalis_agent.actors.history_cache import HistoryCache, PreparedHistory
from aalis_agent.actors.hooks import (
    Hooks,
)
from aalis_agent.actors.messages import AppendEvents, Settled
from aalis_agent.actors.request import (
    TrimmedCall,
    call_usage,
    trim_call,
)
from aalis_agent.actors.workers import Workers
from aalis_agent.events import (
    ChatMessage,
    Clock,
    IdSource,
    Input,
    MessageSaved,
    ModelCallStarted,
    SessionEvent,
    ToolCall,
    TurnOpened,
    UsageRecorded,
)
from aalis_agent.projections import SessionView
from aalis_agent.projections.turns import Party, input_origin
from aalis_agent.request.labels import time_label
from aalis_agent.request.prompt import (
    TurnPrompt,
)
from aalis_agent.request.texts import Texts
from aalis_agent.request.trim import TrimResult
from aalis_agent.request.usage import budget_line, wire
from aalis_agent.services import (
    AbortSignal,
    OutboundMessage,
    Services,
)
from aalis_agent.services.llm import REPLY_CHARS_PER_TOKEN, ChatModel, Usage, reply_limit
from aalis_agent.services.logging_setup import dropped
from aalis_agent.services.outbound import OutboundKind

__all__ = [
    "REPLY_CHARS_PER_TOKEN",
    "FirstCall",
    "NotRecorded",
    "OwnershipLost",
    "TurnBase",
    "deliver",
    "exception_text",
    "reply_limit",
]

_LOG = "aalis.turn"
log = structlog.get_logger(_LOG)


UNPRINTABLE = "<exception str() failed>"
"""Recorded for an exception's message when building it fails."""


def exception_text(exc: BaseException, *, named: bool = False) -> str:
    """What a turn records of ``exc``: its message (its type's name when it has none), or
    with ``named`` ``"Type: message"``. An exception whose ``str()`` itself fails (a
    library's, with a broken message) gives ``"Type: <exception str() failed>"``: the
    failure is recorded as what it was, not as the error of describing it."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:
        return f"{name}: {UNPRINTABLE}"
    if named:
        return f"{name}: {text}"
    return text or name


class OwnershipLost(Exception):
    """The session's ownership is gone from this runtime (its lease expired while it was
    paused, and another runtime may serve the session now): the turn ends without acting
    or recording anything more."""


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
    if not services.bus.wants("outbound:message"):
        return  # no one listens: no payload built
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


class FirstCall(msgspec.Struct, frozen=True):
    """A turn's first model call, its start recorded in the commit that opened the turn
    (with the inputs' archived messages): the runner makes it without an insertion
    point."""

    started: ModelCallStarted
    model: ChatModel
    messages: tuple[ChatMessage, ...]


class ActorPort(Protocol):
    """How a runner reaches its session actor: ``ask`` waits for the answer, ``tell``
    does not need one (both are handled under the actor's lock, SessionActor.call)."""

    def ask(self, message: Any) -> Any: ...

    def tell(self, message: Any) -> None: ...


@dataclass
class _Call:
    """What one streamed model call returned."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    aborted: bool = False
    usage: Usage | None = None
    cut: bool = False  # cut off at the output limit: the last tool call may be incomplete


class TurnBase:
    """One turn's state and its plumbing; the runner and its tool batch and reply parts
    build on it (actors/turn.py, turn_tools.py, turn_reply.py)."""

    def __init__(
        self,
        *,
        actor: ActorPort,
        session_id: str,
        opened: TurnOpened,
        inputs: list[Input],
        view: SessionView,
        services: Services,
        hooks: Hooks,
        clock: Clock,
        ids: IdSource,
        abort: AbortSignal,
        on_exit: Callable[[Any], None] | None = None,
        before_acting: Callable[[Any], None] | None = None,
        confirm_owned: Callable[[str], bool] | None = None,
        on_archive_missed: Callable[[], None] | None = None,
        budget_log: BudgetLog | None = None,
        history_cache: HistoryCache | None = None,
        workers: Workers | None = None,
        first_call: FirstCall | None = None,
    ) -> None:
        self.actor = actor
        self.session_id = session_id
        self.opened = opened
        self.turn_id = opened.turn_id
        self.inputs = list(inputs)
        self.view = view
        self.services = services
        self.texts: Texts = services.texts_for(opened.platform, opened.venue)
        """The texts of this turn's locale (its platform's, else the runtime's)."""
        self.hooks = hooks
        self.clock = clock
        self.ids = ids
        self.abort = abort
        self._on_exit = on_exit
        self._before_acting = before_acting
        self._confirm_owned = confirm_owned
        self.begun = False  # its thread has started running it
        self._on_archive_missed = on_archive_missed
        self._addressed: list[tuple[str, str]] = []
        self._drafts: list[SessionEvent] = []
        self._call_index = 0
        self._call_refused = False  # the last insertion point refused the call's start
        self._protected: set[str] = set()  # this turn's inputs and instruction block (TRIM-N)
        self.trimmed = False
        # Where the last assembled request holds the history, while no hook saw the list.
        self._history_at: int | None = None
        self.last_trim: TrimResult | None = None
        self._persona: str | None = None
        self._history_cache = history_cache
        self._history: PreparedHistory = PreparedHistory(messages=(), active=0)
        self._last_call: TrimmedCall | None = None  # the last call, as trimmed
        self._budget_log = budget_log
        self._workers = workers
        self._claim_lock = threading.Lock()  # a held turn runs once (run_once/start_once)
        self._claimed = False
        self._started_ms = 0  # when the runner began (the turn's duration counts from it)
        self._settled = False  # the turn's end was committed with its reply
        self._first_call = first_call
        self._model: ChatModel | None = first_call.model if first_call is not None else None

    def _main(self) -> None:
        raise NotImplementedError  # the runner's (actors/turn.py): the turn's thread body

    def start(self) -> None:
        """Run the turn on a worker thread (a thread of its own without workers)."""
        if self._workers is not None:
            self._workers.submit(self._main)
            return
        name = f"turn:{self.session_id}:{self.turn_id}"
        threading.Thread(target=self._main, name=name, daemon=True).start()

    def _still_owned(self) -> None:
        """Before the turn acts (a model call, a tool): raise :class:`OwnershipLost` when
        the runtime's ownership says the session is no longer held here."""
        confirm = self._confirm_owned
        if confirm is None:
            return
        with self._outside(("ownership",)):  # a renewal may wait on the lease database
            owned = confirm(self.session_id)
        if not owned:
            raise OwnershipLost(self.turn_id)

    def run_once(self, *, gated: bool = False) -> None:
        """Run the turn on this thread (as a worker would), unless it has been run or
        started already (:meth:`start_once`): a held turn (``Runtime.run``). ``gated``:
        the caller took the gate for this turn (see :meth:`Workers.run_here`)."""
        if self._claim():
            if self._workers is not None:
                self._workers.run_here(self._main, gated=gated)
            else:
                self._main()

    def start_once(self) -> None:
        """:meth:`start`, unless the turn has been run or started already."""
        if self._claim():
            self.start()

    def _claim(self) -> bool:
        with self._claim_lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def _outside(self, key: Hashable) -> AbstractContextManager[None]:
        """Open the runtime's gate around a wait on the outside (the model, a tool): other
        turns' steps run meanwhile, unless ``key``'s last calls were all quick (see
        :mod:`aalis_agent.actors.gate`)."""
        if self._workers is None:
            return nullcontext()
        return self._workers.gate.released(key)

    @property
    def model(self) -> ChatModel:
        """The model of this turn, resolved once from the settings read when it opened
        (SET1, SCH5); a missing preferred model falls back with a warning (SET5)."""
        if self._model is None:
            self._model = self.services.models.resolve(self.opened.settings.model).model
        return self._model

    def _report(self, *drafts: SessionEvent) -> None:
        """Queue facts for the actor; they go out together at the next :meth:`_flush`."""
        self._drafts.extend(drafts)

    def _flush(
        self, *, final: bool = False, settle: Settled | None = None, starts_tool: bool = False
    ) -> None:
        """Persist, then act: commit the queued facts as one batch and wait until they
        are durable, before anything that acts on them (a model call, a tool, sending).

        ``final`` marks the batch that saves the reply: the actor refuses it when a stop
        came first, and after it commits no stop applies. ``starts_tool`` marks the batch
        that records a tool's start: refused, as far as that start goes, when a stop came
        first (a stop acknowledged before it is durable keeps the tool from running). A
        refused batch (the turn was stopped, deleted or is no longer running) raises
        :class:`NotRecorded`; a failed write raises the store's error (the actor has
        stopped). Either way the turn ends without further effects."""
        if not self._drafts and not final:
            return
        events, self._drafts = tuple(self._drafts), []
        appended = AppendEvents(
            self.turn_id, events, final=final, settle=settle, starts_tool=starts_tool
        )
        if not self.actor.ask(appended):
            raise NotRecorded(self.turn_id)
        if settle is not None:
            self._settled = True

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
            id=self.ids.new("msg"), role="system", content=self.texts.focus_guide(self._addressed)
        )

    def _usage(
        self,
        prompt: TurnPrompt,
        sent: Sequence[ChatMessage],
        tools: list[dict[str, Any]],
        call: _Call,
        model: ChatModel,
    ) -> None:
        """ACC2: ``token:usage`` after a call that returned (of the turn's ``model``), and
        the budget log (ACC4)."""
        services = self.services
        assert self._last_call is not None  # every call is trimmed before it is made
        appended = 0  # this turn's tool groups' messages
        for m in prompt.tail:
            if m.role == "tool" or m.tool_calls:
                appended += 1
        usage = call_usage(
            model,
            self._last_call,
            session_id=self.session_id,
            turn_id=self.turn_id,
            platform=self.opened.platform,
            persona=self._persona,
            provider_input_tokens=call.usage.prompt_tokens if call.usage else None,
            trimmed=self.trimmed,
            history_messages=self._history.active + appended,
        )
        self._report(UsageRecorded(usage=usage))
        if services.bus.wants("token:usage"):
            services.bus.publish("token:usage", wire(usage))
        # A session's first, then every 10th or on a new level; built only if seen.
        budget = self._budget_log
        if budget is not None and budget.due(usage) and not dropped(_LOG, logging.INFO):
            log.info(budget_line(usage))

    def _trim(
        self,
        prompt: TurnPrompt,
        messages: Sequence[ChatMessage],
        tools: list[dict[str, Any]],
        index: int,
        model: ChatModel,
    ) -> Sequence[ChatMessage]:
        """FLOW9: trim the assembled list to the budget of the turn's ``model`` (TRIM);
        keep the trace."""
        services = self.services
        trimmed = trim_call(
            services,
            model,
            messages,
            tools,
            self._history,
            protected=frozenset(self._protected),
            texts=self.texts,
            history_at=self._history_at,
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
