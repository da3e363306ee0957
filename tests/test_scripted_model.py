"""The scripted model: streams text, reasoning, tool calls, usage and delays, from Python
or from a file."""

from __future__ import annotations

from pathlib import Path

import pytest
from aalis_agent.events import ConfigError, ToolCall
from aalis_agent.services import AbortSignal, ChatRequest, ScriptedModel, ScriptedReply
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
