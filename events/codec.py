"""The one place that encodes and decodes log rows, built once and reused.

Events are MessagePack maps (compact, and decoded by msgspec straight into the schema's
Structs); ``--json`` output and golden files use JSON. No other module calls
``msgspec.*.decode`` on log rows. A stored row is in one of two formats:

* **Format 1**: one event, encoded whole (:func:`encode`, :func:`decode`). What the
  in-memory store keeps, and every SQLite row written before format 2; still read.
* **Format 2** (:func:`pack_row`, :class:`RowReader`): one SQLite row per appended batch.
  The byte ``0x02``; the row's place in its *group* (a byte, 0 for a group's first row);
  the number of events (a varint); then a raw DEFLATE stream (16 KiB window) of a
  MessagePack array of the events *keyless* (:func:`encode_keyless`: no ``session_id``
  and ``seq``, which the row's key gives back). The stream is compressed against a
  dictionary: the fixed bytes of :mod:`._dictionary` (typical events), then
  ``"sessionId"`` and the session id, then, for every row of a group but its first, the
  last :data:`CONTEXT_BYTES` of the group's earlier rows (their arrays, one after the
  other). Field names, tags and the values a session repeats (its turn ids, model,
  token counts) thus cost a back-reference each. A writer ends a group after
  :data:`GROUP_ROWS` rows, so a row is read with at most that many rows before it, and
  one row that cannot be read costs at most the rest of its group.

The dictionary, :data:`CONTEXT_BYTES` and the window are part of format 2: a stored row
inflates against exactly them, so they never change; other values make another format.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import msgspec
from aalis_agent.events._dictionary import dictionary
from aalis_agent.events.errors import CorruptEvent, InvalidInput
from aalis_agent.events.schema import Event, Input, SessionEvent

__all__ = [
    "CONTEXT_BYTES",
    "GROUP_ROWS",
    "ROW_FORMAT",
    "RowChain",
    "RowContext",
    "RowReader",
    "checked_input",
    "checked_session_id",
    "clean_text",
    "clean_value",
    "decode",
    "decode_json",
    "decode_rows",
    "encode",
    "encode_json",
    "encode_keyless",
    "encode_rows",
    "event_tag",
    "pack_row",
    "restamp",
    "row_header",
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


def encode_keyless(event: Event) -> bytes:
    """Encode one event as a format-2 row holds it: without ``session_id`` and ``seq``."""
    return _encoder.encode(msgspec.structs.replace(event, session_id="", seq=0))


def decode(data: bytes, *, session_id: str = "?", seq: int = 0) -> SessionEvent:
    """Decode one event encoded whole (a format-1 row); a bad row raises
    :class:`CorruptEvent` naming session and seq."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(session_id, seq, str(exc)) from None
    except TypeError:  # not bytes at all (e.g. a TEXT value written by another tool)
        raise CorruptEvent(session_id, seq, f"data is {type(data).__name__}, not bytes") from None


def checked_input(inp: Input, *, max_text_bytes: int | None = None) -> Input:
    """``inp`` as the log will store it, or :class:`InvalidInput` naming the field that
    is wrong: it is encoded and decoded as its event row would be, so a wrong type (``None``
    or ``123`` for ``content``), an integer past 64 bits or an object msgpack cannot hold
    is refused here, before anything is written. Text with lone surrogates (half an
    emoji) is cleaned first: a split pair joined, a lone half replaced by U+FFFD.

    ``max_text_bytes``: the most UTF-8 bytes its ``content`` may have (None: no limit);
    a longer text is refused first, before any work is done on it, naming its size and
    the limit (``Runtime(max_input_bytes=...)``); with it, its other fields (a
    nickname, the mentions, ids) may take :data:`OTHER_FIELDS_BYTES` as stored."""
    if not isinstance(inp, Input):
        raise InvalidInput(f"expected an Input, got {type(inp).__name__}")
    if max_text_bytes is not None:
        _check_text_size(inp, max_text_bytes)
    try:
        data = _encoder.encode(inp)
    except UnicodeEncodeError:
        inp = _cleaned(inp)
        return checked_input(inp, max_text_bytes=max_text_bytes)
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
        raise InvalidInput(f"input {_shown_id(inp)}: {exc}") from None
    except RecursionError:
        raise InvalidInput(
            f"input {_shown_id(inp)}: {_too_deep(inp)} is nested too deeply to be stored"
        ) from None
    if max_text_bytes is not None and len(data) > OTHER_FIELDS_BYTES:
        content = inp.content
        text = len(content) if content.isascii() else len(content.encode("utf-8", "surrogatepass"))
        if len(data) - text > OTHER_FIELDS_BYTES:
            raise InvalidInput(
                f"{'input ' + _shown_id(inp) if inp.id else 'input'}: it is {len(data):,} "
                f"bytes as stored, its text {text:,} of them: its other fields (a nickname, "
                f"mentions, ids) are over their limit of {OTHER_FIELDS_BYTES:,} bytes"
            )
    try:
        return _input_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidInput(f"input {_shown_id(inp)}: {exc}") from None


