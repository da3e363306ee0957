"""Tools from typed functions: the schema from hints and docstrings, argument checks
reported to the model, the context injected, async tools (and their cancellation), and a
turn through the runtime calling one."""

from __future__ import annotations

import asyncio
import enum
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import msgspec
import pykka
import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    FixedClock,
    InMemoryEventStore,
    Input,
    SequentialIds,
    ToolCall,
    ToolFinished,
)
from aalis_agent.events.errors import Aborted, ToolError
from aalis_agent.services import (
    AbortSignal,
    ScriptedModel,
    ScriptedReply,
    Services,
    ToolCallContext,
    ToolRegistry,
)
from aalis_agent.services.typed_tools import EventLoopThread, TypedTool, tool, tool_from


def context(abort: AbortSignal | None = None) -> ToolCallContext:
    return ToolCallContext(session_id="s", turn_id="t", call_id="c1", abort=abort or AbortSignal())


def params(t: TypedTool) -> dict[str, Any]:
    return dict(t.definition()["function"]["parameters"])


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(msgspec.Struct):
    """A point on the map."""

    x: int
    y: int = 0


class Place(TypedDict):
    city: str
    zip: int


@dataclass
class Box:
    width: float
    height: float


# --- the schema ---------------------------------------------------------------------------


def test_scalars_required_and_defaults() -> None:
    @tool
    def search(query: str, limit: int = 5, exact: bool = False, score: float | None = None) -> str:
        """Search the notes."""
        return query

    assert isinstance(search, TypedTool) and search.name == "search"
    assert search.description == "Search the notes."
    p = params(search)
    assert p["type"] == "object" and p["required"] == ["query"]
    props = p["properties"]
    assert props["query"] == {"type": "string"}
    assert props["limit"] == {"type": "integer", "default": 5}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["score"]["anyOf"] == [{"type": "number"}, {"type": "null"}]
    assert props["score"]["default"] is None
    assert p["additionalProperties"] is False
    assert search("x") == "x"  # the tool still calls like the function


def test_lists_literals_enums_and_nested_types() -> None:
    @tool
    def plan(
        tags: list[str],
        mode: Literal["fast", "slow"],
        color: Color,
        at: Point,
        place: Place,
        box: Box | None = None,
        points: list[Point] = [],  # noqa: B006 - a default the schema shows
    ) -> str:
        return "ok"

    p = params(plan)
    props = p["properties"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"enum": ["fast", "slow"]}
    assert props["color"] == {"$ref": "#/$defs/Color"}
    assert p["$defs"]["Color"]["enum"] == ["blue", "red"]
    assert props["at"] == {"$ref": "#/$defs/Point"}
    assert p["$defs"]["Point"]["required"] == ["x"]
    assert p["$defs"]["Point"]["description"] == "A point on the map."
    assert p["$defs"]["Place"]["properties"] == {
        "city": {"type": "string"},
        "zip": {"type": "integer"},
    }
    assert props["box"]["anyOf"][0] == {"$ref": "#/$defs/Box"}
    assert props["points"] == {
        "type": "array",
        "items": {"$ref": "#/$defs/Point"},
        "default": [],
    }
    assert sorted(p["required"]) == ["at", "color", "mode", "place", "tags"]
    json.dumps(plan.definition())  # the definition is plain JSON


def test_google_docstring_gives_descriptions() -> None:
    @tool(groups=("notes",))
    def remember(text: str, days: int = 7) -> str:
        """Remember a note.

        The note is kept for a while.

        Args:
            text: What to remember.
            days: How many days
                to keep it.

        Returns:
            A confirmation.
        """
        return "ok"

    assert remember.description == "Remember a note.\n\nThe note is kept for a while."
    props = params(remember)["properties"]
    assert props["text"]["description"] == "What to remember."
    assert props["days"]["description"] == "How many days\nto keep it."
    assert remember.groups == ("notes",)


def test_numpy_docstring_gives_descriptions() -> None:
    def weather(city: str) -> str:
        """Today's weather.

        Parameters
        ----------
        city : str
            The city's name.
        """
        return "sunny"

    t = tool_from(weather, name="get_weather", description="The weather now.")
    assert t.name == "get_weather" and t.description == "The weather now."
    assert params(t)["properties"]["city"]["description"] == "The city's name."


