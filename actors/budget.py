"""ACC4: the throttled budget log the runtime keeps (per session: how many usages and the
last ratio bucket), a line when the bucket changes or every tenth usage. Stateful, so it
lives with the actors that own it; the line's format is
:func:`aalis_agent.request.usage.budget_line`.

The state is kept for the sessions that used the model last, up to ``max_sessions``
(16,384 by default, about 4 MiB): a host that sees sessions come and go for weeks does not
keep one entry for every session it ever served. A session whose entry was let go starts
over as a first time (its next usage prints a line), as every session does after a
restart."""

from __future__ import annotations

import threading
from collections import OrderedDict
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
    first time included) or every 10th usage. At most ``max_sessions`` sessions are
    remembered, the least recently seen let go first."""

    def __init__(self, every: int = 10, *, max_sessions: int = 16_384) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"BudgetLog: max_sessions must be an int >= 1, not {max_sessions!r}")
        self._every = every
        self._max = max_sessions
        self._state: OrderedDict[str, _SessionState] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many sessions are remembered now."""
        return len(self._state)

    def observe(self, usage: TokenUsage, *, line: bool = True) -> str | None:
        """Count ``usage``; its line when one is due. ``line=False`` counts it only (the
        line would not be seen): the throttle moves on just the same."""
        due = self.due(usage)
        return budget_line(usage) if due and line else None

    def due(self, usage: TokenUsage) -> bool:
        """Count ``usage``; whether its line is due (the caller builds it, if seen)."""
        with self._lock:
            states = self._state
            state = states.get(usage.session_id)
            if state is None:
                state = states[usage.session_id] = _SessionState()
                if len(states) > self._max:
                    states.popitem(last=False)
            else:
                states.move_to_end(usage.session_id)
            state.count += 1
            level, _ = bucket(usage.usage_ratio)
            changed = state.last_bucket != level
            state.last_bucket = level
            return changed or state.count % self._every == 0