OTHER_FIELDS_BYTES = 65_536
"""What an input's fields besides its text may take as stored, wherever its text is
limited (``checked_input``'s ``max_text_bytes``, ``Runtime(max_input_bytes=...)``)."""


def _too_deep(inp: Input) -> str:
    """The field of ``inp`` that cannot be encoded for its depth ("a value" if none
    alone fails)."""
    for name in inp.__struct_fields__:
        try:
            _encoder.encode(getattr(inp, name))
        except RecursionError:
            return name
        except Exception:  # another fault: not this one's
            continue
    return "a value"


def _shown_id(inp: Input) -> str:
    """An input's id for an error message, cut past 200 characters (whatever its type:
    the message may be about it)."""
    shown = repr(inp.id)
    return shown if len(shown) <= 200 else shown[:199] + "…"


def _check_text_size(inp: Input, limit: int) -> None:
    """:class:`InvalidInput` when ``inp``'s text has more than ``limit`` UTF-8 bytes.
    A character is one to four bytes: the text's length decides most texts unencoded."""
    text = inp.content
    if not isinstance(text, str) or len(text) <= limit // 4:
        return  # not text (the encoding names that), or within the limit whatever it holds
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return
    who = f"input {_shown_id(inp)}" if inp.id else "input"
    raise InvalidInput(
        f"{who}: its text is {size:,} bytes (UTF-8), over the limit of "
        f"{limit:,} bytes (Runtime max_input_bytes)"
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def checked_session_id(session_id: object) -> str:
    """``session_id`` when a log can be named by it, else :class:`InvalidInput` naming
    what is wrong: it must be a ``str`` (``5`` and ``"5"`` would file into one log) of
    valid Unicode (a lone surrogate cannot be stored; unlike text, a name is not
    repaired: two ids would become one), and not empty (an id left unset, most likely)."""
    if type(session_id) is not str and not isinstance(session_id, str):
        raise InvalidInput(f"session id must be a str, got {type(session_id).__name__}")
    if type(session_id) is not str:
        session_id = str.__str__(session_id)  # a subclass's value as a plain str
    if not session_id:
        raise InvalidInput("session id must not be empty")
    if _SURROGATE.search(session_id) is not None:
        raise InvalidInput(
            f"session id {session_id!r} is not valid Unicode (it holds a lone surrogate)"
        )
    return session_id


def clean_text(s: str) -> str:
    """``s`` as valid Unicode: a surrogate pair split into two code points (an emoji cut
    between stream chunks) is joined, and any surrogate left alone becomes U+FFFD. Text
    without surrogates is returned as is. A ``str`` subclass (a markup string, say)
    comes back as a plain ``str``: the log stores text, not the subclass."""
    if type(s) is not str:
        s = str.__str__(s)  # a plain copy (a subclass's own __str__ may do anything)
    if _SURROGATE.search(s) is None:
        return s
    joined = s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return _SURROGATE.sub("\ufffd", joined)


def clean_value(value: Any) -> Any:
    """``value`` with every text in it cleaned of lone surrogates (structs, tuples, lists,
    dicts walked; other values as they are), as :func:`clean_text` cleans one."""
    return _cleaned(value)


def _cleaned(value: Any) -> Any:
    """See :func:`clean_value`."""
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


def to_builtins(event: Any) -> Any:
    """The event as plain dicts and lists (the shape ``--json`` prints), with string
    keys throughout, so that JSON can always hold it: a key of another kind (a tuple in
    a tool's metadata, from a log written before such metadata was dropped) becomes its
    ``repr``, and so does a value of a kind JSON has no form for (a MessagePack extension
    in a hand-written row)."""
    try:
        return msgspec.to_builtins(event, str_keys=True, enc_hook=_as_repr)
    except (TypeError, ValueError):
        return _str_keys(msgspec.to_builtins(event, enc_hook=_as_repr))


def _as_repr(value: Any) -> str:
    """A value ``to_builtins`` has no plain form for, as its ``repr`` (a MessagePack
    extension as its code and data)."""
    if isinstance(value, msgspec.msgpack.Ext):
        return f"msgpack.Ext(code={value.code}, data={bytes(value.data)!r})"
    try:
        return repr(value)
    except Exception:  # a repr that fails: the type still names it
        return f"<{type(value).__name__}>"


def _str_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_str_keys(v) for v in value]
    return value


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


