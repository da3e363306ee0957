"""The history part of a session's requests, prepared incrementally (FLOW4, SET4, TRIM).

Every model call sends the session's history: the active history without the turn in
flight, its ``historyLimit`` window, tool calls grouped with their results, user messages
labelled, replies with their visible text, and (for trimming) the token prefix sums of
all that. Computed from scratch, each of these walks the whole history on every turn.

:class:`HistoryCache` keeps them for one session, owned by its actor and dropped with it
(passivation frees it): a turn extends them by the messages archived since the last one.
It gives exactly what the pure functions give (``history.history_window``,
``prompt.render_history``, ``tokens.message_tokens``), and falls back to them whenever
the history did not just grow: after a clear or a compaction, when the window start moves,
when the time zone or the current year changes, or when a turn's own messages would have
to be taken out of what was already prepared.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from operator import attrgetter

from aalis_agent.events.schema import ChatMessage
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.history import HistoryState, window_start
from aalis_agent.request.prompt import render_message
from aalis_agent.request.tokens import TokenCounter, message_tokens

__all__ = ["HistoryCache", "PreparedHistory"]

_id = attrgetter("id")


class _Ids:
    """Whether an id is among a prepared history's messages: asked of the cache's live
    index while that still describes this very history (a version check before and after
    the lookup, as a seqlock does), else of a set built once. Trimming asks about a few
    messages per call; building the set would walk the whole history."""

    __slots__ = ("_grouper", "_messages", "_set", "_version")

    def __init__(
        self, messages: Sequence[ChatMessage], grouper: _Grouper | None, version: int
    ) -> None:
        self._messages = messages
        self._grouper = grouper
        self._version = version
        self._set: frozenset[str] | None = None

    def __contains__(self, item: object) -> bool:
        grouper = self._grouper
        if grouper is not None and grouper.version == self._version:
            found = item in grouper.ids
            if grouper.version == self._version:
                return found
        if self._set is None:
            self._set = frozenset(map(_id, self._messages))
        return item in self._set


@dataclass(slots=True)
class PreparedHistory:
    """The history as sent, with what trimming and accounting need of it.

    ``prefix`` holds the token prefix sums of ``messages`` (``len(messages) + 1`` items)
    when known; ``active`` is the number of messages in the active history (the window's
    source, ``count_history``)."""

    messages: Sequence[ChatMessage]
    active: int
    prefix: Sequence[int] | None = None
    _ids: _Ids | None = field(default=None, repr=False)

    @property
    def ids(self) -> Container[str]:
        """The ids of the messages sent as history, for membership tests."""
        if self._ids is None:
            self._ids = _Ids(self.messages, None, 0)
        return self._ids


class _Grouper:
    """``history.group_tool_calls`` over a sequence that only grows, with the messages
    as sent and their token prefix sums kept alongside.

    Each source message emits in place: nothing for a result, itself for other messages,
    itself and its results for an assistant message whose calls are all answered, nothing
    while a call is unanswered. Only an unanswered group's emission can change later (when
    its last result arrives); then the output is rebuilt from that group on."""

    def __init__(self, counter: TokenCounter, now_ms: int, tz: tzinfo) -> None:
        self.counter = counter
        self.now_ms = now_ms
        self.tz = tz
        self.src: list[ChatMessage] = []
        self.open_calls: dict[str, list[int]] = {}
        self.waiting: dict[int, int] = {}
        self.answers: dict[int, list[int]] = {}
        self.pos: list[int] = []  # output length before each source message's emission
        # A user message without its own time is labelled with the time of the request:
        # such a history is rendered again for every request.
        self.now_dependent = False
        self.out: list[ChatMessage] = []  # as sent (rendered)
        # Machine integers: a request's snapshot of them is one copy of memory, not a
        # walk over as many int objects as the history has messages.
        self.prefix = array("q", (0,))
        self.ids: dict[str, int] = {}  # id -> how many of ``out`` carry it
        self.version = 0  # odd while changing (see ``_Ids``)

    def extend(self, messages: Sequence[ChatMessage]) -> None:
        self.version += 1
        try:
            self._extend(messages)
        finally:
            self.version += 1

    def _extend(self, messages: Sequence[ChatMessage]) -> None:
        src, open_calls, waiting, answers = self.src, self.open_calls, self.waiting, self.answers
        redo = len(src)
        for m in messages:
            i = len(src)
            src.append(m)
            if m.role == "tool":
                stack = open_calls.get(m.tool_call_id or "")
                if stack:
                    owner = stack.pop()
                    answers[owner].append(i)
                    waiting[owner] -= 1
                    if waiting[owner] == 0 and owner < redo:
                        redo = owner  # a group from an earlier extension is complete now
            elif m.role == "assistant" and m.tool_calls:
                waiting[i] = len(m.tool_calls)
                answers[i] = []
                for call in m.tool_calls:
                    open_calls.setdefault(call.id, []).append(i)
        self._emit_from(redo)

    def _emit_from(self, start: int) -> None:
        src, waiting, answers = self.src, self.waiting, self.answers
        if start < len(self.pos):
            keep = self.pos[start]
            ids = self.ids
            for m in self.out[keep:]:
                if ids[m.id] == 1:
                    del ids[m.id]
                else:
                    ids[m.id] -= 1
            del self.out[keep:]
            del self.prefix[keep + 1 :]
            del self.pos[start:]
        for i in range(start, len(src)):
            self.pos.append(len(self.out))
            m = src[i]
            if m.role == "tool":
                continue
            left = waiting.get(i)
            if left is None:
                self._add(m)
            elif left == 0:
                self._add(m)
                for j in answers[i]:
                    self._add(src[j])

    def _add(self, m: ChatMessage) -> None:
        if m.role == "user" and m.meta.timestamp is None:
            self.now_dependent = True
        sent = render_message(m, self.now_ms, self.tz)
        self.out.append(sent)
        self.ids[sent.id] = self.ids.get(sent.id, 0) + 1
        self.prefix.append(self.prefix[-1] + message_tokens(self.counter, sent))


class HistoryCache:
    """One session's prepared history, extended turn by turn (see the module docstring).

    Owned by the session's actor and used by its turn runners (one at a time); a lock
    keeps two preparations from interleaving."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        self._lock = threading.Lock()
        self.rebuilds = 0  # preparations that started over (for tests and benchmarks)
        self._read(Chain(), 0)

    def _read(self, chain: Chain[ChatMessage], active_from: int) -> None:
        """Start over from the log's side: nothing of ``chain`` read yet."""
        self._chain = chain
        self._active_from = active_from
        self._seen = 0  # active messages read from the chain
        self._active: list[ChatMessage] = []  # the active history, without excluded ones
        self._turns: set[str] = set()  # turn ids among them
        self._excluded_turn: str | None = None
        self._excluded = 0
        self._grouper: _Grouper | None = None
        self._key: tuple[int, int, int, tzinfo] | None = None  # start, limit, year, tz

    def prepare(
        self,
        state: HistoryState,
        limit: int,
        exclude_turn: str | None,
        now_ms: int,
        tz: tzinfo,
    ) -> PreparedHistory:
        """The history sent under ``historyLimit`` = ``limit`` without ``exclude_turn``'s
        messages, rendered at ``now_ms``, with its token prefix sums."""
        with self._lock:
            return self._prepare(state, limit, exclude_turn, now_ms, tz)

    def _prepare(
        self,
        state: HistoryState,
        limit: int,
        exclude_turn: str | None,
        now_ms: int,
        tz: tzinfo,
    ) -> PreparedHistory:
        chain = state.messages
        if not (
            chain.extends(self._chain)
            and state.active_from == self._active_from
            and (self._excluded == 0 or exclude_turn == self._excluded_turn)
            and (exclude_turn is None or exclude_turn not in self._turns)
        ):
            if self._seen:
                self.rebuilds += 1
            self._read(chain, state.active_from)
        self._chain = chain
        new = chain[state.active_from + self._seen :]
        # The turn in flight's own messages at the end are left unread: the next turn
        # reads them as history.
        end = len(new)
        if exclude_turn is not None:
            while end and new[end - 1].meta.turn_id == exclude_turn:
                end -= 1
        self._seen += end
        added: list[ChatMessage] = []
        for m in new[:end]:
            turn_id = m.meta.turn_id
            if exclude_turn is not None and turn_id == exclude_turn:
                self._excluded += 1
                self._excluded_turn = exclude_turn
                continue
            if turn_id is not None:
                self._turns.add(turn_id)
            added.append(m)
        self._active.extend(added)
        start = window_start(len(self._active), limit)
        key = (start, limit, datetime.fromtimestamp(now_ms / 1000, tz).year, tz)
        grouper = self._grouper
        if grouper is None or key != self._key or grouper.now_dependent:
            if grouper is not None:
                self.rebuilds += 1
            self._key = key
            grouper = self._grouper = _Grouper(self._counter, now_ms, tz)
            grouper.extend(self._active[start:])
        else:
            grouper.extend(added)
        messages = tuple(grouper.out)
        return PreparedHistory(
            messages=messages,
            active=len(self._active),
            prefix=grouper.prefix[:],
            _ids=_Ids(messages, grouper, grouper.version),
        )
