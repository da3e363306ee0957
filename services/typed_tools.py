"""Tools from typed functions: ``@tool`` and :func:`tool_from` build a :class:`Tool` whose
JSON schema comes from the function's type hints and docstring.

Why msgspec (not pydantic): it is already the runtime's dependency (the event log's codec),
so typed tools add nothing to install; it builds a JSON schema from the same types it
validates (ints, floats, bools, strings, lists, ``Optional``, ``Literal``, enums, nested
``msgspec.Struct``, ``TypedDict`` and dataclasses), and its validation errors carry the
path of the bad value (``$.items[1].name``), which is what the model needs to fix its call.
Arguments are checked leniently (``strict=False``): ``"3"`` is accepted for an ``int``,
as models often quote numbers.

Why docstring_parser: it reads the parameter descriptions of Google, NumPy, reST and Epydoc
docstrings alike, is small, pure Python and maintained; reading the sections by hand would
cover one style and its corner cases badly.

A call's arguments are validated before the function runs; a bad one raises
:class:`ToolError` naming the argument, which the turn reports to the model as the call's
result (``ToolError: invalid argument `count`: ...``), so the model can call again.
An unknown field is refused at any depth (``unknown argument `where.citty```), in nested
Structs, dataclasses and TypedDicts too, which msgspec itself would silently drop; the
user's classes are left as they are (see "unknown fields in nested objects" below).
A parameter annotated :class:`ToolCallContext` receives the call's context and is left out
of the schema. An ``async def`` function (or one returning an awaitable) runs to completion
on an event loop thread (:class:`EventLoopThread`, a shared one unless a loop is given)
while the tool thread waits; stopping the turn (``ctx.abort``), or the tool's ``timeout``
running out, cancels the task and ends the wait. A task that ignores its cancellation
runs on; it is logged once (:data:`RUNAWAY_GRACE_S` later), listed by
:meth:`EventLoopThread.runaways`, and cancelled again when its loop closes (at the last
runtime's shutdown), which names one that outlasts that too and closes its coroutine.
A ``str`` result is returned as is; any other value is JSON-encoded with msgspec.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar, get_type_hints, overload

import docstring_parser
import msgspec
import msgspec.inspect as mi
import structlog
from aalis_agent.events.errors import Aborted, ToolError
from aalis_agent.services.abort import AbortSignal
from aalis_agent.services.tools import Tool, ToolCallContext
from msgspec import Meta

__all__ = [
    "EventLoopThread",
    "TypedTool",
    "default_loop_thread",
    "release_default_loop_thread",
    "run_awaitable",
    "shutdown_default_loop_thread",
    "tool",
    "tool_from",
    "use_default_loop_thread",
]

T = TypeVar("T")

log = structlog.get_logger("aalis.tools")

RUNAWAY_GRACE_S = 1.0
"""How long a coroutine cancelled by its waiter (its timeout ran out, its turn stopped)
has to end before it is logged as still running (once)."""

# The tasks run_awaitable started, named (the tool's name, else the coroutine's), and
# those still running after their cancellation: their loop's close cancels and waits for
# them again, and names one that never ends instead of leaving it to asyncio's "Task was
# destroyed but it is pending!" at exit.
_names: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()
_runaways: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


# --- running coroutines from a tool thread ------------------------------------------------


class EventLoopThread:
    """An asyncio event loop running on a thread of its own (a daemon), started on first
    use; :meth:`run` runs an awaitable on it from any other thread and waits for it."""

    def __init__(self, name: str = "aalis-async") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if it is not running yet, or if its thread
        ended)."""
        with self._lock:
            if self._loop is None or self._loop.is_closed() or not self._alive():
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name=self.name, daemon=True)
                thread.start()
                started.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._loop is not None and not self._loop.is_closed() and self._alive()

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop if it runs, else None (never starting one, as :attr:`loop` does)."""
        with self._lock:
            loop = self._loop
            return loop if loop is not None and not loop.is_closed() and self._alive() else None

    def run(
        self,
        awaitable: Awaitable[T],
        *,
        abort: AbortSignal | None = None,
        timeout: float | None = None,
    ) -> T:
        """Run ``awaitable`` on this loop and wait for its result (see :func:`run_awaitable`)."""
        return run_awaitable(awaitable, self.loop, abort=abort, timeout=timeout)

    def submit(self, awaitable: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule ``awaitable`` on this loop; its future, to wait for or cancel."""
        return asyncio.run_coroutine_threadsafe(_as_coroutine(awaitable), self.loop)

    def runaways(self) -> list[str]:
        """The names of the coroutines on this loop that a waiter cancelled (a timeout, a
        stop) and that still run :data:`RUNAWAY_GRACE_S` later, ignoring it."""
        loop = self.running_loop()
        return sorted(
            _names.get(t, "?") for t in list(_runaways) if t.get_loop() is loop and not t.done()
        )

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what is still running, wait up to ``timeout`` seconds for it to end
        (once, in all), stop the loop and join its thread. A task still running then (it
        ignores its cancellation) is logged by name and its coroutine closed (its
        ``finally`` blocks run): the loop is closed without it, and without asyncio's
        "Task was destroyed but it is pending!" at exit."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or loop.is_closed():
            return

        outlasted: set[asyncio.Task[Any]] = set()  # by a wait: not waited for again

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            fresh = [t for t in tasks if t not in outlasted]
            if fresh:
                await asyncio.wait(fresh, timeout=timeout)
            await asyncio.sleep(0)  # the others' cancellations thrown in
            outlasted.update(t for t in tasks if not t.done())

        if thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout + 1)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        if not thread.is_alive():
            # Run here now: tasks a loop left when it stopped by itself are cancelled.
            with contextlib.suppress(Exception):
                loop.run_until_complete(cancel_all())
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            for task in asyncio.all_tasks(loop):
                log.warning(
                    "async tool left running at shutdown: it ignores its cancellation",
                    tool=_names.get(task) or getattr(task.get_coro(), "__qualname__", "?"),
                    waited_s=timeout,
                )
                # Said here, by name: not again by asyncio when the task is collected.
                task._log_destroy_pending = False  # type: ignore[attr-defined]
                with contextlib.suppress(Exception):  # its finally runs now, not at exit
                    task.get_coro().close()  # (a coroutine ignoring GeneratorExit: left)
            loop.close()