def test_unsupported_parameters_are_refused() -> None:
    def variadic(*names: str) -> str:
        return ""

    with pytest.raises(TypeError, match="keyword parameter"):
        tool_from(variadic)
    with pytest.raises(ValueError, match="tool name"):
        tool_from(lambda: "x", name="has space")


# --- calls ----------------------------------------------------------------------------------


def test_arguments_are_validated_and_named() -> None:
    @tool
    def move(at: Point, steps: int, mode: Literal["walk", "run"] = "walk") -> dict[str, Any]:
        return {"x": at.x, "steps": steps, "mode": mode}

    ctx = context()
    assert json.loads(move.handler({"at": {"x": 1}, "steps": "3"}, ctx)) == {
        "x": 1,
        "steps": 3,
        "mode": "walk",
    }
    cases = [
        ({"at": {"x": 1}, "steps": "many"}, "invalid argument `steps`: Expected `int`"),
        ({"at": {"x": "q"}, "steps": 1}, "invalid argument `at.x`"),
        ({"steps": 1}, "missing required argument `at`"),
        ({"at": {"x": 1}, "steps": 1, "speed": 2}, "unknown argument `speed`"),
        ({"at": {"x": 1}, "steps": 1, "mode": "fly"}, "invalid argument `mode`"),
    ]
    for args, problem in cases:
        with pytest.raises(ToolError, match=problem):
            move.handler(args, ctx)


def test_context_is_injected_and_left_out_of_the_schema() -> None:
    seen: list[ToolCallContext] = []

    @tool
    def who(ctx: ToolCallContext, loud: bool = False) -> str:
        seen.append(ctx)
        return ctx.session_id.upper() if loud else ctx.session_id

    assert "ctx" not in params(who)["properties"]
    ctx = context()
    assert who.handler({"loud": True}, ctx) == "S"
    assert seen == [ctx]


def test_results_str_as_is_others_as_json() -> None:
    ctx = context()
    assert tool_from(lambda: "plain", name="a").handler({}, ctx) == "plain"
    assert tool_from(lambda: {"k": [1, 2]}, name="b").handler({}, ctx) == '{"k":[1,2]}'
    assert tool_from(lambda: Point(1, 2), name="c").handler({}, ctx) == '{"x":1,"y":2}'
    assert tool_from(lambda: None, name="d").handler({}, ctx) == "null"
    with pytest.raises(ToolError, match="not JSON"):
        tool_from(lambda: object(), name="e").handler({}, ctx)


def test_async_tool_runs_on_a_loop_thread() -> None:
    threads: list[str] = []

    @tool
    async def double(n: int, ctx: ToolCallContext) -> int:
        await asyncio.sleep(0.01)
        threads.append(threading.current_thread().name)
        return n * 2

    assert double.handler({"n": 21}, context()) == "42"
    assert threads and threads[0] != threading.current_thread().name


def test_async_tool_on_a_given_loop() -> None:
    loop_thread = EventLoopThread("test-loop")
    try:

        async def where() -> str:
            return threading.current_thread().name

        assert tool_from(where, loop=loop_thread).handler({}, context()) == "test-loop"
        assert tool_from(where, loop=loop_thread.loop).handler({}, context()) == "test-loop"
    finally:
        loop_thread.close()


def test_async_tool_is_cancelled_on_abort() -> None:
    started = threading.Event()
    cancelled = threading.Event()

    @tool
    async def wait_long() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    abort = AbortSignal()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            wait_long.handler({}, context(abort))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(5)
    abort.abort("stop", by="tester")
    worker.join(5)
    assert not worker.is_alive()
    assert isinstance(outcome[0], Aborted)
    assert cancelled.wait(5)
    # Already stopped: the coroutine does not start at all.
    started.clear()
    with pytest.raises(Aborted):
        wait_long.handler({}, context(abort))
    assert not started.is_set()


def test_async_tool_timeout() -> None:
    @tool(timeout=0.05)
    async def stuck() -> str:
        await asyncio.sleep(60)
        return "never"

    with pytest.raises(ToolError, match="timed out"):
        stuck.handler({}, context())


# --- a turn through the runtime ----------------------------------------------------------------


