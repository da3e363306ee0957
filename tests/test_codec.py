"""Property tests of ``events.codec``: every event round-trips, bad rows are CorruptEvent."""

from __future__ import annotations

import hashlib
import json
import typing
import zlib
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from aalis_agent.events import codec
from aalis_agent.events.errors import CorruptEvent
from aalis_agent.events.schema import (
    ChatMessage,
    Event,
    Input,
    InputQueued,
    InputReceived,
    MessageMeta,
    MessageSaved,
    Sender,
    SessionEvent,
    SettingsChanged,
    TurnOpened,
)
from hypothesis import given, settings
from hypothesis import strategies as st

EVENT_TYPES: tuple[type[Event], ...] = typing.get_args(SessionEvent)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "你好，世界", "对话", "こんにちは", "😀🚀", "a\u0000b", "\u200b"]),
)
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
SETTING_VALUES = st.one_of(st.none(), INT64, TEXT, st.booleans(), st.lists(TEXT, max_size=4))


def _strategy(t: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    """A strategy for one msgspec type, walking ``msgspec.inspect`` type info.

    Hand-written rather than ``st.from_type``: that fills only required fields of a
    Struct and cannot draw the ``Any`` fields as JSON-compatible values.
    """
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        return _struct_strategy(t)
    if isinstance(t, mi.StrType):
        return TEXT
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        return INT64
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(_strategy(u) for u in t.types))
    if isinstance(t, mi.VarTupleType):
        return st.lists(_strategy(t.item_type), max_size=3).map(tuple)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(_strategy(u) for u in t.item_types))
    if isinstance(t, mi.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=3)
    if isinstance(t, mi.AnyType):
        return JSON_VALUES
    raise TypeError(f"no strategy for {t!r}")  # a new field type: extend this walker


def _struct_strategy(t: msgspec.inspect.StructType) -> st.SearchStrategy[Any]:
    kwargs: dict[str, st.SearchStrategy[Any]] = {}
    for field in t.fields:
        if t.cls is SettingsChanged and field.name == "value":
            values = SETTING_VALUES
        else:
            values = _strategy(field.type)
        if field.required:
            kwargs[field.name] = values
        elif field.default_factory is not msgspec.NODEFAULT:
            kwargs[field.name] = st.builds(field.default_factory) | values
        else:
            kwargs[field.name] = st.just(field.default) | values
    return st.builds(t.cls, **kwargs)


EVENT_STRATEGIES: dict[type[Event], st.SearchStrategy[Any]] = {
    cls: _strategy(msgspec.inspect.type_info(cls)) for cls in EVENT_TYPES
}
ANY_EVENT = st.one_of(*EVENT_STRATEGIES.values())


# --- the vocabulary itself -----------------------------------------------------------


def test_session_event_union_lists_every_event_subclass() -> None:
    def subclasses(cls: type) -> set[type]:
        out: set[type] = set()
        for sub in cls.__subclasses__():
            out.add(sub)
            out |= subclasses(sub)
        return out

    assert set(EVENT_TYPES) == subclasses(Event)


def test_tags_are_unique_and_named_by_codec() -> None:
    tags = [cls.__struct_config__.tag for cls in EVENT_TYPES]
    assert all(isinstance(tag, str) and tag for tag in tags)
    assert len(set(tags)) == len(tags)


# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=40)
@given(data=st.data())
def test_every_event_type_round_trips(cls: type[Event], data: st.DataObject) -> None:
    event = data.draw(EVENT_STRATEGIES[cls])
    assert type(event) is cls

    packed = codec.encode(event)
    back = codec.decode(packed, session_id=event.session_id, seq=event.seq)
    assert type(back) is cls
    assert back == event
    assert codec.encode(back) == packed  # encoding is deterministic

    as_json = codec.encode_json(event)
    back_json = codec.decode_json(as_json)
    assert type(back_json) is cls
    assert back_json == event
    assert codec.decode_json(as_json.decode("utf-8")) == event  # str input too

    wire = json.loads(as_json)
    assert wire["type"] == codec.event_tag(event) == cls.__struct_config__.tag
    assert next(iter(wire)) == "type"  # ``type`` first, as the codec promises
    assert json.loads(msgspec.json.encode(codec.to_builtins(event))) == wire


