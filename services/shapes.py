"""Helpers for turning msgspec's validation errors into the words of a configuration or
scenario file: the declared type at a path (``$.providers[0].id`` → its field's type
info) and the value given there. Shared by the configuration file and scenario loaders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec.inspect as mi

__all__ = ["bare", "info_at", "value_at"]


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