_default_lock = threading.Lock()
_default: EventLoopThread | None = None


def default_loop_thread() -> EventLoopThread:
    """The shared loop thread typed async tools run on when no loop is given."""
    global _default
    with _default_lock:
        if _default is None:
            _default = EventLoopThread("aalis-async-tools")
        return _default


_default_users = 0


def use_default_loop_thread() -> None:
    """One more user (a runtime) of the shared loop thread, until
    :func:`release_default_loop_thread`."""
    global _default_users
    with _default_lock:
        _default_users += 1


def release_default_loop_thread() -> None:
    """One user fewer; the last one stops the shared loop thread (the async tools still
    running on it are cancelled). Other runtimes' tools are left alone while they run."""
    global _default, _default_users
    with _default_lock:  # decided and taken away at once: a runtime made meanwhile
        _default_users = max(_default_users - 1, 0)  # gets a new loop, not this one
        if _default_users:
            return
        current, _default = _default, None
    if current is not None:
        current.close()


def shutdown_default_loop_thread() -> None:
    """Stop the shared loop thread now, whoever uses it (it starts again on next use)."""
    global _default
    with _default_lock:
        current, _default = _default, None
    if current is not None:
        current.close()


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def run_awaitable(
    awaitable: Awaitable[T],
    loop: asyncio.AbstractEventLoop,
    *,
    abort: AbortSignal | None = None,
    timeout: float | None = None,
    name: str | None = None,
) -> T:
    """Run ``awaitable`` to completion on ``loop`` (running on another thread) and wait.

    When ``abort`` is set the task is cancelled and :class:`Aborted` is raised; after
    ``timeout`` seconds the task is cancelled and :class:`TimeoutError` is raised. The
    wait ends there: a task that ignores its cancellation goes on on its loop, is logged
    once (by ``name``, default the coroutine's) if it still runs
    :data:`RUNAWAY_GRACE_S` later, and is cancelled and waited for again when its
    :class:`EventLoopThread` closes.
    """
    coroutine: Coroutine[Any, Any, T] = (
        awaitable if inspect.iscoroutine(awaitable) else _as_coroutine(awaitable)
    )
    if abort is not None and abort.aborted:
        coroutine.close()
        raise Aborted(abort.reason or "stop")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coroutine.close()
        raise RuntimeError("cannot wait for a coroutine on the loop of this very thread")
    label = name or getattr(coroutine, "__qualname__", None) or type(awaitable).__name__
    started: list[asyncio.Task[Any]] = []
    future = asyncio.run_coroutine_threadsafe(_contained(coroutine, label, started), loop)
    if abort is not None:

        def cancel() -> None:
            if future.cancel():  # cancels the task on the loop (thread-safe)
                _watch(loop, started, label, f"stop: {abort.reason or 'stop'}")

        abort.add_callback(cancel)
    try:
        return _result(future, loop, timeout)
    except _Escaped as escaped:  # raised here, as a function run on this thread raises it
        raise escaped.original from None
    except concurrent.futures.CancelledError:
        if abort is not None and abort.aborted:
            raise Aborted(abort.reason or "stop") from None
        raise
    except TimeoutError:
        if future.cancel():
            _watch(loop, started, label, f"timed out after {timeout} s")
        raise