@pytest.fixture
def runtimes() -> Iterator[list[Runtime]]:
    made: list[Runtime] = []
    yield made
    for rt in made:
        rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def run_turn(
    runtimes: list[Runtime], registry: ToolRegistry, calls: list[ToolCall]
) -> tuple[InMemoryEventStore, ScriptedModel]:
    model = ScriptedModel([ScriptedReply(tool_calls=tuple(calls)), ScriptedReply(text="好")])
    store = InMemoryEventStore()
    runtime = Runtime(
        store,
        Services(llm=model, tools=registry),
        FixedClock(step_ms=1000),
        SequentialIds(),
        janitor=False,
    )
    runtimes.append(runtime)
    handle = runtime.submit("qq:group:1", Input(id="", content="算一下", platform="qq"))
    handle.result(10)
    runtime.wait_idle(10)
    return store, model


def test_a_turn_calls_typed_tools(runtimes: list[Runtime]) -> None:
    @tool
    def add(a: int, b: int, ctx: ToolCallContext) -> dict[str, Any]:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return {"sum": a + b, "session": ctx.session_id}

    @tool
    async def shout(text: str) -> str:
        await asyncio.sleep(0)
        return text.upper()

    calls = [
        ToolCall(id="c1", name="add", arguments='{"a": 2, "b": 3}'),
        ToolCall(id="c2", name="add", arguments='{"a": "two", "b": 3}'),
        ToolCall(id="c3", name="shout", arguments='{"text": "hi"}'),
    ]
    store, model = run_turn(runtimes, ToolRegistry([add, shout]), calls)
    sent = {t["function"]["name"]: t for t in model.requests[0].tools}
    assert sent["add"]["function"]["parameters"]["required"] == ["a", "b"]
    assert sent["add"]["function"]["description"] == "Add two integers."
    finished = {e.call_id: e for e in store.read("qq:group:1") if isinstance(e, ToolFinished)}
    assert finished["c1"].error is None
    assert json.loads(finished["c1"].result or "") == {"sum": 5, "session": "qq:group:1"}
    assert finished["c2"].result is None
    assert finished["c2"].error == ("ToolError: invalid argument `a`: Expected `int`, got `str`")
    assert finished["c3"].result == "HI"
    results = [m for m in model.requests[1].messages if m.role == "tool"]
    assert [r.content for r in results][1] == finished["c2"].error


def test_a_wait_on_a_loop_that_stopped_gives_up_instead_of_waiting_for_good() -> None:
    import time

    from aalis_agent.services.typed_tools import run_awaitable

    thread = EventLoopThread("test-stopping")
    loop = thread.loop
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    failed: list[BaseException] = []

    def wait() -> None:
        try:
            run_awaitable(forever(), loop)
        except BaseException as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert started.wait(5)
    t0 = time.monotonic()
    loop.call_soon_threadsafe(loop.stop)  # the loop ends with the coroutine unfinished
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - t0 < 5
    assert len(failed) == 1 and "the event loop running this coroutine stopped" in str(failed[0])
    assert thread.running_loop() is None or not thread.running
    thread.close()


def test_a_systemexit_in_a_coroutine_reaches_its_waiter_and_the_loop_goes_on() -> None:
    from aalis_agent.services.typed_tools import run_awaitable

    thread = EventLoopThread("test-exit")

    async def bad() -> None:
        raise SystemExit(3)

    async def good() -> str:
        return "good"

    try:
        with pytest.raises(SystemExit):
            run_awaitable(bad(), thread.loop, timeout=5)
        assert thread.running
        assert run_awaitable(good(), thread.loop, timeout=5) == "good"
    finally:
        thread.close()


