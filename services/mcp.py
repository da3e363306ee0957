"""Tools from MCP servers (the Model Context Protocol), through the maintained ``mcp`` SDK.

Why the SDK: it is the protocol's reference implementation, kept in step with the spec
(version negotiation, the stdio and streamable HTTP transports, pagination, cancellation,
process shutdown); the protocol is too large and moving to speak by hand. It is an optional
extra (``pip install aalis-agent[mcp]``): this module imports it only when a client starts.

An :class:`McpClient` connects to the servers of its :class:`McpServer` specs (a command
run over stdio, or a streamable HTTP URL), lists their tools and offers each as a
:class:`Tool` with the server's input schema, in the server's tool group. The SDK is async:
every connection lives on the client's own event loop thread (:class:`EventLoopThread`);
a tool call, made from the turn's tool thread, runs there and is waited for, with a
timeout, and is cancelled when the turn is stopped (``ctx.abort``). A server that fails to
start raises :class:`McpError` naming it (with the tail of its stderr for a command).

A server whose connection ends while in use (its process exited or was killed; an HTTP
server went away) is started, or connected to, again by the next call of one of its
tools, with a warning logged; the call that was under
way when it ended fails, and is not sent again (it may have done its work). A server is
started again at most once in :data:`RECONNECT_GAP_S`: the calls that find it down again
sooner (it did not start, or died again) fail at once, naming why, rather than starting
it on every call. A start again runs on a thread of its own, within the server's
``startup_timeout_s``: a call waits for it at most its own timeout (``timeout_s`` covers
the wait and the call), and a stop (``ctx.abort``) ends the wait; either way the start
goes on, and a later call finds the server started. One server starting again delays no
other server's calls. A server may answer a call with an error under the codes the SDK uses
for a connection it found closed (-32000) or for its read timeout (-32001): that is the
call's error, with the server's message, once the server answers a request after it (for
-32000) or when the call's time is not up (for -32001).

A stdio server runs through the transport of :mod:`aalis_agent.services.mcp_stdio` (the
SDK's on Windows): a line it writes that answers a call but is not a valid JSON-RPC
message fails that call at once, quoting it (the server stays connected), and a line
naming no call (a banner, a stray print) is logged and dropped; a line past its
``max_line_bytes`` is refused, naming the limit; closing ends its process group, the
processes it started with it. An answer that is not a valid tool result fails its call
with one line naming the field and what the server sent there.

Usage::

    client = McpClient([McpServer("files", command="uvx", args=("mcp-server-fs", "."))])
    client.start()                     # connects, lists tools; McpError names a bad server
    client.register(services.tools)    # the tools join the registry, group "files"
    ...
    client.close()                     # at shutdown
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from aalis_agent.events.errors import Aborted, RunError, ToolError
from aalis_agent.services.abort import AbortSignal
from aalis_agent.services.tools import Tool, ToolCallContext, ToolRegistry
from aalis_agent.services.typed_tools import EventLoopThread, run_awaitable

if TYPE_CHECKING:
    from mcp import Client

__all__ = ["McpClient", "McpError", "McpServer", "McpTool"]

log = structlog.get_logger(__name__)

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as providers accept a tool's name (fullmatch)

# A cancelled connection's ending: for a stdio server, 2 s to exit, 2 s more after
# SIGTERM to its group, then SIGKILL and up to 2 s to see it gone.
_CANCELLED_END_S = 7.0

_STDERR_LINE_MAX = 500  # characters of a server's stderr line kept and logged

_PROBE_S = 2.0  # the longest a request may take that asks whether a connection is still there

DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
"""The longest message a stdio server may send by default (one line): 16 MiB."""

RECONNECT_GAP_S = 5.0
"""The least time between two starts of a server whose connection ended: a call that finds
it down sooner fails at once."""


class McpError(RunError):
    """An MCP server could not be reached or used; the message names the server."""


@dataclass(frozen=True)
class McpServer:
    """One MCP server: ``command`` (with ``args``, ``env``, ``cwd``) run over stdio, or a
    streamable HTTP ``url`` (with ``headers``). Its tools join tool group ``group``
    (default: the server's name), named ``prefix + tool name``."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] | None = field(default=None, repr=False)
    group: str | None = None
    prefix: str = ""
    timeout_s: float = 60.0
    """The longest a tool call may take, waiting for its server to start again included."""
    startup_timeout_s: float = 30.0
    """The longest connecting and listing the tools may take."""
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    """The longest message a stdio server may send (one line): a longer one fails the
    call it answers, naming the limit, and is not read (POSIX)."""

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give a command or a url (one of them)")
        if (
            isinstance(self.max_line_bytes, bool)
            or not isinstance(self.max_line_bytes, int)
            or self.max_line_bytes < 1
        ):
            raise ValueError(
                f"MCP server {self.name!r}: max_line_bytes must be a positive integer, got "
                f"{self.max_line_bytes!r}"
            )

    @property
    def tool_group(self) -> str:
        return self.group if self.group is not None else self.name

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


@dataclass(frozen=True, slots=True)
class McpTool:
    """A tool as a server lists it."""

    server: str
    name: str
    description: str
    input_schema: Mapping[str, Any]


class _Connection:
    """One server's live session: entered and left by one task on the client's loop."""

    def __init__(self, spec: McpServer) -> None:
        self.spec = spec
        self.client: Client | None = None
        self.tools: list[McpTool] = []
        self.stderr: collections.deque[str] = collections.deque(maxlen=40)
        self.task: asyncio.Task[None] | None = None
        self.closing: asyncio.Event | None = None
        self.failure: BaseException | None = None
        self.stderr_reader: threading.Thread | None = None
        self.restarted_at: float | None = None  # when it was last started again (monotonic)
        self.restart_failed: str | None = None  # why that start failed, if it did


class McpClient:
    """The connections to a set of MCP servers, on an event loop thread of their own."""

    def __init__(self, servers: Iterable[McpServer], *, name: str = "aalis-mcp") -> None:
        self.servers = tuple(servers)
        names = [s.name for s in self.servers]
        for n in names:
            if names.count(n) > 1:
                raise ValueError(f"MCP server {n!r} is listed twice")
        self._loop = EventLoopThread(name)
        self._lock = threading.Lock()  # connections replaced or closed: one at a time
        self._connections: dict[str, _Connection] = {}
        # The start again under way of each server whose connection ended: one at a time.
        self._restarts: dict[str, concurrent.futures.Future[_Connection]] = {}
        self._starting: set[_Connection] = set()  # connections being started now
        self._closed = False
        self.reconnects = 0  # servers started again after their connection ended

    def __enter__(self) -> McpClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- connecting -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect to every server and list its tools; on a failure, the servers already
        connected are closed and :class:`McpError` names the one that failed."""
        try:
            for spec in self.servers:
                if spec.name not in self._connections:
                    self._connect(spec)
        except BaseException:
            self.close()
            raise

    def _connect(
        self,
        spec: McpServer,
        abort: AbortSignal | None = None,
        restarted_at: float | None = None,
    ) -> _Connection:
        """Start ``spec``'s connection, wait until its tools are listed, and put it in use
        for the server; a stop (``abort``) gives up the wait, and the start, with
        :class:`Aborted`. ``restarted_at``: when it is a start again, its time."""
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise McpError(
                f"MCP server {spec.name!r}: the mcp SDK is not installed "
                "(pip install 'aalis-agent[mcp]')"
            ) from None
        conn = _Connection(spec)
        conn.restarted_at = restarted_at
        with self._lock:
            if self._closed:
                raise McpError(f"MCP server {spec.name!r}: the client is closed")
            self._starting.add(conn)  # from here on, close() ends it if it comes
            loop = self._loop.loop  # started here at the first start; close() comes after
        try:
            run_awaitable(self._open(conn), loop, abort=abort, timeout=spec.startup_timeout_s + 5)
        except (McpError, Aborted):
            self._forget_start(conn)
            raise
        except BaseException as exc:
            self._forget_start(conn)
            raise McpError(_failed(conn, exc)) from None
        with self._lock:  # in use at once: close() finds it in one place or the other
            self._starting.discard(conn)
            if self._closed:
                raise McpError(f"MCP server {spec.name!r}: the client is closed")
            self._connections[spec.name] = conn
        return conn

    def _forget_start(self, conn: _Connection) -> None:
        """A start given up: forgotten once its task has ended (a stopped wait returns
        before the task's ending has run; until then close() waits for it too)."""

        def forget(*_: object) -> None:
            with self._lock:
                self._starting.discard(conn)

        def when_done() -> None:
            task = conn.task
            if task is None or task.done():
                forget()
            else:
                task.add_done_callback(forget)

        loop = self._loop.running_loop()
        try:
            if loop is None:
                raise RuntimeError("closed")
            loop.call_soon_threadsafe(when_done)
        except RuntimeError:  # the loop is closed: nothing of it runs any more
            forget()

    async def _open(self, conn: _Connection) -> None:
        """Start the connection's task and wait until its tools are listed; none once the
        client is closed (checked here, on the loop: a start submitted as close() ran
        would otherwise begin after close() looked for starts to end)."""
        spec = conn.spec
        if self._closed:
            raise McpError(f"MCP server {spec.name!r}: the client is closed")
        conn.closing = asyncio.Event()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.task = asyncio.create_task(self._serve(conn, ready), name=f"mcp:{spec.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), spec.startup_timeout_s)
        except TimeoutError:
            await self._abandon(conn, ready)
            raise McpError(
                _failed(conn, None, f"did not answer within {spec.startup_timeout_s:g} s")
            ) from None
        except asyncio.CancelledError:  # a stop, or the wait given up: no half-started server
            await self._abandon(conn, ready)
            raise
        except Exception as exc:
            raise McpError(_failed(conn, exc)) from None

    @staticmethod
    async def _abandon(conn: _Connection, ready: asyncio.Future[None]) -> None:
        """End a connection that is still starting (its process goes with it)."""
        ready.cancel()
        if conn.task is not None:
            conn.task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(conn.task, 10)

    async def _serve(self, conn: _Connection, ready: asyncio.Future[None]) -> None:
        """Hold the session open until the client closes (enter and exit in one task)."""
        from mcp import Client

        spec = conn.spec
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = await _transport(spec, conn, stack)
                client = await stack.enter_async_context(Client(transport))
                conn.tools = await _list_tools(client, spec.name)
                conn.client = client
                if not ready.done():
                    ready.set_result(None)
                assert conn.closing is not None
                await conn.closing.wait()
        except BaseException as exc:
            conn.failure = exc
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else McpError(repr(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                log.warning("MCP server connection ended", server=spec.name, error=_leaf(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            conn.client = None

    # --- tools ----------------------------------------------------------------------------

    def listed(self) -> list[McpTool]:
        """Every connected server's tools, as listed."""
        return [t for c in self._connections.values() for t in c.tools]

    def tools(self) -> list[Tool]:
        """The servers' tools as :class:`Tool` objects calling back into this client. A
        tool whose name (with the server's prefix) providers would refuse (not 1 to 64
        of ``A-Z a-z 0-9 _ -``) is left out, with a warning naming it: sent, it would make
        every request fail."""
        out: list[Tool] = []
        for conn in self._connections.values():
            spec = conn.spec
            for t in conn.tools:
                if not _TOOL_NAME.fullmatch(spec.prefix + t.name):
                    log.warning(
                        "MCP tool left out: its name is not 1 to 64 letters, digits, _ or -",
                        server=spec.name,
                        tool=(spec.prefix + t.name)[:80],
                    )
                    continue
                out.append(
                    Tool(
                        name=spec.prefix + t.name,
                        handler=self._handler(spec.name, t.name),
                        description=t.description,
                        parameters=dict(t.input_schema),
                        groups=(spec.tool_group,),
                    )
                )
        return out

    def register(self, registry: ToolRegistry) -> list[Tool]:
        """Add the servers' tools to ``registry``; the tools added. A name taken already
        (by another server's tool, or one of the registry's) is an :class:`McpError`
        naming the server: give it a ``prefix`` (``toolPrefix`` in the configuration
        file)."""
        tools = self.tools()
        servers = {spec.prefix + t.name: spec.name for spec, t in self._listed_pairs()}
        for t in tools:
            try:
                registry.register(t)
            except ValueError:
                raise McpError(
                    f"MCP server {servers.get(t.name, '?')!r}: its tool {t.name!r} is "
                    "registered already (by another server or tool); give the server a "
                    "prefix (toolPrefix in the configuration file)"
                ) from None
        return tools

    def _listed_pairs(self) -> list[tuple[McpServer, McpTool]]:
        return [(c.spec, t) for c in self._connections.values() for t in c.tools]

    def _handler(self, server: str, name: str) -> Any:
        def handler(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
            return self.call(server, name, args, ctx=ctx)

        return handler

    def call(
        self,
        server: str,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        ctx: ToolCallContext | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Call tool ``name`` of ``server`` and wait: its text content (structured content
        as JSON when it has no text). A tool's error, a timeout or a lost server raises
        :class:`ToolError`; a stop (``ctx.abort``) cancels the call and raises Aborted."""
        conn = self._connections.get(server)
        if conn is None:
            raise ToolError(f"MCP server {server!r} is not connected")
        limit = conn.spec.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        abort = ctx.abort if ctx is not None else None
        client = conn.client
        if client is None:
            conn, client = self._reconnect(server, name, abort, limit, deadline)
        left = deadline - time.monotonic()  # what waiting for a start again left of it
        loop = self._loop.running_loop()
        if loop is None:  # closed meanwhile (a closed client starts no loop again)
            raise ToolError(f"MCP server {server!r} is not connected (the client is closed)")
        try:
            if left <= 0:
                raise TimeoutError
            result = run_awaitable(
                client.call_tool(name, dict(arguments or {}), read_timeout_seconds=left),
                loop,
                abort=abort,
                timeout=left + 1,
            )
        except (Aborted, ToolError):
            raise
        except TimeoutError:
            raise ToolError(
                f"MCP server {server!r}: tool {name!r} timed out after {limit:g} s"
            ) from None
        except Exception as exc:
            # The SDK's read timeout, which is the call's: it cannot come before the
            # deadline (its clock starts after the request is written); sooner, the code
            # is the server's own error reply.
            if _timed_out(exc) and time.monotonic() >= deadline:
                raise ToolError(
                    f"MCP server {server!r}: tool {name!r} timed out after {limit:g} s"
                ) from None
            # The SDK's code for a connection it found closed, which a server may also
            # send as its own error reply: the server still answering says which.
            if _connection_closed(exc) and not self._answers(client, loop, abort, deadline):
                if self._closed:  # ended by close(): nothing starts it again
                    raise ToolError(
                        f"MCP server {server!r} is not connected (the client is closed)"
                    ) from None
                # The server is gone (its process exited or was killed): this call may
                # have reached it, so it is not sent again; the next call starts it anew.
                self._end(conn, exc)
                raise ToolError(
                    f"MCP server {server!r}: tool {name!r} failed: its connection ended "
                    f"({_leaf(exc)}); the server is started again at its next call"
                ) from None
            raise ToolError(f"MCP server {server!r}: tool {name!r} failed: {_why(exc)}") from None
        text = _result_text(result)
        if result.is_error:
            raise ToolError(text or f"MCP tool {name!r} failed")
        return text

    @staticmethod
    def _answers(
        client: Client,
        loop: asyncio.AbstractEventLoop,
        abort: AbortSignal | None,
        deadline: float,
    ) -> bool:
        """Whether the server answers a request (the first page of its tools: ping is
        gone from newer protocol versions) within what is left of the call, at most
        :data:`_PROBE_S`: its connection is still there. An error reply of its own is an
        answer too."""
        left = min(deadline - time.monotonic(), _PROBE_S)
        if left <= 0:
            return False
        try:
            run_awaitable(client.list_tools(), loop, abort=abort, timeout=left)
        except Aborted:
            raise
        except Exception as exc:
            return _sdk_error(exc, None) and not (_connection_closed(exc) or _timed_out(exc))
        return True

    def _reconnect(
        self,
        server: str,
        tool: str,
        abort: AbortSignal | None,
        limit: float,
        deadline: float,
    ) -> tuple[_Connection, Client]:
        """Wait for a server whose connection ended to be started again, starting it when
        no start of it is under way (none while another start of it is fresh): its
        connection and client, or :class:`ToolError` saying why not (:class:`Aborted` on
        a stop). The wait ends at the call's ``deadline``; the start goes on (within its
        ``startup_timeout_s``) for the calls after it."""
        with self._lock:
            conn = self._connections.get(server)
            if self._closed or conn is None:
                raise ToolError(f"MCP server {server!r} is not connected (the client is closed)")
            client = conn.client  # read once: the loop thread may clear it
            if client is not None:  # another call started it again meanwhile
                return conn, client
            restart = self._restarts.get(server)
            if restart is None:
                self._end(conn)  # what is left of the old one (a dead process's pipes)
                now = time.monotonic()
                if conn.restarted_at is not None and now - conn.restarted_at < RECONNECT_GAP_S:
                    ago = now - conn.restarted_at
                    why = (
                        f"starting it again failed {ago:.1f} s ago: {conn.restart_failed}"
                        if conn.restart_failed is not None
                        else f"its start again began {ago:.1f} s ago, and it has ended again"
                    )
                    raise ToolError(f"MCP server {server!r} is not connected: {why}")
                restart = self._restarts[server] = concurrent.futures.Future()
                threading.Thread(
                    target=self._restart,
                    args=(conn, now, restart),
                    name=f"mcp-restart:{server}",
                    daemon=True,
                ).start()
        woke = threading.Event()
        restart.add_done_callback(lambda _: woke.set())
        if abort is not None:
            abort.add_callback(woke.set)
        woke.wait(max(0.0, deadline - time.monotonic()))
        if not restart.done():
            if abort is not None and abort.aborted:
                raise Aborted(abort.reason or "stop")
            raise ToolError(
                f"MCP server {server!r}: tool {tool!r} timed out after {limit:g} s: the "
                "server is still starting again (it may take "
                f"{conn.spec.startup_timeout_s:g} s); a later call finds it started"
            )
        fresh = restart.result()  # ToolError when the start failed
        client = fresh.client
        if client is None:
            raise ToolError(
                f"MCP server {server!r} is not connected: it ended again right after it was "
                "started again"
            )
        return fresh, client

    def _restart(
        self, old: _Connection, started_at: float, done: concurrent.futures.Future[_Connection]
    ) -> None:
        """Start ``old``'s server again, on a thread of its own (the calls waiting for it
        give up at their own timeouts, the start does not), and tell ``done``."""
        spec = old.spec
        ended = _leaf(old.failure) if old.failure is not None else "it ended"
        result: _Connection | None = None
        error: ToolError | None = None
        try:
            result = self._connect(spec, None, restarted_at=started_at)
        except McpError as exc:
            down = _Connection(spec)  # keeps its tools: they are still offered
            down.tools, down.failure = old.tools, old.failure
            down.restarted_at, down.restart_failed = time.monotonic(), str(exc)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._connections[spec.name] = down
            if closed:  # given up by close(): that is what to say
                error = ToolError(
                    f"MCP server {spec.name!r} is not connected (the client is closed)"
                )
            else:
                log.warning("MCP server did not start again", server=spec.name, error=str(exc))
                error = ToolError(
                    f"MCP server {spec.name!r}: its connection ended and starting it again "
                    f"failed: {exc}"
                )
        except BaseException as exc:  # the waiters hear of anything else too
            error = ToolError(f"MCP server {spec.name!r}: starting it again failed: {_leaf(exc)}")
        finally:
            with self._lock:
                if self._restarts.get(spec.name) is done:
                    del self._restarts[spec.name]  # before the answer: a later call sees it
                if result is not None:
                    self.reconnects += 1
            if result is not None:
                before = {t.name for t in old.tools}
                after = {t.name for t in result.tools}
                log.warning(
                    "MCP server started again: its connection had ended",
                    server=spec.name,
                    ended=ended,
                    tools_gone=sorted(before - after)[:20] or None,
                )
                done.set_result(result)
            else:
                done.set_exception(error or ToolError(f"MCP server {spec.name!r} did not start"))

    def _end(self, conn: _Connection, failure: BaseException | None = None) -> None:
        """Take a connection found dead out of use: the next call starts the server again,
        and its task (on the loop) leaves the old session."""
        conn.client = None
        if failure is not None and conn.failure is None:
            conn.failure = failure
        closing = conn.closing
        loop = self._loop.running_loop()
        if closing is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(closing.set)

    # --- closing --------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every connection (a stdio server's process ends), give up the starts
        under way, and close the loop thread. A connection that has not closed within
        ``timeout_s`` is cancelled, and its process ended (a stdio server's process group is
        ended within a few seconds)."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections.values()), {}
            starting = list(self._starting)
        loop = self._loop.running_loop()
        if loop is not None and (connections or starting):

            async def shut() -> None:
                for conn in connections:
                    if conn.closing is not None:
                        conn.closing.set()
                for conn in starting:  # a start under way is given up
                    # Once only: a second cancel would cut short the ending the first
                    # one began (the SDK's, which stops the server's process).
                    if conn.task is not None and not conn.task.cancelling():
                        conn.task.cancel()
                tasks = [c.task for c in (*connections, *starting) if c.task is not None]
                if tasks:
                    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
                    for task in pending:
                        if not task.cancelling():
                            task.cancel()
                    if pending:  # let their ending run (a process to stop), briefly
                        await asyncio.wait(pending, timeout=_CANCELLED_END_S)

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shut(), loop).result(
                    timeout_s + _CANCELLED_END_S + 5
                )
        self._loop.close()


async def _transport(spec: McpServer, conn: _Connection, stack: contextlib.AsyncExitStack) -> Any:
    """The SDK transport for ``spec``: a stdio process (its stderr kept for errors and
    logged at debug level) or a streamable HTTP endpoint."""
    if spec.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        http_client = None
        if spec.headers:
            import httpx2

            http_client = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=dict(spec.headers), timeout=httpx2.Timeout(30.0, read=300.0)
                )
            )
        return streamable_http_client(spec.url, http_client=http_client)
    assert spec.command is not None
    errlog, conn.stderr_reader = _stderr_pipe(spec.name, conn.stderr)
    stack.callback(errlog.close)  # our copy of the write end; the child keeps its own
    if sys.platform != "win32":
        from aalis_agent.services.mcp_stdio import stdio_transport

        return stdio_transport(
            spec.command,
            list(spec.args),
            env=spec.env,
            cwd=spec.cwd,
            errlog=errlog,
            max_line_bytes=spec.max_line_bytes,
        )
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=spec.command,
        args=list(spec.args),
        env=dict(spec.env) if spec.env is not None else None,
        cwd=spec.cwd,
    )
    return stdio_client(params, errlog=errlog)


def _stderr_pipe(server: str, tail: collections.deque[str]) -> tuple[Any, threading.Thread]:
    """A file for a server's stderr: a pipe read by a daemon thread that keeps the last
    lines (for error messages) and logs each at debug level, so nothing grows unbounded:
    a line is read, kept and logged up to :data:`_STDERR_LINE_MAX` characters, the rest
    of it is skipped (a server may write megabytes with no line break)."""
    read_fd, write_fd = os.pipe()

    def drain() -> None:
        with open(read_fd, encoding="utf-8", errors="replace") as lines:
            cut = False  # within the rest of a line cut short
            while piece := lines.readline(_STDERR_LINE_MAX):
                whole = piece.endswith("\n")
                if not cut:
                    text = piece.rstrip("\n") + ("" if whole else " [...]")
                    tail.append(text)
                    log.debug("MCP server stderr", server=server, line=text)
                cut = not whole

    reader = threading.Thread(target=drain, name=f"mcp-stderr:{server}", daemon=True)
    reader.start()
    return open(write_fd, "w", encoding="utf-8"), reader  # the stack closes it


async def _list_tools(client: Client, server: str) -> list[McpTool]:
    tools: list[McpTool] = []
    cursor: str | None = None
    for _ in range(1000):  # a server whose pages never end cannot hang the start
        page = await client.list_tools(cursor=cursor)
        for t in page.tools:
            tools.append(
                McpTool(
                    server=server,
                    name=t.name,
                    description=t.description or t.title or "",
                    input_schema=dict(t.input_schema or {"type": "object", "properties": {}}),
                )
            )
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _result_text(result: Any) -> str:
    """A call result as text: text blocks joined; other blocks named; structured content
    as JSON when there is no text."""
    parts: list[str] = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}]")
        elif kind == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource: {res.uri}]")
    if not parts and result.structured_content is not None:
        return msgspec.json.encode(result.structured_content).decode()
    return "\n".join(parts)


def _timed_out(exc: BaseException) -> bool:
    """Whether a call failed on the SDK's read timeout (its ``REQUEST_TIMEOUT`` error)."""
    return _sdk_error(exc, "REQUEST_TIMEOUT")


def _connection_closed(exc: BaseException) -> bool:
    """Whether a call failed because its connection is closed (the SDK's
    ``CONNECTION_CLOSED`` error): the server process is gone."""
    return _sdk_error(exc, "CONNECTION_CLOSED")


def _sdk_error(exc: BaseException, code: str | None) -> bool:
    """Whether ``exc`` (or the first error inside exception groups) is the SDK's JSON-RPC
    error of that ``code`` name (``mcp.types``); of any code for None."""
    try:
        import mcp.types
        from mcp.shared.exceptions import MCPError
    except ImportError:  # pragma: no cover - the SDK is there when a call is made
        return False
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if not isinstance(exc, MCPError):
        return False
    return code is None or bool(exc.error.code == getattr(mcp.types, code))


def _why(exc: BaseException) -> str:
    """Why a call failed, on one line: an answer that is not a valid tool result (the
    SDK's pydantic error, many lines long) is named with its first fault and what the
    server sent there (cut short); any other error as :func:`_leaf` gives it."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return _leaf(exc)
    try:
        found = list(errors())
    except Exception:  # pragma: no cover - pydantic's errors() does not fail
        return _leaf(exc)
    first = next((e for e in found if tuple(e.get("loc", ()))[:1] == ("CallToolResult",)), None)
    first = first or (found[0] if found else {})
    where = ".".join(str(p) for p in tuple(first.get("loc", ()))[1:]) or "it"
    sent = repr(first.get("input"))
    sent = sent if len(sent) <= 200 else sent[:200] + " [...]"
    return f"its answer is not a valid tool result ({where}: {first.get('msg', '')}): {sent}"


def _leaf(exc: BaseException) -> str:
    """The first real error inside (nested) exception groups, as ``Type: message``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _failed(conn: _Connection, exc: BaseException | None, problem: str | None = None) -> str:
    spec = conn.spec
    where = (
        f"command {' '.join([spec.command or '', *spec.args])!r}"
        if spec.command is not None
        else f"url {spec.url!r}"
    )
    if conn.stderr_reader is not None:
        conn.stderr_reader.join(1.0)  # the last lines a dead server wrote
    cause = exc or conn.failure
    what = problem or (f"failed to start: {_leaf(cause)}" if cause else "failed to start")
    message = f"MCP server {spec.name!r} ({where}) {what}"
    if conn.stderr:
        message += "\nits stderr ends with:\n" + "\n".join(list(conn.stderr)[-10:])
    return message