def _watch(
    loop: asyncio.AbstractEventLoop, started: list[asyncio.Task[Any]], label: str, why: str
) -> None:
    """After a waiter cancelled the task in ``started``: if it still runs
    :data:`RUNAWAY_GRACE_S` later (it ignores the cancellation), log it once and track it
    (see :meth:`EventLoopThread.runaways`). From any thread."""

    def check() -> None:
        task = started[0] if started else None
        if task is None or task.done():
            return
        _runaways.add(task)
        log.warning(
            "async tool still running after its cancellation: it goes on on the tool loop "
            "until it ends or the loop closes",
            tool=label,
            cancelled=why,
            grace_s=RUNAWAY_GRACE_S,
        )

    def later() -> None:
        loop.call_later(RUNAWAY_GRACE_S, check)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs on it
        loop.call_soon_threadsafe(later)


class _Escaped(Exception):
    """A SystemExit or KeyboardInterrupt a coroutine raised, carried to its waiter."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


async def _contained(
    coroutine: Coroutine[Any, Any, T], label: str, started: list[asyncio.Task[Any]]
) -> T:
    """``coroutine``, with a SystemExit or KeyboardInterrupt it raises kept in its task:
    asyncio raises those out of the loop itself, which would end the loop's thread, and
    every coroutine sent to it after (every session's async tools) would wait for good.
    Its task goes in ``started``, named ``label``."""
    task = asyncio.current_task()
    if task is not None:
        started.append(task)
        _names[task] = label
    try:
        return await coroutine
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Escaped(exc) from None


def _result(
    future: concurrent.futures.Future[T], loop: asyncio.AbstractEventLoop, timeout: float | None
) -> T:
    """``future.result(timeout)``, except that a wait with no end gives up once ``loop``
    has stopped (nothing would ever answer it)."""
    if timeout is not None:
        return future.result(timeout)
    while True:
        try:
            return future.result(1.0)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError, not this poll's
                raise
            if not loop.is_running():
                future.cancel()
                raise RuntimeError("the event loop running this coroutine stopped") from None


# --- building a tool from a function -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TypedTool(Tool):
    """A :class:`Tool` built from a typed function; calling it calls the function."""

    fn: Callable[..., Any] | None = field(default=None, compare=False)
    arguments: type[msgspec.Struct] | None = field(default=None, compare=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:  # pragma: no cover - always set by tool_from
            raise TypeError(f"tool {self.name!r} has no function")
        return self.fn(*args, **kwargs)


_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def tool_from(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    groups: Iterable[str] = (),
    loop: asyncio.AbstractEventLoop | EventLoopThread | None = None,
    timeout: float | None = None,
) -> TypedTool:
    """A :class:`Tool` calling ``fn``, its parameters' schema from the type hints.

    ``name`` defaults to the function's name, ``description`` to its docstring (less the
    parameter sections, whose entries describe the parameters). An async ``fn`` runs on
    ``loop`` (an event loop running on another thread, or an :class:`EventLoopThread`;
    default: :func:`default_loop_thread`), for at most ``timeout`` seconds when given.
    """
    tool_name: str = name or str(getattr(fn, "__name__", ""))
    if not _NAME.fullmatch(tool_name):
        raise ValueError(f"tool name {tool_name!r}: use 1-64 letters, digits, '_' or '-'")
    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    described = {p.arg_name: (p.description or "").strip() for p in doc.params}
    hints = get_type_hints(fn, include_extras=True)
    signature = inspect.signature(fn)
    context_param: str | None = None
    fields: list[tuple[str, Any, Any]] = []
    for pname, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(
                f"tool {tool_name!r}: parameter {pname!r} must be a keyword parameter "
                "(no *args, **kwargs or positional-only parameters)"
            )
        hint = hints.get(pname, Any)
        if hint is ToolCallContext:
            context_param = pname
            continue
        meta: dict[str, Any] = {}
        if described.get(pname):
            meta["description"] = described[pname]
        if param.default is not param.empty:
            with contextlib.suppress(Exception):
                meta["extra_json_schema"] = {
                    "default": msgspec.json.decode(msgspec.json.encode(param.default))
                }
        annotated = Annotated[hint, Meta(**meta)] if meta else hint
        # A missing optional argument stays unset, so the function's own default applies.
        default = msgspec.UNSET if param.default is not param.empty else msgspec.NODEFAULT
        fields.append((pname, annotated, default))
    try:
        arguments = msgspec.defstruct(
            f"{tool_name}_arguments",
            [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
            kw_only=True,
            forbid_unknown_fields=True,
        )
        parameters = _schema(arguments)
        nested = _nested_check(arguments)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tool {tool_name!r}: unsupported parameter type: {exc}") from None
    text = description
    if text is None:
        parts = [doc.short_description or "", doc.long_description or ""]
        text = "\n\n".join(p.strip() for p in parts if p and p.strip())

    def handler(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        kwargs = _validate(arguments, args, nested)
        if context_param is not None:
            kwargs[context_param] = ctx
        value = fn(**kwargs)
        if inspect.isawaitable(value):
            value = _await(value, loop, ctx.abort, timeout, tool_name)
        return _encode(value, tool_name)

    return TypedTool(
        name=tool_name,
        handler=handler,
        description=text,
        parameters=parameters,
        groups=tuple(groups),
        fn=fn,
        arguments=arguments,
    )


@overload
def tool(fn: Callable[..., Any], /) -> TypedTool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    groups: Iterable[str] = (),
    loop: asyncio.AbstractEventLoop | EventLoopThread | None = None,
    timeout: float | None = None,
) -> Callable[[Callable[..., Any]], TypedTool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    groups: Iterable[str] = (),
    loop: asyncio.AbstractEventLoop | EventLoopThread | None = None,
    timeout: float | None = None,
) -> TypedTool | Callable[[Callable[..., Any]], TypedTool]:
    """Decorator: ``@tool`` or ``@tool(name=..., groups=(...))`` makes a function a
    :class:`TypedTool` (see :func:`tool_from`); the tool still calls like the function."""
    options = {
        "name": name,
        "description": description,
        "groups": tuple(groups),
        "loop": loop,
        "timeout": timeout,
    }
    if fn is not None:
        return tool_from(fn, **options)  # type: ignore[arg-type]

    def decorate(f: Callable[..., Any]) -> TypedTool:
        return tool_from(f, **options)  # type: ignore[arg-type]

    return decorate


def _schema(arguments: type[msgspec.Struct]) -> dict[str, Any]:
    """The arguments' JSON schema: an object, with ``$defs`` for nested types.

    A nested object takes no other keys than its fields (``additionalProperties: false``),
    nor an array-like struct more items than its fields, as the checks below refuse them."""
    template = "#/$defs/{name}"
    (_,), components = msgspec.json.schema_components([arguments], ref_template=template)
    schema = dict(components.pop(arguments.__name__))
    schema.pop("title", None)
    schema.setdefault("properties", {})
    for component in components.values():
        if component.get("type") == "object" and "properties" in component:
            component.setdefault("additionalProperties", False)
        elif component.get("type") == "array" and "prefixItems" in component:
            component.setdefault("maxItems", len(component["prefixItems"]))
    if components:
        schema["$defs"] = components
    return schema


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>.*)`)?$", re.S)
_FIELD = re.compile(r"^Object (?P<how>contains unknown|missing required) field `(?P<name>.*)`$")


def _validate(
    arguments: type[msgspec.Struct], args: Mapping[str, Any], nested: _Check | None = None
) -> dict[str, Any]:
    """The checked arguments as keyword arguments, or a ToolError naming the bad one;
    ``nested`` (from :func:`_nested_check`) refuses unknown fields in nested objects.

    An unknown nested field is named before any other problem: a misspelt one is most
    often also a required one missing (``{"where": {"citty": ...}}``), and its name tells
    the model what to fix."""
    raw = dict(args)
    try:
        value = msgspec.convert(raw, arguments, strict=False)
    except msgspec.ValidationError as exc:
        unknown = _unknown_nested(nested, raw) if nested is not None else None
        raise ToolError(_explain(unknown or str(exc))) from None
    if nested is not None:
        unknown = _unknown_nested(nested, raw)
        if unknown is not None:
            raise ToolError(_explain(unknown))
    checked = {
        name: getattr(value, name)
        for name in arguments.__struct_fields__
        if getattr(value, name) is not msgspec.UNSET
    }
    for name, given in checked.items():
        # Lax conversion takes "nan" and "inf" for a float, and JSON's 1e999 reads as
        # infinity: a number asked for is a finite one.
        if isinstance(given, float) and not math.isfinite(given):
            raise ToolError(f"invalid argument `{name}`: expected a finite number, got {given}")
    return checked


def _explain(error: str) -> str:
    m = _AT.match(error)
    message, path = (m["message"], m["path"] or "") if m else (error, "")
    field_error = _FIELD.match(message)
    prefix = path.lstrip(".")
    if field_error is not None:
        where = f"{prefix}.{field_error['name']}" if prefix else field_error["name"]
        if field_error["how"] == "contains unknown":
            return f"unknown argument `{where}`"
        return f"missing required argument `{where}`"
    if not prefix:
        return f"invalid arguments: {message}"
    return f"invalid argument `{prefix}`: {message}"


# --- unknown fields in nested objects ------------------------------------------------------
#
# msgspec drops the unknown keys of an object it converts to a Struct, a dataclass or a
# TypedDict, unless the Struct sets ``forbid_unknown_fields`` (the arguments' own Struct
# does): a nested field the model misspelt would pass unnoticed and the tool run with the
# field's default. The user's classes stay as they are; each tool gets instead, once, a
# check that walks the arguments along the parameters' types (msgspec.inspect) after they
# convert, and words what it finds as msgspec words an unknown argument, with its path.
# A tool whose parameters hold no such object gets no check at all.


@dataclass(slots=True, eq=False)
class _Object:
    """An object converted to a Struct, a dataclass or a TypedDict."""

    known: frozenset[Any] | None  # the keys it takes; None: msgspec refuses others itself
    fields: dict[Any, _Check] = field(default_factory=dict)  # key -> check of its value


@dataclass(slots=True, eq=False)
class _Items:
    """Every item of a list, set or ``tuple[X, ...]``, or (``values``) of a dict."""

    item: _Check | None = None
    values: bool = False


@dataclass(slots=True, eq=False)
class _Positions:
    """The item at each position of a tuple, NamedTuple or array-like Struct."""

    items: tuple[_Check | None, ...] = ()
    at_most: int | None = None  # an array-like Struct's length (msgspec ignores extra items)


@dataclass(slots=True, eq=False)
class _Either:
    """A union: the member a JSON object (or array) converted to."""

    obj: _Check | None = None
    array: _Check | None = None
    tag_field: str | None = None  # tagged Structs: the member by the value of this key
    obj_tags: dict[Any, _Check | None] = field(default_factory=dict)
    array_tags: dict[Any, _Check | None] = field(default_factory=dict)  # the first item


_Check = _Object | _Items | _Positions | _Either
_OBJECTS = (mi.StructType, mi.TypedDictType, mi.DataclassType)
_ARRAYS = (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)


def _nested_check(arguments: type[msgspec.Struct]) -> _Check | None:
    """The check of the unknown fields in the arguments' nested objects, or None when
    no parameter's type holds an object msgspec would let unknown fields through in."""
    root = mi.type_info(arguments)
    nodes: dict[int, mi.Type] = {}
    todo: list[mi.Type] = [root]
    while todo:  # every type reachable (a recursive type refers back to the same node)
        node = todo.pop()
        if id(node) not in nodes:
            nodes[id(node)] = node
            todo.extend(_inner(node))
    needy = {i for i, node in nodes.items() if _lets_unknown_in(node)}
    grew = True
    while grew:  # and the types holding one of those, at any depth
        grew = False
        for i, node in nodes.items():
            if i not in needy and any(id(inner) in needy for inner in _inner(node)):
                needy.add(i)
                grew = True
    return _compile(root, needy, {})


