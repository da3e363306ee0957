"""Tools that ship with the runtime and touch nothing outside the process: the current
time, and arithmetic. ``aalis-agent chat`` offers them to the model unless ``--no-tools``."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

from aalis_agent.events.errors import ToolError
from aalis_agent.request.texts import ZH, Texts
from aalis_agent.services.tools import Tool, ToolCallContext

__all__ = ["ToolError", "builtin_tools", "calculate", "current_time"]


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _round(value: Any, ndigits: Any = None) -> Any:
    if ndigits is None:
        return round(value)
    if isinstance(ndigits, bool) or not isinstance(ndigits, int) or abs(ndigits) > 100:
        raise ToolError("round's digits must be a whole number from -100 to 100")
    return round(value, ndigits)


_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": _round,
    "log": math.log,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
}
_NAMES = {"pi": math.pi, "e": math.e}
_MAX_BITS = 4096  # integers beyond this are refused, so no expression can eat the machine


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, and
    sqrt, abs, round, log, sin, cos, tan, pi, e. Anything else is refused."""
    if len(expression) > 500:
        raise ToolError("expression too long (max 500 characters)")
    expression = expression.strip()  # a leading space would read as an indented line
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return _finite(node.value)  # 1e400 reads as infinity
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ToolError("exponent too large (max 1000)")
            if (
                isinstance(node.op, ast.Pow)
                and isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and left.bit_length() * right > _MAX_BITS
            ):
                raise ToolError("result too large")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > _MAX_BITS:
                raise ToolError("result too large")
            return _finite(value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Name) and node.id in _NAMES:
            return _NAMES[node.id]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
        ):
            return _finite(_FUNCS[node.func.id](*(ev(a) for a in node.args)))
        raise ToolError(f"not allowed in an expression: {ast.unparse(node)!r}")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise ToolError(f"cannot compute: {exc}") from None
    if not isinstance(value, int | float):  # e.g. a complex root of a negative number
        raise ToolError(f"not a real number: {expression!r}")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _finite(value: Any) -> Any:
    """``value``, unless it is a float that overflowed to infinity (``1e308*10``), or
    NaN (``inf-inf``): not the answer, so refused."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large (past ±1.8e308)")
    return value


def current_time(now: datetime, utc_offset_hours: float | None = None) -> str:
    """``now`` as ``YYYY-MM-DD HH:MM:SS (UTC+8)``, in the given offset or its own zone."""
    if utc_offset_hours is not None:
        if not -14 <= utc_offset_hours <= 14:
            raise ToolError("utc_offset_hours must be between -14 and 14")
        now = now.astimezone(timezone(timedelta(hours=utc_offset_hours)))
    offset = now.utcoffset() or timedelta(0)
    hours = offset.total_seconds() / 3600
    label = f"UTC{hours:+g}" if hours else "UTC"
    return f"{now:%Y-%m-%d %H:%M:%S} ({label}, {now:%A})"


def builtin_tools(
    clock_ms: Callable[[], int] | None = None, tz: tzinfo | None = None, *, texts: Texts = ZH
) -> list[Tool]:
    """``current_time`` and ``calculate`` as tools; ``clock_ms`` and ``tz`` make time
    deterministic in tests (default: the system clock and local zone); ``texts``: the
    language of their descriptions."""

    def now() -> datetime:
        if clock_ms is None:
            return datetime.now().astimezone(tz)
        return datetime.fromtimestamp(clock_ms() / 1000, tz or UTC)

    def time_tool(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        offset = args.get("utc_offset_hours")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int | float)):
            raise ToolError("utc_offset_hours must be a number")
        return current_time(now(), offset)

    def calc_tool(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        expression = args.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise ToolError("expression is required (text)")
        return calculate(expression)

    return [
        Tool(
            "current_time",
            time_tool,
            description=texts("tool.builtin.current_time"),
            parameters={
                "type": "object",
                "properties": {
                    "utc_offset_hours": {
                        "type": "number",
                        "description": texts("tool.builtin.current_time.utc_offset_hours"),
                    }
                },
            },
        ),
        Tool(
            "calculate",
            calc_tool,
            description=texts("tool.builtin.calculate"),
            parameters={
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": texts("tool.builtin.calculate.expression"),
                    }
                },
                "required": ["expression"],
            },
        ),
    ]
