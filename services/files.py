"""Reading the text files a user hands over (a configuration, a model script): bounded,
so that a wrong path (``/dev/zero``, a log, a disk image) is refused with an error naming
it instead of being read into memory whole."""

from __future__ import annotations

from pathlib import Path

from aalis_agent.events.errors import ConfigError

__all__ = ["TEXT_FILE_BYTES", "read_text_file"]

TEXT_FILE_BYTES = 16 * 1024 * 1024
"""The most bytes a configuration file or a model script may take: 16 MiB, far past any
written by hand or by a tool."""


def read_text_file(path: str | Path, what: str, limit: int = TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of the file at ``path`` (``what`` it is, for the errors), read up
    to ``limit`` bytes: a longer file, one that cannot be read, or bytes that are not
    UTF-8 raise :class:`ConfigError` naming the file and why."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{p}: not a {what}: longer than {limit:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte {exc.start})"
        raise ConfigError(f"{p}: cannot read the {what}: {why}") from None
