"""Slash commands a session understands: ``/help``, ``/stop`` (CMD3), the session settings
(``/session``, ``/session.set KEY VALUE``, ``/session.reset KEY``), and the paged
listings ``/model [keyword] [-p N]`` and ``/persona [keyword] [-p N]`` (CMD1-CMD2)."""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

from aalis_agent.events import ConfigError
from aalis_agent.request.limits import json_too_deep
from aalis_agent.request.texts import listing_footer, listing_header
from aalis_agent.services.models import entry_id, model_name, parse_model_ref
from aalis_agent.services.settings import SETTING_FIELDS, shown_value, validate_setting

if TYPE_CHECKING:
    from aalis_agent.actors.runtime import Runtime

__all__ = [
    "COMMANDS",
    "HELP",
    "MAX_VALUE_CHARS",
    "MAX_VALUE_DEPTH",
    "PAGE_SIZE",
    "handle_command",
    "page_of",
    "parse_value",
    "set_setting",
]

HELP = "\n".join(
    (
        "/stop  停下在跑的一轮（参与这一轮的人和 owner）",
        "/session  看本会话的设置：模型、深度思考、最大工具迭代、历史条数上限、人设、工具分组",
        "/session.set <键> <值>  改本会话的一项设置（如 /session.set llm openai/gpt-4o）",
        "/session.reset <键>  恢复一项设置",
        "/model [关键词] [-p 页]  列出 / 搜索对话模型",
        "/persona [关键词] [-p 页]  列出 / 搜索人设",
    )
)
"""What ``/help`` answers."""

TEXT_KEYS = frozenset({"llm", "think", "persona"})
"""Settings whose value is taken as typed (``/session.set persona 123`` sets ``"123"``)."""

COMMANDS = frozenset(
    {"/help", "/stop", "/session", "/session.set", "/session.reset", "/model", "/persona"}
)
"""Every command :func:`handle_command` understands."""

PAGE_SIZE = 20
"""Entries per page of ``/model`` and ``/persona``."""

USAGE = "用法：/session、/session.set <键> <值>、/session.reset <键>、/model [关键词] [-p 页]"

MAX_VALUE_CHARS = 100_000
"""Longest value ``/session.set`` reads (256 tool groups of 256 characters fit)."""

MAX_VALUE_DEPTH = 8
"""Deepest JSON value ``/session.set`` parses; a setting nests one level at most."""


def parse_value(key: str, raw: str) -> Any:
    """The value ``/session.set KEY RAW`` means: the text itself for the text settings,
    else the JSON it holds when it is JSON (a number, a list), else the text. Too long or
    too deeply nested text raises ConfigError naming the key; nothing recurses on it."""
    if key in TEXT_KEYS:
        return raw
    if len(raw) > MAX_VALUE_CHARS:
        raise ConfigError(
            f"session setting {key!r}: the value is too long "
            f"({len(raw)} characters, at most {MAX_VALUE_CHARS})"
        )
    if json_too_deep(raw, MAX_VALUE_DEPTH):
        raise ConfigError(
            f"session setting {key!r}: the value is nested deeper than {MAX_VALUE_DEPTH} levels"
        )
    with contextlib.suppress(ValueError):  # numbers and lists may be written as JSON
        return json.loads(raw)
    return raw


def _show(value: Any) -> str:
    if isinstance(value, dict) and {"provider", "model"} <= value.keys():
        return f"{value['provider']}/{value['model']}"
    if isinstance(value, list):
        return "、".join(map(str, value)) or "无"
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
    venue: str | None = None,
) -> str:
    """Set or reset a session-layer setting; owner-only keys refuse anyone else (SET3,
    SET4). Returns the reply; a bad key or value raises ConfigError naming it."""
    refusal = _refusal(runtime, key, platform, user_id)
    if refusal is not None:
        return refusal
    field = SETTING_FIELDS[key]
    stored = None if reset else validate_setting(key, value)
    if not reset:
        _require_existing(runtime, key, stored)
    runtime.set_setting(session_id, key, stored, reset=reset, by=user_id)
    shown = next(f for f in runtime.fields(session_id, platform, venue) if f.key == key)
    if reset:
        return f"已恢复{field.label}（{key}）：{shown.text}"
    given = _show(stored)
    if shown.text == given:
        note = ""
    elif shown.text.startswith(given + "（"):  # the set value, with a remark on it
        note = shown.text[len(given) :]
    else:
        note = f"，此刻：{shown.text}"
    return f"已设置{field.label}（{key}）= {given}{note}"


def _require_existing(runtime: Runtime, key: str, value: Any) -> None:
    """A model or persona that is not there is refused (ConfigError naming it and where
    to look), so a typo never silently falls back. Other keys pass."""
    services = runtime.services
    if key == "llm":
        wanted = _show(value)
        if services.models.find(parse_model_ref(value, where=key)) is None:
            raise ConfigError(
                f"session setting 'llm': there is no model {wanted!r}; /model lists the models"
            )
    elif key == "persona":
        if services.persona is None:
            raise ConfigError("session setting 'persona': no personas are configured")
        if value not in {pid for pid, _ in services.persona.list()}:
            raise ConfigError(
                f"session setting 'persona': there is no persona {shown_value(value)}; "
                "/persona lists the personas"
            )


