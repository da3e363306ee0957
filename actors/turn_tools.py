"""A turn's tool batch (FLOW13): arguments checked, ``agent:tool:before`` → execute →
``agent:tool:after``, every call's start durable before it runs, results coerced to what
the log can hold, and the group (assistant + results) archived."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import msgspec
from aalis_agent.actors.hooks import (
    ToolAfter,
    ToolBefore,
)
from aalis_agent.actors.turn_base import (
    UNPRINTABLE,
    TurnBase,
    _Call,
    exception_text,
    log,
    reply_limit,
)
from aalis_agent.events import (
    ChatMessage,
    MessageMeta,
    ToolCall,
    ToolFinished,
    ToolStarted,
)
from aalis_agent.request.limits import (
    clean_text,
    coerce_tool_result,
    find_unloggable,
    parse_tool_arguments,
)
from aalis_agent.request.textnorm import strip_leaked_special_tokens, truncate_to_tokens
from aalis_agent.request.tokens import (
    default_counter,
)
from aalis_agent.services import (
    Services,
    ToolCallContext,
)
from aalis_agent.services.llm import ChatModel
from aalis_agent.services.secrets import redact
from aalis_agent.services.tools import Inbound
from aalis_agent.services.typed_tools import default_loop_thread, run_awaitable

__all__ = ["ToolBatch"]
"""The result a call gets whose tool handler returned an awaitable."""


class ToolBatch(TurnBase):
    """The tool batch of a turn's runner (a part of :class:`TurnRunner`)."""

    def _tool_context(self, call_id: str) -> ToolCallContext:
        """TCX1: from the inputs already sent to the model; the owner's identities are one
        participant; ``userId`` only when every input has the same physical speaker."""
        authority = self.services.authority
        participants: list[str] = []
        owner_seen = False
        speakers: set[str | None] = set()  # as ``_user_id`` finds them, from the same origins
        for inp in self.inputs:
            parties, speaker = self._origin(inp)
            speakers.add(speaker)
            for platform, who in parties:
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
            user_id=next(iter(speakers)) if len(speakers) == 1 else None,
        )

    def _run_tools(self, call: _Call) -> list[ChatMessage]:
        """One tool batch (FLOW13): every call gets a ``tool:execute`` start/end pair and a
        result; then the group (assistant + results) is saved (SAVE2, SAVE3)."""
        services = self.services
        stored: list[ToolCall] = []
        results: list[ChatMessage] = []
        model = self.model
        max_tokens = _max_result_tokens(services, model)
        last = len(call.tool_calls) - 1
        for n, tc in enumerate(call.tool_calls):
            if self.abort.aborted:
                # Stopped: the calls not yet started never run. The group keeps only the
                # calls that ran, so it stays a complete call-and-results group.
                break
            # Arguments must be a JSON object, nested no deeper than the log can hold;
            # otherwise the call does not run and the model gets the error (FLOW13).
            raw = clean_text(tc.arguments)
            # No longer than the model's output limit can hold (a broken endpoint's 50 MB
            # would be stored and counted): refused as too long, naming the limit.
            args, error = parse_tool_arguments(raw, max_chars=reply_limit(model), texts=self.texts)
            if error is not None and call.cut and n == last:
                # Cut off at the output limit while the model wrote them: say so, so
                # that it writes them shorter rather than the same again.
                error = self.texts("tool.arguments_cut", raw=raw[:200])
            kept = raw if error is None else "{}"
            stored.append(ToolCall(id=tc.id, name=tc.name, arguments=kept))
            context = self._tool_context(tc.id)
            self._report(
                ToolStarted(turn_id=self.turn_id, call_id=tc.id, name=tc.name, arguments=kept)
            )
            # Durable before the tool runs; refused (NotRecorded) when a stop came first.
            self._flush(starts_tool=True)
            if services.bus.wants("tool:execute"):  # else no payload built
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
            result: str | None = None
            metadata: dict[str, Any] = {}
            if error is None:
                self._still_owned()  # not run for a session another runtime has taken
                self._gave = None
                try:
                    result, error, metadata = self._execute(tc, args, context)
                except BaseException as exc:
                    # The turn ends here (an interrupt or an exit from the tool, or its
                    # agent:tool:after middleware failing), and is passed on: its start
                    # durable, the call gets its finish first, committed with the turn's
                    # record. What the tool gave when it ran, else the interruption. The
                    # calls that ran, this one included, stay in history as a stopped
                    # turn's do (SCH6): the next turn is told they are as recorded.
                    gave: tuple[str | None, str | None, dict[str, Any]] | None = self._gave
                    self._gave = None
                    if gave is None:
                        gave = (None, _cut_short(exc), {})
                    result, error = self._finish(tc, *gave, max_tokens=max_tokens)
                    results.append(self._tool_result(tc, result, error, gave[2]))
                    self._save_group(call, stored, results)
                    raise
            result, error = self._finish(tc, result, error, metadata, max_tokens=max_tokens)
            results.append(self._tool_result(tc, result, error, metadata))
        return self._save_group(call, stored, results)

    def _tool_result(
        self, tc: ToolCall, result: str | None, error: str | None, metadata: dict[str, Any]
    ) -> ChatMessage:
        """The tool message answering ``tc`` with its result or error as recorded."""
        return ChatMessage(
            id=self.ids.new("msg"),
            role="tool",
            content=error if error is not None else (result or ""),
            tool_call_id=tc.id,
            name=tc.name,
            meta=MessageMeta(turn_id=self.turn_id, call_id=tc.id, extra=metadata),
        )

    def _save_group(
        self, call: _Call, stored: list[ToolCall], results: list[ChatMessage]
    ) -> list[ChatMessage]:
        """Archive the batch's group, the assistant message with the calls that ran and
        their results (SAVE2), and return it; nothing when no call ran."""
        if not stored:
            return []
        head = ChatMessage(
            id=self.ids.new("msg"),
            role="assistant",
            content=strip_leaked_special_tokens(call.text),
            tool_calls=tuple(stored),
            reasoning=call.reasoning,
            meta=MessageMeta(turn_id=self.turn_id),
        )
        for message in (head, *results):
            self._archive(message)
        return [head, *results]

    def _finish(
        self,
        tc: ToolCall,
        result: str | None,
        error: str | None,
        metadata: dict[str, Any],
        *,
        max_tokens: int | None,
    ) -> tuple[str | None, str | None]:
        """A call's ``ToolFinished`` reported (committed with the turn's next batch) and
        ``tool:execute`` "end" published; returns the result and error as recorded."""
        if max_tokens is not None and (result is not None or error is not None):
            # CFG4, for an error as for a result: a tool (or a remote MCP server) may
            # fail with any amount of text, and the log keeps what the model gets.
            suffix = self.texts("prompt.truncated_suffix")
            counter = default_counter()
            if result is not None:
                result = truncate_to_tokens(result, max_tokens, counter, suffix=suffix)
            if error is not None:
                error = truncate_to_tokens(error, max_tokens, counter, suffix=suffix)
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
        services = self.services
        if services.bus.wants("tool:execute"):
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
        return result, error

    _gave: tuple[str | None, str | None, dict[str, Any]] | None = None
    """What the running call's tool gave, kept while its ``agent:tool:after`` runs: a
    middleware failing there ends the turn, and the call's finish records it."""

    def _execute(
        self, tc: ToolCall, args: dict[str, Any], context: ToolCallContext
    ) -> tuple[str | None, str | None, dict[str, Any]]:
        """``agent:tool:before`` → execute → ``agent:tool:after``; errors go to the model.

        A middleware raising in ``agent:tool:after`` fails the turn; the tool's own
        result (or error) is kept in ``_gave`` for the call's finish."""
        tool = self.services.tools.get(tc.name)
        before = ToolBefore(tc.name, args, context)
        holder: dict[str, Any] = {}

        def execute(c: ToolBefore) -> None:
            if tool is None:
                holder["error"] = self.texts("tool.not_found", name=c.name)
                return
            try:
                with self._outside(("tool", tc.name)):  # waited on with the gate open
                    value = tool.handler(c.args, c.tool_call_context)
                    if inspect.isawaitable(value):
                        # An async handler runs on the shared tool loop thread; a stop
                        # cancels it (SCH6).
                        value = run_awaitable(
                            value,
                            default_loop_thread().loop,
                            abort=c.tool_call_context.abort,
                            name=tc.name,
                        )
                holder["result"] = value
            except _PASSED_ON:
                raise
            except BaseException as exc:  # a library's own (GeneratorExit, CancelledError)
                holder["error"] = redact(exception_text(exc, named=True))

        try:
            ran, _ = self.hooks.run("agent:tool:before", before, execute)
        except _PASSED_ON:
            raise
        except BaseException as exc:
            return None, redact(exception_text(exc, named=True)), {}
        if not ran and "result" not in holder and "error" not in holder:
            holder["error"] = self.texts("tool.blocked")
        after = ToolAfter(tc.name, holder.get("result"), context, error=holder.get("error"))
        if not self.hooks.has_middleware("agent:tool:after"):
            return self._recordable(tc, after)  # left as built: what the tool gave
        try:
            self.hooks.run("agent:tool:after", after, lambda c: c)
        except BaseException:
            # The tool ran: what it returned, not what the failing middleware may have
            # half changed (its metadata keys are stored only with a completed chain).
            own = ToolAfter(tc.name, holder.get("result"), context, error=holder.get("error"))
            self._gave = self._recordable(tc, own)
            raise
        return self._recordable(tc, after)

    def _recordable(
        self, tc: ToolCall, after: ToolAfter
    ) -> tuple[str | None, str | None, dict[str, Any]]:
        """What a tool (and its middleware) gave, as values the log can hold: the result
        as text (a JSON value becomes compact JSON, bytes are decoded; anything else, or
        nesting too deep, is an error for the model), text cleaned of lone surrogates,
        metadata dropped (and logged) when it is not a dict or could not be stored."""
        try:
            result, problem = coerce_tool_result(after.result, texts=self.texts)
        except Exception as exc:  # a value of the tool's own whose reading fails
            result, problem = None, redact(exception_text(exc, named=True))
        try:
            error = after.error if after.error is None else clean_text(str(after.error))
        except Exception:  # an error object whose text cannot be built: named by its type
            error = f"{type(after.error).__name__}: {UNPRINTABLE}"
        if problem is not None and error is None:
            error = problem
        given = after.metadata
        metadata = dict(given) if isinstance(given, Mapping) else {}
        unloggable = (
            find_unloggable(metadata)
            if isinstance(given, Mapping)
            else ("metadata", f"a dict is wanted, not {type(given).__name__}")
        )
        if unloggable is None and metadata:
            # What the log and its readers (replay --json, the inspector) print as JSON:
            # an object of a type of the tool's own, a str subclass, a dict with tuple
            # keys would stop the session at the write, or its readers later; and what
            # reads back as the event's ``dict[str, Any]`` (a number key is written as
            # JSON text, yet the log's own reader refuses it, and the session with it).
            try:
                msgspec.json.encode(metadata)
                packed = msgspec.msgpack.encode(metadata)
                _METADATA.decode(packed)
            except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as exc:
                unloggable = ("metadata", str(exc))
            else:
                if len(packed) > METADATA_BYTES:  # stored twice: result event and message
                    unloggable = (
                        "metadata",
                        f"{len(packed):,} bytes as stored, over the limit of {METADATA_BYTES:,}",
                    )
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


