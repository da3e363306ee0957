"""The built-in tools: arithmetic that refuses anything else, and the time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from aalis_agent.services import AbortSignal, ToolCallContext
from aalis_agent.services.builtin_tools import ToolError, builtin_tools, calculate, current_time


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(3+4)*2", "14"),
        ("2**10", "1024"),
        ("10/4", "2.5"),
        ("7//2 + 7%2", "4"),
        ("-3 + +1", "-2"),
        ("sqrt(16) + abs(-1)", "5"),
        ("round(pi, 2)", "3.14"),
        ("round(1234, -2)", "1200"),
        ("round(2.5)", "2"),
    ],
)
def test_arithmetic(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('x')", "not allowed"),
        ("x + 1", "not allowed"),
        ("'a' * 3", "not allowed"),
        ("1/0", "division by zero"),
        ("9**99999", "exponent too large"),
        ("((10**1000)**1000)**1000", "result too large"),
        ("sqrt(-1)", "cannot compute"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "too long"),
        ("round(1, -10**1000)", "digits must be a whole number"),
        ("round(1, 0.5)", "digits must be a whole number"),
        ("(-1)**0.5", "not a real number"),
        ("round(1, 2, 3)", "cannot compute"),
    ],
)
def test_anything_else_is_refused_with_a_reason(expression: str, problem: str) -> None:
    with pytest.raises(ToolError, match=problem):
        calculate(expression)


def test_the_time_in_a_given_offset() -> None:
    now = datetime(2026, 1, 1, 0, 30, tzinfo=UTC)
    assert current_time(now, 8) == "2026-01-01 08:30:00 (UTC+8, Thursday)"
    assert current_time(now) == "2026-01-01 00:30:00 (UTC, Thursday)"
    assert current_time(now.astimezone(timezone(timedelta(hours=-5.5)))).endswith(
        "(UTC-5.5, Wednesday)"
    )
    with pytest.raises(ToolError):
        current_time(now, 20)


def test_as_tools_they_check_their_arguments() -> None:
    tools = {t.name: t for t in builtin_tools(clock_ms=lambda: 1_767_225_600_000, tz=UTC)}
    ctx = ToolCallContext(session_id="s", turn_id="t", call_id="c", abort=AbortSignal())
    assert tools["current_time"].handler({}, ctx) == "2026-01-01 00:00:00 (UTC, Thursday)"
    assert tools["calculate"].handler({"expression": "1+1"}, ctx) == "2"
    with pytest.raises(ToolError, match="expression is required"):
        tools["calculate"].handler({}, ctx)
    with pytest.raises(ToolError, match="must be a number"):
        tools["current_time"].handler({"utc_offset_hours": "8"}, ctx)
    assert tools["calculate"].definition()["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize(
    ("expression", "value"), [(" 1 + 1", "2"), ("\t2*3 ", "6"), ("\n  (1+2)\n", "3")]
)
def test_an_expression_written_with_spaces_around_it_is_computed(
    expression: str, value: str
) -> None:
    """A leading space made Python's parser see an indented line: refused as "not an
    arithmetic expression", which left the model nothing to fix."""
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression", ["1e308*10", "1e400", "-1e400", "1e400-1e400", "1e308+1e308", "1/(1e308*10)"]
)
def test_a_result_past_the_largest_float_is_refused_not_given_as_inf(expression: str) -> None:
    """``1e308*10`` overflows a float to infinity, which the model was given as the answer
    (``inf``, ``nan`` from ``inf-inf``, or ``0`` from ``1/inf``)."""
    with pytest.raises(ToolError, match="result too large"):
        calculate(expression)
