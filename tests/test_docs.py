"""The documentation's examples run as pasted and print what the text shows.

README.md's ``python`` blocks run in a scratch folder (they write ``agent.db``); a
comment line right after a ``print`` is the line it prints (``…`` or ``...`` stands for
what is left out). docs/debugging.md's walk-through runs whole: its script, then each
``aalis-agent`` command, whose output must hold the lines the page shows, in order
(``…`` alone on a line: lines left out; within a line: text left out; times, the ends of
ids and token counts vary from run to run). docs/scenarios.md's blocks are run by
tests/test_scenario_runner.py.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from aalis_agent.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
STAMP = r"\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"  # a timeline's local time


def blocks(doc: str) -> list[tuple[str, str]]:
    """Every fenced block of ``doc`` as (info string, body), in order."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def shown_outputs(code: str) -> list[str]:
    """The comment lines that follow a ``print(...)`` line: what it prints."""
    shown, after_print = [], False
    for line in code.splitlines():
        if line.startswith("# ") and after_print:
            shown.append(line[2:])
        elif line.strip():
            after_print = "print(" in line
    return shown


def pattern(shown: str) -> re.Pattern[str]:
    """A line as the documentation shows it, as a pattern for the line printed."""
    parts = re.split(r"…|\.\.\.", shown)
    regex = ".*".join(re.escape(p) for p in parts)
    for literal, varying in (
        (r"(in|turn)\\-[0-9a-f]+\.\*", lambda m: m[1] + r"-[0-9a-f]+"),  # in-a69f…
        (r"\d\d\\-\d\d\\ \d\d:\d\d:\d\d\\\.\d{3}", lambda m: STAMP),
        (r"used(=|\\ )\d+/", lambda m: "used" + m[1] + r"\d+/"),  # token counts
        (r"\\\(\d+\\\.\d%\\\)", lambda m: r"\(\d+\.\d%\)"),
    ):
        regex = re.sub(literal, varying, regex)
    return re.compile(regex)


def assert_shows(shown: list[str], printed: str, where: str) -> None:
    """Each line of ``shown`` matches a line of ``printed``, in order."""
    lines = printed.splitlines()
    at = 0
    for want in shown:
        if want.strip() in ("…", "..."):
            continue
        rx = pattern(want.rstrip())
        while at < len(lines) and not rx.fullmatch(lines[at].rstrip()):
            at += 1
        assert at < len(lines), f"{where}: no line printed as shown: {want!r}\n{printed}"
        at += 1


def test_readme_python_runs_as_pasted_and_prints_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    codes = [body for info, body in blocks("README.md") if info == "python"]
    assert len(codes) >= 3
    checked = 0
    for k, code in enumerate(codes):
        exec(compile(code, f"README.md python block {k + 1}", "exec"), {"__name__": "readme"})
        printed = capsys.readouterr().out
        shown = shown_outputs(code)
        if shown:
            assert len(printed.splitlines()) == len(shown), (k, printed)
            assert_shows(shown, printed, f"README.md python block {k + 1}")
            checked += 1
    assert checked >= 2


def test_the_debugging_walk_through_prints_what_the_page_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    fenced = blocks("docs/debugging.md")
    (script,) = [body for info, body in fenced if info == "python"]
    exec(compile(script, "docs/debugging.md", "exec"), {"__name__": "debugging"})
    assert capsys.readouterr().out == "What I found: rain, 14-21 C.\n"  # as the page says
    (toml,) = [body for info, body in fenced if info == "toml"]
    (tmp_path / "second_lookup.toml").write_text(toml, encoding="utf-8")
    runs = 0
    for (info, body), (next_info, output) in itertools.pairwise(fenced):
        if info != "sh" or next_info != "":
            continue
        (command,) = body.splitlines()
        argv = shlex.split(command)
        assert argv[0] == "aalis-agent"
        assert cli_main(argv[1:]) == 0, command
        assert_shows(output.splitlines(), capsys.readouterr().out, command)
        runs += 1
    assert runs == 3  # the replay, the fork, the fork with scripted replies
