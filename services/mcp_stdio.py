"""The stdio transport of MCP servers run as commands (POSIX), in place of the SDK's.

It speaks what the SDK's ``stdio_client`` speaks (one JSON-RPC message a line, both ways)
and differs where a server misbehaves:

- A line from the server that is not a JSON-RPC message but answers a request waiting
  (it names the request's ``id``: a response whose ``result`` is not an object, or a
  line cut short that opens as an answer) fails that request at once, with an error
  quoting what the server sent (cut to :data:`QUOTE_CHARS`); an error reply with no
  request id fails every request waiting. The SDK logged such a line and dropped it, and
  the call waited out its whole timeout. The connection stays in use. A line that names
  no request (a banner, a log line written to stdout, JSON that is no message) is logged
  and dropped, as the SDK did: the calls under way go on. What the server wrote after
  its last line break before its output ended is read as a line too (the SDK dropped
  it): an answer whole is taken, one cut short fails its call as above, where the SDK's
  failed with "Connection closed".
- A line longer than ``max_line_bytes`` is not kept: the requests waiting fail as above
  (the one its opening names, when it does; none when it opens as a notification or a
  request of the server's own), naming the limit, and the rest of the line is skipped.
  Lines are split in linear time (the SDK joined its buffer with each chunk
  read, so a 10 MB line took 6 s and a 50 MB one minutes).
- The server runs in a session (process group) of its own, and closing the connection
  ends the whole group: the server's stdin is closed, then, once the server has exited
  or after :data:`EXIT_GRACE_S`, the group gets SIGTERM and, after :data:`KILL_GRACE_S`,
  SIGKILL. The SDK ended the group only when the server itself outlived its grace, so the
  children of a server that exited on its stdin's end were left running. No group is
  signalled once the server's process id leads another one (the server and its group
  gone, the number given again), where ``/proc`` tells the two apart by start time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator, Mapping
from typing import Any, TextIO

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import structlog

__all__ = ["stdio_transport"]

log = structlog.get_logger(__name__)

QUOTE_CHARS = 200
"""Characters of a bad line quoted in the error it causes."""

EXIT_GRACE_S = 2.0
"""How long a server has to exit after its stdin is closed, before its group is ended."""

KILL_GRACE_S = 2.0
"""Between SIGTERM and SIGKILL to the server's process group."""

_NONE = object()  # an id no request has
_CHUNK = 1 << 16
_READ_ENDED = (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError)
_FLUSH_S = 0.5  # for the messages accepted already to be written, at close
_REAP_S = 2.0  # for the loop to see a killed server exit

# The id of a message, when its opening holds it (``{"jsonrpc": "2.0", "id": ...``).
_OPENING_ID = re.compile(
    rb'\A\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d{1,30}|"[^"\\]{0,200}")'
)
# The opening of a notification or of a request of the server's own: it answers no call.
_OPENING_METHOD = re.compile(rb'\A\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"method"\s*:')
_THEN_METHOD = re.compile(rb'\s*,\s*"method"\s*:')  # after the id: the server's request


def _opening_names(opening: bytes | bytearray) -> Any:
    """The request a line that cannot be read whole answers, by its ``opening``: the id
    it names (a str); ``_NONE`` when it opens as a notification or a request of the
    server's own (a ``method``: no request of ours, whatever its id); None when it names
    neither (it may be an answer)."""
    found = _OPENING_ID.match(opening)
    if found is not None:
        if _THEN_METHOD.match(opening, found.end()):
            return _NONE
        return found.group(1).decode("utf-8", "replace").strip('"')
    return _NONE if _OPENING_METHOD.match(opening) else None


def _quote(data: bytes | bytearray) -> str:
    text = bytes(data[: QUOTE_CHARS * 4]).decode("utf-8", errors="replace")
    return repr(text[:QUOTE_CHARS]) + (" [...]" if len(text) > QUOTE_CHARS else "")


def _reason(exc: Exception, decoded: object) -> str:
    """Why a line is not a message, in a few words: not JSON, or which field of what it
    is meant to be is wrong (``decoded``: the line as JSON, None if it is not JSON)."""
    if decoded is None:
        return "not JSON"
    if not isinstance(decoded, dict):
        return f"not a JSON-RPC message (a JSON {type(decoded).__name__})"
    kind = (
        "JSONRPCResponse"
        if "result" in decoded
        else "JSONRPCError"
        if "error" in decoded
        else "JSONRPCRequest"
        if "id" in decoded
        else "JSONRPCNotification"
    )
    errors: list[Any] = []
    with contextlib.suppress(Exception):
        errors = list(exc.errors())  # type: ignore[attr-defined]
    mine = [e for e in errors if tuple(e.get("loc", ()))[:1] == (kind,)] or errors
    if not mine:
        return "not a JSON-RPC message"
    where = ".".join(str(p) for p in tuple(mine[0].get("loc", ()))[1:]) or "it"
    label = kind.removeprefix("JSONRPC").lower()
    return f"not a valid JSON-RPC {label} ({where}: {mine[0].get('msg', '')})"