def test_a_timeouterror_raised_by_a_coroutine_reaches_its_waiter() -> None:
    """A coroutine's own TimeoutError (an ``asyncio.timeout`` inside an async tool) was
    taken for the waiter's one-second poll running out: the wait spun for good, and the
    turn with it, a stop included."""
    from aalis_agent.services.typed_tools import run_awaitable

    thread = EventLoopThread("test-timeout")

    async def gives_up() -> None:
        await asyncio.wait_for(asyncio.Event().wait(), 0.001)

    raised: list[BaseException] = []
    done = threading.Event()

    def wait() -> None:
        try:
            run_awaitable(gives_up(), thread.loop, abort=AbortSignal())
        except BaseException as exc:
            raised.append(exc)
        done.set()

    try:
        threading.Thread(target=wait, daemon=True).start()
        assert done.wait(10), "the wait never ended"
        assert [type(e) for e in raised] == [TimeoutError]
    finally:
        thread.close()


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"steps": 1, "\\ud800": 1}', "unknown argument `\ufffd`"),
        ('{"steps": 1, "mode": "\\udfff"}', "invalid argument `mode`: Invalid enum value '\ufffd'"),
    ],
)
def test_a_lone_surrogate_escape_in_arguments_is_cleaned_and_the_argument_named(
    raw: str, problem: str
) -> None:
    """``"\\ud800"`` in the model's JSON decodes to text that is not valid Unicode; msgspec
    then failed while wording its error (a bare UnicodeEncodeError reached the model)."""
    from aalis_agent.request.limits import parse_tool_arguments

    @tool
    def walk(steps: int, mode: Literal["walk", "run"] = "walk") -> str:
        return mode

    args, error = parse_tool_arguments(raw)
    assert error is None
    with pytest.raises(ToolError) as info:
        walk.handler(args, context())
    assert str(info.value) == problem
    args, _ = parse_tool_arguments('{"steps": 1, "mode": "walk", "note": "\\ud83d\\ude00"}')
    assert args["note"] == "\U0001f600"  # a pair is one character, kept as it is


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"x": NaN}', "bad"),
        ('{"x": -Infinity}', "bad"),
        ('{"x": "nan"}', "invalid argument `x`: expected a finite number, got nan"),
        ('{"x": 1e999}', "invalid argument `x`: expected a finite number, got inf"),
    ],
)
def test_a_number_argument_is_a_finite_one(raw: str, problem: str) -> None:
    from aalis_agent.request.limits import parse_tool_arguments

    @tool
    def scale(x: float) -> float:
        return x * 2

    args, error = parse_tool_arguments(raw)
    if problem == "bad":  # not JSON: the model is told its arguments do not parse
        assert error is not None and args == {}
        return
    assert error is None
    with pytest.raises(ToolError) as info:
        scale.handler(args, context())
    assert str(info.value) == problem
    assert json.loads(scale.handler({"x": "1.5"}, context())) == 3.0


# --- unknown fields in nested objects ------------------------------------------------------


class Where(msgspec.Struct):
    city: str
    country: str = "FR"


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    """The user's own choice: msgspec refuses its unknown fields itself."""

    name: str
    where: Where | None = None


class Cat(msgspec.Struct, tag=True):
    meows: int


class Dog(msgspec.Struct, tag=True):
    barks: int


class Tree(msgspec.Struct):
    name: str
    children: list[Tree] = []
    parent: Tree | None = None


class Pair(msgspec.Struct, array_like=True):
    left: int
    right: int = 0


@dataclass
class Stop:
    where: Where
    minutes: int = 0


class Leg(TypedDict):
    to: Where
    by: str


