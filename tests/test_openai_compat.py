"""The OpenAI-compatible provider against a real HTTP server on loopback (no patching)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from typing import Any

import pykka
import pytest
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import (
    ChatMessage,
    FixedClock,
    InMemoryEventStore,
    Input,
    SequentialIds,
    ToolCall,
    ToolFinished,
    ToolStarted,
    TurnRecorded,
)
from aalis_agent.services import AbortSignal, ChatRequest, Services, Tool, ToolRegistry
from aalis_agent.services.openai_compat import (
    OpenAICompatibleModel,
    ProviderError,
    to_openai_message,
)
from aalis_agent.services.secrets import MASK, redact

from tests.harness import LoopbackServer, run_cli


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


class Server(LoopbackServer):
    """A loopback chat-completions server whose replies the test scripts."""

    def __init__(self) -> None:
        # a reply: SSE pieces, an error status, or an error status with its message
        self.scripts: list[list[bytes] | int | tuple[int, str] | bytes] = []
        self.raw_type = "text/html"  # of a ``bytes`` script, sent whole
        self.requests: list[dict[str, Any]] = []
        self.delay_s = 0.0
        self.served: list[str] = []
        self.auths: list[str] = []
        self.closed_early = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append({"GET": self.path, "auth": self.headers["Authorization"]})
                body = json.dumps(
                    {"object": "list", "data": [{"id": m, "object": "model"} for m in outer.served]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append(json.loads(body))
                outer.auths.append(self.headers["Authorization"])
                script = outer.scripts.pop(0) if outer.scripts else []
                if isinstance(script, bytes):  # a 200 answer that is not an event stream
                    self.send_response(200)
                    self.send_header("Content-Type", outer.raw_type)
                    self.send_header("Content-Length", str(len(script)))
                    self.end_headers()
                    self.wfile.write(script)
                    return
                if isinstance(script, (int, tuple)):
                    status, message = (
                        script if isinstance(script, tuple) else (script, "overloaded")
                    )
                    error = json.dumps({"error": {"message": message, "type": "invalid_request"}})
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(error.encode())))
                    self.end_headers()
                    self.wfile.write(error.encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for piece in script:
                        self.wfile.write(piece)
                        self.wfile.flush()
                        if outer.delay_s:
                            time.sleep(outer.delay_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    outer.closed_early.set()

        self.serve(Handler)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@contextmanager
def running(services: Services) -> Iterator[Runtime]:
    """A runtime on ``services`` (in-memory log, fixed clock), shut down afterwards."""
    runtime = Runtime(InMemoryEventStore(), services, FixedClock(), SequentialIds(), janitor=False)
    try:
        yield runtime
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def model(server: Server, **kw: Any) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(base_url=server.url, model="m", api_key="sk-test-secret", **kw)


REQ = ChatRequest(messages=(ChatMessage(id="u", role="user", content="你好"),), session_id="s")


def test_streams_text_reasoning_and_usage(server: Server) -> None:
    server.scripts.append(
        [
            sse(chunk({"role": "assistant", "reasoning_content": "想想"})),
            sse(chunk({"content": "你"})),
            sse(chunk({"content": "好"}, "stop")),
            sse(
                {
                    **chunk({}),
                    "choices": [],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13},
                }
            ),
        ]
    )
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    assert [c.reasoning_delta for c in out if c.reasoning_delta] == ["想想"]
    assert "".join(c.content_delta or "" for c in out) == "你好"
    assert out[-1].done and out[-1].usage is not None and out[-1].usage.prompt_tokens == 11
    sent = server.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": "你好"}]


def test_tool_call_arguments_grow_and_are_announced_with_their_call_id(server: Server) -> None:
    server.scripts.append(
        [
            sse(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_abc",
                                "type": "function",
                                "function": {"name": "weather", "arguments": ""},
                            }
                        ]
                    }
                )
            ),
            sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})),
            sse(
                chunk(
                    {"tool_calls": [{"index": 0, "function": {"arguments": '"上海"}'}}]},
                    "tool_calls",
                )
            ),
        ]
    )
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    progress = [c.tool_call_progress for c in out if c.tool_call_progress]
    assert {p.call_id for p in progress} == {"call_abc"}
    assert [p.chars_accumulated for p in progress] == [0, 9, 14]
    assert out[-1].tool_calls == (
        ToolCall(id="call_abc", name="weather", arguments='{"city": "上海"}'),
    )


def test_think_levels_map_to_the_request(server: Server) -> None:
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    m = model(server, think_levels={"high": "high"})
    list(m.chat_stream(ChatRequest(messages=REQ.messages, think="high"), AbortSignal()))
    assert server.requests[0]["reasoning_effort"] == "high"
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    list(m.chat_stream(ChatRequest(messages=REQ.messages, think="unknown"), AbortSignal()))
    assert "reasoning_effort" not in server.requests[1]  # not a level of this model


def test_abort_closes_the_stream_at_once(server: Server) -> None:
    server.delay_s = 0.2
    server.scripts.append([sse(chunk({"content": "字"})) for _ in range(50)])
    abort = AbortSignal()
    stream = model(server).chat_stream(REQ, abort)
    first = next(stream)
    assert first.content_delta == "字"
    t0 = time.monotonic()
    abort.abort("stop")
    rest = list(stream)
    assert time.monotonic() - t0 < 1.0  # not the 10 s the server would still stream
    assert not any(c.done for c in rest)


def test_messages_with_tool_calls_go_out_in_wire_format() -> None:
    call = ToolCall(id="c1", name="f", arguments="{}")
    assert to_openai_message(ChatMessage(id="a", role="assistant", tool_calls=(call,))) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert to_openai_message(ChatMessage(id="t", role="tool", content="ok", tool_call_id="c1")) == {
        "role": "tool",
        "content": "ok",
        "tool_call_id": "c1",
    }


def test_the_key_never_shows(server: Server) -> None:
    m = model(server)
    assert "sk-test-secret" not in repr(m)
    assert "sk-test-secret" not in str(vars(m).get("id"))


def test_turns_through_the_runtime_with_tools_and_errors(server: Server) -> None:
    server.scripts += [
        [
            sse(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "echo", "arguments": '{"x": 1}'},
                            }
                        ]
                    },
                    "tool_calls",
                )
            ),
        ],
        [sse(chunk({"content": "完成"}, "stop"))],
        500,
    ]
    tools = ToolRegistry([Tool("echo", lambda args, ctx: f"echo {args['x']}")])
    # No retry: the 500 is the answer this turn ends with (retries: test_openai_stream).
    with running(Services(llm=model(server, max_retries=0), tools=tools)) as runtime:
        notices: list[Any] = []
        runtime.subscribe("outbound:message", lambda t, p: notices.append(p))
        assert runtime.submit("s", Input(id="", content="跑一下")).result(10).outcome == "replied"
        log = runtime.store.read("s")
        assert [e.call_id for e in log if isinstance(e, ToolStarted)] == ["call_1"]
        assert [e.result for e in log if isinstance(e, ToolFinished)] == ["echo 1"]
        second = server.requests[1]["messages"]
        assert second[-2]["tool_calls"][0]["id"] == "call_1" and second[-1]["role"] == "tool"
        # A server error: the turn ends in error with a [错误] notice, the session goes on.
        assert runtime.submit("s", Input(id="", content="再来")).result(10).outcome == "error"
        assert notices[-1]["kind"] == "error" and notices[-1]["content"].startswith("[错误]")
        assert [e.outcome for e in runtime.store.read("s") if isinstance(e, TurnRecorded)] == [
            "replied",
            "error",
        ]


def test_a_config_file_provider_lists_the_servers_models(server: Server, tmp_path: Any) -> None:
    """``listModels = true``: the server's models join the configured ones at load."""
    from aalis_agent.services.config_file import load_config
    from aalis_agent.services.models import entry_id

    server.served = ["qwen2.5:7b", "llama3.2", "configured"]
    path = tmp_path / "aalis.toml"
    path.write_text(
        f"""
[providers.ollama]
baseUrl = "{server.url}"
apiKey = "sk-listing"
listModels = true
[[providers.ollama.models]]
id = "configured"
contextLength = 9000
""",
        encoding="utf-8",
    )
    fc = load_config(path)
    models = fc.llm.models()
    assert [entry_id(m) for m in models] == [
        "ollama/configured",
        "ollama/qwen2.5:7b",
        "ollama/llama3.2",
    ]
    assert models[0].context_length == 9000  # the configured entry keeps its own values
    assert server.requests == [{"GET": "/v1/models", "auth": "Bearer sk-listing"}]
    # The listed model answers through the same server.
    server.scripts.append([sse(chunk({"content": "在"})), sse(chunk({}, "stop"))])
    out = list(models[1].chat_stream(REQ, AbortSignal()))
    assert "".join(c.content_delta or "" for c in out) == "在"
    assert server.requests[-1]["model"] == "qwen2.5:7b"