@contextlib.asynccontextmanager
async def stdio_transport(
    command: str,
    args: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    errlog: TextIO,
    max_line_bytes: int,
) -> AsyncIterator[tuple[Any, Any]]:
    """Run ``command`` over stdio and yield the SDK's (read, write) stream pair to it."""
    import mcp_types as types
    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process(
        [command, *args],
        env=get_default_environment() | dict(env or {}),
        stderr=errlog,
        cwd=cwd,
        start_new_session=True,  # its group is its own: closing ends its children too
    )
    started = _start_time(process.pid)  # tells its group from a later one under its number
    reader_in, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, writer_out = anyio.create_memory_object_stream[SessionMessage](0)
    waiting: dict[str, Any] = {}  # the requests sent and not answered: their ids, by str
    writer_done = anyio.Event()

    def fail(rid: Any, message: str) -> SessionMessage:
        error = types.ErrorData(code=types.PARSE_ERROR, message=message)
        return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=rid, error=error))

    def failures(named: Any, message: str) -> list[SessionMessage]:
        """Errors for the requests a bad line fails: the one it names (``named``: its id)
        if that one waits, none if it names another (a late answer, or the server's own
        request); every one waiting if it names none (``named`` None)."""
        log.warning("MCP server sent a bad line", error=message)
        if named is not None:
            rid = waiting.pop(str(named), _NONE)
            return [] if rid is _NONE else [fail(rid, message)]
        ids = list(waiting.values())
        waiting.clear()
        return [fail(rid, message) for rid in ids]

    def too_long(opening: bytes | bytearray) -> tuple[Any, str]:
        """The id a line past the limit names in its ``opening`` (its first 1,024 bytes;
        None if it names none: it may be an answer; no request's when it opens as a
        notification or a request of the server's), and the error it causes."""
        return _opening_names(opening), (
            f"the server sent a line longer than {max_line_bytes} bytes (max_line_bytes), "
            f"which is not read: {_quote(opening)}"
        )

    def parse(line: bytes | bytearray) -> list[SessionMessage]:
        try:
            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except ValueError as exc:
            if not line.strip():
                return []
            decoded: object = None
            with contextlib.suppress(msgspec.DecodeError):
                decoded = msgspec.json.decode(line)
            named: Any = None  # the request the line answers, by its opening
            if isinstance(decoded, dict):
                if decoded.get("id") is not None:
                    named = decoded["id"] if "method" not in decoded else _NONE
            elif decoded is None:  # not JSON: cut short, say, if it opens as an answer
                named = _opening_names(line[:1024])
            why = f"the server sent a line that is {_reason(exc, decoded)}: {_quote(line)}"
            if named is None:
                # Stray output naming no request (a banner, a log line on stdout): as
                # the SDK did, logged and dropped; the calls under way go on.
                log.warning("MCP server wrote a line that is not a message", error=why)
                return []
            return failures(named, why)
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError):
            if message.id is None:  # an error for no request: the ones waiting hear of it
                assert isinstance(message, types.JSONRPCError)
                return failures(
                    None,
                    f"the server sent an error for no request: {message.error.message} "
                    f"(code {message.error.code})",
                )
            waiting.pop(str(message.id), None)
        return [SessionMessage(message)]

    async def deliver(items: list[SessionMessage]) -> bool:
        try:
            for item in items:
                await reader_in.send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False  # the session is gone: what is left is drained
        return True

    async def read() -> None:
        assert process.stdout is not None
        buf = bytearray()
        scanned = 0  # buf[:scanned] holds no line break
        skipping = False  # within the rest of a line past the limit
        open_ = True
        try:
            async with reader_in:
                while True:
                    try:
                        chunk = await process.stdout.receive(_CHUNK)
                    except _READ_ENDED:  # the server's end, or ours (shutdown closed it)
                        if open_ and buf and not skipping:
                            # Its last line, with no line break: whole, or cut short as
                            # the server ended (a call it answers fails, quoting it).
                            await deliver(parse(buf))
                        break
                    if not open_:
                        continue  # drained, so that a server writing can exit
                    buf += chunk
                    start = 0
                    items: list[SessionMessage] = []
                    while (end := buf.find(b"\n", scanned)) >= 0:
                        if skipping:
                            skipping = False
                        elif end - start > max_line_bytes:
                            items += failures(*too_long(buf[start : min(end, start + 1024)]))
                        else:
                            items += parse(buf[start:end])
                        start = scanned = end + 1
                    if start:
                        del buf[:start]
                    scanned = len(buf)
                    if not skipping and len(buf) > max_line_bytes:
                        items += failures(*too_long(buf[:1024]))
                        skipping = True
                    if skipping:
                        buf.clear()
                        scanned = 0
                    if items:
                        open_ = await deliver(items)
        except anyio.ClosedResourceError:
            pass

    async def write() -> None:
        assert process.stdin is not None
        try:
            async with writer_out:
                async for item in writer_out:
                    message = item.message
                    if isinstance(message, types.JSONRPCRequest):
                        waiting[str(message.id)] = message.id
                    elif (
                        isinstance(message, types.JSONRPCNotification)
                        and message.method == "notifications/cancelled"
                        and isinstance(message.params, dict)
                    ):
                        waiting.pop(str(message.params.get("requestId")), None)
                    data = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            # The server may still run: the session sees the connection end rather
            # than a request waiting for ever.
            await reader_in.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(_FLUSH_S):
            await writer_done.wait()
        await _stop(process, started)
        for stream in (read_stream, write_stream, reader_in, writer_out):
            await stream.aclose()
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        tg.start_soon(write)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):  # every wait in it is bounded
                await shutdown()
            tg.cancel_scope.cancel()


