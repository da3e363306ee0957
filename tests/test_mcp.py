"""MCP tool servers through the SDK: a real small server (tests/mcp_server.py) over stdio
and over streamable HTTP on loopback; its tools listed, called, stopped, and called from a
turn through the runtime."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
from aalis_agent.events.errors import Aborted, ConfigError, ToolError
from aalis_agent.services import (
    AbortSignal,
    ScriptedModel,
    ScriptedReply,
    Services,
    ToolCallContext,
    ToolRegistry,
)
from aalis_agent.services import mcp as mcp_module
from aalis_agent.services.config_file import parse_config
from aalis_agent.services.mcp import DEFAULT_MAX_LINE_BYTES, McpClient, McpError, McpServer
from aalis_agent.services.typed_tools import run_awaitable

pytest.importorskip("mcp")

SERVER = str(Path(__file__).with_name("mcp_server.py"))


def stdio_server(name: str = "calc", **kw: object) -> McpServer:
    return McpServer(name, command=sys.executable, args=(SERVER,), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stdio_client() -> Iterator[McpClient]:
    client = McpClient([stdio_server(group="math", timeout_s=5)])
    client.start()
    yield client
    client.close()


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert proc.poll() is None, "the test MCP server exited"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


def context(abort: AbortSignal | None = None) -> ToolCallContext:
    return ToolCallContext(session_id="s", turn_id="t", call_id="c", abort=abort or AbortSignal())


def test_stdio_tools_are_listed_with_their_schemas(stdio_client: McpClient) -> None:
    listed = {t.name: t for t in stdio_client.listed()}
    assert {"add", "echo", "fail", "slow"} <= set(listed)
    assert listed["add"].description.startswith("Add two integers.")
    schema = listed["add"].input_schema
    assert schema["type"] == "object" and sorted(schema["required"]) == ["a", "b"]
    registry = ToolRegistry()
    stdio_client.register(registry)
    add = registry.get("add")
    assert add is not None and add.groups == ("math",)
    assert add.definition()["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert registry.available(()) == []  # grouped: only when the group is enabled
    assert {t.name for t in registry.available(("math",))} == set(listed)


def test_stdio_calls(stdio_client: McpClient) -> None:
    tools = {t.name: t for t in stdio_client.tools()}
    assert tools["add"].handler({"a": 2, "b": 40}, context()) == "42"
    assert tools["echo"].handler({"text": "你好"}, context()) == "你好"
    with pytest.raises(ToolError, match="no good"):
        tools["fail"].handler({"reason": "no good"}, context())
    with pytest.raises(ToolError, match="a"):
        tools["add"].handler({"a": "x", "b": 1}, context())


def test_a_call_is_cancelled_on_abort(stdio_client: McpClient) -> None:
    abort = AbortSignal()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            stdio_client.call("calc", "slow", {"seconds": 30}, ctx=context(abort))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.3)
    abort.abort("stop")
    worker.join(5)
    assert not worker.is_alive() and isinstance(outcome[0], Aborted)
    # The connection still serves.
    assert stdio_client.call("calc", "add", {"a": 1, "b": 1}) == "2"


def test_an_error_reply_with_the_codes_the_sdk_uses_for_its_own_ends_is_the_servers_answer(
    stdio_client: McpClient,
) -> None:
    """A JSON-RPC error the server sends under -32000 (which the SDK also uses for a
    connection it found closed) or -32001 (its read timeout) is the server's answer: the
    call fails with its message at once; the server is not stopped and started again, nor
    the call said to have timed out."""
    pid = stdio_client.call("calc", "pid", {})
    reconnects = stdio_client.reconnects
    for code, message in ((-32000, "quota used up"), (-32001, "upstream was slow")):
        with pytest.raises(
            ToolError, match=rf"^MCP server 'calc': tool 'rpc_error' failed: MCPError: {message}$"
        ):
            stdio_client.call("calc", "rpc_error", {"code": code, "message": message})
    assert stdio_client.call("calc", "pid", {}) == pid  # the same process, still connected
    assert stdio_client.reconnects == reconnects


def test_a_call_times_out(stdio_client: McpClient) -> None:
    with pytest.raises(ToolError, match=r"^MCP server 'calc': tool 'slow' timed out after 0.3 s$"):
        stdio_client.call("calc", "slow", {"seconds": 30}, timeout_s=0.3)
    assert stdio_client.call("calc", "echo", {"text": "still here"}) == "still here"


def test_streamable_http(http_url: str) -> None:
    with McpClient([McpServer("web", url=http_url, prefix="web_")]) as client:
        registry = ToolRegistry()
        client.register(registry)
        add = registry.get("web_add")
        assert add is not None and add.groups == ("web",)
        assert add.handler({"a": 5, "b": 6}, context()) == "11"
        assert client.call("web", "echo", {"text": "hi"}) == "hi"


def test_a_server_that_fails_to_start_is_named() -> None:
    crash = McpServer(
        "broken",
        command=sys.executable,
        args=("-c", "import sys; print('cannot start: no token', file=sys.stderr); sys.exit(3)"),
    )
    with pytest.raises(McpError, match=r"MCP server 'broken' .*failed to start") as info:
        McpClient([crash]).start()
    assert "cannot start: no token" in str(info.value)
    with pytest.raises(McpError, match=r"MCP server 'missing'.*No such file"):
        McpClient([McpServer("missing", command="/nonexistent/mcp-server")]).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with pytest.raises(McpError, match="MCP server 'down'"):
        McpClient([McpServer("down", url=f"http://127.0.0.1:{port}/mcp")]).start()


def test_a_server_flooding_its_stderr_on_one_line_is_named_with_its_last_lines_cut_short() -> None:
    """20 MB on stderr with no line break, then the reason it stops: the error names the
    server with its stderr's last lines, each cut to a length a message can hold (the
    lines kept for it were as long as the server wrote them)."""
    flood = McpServer(
        "flood",
        command=sys.executable,
        args=(
            "-c",
            "import sys; sys.stderr.write('y' * 20_000_000 + '\\nfatal: no token\\n'); sys.exit(3)",
        ),
    )
    with pytest.raises(McpError, match=r"MCP server 'flood' .*failed to start") as info:
        McpClient([flood]).start()
    message = str(info.value)
    assert message.endswith("\nfatal: no token") and "yyyy" in message
    assert len(message) < 10_000


def test_two_servers_offering_one_tool_name_is_an_error_naming_the_key_to_set() -> None:
    with (
        McpClient([stdio_server("one"), stdio_server("two")]) as client,
        pytest.raises(
            McpError,
            match=r"^MCP server 'two': its tool 'add' is registered already .*give the server a "
            r"prefix \(toolPrefix in the configuration file\)$",
        ),
    ):
        client.register(ToolRegistry())


def _slow_to_start_again(name: str, marker: Path, sleep_s: float, timeout_s: float) -> McpServer:
    """The test server, which sleeps ``sleep_s`` before it starts once ``marker`` exists
    (so its first start is quick, and a start again slow)."""
    script = (
        "import os, sys, time\n"
        f"if os.path.exists({str(marker)!r}):\n"
        f"    time.sleep({sleep_s!r})\n"
        f"sys.argv = [{SERVER!r}]\n"
        f"exec(compile(open({SERVER!r}).read(), {SERVER!r}, 'exec'))\n"
    )
    return McpServer(
        name, command=sys.executable, args=("-c", script), timeout_s=timeout_s, startup_timeout_s=30
    )


def _background_calls(
    client: McpClient, n: int
) -> tuple[list[threading.Thread], list[BaseException]]:
    """``n`` threads each calling ``calc``'s ``add`` once, started; and what they raise."""
    failed: list[BaseException] = []

    def call() -> None:
        try:
            client.call("calc", "add", {"a": 1, "b": 1})
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads, failed


