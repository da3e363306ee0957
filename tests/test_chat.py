"""``aalis-agent chat``: through a pipe, and as a person types at a terminal (a pty)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aalis_agent.cli.chat import _typed_lines, run_chat
from aalis_agent.cli.main import Terminated
from aalis_agent.events import (
    InputJoined,
    InputQueued,
    InputReceived,
    InvalidInput,
    SqliteEventStore,
    StopRequested,
    TurnRecorded,
)

from tests.harness import run_cli

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "aalis_agent.cli"]


def test_piped_lines_are_answered_in_order_and_persisted(tmp_path: Path) -> None:
    db = tmp_path / "chat.db"
    result = run_cli("chat", "--db", str(db), stdin="你好\n今天天气怎么样\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The second line may arrive while the first turn runs and join it (SCH2): then one
    # reply answers both. Either way both were received, in order.
    replies = [line for line in lines if line.startswith("（脚本模型）收到：")]
    said = " / ".join(r.removeprefix("（脚本模型）收到：") for r in replies)
    assert said == "你好 / 今天天气怎么样", lines
    assert any(line.startswith("[用量] ") for line in lines)  # a status line after each turn
    assert f"Replay: aalis-agent replay {db} --session cli:console" in lines
    with SqliteEventStore(db) as store:
        log = store.read("cli:console")
    outcomes = [e.outcome for e in log if isinstance(e, TurnRecorded)]
    assert outcomes and set(outcomes) == {"replied"}
    joined = [e.input_id for e in log if isinstance(e, InputJoined)]
    assert len(joined) == 2  # both messages entered a turn (joined or queued first)


_UNREAD: dict[int, str] = {}  # per terminal: what was read past the last needle
# At a terminal the chat edits its input line with prompt_toolkit, which redraws the
# prompt around what is printed above it: its control sequences, and the bare prompt it
# draws, are left out of what the tests read.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|>\x08|\x08")


def _read_until(fd: int, needle: str, timeout: float = 20.0) -> str:
    """The terminal's text up to and including ``needle`` (control sequences left out);
    what came after it in the same read is kept for the next call (two lines may arrive
    in one read)."""
    seen = _UNREAD.pop(fd, "")
    raw = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{needle!r} not seen in {seen!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            raw += chunk
            try:  # a character or a control sequence may be cut across two reads
                text = raw.decode()
            except UnicodeDecodeError:
                continue
            if "\x1b" in text[-8:] and not _CONTROL.search(text[text.rindex("\x1b") :]):
                continue
            seen = _CONTROL.sub("", seen + text)
            raw = b""
    if needle not in seen:  # the terminal closed first: the program has ended
        raise EOFError(f"{needle!r} not seen before the end: {seen!r}")
    end = seen.index(needle) + len(needle)
    _UNREAD[fd] = seen[end:]
    return seen[:end]


def _exec_chat(*args: str) -> None:
    """In a pty's child: run ``chat ARGS`` (the test's terminal answers no cursor
    position requests: prompt_toolkit is told not to ask)."""
    os.chdir(ROOT)
    os.environ["PROMPT_TOOLKIT_NO_CPR"] = "1"
    os.execv(sys.executable, [*CLI, "chat", *args])


def _chat_on_a_terminal(tmp_path: Path, second_reply: str) -> tuple[int, int, Path]:
    """``chat`` on a pty (pid, its terminal, its log): the first reply streams slowly
    (60 pieces, 0.1 s apart), the second is ``second_reply``."""
    script = tmp_path / "slow.toml"
    script.write_text(
        '[[replies]]\ntext = "' + "慢" * 60 + '"\nchunks = 60\nchunk_delay_s = 0.1\n\n'
        f'[[replies]]\ntext = "{second_reply}"\n',
        encoding="utf-8",
    )
    db = tmp_path / "chat.db"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, on a terminal
        _exec_chat("--db", str(db), "--script", str(script))
    _UNREAD.pop(fd, None)  # a number an earlier test's terminal had
    return pid, fd, db


def test_typing_while_a_reply_streams_then_stop(tmp_path: Path) -> None:
    pid, fd, db = _chat_on_a_terminal(tmp_path, "好的")
    try:
        _read_until(fd, "/quit leaves.")  # the interactive greeting
        os.write(fd, "讲个长故事\n".encode())
        _read_until(fd, "> 讲个长故事  [开轮] 开了新的一轮")  # the line, and where it went
        _read_until(fd, "慢慢")  # the reply is streaming
        os.write(fd, "等一下\n".encode())  # typed mid-turn: it waits to join or queues
        _read_until(fd, "> 等一下  [")
        assert _read_until(fd, "]") in ("待插入]", "排队]")
        os.write(fd, b"/stop\n")
        _read_until(fd, "[aborted")
        _read_until(fd, "[用量] 无\r\n")  # the stopped turn's own usage: none
        _read_until(fd, "好的")  # the typed line ran next
        os.write(fd, b"/quit\n")
        _read_until(fd, "Replay:")
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # a failed step must not leave the test waiting
        raise
    finally:
        os.waitpid(pid, 0)
        os.close(fd)
    with SqliteEventStore(db) as store:
        log = store.read("cli:console")
    assert [e.by for e in log if isinstance(e, StopRequested)] == [None]  # the owner's own session
    assert [e.outcome for e in log if isinstance(e, TurnRecorded)] == ["aborted", "replied"]
    waited = [e.input_id for e in log if isinstance(e, InputQueued)]
    assert waited  # the mid-turn line was held for the next turn


def test_ctrl_c_stops_a_streaming_reply_and_leaves_when_idle(tmp_path: Path) -> None:
    pid, fd, db = _chat_on_a_terminal(tmp_path, "我在这儿")
    try:
        _read_until(fd, "/quit leaves.")
        os.write(fd, "讲个长故事\n".encode())
        _read_until(fd, "慢慢")
        os.write(fd, b"\x03")  # Ctrl-C mid-reply: the turn stops, the chat goes on
        _read_until(fd, "[aborted")
        os.write(fd, "还在吗\n".encode())
        _read_until(fd, "我在这儿\r\n[用量]")  # the reply, then its status: the turn ended
        os.write(fd, b"\x03")  # Ctrl-C with nothing running: leave
        _read_until(fd, "Replay:")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    except BaseException:
        if pid:
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        if pid:
            os.waitpid(pid, 0)
        os.close(fd)
    with SqliteEventStore(db) as store:
        log = store.read("cli:console")
    assert [e.by for e in log if isinstance(e, StopRequested)] == [None]
    assert [e.outcome for e in log if isinstance(e, TurnRecorded)] == ["aborted", "replied"]


def test_sigterm_at_a_terminal_while_a_reply_streams_stops_it_and_leaves(tmp_path: Path) -> None:
    """A SIGTERM at a terminal while a turn runs stops the turn and leaves with status
    143, as it does through a pipe: it is not taken for a Ctrl-C at the prompt (which
    only stops the turn, the chat going on)."""
    pid, fd, db = _chat_on_a_terminal(tmp_path, "不该有")
    try:
        _read_until(fd, "/quit leaves.")
        os.write(fd, "讲个长故事\n".encode())
        _read_until(fd, "慢慢")
        os.kill(pid, signal.SIGTERM)
        _read_until(fd, "Replay:")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 143
    except BaseException:
        if pid:
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        if pid:
            os.waitpid(pid, 0)
        os.close(fd)
    with SqliteEventStore(db, read_only=True) as store:
        log = store.read("cli:console")
    assert [(e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)] == [
        ("aborted", "stop")
    ]


def test_typed_lines_let_a_sigterm_through_while_a_turn_runs() -> None:
    """At the prompt a Ctrl-C with a turn running stops it and prompts again; a SIGTERM
    (``Terminated``) leaves, whatever runs."""

    class Prompt:
        def __init__(self, raised: BaseException) -> None:
            self.raised: BaseException | None = raised

        def prompt(self, text: str) -> str:
            if self.raised is not None:
                raised, self.raised = self.raised, None
                raise raised
            return "下一行"

    stops: list[bool] = []

    def on_ctrl_c() -> bool:
        stops.append(True)
        return True  # a turn runs: stopped

    lines = _typed_lines(Prompt(KeyboardInterrupt()), on_ctrl_c)
    assert next(lines) == (1, "下一行")  # Ctrl-C: stopped, prompted again
    assert stops == [True]
    with pytest.raises(Terminated):
        next(_typed_lines(Prompt(Terminated()), on_ctrl_c))
    assert stops == [True]  # the SIGTERM's own handler stopped the turn


def test_the_usage_line_after_a_stop_is_that_turns_own(tmp_path: Path) -> None:
    """A turn that replied shows its numbers; the next one, stopped before its answer,
    shows none (not the previous turn's again)."""
    script = tmp_path / "script.toml"
    script.write_text(
        '[[replies]]\ntext = "快"\n\n'
        '[[replies]]\ntext = "' + "慢" * 60 + '"\nchunks = 60\nchunk_delay_s = 0.1\n',
        encoding="utf-8",
    )
    pid, fd = pty.fork()
    if pid == 0:
        _exec_chat("--db", str(tmp_path / "c.db"), "--script", str(script))
    _UNREAD.pop(fd, None)
    try:
        _read_until(fd, "/quit leaves.")
        os.write(fd, "一\n".encode())
        _read_until(fd, "快\r\n[用量] ")  # the first turn's own numbers
        os.write(fd, "二\n".encode())
        _read_until(fd, "慢慢")
        os.write(fd, b"/stop\n")
        _read_until(fd, "[aborted（stop）]\r\n")
        assert _read_until(fd, "\r\n").endswith("[用量] 无\r\n")
        os.write(fd, b"/quit\n")
        _read_until(fd, "Replay:")
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.waitpid(pid, 0)
        os.close(fd)


def test_a_config_file_gives_models_settings_and_listings(tmp_path: Path) -> None:
    """``--config``: the file's provider answers, its preference picks the model, its
    platform layer shows in /session, /model lists and marks the model in use."""
    config = tmp_path / "aalis.toml"
    config.write_text(
        """
[pluginServicePreferences.agent]
llm = "local/big"
[providers.local]
type = "scripted"
reply = "本地模型答复。"
[[providers.local.models]]
id = "small"
[[providers.local.models]]
id = "big"
contextLength = 20000
[settings.platform.cli]
historyLimit = 6
""",
        encoding="utf-8",
    )
    db = tmp_path / "chat.db"
    result = run_cli(
        "chat", "--db", str(db), "--config", str(config), stdin="/model\n/session\n你好\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "local/big  big · 上下文 20000  ← 此刻在用" in lines
    assert "local/small  small · 上下文 128000" in lines
    assert "模型（llm）：跟随服务偏好（此刻：big）" in lines
    assert "历史条数上限（historyLimit）：6 · 平台档" in lines
    assert "本地模型答复。" in lines
    assert any(line.startswith("[用量] ") and "/20000 " in line for line in lines)


def test_a_bad_config_file_is_refused_with_its_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[agent]\nhistoryLimit = 'many'\n", encoding="utf-8")
    result = run_cli(
        "chat", "--db", str(tmp_path / "c.db"), "--config", str(config), stdin="你好\n"
    )
    assert result.returncode == 2
    assert result.stderr == (
        f'aalis-agent chat: error: {config}: agent.historyLimit must be an integer, got "many"\n'
    )
    assert not (tmp_path / "c.db").exists()  # nothing was started


def test_an_unknown_command_is_answered_not_sent_or_dropped(tmp_path: Path) -> None:
    result = run_cli("chat", "--db", str(tmp_path / "c.db"), stdin="/models\n/help\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "没有这个命令：/models（/help 看有哪些）" in lines
    assert any(line.startswith("/session.set <键> <值>") for line in lines)  # /help
    with SqliteEventStore(tmp_path / "c.db") as store:
        assert store.sessions() == []  # nothing reached the model


def _pipe_bytes(db: Path, data: bytes, **env: str) -> subprocess.CompletedProcess[bytes]:
    """``chat`` with ``data`` piped in as raw bytes (``run_cli`` takes text)."""
    return subprocess.run(
        [*CLI, "chat", "--db", str(db)],
        input=data,
        capture_output=True,
        timeout=60,
        cwd=ROOT,
        check=False,
        env={"PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.parametrize(
    "env",
    [{"LC_ALL": "C.UTF-8"}, {"LC_ALL": "C"}, {"PYTHONIOENCODING": "utf-8:strict"}],
    ids=["C.UTF-8", "C", "strict"],
)
def test_a_line_that_is_not_utf8_is_reported_and_skipped(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Invalid UTF-8 on the pipe (a stray byte, a truncated sequence, an encoded lone
    surrogate) is reported with its line number and skipped; the other lines go on.
    Whatever Python's own stdin would do with those bytes: turn them into lone surrogates
    (the C locale, UTF-8 mode) or stop with a UnicodeDecodeError (strict)."""
    db = tmp_path / "chat.db"
    data = b"".join(
        [
            "你好\n".encode(),
            b"caf\xe9 latin-1\n",  # line 2: not UTF-8
            b"\n",
            b"\xed\xa0\x80 a surrogate, encoded\n",  # line 4
            b"/session\n",
            "再见\r\n".encode(),  # a CRLF line end is a line end
            b"truncated \xe4\xbd",  # line 7, the last, without a newline
        ]
    )
    result = _pipe_bytes(db, data, **env)
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 1, stderr  # lines were not sent
    assert stderr.splitlines() == [
        "chat: line 2 is not valid UTF-8; skipped",
        "chat: line 4 is not valid UTF-8; skipped",
        "chat: line 7 is not valid UTF-8; skipped",
    ]
    lines = result.stdout.decode("utf-8").splitlines()
    assert any(line.startswith("历史条数上限（historyLimit）") for line in lines)  # /session ran
    replies = [line for line in lines if line.startswith("（脚本模型）收到：")]
    assert " / ".join(r.removeprefix("（脚本模型）收到：") for r in replies) == "你好 / 再见"
    with SqliteEventStore(db) as store:
        log = store.read("cli:console")
    assert [e.input.content for e in log if isinstance(e, InputReceived)] == ["你好", "再见"]


def test_a_text_stream_with_a_lone_surrogate_never_reaches_the_runtime(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run_chat`` given a text stream (no byte buffer): a line holding a lone surrogate
    is reported on stderr and skipped like an undecodable one."""
    db = tmp_path / "chat.db"
    out = io.StringIO()
    stdin = io.StringIO("坏\ud800行\n好行\n")
    assert run_chat(str(db), "cli:console", stdin=stdin, out=out, tools=False) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("chat:")] == [
        "chat: line 1 is not valid UTF-8; skipped"
    ], err
    assert "（脚本模型）收到：好行" in out.getvalue().splitlines()
    with SqliteEventStore(db) as store:
        log = store.read("cli:console")
    assert [e.input.content for e in log if isinstance(e, InputReceived)] == ["好行"]


def test_the_replay_hint_is_a_command_a_shell_reads_back(tmp_path: Path) -> None:
    # A path with a space and a session id a shell would split: the hint quotes them.
    import shlex

    db = tmp_path / "my chats" / "chat.db"
    db.parent.mkdir()
    out = io.StringIO()
    session = "qq:group 1\nsecond line"
    assert run_chat(str(db), session, stdin=io.StringIO("你好\n"), out=out, tools=False) == 0
    hint = out.getvalue().split("Replay: ", 1)[1].rstrip("\n")
    assert shlex.split(hint) == ["aalis-agent", "replay", str(db), "--session", session]


def test_sync_full_makes_the_chats_commits_survive_a_power_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chat --sync full``: the store's connection runs ``synchronous=FULL`` (2), the
    default ``NORMAL`` (1); a PostgreSQL URL refuses the option, and a bad value is a
    usage error."""
    from aalis_agent.cli import chat as chat_module
    from aalis_agent.events.errors import StoreError
    from aalis_agent.events.open import open_store

    seen: list[int] = []

    def recording(target: str, **kwargs: object) -> object:
        store = open_store(target, **kwargs)  # type: ignore[arg-type]
        seen.append(store._conn.execute("PRAGMA synchronous").fetchone()[0])  # type: ignore[union-attr]
        return store

    monkeypatch.setattr(chat_module, "open_store", recording)
    for sync in (None, "full"):
        out = io.StringIO()
        db = tmp_path / f"chat-{sync}.db"
        assert (
            run_chat(str(db), "s", stdin=io.StringIO("你好\n"), out=out, tools=False, sync=sync)
            == 0
        )
    assert seen == [1, 2]
    with pytest.raises(StoreError, match="sync applies to a SQLite file"):
        open_store("postgresql://127.0.0.1:9/x", sync="full")
    done = run_cli("chat", "--db", str(tmp_path / "cli.db"), "--sync", "full", stdin="你好\n")
    assert done.returncode == 0 and "收到：你好" in done.stdout, done.stderr
    done = run_cli("chat", "--db", str(tmp_path / "cli.db"), "--sync", "fast", stdin="你好\n")
    assert done.returncode == 2 and "invalid choice: 'fast'" in done.stderr


def test_a_line_the_runtime_refuses_is_reported_and_the_chat_goes_on(tmp_path: Path) -> None:
    """A piped line past the runtime's input limit (16 MiB) is not sent: its reason on
    stderr, the lines after it answered, the status 1; nothing of it is in the log."""
    db = tmp_path / "chat.db"
    huge = "长" * (6 * 2**20)  # 18 MiB of UTF-8
    stdin = io.BytesIO(f"你好\n{huge}\n再见\n".encode())
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(str(db), "s", stdin=stdin, out=out, err=err, tools=False) == 1
    assert "chat: line not sent: input: its text is 18,874,368 bytes (UTF-8)" in err.getvalue()
    replies = [x for x in out.getvalue().splitlines() if x.startswith("（脚本模型）收到：")]
    assert " / ".join(r.removeprefix("（脚本模型）收到：") for r in replies) == "你好 / 再见"
    with SqliteEventStore(db) as store:
        received = [e.input.content for e in store.read("s") if isinstance(e, InputReceived)]
    assert received == ["你好", "再见"]


@pytest.mark.parametrize(
    ("session", "problem"),
    [("", "session id must not be empty"), ("\udcff", "is not valid Unicode")],
)
def test_a_session_id_no_log_can_hold_is_refused_before_any_line(
    tmp_path: Path, session: str, problem: str
) -> None:
    """``--session ''`` was taken, then every line was refused with the same error (one
    per line, the chat read to its end) and a replay hint for a session that cannot be."""
    db = tmp_path / "chat.db"
    err = io.StringIO()
    with pytest.raises(InvalidInput, match=problem):
        run_chat(str(db), session, stdin=io.BytesIO(b"hi\nthere\n"), out=io.StringIO(), err=err)
    assert err.getvalue() == ""
    assert not db.exists()  # refused before the database is opened
    result = run_cli("chat", "--db", str(db), "--session", "", stdin="hi\nthere\n")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "aalis-agent chat: error: session id must not be empty\n"


def test_an_empty_db_is_refused_not_kept_in_a_temporary_file() -> None:
    """``--db ''`` is SQLite's temporary database, deleted when closed: the chat ran,
    answered, and pointed at ``aalis-agent replay ''``, with nothing kept."""
    result = run_cli("chat", "--db", "", stdin="你好\n")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "aalis-agent chat: error: --db must name a database file (or a postgresql:// URL)\n"
    )


def test_a_restarted_chat_finishes_what_a_killed_one_left_and_only_its_own(
    tmp_path: Path,
) -> None:
    """A chat SIGKILLed while a reply streams, with two more lines received, leaves the
    turn without its record and the lines unanswered; the next chat on that database
    records the cut turn and answers them at its start (no line typed: stdin is empty),
    printing the reply. Another session's unfinished work in the same file is left."""
    from aalis_agent.events import Batch, Input, ModelCallStarted, TurnOpened

    db = tmp_path / "q.db"
    script = tmp_path / "slow.toml"
    script.write_text(
        '[[replies]]\ntext = "' + "慢" * 20 + '"\nchunks = 20\nchunk_delay_s = 0.2\n',
        encoding="utf-8",
    )
    with SqliteEventStore(db) as store:  # another chat's session, cut mid-turn
        cut = Batch("room", 0, now_ms=1_000)
        cut.add(InputReceived(input=Input(id="r", content="theirs", timestamp=1_000)))
        cut.add(TurnOpened(turn_id="turn-r", input_ids=("r",)))
        cut.add(InputJoined(input_id="r", turn_id="turn-r", entry="opened"))
        cut.add(ModelCallStarted(turn_id="turn-r", index=1))
        store.append("room", cut.events, 0)
    chat = subprocess.Popen(
        [*CLI, "chat", "--db", str(db), "--script", str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        assert chat.stdin is not None
        chat.stdin.write(b"a\nb\nc\n")
        chat.stdin.flush()  # and kept open: the chat waits for more
        deadline = time.monotonic() + 30
        while True:  # until the three lines are in the log and the reply streams
            assert time.monotonic() < deadline, "the chat did not take the three lines"
            with SqliteEventStore(db, read_only=True) as store:
                log = store.read("cli:console")
            received = [e for e in log if isinstance(e, InputReceived)]
            if len(received) == 3 and any(isinstance(e, ModelCallStarted) for e in log):
                break
            time.sleep(0.05)
    finally:
        chat.kill()  # SIGKILL: mid-reply (20 pieces, 0.2 s apart)
        chat.wait(10)
        chat.stdin.close()
    with SqliteEventStore(db, read_only=True) as store:
        assert [e for e in store.read("cli:console") if isinstance(e, TurnRecorded)] == []
    result = run_cli("chat", "--db", str(db))
    assert result.returncode == 0, result.stderr
    with SqliteEventStore(db, read_only=True) as store:
        log = store.read("cli:console")
        theirs = store.read("room")
    records = [(e.outcome, e.reason) for e in log if isinstance(e, TurnRecorded)]
    assert records[0] == ("aborted", "crash")
    assert records[1:] and {r for r in records[1:]} == {("replied", None)}
    opened = [e.input_ids for e in log if isinstance(e, TurnOpened)]
    ids = {e.input.content: e.input.id for e in log if isinstance(e, InputReceived)}
    assert opened[0] == (ids["a"],) and ids["b"] in opened[1]  # each input in one turn
    joined = [e.input_id for e in log if isinstance(e, InputJoined)]
    assert sorted(joined) == sorted(ids.values())
    # The echoing model says the user's words since its last answer: a's was cut.
    assert "（脚本模型）收到：a / b / c" in result.stdout.splitlines(), result.stdout
    assert "[恢复] " in result.stdout
    assert len(theirs) == 4  # the other session's cut turn: not recorded, not run here