@settings(max_examples=100)
@given(event=ANY_EVENT)
def test_union_decoder_picks_the_right_type(event: Event) -> None:
    assert type(codec.decode(codec.encode(event))) is type(event)
    assert type(codec.decode_json(codec.encode_json(event))) is type(event)


def test_defaults_are_omitted_and_v_defaults_to_one() -> None:
    event = InputQueued(session_id="s", seq=1, at=5, input_id="in-1")
    wire = json.loads(codec.encode_json(event))
    assert wire == {
        "type": "input_queued",
        "session_id": "s",
        "seq": 1,
        "at": 5,
        "input_id": "in-1",
    }
    assert codec.decode_json(json.dumps(wire)).v == 1
    assert codec.decode_json(json.dumps({**wire, "v": 2})).v == 2


@given(seq=st.integers(min_value=1, max_value=10**6), n=st.integers(min_value=1, max_value=10))
def test_restamp_changes_only_seq_and_session(seq: int, n: int) -> None:
    event = InputQueued(session_id="s", seq=n, at=7, input_id="in")
    moved = codec.restamp(event, seq=seq)
    assert moved == InputQueued(session_id="s", seq=seq, at=7, input_id="in")
    other = codec.restamp(event, seq=seq, session_id="t")
    assert other == InputQueued(session_id="t", seq=seq, at=7, input_id="in")
    assert event.seq == n  # the original is untouched


# --- bad rows ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\xc1", b"\x00\x01\x02garbage", b"not msgpack at all", b"\x81\xa4type"],
    ids=["empty", "bad-opcode", "binary", "ascii", "truncated-map"],
)
def test_decode_garbage_raises_corrupt_event_naming_session_and_seq(garbage: bytes) -> None:
    with pytest.raises(CorruptEvent) as info:
        codec.decode(garbage, session_id="sess-7", seq=42)
    assert info.value.session_id == "sess-7"
    assert info.value.seq == 42
    assert "sess-7" in str(info.value) and "42" in str(info.value)
    assert info.value.reason


@pytest.mark.parametrize(
    "data", ["text, as another tool might store it", 12345, None], ids=["str", "int", "none"]
)
def test_decode_of_non_bytes_raises_corrupt_event(data: Any) -> None:
    """A row whose ``data`` is not a blob (TEXT, INTEGER, NULL in SQL) is corrupt too."""
    with pytest.raises(CorruptEvent) as info:
        codec.decode(data, session_id="s", seq=8)
    assert (info.value.session_id, info.value.seq) == ("s", 8)


@pytest.mark.parametrize("garbage", ["", "{", "[1, 2]", "null", '{"type": 3}', "\xff"])
def test_decode_json_garbage_raises_corrupt_event(garbage: str) -> None:
    with pytest.raises(CorruptEvent) as info:
        codec.decode_json(garbage, session_id="会话", seq=3)
    assert (info.value.session_id, info.value.seq) == ("会话", 3)
    assert "会话" in str(info.value)


@settings(max_examples=200)
@given(garbage=st.binary(max_size=64), seq=st.integers(min_value=0, max_value=10**9))
def test_decode_of_random_bytes_is_an_event_or_corrupt_event(garbage: bytes, seq: int) -> None:
    try:
        event = codec.decode(garbage, session_id="fuzz", seq=seq)
    except CorruptEvent as exc:
        assert (exc.session_id, exc.seq) == ("fuzz", seq)
    else:
        assert isinstance(event, EVENT_TYPES)


@settings(max_examples=200)
@given(garbage=st.text(max_size=64) | st.binary(max_size=64))
def test_decode_json_of_random_input_is_an_event_or_corrupt_event(garbage: str | bytes) -> None:
    try:
        event = codec.decode_json(garbage, session_id="fuzz", seq=9)
    except CorruptEvent as exc:
        assert (exc.session_id, exc.seq) == ("fuzz", 9)
    else:
        assert isinstance(event, EVENT_TYPES)


def test_unknown_tag_raises_corrupt_event() -> None:
    wire = {"type": "no_such_event", "session_id": "s", "seq": 1, "at": 0}
    with pytest.raises(CorruptEvent) as info:
        codec.decode(msgspec.msgpack.encode(wire), session_id="s", seq=1)
    assert (info.value.session_id, info.value.seq) == ("s", 1)
    assert "no_such_event" in info.value.reason
    with pytest.raises(CorruptEvent):
        codec.decode_json(json.dumps(wire), session_id="s", seq=1)


