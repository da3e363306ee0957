"""The ``aalis-agent`` command's edges: ``--version``, ``demo | head``, a server's errors
in one line, and the ``--context-length`` / ``--max-tokens`` of a ``--base-url`` model."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.harness import LoopbackServer, run_cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PATH": "/usr/bin:/bin"}


def test_version_comes_from_the_installed_distribution() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"aalis-agent {version('aalis-agent')}\n"


def test_demo_into_head_ends_quietly_and_at_once(tmp_path: Path) -> None:
    """``aalis-agent demo | head -3``: the reader leaves, the demo ends without a
    traceback and without waiting for its tool's 10 s timeout."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aalis_agent.cli", "demo", "--db", str(tmp_path / "d.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # as head does
    try:
        status = proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert lines[0].startswith(b"Session demo:room-1")
    assert status == 0 and stderr == ""
    assert time.monotonic() - started < 8


class Server(LoopbackServer):
    """``GET /models`` answers ``listing``; each POST the next of ``posts``: ``"429"`` or
    a streamed reply ``"好"``. The posted bodies are kept."""

    def __init__(self, listing: list[dict[str, Any]] | None = None) -> None:
        self.posts: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, obj: Any, **headers: str) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if listing is None:
                    self._json(404, {"error": {"message": "no listing"}})
                else:
                    self._json(200, {"object": "list", "data": listing})

            def do_POST(self) -> None:
                outer.bodies.append(
                    json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                )
                if (outer.posts.pop(0) if outer.posts else "ok") == "429":
                    error = {"message": "Rate limit reached", "type": "rate_limit"}
                    self._json(429, {"error": error}, **{"Retry-After": "0"})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                for choice in (
                    {"delta": {"content": "好"}},
                    {"delta": {}, "finish_reason": "stop"},
                ):
                    data = {**base, "choices": [{"index": 0, **choice}]}
                    self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.serve(Handler)


@pytest.fixture
def server() -> Any:
    s = Server(
        [{"id": "other"}, {"id": "m", "max_model_len": 20_000, "max_completion_tokens": 512}]
    )
    yield s
    s.close()


def _chat(
    db: Path, url: str, *args: str, stdin: str = "你好\n"
) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "chat", "--db", str(db), "--base-url", url, "--model", "m", *args, stdin=stdin, env=ENV
    )


def test_a_429_is_one_line_and_a_non_zero_exit(server: Server, tmp_path: Path) -> None:
    server.posts += ["429"] * 4  # the first try and its three retries
    result = _chat(tmp_path / "c.db", server.url)
    assert result.returncode == 1
    assert result.stderr == (
        "aalis-agent chat: error: turn failed: RateLimitError: Error code: 429 - "
        "Rate limit reached (after 3 retries)\n"
    )
    assert "[用量] 无" in result.stdout.splitlines()


def test_a_wrong_base_url_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = _chat(tmp_path / "c.db", f"http://127.0.0.1:{port}/v1", stdin="你好\n再来\n")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()  # the same error is told once
    assert line.startswith("aalis-agent chat: error: turn failed: APIConnectionError: ")
    assert "Traceback" not in result.stdout + result.stderr


def test_context_length_and_max_tokens_as_given(server: Server, tmp_path: Path) -> None:
    result = _chat(tmp_path / "c.db", server.url, "--context-length", "9000", "--max-tokens", "77")
    assert result.returncode == 0, result.stderr
    assert any(
        line.startswith("[用量] ") and "/9000 " in line for line in result.stdout.splitlines()
    )
    assert server.bodies[0]["max_tokens"] == 77


def test_context_length_and_max_tokens_from_the_servers_listing(
    server: Server, tmp_path: Path
) -> None:
    result = _chat(
        tmp_path / "c.db", server.url, "--context-length", "auto", "--max-tokens", "auto"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert any(
        line.startswith("[用量] ") and "/20000 " in line for line in result.stdout.splitlines()
    )
    assert server.bodies[0]["max_tokens"] == 512


def test_a_listing_without_the_numbers_keeps_the_defaults(tmp_path: Path) -> None:
    bare = Server([{"id": "m"}])
    try:
        result = _chat(tmp_path / "c.db", bare.url, "--context-length", "auto")
    finally:
        bare.close()
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "aalis-agent chat: --context-length auto: the server's model listing gives none; "
        "using the default\n"
    )
    assert any("/128000 " in line for line in result.stdout.splitlines())


def test_a_listing_with_absurd_numbers_keeps_the_defaults(tmp_path: Path) -> None:
    """A context length of 10**30 in the listing used to stop the session at its first
    usage record (a count the log cannot hold): past 2**31 it is not taken."""
    absurd = Server([{"id": "m", "context_length": 10**30, "max_output_tokens": 2**40}])
    try:
        result = _chat(tmp_path / "c.db", absurd.url, "--context-length", "auto")
    finally:
        absurd.close()
    assert result.returncode == 0, result.stderr
    assert "the server's model listing gives none; using the default" in result.stderr
    assert any("/128000 " in line for line in result.stdout.splitlines())


