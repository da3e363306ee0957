"""The scripted model: streams text, reasoning, tool calls, usage and delays, from Python
or from a file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from aalis_agent.events import ConfigError, ToolCall
from aalis_agent.services import AbortSignal, ChatRequest, ScriptedModel, ScriptedReply
from aalis_agent.services.config import AgentConfig
from aalis_agent.services.llm import Usage

REQUEST = ChatRequest(messages=())


def chunks(model: ScriptedModel, abort: AbortSignal | None = None) -> list[object]:
    return list(model.chat_stream(REQUEST, abort or AbortSignal()))


def test_streams_reasoning_text_tool_calls_with_progress_and_usage() -> None:
    call = ToolCall(id="c1", name="search", arguments='{"q": ')  # malformed on purpose
    model = ScriptedModel(
        [
            ScriptedReply(
                text="abcdef",
                reasoning="想一想",
                chunks=3,
                tool_calls=(call,),
                usage=Usage(prompt_tokens=12),
            )
        ]
    )
    out = chunks(model)
    assert out[0].reasoning_delta == "想一想"  # type: ignore[attr-defined]
    assert [c.content_delta for c in out[1:4]] == ["ab", "cd", "ef"]  # type: ignore[attr-defined]
    progress = out[4].tool_call_progress  # type: ignore[attr-defined]
    assert (progress.call_id, progress.name, progress.chars_accumulated) == ("c1", "search", 6)
    last = out[-1]
    assert last.done and last.tool_calls == (call,) and last.usage.prompt_tokens == 12  # type: ignore[attr-defined]


def test_a_stop_abandons_a_delayed_stream() -> None:
    model = ScriptedModel([ScriptedReply(text="x" * 100, chunks=100, chunk_delay_s=5)])
    abort = AbortSignal()
    abort.abort("stop")
    assert chunks(model, abort) == []


def test_from_a_toml_file(tmp_path: Path) -> None:
    script = tmp_path / "script.toml"
    script.write_text(
        """
[[replies]]
text = "你好"
usage = { prompt_tokens = 7 }