@pytest.mark.parametrize(
    "wire",
    [
        {"session_id": "s", "seq": 1, "at": 0, "input_id": "x"},  # no tag at all
        {"type": "input_queued", "session_id": "s", "seq": 1, "at": 0},  # required field missing
        {"type": "input_queued", "session_id": "s", "seq": "1", "at": 0, "input_id": "x"},
        {
            "type": "input_released",
            "session_id": "s",
            "seq": 1,
            "at": 0,
            "input_id": "x",
            "reason": "not-a-reason",
        },
    ],
    ids=["untagged", "missing-field", "wrong-type", "bad-literal"],
)
def test_invalid_shapes_raise_corrupt_event(wire: dict[str, Any]) -> None:
    with pytest.raises(CorruptEvent):
        codec.decode(msgspec.msgpack.encode(wire), session_id="s", seq=1)
    with pytest.raises(CorruptEvent):
        codec.decode_json(json.dumps(wire), session_id="s", seq=1)


# --- schema evolution ----------------------------------------------------------------


@settings(max_examples=60)
@given(event=ANY_EVENT, extra=JSON_VALUES)
def test_unknown_top_level_field_is_tolerated(event: Event, extra: Any) -> None:
    wire = codec.to_builtins(event)
    wire["field_from_the_future"] = extra
    assert codec.decode(msgspec.msgpack.encode(wire)) == event
    assert codec.decode_json(msgspec.json.encode(wire)) == event


def test_unknown_nested_fields_are_tolerated() -> None:
    received = InputReceived(
        session_id="s",
        seq=1,
        at=1,
        input=Input(id="in-1", content="你好", sender=Sender(user_id="u1", nickname="小明")),
    )
    wire = codec.to_builtins(received)
    wire["input"]["new_input_field"] = {"nested": [1, 2]}
    wire["input"]["sender"]["avatar"] = "https://example.invalid/a.png"
    assert codec.decode(msgspec.msgpack.encode(wire)) == received
    assert codec.decode_json(msgspec.json.encode(wire)) == received

    saved = MessageSaved(
        session_id="s",
        seq=2,
        at=2,
        message=ChatMessage(id="m1", role="user", content="hi", meta=MessageMeta(turn_id="t1")),
    )
    wire = codec.to_builtins(saved)
    wire["message"]["meta"]["brand_new"] = True
    wire["message"]["later"] = None
    assert codec.decode(msgspec.msgpack.encode(wire)) == saved
    assert codec.decode_json(msgspec.json.encode(wire)) == saved


# --- immutability --------------------------------------------------------------------


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=5)
@given(data=st.data())
def test_events_are_frozen(cls: type[Event], data: st.DataObject) -> None:
    event = data.draw(EVENT_STRATEGIES[cls])
    before = codec.encode(event)
    for name in ("session_id", "seq", "at", "v", *cls.__struct_fields__):
        with pytest.raises(AttributeError):
            setattr(event, name, None)
    assert codec.encode(event) == before


def test_nested_values_are_frozen() -> None:
    opened = TurnOpened(session_id="s", seq=1, at=1, turn_id="t", input_ids=("a", "b"))
    with pytest.raises(AttributeError):
        opened.settings.history_limit = 3  # type: ignore[misc]
    sender = Sender(user_id="u")
    with pytest.raises(AttributeError):
        sender.nickname = "x"  # type: ignore[misc]
    assert opened.settings.history_limit == 0 and sender.nickname is None


# --- row format 2: a batch per row, compressed against the rows before it --------------

ROW_SESSION = "qq:group:会话"


def _stamped(events: Sequence[Event], first: int = 1) -> list[SessionEvent]:
    return [
        codec.restamp(e, seq=n, session_id=ROW_SESSION)  # type: ignore[misc]
        for n, e in enumerate(events, first)
    ]


def _pack(batches: Sequence[Sequence[SessionEvent]]) -> list[tuple[int, bytes]]:
    """Each batch as one row, every row continuing the one before (as a writer does)."""
    rows: list[tuple[int, bytes]] = []
    after: codec.RowContext | None = None
    for events in batches:
        parts = [codec.encode_keyless(e) for e in events]
        row, after = codec.pack_row(ROW_SESSION, parts, events[-1].seq, after)
        rows.append((events[-1].seq, row))
    return rows


