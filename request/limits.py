"""What may enter the event log, and clear errors for what may not (pure; no I/O).

The log holds msgspec Structs encoded with MessagePack: integers must fit in 64 bits,
text must be valid Unicode (no lone surrogates), and anything nested must be shallow
enough to encode, decode, print and send without recursing too deep. Every check here is
iterative, so a value nested 100,000 deep gets an error instead of a ``RecursionError``:

- :func:`parse_tool_arguments` reads a tool call's arguments (FLOW13), checking the
  nesting of the raw text before ``json.loads`` ever sees it;
- :func:`check_depth` checks an already-built value, :func:`coerce_tool_result` turns a
  tool handler's return value into the text stored and sent (or an error);
- :func:`clean_text` repairs text that is not valid Unicode;
- :func:`find_unloggable` and :func:`toml_too_deep` find, in a configuration or scenario
  (the parsed table, and the TOML text before it is parsed), the dotted key of the first
  value the log cannot hold.

The texts that go to the model (a tool's arguments or result refused) come from the
locale packs, in the ``texts`` given (default ``zh``); the others are Chinese, in their tone.
"""

from __future__ import annotations

import json
import math
import re
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aalis_agent.events.codec import clean_text, clean_value
from aalis_agent.request.texts import ZH, Texts

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DEPTH",
    "check_depth",
    "clean_text",
    "coerce_tool_result",
    "find_unloggable",
    "has_lone_surrogate",
    "json_too_deep",
    "parse_tool_arguments",
    "show_path",
    "toml_too_deep",
    "tool_arguments_too_deep",
    "tool_arguments_too_long",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
"""The range of an integer the log holds (MessagePack's signed 64 bits; TOML's range too)."""

MAX_DEPTH = 64
"""Default nesting limit: tool arguments, tool results, configuration and scenario files."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A JSON ``\\u`` escape of a UTF-16 surrogate."""

_SURROGATE = re.compile("[\ud800-\udfff]")


# --- text ----------------------------------------------------------------------------


def has_lone_surrogate(s: str) -> bool:
    """True when ``s`` holds a surrogate code point (it cannot be encoded as UTF-8)."""
    return _SURROGATE.search(s) is not None


# --- tool arguments (FLOW13) ----------------------------------------------------------


def tool_arguments_too_deep(raw: str, max_depth: int, *, texts: Texts = ZH) -> str:
    """The result a call gets whose arguments nest deeper than ``max_depth``."""
    return texts("tool.arguments_too_deep", max_depth=max_depth, raw=clean_text(raw[:200]))


def tool_arguments_too_long(raw: str, max_chars: int, *, texts: Texts = ZH) -> str:
    """The result a call gets whose arguments are longer than ``max_chars`` characters."""
    return texts(
        "tool.arguments_too_long", length=len(raw), max_chars=max_chars, raw=clean_text(raw[:200])
    )


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)
"""A JSON string (skipped whole, even unterminated), or a bracket outside strings."""


def json_too_deep(raw: str, max_depth: int) -> bool:
    """True when the brackets of ``raw`` (outside JSON strings) nest deeper than
    ``max_depth``. One pass, no recursion; ``json.loads`` nests no deeper than this."""
    if raw.count("[") + raw.count("{") <= max_depth:
        return False
    depth = 0
    for m in _JSON_TOKEN.finditer(raw):
        c = raw[m.start()]
        if c == '"':
            continue
        if c in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif depth > 0:
            depth -= 1
    return False


