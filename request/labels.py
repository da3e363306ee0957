"""Time and sender labels on user messages (open formats, see UPSTREAM-FACTS).

A label never uses relative words, so an old message's text never changes and provider
prefix caches keep hitting.
"""

from __future__ import annotations

import functools
from datetime import datetime, tzinfo

__all__ = ["sender_label", "time_label"]

SINGLE_USER_PLATFORMS = frozenset({"cli", "webui"})


def time_label(at_ms: int, now_ms: int, tz: tzinfo) -> str:
    """``M/D HH:mm`` in the current year, ``YYYY/M/D HH:mm`` in another (local time)."""
    # Kept per second of each: a turn labels its input and its context within one.
    return _label(at_ms // 1000, now_ms // 1000, tz)


@functools.lru_cache(maxsize=256)
def _label(at_s: int, now_s: int, tz: tzinfo) -> str:
    at = datetime.fromtimestamp(at_s, tz)
    now = datetime.fromtimestamp(now_s, tz)
    clock = f"{at.hour:02d}:{at.minute:02d}"
    if at.year == now.year:
        return f"{at.month}/{at.day} {clock}"
    return f"{at.year}/{at.month}/{at.day} {clock}"


def sender_label(platform: str | None, user_id: str | None, nickname: str | None) -> str:
    """``[nickname(id)]: `` (or whichever exists); none on single-user channels."""
    if platform in SINGLE_USER_PLATFORMS:
        return ""
    if nickname and user_id:
        return f"[{nickname}({user_id})]: "
    if nickname or user_id:
        return f"[{nickname or user_id}]: "
    return ""
