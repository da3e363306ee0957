"""``Batch``: builds the events of one atomic append, stamping session, seq and time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from aalis_agent.events.clock import Clock
from aalis_agent.events.schema import SessionEvent
from msgspec.structs import replace

__all__ = ["Batch"]

E = TypeVar("E", bound=SessionEvent)


class Batch:
    """Events for one append after ``last_seq``; every event gets the next seq.

    >>> batch = Batch("s1", last_seq=4, now_ms=0)
    >>> from events.schema import InputQueued
    >>> batch.add(InputQueued(input_id="in-1")).seq
    5
    """

    def __init__(
        self,
        session_id: str,
        last_seq: int,
        *,
        clock: Clock | None = None,
        now_ms: int | None = None,
    ) -> None:
        if clock is None and now_ms is None:
            raise TypeError("Batch needs a clock or now_ms")
        self.session_id = session_id
        self.expected_seq = last_seq
        self.now_ms: Callable[[], int] = (
            clock.now_ms if clock is not None else _fixed(now_ms)  # type: ignore[arg-type]
        )
        """The time each event added is stamped with: the clock read per event, or the
        fixed ``now_ms``."""
        self.events: list[SessionEvent] = []

    @property
    def last_seq(self) -> int:
        """The seq of the newest event in the batch (``expected_seq`` when empty)."""
        return self.expected_seq + len(self.events)

    def add(self, event: E) -> E:
        """Stamp ``event`` with this batch's session, the next seq and the time, and add
        it; returns the stamped event. The event is built typed by the caller
        (``InputQueued(input_id=...)``), so a misspelled field is a type error."""
        events = self.events
        seq = self.expected_seq + len(events) + 1  # last_seq + 1, without the call
        stamped = replace(event, session_id=self.session_id, seq=seq, at=self.now_ms())
        events.append(stamped)
        return stamped

    def __len__(self) -> int:
        return len(self.events)


def _fixed(now_ms: int) -> Callable[[], int]:
    def fixed() -> int:
        return now_ms

    return fixed