# --- format 2: one compressed row per batch ------------------------------------------

ROW_FORMAT = 2
"""The format new SQLite rows are written in (format 1: one event per row, encoded whole)."""

GROUP_ROWS = 32
"""The most rows a writer puts in one group, so a row is read with at most this many
rows before it (a reader takes any group the row header can say: up to 256 rows)."""

CONTEXT_BYTES = 4096
"""How much of a group's earlier rows (their end) a row is compressed against; part of
the format, never changed."""

_MARK = 0x02  # the first byte of a format-2 row; a format-1 row starts with a map header
_WBITS = -14  # raw DEFLATE, 16 KiB window: the dictionary (about 7.3 KiB) fits whole
# How rows are compressed (a reader inflates any DEFLATE stream: these are not the format).
# Fixed Huffman codes: on rows this small a dynamic table seldom pays for itself (a few
# bytes a turn), and fixed-code blocks inflate about twice as fast; a small hash table
# costs nothing on rows of a few KiB and is quicker to set up. A 4 KiB window: the
# compressor takes in only the dictionary's last 4 KiB (the group's recent plaintext),
# about half the work of taking it all in, for about 1% more bytes; the stream it writes
# reaches back at most 4 KiB, which a reader's 16 KiB window holds whole. Level 6: its
# shorter match search takes about 11,500 fewer instructions a tool turn than level 9's,
# for about 1 byte more a turn (of ~675; the database file the same size).
_DEFLATE_WBITS = -12
_LEVEL = 6
_MEM_LEVEL = 4
_STRATEGY = zlib.Z_FIXED
_STATIC = dictionary()
_setattr = msgspec.structs.force_setattr
_replace = msgspec.structs.replace
_rows_decoder: msgspec.msgpack.Decoder[list[SessionEvent]] = msgspec.msgpack.Decoder(
    list[SessionEvent]
)


class RowContext(NamedTuple):
    """What the next row of a session may be compressed against: the row just written
    or read (its last ``seq`` and its place ``depth`` in its group) and the dictionary
    the next row of its group is compressed against (``zdict``: the fixed bytes, the
    session, the end of the group's plaintext so far)."""

    seq: int
    depth: int
    zdict: bytes


def _head(session_id: str) -> bytes:
    """The dictionary of a group's first row: the fixed bytes, then the session id as the
    ``sessionId`` of a token-usage payload spells it. A name that is not valid Unicode
    (a session table edited by hand) gets its raw bytes: its rows then read as corrupt,
    each named, instead of the read failing."""
    try:
        name = _encoder.encode(session_id)
    except (msgspec.EncodeError, UnicodeEncodeError):
        name = _encoder.encode(session_id.encode("utf-8", "surrogateescape"))
    return _STATIC + b"\xa9sessionId" + name