def test_a_server_that_cannot_list_is_a_load_error(tmp_path: Any) -> None:
    from aalis_agent.events import ConfigError
    from aalis_agent.services.config_file import load_config

    path = tmp_path / "aalis.toml"
    path.write_text(
        '[providers.gone]\nbaseUrl = "http://127.0.0.1:9/v1"\nlistModels = true\n'
        "timeoutMs = 2000\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"aalis.toml: providers.gone.listModels: listing"):
        load_config(path)


def test_chat_converses_with_a_server_and_runs_the_builtin_tools(
    server: Server, tmp_path: Any
) -> None:
    """``aalis-agent chat --base-url --model`` against the loopback server: the model calls
    ``calculate``, the chat runs it, and the result goes back in the next request."""
    call = {
        "index": 0,
        "id": "call_calc",
        "type": "function",
        "function": {"name": "calculate", "arguments": '{"expression": "6*7"}'},
    }
    server.scripts.append([sse(chunk({"tool_calls": [call]}, "tool_calls"))])
    server.scripts.append([sse(chunk({"content": "是 42。"})), sse(chunk({}, "stop"))])
    result = run_cli(
        *("chat", "--db", str(tmp_path / "c.db"), "--base-url", server.url, "--model", "m"),
        stdin="六乘七是多少\n",
        env={"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "sk-chat"},
    )
    # A plain-http server never gets OPENAI_API_KEY unasked.
    assert set(server.auths) == {"Bearer not-needed"}
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "[工具] calculate" in lines and "是 42。" in lines
    first, second = server.requests
    assert {t["function"]["name"] for t in first["tools"]} == {"current_time", "calculate"}
    tool_messages = [m for m in second["messages"] if m["role"] == "tool"]
    assert tool_messages == [{"role": "tool", "content": "42", "tool_call_id": "call_calc"}]
    assert "sk-chat" not in result.stdout + result.stderr


def test_a_stalled_stream_times_out_and_the_turn_ends_in_error(server: Server) -> None:
    """The read timeout ends a stream that stops sending: without it this reply would
    complete (two pieces, two seconds apart)."""
    server.delay_s = 2.0
    server.scripts.append([sse(chunk({"content": "第一段"})), sse(chunk({"content": "第二段"}))])
    with running(Services(llm=model(server, timeout_s=0.3))) as runtime:
        notices: list[Any] = []
        runtime.subscribe("outbound:message", lambda t, p: notices.append(p))
        assert runtime.submit("s", Input(id="", content="慢慢说")).result(10).outcome == "error"
        assert [n["kind"] for n in notices] == ["error"]
        assert notices[0]["content"].startswith("[错误]") and "turn=" in notices[0]["content"]
        assert "第二段" not in str(runtime.view("s").history)


def test_chat_sends_the_key_the_user_names(server: Server, tmp_path: Any) -> None:
    server.scripts.append([sse(chunk({"content": "好"})), sse(chunk({}, "stop"))])
    args = ("chat", "--db", str(tmp_path / "c.db"), "--base-url", server.url, "--model", "m")
    result = run_cli(
        *args,
        "--api-key-env",
        "MY_SERVER_KEY",
        stdin="你好\n",
        env={"PATH": "/usr/bin:/bin", "MY_SERVER_KEY": "sk-mine", "OPENAI_API_KEY": "sk-other"},
    )
    assert result.returncode == 0, result.stderr
    assert server.auths == ["Bearer sk-mine"]
    missing = run_cli(*args, "--api-key-env", "NOT_SET", stdin="", env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2
    assert "--api-key-env: the environment variable NOT_SET is not set" in missing.stderr


def test_an_https_server_may_take_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    remote = OpenAICompatibleModel(base_url="https://api.example.com/v1", model="m")
    local = OpenAICompatibleModel(base_url="http://127.0.0.1:9/v1", model="m")
    off = OpenAICompatibleModel(base_url="https://api.example.com/v1", model="m", env_key=False)
    assert remote._headers["Authorization"] == "Bearer sk-env"
    assert local._headers["Authorization"] == off._headers["Authorization"] == "Bearer not-needed"


def test_tool_calls_without_an_index_are_told_apart_by_their_ids(server: Server) -> None:
    """Some servers leave ``index`` out of tool-call deltas: a new id starts a new call."""
    server.scripts.append(
        [
            sse(chunk({"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": ""}}]})),
            sse(chunk({"tool_calls": [{"function": {"arguments": '{"a": 1}'}}]})),
            sse(
                chunk({"tool_calls": [{"id": "c2", "function": {"name": "g", "arguments": "{}"}}]})
            ),
            sse(chunk({}, "tool_calls")),
        ]
    )
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    assert out[-1].tool_calls == (
        ToolCall(id="c1", name="f", arguments='{"a": 1}'),
        ToolCall(id="c2", name="g", arguments="{}"),
    )
    progress = [c.tool_call_progress for c in out if c.tool_call_progress]
    assert [(p.index, p.call_id) for p in progress] == [(0, "c1"), (0, "c1"), (1, "c2")]


