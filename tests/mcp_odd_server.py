"""The test MCP server (tests/mcp_server.py) with tools that misbehave, over stdio: ``say``
writes a line of its own to stdout in place of its answer (``{id}`` in it becomes the
call's request id) and then waits, ``cut`` writes one with no line break and exits,
``chatter`` writes lines that are no message and
then answers, ``big`` answers with ``mb`` megabytes of text on one
line, ``spawn`` starts a child process that runs until it is killed and answers its
process id."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
from mcp.server.mcpserver import Context

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mcp_server import main, server


@server.tool()
async def say(line: str, ctx: Context) -> str:
    """Write ``line`` to stdout as it is (``{id}``: this call's request id), then wait."""
    os.write(_wire(), (line.replace("{id}", ctx.request_id) + "\n").encode())
    await anyio.sleep(3600)
    return "never"


@server.tool()
def cut(line: str, ctx: Context) -> str:
    """Write ``line`` to stdout with no line break after it (``{id}``: this call's request
    id), then exit: the server's last output, cut short or whole."""
    os.write(_wire(), line.replace("{id}", ctx.request_id).encode())
    os._exit(0)


@server.tool()
async def chatter(lines: list[str], ctx: Context) -> str:
    """Write ``lines`` to stdout as they are (stray output: no message; ``{id}``: this
    call's request id), then answer."""
    wire = _wire()
    for line in lines:
        os.write(wire, (line.replace("{id}", ctx.request_id) + "\n").encode())
    return "answered"


def _wire() -> int:
    from mcp.server.stdio import _claims  # the SDK moved the wire off fd 1: its copy

    claim = _claims.get(1)
    return claim.private_fd if claim is not None and claim.private_fd is not None else 1


@server.tool()
def big(mb: float) -> str:
    """``mb`` megabytes of text."""
    return "x" * int(mb * 1_000_000)


@server.tool()
def spawn(ignore_sigterm: bool = False) -> int:
    """Start a child process that sleeps until it is killed (ignoring SIGTERM, if asked);
    its process id, once it runs."""
    code = (
        "import signal, sys, time\n"
        f"if {ignore_sigterm!r}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, "mcp-odd-child"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert child.stdout is not None
    child.stdout.readline()  # it runs, SIGTERM handled as asked
    return child.pid


if __name__ == "__main__":
    if os.environ.get("ODD_BANNER"):  # a banner on stdout before it serves
        os.write(1, (os.environ["ODD_BANNER"] + "\n").encode())
    main(sys.argv[1:])