def _batches(events: list[SessionEvent], sizes: Sequence[int]) -> list[list[SessionEvent]]:
    out, i = [], 0
    for size in sizes:
        if i < len(events):
            out.append(events[i : i + size])
            i += size
    if i < len(events):
        out.append(events[i:])
    return out


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=30)
@given(data=st.data())
def test_every_event_type_round_trips_in_a_format_2_row(
    cls: type[Event], data: st.DataObject
) -> None:
    event = _stamped([data.draw(EVENT_STRATEGIES[cls])], first=7)[0]
    keyless = codec.encode_keyless(event)
    assert codec.decode(keyless) == codec.restamp(event, seq=0, session_id="")
    [(seq, row)] = _pack([[event]])
    assert row[0] == codec.ROW_FORMAT and codec.row_header(row)[:2] == (0, 1)  # type: ignore[index]
    [back] = codec.RowReader(ROW_SESSION).read(seq, row)
    assert type(back) is cls
    assert back == event
    assert codec.encode(back) == codec.encode(event)


@settings(max_examples=60)
@given(
    events=st.lists(ANY_EVENT, min_size=1, max_size=40),
    sizes=st.lists(st.integers(min_value=1, max_value=20), max_size=8),
)
def test_batches_of_any_events_read_back_row_by_row(events: list[Event], sizes: list[int]) -> None:
    stamped = _stamped(events)
    rows = _pack(_batches(stamped, sizes))
    reader = codec.RowReader(ROW_SESSION)
    back = [e for seq, row in rows for e in reader.read(seq, row)]
    assert back == stamped
    assert [codec.row_header(row)[0] for _, row in rows] == list(range(len(rows)))  # type: ignore[index]


def test_a_group_holds_at_most_group_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "GROUP_ROWS", 3)
    events = _stamped([InputQueued(input_id=f"in-{n}") for n in range(8)])
    rows = _pack([[e] for e in events])
    assert [codec.row_header(row)[0] for _, row in rows] == [0, 1, 2, 0, 1, 2, 0, 1]  # type: ignore[index]
    reader = codec.RowReader(ROW_SESSION)
    assert [e for seq, row in rows for e in reader.read(seq, row)] == events
    # A row that starts a group reads on its own; one inside a group needs the rows before.
    assert codec.RowReader(ROW_SESSION).read(*rows[3]) == [events[3]]
    with pytest.raises(CorruptEvent, match="continues the row before seq 5, which was not read"):
        codec.RowReader(ROW_SESSION).read(*rows[4])
    reader = codec.RowReader(ROW_SESSION)
    assert reader.read(*rows[3], events=False) == []
    assert reader.read(*rows[4]) == [events[4]]


def test_rows_compress_against_their_group() -> None:
    """The second turn of the same shape costs a fraction of the first: its tags, field
    names and repeated values point back into the group."""
    text = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
    first = _stamped([MessageSaved(at=1, message=ChatMessage(id="m1", role="user", content=text))])
    second = _stamped(
        [MessageSaved(at=2, message=ChatMessage(id="m2", role="user", content=text))], first=2
    )
    (_, key), (_, chained) = _pack([first, second])
    assert len(chained) < len(key) / 3
    assert len(key) < len(codec.encode(first[0]))


def test_format_1_rows_read_as_before_and_break_a_group() -> None:
    old = _stamped([InputQueued(input_id="a")])[0]
    new = _stamped([InputQueued(input_id="b"), InputQueued(input_id="c")], first=2)
    rows = _pack([[new[0]], [new[1]]])
    reader = codec.RowReader(ROW_SESSION)
    assert reader.read(1, codec.encode(old)) == [old]
    assert reader.read(*rows[0]) == [new[0]]
    assert reader.read(*rows[1]) == [new[1]]
    reader.read(1, codec.encode(old))  # a format-1 row between: the group is not continued
    with pytest.raises(CorruptEvent, match="which was not read"):
        reader.read(*rows[1])


def _corrupted(row: bytes, how: str) -> bytes:
    _, count, offset = codec.row_header(row)  # type: ignore[misc]
    if how == "cut":
        return row[:-2]
    if how == "empty-stream":
        return row[:offset]
    if how == "flipped":
        middle = offset + (len(row) - offset) // 2
        return row[:middle] + bytes([row[middle] ^ 0xFF]) + row[middle + 1 :]
    if how == "trailing":
        return row + b"\x00garbage"
    if how == "count":
        return row[:2] + bytes([count + 1]) + row[offset:]
    if how == "no-events":
        return row[:2] + b"\x00" + row[offset:]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["cut", "empty-stream", "flipped", "trailing", "count"])