def test_usage_with_counts_left_out_is_completed(server: Server) -> None:
    server.scripts.append(
        [
            sse(chunk({"content": "好"}, "stop")),
            sse(
                {**chunk({}), "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}
            ),
        ]
    )
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    assert out[-1].usage is not None
    assert (out[-1].usage.prompt_tokens, out[-1].usage.total_tokens) == (7, 8)


def test_usage_counts_sent_as_floats_are_taken(server: Server) -> None:
    """「used 取模型服务返回的这次调用的输入 token,没有返回或不是正的有限数时取…估算」: a
    server sending its counts as floats (1234.0) gives a positive finite number, which is
    taken (as the nearest count); it was dropped for the estimate. NaN, infinities and
    numbers past 0 only in name are not counts."""
    usage = {"prompt_tokens": 1234.0, "completion_tokens": 56.6, "total_tokens": 1290.0}
    server.scripts.append(
        [sse(chunk({"content": "好"}, "stop")), sse({**chunk({}), "choices": [], "usage": usage})]
    )
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    got = out[-1].usage
    assert got is not None
    assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (1234, 57, 1290)
    for bad in ("NaN", "Infinity", "-5.0", "0.0", "1e300"):
        body = (
            '{"id":"x","object":"chat.completion.chunk","choices":[],'
            f'"usage":{{"prompt_tokens":{bad},"completion_tokens":1}}}}'
        )
        server.scripts.append([sse(chunk({"content": "好"}, "stop")), f"data: {body}\n\n".encode()])
        out = list(model(server).chat_stream(REQ, AbortSignal()))
        assert out[-1].usage is not None and out[-1].usage.prompt_tokens == 0, bad


def test_a_server_refusing_stream_options_is_asked_again_without_them(server: Server) -> None:
    """The 400 is answered once; the model remembers, and the turn's usage is counted
    locally since the server sends none."""
    refusal = (400, "Unrecognized request argument supplied: stream_options")
    server.scripts += [refusal, [sse(chunk({"content": "好"}, "stop"))]]
    server.scripts.append([sse(chunk({"content": "又好"}, "stop"))])
    with running(Services(llm=model(server))) as runtime:
        usages: list[Any] = []
        runtime.subscribe("token:usage", lambda t, p: usages.append(p))
        assert runtime.submit("s", Input(id="", content="你好")).result(10).outcome == "replied"
        assert runtime.submit("s", Input(id="", content="再来")).result(10).outcome == "replied"
    assert ["stream_options" in r for r in server.requests] == [True, False, False]
    assert len(usages) == 2 and all(u["used"] > 0 for u in usages)


def test_a_server_wanting_max_completion_tokens_gets_it(server: Server) -> None:
    refusal = (
        400,
        "Unsupported parameter: 'max_tokens' is not supported with this model. "
        "Use 'max_completion_tokens' instead.",
    )
    server.scripts += [refusal, [sse(chunk({"content": "好"}, "stop"))]]
    out = list(model(server, max_output_tokens=321).chat_stream(REQ, AbortSignal()))
    assert "".join(c.content_delta or "" for c in out) == "好"
    first, second = server.requests
    assert first["max_tokens"] == 321 and "max_completion_tokens" not in first
    assert second["max_completion_tokens"] == 321 and "max_tokens" not in second


def test_another_bad_request_is_not_retried(server: Server) -> None:
    """It comes out as a ProviderError naming the client's error and the status, masked
    and without the client's exception (which holds the request's headers)."""
    server.scripts += [(400, "messages: too long"), [sse(chunk({"content": "好"}, "stop"))]]
    with pytest.raises(ProviderError, match=r"^BadRequestError: .*too long") as caught:
        list(model(server).chat_stream(REQ, AbortSignal()))
    assert (caught.value.kind, caught.value.status_code) == ("BadRequestError", 400)
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    assert len(server.requests) == 1


def test_an_unreachable_server_is_a_provider_error_and_a_url_password_is_masked() -> None:
    """A connection error is wrapped too; a password in the server's URL is registered
    like a key."""
    m = OpenAICompatibleModel(base_url="http://user:pw-in-the-URL-77@127.0.0.1:9/v1", model="m")
    with pytest.raises(ProviderError, match=r"^APIConnectionError: ") as caught:
        list(m.chat_stream(REQ, AbortSignal()))
    assert caught.value.status_code is None and caught.value.__context__ is None
    assert redact("http://user:pw-in-the-URL-77@host") == f"http://user:{MASK}@host"


def test_tool_calls_whose_indexes_start_at_1_run_under_the_ids_they_were_announced_with(
    server: Server,
) -> None:
    """FLOW10 with a server numbering its calls from 1: each call runs and is stored under
    the id announced while it streamed (the second used to run as the first's id, ~2)."""
    first = {"index": 1, "id": "call_A", "function": {"name": "add", "arguments": "{}"}}
    second = {"index": 2, "id": "call_B", "function": {"name": "add", "arguments": "{}"}}
    server.scripts.append(
        [sse(chunk({"tool_calls": [first]})), sse(chunk({"tool_calls": [second]}, "tool_calls"))]
    )
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    services = Services(llm=model(server), tools=ToolRegistry([Tool("add", lambda a, c: "2")]))
    announced: list[str] = []
    with running(services) as runtime:
        runtime.subscribe(
            "outbound:stream",
            lambda topic, p: (
                announced.append(p["toolCallProgress"]["callId"])
                if "toolCallProgress" in p
                else None
            ),
        )
        assert runtime.run("s", Input(id="", content="算")).outcome == "replied"
        started = [e.call_id for e in runtime.store.read("s") if isinstance(e, ToolStarted)]
    assert started == ["call_A", "call_B"] == announced


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"<html><body>Bad gateway</body></html>", "<html><body>Bad gateway</body></html>"),
        (b'{"error": {"message": "model not loaded"}}', "model not loaded"),
        (b"", "an empty answer"),
    ],
)
def test_a_200_answer_that_is_not_an_event_stream_is_an_error(
    server: Server, body: bytes, said: str
) -> None:
    server.scripts.append(body)
    with pytest.raises(ProviderError) as info:
        list(model(server).chat_stream(REQ, AbortSignal()))
    assert str(info.value) == f"APIError: the server's answer is not an event stream: {said}"


