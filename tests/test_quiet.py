"""The library is quiet unless the application configures logging; the CLI logs to stderr."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness import run_cli

ROOT = Path(__file__).resolve().parent.parent

# A turn whose plugin preference names a model that is not there: the llm service logs a
# warning (SET5) and the runtime logs at debug and info on the way.
TURN = """
import logging, sys
if sys.argv[1:] == ["configured"]:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
if sys.argv[1:] == ["print-logger"]:  # structlog given only a logger factory, after import
    import aalis_agent, structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from aalis_agent import (
    InMemoryEventStore, Input, LlmService, ModelRef, Provider, Runtime, ScriptedModel,
    ScriptedReply, Services,
)
llm = LlmService(
    [Provider("demo", [ScriptedModel([ScriptedReply(text="hi")])])],
    plugin_preference=ModelRef(provider="gone", model="x"),
)
runtime = Runtime(InMemoryEventStore(), Services(llm=llm))
outcome = runtime.submit("s:1", Input(id="", content="hello")).result(30)
assert outcome.outcome == "replied", outcome
runtime.shutdown(timeout=30)
"""


def _turn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", TURN, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_a_turn_with_the_library_prints_nothing() -> None:
    done = _turn()
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_the_applications_logging_shows_the_librarys_warnings() -> None:
    done = _turn("configured")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert any(
        line.startswith("WARNING:aalis.llm:preferred model missing; using the fallback")
        and "wanted=gone/x" in line
        for line in lines
    ), lines
    assert not any(line.startswith(("DEBUG:", "INFO:")) for line in lines)  # its level


def test_an_application_that_gives_structlog_its_own_logger_factory_keeps_working() -> None:
    """Only the logger factory replaced (a PrintLogger): the library's lines reach it and
    nothing breaks (a stdlib-only level filter would fail on a PrintLogger)."""
    done = _turn("print-logger")
    assert done.returncode == 0, done.stderr
    assert "preferred model missing" in done.stderr


def test_the_cli_still_logs_to_stderr_when_asked(tmp_path: Path) -> None:
    result = run_cli("chat", "--db", str(tmp_path / "c.db"), "-v", stdin="你好\n")
    assert result.returncode == 0, result.stderr
    assert "→ 开轮" in result.stderr and "session=cli:console" in result.stderr
    assert "→ 开轮" not in result.stdout
    quiet = run_cli("chat", "--db", str(tmp_path / "c.db"), stdin="你好\n")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_the_cli_log_has_no_colour_codes_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """A log sent to a file or a pipe is plain text; the console look is coloured only on
    a terminal, and never with ``NO_COLOR`` set."""
    result = run_cli("chat", "--db", str(tmp_path / "c.db"), "-v", stdin="你好\n")
    assert result.returncode == 0, result.stderr
    assert "→ 开轮" in result.stderr and "\x1b[" not in result.stderr


def test_the_console_log_is_coloured_on_a_terminal_only(monkeypatch: Any) -> None:
    import structlog
    from aalis_agent.services.logging_setup import stdlib_processors

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def rendered() -> str:
        renderer = stdlib_processors(console=True)[-1]
        assert isinstance(renderer, structlog.dev.ConsoleRenderer)
        return str(renderer(None, "info", {"event": "开轮", "level": "info", "session": "s"}))

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert "\x1b[" in rendered()
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in rendered()
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert "\x1b[" not in rendered()
