"""Every exact string the model, the user or the logs see, read from the locale packs.

The packs live in ``request/locales/`` (``zh``, the source's strings and the default, and
``en``). :class:`Texts` reads one pack; :func:`texts_for` gives the shared instance of a
locale. The module-level names below are the ``zh`` texts, as before: tests quote them
from here.

The source document's punctuation was normalised to ASCII; the original writes full-width
punctuation in Chinese text, and so do the ``zh`` strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache

from aalis_agent.request.locales import DEFAULT_LOCALE, LOCALES, check_locale

__all__ = [
    "BATCH_NO_REPLY_NEEDED",
    "BATCH_PREFIX",
    "CONTINUATION_HINT",
    "DELEGATION_HEAD",
    "ERROR_PREFIX",
    "FOCUS_GUIDE_HEAD",
    "HOST_NOTICE_HEAD",
    "INPUT_CONVENTION",
    "NO_RUNNING_TURN",
    "STOP_DENIED",
    "STOP_MARKER_PREFIX",
    "SYSTEM_PREFIX",
    "THINK_NOT_TUNABLE",
    "TRUNCATED_SUFFIX",
    "UNLIMITED",
    "ZH",
    "Texts",
    "focus_guide",
    "follow_preference",
    "listing_footer",
    "listing_header",
    "stop_marker_text",
    "texts_for",
    "think_not_in_model",
    "tool_bad_arguments",
    "volatile_context",
]


class Texts:
    """The texts of one locale: ``texts(key, **values)`` fills the key's template; the
    methods below build the composite texts. Immutable; share one per locale
    (:func:`texts_for`)."""

    __slots__ = ("_pack", "locale")

    locale: str
    _pack: Mapping[str, str]

    def __init__(self, locale: str = DEFAULT_LOCALE) -> None:
        self.locale = check_locale(locale)
        self._pack = LOCALES[locale]

    def __call__(self, key: str, /, **values: object) -> str:
        template = self._pack[key]
        return template.format(**values) if values else template

    def __repr__(self) -> str:
        return f"Texts({self.locale!r})"

    # --- the request --------------------------------------------------------------------

    @property
    def input_convention(self) -> str:
        """The fixed block at the end of the system prompt (FLOW3)."""
        return self("prompt.input_convention")

    def volatile_context(self, time_label: str, platform: str | None, multi_party: bool) -> str:
        """The per-turn context block (current time and where the conversation is)."""
        where = self("prompt.volatile.multi_party" if multi_party else "prompt.volatile.one_on_one")
        shown = platform or self("prompt.volatile.unknown_platform")
        return self("prompt.volatile", time=time_label, platform=shown, where=where)

    def batch_prefix(self, *, no_reply_needed: bool = False) -> str:
        """Before a batch of inputs that queued while the last turn ran (SCH4); with the
        no-reply line in a multi-party room where none of them addresses the agent."""
        prefix = self("prompt.batch_prefix")
        if no_reply_needed:
            return f"{prefix}\n{self('prompt.batch_no_reply_needed')}"
        return prefix

    def focus_guide(self, entries: Iterable[tuple[str, str]]) -> str:
        """The focus-guide block: every addressed insert so far, as ``(time) account``."""
        lines = (self("prompt.focus_guide_line", when=w, who=who) for w, who in entries)
        return "\n".join([self("prompt.focus_guide_head"), *lines])

    def truncated_suffix(self, length: int) -> str:
        """Appended to text cut short, with the original length."""
        return self("prompt.truncated_suffix", length=length)

    # --- stopping and notices -----------------------------------------------------------

    def stop_marker_text(self, stopped_by: str | None) -> str:
        """The one sentence the next turn's model reads about a stopped turn (SAVE6)."""
        who = self("stop.marker_by", name=stopped_by) if stopped_by else ""
        return self("stop.marker", prefix=self("stop.marker_prefix"), who=who)

    def turn_failed(self, error: str, turn_id: str) -> str:
        """The error notice a failed turn sends to the room (OUT2)."""
        return self(
            "notice.turn_failed", prefix=self("notice.error_prefix"), error=error, turn_id=turn_id
        )

    # --- tool errors (FLOW13) -----------------------------------------------------------

    def tool_bad_arguments(self, raw: str) -> str:
        """The result a call with arguments that are not a JSON object gets (FLOW13)."""
        return self("tool.bad_arguments", raw=raw[:200])

    # --- scheduling outcomes ------------------------------------------------------------

    def where(self, where: str) -> str:
        """The display text of a scheduling outcome (a ``Where``; its value names it)."""
        key = f"where.{where}"
        return self(key) if key in self._pack else str(where)

    # --- settings and listings (SET, CMD1-CMD2) -----------------------------------------

    def follow_preference(self, model_name: str) -> str:
        """The model field when no layer sets ``llm`` (SET1)."""
        return self("setting.follow_preference", model=model_name)

    def think_not_in_model(self, default_name: str) -> str:
        """After the name of a level the session's model does not have (SET2)."""
        return self("setting.think_not_in_model", default=default_name)

    def listing_header(
        self, what: str, total: int, page: int, pages: int, keyword: str | None
    ) -> str:
        """The first line of a paged listing (CMD1-CMD2): the count and the page."""
        found = self("listing.header_found", keyword=keyword) if keyword else ""
        return self("listing.header", found=found, what=what, total=total, page=page, pages=pages)

    def listing_footer(self, command: str, page: int, pages: int) -> str:
        """The last line of a paged listing: how to turn the page or search."""
        turn = self("listing.footer_next", command=command, page=page + 1) if page < pages else ""
        return turn + self("listing.footer_search", command=command)