METADATA_BYTES = 65_536
"""The most a tool's metadata may take as stored (64 KiB, as an input's other fields):
past it, it is dropped (and logged), as metadata the log cannot hold is."""

_PASSED_ON = (KeyboardInterrupt, SystemExit)
"""Raised by a tool or its middleware, these end the turn as they would any code: an
interrupt or an exit, not the tool's failure. They are raised on once the call's finish
(an error naming the interruption), the batch's group of the calls that ran (SAVE2) and
the turn's record (``aborted``, reason ``interrupt`` or ``exit``) are committed. Any other
exception is the call's error."""


def _cut_short(exc: BaseException) -> str:
    """The error recorded for a call whose run ended in ``exc`` before the tool gave
    anything (a ``KeyboardInterrupt`` or ``SystemExit`` raised by the tool's own code)."""
    what = type(exc).__name__
    try:
        detail = str(exc)
    except Exception:  # its message cannot be built: the interruption is still named
        detail = UNPRINTABLE
    if detail:
        what = f"{what}({detail[:200]})"
    if isinstance(exc, _PASSED_ON):
        return redact(f"{what}: interrupted while the tool ran; the turn ended with it")
    return redact(f"{what}: the turn ended while the tool ran")


_METADATA: msgspec.msgpack.Decoder[dict[str, Any]] = msgspec.msgpack.Decoder(dict[str, Any])
"""Reads a tool's metadata back as the log's reader reads ``ToolFinished.metadata``."""


def _max_result_tokens(services: Services, model: ChatModel) -> int | None:
    """CFG4: one tool result may take ``toolResultMaxRatio`` of the context window, in
    tokens by the counter in use (``truncate_to_tokens`` keeps the suffix within it)."""
    ratio = services.config.tool_result_max_ratio
    window = getattr(model, "context_length", 0) or 0
    if window <= 0:
        return None
    return max(int(window * ratio), 1)