def nested_tool() -> tuple[TypedTool, list[dict[str, Any]]]:
    """A tool taking nested objects of every kind, and the arguments it was called with."""
    seen: list[dict[str, Any]] = []

    @tool
    def trip(
        where: Where | None = None,
        stops: list[Where] = [],  # noqa: B006 - never mutated
        by_day: dict[str, Where] = {},  # noqa: B006 - never mutated
        pet: Cat | Dog | None = None,
        cat: Cat | None = None,
        stop: Stop | None = None,
        legs: list[Leg] = [],  # noqa: B006 - never mutated
        tree: Tree | None = None,
        strict: Strict | None = None,
        pair: Pair | None = None,
        route: tuple[str, Where] | None = None,
    ) -> str:
        seen.append(dict(locals()))
        return "ok"

    return trip, seen


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        pytest.param({"where": {"citty": "Paris"}}, "unknown argument `where.citty`", id="struct"),
        pytest.param(
            {"where": {"city": "Paris", "citty": "Paris"}},
            "unknown argument `where.citty`",
            id="struct-beside-a-known-field",
        ),
        pytest.param(
            {"stops": [{"city": "Lyon"}, {"city": "Nice", "contry": "FR"}]},
            "unknown argument `stops[1].contry`",
            id="list-of-structs",
        ),
        pytest.param(
            {"by_day": {"mon": {"city": "Lyon"}, "tue": {"town": "Nice", "city": "Nice"}}},
            "unknown argument `by_day[...].town`",
            id="dict-of-structs",
        ),
        pytest.param(
            {"pet": {"type": "Dog", "barks": 2, "meows": 1}},
            "unknown argument `pet.meows`",
            id="tagged-union",
        ),
        pytest.param(
            {"cat": {"meows": 1, "purrs": 2}},
            "unknown argument `cat.purrs`",
            id="tagged-struct-its-tag-left-out",
        ),
        pytest.param(
            {"stop": {"where": {"city": "Lyon"}, "mins": 5}},
            "unknown argument `stop.mins`",
            id="dataclass",
        ),
        pytest.param(
            {"stop": {"where": {"city": "Lyon", "zip": 69000}}},
            "unknown argument `stop.where.zip`",
            id="struct-in-a-dataclass",
        ),
        pytest.param(
            {"legs": [{"to": {"city": "Lyon"}, "by": "train", "via": "Dijon"}]},
            "unknown argument `legs[0].via`",
            id="typeddict",
        ),
        pytest.param(
            {"legs": [{"to": {"city": "Lyon", "cty": "x"}, "by": "train"}]},
            "unknown argument `legs[0].to.cty`",
            id="struct-in-a-typeddict",
        ),
        pytest.param(
            {"tree": {"name": "a", "children": [{"name": "b", "parent": {"name": "a", "x": 1}}]}},
            "unknown argument `tree.children[0].parent.x`",
            id="recursive-struct",
        ),
        pytest.param(
            {"route": ["Lyon", {"city": "Nice", "citty": "Nice"}]},
            "unknown argument `route[1].citty`",
            id="tuple",
        ),
        pytest.param(
            {"strict": {"name": "n", "where": {"city": "Lyon", "cit": "x"}}},
            "unknown argument `strict.where.cit`",
            id="struct-in-a-forbidding-struct",
        ),
        pytest.param(
            {"pair": [1, 2, 3]},
            "invalid argument `pair`: Expected `array` of at most length 2, got 3",
            id="array-like-struct",
        ),
    ],
)
def test_an_unknown_field_in_a_nested_object_is_refused_with_its_path(
    args: dict[str, Any], problem: str
) -> None:
    """msgspec drops the unknown keys of a nested object unless its class forbids them:
    a misspelt nested field ran the tool with the field's default, the model never told."""
    trip, seen = nested_tool()
    with pytest.raises(ToolError) as info:
        trip.handler(args, context())
    assert str(info.value) == problem
    assert seen == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"stops": {"city": "Lyon"}}, "invalid argument `stops`: Expected `array`, got `object`"),
        ({"by_day": [{"city": "L"}]}, "invalid argument `by_day`: Expected `object`, got `array`"),
        ({"pet": {"type": ["Cat"]}}, "invalid argument `pet.type`: Expected `str`, got `list`"),
        ({"pet": {"type": "Fish"}}, "invalid argument `pet.type`: Invalid value 'Fish'"),
        ({"pet": {"barks": 1, "x": 2}}, "missing required argument `pet.type`"),
        ({"route": ["Lyon"]}, "invalid argument `route`: Expected `array` of length 2, got 1"),
        (
            {"tree": {"children": [{"name": "b"}]}, "where": {"city": 1, "ctry": "FR"}},
            "unknown argument `where.ctry`",
        ),
    ],
)
def test_nested_arguments_of_the_wrong_shape_are_named_as_msgspec_names_them(
    args: dict[str, Any], problem: str
) -> None:
    """Arguments that do not convert are looked into for an unknown field first (a
    misspelt field is often a required one missing as well), then msgspec's error."""
    trip, seen = nested_tool()
    with pytest.raises(ToolError) as info:
        trip.handler(args, context())
    assert str(info.value) == problem
    assert seen == []


def test_the_model_hears_of_its_misspelt_nested_field() -> None:
    from aalis_agent.request.limits import parse_tool_arguments

    @tool
    def weather(where: Where, days: int = 1) -> str:
        return f"{where.city}: sunny"

    args, error = parse_tool_arguments('{"where": {"citty": "Paris"}}')
    assert error is None
    with pytest.raises(ToolError, match=r"^unknown argument `where.citty`$"):
        weather.handler(args, context())