def test_an_emoji_cut_between_two_events_as_json_escapes_is_joined(server: Server) -> None:
    """A server whose encoder cuts a string between the halves of a surrogate pair sends
    ``"a\\ud83d"`` then ``"\\ude00b"``: the reply is ``a😀b`` (the turn failed)."""
    server.scripts.append(
        [
            b'data: {"choices": [{"index": 0, "delta": {"content": "a\\ud83d"}}]}\n\n',
            b'data: {"choices": [{"index": 0, "delta": {"content": "\\ude00b"}}]}\n\n',
        ]
    )
    with running(Services(llm=model(server))) as runtime:
        outcome = runtime.run("s", Input(id="", content="表情"))
    assert (outcome.outcome, outcome.reply) == ("replied", "a😀b")


def test_a_servers_error_message_cannot_break_lines_or_send_escapes(server: Server) -> None:
    server.scripts.append((400, "line one\nline two\r\x1b[31mRED\x1b[0m\x07 \u202e reversed"))
    with pytest.raises(ProviderError) as info:
        list(model(server).chat_stream(REQ, AbortSignal()))
    text = str(info.value)
    assert text.isprintable() and "\\x1b[31mRED" in text and "\\u202e" in text


def test_a_tool_call_index_that_is_not_ascii_digits_is_taken_as_none(server: Server) -> None:
    odd = {"index": "²", "id": "c1", "function": {"name": "f", "arguments": "{}"}}
    server.scripts.append([sse(chunk({"tool_calls": [odd]}, "tool_calls"))])
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    assert out[-1].tool_calls == (ToolCall(id="c1", name="f", arguments="{}"),)


