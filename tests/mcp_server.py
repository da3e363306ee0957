"""A small MCP server for the tests, written with the ``mcp`` SDK: ``add``, ``echo``,
``fail``, ``rpc_error``, ``slow`` and ``pid`` tools, over stdio (no arguments) or streamable
HTTP on loopback (``--http PORT``); ``echo`` also under the name in ``MCP_TEST_TOOL_NAME``,
when that is set."""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError

server = MCPServer("aalis-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@server.tool()
def fail(reason: str) -> str:
    """Always fails with the given reason."""
    raise ToolError(reason)


@server.tool()
def rpc_error(code: int, message: str) -> str:
    """Answers with a JSON-RPC error of that code and message (not a tool result)."""
    raise MCPError(code=code, message=message)


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


if os.environ.get("MCP_TEST_TOOL_NAME"):  # echo under another name too
    server.tool(name=os.environ["MCP_TEST_TOOL_NAME"])(echo)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(argv[1]))
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
