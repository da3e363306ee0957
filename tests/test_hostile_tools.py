"""Tools, and their middleware, as a careless author writes them: whatever they raise or
leave behind, the call ends with a result or an error the model reads, its start and its
end are both in the log, and the session takes its next input.

- Tool metadata whose keys are not text (``{1: "x"}``) passed the JSON check (msgspec
  writes number keys as text) but could not be read back as the event's
  ``dict[str, Any]``: the write was refused and the session stopped (``SessionFailed``).
- An ``agent:tool:after`` middleware that set ``metadata`` to something other than a dict
  failed the turn with a bare ``ValueError`` or ``TypeError`` naming nothing.
- A tool raising a ``BaseException`` that is not an interrupt or an exit
  (``asyncio.CancelledError`` from a synchronous tool running a loop of its own,
  ``GeneratorExit``, a library's own) failed the turn with no reason and no notice, its
  ``ToolStarted`` never finished and the model never told.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import ToolFinished, ToolStarted, TurnRecorded

from aalis_agent import (
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Services,
    SqliteEventStore,
    Tool,
    ToolCall,
    ToolRegistry,
    tool,
)


def _runtime(tmp_path: Path, tools: list[Tool]) -> tuple[Runtime, SqliteEventStore]:
    store = SqliteEventStore(tmp_path / "log.db")
    model = ScriptedModel(
        [
            ScriptedReply(tool_calls=(ToolCall(id="c1", name="t", arguments="{}"),)),
            ScriptedReply(text="好的"),
            ScriptedReply(text="再来"),
        ]
    )
    services = Services(llm=model, tools=ToolRegistry(tools))
    return Runtime(store, services, janitor=False), store


def _check_log(store: SqliteEventStore) -> ToolFinished:
    events = store.read("s")
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [e.call_id for e in started] == [e.call_id for e in finished] == ["c1"]
    return finished[0]


@pytest.mark.parametrize("metadata", [{1: "x"}, {1.5: "x"}, {b"k": "x"}, {None: "x"}])
def test_tool_metadata_with_keys_that_are_not_text_is_dropped_and_the_session_goes_on(
    tmp_path: Path, metadata: dict[Any, Any]
) -> None:
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: "ok")])

    def annotate(ctx: Any, next_: Any) -> Any:
        ctx.metadata = metadata
        return next_()

    runtime.hooks.use("agent:tool:after", annotate)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        finished = _check_log(store)
        assert (finished.result, finished.metadata) == ("ok", {})
        assert runtime.run("s", Input(id="", content="还在吗")).reply == "再来"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


@pytest.mark.parametrize("metadata", [None, "text", [("a", 1), ("b",)], 5])
def test_tool_metadata_that_is_not_a_dict_is_dropped_and_the_turn_goes_on(
    tmp_path: Path, metadata: Any
) -> None:
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: "ok")])

    def annotate(ctx: Any, next_: Any) -> Any:
        ctx.metadata = metadata
        return next_()

    runtime.hooks.use("agent:tool:after", annotate)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        finished = _check_log(store)
        assert (finished.result, finished.metadata) == ("ok", {})
    finally:
        runtime.shutdown(timeout=10)
        store.close()


@pytest.mark.parametrize(("size", "kept"), [(60_000, True), (70_000, False)])
def test_tool_metadata_past_64_kib_is_dropped_and_the_turn_goes_on(
    tmp_path: Path, size: int, kept: bool
) -> None:
    """Metadata is stored with the tool's result and with its message: 20 MB of it was
    stored whole, twice; past 64 KiB as stored (an input's other fields' limit) it is
    dropped and logged, as metadata the log cannot hold is."""
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: "ok")])
    metadata = {"notes": "a" * size}

    def annotate(ctx: Any, next_: Any) -> Any:
        ctx.metadata = metadata
        return next_()

    runtime.hooks.use("agent:tool:after", annotate)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        assert _check_log(store).metadata == (metadata if kept else {})
    finally:
        runtime.shutdown(timeout=10)
        store.close()


class _LibraryExit(BaseException):
    """Stands in for a library's own BaseException (gevent's GreenletExit, say)."""


def _cancelled() -> str:
    raise asyncio.CancelledError("the tool's own loop was cancelled")


def _generator_exit() -> str:
    raise GeneratorExit


def _library_exit() -> str:
    raise _LibraryExit("greenlet killed")


@pytest.mark.parametrize(
    ("raise_", "named"),
    [
        (_cancelled, "CancelledError: the tool's own loop was cancelled"),
        (_generator_exit, "GeneratorExit"),
        (_library_exit, "_LibraryExit: greenlet killed"),
    ],
)
def test_a_tool_raising_a_base_exception_gives_the_model_its_error(
    tmp_path: Path, raise_: Any, named: str
) -> None:
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: raise_())])
    try:
        outcome = runtime.run("s", Input(id="", content="你好"))
        assert (outcome.outcome, outcome.reply) == ("replied", "好的")
        finished = _check_log(store)
        assert finished.result is None and finished.error is not None
        assert finished.error.startswith(named)
        (record,) = [e for e in store.read("s") if isinstance(e, TurnRecorded)]
        assert record.outcome == "replied"
        assert runtime.run("s", Input(id="", content="还在吗")).reply == "再来"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_an_async_tool_raising_a_base_exception_gives_the_model_its_error(
    tmp_path: Path,
) -> None:
    @tool(name="t")
    async def gone() -> str:
        raise _LibraryExit("greenlet killed")

    runtime, store = _runtime(tmp_path, [gone])
    try:
        assert runtime.run("s", Input(id="", content="你好")).reply == "好的"
        assert _check_log(store).error == "_LibraryExit: greenlet killed"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_a_tool_before_middleware_raising_a_base_exception_gives_the_model_its_error(
    tmp_path: Path,
) -> None:
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: "ok")])

    def refuse(ctx: Any, next_: Any) -> Any:
        raise _LibraryExit("middleware gone")

    runtime.hooks.use("agent:tool:before", refuse)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        finished = _check_log(store)
        assert finished.error == "_LibraryExit: middleware gone"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_a_number_too_long_to_read_in_the_arguments_is_named_not_called_invalid_json() -> None:
    """Python reads integers of at most 4300 digits: a longer one in valid JSON was
    answered "not a valid JSON object", which told the model nothing it could fix."""
    from aalis_agent.request.limits import parse_tool_arguments

    args, error = parse_tool_arguments('{"n": ' + "9" * 5000 + "}")
    assert args == {} and error is not None
    assert "超过 4300 位的数字" in error and "不是合法的 JSON" not in error
    for raw in ('{"n": NaN}', '{"n": 1', "[1]"):  # these still are not JSON objects
        assert "不是合法的 JSON 对象" in (parse_tool_arguments(raw)[1] or "")


class _Unprintable(Exception):
    """An exception whose ``str()`` itself fails (a library's, with a broken message)."""

    def __str__(self) -> str:
        raise RuntimeError("its message cannot be built")


def _unprintable() -> str:
    raise _Unprintable


def test_a_tool_raising_an_exception_whose_message_fails_is_named_by_its_type(
    tmp_path: Path,
) -> None:
    """Its error was recorded as the ``RuntimeError`` of building the message, naming
    neither the tool's exception nor what happened."""
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: _unprintable())])
    try:
        assert runtime.run("s", Input(id="", content="你好")).reply == "好的"
        assert _check_log(store).error == "_Unprintable: <exception str() failed>"
    finally:
        runtime.shutdown(timeout=10)
        store.close()


