"""ACC4: the throttled budget log the runtime keeps (per session: how many usages and the
last ratio bucket), a line when the bucket changes or every tenth usage. Stateful, so it
lives with the actors that own it; the line's format is
:func:`aalis_agent.request.usage.budget_line`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from aalis_agent.events import TokenUsage
from aalis_agent.request.usage import bucket, budget_line

__all__ = ["BudgetLog"]


@dataclass
class _SessionState:
    count: int = 0
    last_bucket: int | None = None


class BudgetLog:
    """ACC4: per session ``{count, lastRatioBucket}``; a line when the bucket changes (the
    first time included) or every 10th usage."""

    def __init__(self, every: int = 10) -> None:
        self._every = every
        self._state: dict[str, _SessionState] = {}
        self._lock = threading.Lock()

    def observe(self, usage: TokenUsage) -> str | None:
        with self._lock:
            return self._observe(usage)

    def _observe(self, usage: TokenUsage) -> str | None:
        state = self._state.setdefault(usage.session_id, _SessionState())
        state.count += 1
        level, _ = bucket(usage.usage_ratio)
        changed = state.last_bucket != level
        state.last_bucket = level
        if changed or state.count % self._every == 0:
            return budget_line(usage)
        return None
