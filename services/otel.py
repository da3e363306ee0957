"""OpenTelemetry spans for a runtime's turns, model calls and tool calls (the ``otel`` extra).

    from aalis_agent.services.otel import instrument

    uninstrument = instrument(runtime)  # the global tracer provider, or tracer_provider=...
    ...
    uninstrument()

Everything is observed on the runtime's event bus (``services/bus_events.py``); no hook
middleware is installed, so turns keep their fast path (``Hooks.quiet``). The spans:

``aalis.turn`` (one per turn, from ``turn:opened`` to ``turn:ended``)
    ``gen_ai.operation.name`` = ``invoke_agent``, ``gen_ai.conversation.id``,
    ``aalis.session_id``, ``aalis.turn_id``, ``aalis.turn.input_ids``,
    ``aalis.turn.source`` (an injected turn's source), ``aalis.turn.outcome``,
    ``aalis.turn.reason``, ``aalis.turn.duration_ms``; status ERROR (the reason as its
    description) when the outcome is ``error``.
``chat <model>`` (one per model call, a child of its turn's span, from its ``llm:call``
start to its end)
    ``gen_ai.operation.name`` = ``chat``, ``gen_ai.request.model`` and ``aalis.model``
    (``provider/model``) of the model the call used, ``aalis.call.index``,
    ``aalis.call.returned``; for a call that returned: ``gen_ai.request.max_tokens``,
    ``gen_ai.usage.input_tokens`` (the provider's count when it reported one, else the
    runtime's estimate), ``gen_ai.usage.output_tokens`` (when the provider reported it),
    ``aalis.usage.token_budget``, ``aalis.usage.context_window``, ``aalis.usage.trimmed``
    and, when the call's messages were trimmed (``agent:trim``), ``aalis.trim.budget`` and
    ``aalis.trim.steps``; an ``aalis.first_chunk`` span event when the first piece of
    output streamed. A call that failed is ERROR (the error as its description); one
    that was stopped has ``aalis.call.returned`` false.
``execute_tool <name>`` (one per tool call, a child of its turn's span)
    ``gen_ai.operation.name`` = ``execute_tool``, ``gen_ai.tool.name``,
    ``gen_ai.tool.call.id``, the session and turn ids; on failure status ERROR with the
    error the model gets, ``error.type`` and an ``exception`` span event.

A call's span takes its times and model from ``llm:call``. A call made while no
``llm:call`` was heard (the turn was running when ``instrument()`` began) starts when the
step before it ended (its turn's open, the previous call's or the last tool's end) and
ends at its ``token:usage``, with the model only when the runtime serves one; a call due
when its turn ended ``error`` or ``aborted`` gets a span ending with the turn.

Subscribers run on the publishing threads; the work here is a few dict operations and the
span calls under one lock. Ending a span runs the provider's span processors there: a
``BatchSpanProcessor`` hands it to its own export thread, a ``SimpleSpanProcessor``
exports it then and there, so an exporter that blocks would hold every turn (measured:
a blocking exporter behind a ``SimpleSpanProcessor`` held a turn past 3 s, behind a
``BatchSpanProcessor`` not at all; an exporter that raises is logged by either). Spans
left open by ``uninstrument()`` are ended then, marked ``aalis.incomplete``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aalis_agent.services.bus_events import (
    ModelCall,
    ToolExecution,
    TrimApplied,
    TurnEnded,
    TurnStarted,
    UsageReported,
    typed_event,
)
from aalis_agent.services.models import LlmService, entry_id

if TYPE_CHECKING:
    from aalis_agent.services import Services
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = ["INSTALL_HINT", "instrument"]

INSTALL_HINT = "pip install aalis-agent[otel]"

TOPICS = (
    "turn:opened",
    "llm:call",
    "turn:ended",
    "outbound:stream",
    "tool:execute",
    "token:usage",
    "agent:trim",
)
"""The bus topics :func:`instrument` subscribes to."""

# An error text that starts with an exception's name ("ValueError: ...", or the name alone
# as a turn's reason): that name is the span's ``error.type``.
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")


class Observable(Protocol):
    """What :func:`instrument` needs of a runtime (``aalis_agent.Runtime`` is one)."""

    @property
    def services(self) -> Services: ...

    def subscribe(self, topic: str, fn: Callable[[str, Any], None]) -> Callable[[], None]: ...


def _otel() -> Any:
    """The ``opentelemetry.trace`` module, or an ImportError naming the extra."""
    try:
        from opentelemetry import trace
    except ImportError as exc:
        raise ImportError(
            f"OpenTelemetry export needs the opentelemetry packages: {INSTALL_HINT}"
        ) from exc
    return trace


@dataclass
class _Turn:
    """One open turn: its span and what its next model call's span needs."""

    span: Span
    context: Context
    mark: int
    """When the step now running began (ns): the turn's open, a call's or a tool's end."""
    attributes: dict[str, Any]
    calls: int = 0
    call_due: bool = True
    """A model call is running or due next (the turn opened, or the last tool ended)."""
    first_chunk: int | None = None
    trim: TrimApplied | None = None
    tools: dict[str, Span] = field(default_factory=dict)
    call_model: dict[str, Any] | None = None
    """The running call's model (from its ``llm:call`` start)."""
    call_end: int | None = None
    """When the running call's stream ended (ns; its ``token:usage`` follows)."""
    output_tokens: int | None = None


