"""Secrets (API keys) that must never be stored or logged, and their masking.

A process-wide registry: whatever holds a secret registers it (the OpenAI-compatible
model registers its key when it is built, the model listing the key it sends), and text
that may have come back from elsewhere — a provider's error, a log line — goes through
:func:`redact` before it is stored or shown. :func:`redact_processor` does the same for
every value of a structlog event; put it after ``format_exc_info`` (it formats a
remaining ``exc_info`` itself, so the traceback's text is masked too) and before the
renderer::

    structlog.configure(processors=[..., structlog.processors.format_exc_info,
                                    redact_processor, structlog.dev.ConsoleRenderer()])

Every occurrence of every registered secret is replaced by :data:`MASK`, overlapping
ones together. Values shorter than :data:`MIN_LENGTH` are not registered: no real key is
that short, and masking them would garble ordinary text. Registering is cheap and
idempotent; :func:`redact` is a single regular-expression pass (a trie of the secrets,
however many there are) and returns its argument untouched when nothing is registered or
nothing matches.
"""

from __future__ import annotations

import re
import threading
from collections.abc import MutableMapping
from typing import Any

__all__ = ["MASK", "MIN_LENGTH", "redact", "redact_processor", "register_secret"]

MASK = "***"
MIN_LENGTH = 8

_lock = threading.Lock()
_secrets: set[str] = set()
_pattern: re.Pattern[str] | None = None  # built lazily from _secrets; None when stale


def register_secret(value: str | None) -> None:
    """Mask ``value`` from now on wherever :func:`redact` runs (empty, ``None`` and values
    shorter than :data:`MIN_LENGTH` are ignored; surrounding whitespace is not part of it)."""
    global _pattern
    if not value:
        return
    candidates = {value, value.strip()}
    with _lock:
        added = {c for c in candidates if len(c) >= MIN_LENGTH and c not in _secrets}
        if added:
            _secrets.update(added)
            _pattern = None


def _compiled() -> re.Pattern[str]:
    global _pattern
    pattern = _pattern
    if pattern is None:
        with _lock:
            if _pattern is None:
                # A lookahead finds the longest secret starting at every position, so
                # secrets that overlap are all found.
                try:
                    body = _trie(_secrets)
                    _pattern = re.compile(f"(?=({body}))")
                except RecursionError:  # secrets nested a thousand deep: no trie, then
                    longest_first = sorted(_secrets, key=len, reverse=True)
                    body = "|".join(map(re.escape, longest_first))
                    _pattern = re.compile(f"(?=({body}))")
            pattern = _pattern
    return pattern


def _trie(words: set[str]) -> str:
    """A regular expression matching any of ``words``, longest first, factored as a trie
    so that matching costs the length of the match, not the number of words."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def build(node: dict[str, Any]) -> str:
        parts: list[str] = []
        while len(node) == 1 and "" not in node:  # a chain: no alternation needed
            (ch, node), *_ = node.items()
            parts.append(re.escape(ch))
        branches = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        if branches:
            group = "(?:" + "|".join(branches) + ")"
            parts.append(group + "?" if "" in node else group)  # greedy: longest first
        return "".join(parts)

    return build(root)


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by :data:`MASK` (the same object
    when there is nothing to mask)."""
    if not _secrets or not text:
        return text
    spans: list[list[int]] = []
    for m in _compiled().finditer(text):
        start, end = m.start(), m.start() + len(m.group(1))
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)  # overlapping or adjacent: one mask
        else:
            spans.append([start, end])
    if not spans:
        return text
    out: list[str] = []
    at = 0
    for start, end in spans:
        out += (text[at:start], MASK)
        at = end
    out.append(text[at:])
    return "".join(out)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    try:
        shown = repr(value)  # what a renderer would print
    except Exception:  # pragma: no cover - a broken __repr__
        return value
    masked = redact(shown)
    return value if masked is shown else masked


def redact_processor(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: every value of the event with the registered secrets
    masked. A string stays a string; another value that would show a secret is replaced
    by its masked ``repr``. A still unformatted ``exc_info`` is formatted first (as
    ``format_exc_info`` does) so that the traceback's text is masked too."""
    if not _secrets:
        return event_dict
    if event_dict.get("exc_info"):
        from structlog.processors import format_exc_info

        event_dict = format_exc_info(logger, method_name, event_dict)
    for key in list(event_dict):
        event_dict[key] = _scrub(event_dict[key])
    return event_dict
