"""The inputs a session received, by id, and how each was handled: a fold of the log that
lets a submit recognise an input sent again after its turn is over (or after it was
released) and answer it with that outcome instead of running it twice.

An input sent again must be the one its submitter sent the first time (:func:`same_input`):
when the input hooks (preprocessors, ``agent:input:before``) changed it before it was
recorded, the log holds the submitter's input's :func:`sent_digest` with it, and the input
sent again is compared with that, not with what the hooks made of it.

Unlike the other projections this one is folded in place (:meth:`InputIds.fold`): a
session keeps the last :data:`KEEP_INPUT_IDS` ids, and rebuilding a dict of that size
for every event a decision adds would cost the size of the dict per event. Its owner
folds only events that are durable (after their batch commits), and rebuilds it from the
log when the session starts, as it rebuilds the view. No I/O, no clock, no threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec
from aalis_agent.events.schema import (
    Input,
    InputJoined,
    InputReceived,
    InputReleased,
    InputRequeued,
    MessageSaved,
    SessionEvent,
    TurnRecorded,
)

__all__ = [
    "KEEP_INPUT_IDS",
    "Handled",
    "InputIds",
    "digest",
    "same_input",
    "sent_digest",
    "unchanged",
]

KEEP_INPUT_IDS = 10_000
"""How many input ids a session remembers (the most recently received ones). An id older
than that is forgotten once its input ended: an input sent again under it is taken as a
new one. An input still waiting or running is never forgotten: the memory then holds
more, as the queue does (at most the limit plus twice the inputs waiting)."""


def digest(inp: Input) -> int:
    """What must match for an input to be the same one sent again: all of it but the time
    it was stamped with and the gateway's delivery number (a hash, kept instead of the
    input's text; it is computed in this process only, never stored)."""
    return hash(msgspec.structs.replace(inp, timestamp=None, gateway_seq=None))


_encode = msgspec.msgpack.Encoder(order="deterministic").encode


def sent_digest(inp: Input) -> str:
    """A digest of an input as its submitter sent it, recorded with the input
    (``InputReceived.sent_digest``) when the input hooks changed it: stable across
    processes (BLAKE2b, 128 bits, of its encoding), and, as :func:`digest`, of all of it
    but the time and the gateway's delivery number, and also but its id (an input is
    looked up by the id it was recorded under, which a hook may have given it)."""
    bare = msgspec.structs.replace(inp, id="", timestamp=None, gateway_seq=None)
    return hashlib.blake2b(_encode(bare), digest_size=16).hexdigest()


def unchanged(sent: Input, recorded: Input) -> bool:
    """Whether the input hooks left ``sent`` as it was (``recorded``), as far as
    :func:`sent_digest` reads it (its id, time and delivery number aside)."""
    skip = {"id": "", "timestamp": None, "gateway_seq": None}
    return msgspec.structs.replace(sent, **skip) == msgspec.structs.replace(recorded, **skip)


class Handled(msgspec.Struct, frozen=True, gc=False):
    """One input received: its :func:`digest`, the turn it entered (its last one), and
    once it is over, how: the turn's outcome, reason and the seq of its reply (the
    ``MessageSaved`` holding the text, read back from the log when an input is sent again:
    the texts of 10,000 replies are not kept), or ``released`` with the release's reason.
    ``outcome`` is None while it waits or runs. ``sent``: the :func:`sent_digest` of the
    input as its submitter sent it, when the input hooks changed it (None: as received)."""

    digest: int
    turn_id: str | None = None
    outcome: str | None = None
    reason: str | None = None
    reply_seq: int | None = None
    sent: str | None = None


def same_input(handled: Handled, inp: Input) -> bool:
    """Whether ``inp``, as its submitter sends it under the id ``handled`` was received
    under, is the input received then: what its submitter sent then when the input hooks
    changed that (:func:`sent_digest`), else the input as received (:func:`digest`)."""
    if handled.sent is not None:
        return sent_digest(inp) == handled.sent
    return digest(inp) == handled.digest


