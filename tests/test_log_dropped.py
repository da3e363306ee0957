"""``logging_setup.dropped``: a turn's debug and info lines are not even built when they
would be dropped unseen, and are never skipped where anyone could see them (a level
turned on, ``capture_logs``, an application's own structlog configuration)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import InMemoryEventStore, Input
from aalis_agent.services import ScriptedModel, ScriptedReply, Services
from aalis_agent.services.logging_setup import dropped
from structlog.testing import capture_logs

NAME = "aalis.agent"


@pytest.fixture
def aalis_level() -> Iterator[logging.Logger]:
    logger = logging.getLogger("aalis")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_with_the_library_default_a_line_below_the_level_is_dropped(
    aalis_level: logging.Logger,
) -> None:
    aalis_level.setLevel(logging.WARNING)
    assert dropped(NAME, logging.DEBUG)
    assert dropped(NAME, logging.INFO)
    assert not dropped(NAME, logging.WARNING)
    aalis_level.setLevel(logging.DEBUG)  # turned on: the lines are built and sent
    assert not dropped(NAME, logging.DEBUG)


def test_capture_logs_and_an_applications_own_configuration_see_every_line(
    aalis_level: logging.Logger,
) -> None:
    aalis_level.setLevel(logging.WARNING)
    with capture_logs():
        assert not dropped(NAME, logging.DEBUG)
    assert dropped(NAME, logging.DEBUG)
    structlog.configure(processors=[structlog.processors.KeyValueRenderer()])
    assert not dropped(NAME, logging.DEBUG)


def test_a_turns_lines_still_reach_capture_logs(aalis_level: logging.Logger) -> None:
    aalis_level.setLevel(logging.WARNING)  # dropped() alone would skip them
    runtime = Runtime(
        InMemoryEventStore(), Services(llm=ScriptedModel([ScriptedReply(text="好")])), janitor=False
    )
    try:
        with capture_logs() as logs:
            runtime.run("s", Input(id="", content="在吗"))
    finally:
        runtime.shutdown(timeout=10)
    lines = [(e["log_level"], e["event"]) for e in logs]
    assert any(level == "debug" and "开轮" in line for level, line in lines), lines  # handed on
    assert any(level == "info" and "回合结束" in line for level, line in lines), lines  # ended
    # ACC4: the session's first budget line.
    assert any(level == "info" and line.startswith("[token-usage:") for level, line in lines)
