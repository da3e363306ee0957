"""``TurnRunner``: one turn, on its own thread, reporting every fact back to its actor.

The runner never writes the log: it tells the session actor what happened (the actor
stays the only writer) and asks it, at each insertion point, which pending inputs join.
It checks the turn's abort signal between stream chunks and hands it to tools (SCH6).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import pykka
import structlog

from actors.messages import AppendEvents, CallEnded, InsertionPoint, Settled
from actors.scheduler import archived_input_message
from events import (
    ChatMessage,
    Clock,
    IdSource,
    Input,
    MessageMeta,
    MessageSaved,
    ModelCallStarted,
    SessionEvent,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnOpened,
    TurnOutcome,
    TurnRecord,
)
from projections import SessionView, history
from projections.labels import time_label
from projections.texts import focus_guide, tool_bad_arguments
from services import AbortSignal, ChatRequest, Services, ToolCallContext
from services.tools import Inbound

__all__ = ["TurnRunner"]

log = structlog.get_logger("aalis.turn")


class TurnRunner:
    """Drives one turn: model calls, tool batches and insertion points (FLOW8, FLOW13)."""

    def __init__(
        self,
        *,
        actor: pykka.ActorRef[Any],
        session_id: str,
        opened: TurnOpened,
        inputs: list[Input],
        view: SessionView,
        services: Services,
        clock: Clock,
        ids: IdSource,
        abort: AbortSignal,
        on_exit: Callable[[TurnRunner], None] | None = None,
    ) -> None:
        self.actor = actor
        self.session_id = session_id
        self.opened = opened
        self.turn_id = opened.turn_id
        self.inputs = list(inputs)
        self.view = view
        self.services = services
        self.clock = clock
        self.ids = ids
        self.abort = abort
        self._on_exit = on_exit
        self._addressed: list[tuple[str, str]] = []
        self._drafts: list[tuple[type[SessionEvent], dict[str, Any]]] = []
        self.thread = threading.Thread(
            target=self._main, name=f"turn:{session_id}:{self.turn_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    # --- reporting -------------------------------------------------------------------

    def _report(self, *drafts: tuple[type[SessionEvent], dict[str, Any]]) -> None:
        """Queue facts for the actor; they go out together at the next :meth:`_flush`."""
        self._drafts.extend(drafts)

    def _flush(self) -> None:
        """Send the queued facts as one batch: before anything that waits (a model call,
        a tool, a question to the actor), so the log shows what was under way."""
        if self._drafts:
            drafts, self._drafts = tuple(self._drafts), []
            self.actor.tell(AppendEvents(self.turn_id, drafts))

    def _save(self, message: ChatMessage) -> None:
        self._report((MessageSaved, {"message": message}))

    # --- the turn --------------------------------------------------------------------

    def _main(self) -> None:
        started = self.clock.now_ms()
        outcome: TurnOutcome = "error"
        reason: str | None = None
        try:
            outcome, reason = self._run()
        except Exception as exc:
            log.exception("turn failed", session=self.session_id, turn=self.turn_id)
            outcome, reason = "error", type(exc).__name__
        finally:
            if self.abort.aborted and outcome != "replied":
                outcome, reason = "aborted", self.abort.reason
            duration = max(self.clock.now_ms() - started, 0)
            with contextlib.suppress(pykka.ActorDeadError):
                self._flush()
                self.actor.tell(Settled(self.turn_id, outcome, reason, duration))
            if self._on_exit is not None:
                self._on_exit(self)

    def _messages_base(self) -> list[ChatMessage]:
        settings = self.opened.settings
        window = history.history_window(
            self.view.history, settings.history_limit, exclude_turn=self.turn_id
        )
        messages = list(window)
        if self.opened.batch_prefix:
            messages.append(
                ChatMessage(id=self.ids.new("msg"), role="system", content=self.opened.batch_prefix)
            )
        return messages

    def _run(self) -> tuple[TurnOutcome, str | None]:
        services = self.services
        settings = self.opened.settings
        human_opened = self.opened.source is None
        # SAVE1: the opening inputs are archived first, in order, entry "opened"; an idle
        # prompt is shown to the model but never archived (INS3).
        turn_messages: list[ChatMessage] = []
        for inp in self.inputs:
            message = archived_input_message(inp, self.turn_id, "opened", self.ids.new("msg"))
            if inp.trigger_type != "idle":
                self._save(message)
            turn_messages.append(message)
        base = self._messages_base()
        tools = services.tools.available(settings.tool_groups)
        tool_defs = tuple(t.definition() for t in tools)
        batches = 0
        call_index = 0
        while True:
            if self.abort.aborted:
                return "aborted", self.abort.reason
            if human_opened:
                self._flush()
                joined: list[Input] = self.actor.ask(InsertionPoint(self.turn_id))  # type: ignore[assignment]
                guide = self._focus_guide(joined)
                if guide is not None:
                    turn_messages.append(guide)
                for inp in joined:
                    message = archived_input_message(
                        inp, self.turn_id, "joined", self.ids.new("msg")
                    )
                    self._save(message)
                    turn_messages.append(message)
                    self.inputs.append(inp)
            call_index += 1
            request = ChatRequest(
                messages=tuple(base + turn_messages),
                tools=tool_defs,
                model=str(settings.model) if settings.model else services.llm.id,
                think=settings.think,
                session_id=self.session_id,
            )
            self._report(
                (
                    ModelCallStarted,
                    {"turn_id": self.turn_id, "index": call_index, "model": request.model},
                )
            )
            self._flush()
            text: list[str] = []
            calls: list[ToolCall] = []
            for chunk in services.llm.chat_stream(request, self.abort):
                if self.abort.aborted:
                    break
                if chunk.content_delta:
                    text.append(chunk.content_delta)
                if chunk.tool_calls:
                    calls.extend(chunk.tool_calls)
            if self.abort.aborted:
                self.actor.tell(CallEnded(self.turn_id, call_index, "aborted"))
                return "aborted", self.abort.reason
            self.actor.tell(CallEnded(self.turn_id, call_index, "ok", len(calls)))
            reply = "".join(text)
            cap = settings.max_tool_iterations
            if not calls or (cap is not None and batches >= cap):
                if not reply.strip():
                    return "silent", None
                self._save(
                    ChatMessage(
                        id=self.ids.new("msg"),
                        role="assistant",
                        content=reply,
                        meta=MessageMeta(
                            turn_id=self.turn_id,
                            turn_record=TurnRecord(
                                turn_id=self.turn_id, outcome="replied", source=self.opened.source
                            ),
                        ),
                    )
                )
                services.bus.publish(
                    "outbound:message",
                    {"sessionId": self.session_id, "turnId": self.turn_id, "content": reply},
                )
                return "replied", None
            batches += 1
            turn_messages.extend(self._run_tools(calls, reply))
            if self.abort.aborted:
                return "aborted", self.abort.reason

    def _focus_guide(self, joined: list[Input]) -> ChatMessage | None:
        """Before addressed inserts in a multi-party room: a block listing every addressed
        insert so far (SCH2). Earlier blocks stay as they were, so requests keep their
        prefix; the block is part of this turn's requests only, never archived."""
        if not self.opened.settings.multi_party:
            return None
        addressed = [i for i in joined if i.addressed and i.source is None]
        if not addressed:
            return None
        now = self.clock.now_ms()
        for inp in addressed:
            when = time_label(inp.timestamp or now, now, self.services.tz)
            self._addressed.append((when, inp.sender.user_id or "?"))
        return ChatMessage(
            id=self.ids.new("msg"), role="system", content=focus_guide(list(self._addressed))
        )

    def _run_tools(self, calls: list[ToolCall], reply: str) -> list[ChatMessage]:
        """One tool batch (FLOW13): every call gets a start/end pair; then the group is saved."""
        stored: list[ToolCall] = []
        results: list[ChatMessage] = []
        senders = {i.sender.user_id for i in self.inputs}
        last = self.inputs[-1] if self.inputs else None
        for call in calls:
            if self.abort.aborted:
                # Stopped: the calls not yet started never run. The group keeps only the
                # calls that ran, so it stays a complete call-and-results group.
                break
            args, error = _parse_arguments(call.arguments)
            kept = call.arguments if error is None else "{}"
            stored.append(ToolCall(id=call.id, name=call.name, arguments=kept))
            self._report(
                (
                    ToolStarted,
                    {
                        "turn_id": self.turn_id,
                        "call_id": call.id,
                        "name": call.name,
                        "arguments": kept,
                    },
                )
            )
            self._flush()
            result: str | None = None
            tool = self.services.tools.get(call.name)
            if error is None and tool is None:
                error = f"没有这个工具：{call.name}"
            if error is None and tool is not None:
                context = ToolCallContext(
                    session_id=self.session_id,
                    turn_id=self.turn_id,
                    call_id=call.id,
                    abort=self.abort,
                    platform=self.opened.platform,
                    participants=tuple(sorted(s for s in senders if s)),
                    inbound=Inbound(
                        source=self.opened.source,
                        from_turn=last.from_turn if last else None,
                        message_id=last.message_id if last else None,
                    ),
                    user_id=next(iter(senders)) if len(senders) == 1 else None,
                )
                try:
                    result = tool.handler(args, context)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            self._report(
                (
                    ToolFinished,
                    {
                        "turn_id": self.turn_id,
                        "call_id": call.id,
                        "name": call.name,
                        "result": result,
                        "error": error,
                    },
                )
            )
            results.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="tool",
                    content=error if error is not None else (result or ""),
                    tool_call_id=call.id,
                    name=call.name,
                    meta=MessageMeta(turn_id=self.turn_id, call_id=call.id),
                )
            )
        head = ChatMessage(
            id=self.ids.new("msg"),
            role="assistant",
            content=reply,
            tool_calls=tuple(stored),
            meta=MessageMeta(turn_id=self.turn_id),
        )
        for message in (head, *results):
            self._save(message)
        return [head, *results]


def _parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """Arguments must be a JSON object; an empty string means none (FLOW13)."""
    if raw == "":
        return {}, None
    try:
        value = json.loads(raw)
    except ValueError:
        return {}, tool_bad_arguments(raw)
    if not isinstance(value, dict):
        return {}, tool_bad_arguments(raw)
    return value, None
