"""Scenario files: sessions, tools, scripted model replies and a timeline of inputs and
stops, run through the real runtime, the same way on every run (docs/scenarios.md).

    result = run_scenario("tests/scenarios/insert_while_tool_runs.toml")
    result.calls["qq:group:1"][1].messages     # what call 2 of the session sent
    result.logs["qq:group:1"]                  # the session's event log

The model parks every call until the driver answers it from the script, and slow tools
park until the driver releases them. After each step, answer or release, the driver
waits until every turn is parked again or has ended, then moves the clock; so only one
thing happens at a time, and ids, times and the output are the same on every run.

The parts: :mod:`aalis_agent.scenarios.spec` (what a scenario is), :mod:`aalis_agent.scenarios.load`
(reading and checking a file), :mod:`aalis_agent.scenarios.drive` (running it) and
:mod:`aalis_agent.scenarios.result` (what a run produced, as JSON or a transcript).
"""

from __future__ import annotations

import sys
from typing import TextIO

from aalis_agent.events.errors import ScenarioError, ToolError
from aalis_agent.scenarios.drive import run_scenario
from aalis_agent.scenarios.load import load_scenario
from aalis_agent.scenarios.result import (
    CallRecord,
    InputRecord,
    ScenarioResult,
    StepRecord,
    message_json,
)
from aalis_agent.scenarios.spec import (
    Point,
    ReplySpec,
    Scenario,
    SessionSpec,
    StepSpec,
    ToolOutcome,
    ToolSpec,
)

__all__ = [
    "CallRecord",
    "InputRecord",
    "Point",
    "ReplySpec",
    "Scenario",
    "ScenarioError",
    "ScenarioResult",
    "SessionSpec",
    "StepRecord",
    "StepSpec",
    "ToolError",
    "ToolOutcome",
    "ToolSpec",
    "load_scenario",
    "message_json",
    "run_cli",
    "run_scenario",
]

# --- the command -----------------------------------------------------------------------


def run_cli(
    file: str,
    *,
    db: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``aalis-agent scenario FILE [--db PATH] [--json]``: run it, print the JSON document
    or the transcript; warnings go to ``err``. Errors raise :class:`ScenarioError`."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    result = run_scenario(file, db=db)
    out.write(result.dumps() if as_json else result.transcript())
    for warning in result.warnings:
        err.write(f"warning: {warning}\n")
    return 0
