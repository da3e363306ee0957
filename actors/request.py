"""Building a model request from a session's state: the parts a turn's model call and a
``token:request`` snapshot share (FLOW3-FLOW6), so the two cannot drift apart."""

from __future__ import annotations

from aalis_agent.actors.hooks import ContributionView, Hooks
from aalis_agent.events import TurnSettings
from aalis_agent.projections.history import HistoryState
from aalis_agent.projections.prompt import (
    Block,
    TurnPrompt,
    assemble,
    render_history,
    system_prompt,
)
from aalis_agent.services import Services

__all__ = ["add_contributions", "base_prompt"]


def base_prompt(
    services: Services,
    session_id: str,
    state: HistoryState,
    settings: TurnSettings,
    now: int,
    *,
    exclude_turn: str | None,
) -> tuple[TurnPrompt, str | None, int]:
    """FLOW3-FLOW4, shared by turns and ``token:request`` snapshots: the system prompt and
    the history read from memory. Returns the prompt, the persona text and the number of
    active history messages."""
    persona = services.persona.prompt(settings.persona) if services.persona else None
    memory = services.memory  # FLOW4: the history window comes from memory
    window = memory.window(session_id, state, settings.history_limit, exclude_turn)
    prompt = TurnPrompt(
        system=system_prompt(persona, services.config.system_prompt),
        history=render_history(window, now, services.tz),
    )
    return prompt, persona, memory.count_history(session_id, state, exclude_turn)


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
    view = ContributionView(
        session_id=session_id,
        user_id=user_id,
        platform=platform,
        trigger_type=trigger_type,
        dry_run=dry_run,
        messages=tuple(assemble(prompt)),
    )
    for built in hooks.build_contributions(view, services.config.prompt_build_timeout_ms):
        c = built.contribution
        prompt.blocks.extend(Block(c.anchor, c.injector, text) for text in built.blocks)