[[replies]]
tool_calls = [{ id = "c1", name = "echo", arguments = '{"bad": ' }]
""",
        encoding="utf-8",
    )
    model = ScriptedModel.from_file(script)
    first, second = chunks(model), chunks(model)
    assert first[0].content_delta == "你好"  # type: ignore[attr-defined]
    assert second[-1].tool_calls[0].arguments == '{"bad": '  # type: ignore[attr-defined]


def test_from_a_json_file_and_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "s.json"
    good.write_text('[{"text": "一"}, {"text": "二"}]', encoding="utf-8")
    model = ScriptedModel.from_file(good)
    assert chunks(model)[0].content_delta == "一"  # type: ignore[attr-defined]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"txt": 1}, {"text": 5}]', encoding="utf-8")
    with pytest.raises(ConfigError, match="not a model script"):
        ScriptedModel.from_file(bad)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("typo.toml", '[[replies]]\ntxt = "a"\n', r"reply 1: unknown key 'txt' \(known: "),
        (
            "call.toml",
            '[[replies]]\ntool_calls = [{ id = "c", name = "x", argument = "{}" }]\n',
            "reply 1: tool call 1: unknown key 'argument' \\(known: arguments, id, name\\)",
        ),
        ("use.json", '[{"text": "a"}, {"usage": {"prompt": 1}}]', "reply 2: usage: unknown key"),
        ("toml.txt", '[[replies]]\ntext = "a"\n', r"\(read as JSON: a TOML script's name ends"),
    ],
)
def test_a_model_script_refuses_what_it_does_not_know_naming_it(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    """As every other input file does: a misspelt key would otherwise be dropped and its
    reply come out empty."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    where = re.escape(str(path))
    with pytest.raises(ConfigError, match=f"^{where}: not a model script.*{problem}"):
        ScriptedModel.from_file(path)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("text.toml", "[[replies]]\ntext = 5\n", "reply 1: text: Expected `str`, got `int`$"),
        (
            "call.toml",
            '[[replies]]\ntext = "a"\n[[replies]]\ntool_calls = [{ id = "c", name = "x" }, '
            '{ id = "d", name = "x", arguments = 5 }]\n',
            "reply 2: tool call 2: arguments: Expected `str`, got `int`$",
        ),
        (
            "use.json",
            '[{"usage": {"prompt_tokens": "many"}}]',
            "reply 1: usage: prompt_tokens: Expected `int | null`, got `str`$",
        ),
        ("none.toml", '[[reply]]\ntext = "a"\n', r"no \[\[replies\]\] table"),
        ("flat.toml", 'replies = "a"\n', "replies must be a list of replies, got text$"),
        (
            "obj.json",
            '{"replies": []}',
            "the JSON document must be a list of replies, got an object$",
        ),
    ],
)
def test_a_model_script_names_the_reply_and_key_of_a_wrong_value(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    """A wrong type named its place as ``$[0].text`` (0-based, unlike the unknown-key
    errors' ``reply 1``), and a TOML file with no ``[[replies]]`` said only ``'replies'``:
    each now says which reply (1-based), which key, and what is wrong."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    where = re.escape(str(path))
    with pytest.raises(ConfigError, match=f"^{where}: not a model script.*: {problem}"):
        ScriptedModel.from_file(path)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("deep.json", "[" * 5000, "nested deeper than 64 levels"),
        ("deep.toml", "replies = " + "[" * 5000, "nested deeper than 64 levels"),
        ("many.toml", '[[replies]]\ntext = "x"\nchunks = 99999999\n', "chunks must be 1..100000"),
        ("bad.json", b"\xff\xfe", "cannot read the model script"),
    ],
)
def test_a_hostile_model_script_is_refused_plainly(
    tmp_path: Path, name: str, text: str | bytes, problem: str
) -> None:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=problem):
        ScriptedModel.from_file(path)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("memory_token_budget", 10**12, "memoryTokenBudget must be <= 1000000000"),
        ("prompt_build_timeout_ms", 2**40, "promptBuildTimeoutMs must be <= 2147483647"),
        ("history_limit", 2**70, "historyLimit must be <= 9223372036854775807"),
        ("trim_threshold_ratio", 1e9, "trimThresholdRatio must be <= 1000"),
    ],
)
def test_a_plugin_config_built_in_python_is_bounded_too(
    field: str, value: Any, problem: str
) -> None:
    with pytest.raises(ConfigError, match=problem):
        AgentConfig(**{field: value})


@pytest.mark.parametrize("delay", ["1e308", "-1", "NaN"])
def test_a_chunk_delay_out_of_range_is_refused_at_load(tmp_path: Path, delay: str) -> None:
    script = tmp_path / "s.json"
    script.write_text(f'[{{"text": "一", "chunks": 2, "chunk_delay_s": {delay}}}]')
    with pytest.raises(ConfigError, match=r"reply 1: chunk_delay_s must be 0\.\.3600 seconds"):
        ScriptedModel.from_file(script)


@pytest.mark.parametrize("kind", ["script", "config"])
def test_a_file_past_16_mib_is_refused_unread(tmp_path: Path, kind: str) -> None:
    """A model script or a configuration past 16 MiB (``/dev/zero`` given by mistake,
    a log) is refused naming the file and the limit, after reading just past the limit
    (it was read whole: ``/dev/zero`` until the kernel ended the process)."""
    from aalis_agent.services.config_file import load_config
    from aalis_agent.services.files import TEXT_FILE_BYTES

    big = tmp_path / ("big.toml" if kind == "config" else "big.json")
    big.write_bytes(b" " * (TEXT_FILE_BYTES + 1))
    load = load_config if kind == "config" else ScriptedModel.from_file
    with pytest.raises(ConfigError, match=r"big\.(toml|json): not a .*: longer than 16,777,216"):
        load(big)
    with pytest.raises(ConfigError, match="longer than 16,777,216 bytes"):
        load("/dev/zero")