def texts_for(locale: str | None = None) -> Texts:
    """The shared :class:`Texts` of ``locale`` (None: the default); an unknown locale
    raises ConfigError."""
    return _texts(DEFAULT_LOCALE if locale is None else locale)


@cache
def _texts(locale: str) -> Texts:
    return Texts(locale)


ZH = texts_for(DEFAULT_LOCALE)
"""The default texts: the source document's strings."""

BATCH_PREFIX = ZH("prompt.batch_prefix")
"""Before a batch of human inputs that queued while the last turn ran (SCH4)."""

BATCH_NO_REPLY_NEEDED = ZH("prompt.batch_no_reply_needed")
"""Added in a multi-party room when no input of the batch addresses the agent (SCH4)."""

STOP_DENIED = ZH("stop.denied")
"""``/stop`` from someone who is neither a participant of the turn nor the owner (CMD3)."""

NO_RUNNING_TURN = ZH("stop.no_running_turn")
"""``/stop`` when no turn runs (CMD3)."""

STOP_MARKER_PREFIX = ZH("stop.marker_prefix")
"""The start of the ``turn-stopped`` marker (SAVE6)."""

FOCUS_GUIDE_HEAD = ZH("prompt.focus_guide_head")
"""Head of the focus-guide block before addressed inserts in multi-party rooms (SCH2)."""

DELEGATION_HEAD = ZH("prompt.delegation_head")
"""Head of the task block of a delegated (``proactive``) turn (INS1)."""

HOST_NOTICE_HEAD = ZH("prompt.host_notice_head")
"""Head of a host notice's instruction block (INS2)."""

ERROR_PREFIX = ZH("notice.error_prefix")
"""Start of an error notice sent to the room (OUT2)."""

SYSTEM_PREFIX = ZH("notice.system_prefix")
"""Start of a system notice sent to the room (OUT2)."""

INPUT_CONVENTION = ZH.input_convention
"""The fixed block at the end of the system prompt (FLOW3)."""

CONTINUATION_HINT = ZH("prompt.continuation_hint")
"""Inserted after a trim that reached step 4 and removed six or more messages (TRIM-H)."""

TRUNCATED_SUFFIX = ZH("prompt.truncated_suffix")
"""Appended to text cut short, with the original length (a ``{length}`` template)."""

THINK_NOT_TUNABLE = ZH("setting.think_not_tunable")
"""The thinking-level field when the session's model declares no levels (SET2)."""

UNLIMITED = ZH("setting.unlimited")
"""``maxToolIterations`` unset (SET3)."""


def focus_guide(entries: list[tuple[str, str]]) -> str:
    """The ``zh`` focus-guide block (:meth:`Texts.focus_guide`)."""
    return ZH.focus_guide(entries)


def stop_marker_text(stopped_by: str | None) -> str:
    """The ``zh`` stop marker (:meth:`Texts.stop_marker_text`)."""
    return ZH.stop_marker_text(stopped_by)


def tool_bad_arguments(raw: str) -> str:
    """The ``zh`` bad-arguments result (:meth:`Texts.tool_bad_arguments`)."""
    return ZH.tool_bad_arguments(raw)


def volatile_context(time_label: str, platform: str | None, multi_party: bool) -> str:
    """The ``zh`` volatile context block (:meth:`Texts.volatile_context`)."""
    return ZH.volatile_context(time_label, platform, multi_party)


def follow_preference(model_name: str) -> str:
    """The ``zh`` model field text when no layer sets ``llm`` (SET1)."""
    return ZH.follow_preference(model_name)


def think_not_in_model(default_name: str) -> str:
    """The ``zh`` remark after a level the session's model does not have (SET2)."""
    return ZH.think_not_in_model(default_name)


def listing_header(what: str, total: int, page: int, pages: int, keyword: str | None) -> str:
    """The ``zh`` first line of a paged listing (:meth:`Texts.listing_header`)."""
    return ZH.listing_header(what, total, page, pages, keyword)


def listing_footer(command: str, page: int, pages: int) -> str:
    """The ``zh`` last line of a paged listing (:meth:`Texts.listing_footer`)."""
    return ZH.listing_footer(command, page, pages)
