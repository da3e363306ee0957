"""``aalis-agent replay DB --session S --fork SEQ``: a turn re-run from a past point into a
scratch log, beside the original; the database itself is only read."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.cli.fork import add_fork_arguments, run_fork
from aalis_agent.events import (
    ConfigError,
    FixedClock,
    Input,
    ReplayError,
    Sender,
    SequentialIds,
    SqliteEventStore,
    ToolCall,
    ToolStarted,
    TurnOpened,
    TurnRecorded,
)
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, ToolRegistry
from aalis_agent.services.builtin_tools import builtin_tools
from aalis_agent.testing.sample import write_demo_session

SESSION = "cli:console"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A live log: turn-1 a greeting, turn-2 a tool turn (calculate), through the runtime."""
    path = tmp_path / "orig.db"
    replies = [
        ScriptedReply(text="你好！有什么可以帮你？"),
        ScriptedReply(
            tool_calls=(ToolCall(id="call-1", name="calculate", arguments='{"expression": "6*7"}'),)
        ),
        ScriptedReply(text="6 乘 7 等于 42。"),
    ]
    store = SqliteEventStore(path)
    clock = FixedClock(1_767_225_600_000, step_ms=10)
    services = Services(llm=ScriptedModel(replies), tools=ToolRegistry(builtin_tools(clock.now_ms)))
    runtime = Runtime(store, services, clock=clock, ids=SequentialIds(), janitor=False)
    try:
        for text in ("你好", "算一下 6*7"):
            inp = Input(id="", content=text, sender=Sender(user_id="u1"))
            assert runtime.submit(SESSION, inp).result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    return path


def _events(path: Path, session: str = SESSION) -> list[Any]:
    with SqliteEventStore(path, read_only=True) as store:
        return store.read(session)


def _seq_of(path: Path, kind: type, turn_id: str, session: str = SESSION) -> int:
    return next(
        e.seq
        for e in _events(path, session)
        if isinstance(e, kind) and getattr(e, "turn_id", None) == turn_id
    )


def _digest(path: Path) -> tuple[str, str]:
    """The bytes of the database and of its WAL (none and empty are alike: SQLite may
    leave an empty one beside a file it opened read-only)."""
    wal = path.with_name(path.name + "-wal")
    wal_bytes = wal.read_bytes() if wal.exists() else b""
    return hashlib.sha256(path.read_bytes()).hexdigest(), hashlib.sha256(wal_bytes).hexdigest()


def _parser() -> argparse.ArgumentParser:
    """The ``replay`` options as ``cli/main.py`` declares them, plus the fork's."""
    parser = argparse.ArgumentParser(prog="aalis-agent replay")
    parser.add_argument("db")
    parser.add_argument("--session")
    parser.add_argument("--at", type=int)
    parser.add_argument("--json", action="store_true")
    add_fork_arguments(parser)
    return parser


def fork(*argv: str) -> str:
    out = io.StringIO()
    assert run_fork(_parser().parse_args(list(argv)), out=out) == 0
    return out.getvalue()