async def _stop(process: anyio.abc.Process, started: int | None) -> None:
    """Close the server's stdin, give it :data:`EXIT_GRACE_S` to exit, then end its whole
    process group (SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`): its children too,
    whether it exited by itself or not. ``started``: the server's start time
    (:func:`_start_time`)."""
    if process.stdin is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()
    await _exited(process, EXIT_GRACE_S)
    await _end_group(process, started)
    if not await _exited(process, _REAP_S):
        log.warning("MCP server process still alive after SIGKILL", pid=process.pid)
    if process.stdout is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdout.aclose()
    # The subprocess transport, which stays open (and warns when collected) otherwise.
    transport = getattr(getattr(process, "_process", None), "_transport", None)
    close = getattr(transport, "close", None)
    if callable(close):
        with contextlib.suppress(PermissionError):
            close()


async def _end_group(process: anyio.abc.Process, started: int | None) -> None:
    """SIGTERM to the server's process group (its id is the server's: a session of its
    own), SIGKILL to what still runs of it after :data:`KILL_GRACE_S`, and wait (at most
    :data:`_REAP_S`) until none of it runs. Neither is sent once the server's number
    leads another group (see :func:`_group_is_servers`)."""
    pgid = process.pid  # not getpgid(): it fails once the server is reaped, its group not
    if not _group_is_servers(pgid, started):
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return  # none of it is left
    except PermissionError:
        pass  # some of it is not ours to signal: SIGKILL reaches what is
    if await _group_ended(process, KILL_GRACE_S) or not _group_is_servers(pgid, started):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if not await _group_ended(process, _REAP_S):
        log.warning("MCP server's process group still runs after SIGKILL", pgid=pgid)


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``); None where
    ``/proc`` does not tell, or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _group_is_servers(pgid: int, started: int | None) -> bool:
    """Whether group ``pgid`` may be the server's (``started``: its start time), not one
    led by a later process given the server's number once the server exited and was
    reaped and the last of its group was gone: the number is not given again while a
    process of the group runs, so a group under it is the server's unless a process
    holds the number with another start time. True where that cannot be told."""
    if started is None:
        return True
    now = _start_time(pgid)
    return now is None or now == started


async def _group_ended(process: anyio.abc.Process, timeout: float) -> bool:
    """Whether no process of the server's group runs, within ``timeout``."""
    with anyio.move_on_after(timeout):
        while _group_runs(process.pid):
            _ = process.returncode  # lets the loop reap the server itself
            await anyio.sleep(0.02)
        return True
    return False


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs. A member that has exited but is not yet
    reaped (by its parent, or by init for an orphan: a zombie) does not; where ``/proc``
    tells, zombies are left out, as init may take its time to reap them."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: a zombie counts as running
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] not in (b"Z", b"X"):
            return True
    return False


async def _exited(process: anyio.abc.Process, timeout: float) -> bool:
    """Whether the process exited within ``timeout`` (polled: ``wait()`` also waits for
    its pipes, which a child may hold open)."""
    with anyio.move_on_after(timeout):
        while process.returncode is None:
            await anyio.sleep(0.01)
        return True
    return False