def test_a_corrupt_format_2_row_is_a_corrupt_event_naming_its_first_seq(how: str) -> None:
    events = _stamped([InputQueued(input_id=f"in-{n}", at=n) for n in range(6)])
    rows = _pack([events[:2], events[2:5], events[5:]])
    bad = _corrupted(rows[1][1], how)
    reader = codec.RowReader(ROW_SESSION)
    assert reader.read(*rows[0]) == events[:2]
    with pytest.raises(CorruptEvent) as info:
        reader.read(rows[1][0], bad)
    first = 2 if how == "count" else 3  # the row's first seq, as its header tells it
    assert (info.value.session_id, info.value.seq) == (ROW_SESSION, first)
    assert info.value.reason.startswith(f"a row of seqs {first}-5: ")
    assert f"session {ROW_SESSION!r} seq {first}: cannot decode event" in str(info.value)
    # The row after it continues its group: it cannot be read either, and says why.
    with pytest.raises(CorruptEvent) as after:
        reader.read(*rows[2])
    assert after.value.seq == 6 and "which was not read" in after.value.reason


def test_a_row_of_no_events_is_corrupt() -> None:
    [(seq, row)] = _pack([_stamped([InputQueued(input_id="a")])])
    with pytest.raises(CorruptEvent, match="holds no events"):
        codec.RowReader(ROW_SESSION).read(seq, _corrupted(row, "no-events"))


def test_a_row_whose_header_claims_more_events_than_its_seq_is_named_by_its_seq() -> None:
    """A header damaged into a count past the row's own seq would name seq 0 or less."""
    [(seq, row)] = _pack([_stamped([InputQueued(input_id="a")], first=3)])
    bad = row[:2] + bytes([0x7F]) + row[3:]  # 127 events, ending at seq 3
    with pytest.raises(CorruptEvent) as info:
        codec.RowReader(ROW_SESSION).read(seq, bad)
    assert info.value.seq == 3
    assert info.value.reason == "a row of seq 3: it says it holds 127 events, ending at seq 3"


def test_a_row_whose_events_do_not_validate_keeps_its_group_readable() -> None:
    """The stream inflates but an event in it is not one (a required field missing): the
    row is corrupt, and the rows after it in its group still read."""
    good = _stamped([InputQueued(input_id="a"), InputQueued(input_id="b")])
    parts = [codec.encode_keyless(good[0]), msgspec.msgpack.encode({"type": "input_queued"})]
    bad, after = codec.pack_row(ROW_SESSION, parts, 2, None)
    nxt = _stamped([InputQueued(input_id="c")], first=3)
    row3, _ = codec.pack_row(ROW_SESSION, [codec.encode_keyless(nxt[0])], 3, after)
    reader = codec.RowReader(ROW_SESSION)
    with pytest.raises(CorruptEvent) as info:
        reader.read(2, bad)
    assert info.value.seq == 1 and "input_id" in info.value.reason
    assert reader.read(3, row3) == nxt


@settings(max_examples=200)
@given(garbage=st.binary(max_size=64), depth=st.integers(0, 3), seq=st.integers(1, 10**6))
def test_random_format_2_rows_are_events_or_corrupt_events(
    garbage: bytes, depth: int, seq: int
) -> None:
    row = bytes([codec.ROW_FORMAT, depth]) + garbage
    try:
        events = codec.RowReader("fuzz").read(seq, row)
    except CorruptEvent as exc:
        assert exc.session_id == "fuzz"
    else:
        assert all(isinstance(e, EVENT_TYPES) for e in events)


def test_row_header_tells_format_2_rows_apart() -> None:
    assert codec.row_header(codec.encode(InputQueued(input_id="a"))) is None  # format 1
    assert codec.row_header(b"") is None
    assert codec.row_header(b"\x02\x00") is None
    assert codec.row_header("\x02\x00\x01text") is None  # not bytes at all
    assert codec.row_header(b"\x02\x05\x81\x01stream") == (5, 129, 4)
    assert codec.row_header(b"\x02\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff") is None