def _bare(node: mi.Type) -> mi.Type:
    while isinstance(node, mi.Metadata):
        node = node.type
    return node


def _inner(node: mi.Type) -> list[mi.Type]:
    if isinstance(node, (*_OBJECTS, mi.NamedTupleType)):
        return [_bare(f.type) for f in node.fields]
    if isinstance(node, _ARRAYS):
        return [_bare(node.item_type)]
    if isinstance(node, mi.TupleType):
        return [_bare(t) for t in node.item_types]
    if isinstance(node, mi.DictType):
        return [_bare(node.value_type)]
    if isinstance(node, mi.UnionType):
        return [_bare(t) for t in node.types]
    return []


def _lets_unknown_in(node: mi.Type) -> bool:
    if isinstance(node, mi.StructType):
        return not node.forbid_unknown_fields
    return isinstance(node, (mi.TypedDictType, mi.DataclassType))


def _compile(node: mi.Type, needy: set[int], made: dict[int, _Check]) -> _Check | None:
    if id(node) not in needy:
        return None
    if id(node) in made:  # a recursive type: the check being made
        return made[id(node)]

    def inner(t: mi.Type) -> _Check | None:
        return _compile(_bare(t), needy, made)

    if isinstance(node, mi.StructType) and node.array_like:
        tag: tuple[None, ...] = (None,) if node.tag is not None else ()
        at_most = None if node.forbid_unknown_fields else len(tag) + len(node.fields)
        positions = made[id(node)] = _Positions(at_most=at_most)
        positions.items = tag + tuple(inner(f.type) for f in node.fields)
        return positions
    if isinstance(node, _OBJECTS):
        known: frozenset[Any] | None = None
        if _lets_unknown_in(node):
            keys = {f.encode_name for f in node.fields}
            if isinstance(node, mi.StructType) and node.tag_field is not None:
                keys.add(node.tag_field)
            known = frozenset(keys)
        obj = made[id(node)] = _Object(known)
        for f in node.fields:
            check = inner(f.type)
            if check is not None:
                obj.fields[f.encode_name] = check
        return obj
    if isinstance(node, mi.NamedTupleType):
        positions = made[id(node)] = _Positions()
        positions.items = tuple(inner(f.type) for f in node.fields)
        return positions
    if isinstance(node, mi.TupleType):
        positions = made[id(node)] = _Positions()
        positions.items = tuple(inner(t) for t in node.item_types)
        return positions
    if isinstance(node, _ARRAYS):
        items = made[id(node)] = _Items()
        items.item = inner(node.item_type)
        return items
    if isinstance(node, mi.DictType):
        values = made[id(node)] = _Items(values=True)
        values.item = inner(node.value_type)
        return values
    if isinstance(node, mi.UnionType):
        either = made[id(node)] = _Either()
        for member in (_bare(t) for t in node.types):
            check = inner(member)
            array = isinstance(member, (*_ARRAYS, mi.TupleType, mi.NamedTupleType)) or (
                isinstance(member, mi.StructType) and member.array_like
            )
            if isinstance(member, mi.StructType) and member.tag is not None:
                (either.array_tags if array else either.obj_tags)[member.tag] = check
                either.tag_field = member.tag_field
            elif array:
                either.array = check
            elif isinstance(member, (*_OBJECTS, mi.DictType)):
                either.obj = check
        if len(either.obj_tags) == 1 and either.obj is None:  # its tag may be left out
            (either.obj,) = either.obj_tags.values()
        return either
    return None  # pragma: no cover - every type holding another is listed above