def parse_tool_arguments(
    raw: str, *, max_depth: int = MAX_DEPTH, max_chars: int | None = None, texts: Texts = ZH
) -> tuple[dict[str, Any], str | None]:
    """A tool call's arguments (FLOW13): ``(args, None)`` for a JSON object (the empty
    string means none: ``{}``), else ``({}, the error the model gets)``: not JSON or not an
    object (:func:`~aalis_agent.request.texts.tool_bad_arguments`), nested deeper than
    ``max_depth``, or longer than ``max_chars``, in ``texts``' language. Never raises for
    any text. A number of more digits than the interpreter reads is named as such."""
    if raw == "":
        return {}, None
    if max_chars is not None and len(raw) > max_chars:
        return {}, tool_arguments_too_long(raw, max_chars, texts=texts)
    if json_too_deep(raw, max_depth):
        return {}, tool_arguments_too_deep(raw, max_depth, texts=texts)
    try:
        value = _DECODER.decode(raw)
    except (json.JSONDecodeError, _NotJson):
        return {}, texts.tool_bad_arguments(clean_text(raw))
    except ValueError:  # valid JSON, but an integer past the interpreter's digit limit
        if not raw.lstrip().startswith("{"):  # not an object anyway: said as any other
            return {}, texts.tool_bad_arguments(clean_text(raw))
        return {}, texts(
            "tool.arguments_number_too_long",
            max_digits=sys.get_int_max_str_digits(),
            raw=clean_text(raw[:200]),
        )
    if not isinstance(value, dict):
        return {}, texts.tool_bad_arguments(clean_text(raw))
    if _SURROGATE_ESCAPE.search(raw) is not None:
        # A JSON escape of a lone surrogate (``"\ud800"``) decodes to text that is not
        # valid Unicode: cleaned as every text the runtime keeps is (U+FFFD), so a tool,
        # its argument checks and their error messages never meet it.
        value = clean_value(value)
    return value, None


class _NotJson(ValueError):
    """A constant JSON does not have."""


