"""Time and sender labels on user messages (open formats, see UPSTREAM-FACTS).

A label never uses relative words, so an old message's text never changes and provider
prefix caches keep hitting.
"""

from __future__ import annotations

from datetime import datetime, tzinfo

__all__ = ["sender_label", "time_label"]

SINGLE_USER_PLATFORMS = frozenset({"cli", "webui"})


def time_label(at_ms: int, now_ms: int, tz: tzinfo) -> str:
    """``M/D HH:mm`` in the current year, ``YYYY/M/D HH:mm`` in another (local time)."""
    at = datetime.fromtimestamp(at_ms / 1000, tz)
    now = datetime.fromtimestamp(now_ms / 1000, tz)
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
