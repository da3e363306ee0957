"""Text clean-up for model output and tool results (FLOW10, CFG4).

One truncation rule for every cut (UPSTREAM-FACTS): the kept start, then the visible
``TRUNCATED_SUFFIX`` naming the original length in characters. ``truncate`` cuts by
characters (the trim's character thresholds); ``truncate_to_tokens`` cuts by the token
counter in use (``toolResultMaxRatio`` is a share of the context window in tokens).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from aalis_agent.request.texts import TRUNCATED_SUFFIX
from aalis_agent.request.tokens import EstimateCounter, TiktokenCounter, TokenCounter

__all__ = ["strip_leaked_special_tokens", "truncate", "truncate_to_tokens"]

_CHARS_PER_TOKEN = 8
"""How far ``truncate_to_tokens`` looks first before encoding a whole text: natural text
and code run well under eight characters a token, so a start this long, ``max_tokens`` +
1 tokens' worth, usually proves an over-long text over budget by itself. A start that
does not is doubled, while it is at most half the text: a text of more characters a
token (a run of 64-byte tokens such as dashes) is then proven over budget by a start a
few times its budget's worth, never by encoding all of it."""

# Tool-call markup that some servers leak into the text of an OpenAI-compatible reply:
# whole tool-call sections first, then stray special tokens. Nothing else is rewritten.
_SECTIONS = re.compile(
    r"<\|tool▁calls▁begin\|>.*?(?:<\|tool▁calls▁end\|>|$)"
    r"|<tool_call>.*?(?:</tool_call>|$)"
    r"|<\|tool_calls_section_begin\|>.*?(?:<\|tool_calls_section_end\|>|$)"
    r"|\[TOOL_CALLS\]\s*\[.*?\](?=\s|$)",
    re.DOTALL,
)
_TOKENS = re.compile(
    r"<\|(?:tool▁[a-z▁]+|tool_call[a-z_]*|tool_calls[a-z_]*|im_start|im_end|"
    r"python_tag|eom_id|eot_id|start_header_id|end_header_id|endoftext|"
    r"fim_prefix|fim_middle|fim_suffix|endofprompt|begin_of_text|end_of_text)\|>"
)


def strip_leaked_special_tokens(text: str) -> str:
    """Remove leaked tool-call sections and special tokens; only strip, never execute."""
    if "<" not in text and "[TOOL_CALLS]" not in text:
        return text
    cleaned = _TOKENS.sub("", _SECTIONS.sub("", text))
    return cleaned.strip() if cleaned != text else text


def truncate(text: str, max_chars: int, *, suffix: str = TRUNCATED_SUFFIX) -> str:
    """Cut ``text`` to ``max_chars`` with a visible suffix naming the original length
    (``suffix``: the locale's template, with ``{length}``)."""
    if max_chars < 0 or len(text) <= max_chars:
        return text
    return text[:max_chars] + suffix.format(length=len(text))


def truncate_to_tokens(
    text: str,
    max_tokens: int,
    counter: TokenCounter,
    *,
    min_chars: int = 0,
    suffix: str = TRUNCATED_SUFFIX,
) -> str:
    """Cut ``text`` so that the whole result, visible suffix included, costs at most
    ``max_tokens`` by ``counter``; ``text`` itself when it fits (or ``max_tokens < 0``).

    The kept start is the longest found whose cut fits: a galloping search from the
    proportional guess, then bisection, counting only candidate cuts (each about the size
    of the result), never re-encoding per character. A text far longer than the budget
    whose start alone is already over it is not encoded in full at all. Every returned
    cut was counted and fits. ``min_chars`` is a floor that wins over the budget (the trim
    keeps 200 characters of a shrunk block); without one, when even the bare suffix is
    over budget the result is the longest plain start that fits.
    """
    if max_tokens < 0 or _fits_unencoded(text, max_tokens, counter):
        return text
    n = len(text)
    window = _CHARS_PER_TOKEN * (max_tokens + 1)
    end = total = 0
    while n > 2 * window:
        start = counter.count(text[:window])
        if start > max_tokens:
            # Over budget within its first ``window`` characters, with more than as much
            # again after them: cut inside that start, never encoding the whole text.
            end, total = window, start
            break
        window *= 2
    if not end:
        total = counter.count(text)
        if total <= max_tokens:
            return text
        end = n
    floor = max(min_chars, 0)
    if floor >= n:
        return text  # no cut keeps that much and is shorter
    suffix = suffix.format(length=n)

    def fits(k: int) -> bool:
        return counter.count(text[:k] + suffix) <= max_tokens

    if not fits(floor):
        if floor > 0:
            return text[:floor] + suffix
        # Not even the suffix fits: the budget wins, the longest plain start that fits.
        return text[: _longest(lambda k: counter.count(text[:k]) <= max_tokens, 0, end, 0)]
    share = max(max_tokens - counter.count(suffix), 0) / total
    return text[: _longest(fits, floor, end, int(end * share))] + suffix


def _fits_unencoded(text: str, max_tokens: int, counter: TokenCounter) -> bool:
    """Whether ``text`` is known to cost at most ``max_tokens`` without counting it: by
    the counters that never count more tokens than the text has UTF-8 bytes. Every token
    of a tiktoken encoding is at least one byte (cl100k_base: 1 to 128), and the
    estimate's 1.5 a CJK character (three bytes) and ⌈len/3.5⌉ a run of others are at
    most that too. A character is at least one byte: a text longer than the budget in
    characters is not decided here."""
    if len(text) > max_tokens or not isinstance(counter, TiktokenCounter | EstimateCounter):
        return False
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return size <= max_tokens


def _longest(fits: Callable[[int], bool], lo: int, hi: int, guess: int) -> int:
    """The largest ``k`` found in ``[lo, hi)`` with ``fits(k)``, given ``fits(lo)`` and
    taking ``hi`` as not fitting: gallop from ``guess`` towards the boundary, then bisect.
    Only ``fits`` results are trusted, so a counter that is not quite monotone (tiktoken
    merges across the cut) still yields a cut that was counted and fits."""
    k = min(max(guess, lo + 1), hi - 1)
    if k <= lo:
        return lo
    step = max((k - lo) // 16, 1)
    if fits(k):
        lo = k
        while lo + step < hi:  # up, doubling the step
            if not fits(lo + step):
                hi = lo + step
                break
            lo += step
            step *= 2
    else:
        hi = k
        while hi - step > lo:  # down, doubling the step
            if fits(hi - step):
                lo = hi - step
                break
            hi -= step
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