def _unknown_nested(check: _Check, args: Mapping[str, Any]) -> str | None:
    """The first unknown field (in the arguments' order) of a nested object in ``args``,
    in msgspec's words (``Object contains unknown field `x` - at `$.where```), or None.
    A value of another shape than its type's (arguments that did not convert) is passed
    over: msgspec names what is wrong with it."""
    todo: list[tuple[_Check, Any, tuple[Any, ...]]] = [(check, args, ())]
    while todo:  # no recursion: an object as deep as msgspec takes is walked too
        node, value, path = todo.pop()
        if isinstance(node, _Either):
            picked = _member(node, value)
            if picked is None:
                continue
            node = picked
        if isinstance(node, _Object):
            if not isinstance(value, Mapping):
                continue
            if node.known is not None:
                for key in value:
                    if key not in node.known:
                        return f"Object contains unknown field `{key}` - at `{_path(path)}`"
            for key, field_check in reversed(node.fields.items()):
                if key in value:
                    todo.append((field_check, value[key], (path, f".{key}")))
        elif isinstance(node, _Items):
            item = node.item
            if item is None:
                continue
            if node.values:
                if isinstance(value, Mapping):
                    todo.extend((item, v, (path, "[...]")) for v in reversed(list(value.values())))
            elif isinstance(value, (list, tuple)):
                todo.extend((item, value[i], (path, f"[{i}]")) for i in reversed(range(len(value))))
        elif isinstance(node, _Positions) and isinstance(value, (list, tuple)):
            if node.at_most is not None and len(value) > node.at_most:
                return (
                    f"Expected `array` of at most length {node.at_most}, got {len(value)}"
                    f" - at `{_path(path)}`"
                )
            for i in reversed(range(min(len(node.items), len(value)))):
                position = node.items[i]
                if position is not None:
                    todo.append((position, value[i], (path, f"[{i}]")))
    return None