@pytest.mark.parametrize("piece", [b'data: {"choices": []}\n\n', b": still here\n\n"])
def test_a_reply_still_streaming_at_max_reply_s_ends_as_a_timeout(
    server: Server, piece: bytes
) -> None:
    """A stream that never ends, of events or of comments dripping in under the read
    timeout, is cut at ``max_reply_s`` (it ran until stopped)."""
    server.scripts.append([piece] * 200)
    server.delay_s = 0.01  # 2 s in all
    started = time.monotonic()
    with pytest.raises(ProviderError, match="APITimeoutError: the reply was still streaming"):
        list(model(server, max_reply_s=0.3).chat_stream(REQ, AbortSignal()))
    assert time.monotonic() - started < 1.5


def test_max_reply_s_must_be_positive(server: Server) -> None:
    from aalis_agent.events import ConfigError

    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError, match="max_reply_s must be more than 0"):
            model(server, max_reply_s=bad)


def test_an_event_nested_too_deep_is_a_provider_error(server: Server) -> None:
    deep = b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"
    server.scripts.append([deep])
    with pytest.raises(ProviderError, match=r"malformed event in the stream \(its data is nested"):
        list(model(server).chat_stream(REQ, AbortSignal()))


def test_a_tool_call_cut_off_at_the_output_limit_is_told_as_such(server: Server) -> None:
    """``finish_reason`` ``length`` while the last call's arguments were being written:
    that call does not run, and the model reads that its reply was cut off (so that it
    writes shorter arguments), not only that they were not JSON. The calls before it are
    whole and run."""
    whole = {"index": 0, "id": "call_A", "function": {"name": "add", "arguments": "{}"}}
    cut = {"index": 1, "id": "call_B", "function": {"name": "add", "arguments": '{"a": "很长'}}
    server.scripts.append(
        [sse(chunk({"tool_calls": [whole]})), sse(chunk({"tool_calls": [cut]}, "length"))]
    )
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    ran: list[Any] = []
    tools = ToolRegistry([Tool("add", lambda a, c: ran.append(a) or "2")])
    with running(Services(llm=model(server), tools=tools)) as runtime:
        assert runtime.run("s", Input(id="", content="算")).outcome == "replied"
        finished = [e for e in runtime.store.read("s") if isinstance(e, ToolFinished)]
    assert ran == [{}]
    assert [(e.call_id, e.result) for e in finished] == [("call_A", "2"), ("call_B", None)]
    error = finished[1].error
    assert error is not None and error.startswith("[错误] 回复在输出长度上限处被截断")
    assert '{"a": "很长' in error
    # A reply that ended for another reason keeps the usual error.
    server.scripts.append([sse(chunk({"tool_calls": [cut]}, "tool_calls"))])
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    with running(Services(llm=model(server), tools=tools)) as runtime:
        assert runtime.run("s", Input(id="", content="算")).outcome == "replied"
        finished = [e for e in runtime.store.read("s") if isinstance(e, ToolFinished)]
    assert finished[0].error is not None
    assert finished[0].error.startswith("[错误] 工具参数不是合法的 JSON 对象")


