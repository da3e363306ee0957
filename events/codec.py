"""The one place that encodes and decodes log rows, built once and reused.

Rows are stored as MessagePack (compact, fast); ``--json`` output and golden files use
JSON. No other module calls ``msgspec.*.decode`` on log rows.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from aalis_agent.events.errors import CorruptEvent, InvalidInput
from aalis_agent.events.schema import Event, Input, SessionEvent

__all__ = [
    "checked_input",
    "clean_text",
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
_input_decoder: msgspec.msgpack.Decoder[Input] = msgspec.msgpack.Decoder(Input)
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


def checked_input(inp: Input) -> Input:
    """``inp`` as the log will store it, or :class:`InvalidInput` naming the field that
    is wrong: it is encoded and decoded as its event row would be, so a wrong type (``None``
    or ``123`` for ``content``), an integer past 64 bits or an object msgpack cannot hold
    is refused here, before anything is written. Text with lone surrogates (half an
    emoji) is cleaned first: a split pair joined, a lone half replaced by U+FFFD."""
    if not isinstance(inp, Input):
        raise InvalidInput(f"expected an Input, got {type(inp).__name__}")
    try:
        data = _encoder.encode(inp)
    except UnicodeEncodeError:
        inp = _cleaned(inp)
        return checked_input(inp)
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
        raise InvalidInput(f"input {inp.id!r}: {exc}") from None
    try:
        return _input_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidInput(f"input {inp.id!r}: {exc}") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(s: str) -> str:
    """``s`` as valid Unicode: a surrogate pair split into two code points (an emoji cut
    between stream chunks) is joined, and any surrogate left alone becomes U+FFFD. Text
    without surrogates is returned as is."""
    if _SURROGATE.search(s) is None:
        return s
    joined = s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return _SURROGATE.sub("\ufffd", joined)


def _cleaned(value: Any) -> Any:
    """``value`` with every text in it cleaned of lone surrogates (structs, tuples, lists,
    dicts walked; other values as they are)."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, msgspec.Struct):
        changes = {f: _cleaned(getattr(value, f)) for f in value.__struct_fields__}
        return msgspec.structs.replace(value, **changes)
    if isinstance(value, tuple | list):
        return type(value)(_cleaned(v) for v in value)
    if isinstance(value, dict):
        return {_cleaned(k): _cleaned(v) for k, v in value.items()}
    return value


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
