"""Slash commands a session understands: ``/help``, ``/stop`` (CMD3), the session settings
(``/session``, ``/session.set KEY VALUE``, ``/session.reset KEY``), and the paged
listings ``/model [keyword] [-p N]`` and ``/persona [keyword] [-p N]`` (CMD1-CMD2)."""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

from aalis_agent.events import ConfigError
from aalis_agent.request.limits import json_too_deep
from aalis_agent.request.texts import ZH, Texts
from aalis_agent.services.config import json_value
from aalis_agent.services.models import entry_id, model_name, parse_model_ref
from aalis_agent.services.settings import SETTING_FIELDS, validate_setting

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

HELP = ZH("command.help")
"""What ``/help`` answers (``zh``; the session's locale: ``texts("command.help")``)."""

TEXT_KEYS = frozenset({"llm", "think", "persona"})
"""Settings whose value is taken as typed (``/session.set persona 123`` sets ``"123"``)."""

COMMANDS = frozenset(
    {"/help", "/stop", "/session", "/session.set", "/session.reset", "/model", "/persona"}
)
"""Every command :func:`handle_command` understands."""

PAGE_SIZE = 20
"""Entries per page of ``/model`` and ``/persona``."""

USAGE = ZH("command.usage")

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
            f"session setting {json_value(key)}: the value is too long "
            f"({len(raw)} characters, at most {MAX_VALUE_CHARS})"
        )
    if json_too_deep(raw, MAX_VALUE_DEPTH):
        raise ConfigError(
            f"session setting {json_value(key)}: the value is nested deeper than "
            f"{MAX_VALUE_DEPTH} levels"
        )
    with contextlib.suppress(ValueError):  # numbers and lists may be written as JSON
        return json.loads(raw)
    return raw


def _show(value: Any, texts: Texts = ZH) -> str:
    if isinstance(value, dict) and {"provider", "model"} <= value.keys():
        return f"{value['provider']}/{value['model']}"
    if isinstance(value, list):
        return texts("setting.list_separator").join(map(str, value)) or texts("setting.none")
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
    SET4). Returns the reply (in the locale of ``platform`` and ``venue``); a bad key or
    value raises ConfigError naming it, the key and the value spelled as JSON (what the
    command reads: ``session setting "historyLimit"``, ``got true``, ``got "x"``)."""
    texts = runtime.texts_for(session_id, platform, venue)
    refusal = _refusal(runtime, key, platform, user_id, texts)
    if refusal is not None:
        return refusal
    label = texts(f"setting.{key}")
    stored = None if reset else validate_setting(key, value, shown=json_value)
    if not reset:
        _require_existing(runtime, key, stored)
    runtime.set_setting(session_id, key, stored, reset=reset, by=user_id)
    shown = next(f for f in runtime.fields(session_id, platform, venue) if f.key == key)
    if reset:
        return texts("command.reset_done", label=label, key=key, text=shown.text)
    given = _show(stored, texts)
    if shown.text == given:
        note = ""
    elif shown.text.startswith(given + texts("setting.remark_open")):  # with a remark on it
        note = shown.text[len(given) :]
    else:
        note = texts("command.set_note", text=shown.text)
    return texts("command.set_done", label=label, key=key, given=given, note=note)


def _require_existing(runtime: Runtime, key: str, value: Any) -> None:
    """A model or persona that is not there is refused (ConfigError naming it and where
    to look), so a typo never silently falls back. Other keys pass."""
    services = runtime.services
    if key == "llm":
        wanted = _show(value)
        if services.models.find(parse_model_ref(value, where=key)) is None:
            raise ConfigError(
                f'session setting "llm": there is no model {json_value(wanted)}; '
                "/model lists the models"
            )
    elif key == "persona":
        if services.persona is None:
            raise ConfigError('session setting "persona": no personas are configured')
        if value not in {pid for pid, _ in services.persona.list()}:
            raise ConfigError(
                f'session setting "persona": there is no persona {json_value(value)}; '
                "/persona lists the personas"
            )


def _refusal(
    runtime: Runtime, key: str, platform: str | None, user_id: str | None, texts: Texts = ZH
) -> str | None:
    """The reply refusing ``key`` to this user (owner-only keys, SET3-SET4), or None; an
    unknown key raises ConfigError."""
    if key not in SETTING_FIELDS:
        known = ", ".join(SETTING_FIELDS)
        raise ConfigError(f"unknown session setting {json_value(key)}; known: {known}")
    field = SETTING_FIELDS[key]
    if field.owner_only and not runtime.services.authority.is_owner(platform, user_id):
        return texts("command.owner_only", label=texts(f"setting.{key}"), key=key)
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
    session's. Replies are in the locale of ``platform`` and ``venue``."""
    words = text.strip().split(maxsplit=2)
    if not words:
        return None
    name = words[0]
    if name not in COMMANDS:
        return None
    texts = runtime.texts_for(session_id, platform, venue)
    if name == "/help":
        return texts("command.help")
    if name == "/stop":
        return runtime.stop_command(session_id, platform, user_id, venue)
    if name == "/session":
        return "\n".join(f.line(texts) for f in runtime.fields(session_id, platform, venue))
    if name in ("/model", "/persona"):
        return _listing(runtime, session_id, name, text.strip().split()[1:], platform, venue)
    if name in ("/session.set", "/session.reset"):
        if len(words) < 2 or (name == "/session.set" and len(words) < 3):
            return texts("command.usage")
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
            refusal = _refusal(runtime, key, platform, user_id, texts)
            if refusal is not None:  # before reading the value at all
                return refusal
            value = parse_value(key, words[2])
            return set_setting(
                runtime, session_id, key, value, platform=platform, user_id=user_id, venue=venue
            )
        except ConfigError as exc:
            return texts("command.set_failed", error=exc)
    return None