@pytest.mark.parametrize("value", ["0", "-5", "many", "1e9"])
def test_a_bad_limit_is_refused_by_the_parser(value: str, tmp_path: Path) -> None:
    result = run_cli("chat", "--db", str(tmp_path / "c.db"), "--context-length", value)
    assert result.returncode == 2
    assert "expected a positive integer or auto" in result.stderr


def test_limits_without_a_base_url_are_refused(tmp_path: Path) -> None:
    result = run_cli("chat", "--db", str(tmp_path / "c.db"), "--max-tokens", "100")
    assert result.returncode == 2
    assert result.stderr == (
        "aalis-agent chat: error: --context-length and --max-tokens go with --base-url and "
        "--model\n"
    )


def test_a_script_with_a_base_url_is_refused(tmp_path: Path) -> None:
    """The server's model answered and the script was dropped without a word."""
    script = tmp_path / "s.toml"
    script.write_text('[[replies]]\ntext = "scripted"\n', encoding="utf-8")
    db = tmp_path / "c.db"
    result = run_cli(
        "chat", "--db", str(db), "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
        "--script", str(script), stdin="hi\n",
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "aalis-agent chat: error: --script and --base-url do not go together: the chat's "
        "model is the script's or the server's\n"
    )
    assert not db.exists()  # refused before anything was opened


def _cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "aalis_agent.cli", *args],
        capture_output=kwargs.pop("capture_output", True),
        timeout=120,
        cwd=ROOT,
        check=False,
        **kwargs,
    )


def test_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """``> /dev/full``: the write fails; one line says so (no traceback), exit 1."""
    db = tmp_path / "d.db"
    made = _cli("demo", "--db", str(db), stdout=subprocess.DEVNULL, capture_output=False)
    assert made.returncode == 0 and db.exists()
    for args in (("demo", "--db", str(tmp_path / "e.db")), ("replay", str(db))):
        with open("/dev/full", "w") as full:
            result = _cli(*args, stdout=full, stderr=subprocess.PIPE, capture_output=False)
        assert result.returncode == 1, result.stderr
        assert result.stderr.decode().splitlines() == [
            f"aalis-agent {args[0]}: error: [Errno 28] No space left on device"
        ]


def test_chat_with_its_input_closed_says_so(tmp_path: Path) -> None:
    def close_stdin() -> None:
        os.close(0)

    result = _cli("chat", "--db", str(tmp_path / "c.db"), preexec_fn=close_stdin)
    assert result.returncode == 2
    assert result.stderr.decode().strip() == (
        "aalis-agent chat: error: chat needs its standard input and output open"
    )


def test_demo_refuses_an_empty_db_and_quotes_its_replay_hint(tmp_path: Path) -> None:
    result = _cli("demo", "--db", "")
    assert result.returncode == 2 and b"--db must name a database file" in result.stderr
    db = tmp_path / "my db's.db"
    result = _cli("demo", "--db", str(db))
    assert result.returncode == 0, result.stderr
    hint = [line.strip() for line in result.stdout.decode().splitlines() if "replay" in line][-1]
    assert subprocess.run(  # the hint, as a shell reads it, names that file
        ["sh", "-c", f"printf '%s\\n' {hint.split(' ', 2)[2]}"], capture_output=True, check=True
    ).stdout.decode().splitlines()[0] == str(db)


@pytest.mark.parametrize("timeout", ["nan", "1e308", "0", "-1"])
def test_a_fork_timeout_out_of_range_is_refused(tmp_path: Path, timeout: str) -> None:
    db = tmp_path / "d.db"
    assert _cli("demo", "--db", str(db)).returncode == 0
    result = _cli(
        "replay", str(db), "--session", "demo:room-1", "--fork", "1", "--timeout", timeout
    )
    assert result.returncode == 2
    assert b"--timeout must be more than 0 and at most 86400 seconds" in result.stderr


def test_a_database_whose_name_is_not_utf8_replays(tmp_path: Path) -> None:
    db = os.fsdecode(bytes(tmp_path) + b"/\xff.db")
    assert _cli("demo", "--db", db).returncode == 0
    result = _cli("replay", db)
    assert result.returncode == 0, result.stderr
    assert b"== session demo:room-1" in result.stdout