def _next_zdict(head: bytes, zdict: bytes, body: bytes) -> bytes:
    """The dictionary after a row whose plaintext is ``body``, compressed against
    ``zdict``: ``head`` and the last :data:`CONTEXT_BYTES` of the group's plaintext
    (``zdict`` past ``head``, then ``body``), copied once."""
    keep = CONTEXT_BYTES - len(body)
    if keep <= 0:
        return b"".join((head, memoryview(body)[-CONTEXT_BYTES:]))
    if keep >= len(zdict) - len(head):
        return zdict + body
    return b"".join((head, memoryview(zdict)[len(zdict) - keep :], body))


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def row_header(data: object) -> tuple[int, int, int] | None:
    """``(depth, count, offset)`` of a format-2 row: its place in its group, how many
    events it holds and where its DEFLATE stream starts; None for any other row (a
    format-1 row, or one too short to be either)."""
    if not isinstance(data, bytes) or len(data) < 3 or data[0] != _MARK:
        return None
    depth = data[1]
    if data[2] < 0x80:  # fewer than 128 events: the count is one byte
        return depth, data[2], 3
    count = shift = 0
    for i in range(2, min(len(data), 12)):
        byte = data[i]
        count |= (byte & 0x7F) << shift
        if byte < 0x80:
            return depth, count, i + 1
        shift += 7
    return None


def _group_rows() -> int:
    return max(1, min(GROUP_ROWS, 256))  # a row says its place in one byte


def encode_rows(events: Iterable[Event]) -> bytes:
    """The plaintext of a format-2 row holding ``events``: a MessagePack array of the
    events keyless, in one call (the same bytes as the array header, then
    :func:`encode_keyless` of each event)."""
    return _encoder.encode([_replace(e, session_id="", seq=0) for e in events])


def decode_rows(body: bytes) -> list[SessionEvent]:
    """The events of a format-2 row's plaintext as a reader decodes them, still keyless
    (``session_id`` empty, ``seq`` 0); raises msgspec's ``DecodeError`` or
    ``ValidationError`` when they do not decode."""
    return _rows_decoder.decode(body)


def _new_deflate(zdict: bytes | memoryview) -> zlib._Compress:
    return zlib.compressobj(_LEVEL, zlib.DEFLATED, _DEFLATE_WBITS, _MEM_LEVEL, _STRATEGY, zdict)


# An empty final block (fixed codes: the header bits 1, 01, then the end-of-block code),
# after a sync flush has left the stream on a byte boundary.
_LAST_BLOCK = b"\x03\x00"


def _deflate_on(deflate: zlib._Compress, zdict: bytes | memoryview, body: bytes) -> bytes:
    """``body`` as a raw DEFLATE stream of its own, from ``deflate``: a compressor whose
    window ends as ``zdict`` does (made with it, or one that went on from the row before),
    which keeps going for the next row. The blocks it writes end with a sync flush, then
    an empty final block closes the stream. Inflated once more against ``zdict``, as a
    reader inflates it: it must give back exactly ``body``, end where the stream ends and
    leave nothing over."""
    packed = deflate.compress(body) + deflate.flush(zlib.Z_SYNC_FLUSH) + _LAST_BLOCK
    inflate = zlib.decompressobj(_WBITS, zdict=zdict)
    if inflate.decompress(packed) != body or not inflate.eof or inflate.unused_data:
        raise ValueError("the packed row does not inflate back")  # zlib itself failed
    return packed


def _row(depth: int, count: int, packed: bytes) -> bytes:
    if count < 0x80:
        return bytes((_MARK, depth, count)) + packed
    return bytes((_MARK, depth)) + _varint(count) + packed