class _Unreadable(dict[str, Any]):
    """A mapping of a tool's own whose items cannot be read (a lazy record whose source
    has gone)."""

    def items(self) -> Any:
        raise LookupError("the record is gone")

    def __iter__(self) -> Any:
        raise LookupError("the record is gone")


class _UnreadableList(list[Any]):
    def __iter__(self) -> Any:
        raise LookupError("the rows are gone")


@pytest.mark.parametrize("value", [_Unreadable(a=1), _UnreadableList([1])], ids=["dict", "list"])
def test_a_tool_result_that_cannot_be_read_is_the_calls_error_and_the_turn_goes_on(
    tmp_path: Path, value: Any
) -> None:
    """Reading the value raised outside the call: the turn failed (``error``) instead of
    the model being told, as for any other exception of the tool's."""
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: value)])
    try:
        outcome = runtime.run("s", Input(id="", content="你好"))
        assert (outcome.outcome, outcome.reply) == ("replied", "好的")
        finished = _check_log(store)
        assert finished.result is None and finished.error is not None
        assert finished.error.startswith("LookupError: the r")
    finally:
        runtime.shutdown(timeout=10)
        store.close()


def test_an_error_set_by_a_tool_after_middleware_that_cannot_be_printed_is_named(
    tmp_path: Path,
) -> None:
    runtime, store = _runtime(tmp_path, [Tool("t", lambda args, ctx: "ok")])

    def spoil(ctx: Any, next_: Any) -> Any:
        ctx.error = _Unprintable()
        return next_()

    runtime.hooks.use("agent:tool:after", spoil)
    try:
        assert runtime.run("s", Input(id="", content="你好")).outcome == "replied"
        assert _check_log(store).error == "_Unprintable: <exception str() failed>"
    finally:
        runtime.shutdown(timeout=10)
        store.close()
