"""Property tests of ``events.codec``: every event round-trips, bad rows are CorruptEvent."""

from __future__ import annotations

import json
import typing
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