def pack_row(
    session_id: str, parts: Sequence[bytes], last_seq: int, after: RowContext | None
) -> tuple[bytes, RowContext]:
    """One format-2 row holding ``parts`` (:func:`encode_keyless` of consecutive events,
    the last one ``last_seq``), and the context the session's next row may use.

    ``after`` is the context of the session's row just before (its seq must be the one
    before ``parts``), or None: the row then starts a group, as it does when the group
    is full. The row is inflated once more before it is returned: it must give back
    exactly what was packed.
    """
    if not parts:
        raise ValueError("a row holds at least one event")
    head = _head(session_id)
    if after is None or after.seq != last_seq - len(parts) or after.depth + 1 >= _group_rows():
        depth, zdict = 0, head
    else:
        depth, zdict = after.depth + 1, after.zdict
    body = _array_header(len(parts)) + b"".join(parts)
    row = _row(depth, len(parts), _deflate_on(_new_deflate(zdict), zdict, body))
    return row, RowContext(last_seq, depth, _next_zdict(head, zdict, body))


class RowChain:
    """A writer's memory of the last row it stored for one session, to continue that
    row's group: the row's ``seq`` and ``depth``, and the dictionary the group's next row
    is compressed against (the session's fixed bytes, then the last
    :data:`CONTEXT_BYTES` of the group's plaintext; what :class:`RowReader` rebuilds).

    The dictionary lives in one buffer allocated with the chain and rewritten in place as
    rows are stored, so a writer that keeps chains for many sessions allocates nothing
    lasting per row.

    The chain may also keep the compressor that wrote its last row (see :meth:`advance`):
    its window already ends as the next row's dictionary does (the compressor reaches
    back 4 KiB, the dictionary's last 4 KiB are the group's latest plaintext), so the next
    row goes on from it instead of a new compressor taking in the whole dictionary, which
    is most of the work of packing a row. About 30 KiB each: a writer keeps a few, for
    the sessions it wrote last (:meth:`drop_compressor`).

    :meth:`pack` changes nothing the chain's readers see and may run outside the
    writer's lock (it takes the kept compressor, which no other :meth:`pack` can then
    use); :meth:`advance` records a row once it is stored. A :meth:`pack` that overlaps
    an :meth:`advance` of the same chain reads ``seq`` first (``advance`` writes it last),
    so it can only pack against a newer row than the one it meant to follow, that is
    after another append of the session was stored: the writer's sequence check then
    refuses the row it packed.
    """

    __slots__ = ("_buf", "_deflate", "_deflate_seq", "_head", "_used", "depth", "seq")

    def __init__(self, session_id: str) -> None:
        head = _head(session_id)
        self._head = len(head)
        self._buf = bytearray(len(head) + CONTEXT_BYTES)
        self._buf[: len(head)] = head
        self._used = 0  # bytes of the group's plaintext kept after the head
        self.seq = -1  # no row yet: the next one starts a group
        self.depth = 0
        self._deflate: zlib._Compress | None = None  # it wrote row ``_deflate_seq``
        self._deflate_seq = -1

    def pack(self, body: bytes, count: int, last_seq: int) -> tuple[bytes, int, zlib._Compress]:
        """The row holding ``body`` (:func:`encode_rows` of ``count`` events, the last one
        ``last_seq``), its depth, and the compressor to hand to :meth:`advance` once the
        row is stored: continuing the group of the chain's last row when that row is the
        one just before and its group has room, else starting one."""
        seq = self.seq  # first: see the class docstring
        depth = self.depth + 1
        if seq != last_seq - count or depth >= _group_rows():
            row, deflate = self.pack_first(body, count)
            return row, 0, deflate
        zdict = bytes(self.dictionary(True))  # a copy: advance() may rewrite the buffer
        kept, self._deflate = self._deflate, None  # taken: no other pack can use it
        if kept is not None and self._deflate_seq == seq:
            try:
                return _row(depth, count, _deflate_on(kept, zdict, body)), depth, kept
            except ValueError:
                pass  # raced with an advance (its row is then refused): start afresh
        deflate = _new_deflate(zdict)
        return _row(depth, count, _deflate_on(deflate, zdict, body)), depth, deflate

    def pack_first(self, body: bytes, count: int) -> tuple[bytes, zlib._Compress]:
        """The row holding ``body`` as the first of a group, and its compressor."""
        zdict = self.dictionary(False)
        deflate = _new_deflate(zdict)
        return _row(0, count, _deflate_on(deflate, zdict, body)), deflate

    def dictionary(self, continued: bool) -> memoryview:
        """The dictionary of the next row: of one continuing the chain's group
        (``continued``), or of one starting a group (the session's fixed bytes, which
        never change). A view of the buffer, which :meth:`advance` rewrites."""
        return memoryview(self._buf)[: self._head + self._used if continued else self._head]

    def advance(
        self, last_seq: int, depth: int, body: bytes, deflate: zlib._Compress | None = None
    ) -> None:
        """Record the row :meth:`pack` gave for ``body`` as stored: the chain now ends with
        it, and keeps ``deflate`` (the compressor :meth:`pack` gave with it) for the next
        row. The buffer keeps its size (a copy within it, never a new one)."""
        buf, head, size = self._buf, self._head, CONTEXT_BYTES
        used = self._used if depth else 0
        n = len(body)
        if n >= size:
            buf[head:] = memoryview(body)[n - size :]
            used = size
        elif used + n <= size:
            buf[head + used : head + used + n] = body
            used += n
        else:  # keep the end of what was there, then the row
            keep = size - n
            buf[head : head + keep] = buf[head + used - keep : head + used]
            buf[head + keep :] = body
            used = size
        self._used = used
        self.depth = depth
        self._deflate_seq = last_seq  # before the compressor: a pack that sees this one
        self._deflate = deflate  # sees the row it wrote
        self.seq = last_seq  # last: see the class docstring

    def drop_compressor(self) -> None:
        """Let the kept compressor go (its memory); the next row makes a new one."""
        self._deflate = None