def fork_json(*argv: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(fork(*argv, "--json"))
    return doc


def _fork_calls(doc: dict[str, Any]) -> list[dict[str, Any]]:
    main = next(t for t in doc["fork"]["turns"] if t["turn_id"] == doc["fork"]["turn_id"])
    calls: list[dict[str, Any]] = main["calls"]
    return calls


def test_fork_at_the_start_of_a_tool_turn_with_a_setting_changed(db: Path) -> None:
    before = _digest(db)
    seq = _seq_of(db, TurnRecorded, "turn-1")  # turn-1 over, turn-2 not opened yet
    doc = fork_json(str(db), "--session", SESSION, "--fork", str(seq), "--set", "historyLimit=1")
    assert _digest(db) == before  # the original is only read
    assert doc["turn_id"] == "turn-2" and doc["turn_open_at_seq"] is False
    assert doc["settings"] == {"historyLimit": 1}
    assert doc["prefix"] == {"events": seq, "left_out": 0, "restarted": False}
    original, forked = doc["original"]["calls"], _fork_calls(doc)
    assert [c["status"] for c in original] == ["ok", "ok"] == [c["status"] for c in forked]
    # The same replies (replayed), the tool answered again...
    assert forked[0]["reply"]["tool_calls"] == original[0]["reply"]["tool_calls"]
    assert forked[0]["tool_results"] == original[0]["tool_results"]
    assert forked[1]["reply"]["text"] == original[1]["reply"]["text"] == "6 乘 7 等于 42。"
    # ...but a shorter history: the greeting's user message is out of the window.
    assert original[0]["request"] is not None and forked[0]["request"] is not None
    sent = [m["content"] for m in original[0]["request"]["messages"]]
    sent_fork = [m["content"] for m in forked[0]["request"]["messages"]]
    assert any(c.endswith("你好") for c in sent)
    assert not any(c.endswith("你好") for c in sent_fork)
    assert len(sent_fork) < len(sent)
    turn = next(t for t in doc["fork"]["turns"] if t["turn_id"] == doc["fork"]["turn_id"])
    assert turn["settings"]["history_limit"] == 1
    assert forked[0]["usage"]["used"] < original[0]["usage"]["used"]
    assert doc["original"]["settings"].get("history_limit", 0) == 0  # defaults are left out
    # The fork's log: the setting, then the re-submitted input, then the turn.
    log = doc["fork"]["log"]
    assert log[0]["type"] == "settings_changed" and log[0]["value"] == 1
    assert log[1]["type"] == "input_received" and log[1]["input"]["id"] == "in-2"


def test_unchanged_fork_sends_what_the_original_sent(db: Path) -> None:
    seq = _seq_of(db, TurnRecorded, "turn-1")
    doc = fork_json(str(db), "--session", SESSION, "--fork", str(seq))
    original, forked = doc["original"]["calls"], _fork_calls(doc)
    assert [c["request"]["messages"] for c in original] == [
        c["request"]["messages"] for c in forked
    ]
    assert [c["usage"]["used"] for c in original] == [c["usage"]["used"] for c in forked]


def test_max_tool_iterations_and_text_report(db: Path) -> None:
    before = _digest(db)
    seq = _seq_of(db, TurnRecorded, "turn-1")
    out = fork(str(db), "--session", SESSION, "--fork", str(seq), "--set", "maxToolIterations=1")
    assert _digest(db) == before
    assert f"Fork of session {SESSION} at seq {seq}" in out
    assert "turn re-run: turn-2 (opened at seq" in out
    assert "settings changed: maxToolIterations=1" in out
    assert "submitted again: in-2 '算一下 6*7' → 开轮" in out
    assert "maxToolIterations=1" in out.split("fork     fork-turn-1")[1].splitlines()[0]
    call2 = out.split("\ncall 2\n")[1].split("\n\nfork log after the prefix")[0]
    original, forked = call2.split("\n  fork ")
    assert "2 tools [current_time, calculate]" in original
    assert "0 tools []" in forked  # the cap is reached: the last call is offered no tools
    assert "usage: used" in original and "usage: used" in forked
    # Its units said: the history's messages beside the untrimmed history's tokens (ACC2),
    # which read as two counts of one thing ("history 4, untrimmed history 37").
    usage = re.compile(
        r"usage: used \d+/\d+ .*, history 4 message\(s\), untrimmed history \d+ tokens"
    )
    assert usage.search(original) and usage.search(forked)
    assert "reply: '6 乘 7 等于 42。'" in original and "reply: '6 乘 7 等于 42。'" in forked
    call1 = out.split("\ncall 1\n")[1].split("\ncall 2\n")[0]
    assert call1.count("reply: tool calls calculate#call-1") == 2
    assert call1.count("tool calculate#call-1 → '42'") == 2
    assert "fork log after the prefix" in out and "setting maxToolIterations = 1" in out


def test_a_script_gives_another_reply(db: Path, tmp_path: Path) -> None:
    script = tmp_path / "fork.toml"
    script.write_text('[[replies]]\ntext = "我不算，自己算吧。"\n', encoding="utf-8")
    before = _digest(db)
    seq = _seq_of(db, TurnRecorded, "turn-1")
    doc = fork_json(str(db), "--session", SESSION, "--fork", str(seq), "--script", str(script))
    assert _digest(db) == before
    assert "scripted from" in doc["model"]
    forked = _fork_calls(doc)
    assert len(forked) == 1 and len(doc["original"]["calls"]) == 2
    assert forked[0]["reply"] == {"text": "我不算，自己算吧。", "reasoning": None, "tool_calls": []}
    assert forked[0]["request"]["tools"]  # the same request went out
    text = fork(str(db), "--session", SESSION, "--fork", str(seq), "--script", str(script))
    assert "reply: '我不算，自己算吧。'" in text
    assert "reply: '6 乘 7 等于 42。'" in text
    assert "call 2\n" in text and "(no such call)" in text


def test_fork_inside_a_turn_recovers_the_cut_turn_first(db: Path) -> None:
    before = _digest(db)
    seq = _seq_of(db, ToolStarted, "turn-2")  # the model was called, the tool runs
    doc = fork_json(str(db), "--session", SESSION, "--fork", str(seq))
    assert _digest(db) == before
    assert doc["turn_id"] == "turn-2" and doc["turn_open_at_seq"] is True
    log = doc["fork"]["log"]
    record = next(e for e in log if e["type"] == "turn_recorded" and e["turn_id"] == "turn-2")
    assert record["outcome"] == "aborted" and record["reason"] == "crash"
    assert [r["input_id"] for r in doc["fork"]["resubmitted"]] == ["in-2.fork"]
    forked = _fork_calls(doc)
    assert [c["status"] for c in forked] == ["ok", "ok"]
    kinds = [m.get("kind") for m in forked[0]["request"]["messages"]]
    assert "turn-stopped" in kinds  # the cut turn's marker, as after a crash
    text = fork(str(db), "--session", SESSION, "--fork", str(seq))
    assert "recovery: TURN turn-2 ended: aborted reason=crash" in text


def test_fork_inside_the_opening_batch_reruns_the_turn_from_its_start(db: Path) -> None:
    seq = _seq_of(db, TurnOpened, "turn-2")
    doc = fork_json(str(db), "--session", SESSION, "--fork", str(seq))
    assert doc["prefix"]["restarted"] is True and doc["prefix"]["left_out"] == 2
    assert [r["input_id"] for r in doc["fork"]["resubmitted"]] == ["in-2"]
    original, forked = doc["original"]["calls"], _fork_calls(doc)
    assert [c["request"]["messages"] for c in original] == [
        c["request"]["messages"] for c in forked
    ]


def test_a_tool_the_fork_does_not_have_answers_from_the_log(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    with SqliteEventStore(path) as store:
        write_demo_session(store, "demo:room-1", FixedClock(1_767_225_600_000, step_ms=100))
    before = _digest(path)
    doc = fork_json(str(path), "--session", "demo:room-1", "--fork", "1")
    assert _digest(path) == before
    assert doc["turn_id"] == "turn-1"
    forked = _fork_calls(doc)
    assert forked[0]["tool_results"] == doc["original"]["calls"][0]["tool_results"]
    assert forked[0]["tool_results"][0]["result"] == "明天上海多云,14 到 21 度。"


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--fork", "999"], ReplayError, "has seq 1 to 25"),
        (["--fork", "0"], ReplayError, "has seq 1 to 25"),
        (["--fork", "25"], ReplayError, "nothing to re-run"),
        (["--fork", "3", "--session", "nobody"], ReplayError, "no session 'nobody'"),
        (["--fork", "3", "--set", "historyLimit"], ConfigError, "expected KEY=VALUE"),
        (["--fork", "3", "--set", "noSuchKey=1"], ConfigError, "unknown session setting"),
        (["--fork", "3", "--set", "historyLimit=-1"], ConfigError, "historyLimit"),
        (["--fork", "3", "--script", "missing.toml"], ConfigError, "cannot read the model"),
        (["--fork", "3", "--model", "x/y"], ConfigError, "add --config FILE"),
        # One model or the other: the configuration's was dropped without a word.
        (
            ["--fork", "3", "--script", "s.toml", "--config", "c.toml"],
            ConfigError,
            "^--script and --config do not go together",
        ),
        (["--fork", "3", "--at", "3"], ReplayError, "--at and --fork"),
    ],
)
def test_clear_errors(db: Path, argv: list[str], error: type, message: str) -> None:
    before = _digest(db)
    with pytest.raises(error, match=message):
        fork(str(db), *argv)
    assert _digest(db) == before