def _member(either: _Either, value: Any) -> _Check | None:
    if isinstance(value, Mapping):
        tags, tag, untagged = either.obj_tags, value.get(either.tag_field or ""), either.obj
    elif isinstance(value, (list, tuple)):
        tags, tag, untagged = either.array_tags, value[0] if value else None, either.array
    else:
        return None
    try:
        return tags.get(tag, untagged)
    except TypeError:  # a tag no member has (a list, say)
        return untagged


def _path(path: tuple[Any, ...]) -> str:
    steps: list[str] = []
    while path:
        path, step = path
        steps.append(step)
    return "$" + "".join(reversed(steps))


def _await(
    value: Awaitable[Any],
    loop: asyncio.AbstractEventLoop | EventLoopThread | None,
    abort: AbortSignal,
    timeout: float | None,
    tool_name: str,
) -> Any:
    target = loop if loop is not None else default_loop_thread()
    running = target.loop if isinstance(target, EventLoopThread) else target
    try:
        return run_awaitable(value, running, abort=abort, timeout=timeout, name=tool_name)
    except TimeoutError:
        raise ToolError(f"tool {tool_name!r} timed out after {timeout} s") from None


def _encode(value: Any, tool_name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ToolError(f"tool {tool_name!r} returned a value that is not JSON: {exc}") from None