def test_valid_nested_arguments_are_accepted_unchanged() -> None:
    trip, seen = nested_tool()
    args = {
        "where": {"city": "Paris"},
        "stops": [{"city": "Lyon", "country": "FR"}, {"city": "Nice"}],
        "by_day": {"mon": {"city": "Lyon"}},
        "pet": {"type": "Cat", "meows": 3},
        "cat": {"meows": 4},
        "stop": {"where": {"city": "Lyon"}, "minutes": "5"},
        "legs": [{"to": {"city": "Lyon"}, "by": "train"}],
        "tree": {"name": "a", "children": [{"name": "b", "parent": {"name": "a"}}]},
        "strict": {"name": "n", "where": {"city": "Lyon"}},
        "pair": [1, 2],
        "route": ["Lyon", {"city": "Nice"}],
    }
    assert trip.handler(args, context()) == "ok"
    (got,) = seen
    assert got["where"] == Where("Paris")
    assert got["stops"] == [Where("Lyon"), Where("Nice")]
    assert got["by_day"] == {"mon": Where("Lyon")}
    assert got["pet"] == Cat(3)
    assert got["cat"] == Cat(4)
    assert got["stop"] == Stop(Where("Lyon"), 5)
    assert got["legs"] == [{"to": Where("Lyon"), "by": "train"}]
    assert got["tree"] == Tree("a", [Tree("b", parent=Tree("a"))])
    assert got["strict"] == Strict("n", Where("Lyon"))
    assert got["pair"] == Pair(1, 2)
    assert got["route"] == ("Lyon", Where("Nice"))
    # Absent or null nested arguments are not looked into.
    assert trip.handler({"where": None, "pet": None}, context()) == "ok"


def test_a_struct_forbidding_unknown_fields_itself_is_refused_as_before_and_left_as_it_is() -> None:
    trip, _ = nested_tool()
    with pytest.raises(ToolError) as info:
        trip.handler({"strict": {"name": "n", "nmae": "m"}}, context())
    assert str(info.value) == "unknown argument `strict.nmae`"
    # The user's classes keep their own configuration.
    assert Strict.__struct_config__.forbid_unknown_fields is True
    assert Where.__struct_config__.forbid_unknown_fields is False
    assert msgspec.convert({"city": "Lyon", "zip": 1}, Where) == Where("Lyon")


def test_a_deep_recursive_argument_is_walked_without_recursing() -> None:
    @tool
    def grow(tree: Tree) -> int:
        depth, node = 0, tree
        while node.children:
            depth, node = depth + 1, node.children[0]
        return depth

    root: dict[str, Any] = {"name": "0"}
    node = root
    for i in range(1, 400):
        child: dict[str, Any] = {"name": str(i)}
        node["children"] = [child]
        node = child
    assert grow.handler({"tree": root}, context()) == "399"
    node["nmae"] = "x"
    with pytest.raises(ToolError) as info:
        grow.handler({"tree": root}, context())
    message = str(info.value)
    assert message.startswith("unknown argument `tree.children[0].children[0].")
    assert message.endswith(".nmae`") and message.count("children[0]") == 399


def test_the_schema_refuses_unknown_fields_in_nested_objects_too() -> None:
    p = params(nested_tool()[0])
    defs = p["$defs"]
    assert p["additionalProperties"] is False
    for name in ("Where", "Strict", "Cat", "Dog", "Tree", "Stop", "Leg"):
        assert defs[name]["additionalProperties"] is False, name
    assert defs["Pair"]["maxItems"] == 2  # an array-like Struct takes no extra items
    assert defs["Cat"]["properties"]["type"] == {"enum": ["Cat"]}  # the tag is a field


def test_flat_arguments_get_no_nested_check() -> None:
    from aalis_agent.services.typed_tools import _nested_check

    @tool
    def flat(a: int, tags: list[str], scores: dict[str, float] | None = None) -> str:
        return "ok"

    trip, _ = nested_tool()
    assert flat.arguments is not None and _nested_check(flat.arguments) is None
    assert trip.arguments is not None and _nested_check(trip.arguments) is not None


def test_a_tool_name_ending_in_a_line_break_is_refused() -> None:
    """``$`` matches before a final line break: a name "echo\\n" passed the check, and a
    provider refuses every request that offers it."""
    with pytest.raises(ValueError, match=r"tool name 'echo\\n': use 1-64 letters"):
        tool(name="echo\n")(lambda: "x")
    assert tool(name="echo")(lambda: "x").name == "echo"