class RowReader:
    """Reads the rows of one session, in seq order, in either format.

    :meth:`read` takes each row with its ``seq`` (the seq of its last event) and
    returns its events; a row that cannot be read raises :class:`CorruptEvent` naming its
    first seq, and the reader goes on with the next row. A row that continues a group
    needs the row before it read first (with ``events=False`` when only its context is
    wanted): one that follows a row not read, or not read successfully, is corrupt too.
    """

    __slots__ = ("_after", "_head", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._head = _head(session_id)
        self._after: RowContext | None = None

    def read(self, seq: int, data: bytes, *, events: bool = True) -> list[SessionEvent]:
        """The events of one row (none when ``events`` is False: the row is read as the
        context of the next one only)."""
        header = row_header(data)
        if header is None:
            self._after = None
            if not events:
                return []
            return [decode(data, session_id=self.session_id, seq=seq)]
        depth, count, offset = header
        first = seq - count + 1
        after, self._after = self._after, None
        if count < 1:
            raise self._corrupt(seq, 1, "it says it holds no events")
        if count > seq:  # a damaged header: name the row by its own seq, not by it
            raise self._corrupt(seq, 1, f"it says it holds {count} events, ending at seq {seq}")
        zdict = self._head
        if depth:
            if after is None or after.seq != first - 1 or after.depth != depth - 1:
                raise self._corrupt(
                    first, count, f"it continues the row before seq {first}, which was not read"
                )
            zdict = after.zdict
        try:
            inflate = zlib.decompressobj(_WBITS, zdict=zdict)
            body = inflate.decompress(memoryview(data)[offset:])
        except zlib.error as exc:
            raise self._corrupt(first, count, f"does not inflate: {exc}") from None
        if not inflate.eof or inflate.unused_data:
            raise self._corrupt(first, count, "its compressed stream is cut short or overlong")
        self._after = RowContext(seq, depth, _next_zdict(self._head, zdict, body))
        if not events:
            return []
        try:
            out = _rows_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._corrupt(first, count, str(exc)) from None
        if len(out) != count:
            raise self._corrupt(first, count, f"it holds {len(out)} events")
        session_id = self.session_id
        for n, event in enumerate(out, first):  # the keys the row leaves out
            _setattr(event, "session_id", session_id)
            _setattr(event, "seq", n)
        return out

    def _corrupt(self, first: int, count: int, reason: str) -> CorruptEvent:
        span = f"seq {first}" if count == 1 else f"seqs {first}-{first + count - 1}"
        return CorruptEvent(self.session_id, first, f"a row of {span}: {reason}")