def test_the_row_dictionary_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    from aalis_agent.events import _dictionary

    data = _dictionary.dictionary()
    assert hashlib.sha256(data).hexdigest() == _dictionary.SHA256
    assert data == codec._STATIC
    events = list(_dictionary.EVENTS)
    events[-1] = {**events[-1], "at": 0}
    monkeypatch.setattr(_dictionary, "EVENTS", tuple(events))
    with pytest.raises(RuntimeError, match="would not read back"):
        _dictionary.dictionary()


@pytest.mark.parametrize("strategy", [zlib.Z_DEFAULT_STRATEGY, zlib.Z_FIXED, zlib.Z_FILTERED])
def test_how_a_row_was_compressed_is_not_the_format(
    strategy: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader inflates rows packed with any strategy or hash size (the golden file of
    store format 3 was written with zlib's defaults)."""
    monkeypatch.setattr(codec, "_STRATEGY", strategy)
    monkeypatch.setattr(codec, "_MEM_LEVEL", 8 if strategy == zlib.Z_DEFAULT_STRATEGY else 1)
    events = _stamped([InputQueued(input_id=f"in-{n}", at=n) for n in range(5)])
    rows = _pack([events[:3], events[3:]])
    reader = codec.RowReader(ROW_SESSION)
    assert [e for seq, row in rows for e in reader.read(seq, row)] == events


@pytest.mark.parametrize("level", [1, 6, 9])
def test_rows_read_back_whatever_level_packed_them(
    level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compression level is not the format either: rows packed at level 9 (as stores
    wrote them before level 6) and at any other level read back alike."""
    monkeypatch.setattr(codec, "_LEVEL", level)
    events = _stamped([InputQueued(input_id=f"in-{n}", at=n) for n in range(5)])
    rows = _pack([events[:2], events[2:4], events[4:]])
    reader = codec.RowReader(ROW_SESSION)
    assert [e for seq, row in rows for e in reader.read(seq, row)] == events


def test_read_all_names_a_continued_row_whose_header_claims_2_to_the_64_events(
    tmp_path: Any,
) -> None:
    """``read_all`` looks up the rows before a continued row in its group by its header's
    count: a count past 64 bits used to reach SQLite and raise a raw OverflowError."""
    import sqlite3

    from aalis_agent.events import SqliteEventStore

    path = tmp_path / "log.db"
    with SqliteEventStore(path) as store:
        for seq in (1, 2):
            event = InputQueued(session_id="a", seq=seq, at=1, input_id=f"i{seq}")
            store.append("a", [event], seq - 1, open_work=True)
    conn = sqlite3.connect(path)
    sid, data = conn.execute("SELECT sid, data FROM log WHERE seq = 2").fetchone()
    assert data[1] == 1  # it continues the group of seq 1
    bad = bytes((data[0], 1)) + codec._varint(2**64) + data[3:]
    conn.execute("UPDATE log SET data = ? WHERE sid = ? AND seq = 2", (bad, sid))
    conn.commit()
    conn.close()
    with SqliteEventStore(path) as store, pytest.raises(CorruptEvent) as info:
        store.read_all()
    assert (info.value.session_id, info.value.seq) == ("a", 2)


@pytest.mark.parametrize(("sync", "pragma"), [("normal", 1), ("full", 2)])
def test_the_sqlite_store_syncs_as_asked(tmp_path: Any, sync: str, pragma: int) -> None:
    from aalis_agent.events import SqliteEventStore

    with SqliteEventStore(tmp_path / "log.db", sync=sync) as store:
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == pragma
        store.append("a", [InputQueued(session_id="a", seq=1, at=1, input_id="i")], 0)
        assert len(store.read("a")) == 1


def test_an_unknown_sync_is_refused_by_name(tmp_path: Any) -> None:
    from aalis_agent.events import SqliteEventStore, StoreError

    with pytest.raises(StoreError, match='sync must be "normal" or "full", not \'off\''):
        SqliteEventStore(tmp_path / "log.db", sync="off")
    assert not (tmp_path / "log.db.lock").exists()


def test_session_names_edited_by_hand_into_blobs_still_read(tmp_path: Any) -> None:
    """A name stored as a blob of valid UTF-8 is the same session (it read as empty, and
    the next append made a second one); a name whose bytes are not UTF-8 has its rows
    reported as corrupt, each named, while the other sessions read (it failed the read
    with a raw UnicodeEncodeError)."""
    import sqlite3

    from aalis_agent.events import SqliteEventStore

    path = tmp_path / "log.db"
    with SqliteEventStore(path) as store:
        for name in ("a", "b"):
            store.append(name, [InputQueued(session_id=name, seq=1, at=1, input_id="i")], 0)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE sessions SET name = CAST('b' AS BLOB) WHERE name = 'b'")
    conn.execute("UPDATE sessions SET name = x'ff00fe' WHERE name = 'a'")
    conn.commit()
    conn.close()
    with SqliteEventStore(path) as store:
        assert [e.input_id for e in store.read("b")] == ["i"]
        store.append("b", [InputQueued(session_id="b", seq=2, at=1, input_id="j")], 1)
        assert len(store.read("b")) == 2
        assert sorted(store.sessions(), key=len)[0] == "b"
        [bad] = [s for s in store.sessions() if s != "b"]
        open_ = set(store.open_sessions())
        assert store.session_page(0, 10) == (
            2,
            [(n, store.last_seq(n), n in open_) for n in store.sessions()],
        )
        seen: list[CorruptEvent] = []
        assert store.read(bad, on_corrupt=seen.append) == []
        assert [(c.session_id, c.seq) for c in seen] == [(bad, 1)]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM sessions").fetchone()[0] == 2  # no second "b"
    conn.close()


def test_a_name_held_as_text_and_as_a_blob_reads_the_first_numbered(tmp_path: Any) -> None:
    """Both forms of one name in the sessions table (a hand edit): the session is the one
    numbered first, whichever form it has (the lookup reads both from the name index)."""
    import sqlite3

    from aalis_agent.events import SqliteEventStore

    path = tmp_path / "log.db"
    with SqliteEventStore(path) as store:
        for name in ("x", "y"):
            store.append(name, [InputQueued(session_id=name, seq=1, at=1, input_id=name)], 0)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE sessions SET name = CAST('y' AS BLOB) WHERE name = 'x'")
    conn.commit()
    conn.close()
    with SqliteEventStore(path) as store:  # "y" as a blob is number 1, as text number 2
        assert [e.input_id for e in store.read("y")] == ["x"]
    conn = sqlite3.connect(path)
    conn.execute("UPDATE sessions SET name = 'x' WHERE id = 1")
    conn.execute("INSERT INTO sessions (id, name) VALUES (0, CAST('y' AS BLOB))")
    conn.execute("UPDATE log SET sid = 0 WHERE sid = 1")
    conn.commit()
    conn.close()
    with SqliteEventStore(path) as store:  # now the blob is number 0: its rows are read
        assert [e.input_id for e in store.read("y")] == ["x"]
        assert store.read("x") == []


def test_rows_at_level_6_go_on_from_rows_at_level_9(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's rows are compressed against the group's plaintext, which the level does
    not change: rows packed at level 6 continue a group whose first rows were packed at
    level 9 (one writer's group spanning the change), and read back with them. A
    database written at level 9 and reopened: the session's next rows (a reopened
    SQLite store starts a new group) read back with the old ones, there and in the next
    process."""
    from aalis_agent.events import SqliteEventStore

    events = _stamped([InputQueued(input_id=f"in-{n}", at=n) for n in range(8)])
    rows: list[tuple[int, bytes]] = []
    after: codec.RowContext | None = None
    for level, batch in ((9, events[:2]), (9, events[2:4]), (6, events[4:6]), (6, events[6:])):
        monkeypatch.setattr(codec, "_LEVEL", level)
        parts = [codec.encode_keyless(e) for e in batch]
        row, after = codec.pack_row(ROW_SESSION, parts, batch[-1].seq, after)
        rows.append((batch[-1].seq, row))
    assert [codec.row_header(row)[0] for _, row in rows] == [0, 1, 2, 3]  # type: ignore[index]
    reader = codec.RowReader(ROW_SESSION)
    assert [e for seq, row in rows for e in reader.read(seq, row)] == events

    monkeypatch.setattr(codec, "_LEVEL", 9)
    with SqliteEventStore(tmp_path / "log.db") as store:
        store.append(ROW_SESSION, events[:2], 0)
        store.append(ROW_SESSION, events[2:4], 2)
    monkeypatch.setattr(codec, "_LEVEL", 6)
    with SqliteEventStore(tmp_path / "log.db") as store:
        store.append(ROW_SESSION, events[4:6], 4)
        store.append(ROW_SESSION, events[6:], 6)
        assert store.read(ROW_SESSION) == events
    with SqliteEventStore(tmp_path / "log.db") as store:
        assert store.read(ROW_SESSION) == events