_RUNAWAY_CHILD = """
import asyncio, sys, time
import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import Input, SqliteEventStore, ToolCall, ToolFinished
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, ToolRegistry
from aalis_agent.services.typed_tools import tool_from

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
db, late = sys.argv[1], sys.argv[2] == "late"

async def stubborn() -> str:
    '''Swallows its cancellation: for good, or (late) once, then ends 3 s later.'''
    try:
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if late:
                    await asyncio.sleep(3)
                    return "late"
    finally:
        print("TOOL ENDED", flush=True)

call = ToolCall(id="c1", name="stubborn", arguments="{}")
model = ScriptedModel([ScriptedReply(tool_calls=(call,)), ScriptedReply(text="done")])
tools = ToolRegistry([tool_from(stubborn, timeout=0.2)])
store = SqliteEventStore(db)
rt = Runtime(store, Services(llm=model, tools=tools), janitor=False)
print("OUTCOME", rt.submit("s", Input(id="", content="hi")).result(20).outcome, flush=True)
print("ERROR", [e.error for e in store.read("s") if isinstance(e, ToolFinished)], flush=True)
time.sleep(2)  # past the grace a cancelled tool has to end
t0 = time.monotonic()
rt.shutdown(timeout=10)
store.close()
print("SHUTDOWN", round(time.monotonic() - t0, 1), flush=True)
"""


@pytest.mark.parametrize("late", [False, True], ids=["never-ends", "ends-late"])
def test_an_async_tool_ignoring_its_cancellation_is_logged_and_ended_at_shutdown(
    tmp_path: Path, late: bool
) -> None:
    """An async tool past its timeout that ignores its cancellation: the turn goes on
    with the timeout as the call's error; the task still running is logged once, by
    name; at shutdown it is cancelled and waited for (a bounded time), one that never
    ends is logged as left and its coroutine closed, and the interpreter exits without
    asyncio's 'Task was destroyed but it is pending!' (it printed that, after a 10 s
    wait)."""
    child = subprocess.run(
        [sys.executable, "-c", _RUNAWAY_CHILD, str(tmp_path / "r.db"), "late" if late else ""],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out, err = child.stdout, child.stderr
    assert child.returncode == 0, err
    assert "OUTCOME replied" in out
    assert "ToolError: tool 'stubborn' timed out after 0.2 s" in out
    still = [line for line in err.splitlines() if "still running after its cancellation" in line]
    assert len(still) == 1 and "stubborn" in still[0], err
    assert "Task was destroyed" not in err and "Task was destroyed" not in out, err
    shutdown_s = float(out.split("SHUTDOWN ", 1)[1].split()[0])
    left = [line for line in err.splitlines() if "left running at shutdown" in line]
    if late:  # cancelled at shutdown, it ended within the wait
        assert out.count("TOOL ENDED") == 1 and left == [], (out, err)
        assert shutdown_s < 4
    else:  # its coroutine closed at shutdown (its finally ran), not at exit
        assert out.count("TOOL ENDED") == 1 and out.index("TOOL ENDED") < out.index("SHUTDOWN")
        assert len(left) == 1 and "stubborn" in left[0], err
        assert shutdown_s < 7  # the loop's wait (5 s), once


def test_a_stopped_async_tool_still_running_is_tracked_until_its_loop_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop (not only a timeout) that the coroutine ignores: the wait ends with
    Aborted, the task is listed by ``runaways()`` and logged once; ``close`` cancels it
    again, and one that ends then is gone from the list."""
    import time

    from aalis_agent.services import typed_tools
    from structlog.testing import capture_logs

    monkeypatch.setattr(typed_tools, "RUNAWAY_GRACE_S", 0.05)
    thread = EventLoopThread("test-runaway")
    cancels: list[int] = []

    async def deaf() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) > 1:  # the loop's close: this one it heeds
                    raise

    abort = AbortSignal()
    try:
        with capture_logs() as logs:
            threading.Timer(0.1, abort.abort, args=("user",)).start()
            with pytest.raises(Aborted):
                typed_tools.run_awaitable(deaf(), thread.loop, abort=abort, name="deaf")
            deadline = time.monotonic() + 10
            while thread.runaways() != ["deaf"]:
                assert time.monotonic() < deadline, thread.runaways()
                time.sleep(0.01)
            time.sleep(0.2)  # no second line for the same task
        still = [e for e in logs if "still running after its cancellation" in e["event"]]
        assert [(e["tool"], e["cancelled"]) for e in still] == [("deaf", "stop: user")]
    finally:
        thread.close(timeout=5)
    assert len(cancels) == 2 and thread.runaways() == []