class InputIds:
    """The last ``limit`` input ids a session received (default :data:`KEEP_INPUT_IDS`)
    and how each was handled, in the order they were received."""

    __slots__ = ("_by_id", "_limit", "_replies", "_turns")

    def __init__(self, limit: int | None = None) -> None:
        self._limit = KEEP_INPUT_IDS if limit is None else limit
        if self._limit < 1:
            raise ValueError(f"an input id memory needs a limit >= 1, not {self._limit}")
        self._by_id: dict[str, Handled] = {}
        self._turns: dict[str, list[str]] = {}  # the input ids in each unrecorded turn
        self._replies: dict[str, int] = {}  # an unrecorded turn's reply: its seq

    @classmethod
    def of(cls, events: Iterable[SessionEvent], limit: int | None = None) -> InputIds:
        """Fold a whole log."""
        ids = cls(limit)
        ids.fold(events)
        return ids

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, input_id: object) -> bool:
        return input_id in self._by_id

    def get(self, input_id: str) -> Handled | None:
        """How the input received under ``input_id`` was handled, if it is remembered."""
        return self._by_id.get(input_id)

    def fold(self, events: Iterable[SessionEvent]) -> None:
        """Fold durable events in (they must follow those folded before)."""
        by_id, turns, replies = self._by_id, self._turns, self._replies
        for event in events:
            kind = type(event)
            if kind is MessageSaved:  # the commonest: only a turn's reply matters here
                m = event.message  # type: ignore[union-attr]
                meta = m.meta
                if m.role == "assistant" and meta.turn_record is not None and meta.turn_id:
                    replies[meta.turn_id] = event.seq
            elif kind not in _FOLDED:
                continue
            elif kind is InputReceived:
                inp = event.input  # type: ignore[union-attr]
                if by_id.pop(inp.id, None) is None:
                    # The oldest are forgotten, once they ended: one still waiting or
                    # running is kept (past the limit, as long as it waits, however many
                    # wait: the queue holds them too) so that, sent again after it ran,
                    # it is answered rather than run twice.
                    limit, moved = self._limit, 0
                    while len(by_id) >= limit:
                        oldest = next(iter(by_id))
                        kept = by_id[oldest]
                        if kept.outcome is None:
                            if moved == 2:
                                break  # a run still waiting: held, as the queue holds it
                            moved += 1
                            del by_id[oldest]  # put last, to be forgotten after it ends
                            by_id[oldest] = kept
                            continue
                        del by_id[oldest]
                sent = event.sent_digest  # type: ignore[union-attr]
                by_id[inp.id] = Handled(digest(inp), sent=sent)
            elif kind is InputJoined:
                input_id, turn_id = event.input_id, event.turn_id  # type: ignore[union-attr]
                found = by_id.get(input_id)
                if found is not None:
                    by_id[input_id] = Handled(found.digest, turn_id, sent=found.sent)
                joined = turns.get(turn_id)
                if joined is None:
                    turns[turn_id] = [input_id]
                else:
                    joined.append(input_id)
            elif kind is TurnRecorded:
                turn_id = event.turn_id  # type: ignore[union-attr]
                reply = replies.pop(turn_id, None)
                outcome, reason = event.outcome, event.reason  # type: ignore[union-attr]
                for input_id in turns.pop(turn_id, ()):
                    found = by_id.get(input_id)
                    if found is not None and found.turn_id == turn_id:
                        by_id[input_id] = Handled(
                            found.digest, turn_id, outcome, reason, reply, found.sent
                        )
            elif kind is InputReleased:
                input_id = event.input_id  # type: ignore[union-attr]
                found = by_id.get(input_id)
                if found is not None:
                    by_id[input_id] = Handled(
                        found.digest,
                        None,
                        "released",
                        event.reason,  # type: ignore[union-attr]
                        sent=found.sent,
                    )
            else:  # InputRequeued: back in the queue, not answered by that turn
                joined = turns.get(event.turn_id)  # type: ignore[union-attr]
                if joined is not None and event.input_id in joined:  # type: ignore[union-attr]
                    joined.remove(event.input_id)  # type: ignore[union-attr]


_FOLDED = frozenset({InputReceived, InputJoined, TurnRecorded, InputReleased, InputRequeued})
"""The event types :meth:`InputIds.fold` reads besides ``MessageSaved``."""