def test_a_script_that_does_not_load_and_a_missing_database(db: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[replies]]\ntext = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a model script"):
        fork(str(db), "--fork", "3", "--script", str(bad))
    with pytest.raises(ReplayError, match="no event database"):
        fork(str(tmp_path / "none.db"), "--fork", "3")


def _wired() -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "aalis_agent.cli", "replay", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "--fork" in help_text


def test_the_command_line(db: Path) -> None:
    """Enabled once ``cli/main.py`` wires ``--fork`` into ``replay``."""
    if not _wired():
        pytest.skip("`aalis-agent replay --help` has no --fork yet: cli/main.py is not wired")
    before = _digest(db)
    seq = _seq_of(db, TurnRecorded, "turn-1")
    argv = ["replay", str(db), "--session", SESSION, "--fork", str(seq), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "aalis_agent.cli", *argv, "--set", "historyLimit=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["turn_id"] == "turn-2" and doc["settings"] == {"historyLimit": 1}
    assert _digest(db) == before
    bad = subprocess.run(
        [sys.executable, "-m", "aalis_agent.cli", "replay", str(db), "--fork", "999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "has seq 1 to 25" in bad.stderr


def test_a_fork_whose_model_fails_reports_it_and_logs_only_with_verbose(
    db: Path, tmp_path: Path
) -> None:
    """The report says the fork's turn failed and why; the runtime's log (a traceback)
    goes to stderr only with ``-v``."""
    config = tmp_path / "bad.toml"
    config.write_text(  # a closed loopback port: the call fails at once
        "[providers.p]\nbaseUrl = 'http://127.0.0.1:9/v1'\nlistModels = false\n"
        "[[providers.p.models]]\nid = 'm'\n",
        encoding="utf-8",
    )
    seq = _seq_of(db, TurnRecorded, "turn-1")
    argv = ["replay", str(db), "--session", SESSION, "--fork", str(seq)]
    argv += ["--config", str(config), "--model", "p/m"]
    for verbose in (False, True):
        done = subprocess.run(
            [sys.executable, "-m", "aalis_agent.cli", *argv, *(["-v"] if verbose else [])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert ": error (ProviderError)" in done.stdout
        assert ("turn failed" in done.stderr) is verbose
        assert ("Traceback" in done.stderr) is verbose


def test_text_from_the_log_cannot_forge_lines_or_drive_the_terminal(tmp_path: Path) -> None:
    """An id, a tool name or a setting holding a newline and escape sequences: the timeline
    and the fork's report write them escaped, on the line they belong to; a persona is
    previewed (a log edited by hand may hold megabytes there)."""
    from aalis_agent.events import SettingsChanged
    from aalis_agent.timeline import render_event

    forged = "x\n#99    TURN forged ended: replied\x1b[2J\x1b[31m"
    line = render_event(SettingsChanged(session_id="s", seq=1, at=0, key=forged, value=forged))
    assert "\n" not in line and "\x1b" not in line
    assert "\\n#99" in line and "\\x1b[2J" in line
    persona = "人" * 256
    path = tmp_path / "odd.db"
    replies = [ScriptedReply(text=f"好{n}") for n in range(3)]
    store = SqliteEventStore(path)
    runtime = Runtime(store, Services(llm=ScriptedModel(replies)), janitor=False)
    try:
        runtime.set_setting(SESSION, "persona", persona)
        inp = Input(id="", content=f"a{forged}", sender=Sender(user_id="u1"))
        assert runtime.submit(SESSION, inp).result(10).outcome == "replied"
    finally:
        runtime.shutdown(timeout=10)
        store.close()
    report = fork(str(path), "--session", SESSION, "--fork", "1")
    assert "\x1b" not in report and "#99    TURN forged" not in report.split("\n")
    assert persona not in report and "persona='人人" in report  # previewed