def _kill(client: McpClient, server: str) -> int:
    pid = int(client.call(server, "pid", {}))
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # gone for sure (the SDK may have reaped it first)
    return pid


def test_a_server_killed_mid_session_is_started_again_at_its_next_call() -> None:
    """The call that finds the connection dead fails (it may have reached the server, so
    it is not sent again); the next one starts the server anew and is answered."""
    with McpClient([stdio_server(timeout_s=5)]) as client:
        first = _kill(client, "calc")
        with pytest.raises(
            ToolError, match=r"^MCP server 'calc': tool 'add' failed: its connection ended"
        ):
            client.call("calc", "add", {"a": 1, "b": 2})
        assert client.call("calc", "add", {"a": 1, "b": 2}) == "3"
        assert int(client.call("calc", "pid", {})) != first
        assert client.reconnects == 1
        assert [t.name for t in client.tools()].count("add") == 1  # still offered once


def test_a_server_that_does_not_start_again_fails_fast_until_the_gap_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "server.py"
    script.write_bytes(Path(SERVER).read_bytes())
    spec = McpServer("calc", command=sys.executable, args=(str(script),), timeout_s=5)
    with McpClient([spec]) as client:
        _kill(client, "calc")
        script.unlink()  # it cannot start again now
        with pytest.raises(ToolError, match="its connection ended"):
            client.call("calc", "add", {"a": 1, "b": 2})
        with pytest.raises(ToolError, match="starting it again failed: MCP server 'calc'"):
            client.call("calc", "add", {"a": 1, "b": 2})
        # Within the gap: refused at once, naming the failure, no process started.
        t0 = time.monotonic()
        with pytest.raises(ToolError, match=r"starting it again failed [\d.]+ s ago"):
            client.call("calc", "add", {"a": 1, "b": 2})
        assert time.monotonic() - t0 < 1.0
        assert "add" in [t.name for t in client.tools()]  # its tools are still offered
        # Past the gap, with the server back: the next call starts it.
        script.write_bytes(Path(SERVER).read_bytes())
        monkeypatch.setattr(mcp_module, "RECONNECT_GAP_S", 0.0)
        assert client.call("calc", "add", {"a": 2, "b": 2}) == "4"
        assert client.reconnects == 1


