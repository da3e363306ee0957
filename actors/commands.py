"""Slash commands a session understands: ``/stop`` (CMD3) and the session settings
(``/session``, ``/session.set KEY VALUE``, ``/session.reset KEY``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from actors.messages import SetSetting
from events import ConfigError
from services.settings import SETTING_FIELDS, validate_setting

if TYPE_CHECKING:
    from actors.runtime import Runtime

__all__ = ["handle_command", "set_setting"]

USAGE = "用法：/session、/session.set <键> <值>、/session.reset <键>"


def _show(value: Any) -> str:
    if isinstance(value, dict) and {"provider", "model"} <= value.keys():
        return f"{value['provider']}/{value['model']}"
    return str(value)


def set_setting(
    runtime: Runtime,
    session_id: str,
    key: str,
    value: Any = None,
    *,
    reset: bool = False,
    platform: str | None = None,
    user_id: str | None = None,
) -> str:
    """Set or reset a session-layer setting; owner-only keys refuse anyone else (SET3,
    SET4). Returns the reply; a bad key or value raises ConfigError naming it."""
    if key not in SETTING_FIELDS:
        raise ConfigError(f"unknown session setting {key!r}; known: {', '.join(SETTING_FIELDS)}")
    field = SETTING_FIELDS[key]
    if field.owner_only and not runtime.services.authority.is_owner(platform, user_id):
        return f"{field.label}（{key}）只有 owner 能改"
    stored = None if reset else validate_setting(key, value)
    runtime._ask(session_id, SetSetting(key, stored, reset, user_id))
    if reset:
        return f"已恢复{field.label}（{key}）：{field.unset_text}"
    return f"已设置{field.label}（{key}）= {_show(stored)}"


def handle_command(
    runtime: Runtime, session_id: str, text: str, *, platform: str | None, user_id: str | None
) -> str | None:
    """The reply to a command line, or None when ``text`` is not one of these commands
    (or, for ``/stop``, when the turn was stopped and there is nothing to say)."""
    words = text.strip().split(maxsplit=2)
    if not words:
        return None
    name = words[0]
    if name == "/stop":
        return runtime.stop_command(session_id, platform, user_id)
    if name == "/session":
        layer = runtime.view(session_id).settings
        return "\n".join(
            f"{f.label}（{key}）：{_show(layer[key]) if key in layer else f.unset_text}"
            for key, f in SETTING_FIELDS.items()
        )
    if name in ("/session.set", "/session.reset"):
        if len(words) < 2 or (name == "/session.set" and len(words) < 3):
            return USAGE
        key = words[1]
        try:
            if name == "/session.reset":
                return set_setting(
                    runtime, session_id, key, reset=True, platform=platform, user_id=user_id
                )
            raw = words[2]
            try:
                value: Any = json.loads(raw)
            except ValueError:
                value = raw
            return set_setting(runtime, session_id, key, value, platform=platform, user_id=user_id)
        except ConfigError as exc:
            return f"设置失败：{exc}"
    return None
