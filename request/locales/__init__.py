"""The locale packs: every model-facing and person-facing text, one module per language.

``zh`` (the default) holds the source document's exact strings; ``en`` is complete. Both
have the same keys and the same ``str.format`` placeholders per key. A runtime picks one
with ``AgentConfig(locale=...)``; a settings layer (a platform, a platform type, a venue)
may pick another for its sessions (``services/settings.py``). Read them through
:class:`aalis_agent.request.texts.Texts`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from aalis_agent.events.errors import ConfigError
from aalis_agent.request.locales import en, zh

__all__ = ["DEFAULT_LOCALE", "LOCALES", "check_locale"]

DEFAULT_LOCALE = "zh"
"""The locale of a runtime that names none: the source's own strings."""

LOCALES: Mapping[str, Mapping[str, str]] = {"zh": zh.TEXTS, "en": en.TEXTS}
"""Every pack by locale name."""


def check_locale(
    value: object, *, where: str = "locale", shown: Callable[[object], str] | None = None
) -> str:
    """``value`` when it names a pack, else a ConfigError naming ``where`` and the packs
    (the value shown by ``shown``, else as its ``repr``, cut at 60 characters)."""
    if not isinstance(value, str) or value not in LOCALES:
        known = ", ".join(sorted(LOCALES))
        said = shown(value) if shown is not None else f"{value!r:.60}"
        raise ConfigError(f"{where}: unknown locale {said}; known: {known}")
    return value