def test_ctrl_c_in_piped_chat_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Piped lines left unsent at a Ctrl-C: the chat ends as it does at the end of its
    input (its replay hint printed), with the status of an interrupted command."""
    with subprocess.Popen(
        [sys.executable, "-m", "aalis_agent.cli", "chat", "--db", str(tmp_path / "c.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # Ctrl-C as at a terminal, whatever this process inherited (a shell's background
        # job ignores SIGINT, and so would the chat: Python then leaves it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write("你好\n")
        proc.stdin.flush()  # and left open: more lines could come
        status = ""
        while not status.startswith("[用量]"):
            status = proc.stdout.readline()
            assert status, "the chat ended before answering"
        for _ in range(20):  # the turn's end may still be settling: then it is stopped
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1)
                break
        else:
            proc.kill()  # never left hanging: the assertion below fails instead
            proc.wait(10)
        out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert "Replay: aalis-agent replay" in out


def test_sigterm_in_chat_stops_the_running_turn_and_exits_143(tmp_path: Path) -> None:
    """A service manager's SIGTERM while a reply streams: the turn is stopped (recorded
    once, aborted by the stop), the chat leaves at once with status 143 and no traceback
    (it died as at a kill: its turn was left for the next start to find cut)."""
    script = tmp_path / "slow.json"
    script.write_text(json.dumps([{"text": "好" * 60, "chunks": 60, "chunk_delay_s": 1}]))
    db = tmp_path / "c.db"
    with subprocess.Popen(
        [sys.executable, "-m", "aalis_agent.cli", "chat", "--db", str(db), "--script", str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write("你好\n")
        proc.stdin.flush()
        proc.stdout.read(1)  # the reply has begun streaming
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left hanging: the assertion below fails instead
            proc.wait(10)
        out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 143, (out, err)
    assert "Traceback" not in err
    from aalis_agent.events import SqliteEventStore, TurnRecorded

    with SqliteEventStore(db, read_only=True) as store:
        events = store.read("cli:console")
    recorded = [e for e in events if isinstance(e, TurnRecorded)]
    assert [(e.outcome, e.reason) for e in recorded] == [("aborted", "stop")]


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cli_main = importlib.import_module("aalis_agent.cli.main")  # the module, not main()

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_cmd_replay", interrupted)
    assert cli_main.main(["replay", str(tmp_path / "x.db")]) == 130
    assert capsys.readouterr().err == "\naalis-agent replay: interrupted\n"

    before = signal.getsignal(signal.SIGTERM)

    def terminated(args: Any) -> int:  # a SIGTERM, which the command's handler takes
        # (without one it would end this test run: refused first)
        assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at once on the main thread
        return 0

    monkeypatch.setattr(cli_main, "_cmd_replay", terminated)
    assert cli_main.main(["replay", str(tmp_path / "x.db")]) == 143
    assert capsys.readouterr().err == "\naalis-agent replay: terminated\n"
    assert signal.getsignal(signal.SIGTERM) is before  # given back


def test_a_database_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "dirdb"
    folder.mkdir()
    result = run_cli("chat", "--db", str(folder), stdin="你好\n")
    assert result.returncode == 2
    assert result.stderr == (
        f"aalis-agent chat: error: cannot open event database {str(folder)!r}: it is a directory\n"
    )


def test_a_database_in_a_folder_that_does_not_exist_names_the_folder(tmp_path: Path) -> None:
    """It named the lock file beside the database (``No such file or directory:
    '.../x.db.lock'``), a file the user never gave."""
    db = tmp_path / "nowhere" / "x.db"
    result = run_cli("chat", "--db", str(db), stdin="你好\n")
    assert result.returncode == 2
    assert result.stderr == (
        f"aalis-agent chat: error: cannot open event database {str(db)!r}: "
        f"its folder {str(db.parent)!r} does not exist\n"
    )
    assert not db.parent.exists()


def test_another_programs_database_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A SQLite file of another program (its own tables, none of ours) was taken as an
    empty event database: the demo wrote its tables into it and switched its journal to
    WAL."""
    import sqlite3

    other = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO users (name) VALUES ('alice')")
        conn.commit()
    before = other.read_bytes()
    for command in (("demo", "--db", str(other)), ("chat", "--db", str(other))):
        result = run_cli(*command, stdin="你好\n")
        assert result.returncode == 2, result.stdout
        assert result.stderr == (
            f"aalis-agent {command[0]}: error: {str(other)!r} is not an event database: it "
            "holds another program's tables (users)\n"
        )
    assert other.read_bytes() == before
    assert not Path(f"{other}-wal").exists()


def test_every_option_with_a_default_names_it_in_its_help() -> None:
    """``aalis-agent chat --help`` left out where the chat's log goes without ``--db``
    (aalis-chat.db, as the README says), where ``demo --help`` gave its own."""
    import argparse

    from aalis_agent.cli.main import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    checked = []
    for name, parser in commands.choices.items():
        for action in parser._actions:
            if isinstance(action.default, str) and action.default != argparse.SUPPRESS:
                assert f"(default: {action.default})" in (action.help or ""), (name, action)
                checked.append((name, action.dest))
    assert ("chat", "db") in checked and ("demo", "db") in checked