def test_a_server_that_dies_again_soon_is_not_started_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most one start a server in RECONNECT_GAP_S: killed again right after it was
    started again, its calls fail at once, naming that, until the gap has passed."""
    with McpClient([stdio_server(timeout_s=5)]) as client:
        for _ in range(2):
            _kill(client, "calc")
            with pytest.raises(ToolError, match="its connection ended"):
                client.call("calc", "add", {"a": 1, "b": 1})
            if client.reconnects == 0:
                assert client.call("calc", "add", {"a": 1, "b": 1}) == "2"
        with pytest.raises(
            ToolError, match=r"its start again began [\d.]+ s ago, and it has ended again"
        ):
            client.call("calc", "add", {"a": 1, "b": 1})
        assert client.reconnects == 1
        monkeypatch.setattr(mcp_module, "RECONNECT_GAP_S", 0.0)
        assert client.call("calc", "add", {"a": 2, "b": 1}) == "3"
        assert client.reconnects == 2


def test_a_stop_ends_the_wait_for_a_server_starting_again_and_others_are_not_held_up(
    tmp_path: Path,
) -> None:
    """A server that hangs when started again (here: once a marker file exists): a call
    waiting for it ends with Aborted at the stop, and meanwhile another server's calls
    (it too started again) are answered; closing does not wait for the hung start."""
    marker = tmp_path / "hang"
    # Its calls' timeout well past the stop below, however slow the machine: the stop,
    # not the timeout, must end the wait.
    slow = _slow_to_start_again("slow", marker, 60, timeout_s=30)
    client = McpClient([slow, stdio_server("calc", timeout_s=2)])
    client.start()
    try:
        marker.write_text("", encoding="utf-8")
        for name in ("slow", "calc"):
            _kill(client, name)
            with pytest.raises(ToolError, match="its connection ended"):
                client.call(name, "add", {"a": 1, "b": 1})
        abort = AbortSignal()
        failed: list[BaseException] = []

        def wait_for_slow() -> None:
            try:
                client.call("slow", "add", {"a": 1, "b": 1}, ctx=context(abort))
            except BaseException as exc:
                failed.append(exc)

        waiting = threading.Thread(target=wait_for_slow, daemon=True)
        waiting.start()
        time.sleep(0.5)  # the slow server is being started again, and hangs
        t0 = time.monotonic()
        assert client.call("calc", "add", {"a": 2, "b": 2}) == "4"
        assert time.monotonic() - t0 < 10  # its own start only, not the hung one's
        abort.abort("stop")
        waiting.join(5)
        assert not waiting.is_alive() and len(failed) == 1 and isinstance(failed[0], Aborted)
    finally:
        t0 = time.monotonic()
        client.close()
        assert time.monotonic() - t0 < 10
    # The hung start's process was ended, not left behind.
    assert not _processes_naming(str(marker))


def test_a_call_waits_for_a_server_starting_again_at_most_its_own_timeout(
    tmp_path: Path,
) -> None:
    """A server slower to start again (3 s) than its calls' timeout (1 s): the call that
    finds it starting gives up at its own timeout, naming why, and the start goes on, so
    a later call finds the server started (a start cut at each call's timeout would never
    finish). Calls waiting meanwhile share the one start."""
    marker = tmp_path / "slow-start"
    spec = _slow_to_start_again("calc", marker, 3, timeout_s=1)
    with McpClient([spec]) as client:
        marker.write_text("", encoding="utf-8")
        first = _kill(client, "calc")
        with pytest.raises(ToolError, match="its connection ended"):
            client.call("calc", "add", {"a": 1, "b": 1})
        t0 = time.monotonic()
        others, failed = _background_calls(client, 2)
        with pytest.raises(
            ToolError,
            match=r"^MCP server 'calc': tool 'add' timed out after 1 s: the server is still "
            r"starting again",
        ):
            client.call("calc", "add", {"a": 1, "b": 1})
        assert time.monotonic() - t0 < 2.5  # its own timeout, not the start's 3 s
        for t in others:
            t.join(5)
        assert len(failed) == 2 and all("still starting again" in str(e) for e in failed)
        deadline = time.monotonic() + 20
        while client.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.reconnects == 1  # one start, not one a call
        assert client.call("calc", "add", {"a": 2, "b": 2}) == "4"
        assert int(client.call("calc", "pid", {})) != first


def test_close_during_a_start_again_tells_the_waiting_call_so(tmp_path: Path) -> None:
    marker = tmp_path / "slow-start"
    client = McpClient([_slow_to_start_again("calc", marker, 3, timeout_s=20)])
    client.start()
    marker.write_text("", encoding="utf-8")
    _kill(client, "calc")
    with pytest.raises(ToolError, match="its connection ended"):
        client.call("calc", "add", {"a": 1, "b": 1})
    (waiting,), failed = _background_calls(client, 1)
    time.sleep(0.5)  # the server is starting again (3 s)
    client.close()
    waiting.join(10)
    assert not waiting.is_alive() and len(failed) == 1
    assert str(failed[0]) == "MCP server 'calc' is not connected (the client is closed)"
    assert not _processes_naming(str(marker))


def test_a_call_under_way_when_the_client_closes_says_so() -> None:
    """Closed while a call waits for its answer: the call fails naming the close, not a
    connection that ended and a server to be started again at its next call."""
    client = McpClient([stdio_server(timeout_s=60)])
    client.start()
    pid = int(client.call("calc", "pid", {}))
    failed: list[BaseException] = []

    def call() -> None:
        try:
            client.call("calc", "slow", {"seconds": 60})
        except BaseException as exc:
            failed.append(exc)

    waiting = threading.Thread(target=call, daemon=True)
    waiting.start()
    time.sleep(0.5)  # the call is under way
    client.close()
    waiting.join(10)
    assert not waiting.is_alive() and len(failed) == 1
    assert str(failed[0]) == "MCP server 'calc' is not connected (the client is closed)"
    assert not Path(f"/proc/{pid}").exists()


def test_no_start_begins_once_close_has_begun(tmp_path: Path) -> None:
    """A start submitted to the loop just as close() runs (after close() looked for
    starts to end) begins nothing: the loop refuses it, so no server is left behind."""
    marker = tmp_path / "started"
    script = f"open({str(marker)!r}, 'w').close()\n" + (
        f"import sys\nsys.argv = [{SERVER!r}]\n"
        f"exec(compile(open({SERVER!r}).read(), {SERVER!r}, 'exec'))\n"
    )
    spec = McpServer("late", command=sys.executable, args=("-c", script), timeout_s=5)
    client = McpClient([stdio_server("calc", timeout_s=5)])
    client.start()
    try:
        with client._lock:
            client._closed = True  # close() has begun: its flag comes first
        conn = mcp_module._Connection(spec)
        with pytest.raises(McpError, match=r"^MCP server 'late': the client is closed$"):
            run_awaitable(client._open(conn), client._loop.loop, timeout=10)
        assert conn.task is None and not marker.exists()
    finally:
        client._closed = False
        client.close()


def _processes_naming(text: str) -> list[int]:
    """The processes whose command line holds ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _http_server(port: int) -> subprocess.Popen[bytes]:
    """The test server over streamable HTTP on ``port``, once it accepts connections."""
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        assert proc.poll() is None, "the test MCP server exited"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the test MCP server did not listen")