class _Tracer:
    """The bus subscriber: turns bus events into spans."""

    def __init__(self, runtime: Observable, tracer: Tracer, trace: Any) -> None:
        self.runtime = runtime
        self.tracer = tracer
        self.trace = trace
        self.lock = threading.Lock()
        self.turns: dict[tuple[str, str], _Turn] = {}
        self.closed = False

    # --- the bus -----------------------------------------------------------------------

    def on_event(self, topic: str, payload: Any) -> None:
        now = time.time_ns()
        if topic == "outbound:stream":  # every chunk: only the first of a call matters
            if isinstance(payload, dict):
                self._chunk(payload.get("sessionId"), payload.get("turnId"), now)
            return
        event = typed_event(topic, payload)
        with self.lock:
            if self.closed:
                return
            if isinstance(event, TurnStarted):
                self._opened(event, now)
            elif isinstance(event, ModelCall):
                self._model_call(event, now)
            elif isinstance(event, UsageReported):
                self._usage(event, now)
            elif isinstance(event, ToolExecution):
                self._tool(event, now)
            elif isinstance(event, TrimApplied):
                turn = self.turns.get((event.session_id, event.turn_id))
                if turn is not None:
                    turn.trim = event
            elif isinstance(event, TurnEnded):
                self._ended(event, now)

    def _chunk(self, session_id: Any, turn_id: Any, now: int) -> None:
        if not isinstance(session_id, str) or not isinstance(turn_id, str):
            return
        with self.lock:
            turn = self.turns.get((session_id, turn_id))
            if turn is not None and turn.first_chunk is None:
                turn.first_chunk = now

    # --- turns -------------------------------------------------------------------------

    def _opened(self, event: TurnStarted, now: int) -> None:
        key = (event.session_id, event.turn_id)
        if key in self.turns:
            return
        ids = {"aalis.session_id": event.session_id, "aalis.turn_id": event.turn_id}
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": event.session_id,
            **ids,
            "aalis.turn.input_ids": list(event.input_ids),
        }
        if event.source is not None:
            attributes["aalis.turn.source"] = event.source
        span = self.tracer.start_span("aalis.turn", attributes=attributes, start_time=now)
        model = self._model()
        self.turns[key] = _Turn(
            span=span,
            context=self.trace.set_span_in_context(span),
            mark=now,
            attributes={"gen_ai.conversation.id": event.session_id, **ids, **model},
        )

    def _ended(self, event: TurnEnded, now: int) -> None:
        turn = self.turns.pop((event.session_id, event.turn_id), None)
        if turn is None:  # opened before instrument() (or recovered after a crash)
            return
        failed = event.outcome == "error"
        reason = event.reason or event.outcome
        if turn.call_due and event.outcome in ("error", "aborted"):
            # A call due or running when the turn failed or was stopped never returned.
            self._call(turn, now, returned=False, error=reason if failed else None)
        for span in turn.tools.values():  # a tool still running when the turn ended
            span.set_attribute("aalis.tool.finished", False)
            if failed:
                self._fail(span, reason)
            span.end(end_time=now)
        turn.tools.clear()
        span = turn.span
        span.set_attribute("aalis.turn.outcome", event.outcome)
        if event.reason is not None:
            span.set_attribute("aalis.turn.reason", event.reason)
        span.set_attribute("aalis.turn.duration_ms", event.duration_ms)
        if failed:
            self._fail(span, reason)
        span.end(end_time=now)

    # --- model calls -------------------------------------------------------------------

    def _model_call(self, event: ModelCall, now: int) -> None:
        turn = self.turns.get((event.session_id, event.turn_id))
        if turn is None:
            return
        if event.phase == "start":
            turn.mark = now
            turn.call_due = True
            turn.first_chunk = None
            turn.call_model = {"gen_ai.request.model": event.model, "aalis.model": event.entry}
            turn.call_end = turn.output_tokens = None
            return
        if event.status == "ok":  # its span ends with this, once token:usage has come
            turn.call_end = now
            turn.output_tokens = event.output_tokens
            return
        failed = event.status == "error"
        self._call(turn, now, returned=False, error=(event.error or "error") if failed else None)
        turn.call_due = False

    def _usage(self, event: UsageReported, now: int) -> None:
        if event.turn_id is None:  # Runtime.token_request: no call was made
            return
        turn = self.turns.get((event.session_id, event.turn_id))
        if turn is None:
            return
        usage = event.usage
        extra: dict[str, Any] = {
            "aalis.usage.token_budget": usage.token_budget,
            "aalis.usage.context_window": usage.context_window,
            "aalis.usage.trimmed": usage.trimmed,
        }
        if usage.max_tokens:
            extra["gen_ai.request.max_tokens"] = usage.max_tokens
        if usage.used:
            extra["gen_ai.usage.input_tokens"] = usage.used
        self._call(turn, now, returned=True, extra=extra)
        turn.call_due = False

    def _call(
        self,
        turn: _Turn,
        now: int,
        *,
        returned: bool,
        error: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        turn.calls += 1
        model_attributes, turn.call_model = turn.call_model, None
        end, turn.call_end = turn.call_end, None
        output, turn.output_tokens = turn.output_tokens, None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            **turn.attributes,
            **(model_attributes or {}),
            "aalis.call.index": turn.calls,
            "aalis.call.returned": returned,
            **(extra or {}),
        }
        if output is not None and returned:
            attributes["gen_ai.usage.output_tokens"] = output
        if end is not None:
            now = max(end, turn.mark)
        trim, turn.trim = turn.trim, None
        if trim is not None:
            attributes["aalis.trim.budget"] = trim.budget
            attributes["aalis.trim.steps"] = list(trim.steps)
        model = attributes.get("gen_ai.request.model")
        span = self.tracer.start_span(
            f"chat {model}" if model else "chat",
            context=turn.context,
            kind=self.trace.SpanKind.CLIENT,
            attributes=attributes,
            start_time=turn.mark,
        )
        first, turn.first_chunk = turn.first_chunk, None
        if first is not None:
            span.add_event("aalis.first_chunk", timestamp=max(first, turn.mark))
        if error is not None:
            self._fail(span, error)
        span.end(end_time=now)
        turn.mark = now

    # --- tools -------------------------------------------------------------------------

    def _tool(self, event: ToolExecution, now: int) -> None:
        turn = self.turns.get((event.session_id, event.turn_id))
        if turn is None:
            return
        if event.phase == "start":
            turn.call_due = False
            turn.tools[event.call_id] = self.tracer.start_span(
                f"execute_tool {event.name}",
                context=turn.context,
                kind=self.trace.SpanKind.INTERNAL,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": event.name,
                    "gen_ai.tool.call.id": event.call_id,
                    "aalis.session_id": event.session_id,
                    "aalis.turn_id": event.turn_id,
                },
                start_time=now,
            )
            return
        span = turn.tools.pop(event.call_id, None)
        if span is None:
            return
        if event.error is not None:
            self._fail(span, event.error)
        span.end(end_time=now)
        turn.mark = now
        # The next model call is due once the batch's tools have all ended.
        turn.call_due = not turn.tools
        turn.first_chunk = None

    # --- helpers -----------------------------------------------------------------------

    def _fail(self, span: Span, error: str) -> None:
        match = _EXCEPTION_NAME.match(error)
        span.set_attribute("error.type", match.group(1) if match else "_OTHER")
        span.add_event("exception", {"exception.message": error})
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, error))

    def _model(self) -> dict[str, Any]:
        """``gen_ai.request.model`` when the runtime serves one model (the bus does not say
        which model a session's call used)."""
        llm = self.runtime.services.llm
        if isinstance(llm, LlmService):
            models = llm.models()
            if len(models) != 1:
                return {}
            llm = models[0]
        model_id = getattr(llm, "id", None)
        if not isinstance(model_id, str) or not model_id:
            return {}
        return {"gen_ai.request.model": model_id, "aalis.model": entry_id(llm)}

    def close(self) -> None:
        now = time.time_ns()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            turns, self.turns = list(self.turns.values()), {}
        for turn in turns:
            for span in turn.tools.values():
                span.set_attribute("aalis.incomplete", True)
                span.end(end_time=now)
            turn.span.set_attribute("aalis.incomplete", True)
            turn.span.end(end_time=now)


def instrument(
    runtime: Observable, tracer_provider: TracerProvider | None = None
) -> Callable[[], None]:
    """Export spans for ``runtime``'s turns, model calls and tool calls through
    ``tracer_provider`` (the global one when None); returns the function that stops it.

    Raises ImportError naming the ``otel`` extra when OpenTelemetry is not installed.
    """
    trace = _otel()
    tracer = trace.get_tracer("aalis_agent", tracer_provider=tracer_provider)
    observer = _Tracer(runtime, tracer, trace)
    removers = [runtime.subscribe(t, observer.on_event) for t in TOPICS]

    def uninstrument() -> None:
        for remove in removers:
            remove()
        observer.close()

    return uninstrument
