"""The library's logging: quiet unless the application configures it.

The library logs through structlog under names beginning with ``aalis`` (``aalis.turn``,
``aalis.runtime``...). At import, :func:`install` routes structlog through the standard
:mod:`logging` module (structlog's stdlib integration) and puts a ``NullHandler`` on the
``aalis`` logger, so nothing is printed until the application configures logging
(``logging.basicConfig()``, its own handlers, or its own ``structlog.configure``, which
then wins). Registered secrets (:mod:`services.secrets`) are masked in every message,
tracebacks included.

An application that configured structlog before importing the library keeps its
configuration: :func:`install` only configures structlog when nothing has.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog
from aalis_agent.events.secrets import redact_processor

__all__ = ["LOGGER_NAME", "BoundLogger", "dropped", "install", "stdlib_processors"]

LOGGER_NAME = "aalis"
"""The parent of every logger the library uses."""


class BoundLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib logger, whose ``exception`` logs at ERROR with the traceback
    already in the (masked) message: the stdlib record carries no ``exc_info``, so no
    handler prints the traceback again, unmasked."""

    def exception(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        kw.setdefault("exc_info", True)
        return self._proxy_to_logger("error", event, *args, **kw)


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def filter_by_level(logger: Any, method_name: str, event_dict: Any) -> Any:
    """Drop an event below its stdlib logger's level (structlog's ``filter_by_level``),
    and let it through to any other kind of logger: an application that later gives
    structlog its own logger factory (a ``PrintLogger``, say) keeps working."""
    enabled = getattr(logger, "isEnabledFor", None)
    if enabled is not None and (
        getattr(logger, "disabled", False) or not enabled(_LEVELS.get(method_name, 0))
    ):
        raise structlog.DropEvent
    return event_dict


def stdlib_processors(*, console: bool = False, colors: bool | None = None) -> list[Any]:
    """structlog processors for loggers that hand their lines to :mod:`logging`: events
    below the stdlib logger's level are dropped first (cheaply), a traceback is formatted
    as text and masked with every other value, and the line is rendered as
    ``event key=value...`` (the stdlib formatter adds level and name as the application
    chooses). ``console``: structlog's console look instead, with time and level (the
    CLI's stderr log), in colour when ``colors`` says so (by default: when stderr is a
    terminal and ``NO_COLOR`` is not set, so a log sent to a file or a pipe has no
    escape codes)."""
    if colors is None:
        colors = _terminal(sys.stderr) and not os.environ.get("NO_COLOR")
    processors: list[Any] = [
        filter_by_level,
        structlog.contextvars.merge_contextvars,
    ]
    if console:
        processors.append(structlog.stdlib.add_log_level)
    processors += [structlog.processors.StackInfoRenderer(), structlog.dev.set_exc_info]
    if console:
        processors.append(structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False))
    processors += [
        structlog.processors.format_exc_info,  # the traceback as text, so that...
        redact_processor,  # ...this masks it with every other value
        structlog.dev.ConsoleRenderer(colors=colors)
        if console
        else structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0),
    ]
    return processors


def _terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no such method, or closed
        return False


def install() -> None:
    """Make the library quiet by default (idempotent): a ``NullHandler`` on ``aalis``,
    and structlog routed through :mod:`logging` unless the application configured it."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    if not structlog.is_configured():
        global _factory
        factory = structlog.stdlib.LoggerFactory()
        structlog.configure(
            processors=stdlib_processors(),
            logger_factory=factory,
            wrapper_class=BoundLogger,
            cache_logger_on_first_use=False,  # structlog.testing.capture_logs still works
        )
        _factory = factory


_factory: Any = None  # the logger factory install() configured
_stdlib: dict[str, logging.Logger] = {}


def dropped(name: str, level: int) -> bool:
    """Whether a line at ``level`` from the library's logger ``name`` would be dropped
    unseen, so that its message need not even be built (a few turn lines cost about 2%
    of a turn otherwise): structlog still routes as :func:`install` set it (its stdlib
    logger factory, :func:`filter_by_level` as the first processor, a standard wrapper),
    and stdlib logging has that level off for ``name``. Any other configuration
    (``capture_logs``, an application's own) is never second-guessed: False."""
    if _factory is None:
        return False
    config = structlog.get_config()
    processors = config["processors"]  # capture_logs changes this very list in place
    if not processors or processors[0] is not filter_by_level:
        return False
    if config["logger_factory"] is not _factory:
        return False
    wrapper = config["wrapper_class"]
    if wrapper is not BoundLogger and getattr(wrapper, "__module__", "") != "structlog._native":
        return False  # an application's own wrapper may see lines before the processors
    logger = _stdlib.get(name)
    if logger is None:
        logger = _stdlib[name] = logging.getLogger(name)
    return not logger.isEnabledFor(level)
