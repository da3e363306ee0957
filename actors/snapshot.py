"""``token:request`` (ACC3): a usage snapshot built exactly like a real turn's request.

Same read of the history, same prompt, same trim (as a snapshot: the continuation hint
goes at the end), but no logs, no events, no turn id, and ``used`` is the estimate.
The platform is the caller's, else the session's origin platform, else ``webui``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aalis_agent.actors.request import add_contributions, base_prompt, call_usage, trim_call
from aalis_agent.events import TokenUsage
from aalis_agent.projections import turns
from aalis_agent.request.prompt import (
    assemble_at,
    volatile_for,
)

if TYPE_CHECKING:
    from aalis_agent.actors.runtime import Runtime

__all__ = ["snapshot_platform", "token_request"]


def snapshot_platform(runtime: Runtime, session_id: str, platform: str | None) -> str:
    """ACC3: explicit, else the origin platform (a child's from its root), else webui."""
    if platform:
        return platform
    sessions = runtime.services.sessions
    info = sessions.info(session_id)
    seen = {session_id}
    while info.parent_id is not None and info.parent_id not in seen:
        seen.add(info.parent_id)
        info = sessions.info(info.parent_id)
    return info.origin_platform or "webui"


def token_request(runtime: Runtime, session_id: str, platform: str | None = None) -> TokenUsage:
    """Build the snapshot for ``session_id``; reads the session, writes nothing."""
    services = runtime.services
    view = runtime.view(session_id)
    where = snapshot_platform(runtime, session_id, platform)
    info = services.sessions.info(session_id)
    last = turns.last_opened(view.turns)  # a turn now would be read for the same venue
    venue = (last.venue if last else None) or info.venue
    settings = services.resolver.for_turn(session_id, where, view.settings, venue)
    now = runtime.clock.now_ms()
    tz = services.tz
    texts = services.texts_for(where, venue)
    prompt, persona, history = base_prompt(
        services, session_id, view.history, settings, now, exclude_turn=None, texts=texts
    )
    prompt.volatile = volatile_for(now, tz, where, info.multi_party, texts=texts)
    add_contributions(
        runtime.hooks,
        services,
        prompt,
        session_id=session_id,
        user_id=None,
        platform=where,
        trigger_type=None,
        dry_run=True,
    )
    messages, at = assemble_at(prompt)
    tools = [t.definition() for t in services.tools.available(settings.tool_groups)]
    llm = services.models.resolve(settings.model, warn=False).model
    # The same trim and the same accounting as a turn's call (actors/request.py).
    call = trim_call(
        services, llm, messages, tools, history, snapshot=True, texts=texts, history_at=at
    )
    return call_usage(
        llm,
        call,
        session_id=session_id,
        turn_id=None,
        platform=where,
        persona=persona,
        provider_input_tokens=None,  # a snapshot is an estimate
        trimmed=call.result.trimmed,
        history_messages=history.active,
    )