def page_of(
    entries: list[tuple[str, str]], args: list[str], texts: Texts = ZH
) -> tuple[list[tuple[str, str]], str | None, int, int, int]:
    """Filter ``(id, text)`` entries by the keyword in ``args`` (case-insensitive, on the
    id and the text) and cut page ``-p N``. Returns the page, the keyword, the total
    matched, the page number and the page count; a bad ``-p`` raises ValueError."""
    page, words = 1, []
    i = 0
    while i < len(args):
        if args[i] in ("-p", "--page"):
            if i + 1 >= len(args):
                raise ValueError(texts("command.page_missing"))
            raw = args[i + 1]
            shown = raw if len(raw) <= 20 else raw[:20] + "…"
            if not (raw.isascii() and raw.isdigit()) or (len(raw) <= 9 and int(raw) < 1):
                raise ValueError(texts("command.page_not_positive", given=repr(shown)))
            if len(raw) > 9:  # never converts thousands of digits
                raise ValueError(texts("command.page_too_large", given=shown))
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
    texts = runtime.texts_for(session_id, platform, venue)
    if name == "/model":
        what, current = texts("listing.models"), None
        with contextlib.suppress(ConfigError):
            fields = runtime.fields(session_id, platform, venue)
            current = next(f.value for f in fields if f.key == "llm")
        models = services.models.models()
        entries = [(entry_id(m), model_name(m)) for m in models]  # searched: id and name
        extra = {
            entry_id(m): texts("listing.context", context_length=m.context_length) for m in models
        }
    else:
        what, current, extra = texts("listing.personas"), None, {}
        if services.persona is None:
            return texts("listing.no_persona_service")
        entries = list(services.persona.list())
    try:
        shown, keyword, total, page, pages = page_of(entries, args, texts)
    except ValueError as exc:
        return texts("command.error", command=name, error=exc)
    if total == 0:
        if keyword:
            found = texts("listing.none_matching", keyword=keyword, what=what)
        else:
            found = texts("listing.none", what=what)
        return f"{found}\n{texts.listing_footer(name, 1, 1)}"
    if page > pages:
        missing = texts("listing.no_page", page=page, pages=pages)
        return f"{missing}\n{texts.listing_footer(name, pages, pages)}"
    lines = [texts.listing_header(what, total, page, pages, keyword)]
    for eid, text in shown:
        mark = texts("listing.in_use") if eid == current else ""
        lines.append(f"{eid}  {text}{extra.get(eid, '')}{mark}")
    lines.append(texts.listing_footer(name, page, pages))
    return "\n".join(lines)
