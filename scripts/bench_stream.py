"""Time to first token of the OpenAI-compatible provider over loopback (``first_token``).

A loopback chat-completions server (HTTP/1.1 keep-alive, TCP_NODELAY, chunked) streams 50
chunks for every request. For histories of 141 and 1,061 messages this measures, in one
run and interleaved, the raw HTTP floor (httpx posts a prebuilt body and reads the first
event) and the provider (``OpenAICompatibleModel.chat_stream``, from the call to the first
chunk with content, the body built from the request's messages), each read to its end so
that both keep their connection. It emits the median of each and the median of the
per-pair added time (ours - floor); the target is an added time of at most 2 ms at 1,061
messages.

Run alone: ``.venv/bin/python scripts/bench_stream.py``; one JSON line per figure.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
from aalis_agent.events import ChatMessage, ToolCall
from aalis_agent.services import AbortSignal, ChatRequest
from aalis_agent.services.openai_compat import OpenAICompatibleModel

CHUNKS = 50
SIZES = (141, 1061)  # a system prompt and 35 / 265 turns of four messages
RUNS = 60
WARMUP = 5
TARGET_ADDED_MS = 2.0
USER_TEXT = "你好,帮我查一下明天上海的天气,顺便看看要不要带伞。"
REPLY_TEXT = "明天上海多云转小雨,14 到 21 度,东南风 3 级,下午可能有阵雨,出门记得带伞。"
SYSTEM_TEXT = "你是一个乐于助人的群聊助手。回答简洁,必要时调用工具。" * 20
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "查询城市天气",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "day": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
)

Emit = Callable[..., None]


def emit_json(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": name, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


def history(n: int) -> tuple[ChatMessage, ...]:
    """``n`` messages: a system prompt, then turns of a user message, a tool call, its
    result and a reply."""
    out = [ChatMessage(id="sys", role="system", content=SYSTEM_TEXT)]
    i = 0
    while len(out) < n:
        call = ToolCall(id=f"call-{i}", name="weather", arguments='{"city": "上海", "day": "明天"}')
        out += [
            ChatMessage(id=f"u{i}", role="user", content=f"({i}) {USER_TEXT}"),
            ChatMessage(id=f"a{i}", role="assistant", tool_calls=(call,)),
            ChatMessage(id=f"t{i}", role="tool", content=REPLY_TEXT, tool_call_id=call.id),
            ChatMessage(id=f"r{i}", role="assistant", content=REPLY_TEXT),
        ]
        i += 1
    return tuple(out[:n])


def _frames() -> list[bytes]:
    """The reply: 50 content chunks, usage, then [DONE], each one chunked-encoding frame."""
    base = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    events: list[dict[str, Any]] = []
    for k in range(CHUNKS):
        delta: dict[str, Any] = {"content": REPLY_TEXT[k % len(REPLY_TEXT)]}
        if k == 0:
            delta["role"] = "assistant"
        finish = "stop" if k == CHUNKS - 1 else None
        events.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    usage = {"prompt_tokens": 1000, "completion_tokens": CHUNKS, "total_tokens": 1000 + CHUNKS}
    events.append({**base, "choices": [], "usage": usage})
    payloads = [b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events]
    payloads.append(b"data: [DONE]\n\n")
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in payloads] + [b"0\r\n\r\n"]


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that drops its connection is no failure of the benchmark


class _Server:
    """A loopback chat-completions server: every POST gets the same 50-chunk stream."""

    def __init__(self) -> None:
        frames = _frames()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, chunked replies
            disable_nagle_algorithm = True  # TCP_NODELAY: each chunk leaves at once

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n\r\n"
                )
                for frame in frames:
                    self.wfile.write(frame)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _floor(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> float:
    """Seconds from posting ``body`` to the first complete event; the rest is read too."""
    start = time.perf_counter()
    first = 0.0
    with client.stream("POST", url, content=body, headers=headers) as response:
        seen = b""
        for piece in response.iter_raw():
            if not first:
                seen += piece
                if b"\n\n" in seen:
                    first = time.perf_counter() - start
    if not first:
        raise RuntimeError("the floor read no event")
    return first


def _ours(model: OpenAICompatibleModel, request: ChatRequest) -> float:
    """Seconds from the call to the first chunk with content; the stream is read to its end."""
    start = time.perf_counter()
    first = 0.0
    for chunk in model.chat_stream(request, AbortSignal()):
        if chunk.content_delta and not first:
            first = time.perf_counter() - start
    if not first:
        raise RuntimeError("the model streamed no content")
    return first


def bench_first_token(tmp: Path, emit: Emit) -> None:
    """Time to first token at 141 and 1,061 messages: floor, ours, and the added time."""
    del tmp  # nothing is written
    server = _Server()
    model = OpenAICompatibleModel(base_url=server.url, model="m", api_key="sk-bench-not-a-key")
    url = f"{server.url}/chat/completions"
    headers = {
        "Authorization": "Bearer sk-bench-not-a-key",
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
    }
    try:
        with httpx.Client(timeout=30) as client:
            for n in SIZES:
                request = ChatRequest(messages=history(n), tools=TOOLS, session_id="bench")
                body = msgspec.json.encode(model._request(request))  # prebuilt, as sent
                for _ in range(WARMUP):
                    _floor(client, url, body, headers)
                    _ours(model, request)
                gc.collect()
                floors: list[float] = []
                ours: list[float] = []
                for k in range(RUNS):  # interleaved, each going first every other time
                    if k % 2:
                        ours.append(_ours(model, request))
                        floors.append(_floor(client, url, body, headers))
                    else:
                        floors.append(_floor(client, url, body, headers))
                        ours.append(_ours(model, request))
                added = statistics.median(o - f for o, f in zip(ours, floors, strict=True))
                extra: dict[str, object] = {"messages": n, "chunks": CHUNKS, "runs": RUNS}
                extra["body_kib"] = round(len(body) / 1024, 1)
                emit("first_token_floor_ms", statistics.median(floors) * 1e3, "ms", **extra)
                emit("first_token_ms", statistics.median(ours) * 1e3, "ms", **extra)
                emit("first_token_added_ms", added * 1e3, "ms", target_ms=TARGET_ADDED_MS, **extra)
    finally:
        server.close()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="aalis-bench-") as tmpdir:
        bench_first_token(Path(tmpdir), emit_json)
