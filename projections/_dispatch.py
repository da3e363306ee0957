"""Table dispatch for folds: one handler per event type, checked to be complete.

A fold must handle every event type; ``match`` with ``assert_never`` says so to the
type checker but tests the cases one by one, which costs more than the rest of a fold
on long replays. Here each projection maps *every* ``SessionEvent`` type to a handler
(``keep`` for the types it ignores); :func:`check_complete` runs at import, so a new
event type without a decision fails loudly at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, get_args

from aalis_agent.events.schema import SessionEvent

__all__ = ["EVENT_TYPES", "Handler", "check_complete", "fold", "keep"]

S = TypeVar("S")
Handler = Callable[[S, Any], S]

EVENT_TYPES: frozenset[type] = frozenset(get_args(SessionEvent))


def keep(state: S, event: object) -> S:
    """The handler of an event type a projection ignores."""
    return state


def check_complete(name: str, handlers: Mapping[type, object]) -> None:
    """Raise unless ``handlers`` decides every event type and nothing else."""
    missing = EVENT_TYPES - handlers.keys()
    extra = handlers.keys() - EVENT_TYPES
    if missing or extra:
        raise TypeError(
            f"projection {name}: no handler for {sorted(t.__name__ for t in missing)}; "
            f"not events: {sorted(t.__name__ for t in extra)}"
        )


def fold(handlers: Mapping[type, Handler[S]], state: S, events: Iterable[SessionEvent]) -> S:
    """Fold ``events`` into ``state`` through a complete handler table."""
    for event in events:
        state = handlers[type(event)](state, event)
    return state
