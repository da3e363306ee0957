"""Building a model request from a session's state: the parts a turn's model call and a
``token:request`` snapshot share (FLOW3-FLOW6), so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from aalis_agent.actors.history_cache import HistoryCache, PreparedHistory
from aalis_agent.actors.hooks import ContributionView, Hooks
from aalis_agent.events import ChatMessage, TokenUsage, TurnSettings
from aalis_agent.events.codec import clean_text
from aalis_agent.projections.history import HistoryState
from aalis_agent.request.prompt import (
    Block,
    TurnPrompt,
    assemble_at,
    render_history,
    split_parts,
    system_prompt,
)
from aalis_agent.request.texts import Texts
from aalis_agent.request.tokens import default_counter, tool_definition_tokens
from aalis_agent.request.trim import TrimRequest, TrimResult, trim, trim_budget
from aalis_agent.request.usage import breakdown, usage_payload
from aalis_agent.services import Services
from aalis_agent.services.llm import ChatModel
from aalis_agent.services.memory import ProjectionMemory

__all__ = ["TrimmedCall", "add_contributions", "base_prompt", "call_usage", "trim_call"]


def base_prompt(
    services: Services,
    session_id: str,
    state: HistoryState,
    settings: TurnSettings,
    now: int,
    *,
    exclude_turn: str | None,
    cache: HistoryCache | None = None,
    texts: Texts | None = None,
) -> tuple[TurnPrompt, str | None, PreparedHistory]:
    """FLOW3-FLOW4, shared by turns and ``token:request`` snapshots: the system prompt and
    the history read from memory. Returns the prompt, the persona text and the prepared
    history (what was sent as history, its token prefix sums when known, and the number of
    active history messages). With the session's ``cache`` and the default memory, the
    history is extended by what was archived since the last turn instead of read whole.
    ``texts``: the turn's locale (default: the runtime's)."""
    persona = _persona_text(services, settings.persona)
    memory = services.memory  # FLOW4: the history window comes from memory
    limit = settings.history_limit
    if cache is not None and type(memory) is ProjectionMemory:
        prepared = cache.prepare(state, limit, exclude_turn, now, services.tz)
    else:
        window = memory.window(session_id, state, limit, exclude_turn)
        prepared = PreparedHistory(
            messages=render_history(window, now, services.tz),
            active=memory.count_history(session_id, state, exclude_turn),
        )
    prompt = TurnPrompt(
        system=system_prompt(persona, services.config.system_prompt, texts=texts or services.texts),
        history=prepared.messages,
    )
    return prompt, persona, prepared


def _persona_text(services: Services, persona_id: str | None) -> str | None:
    """The persona's prompt as it can be sent (lone surrogates replaced, as any text the
    log or a provider's encoder takes), or a TypeError naming a persona service that gave
    other than text."""
    if services.persona is None:
        return None
    text = services.persona.prompt(persona_id)
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError(
            f"the persona service gave {type(text).__name__} for persona {persona_id!r}, not text"
        )
    return clean_text(text)


def add_contributions(
    hooks: Hooks,
    services: Services,
    prompt: TurnPrompt,
    *,
    session_id: str,
    user_id: str | None,
    platform: str | None,
    trigger_type: str | None,
    dry_run: bool,
) -> None:
    """FLOW6: build the ``agent:prompt`` contributions and place their blocks."""
    if not hooks.has_contributions():
        return  # nothing to build: the request is not assembled for them
    view = ContributionView(
        session_id=session_id,
        user_id=user_id,
        platform=platform,
        trigger_type=trigger_type,
        dry_run=dry_run,
        messages=assemble_at(prompt)[0],
    )
    for built in hooks.build_contributions(view, services.config.prompt_build_timeout_ms):
        c = built.contribution
        prompt.blocks.extend(Block(c.anchor, c.injector, text) for text in built.blocks)


class TrimmedCall(msgspec.Struct, frozen=True):
    """A request trimmed to its budget (FLOW9): the result with its trace, the budget,
    and what the tool definitions cost (counted once per call)."""

    result: TrimResult
    budget: int
    tool_tokens: int


def trim_call(
    services: Services,
    llm: ChatModel,
    messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]],
    history: PreparedHistory,
    *,
    protected: frozenset[str] = frozenset(),
    snapshot: bool = False,
    texts: Texts | None = None,
    history_at: int | None = None,
) -> TrimmedCall:
    """FLOW9 for a turn's call and a ``token:request`` snapshot alike: the budget from the
    model and the plugin config, the list split into head, history and turn, the five-step
    trim (TRIM). ``snapshot`` puts the continuation hint at the end (no inputs). When the
    history part is the prepared history unchanged, its token prefix sums are reused.
    ``texts``: the locale of what the trim adds (default: the runtime's).
    ``history_at``: where ``messages`` holds the prepared history unchanged, when the
    caller knows it (``prompt.assemble_at`` built the list and no hook saw it); the
    history is then not compared message by message."""
    config = services.config
    budget = trim_budget(llm.context_length, llm.max_output_tokens, config.trim_threshold_ratio)
    head, hist, rest = split_parts(messages, history.ids, history.messages, at=history_at)
    prefix = history.prefix if hist is history.messages else None
    counter = default_counter()
    tool_tokens = tool_definition_tokens(counter, tools)
    result = trim(
        TrimRequest(
            head=head,
            history=hist,
            turn=rest,
            budget=budget,
            memory_budget=config.memory_token_budget,
            protected=protected,
            tool_tokens=tool_tokens,
            snapshot=snapshot,
            history_prefix=prefix,
            whole=messages,
            texts=texts or services.texts,
        ),
        counter,
    )
    return TrimmedCall(result, budget, tool_tokens)


def call_usage(
    llm: ChatModel,
    call: TrimmedCall,
    *,
    session_id: str,
    turn_id: str | None,
    platform: str | None,
    persona: str | None,
    provider_input_tokens: int | None,
    trimmed: bool,
    history_messages: int,
) -> TokenUsage:
    """ACC2-ACC3: ``token:usage`` of a trimmed request, for a turn's call and a snapshot
    alike. The parts are counted on what is sent (the history's cost is known from the
    trim); ``used`` is the provider's input tokens when given, else the estimate."""
    counter = default_counter()
    result = call.result
    counts = None
    if result.head_counts is not None and result.turn_counts is not None:
        counts = [*result.head_counts, *result.turn_counts]  # counted by the trim
    parts = breakdown(
        counter,
        [*result.head, *result.turn],
        counts=counts,
        history_ids=frozenset(),
        persona_tokens=counter.count(persona) if persona else 0,
        tool_defs_tokens=call.tool_tokens,
        reserved=llm.max_output_tokens,
        history_tokens=result.history_tokens,
    )
    return usage_payload(
        session_id=session_id,
        turn_id=turn_id,
        platform=platform,
        context_window=llm.context_length,
        max_tokens=llm.max_output_tokens,
        token_budget=call.budget,
        provider_input_tokens=provider_input_tokens,
        estimate=result.tokens_after,
        trimmed=trimmed,
        untrimmed_history=result.untrimmed_history,
        history_messages=history_messages,
        parts=parts,
    )