def test_the_last_chunk_says_whether_the_reply_was_cut_at_the_output_limit(
    server: Server,
) -> None:
    for reason, cut in (("length", True), ("stop", False)):
        server.scripts.append([sse(chunk({"content": "好"}, reason))])
        out = list(model(server).chat_stream(REQ, AbortSignal()))
        assert out[-1].done and out[-1].cut is cut


def test_tool_call_arguments_without_end_are_cut_at_the_output_limit_in_a_turn(
    server: Server,
) -> None:
    """A server streaming a call's arguments past what ``max_output_tokens`` can hold
    (10 tokens: 1,280 characters): the turn reads no more of it, the call does not run and
    the model reads that its reply was cut off; nothing longer is stored."""
    start = {"index": 0, "id": "call_A", "function": {"name": "echo", "arguments": '{"x": "'}}
    more = {"index": 0, "function": {"arguments": "长" * 100}}
    server.scripts.append(
        [sse(chunk({"tool_calls": [start]})), *[sse(chunk({"tool_calls": [more]}))] * 100]
    )
    server.scripts.append([sse(chunk({"content": "好"}, "stop"))])
    ran: list[Any] = []
    tools = ToolRegistry([Tool("echo", lambda a, c: ran.append(a) or "x")])
    with running(Services(llm=model(server, max_output_tokens=10), tools=tools)) as runtime:
        assert runtime.run("s", Input(id="", content="说")).outcome == "replied"
        log = runtime.store.read("s")
    assert ran == []
    [finished] = [e for e in log if isinstance(e, ToolFinished)]
    assert finished.error is not None
    assert finished.error.startswith("[错误] 回复在输出长度上限处被截断")
    assert [e.arguments for e in log if isinstance(e, ToolStarted)] == ["{}"]
    assert max(len(m["content"] or "") for m in server.requests[1]["messages"]) < 1280
    assert len(json.dumps(server.requests[1], ensure_ascii=False)) < 2 * 1280 + 4096
