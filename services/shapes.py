"""Helpers for turning msgspec's validation errors into the words of a configuration or
scenario file: the declared type at a path (``$.providers[0].id`` → its field's type
info) and the value given there. Shared by the configuration file and scenario loaders."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec.inspect as mi
from aalis_agent.services.settings import shown_value

__all__ = [
    "FIELD",
    "RANGE",
    "bare",
    "extra",
    "info_at",
    "kind",
    "split_error",
    "value_at",
    "what",
]

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>.*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
RANGE = re.compile(r"^Expected `(?:int|float)` (?P<op>[<>]=?) (?P<bound>\S+)$")
"""msgspec's message for a number out of its bounds."""
FIELD = re.compile(r"^Object (?P<how>contains unknown|missing required) field `(?P<name>.*)`$")
"""msgspec's message for an unknown or a missing key."""


def split_error(error: str) -> tuple[str, list[str | int]]:
    """msgspec's validation error as its message and the steps of its path:
    ``"Expected `int` - at `$.a.b[0]`"`` gives ``("Expected `int`", ["a", "b", 0])``."""
    m = _AT.match(error)
    message, path = (m["message"], m["path"] or "") if m else (error, "")
    return message, [name or int(index) for name, index in _SEGMENT.findall(path)]


def extra(info: Any) -> dict[str, Any]:
    """The ``extra`` of ``info``'s metadata (with that of a union's members)."""
    found: dict[str, Any] = {}
    while isinstance(info, mi.Metadata):
        found.update(info.extra or {})
        info = info.type
    if isinstance(info, mi.UnionType):
        for member in info.types:
            found = {**extra(member), **found}
    return found


def _outer(info: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    while isinstance(info, mi.Metadata):
        found.update(info.extra or {})
        info = info.type
    return found


def what(info: Any) -> str:
    """What a value of type ``info`` is, in words (a ``what`` in its metadata wins)."""
    outer = _outer(info)
    if outer.get("what"):
        return str(outer["what"])
    info = bare(info)
    if isinstance(info, mi.UnionType):
        return " or ".join(what(t) for t in info.types if not isinstance(t, mi.NoneType))
    if isinstance(info, mi.LiteralType):
        return f"one of {', '.join(map(str, outer.get('values', info.values)))}"
    if isinstance(info, mi.StrType):
        return "non-empty text" if info.min_length else "text"
    if isinstance(info, mi.IntType):
        return "an integer"
    if isinstance(info, mi.FloatType):
        return "a number"
    if isinstance(info, mi.BoolType):
        return "true or false"
    if isinstance(info, mi.ListType):
        return "a list of text" if isinstance(bare(info.item_type), mi.StrType) else "a list"
    if isinstance(info, mi.StructType | mi.DictType):
        return "a table"
    return "something else"


def kind(value: Any, shown: Callable[[Any], str] = shown_value) -> str:
    """What a given value is, in words, with the value when short (text shown by
    ``shown``: as Python spells it unless told otherwise)."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"text ({shown(value)})" if value else "empty text"
    return type(value).__name__


def bare(info: Any, want: type | None = None) -> Any:
    """``info`` without its metadata; with ``want``, the member of a union (or ``info``
    itself) of that kind, else None."""
    while isinstance(info, mi.Metadata):
        info = info.type
    if want is None:
        return info
    members = info.types if isinstance(info, mi.UnionType) else (info,)
    return next((t for t in map(bare, members) if isinstance(t, want)), None)


def info_at(info: Any, steps: list[str | int]) -> Any:
    """The type of the value at ``steps`` below a value of type ``info``."""
    for step in steps:
        if isinstance(step, int):
            info = getattr(bare(info, mi.ListType), "item_type", mi.AnyType())
        elif (struct := bare(info, mi.StructType)) is not None:
            info = next((f.type for f in struct.fields if f.encode_name == step), mi.AnyType())
        else:
            info = getattr(bare(info, mi.DictType), "value_type", mi.AnyType())
    return info


def value_at(value: Any, steps: list[str | int]) -> Any:
    """The value at ``steps`` (keys and list indexes) below ``value``, or None."""
    for step in steps:
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            value = value[step]
        elif isinstance(step, str) and isinstance(value, Mapping):
            value = value.get(step)
        else:
            return None
    return value