def test_an_http_server_that_went_away_and_came_back_is_connected_again() -> None:
    """Streamable HTTP: the server process ends (its session with it) and a new one
    listens on the same port; the call that finds the session gone fails, the next one
    opens a new session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _http_server(port)
    try:
        with McpClient([McpServer("web", url=f"http://127.0.0.1:{port}/mcp", timeout_s=5)]) as c:
            assert c.call("web", "add", {"a": 1, "b": 2}) == "3"
            proc.kill()
            proc.wait(10)
            with pytest.raises(ToolError, match="its connection ended"):
                c.call("web", "add", {"a": 1, "b": 2})
            proc = _http_server(port)
            assert c.call("web", "add", {"a": 2, "b": 2}) == "4"
            assert c.reconnects == 1
    finally:
        proc.kill()
        proc.wait(10)


def test_the_config_file_declares_servers() -> None:
    fc = parse_config(
        {
            "mcp": {
                "calc": {"command": sys.executable, "args": [SERVER], "group": "math"},
                "web": {"url": "http://127.0.0.1:1/mcp", "timeoutMs": 5000},
            }
        }
    )
    calc, web = fc.mcp
    assert (calc.name, calc.command, calc.args, calc.tool_group) == (
        "calc",
        sys.executable,
        (SERVER,),
        "math",
    )
    assert (web.url, web.tool_group, web.timeout_s) == ("http://127.0.0.1:1/mcp", "web", 5.0)
    assert calc.max_line_bytes == DEFAULT_MAX_LINE_BYTES


def test_the_config_file_sets_a_servers_line_limit_within_bounds() -> None:
    calc = {"command": sys.executable, "args": [SERVER]}
    (server,) = parse_config({"mcp": {"calc": {**calc, "maxLineBytes": 1_000_000}}}).mcp
    assert server.max_line_bytes == 1_000_000
    for bad in (0, -5, 1 << 31, "16MiB", 1.5, True):
        with pytest.raises(ConfigError, match=r"mcp\.calc\.maxLineBytes"):
            parse_config({"mcp": {"calc": {**calc, "maxLineBytes": bad}}})


@pytest.fixture
def runtimes() -> Iterator[list[Runtime]]:
    made: list[Runtime] = []
    yield made
    for rt in made:
        rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


def test_a_turn_calls_an_mcp_tool(runtimes: list[Runtime]) -> None:
    fc = parse_config({"mcp": {"calc": {"command": sys.executable, "args": [SERVER]}}})
    with McpClient(fc.mcp) as client:
        registry = ToolRegistry()
        client.register(registry)
        model = ScriptedModel(
            [
                ScriptedReply(
                    tool_calls=(
                        ToolCall(id="c1", name="add", arguments='{"a": 2, "b": 3}'),
                        ToolCall(id="c2", name="fail", arguments='{"reason": "坏了"}'),
                    )
                ),
                ScriptedReply(text="是 5"),
            ]
        )
        store = InMemoryEventStore()
        runtime = Runtime(
            store,
            Services(llm=model, tools=registry),
            FixedClock(step_ms=1000),
            SequentialIds(),
            janitor=False,
        )
        runtimes.append(runtime)
        handle = runtime.submit("qq:group:1", Input(id="", content="2+3?", platform="qq"))
        handle.result(30)
        runtime.wait_idle(30)
        sent = {t["function"]["name"]: t for t in model.requests[0].tools}
        assert json.dumps(sent["add"]["function"]["parameters"])  # the server's schema
        finished = {e.call_id: e for e in store.read("qq:group:1") if isinstance(e, ToolFinished)}
        assert finished["c1"].result == "5" and finished["c1"].error is None
        assert finished["c2"].error == "ToolError: Error executing tool fail: 坏了"
        results = [m.content for m in model.requests[1].messages if m.role == "tool"]
        assert results == ["5", finished["c2"].error]


def test_chat_with_a_config_connects_its_mcp_servers(tmp_path: Path) -> None:
    """``aalis-agent chat --config`` starts the file's ``[mcp.<name>]`` servers and the
    model can call their tools (they were ignored), beside the built-in ones (which an
    MCP server's tools used to displace); one that does not start is one line naming it,
    exit 2."""
    import json

    from tests.harness import run_cli

    config = tmp_path / "agent.toml"
    config.write_text(
        f"[mcp.calc]\ncommand = {json.dumps(sys.executable)}\nargs = [{json.dumps(SERVER)}]\n",
        encoding="utf-8",
    )
    script = tmp_path / "replies.json"
    calls = [
        {"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"id": "c2", "name": "calculate", "arguments": '{"expression": "2*3"}'},
    ]
    script.write_text(json.dumps([{"tool_calls": calls}, {"text": "是 5"}]), encoding="utf-8")
    db = tmp_path / "chat.db"
    argv = ["chat", "--config", str(config), "--script", str(script), "--db", str(db)]

    done = run_cli(*argv, stdin="2+3?\n")
    assert done.returncode == 0, done.stderr
    assert "是 5" in done.stdout
    from aalis_agent.events import SqliteEventStore, ToolFinished

    with SqliteEventStore(db, read_only=True) as store:
        [session] = store.sessions()
        results = [(e.result, e.error) for e in store.read(session) if isinstance(e, ToolFinished)]
    assert results == [("5", None), ("6", None)]
    # --no-tools: the MCP server's tools only.
    db.unlink()
    done = run_cli(*argv, "--no-tools", stdin="2+3?\n")
    assert done.returncode == 0, done.stderr
    with SqliteEventStore(db, read_only=True) as store:
        [session] = store.sessions()
        finished = [e for e in store.read(session) if isinstance(e, ToolFinished)]
    assert [(e.name, e.result) for e in finished] == [("add", "5"), ("calculate", None)]
    assert finished[1].error is not None and "calculate" in finished[1].error
    config.write_text('[mcp.bad]\ncommand = "/nonexistent/mcp-server"\n', encoding="utf-8")
    done = run_cli(*argv, stdin="hi\n")
    assert done.returncode == 2
    assert done.stderr.startswith("aalis-agent chat: error: MCP server 'bad'")


def test_two_servers_offering_one_tool_name_are_a_clear_error_naming_the_second() -> None:
    with McpClient([stdio_server("one"), stdio_server("two")]) as client:
        registry = ToolRegistry()
        with pytest.raises(McpError, match="MCP server 'two': its tool 'add' is registered"):
            client.register(registry)


def test_tools_whose_names_providers_refuse_are_left_out_with_a_warning() -> None:
    from structlog.testing import capture_logs

    with McpClient([stdio_server("odd", prefix="bad name ")]) as client:
        registry = ToolRegistry()
        with capture_logs() as logs:
            assert client.register(registry) == []
    left = [e for e in logs if e["event"].startswith("MCP tool left out")]
    assert {e["tool"] for e in left} == {
        "bad name add",
        "bad name echo",
        "bad name fail",
        "bad name pid",
        "bad name rpc_error",
        "bad name slow",
    }


def test_a_tool_name_ending_in_a_newline_is_left_out() -> None:
    """The name check covers the whole name: a line break at its end (which ``$`` alone
    lets through) would make every request that offers the tool fail."""
    from structlog.testing import capture_logs

    spec = stdio_server("odd", env={"MCP_TEST_TOOL_NAME": "echo2\n"})
    with McpClient([spec]) as client:
        assert "echo2\n" in [t.name for t in client.listed()]
        with capture_logs() as logs:
            names = [t.name for t in client.register(ToolRegistry())]
    assert "echo2\n" not in names and "echo" in names
    assert [e["tool"] for e in logs if e["event"].startswith("MCP tool left out")] == ["echo2\n"]
