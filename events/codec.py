"""The one place that encodes and decodes log rows, built once and reused.

Rows are stored as MessagePack (compact, fast); ``--json`` output and golden files use
JSON. No other module calls ``msgspec.*.decode`` on log rows.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from aalis_agent.events.errors import CorruptEvent
from aalis_agent.events.schema import Event, SessionEvent

__all__ = [
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "event_tag",
    "restamp",
    "to_builtins",
]

E = TypeVar("E", bound=Event)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[SessionEvent] = msgspec.msgpack.Decoder(SessionEvent)
_json_encoder = msgspec.json.Encoder()
_json_decoder: msgspec.json.Decoder[SessionEvent] = msgspec.json.Decoder(SessionEvent)


def encode(event: Event) -> bytes:
    """Encode one event for storage."""
    return _encoder.encode(event)


def decode(data: bytes, *, session_id: str = "?", seq: int = 0) -> SessionEvent:
    """Decode one stored row; a bad row raises :class:`CorruptEvent` naming session and seq."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(session_id, seq, str(exc)) from None
    except TypeError:  # not bytes at all (e.g. a TEXT value written by another tool)
        raise CorruptEvent(session_id, seq, f"data is {type(data).__name__}, not bytes") from None


def encode_json(event: Event) -> bytes:
    """Encode one event as a JSON object (``type`` first), for output and golden files."""
    return _json_encoder.encode(event)


def decode_json(data: bytes | str, *, session_id: str = "?", seq: int = 0) -> SessionEvent:
    """Decode one JSON-encoded event; errors as in :func:`decode`."""
    try:
        return _json_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(session_id, seq, str(exc)) from None


def to_builtins(event: Event) -> Any:
    """The event as plain dicts and lists (the shape ``--json`` prints)."""
    return msgspec.to_builtins(event)


def event_tag(event: Event) -> str:
    """The stable tag an event is stored under."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def restamp(event: E, *, seq: int, session_id: str | None = None) -> E:
    """A copy of ``event`` with another seq (and session), for building batches."""
    if session_id is None:
        return msgspec.structs.replace(event, seq=seq)
    return msgspec.structs.replace(event, seq=seq, session_id=session_id)