def _not_json(name: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's JSON reader takes them, JSON has no
    such values (and a tool asked for a number means a finite one)."""
    raise _NotJson(f"{name} is not JSON")


# ``json.loads(raw, parse_constant=_not_json)`` builds a decoder per call: made once.
_DECODER = json.JSONDecoder(parse_constant=_not_json)


# --- values already built -------------------------------------------------------------

Path = tuple[object, ...]
"""Keys and list indices from the top of a value down to one place in it."""


def show_path(path: Path, *, limit: int = 200) -> str:
    """``a.b[2].c`` for ``("a", "b", 2, "c")``: keys joined by dots, indices in brackets,
    each key cut to 40 characters and the whole to ``limit``."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out.append(f"[{part}]")
            continue
        text = clean_text(part if isinstance(part, str) else _short_repr(part))
        if len(text) > 40:
            text = text[:39] + "…"
        out.append(("." if out else "") + text)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def _short_repr(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = repr(value) if isinstance(value, str | int | float | bool) else type(value).__name__
    except ValueError:
        text = type(value).__name__
    return text


def _children(value: object) -> Iterator[tuple[object, object]] | None:
    """The ``(key, child)`` pairs of a container, or None for a leaf."""
    if isinstance(value, Mapping):
        return iter(value.items())
    if isinstance(value, list | tuple):
        return enumerate(value)
    return None


def _walk(
    value: object,
    max_depth: int,
    leaf: Callable[[object], str | None],
    key: Callable[[object], str | None],
) -> tuple[Path, str] | None:
    """The first place (document order) where ``value`` nests deeper than ``max_depth``
    (problem ``"deep"``), or a leaf or a mapping key gets a problem from ``leaf`` or
    ``key``. A container counts one level; the top one is level 1. Iterative."""
    top = _children(value)
    if top is None:
        problem = leaf(value)
        return ((), problem) if problem is not None else None
    if max_depth < 1:
        return (), "deep"
    path: list[object] = []
    stack: list[tuple[Iterator[tuple[object, object]], bool]] = [(top, isinstance(value, Mapping))]
    while stack:
        items, mapping = stack[-1]
        pair = next(items, None)
        if pair is None:
            stack.pop()
            if path:
                path.pop()
            continue
        k, v = pair
        if mapping:
            problem = key(k)
            if problem is not None:
                return (*path, k), problem
        children = _children(v)
        if children is None:
            problem = leaf(v)
            if problem is not None:
                return (*path, k), problem
            continue
        if len(stack) + 1 > max_depth:
            return (*path, k), "deep"
        path.append(k)
        stack.append((children, isinstance(v, Mapping)))
    return None


def _no_problem(value: object) -> str | None:
    return None


def check_depth(value: object, max_depth: int = MAX_DEPTH) -> str | None:
    """None when ``value`` (dicts, lists and tuples of anything) nests at most
    ``max_depth`` levels (a container is one level), else a Chinese error saying where."""
    found = _walk(value, max_depth, _no_problem, _no_problem)
    if found is None:
        return None
    return f"嵌套超过 {max_depth} 层{_where(found[0])}"


def _where(path: Path) -> str:
    return f"（位置 {show_path(path)}）" if path else ""


def _json_leaf(value: object) -> str | None:
    if value is None or isinstance(value, str | bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "nan"
    return "type"


def _json_key(key: object) -> str | None:
    if key is None or isinstance(key, str | bool | int):
        return None
    if isinstance(key, float):
        return None if math.isfinite(key) else "nan"
    return "key"


def coerce_tool_result(
    value: object, *, max_depth: int = MAX_DEPTH, texts: Texts = ZH
) -> tuple[str | None, str | None]:
    """A tool handler's return value as ``(text, error)``: text is cleaned (lone
    surrogates replaced), bytes decoded as UTF-8 with replacement, None stays None, and a
    JSON value (dict, list, tuple, int, float, bool) becomes compact JSON text. Anything
    else, a non-finite number, or nesting past ``max_depth`` gives ``(None, error)``, the
    error in ``texts``' language (``tool.result_*``; the model reads it)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return clean_text(value), None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace"), None
    if not isinstance(value, dict | list | tuple | int | float):  # bool is an int
        return None, texts("tool.result_type", type=type(value).__name__)
    found = _walk(value, max_depth, _json_leaf, _json_key)
    if found is not None:
        path, problem = found
        where = texts("tool.result_where", path=show_path(path)) if path else ""
        if problem == "deep":
            return None, texts("tool.result_too_deep", max_depth=max_depth, where=where)
        if problem == "nan":
            return None, texts("tool.result_nan", where=where)
        if problem == "key":
            return None, texts("tool.result_key", where=where)
        bad = type(_at(value, path)).__name__
        return None, texts("tool.result_value", type=bad, where=where)
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # e.g. an integer past the digit limit
        return None, texts("tool.result_not_json", error=exc)
    return clean_text(text), None


def _at(value: Any, path: Path) -> object:
    for part in path:
        value = value[part]
    return value


# --- configuration and scenario files ------------------------------------------------


def _log_leaf(value: object) -> str | None:
    if isinstance(value, str):
        return "text" if _SURROGATE.search(value) is not None else None
    if isinstance(value, int) and not isinstance(value, bool):
        return None if INT64_MIN <= value <= INT64_MAX else "int"
    return None


def _log_key(key: object) -> str | None:
    if isinstance(key, str) and _SURROGATE.search(key) is not None:
        return "text"
    return None


_PROBLEMS = {
    "deep": "nested deeper than {max_depth} levels",
    "int": f"integer out of range: it must fit in 64 bits ({INT64_MIN} to {INT64_MAX})",
    "text": "text that is not valid Unicode (a lone surrogate)",
}


def find_unloggable(
    value: object, *, max_depth: int = MAX_DEPTH, shown: Callable[[Path], str] = show_path
) -> tuple[str, str] | None:
    """The first place in a parsed configuration or scenario (tables, lists, scalars)
    that the log could not hold: ``(dotted key, problem)`` for nesting past
    ``max_depth``, an integer outside 64 bits, or text (a key or a value) with a lone
    surrogate; None when there is none. The key is spelled by ``shown`` (a TOML file's
    reader passes ``services.config.toml_path``, which quotes what TOML quotes).
    Iterative."""
    found = _walk(value, max_depth, _log_leaf, _log_key)
    if found is None:
        return None
    path, problem = found
    return shown(path), _PROBLEMS[problem].format(max_depth=max_depth)


_TOML_STOP = re.compile(r"[\"'#\[\]{}\n]")
_BASIC_ML_STOP = re.compile(r'\\.|"""', re.S)


def toml_too_deep(
    text: str, max_depth: int = MAX_DEPTH, *, shown: Callable[[Path], str] = show_path
) -> tuple[str, int] | None:
    """Where TOML ``text`` nests arrays and inline tables deeper than ``max_depth``: the
    dotted key of the statement (``[[x]]`` tables numbered from 0) as ``shown`` spells
    its parts, and its line, or None.
    One pass without recursion, so ``tomllib`` (which recurses) never sees such a file.
    Brackets inside strings and comments do not count; invalid TOML is never refused
    here (tomllib says what is wrong with it)."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    n = len(text)
    i = 0
    line = 1
    header: list[str] = []
    arrays: dict[str, int] = {}  # array-of-tables header -> tables seen so far
    key: list[str] = []
    depth = 0
    statement = True  # at the start of a statement (depth 0, no value being read)
    while i < n:
        if statement:
            c = text[i]
            if c in " \t\r":
                i += 1
            elif c == "\n":
                line += 1
                i += 1
            elif c == "#" or c == "]":
                i = _line_end(text, i)
            elif c == "[":
                array = text.startswith("[[", i)
                i, header = _toml_key(text, i + (2 if array else 1), "]")
                name = ".".join(header)
                if array:
                    arrays[name] = arrays.get(name, 0) + 1
                    for other in [a for a in arrays if a.startswith(name + ".")]:
                        del arrays[other]
                i = _line_end(text, i)  # a header ends its line
            else:
                i, key = _toml_key(text, i, "=")
                if i < n and text[i] == "=":
                    statement = False
                    i += 1
                else:
                    i = _line_end(text, i)
            continue
        m = _TOML_STOP.search(text, i)
        if m is None:
            break
        i = m.start()
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
            statement = depth == 0
        elif c == "#":
            i = _line_end(text, i)
        elif c in "\"'":
            end = _string_end(text, i)
            line += text.count("\n", i, end)
            i = end
        elif c in "[{":
            depth += 1
            if depth > max_depth:
                return shown(_toml_path(header, arrays, key)), line
            i += 1
        else:
            depth = max(depth - 1, 0)
            i += 1
    return None


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _string_end(text: str, i: int) -> int:
    """The index after the TOML string that starts at ``i`` (one line at most, unless it
    is a multi-line string); an unterminated string ends at its line's end."""
    quote = text[i]
    if text.startswith(quote * 3, i):
        j = i + 3
        while True:
            if quote == '"':
                m = _BASIC_ML_STOP.search(text, j)
                if m is None:
                    return len(text)
                if m.group() != '"""':
                    j = m.end()
                    continue
                end = m.end()
            else:
                found = text.find("'''", j)
                if found < 0:
                    return len(text)
                end = found + 3
            extra = 0  # up to two more quotes belong to the string
            while extra < 2 and end < len(text) and text[end] == quote:
                end += 1
                extra += 1
            return end
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\n":
            return j
        if c == "\\" and quote == '"':
            j += 2
            continue
        j += 1
        if c == quote:
            return j
    return len(text)


def _toml_key(text: str, i: int, stop: str) -> tuple[int, list[str]]:
    """A dotted key starting at ``i``, read up to ``stop`` (returned at it) or the line's
    end: its parts, quotes removed and a basic string's escapes read (one that is not
    valid is kept as written)."""
    parts: list[str] = []
    part: list[str] = []
    n = len(text)
    while i < n:
        c = text[i]
        if c == stop or c == "\n" or c == "#":
            break
        if c in "\"'":
            end = _string_end(text, i)
            part.append(_key_string(text[i:end]))
            i = end
        elif c == ".":
            parts.append("".join(part).strip())
            part = []
            i += 1
        else:
            part.append(c)
            i += 1
    parts.append("".join(part).strip())
    return i, parts


def _key_string(quoted: str) -> str:
    """A quoted key's text: a literal string's as written, a basic string's with its
    escapes read (as written when they are not valid, or the string is not closed)."""
    inner = quoted[1:-1] if len(quoted) >= 2 and quoted[-1] == quoted[0] else quoted[1:]
    if quoted[0] == "'" or "\\" not in inner:
        return inner
    try:  # one short basic string: tomllib reads it without nesting
        value = tomllib.loads(f"k = {quoted}")["k"]
    except tomllib.TOMLDecodeError:
        return inner
    return value if isinstance(value, str) else inner


def _toml_path(header: list[str], arrays: dict[str, int], key: list[str]) -> Path:
    path: list[object] = []
    for k, part in enumerate(header):
        path.append(part)
        name = ".".join(header[: k + 1])
        if name in arrays:
            path.append(arrays[name] - 1)
    path.extend(key)
    return tuple(path)