def _refusal(runtime: Runtime, key: str, platform: str | None, user_id: str | None) -> str | None:
    """The reply refusing ``key`` to this user (owner-only keys, SET3-SET4), or None; an
    unknown key raises ConfigError."""
    if key not in SETTING_FIELDS:
        known = ", ".join(SETTING_FIELDS)
        raise ConfigError(f"unknown session setting {shown_value(key)}; known: {known}")
    field = SETTING_FIELDS[key]
    if field.owner_only and not runtime.services.authority.is_owner(platform, user_id):
        return f"{field.label}（{key}）只有 owner 能改"
    return None


def handle_command(
    runtime: Runtime,
    session_id: str,
    text: str,
    *,
    platform: str | None,
    user_id: str | None,
    venue: str | None = None,
) -> str | None:
    """The reply to a command line, or None when ``text`` is not one of these commands
    (or, for ``/stop``, when the turn was stopped and there is nothing to say). ``venue``
    (``venue_of(platform, group id)``) shows the venue layer's values; default: the
    session's."""
    words = text.strip().split(maxsplit=2)
    if not words:
        return None
    name = words[0]
    if name == "/help":
        return HELP
    if name == "/stop":
        return runtime.stop_command(session_id, platform, user_id)
    if name == "/session":
        return "\n".join(f.line() for f in runtime.fields(session_id, platform, venue))
    if name in ("/model", "/persona"):
        return _listing(runtime, session_id, name, text.strip().split()[1:], platform, venue)
    if name in ("/session.set", "/session.reset"):
        if len(words) < 2 or (name == "/session.set" and len(words) < 3):
            return USAGE
        key = words[1]
        try:
            if name == "/session.reset":
                return set_setting(
                    runtime,
                    session_id,
                    key,
                    reset=True,
                    platform=platform,
                    user_id=user_id,
                    venue=venue,
                )
            refusal = _refusal(runtime, key, platform, user_id)
            if refusal is not None:  # before reading the value at all
                return refusal
            value = parse_value(key, words[2])
            return set_setting(
                runtime, session_id, key, value, platform=platform, user_id=user_id, venue=venue
            )
        except ConfigError as exc:
            return f"设置失败：{exc}"
    return None


def page_of(
    entries: list[tuple[str, str]], args: list[str]
) -> tuple[list[tuple[str, str]], str | None, int, int, int]:
    """Filter ``(id, text)`` entries by the keyword in ``args`` (case-insensitive, on the
    id and the text) and cut page ``-p N``. Returns the page, the keyword, the total
    matched, the page number and the page count; a bad ``-p`` raises ValueError."""
    page, words = 1, []
    i = 0
    while i < len(args):
        if args[i] in ("-p", "--page"):
            if i + 1 >= len(args):
                raise ValueError("-p 后面要跟页码")
            raw = args[i + 1]
            shown = raw if len(raw) <= 20 else raw[:20] + "…"
            if not (raw.isascii() and raw.isdigit()):
                raise ValueError(f"页码要是正整数，不是 {shown!r}")
            if len(raw) > 9:  # never converts thousands of digits
                raise ValueError(f"页码太大：{shown}")
            if int(raw) < 1:
                raise ValueError(f"页码要是正整数，不是 {shown!r}")
            page = int(raw)
            i += 2
            continue
        words.append(args[i])
        i += 1
    keyword = " ".join(words) or None
    if keyword is not None:
        needle = keyword.casefold()
        entries = [e for e in entries if needle in e[0].casefold() or needle in e[1].casefold()]
    pages = max(-(-len(entries) // PAGE_SIZE), 1)
    start = (page - 1) * PAGE_SIZE
    return entries[start : start + PAGE_SIZE], keyword, len(entries), page, pages


def _listing(
    runtime: Runtime,
    session_id: str,
    name: str,
    args: list[str],
    platform: str | None,
    venue: str | None,
) -> str:
    services = runtime.services
    if name == "/model":
        what, current = "对话模型", None
        with contextlib.suppress(ConfigError):
            fields = runtime.fields(session_id, platform, venue)
            current = next(f.value for f in fields if f.key == "llm")
        models = services.models.models()
        entries = [(entry_id(m), model_name(m)) for m in models]  # searched: id and name
        extra = {entry_id(m): f" · 上下文 {m.context_length}" for m in models}
    else:
        what, current, extra = "人设", None, {}
        if services.persona is None:
            return "没有人设服务，/persona 无可列"
        entries = list(services.persona.list())
    try:
        shown, keyword, total, page, pages = page_of(entries, args)
    except ValueError as exc:
        return f"{name}：{exc}"
    if total == 0:
        found = f"没有含“{keyword}”的{what}" if keyword else f"没有可用的{what}"
        return f"{found}\n{listing_footer(name, 1, 1)}"
    if page > pages:
        return f"没有第 {page} 页（共 {pages} 页）\n{listing_footer(name, pages, pages)}"
    lines = [listing_header(what, total, page, pages, keyword)]
    for eid, text in shown:
        mark = "  ← 此刻在用" if eid == current else ""
        lines.append(f"{eid}  {text}{extra.get(eid, '')}{mark}")
    lines.append(listing_footer(name, page, pages))
    return "\n".join(lines)
