"""The OpenAI-compatible provider's HTTP streaming against a real loopback server: retries
on 429 and 5xx (Retry-After, backoff, budget, never after the reply began, abortable),
the ``reasoning_effort`` refusal, Server-Sent Events cut at awkward places, malformed
events, kept connections and a stop on a silent server."""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from aalis_agent.events import ChatMessage
from aalis_agent.services import AbortSignal, ChatRequest, StreamChunk, openai_compat
from aalis_agent.services.openai_compat import (
    OpenAICompatibleModel,
    ProviderError,
    _Events,
    _inflated,
    list_server_models,
)

from tests.harness import LoopbackServer


def sse(obj: dict[str, Any], end: str = "\n") -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}{end}{end}".encode()


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def frame(data: bytes) -> bytes:
    """One chunk of a chunked body: the client reads it apart from its neighbours."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass
class Reply:
    """What the server answers one POST with."""

    status: int = 200
    pieces: Sequence[bytes] = ()  # the body, one chunk each (200)
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "overloaded"  # the error's message (other statuses)
    done: bool = True  # ends with data: [DONE]
    drop: bool = False  # the connection is cut after the pieces, mid-body
    hold: threading.Event | None = None  # after the pieces, silent until this is set
    hold_answer: threading.Event | None = None  # before the status line, silent until set
    gzip: bool = False  # the body gzipped (though the client asks for identity)


OK = Reply(pieces=[sse(chunk({"content": "好"}, "stop"))])


class Server(LoopbackServer):
    """An HTTP/1.1 chat-completions server (keep-alive, chunked, TCP_NODELAY) on loopback
    whose replies the test scripts."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[dict[str, Any]] = []
        self.ports: list[int] = []  # the client's port for each request
        self.paths: list[str] = []  # each request's target, as sent
        self.holding = threading.Event()  # a request is held before its answer
        self.listing = b""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True
            timeout = 10  # an idle kept connection is let go

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(outer.listing)))
                self.end_headers()
                self.wfile.write(outer.listing)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append(json.loads(body))
                outer.ports.append(self.client_address[1])
                outer.paths.append(self.path)
                reply = outer.replies.pop(0) if outer.replies else OK
                if reply.hold_answer is not None:
                    outer.holding.set()
                    reply.hold_answer.wait(30)
                if reply.status != 200:
                    error = json.dumps({"error": {"message": reply.message, "type": "x"}})
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(error.encode())))
                    self.end_headers()
                    self.wfile.write(error.encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                packer = zlib.compressobj(wbits=31) if reply.gzip else None
                if packer is not None:
                    self.send_header("Content-Encoding", "gzip")
                self.end_headers()

                def packed(data: bytes) -> bytes:
                    if packer is None or not data:
                        return data
                    return packer.compress(data) + packer.flush(zlib.Z_SYNC_FLUSH)

                try:
                    for piece in reply.pieces:
                        self.wfile.write(frame(packed(piece)))
                    if reply.hold is not None:
                        reply.hold.wait(30)
                    if reply.drop:
                        self.close_connection = True
                        return
                    end = frame(packed(b"data: [DONE]\n\n")) if reply.done else b""
                    if packer is not None:
                        end += frame(packer.flush())
                    self.wfile.write(end + b"0\r\n\r\n")  # in one write: ends at once
                except OSError:
                    self.close_connection = True

        self.serve(Handler)
        self.httpd.handle_error = lambda *args: None  # type: ignore[method-assign]


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    for reply in s.replies:
        for event in (reply.hold, reply.hold_answer):
            if event is not None:
                event.set()
    s.close()


class Signal(AbortSignal):
    """An abort signal that records the waits asked of it; unless ``sleep``, it answers
    them at once (a test of what is waited need not wait it)."""

    def __init__(self, sleep: bool = False) -> None:
        super().__init__()
        self.sleep = sleep
        self.waits: list[float | None] = []
        self.woken: list[bool] = []
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.waiting.set()
        woken = super().wait(timeout if self.sleep else 0)
        self.woken.append(woken)
        return woken


REQ = ChatRequest(messages=(ChatMessage(id="u", role="user", content="你好"),), session_id="s")


def model(server: Server, **kw: Any) -> OpenAICompatibleModel:
    return OpenAICompatibleModel(base_url=server.url, model="m", api_key="sk-test-stream", **kw)


def text(out: list[StreamChunk]) -> str:
    return "".join(c.content_delta or "" for c in out)


# --- retries ---------------------------------------------------------------------------


def test_a_429_is_retried_after_the_seconds_retry_after_names(server: Server) -> None:
    server.replies += [Reply(429, headers={"Retry-After": "2"}), OK]
    signal = Signal()
    out = list(model(server).chat_stream(REQ, signal))
    assert text(out) == "好" and out[-1].done
    assert signal.waits == [2.0]
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]


def test_retry_after_may_be_an_http_date(server: Server) -> None:
    later = email.utils.formatdate(time.time() + 3, usegmt=True)
    server.replies += [Reply(429, headers={"Retry-After": later}), OK]
    signal = Signal()
    assert text(list(model(server).chat_stream(REQ, signal))) == "好"
    (wait,) = signal.waits
    assert wait is not None and 0 < wait <= 3  # whole seconds: what is left of them


def test_a_retry_after_date_already_past_backs_off_as_if_none_were_named(
    server: Server,
) -> None:
    """A server whose clock is behind ours names a time already gone: the call does not
    come straight back (three retries in a row at once), it backs off."""
    earlier = email.utils.formatdate(time.time() - 600, usegmt=True)
    server.replies += [Reply(429, headers={"Retry-After": earlier})] * 2 + [OK]
    signal = Signal()
    out = list(model(server, retry_backoff_s=0.25).chat_stream(REQ, signal))
    assert text(out) == "好" and signal.waits == [0.25, 0.5]


def test_a_503_is_retried_with_exponential_backoff(server: Server) -> None:
    server.replies += [Reply(503), Reply(503), OK]
    signal = Signal()
    out = list(model(server, retry_backoff_s=0.25).chat_stream(REQ, signal))
    assert text(out) == "好"
    assert signal.waits == [0.25, 0.5]
    assert len(server.requests) == 3


def test_retries_exhausted_is_a_provider_error_naming_the_status(server: Server) -> None:
    server.replies += [Reply(503, message="upstream overloaded")] * 4 + [OK]
    signal = Signal()
    with pytest.raises(ProviderError, match=r"^InternalServerError: Error code: 503") as caught:
        list(model(server, retry_backoff_s=0.1).chat_stream(REQ, signal))
    err = caught.value
    assert "upstream overloaded" in str(err) and "after 3 retries" in str(err)
    assert (err.kind, err.status_code) == ("InternalServerError", 503)
    assert err.__cause__ is None and err.__context__ is None
    assert signal.waits == [0.1, 0.2, 0.4]
    assert len(server.requests) == 4


def test_a_retry_after_beyond_the_budget_is_not_waited(server: Server) -> None:
    server.replies += [Reply(429, headers={"Retry-After": "120"}), OK]
    signal = Signal()
    with pytest.raises(ProviderError, match=r"^RateLimitError: Error code: 429") as caught:
        list(model(server).chat_stream(REQ, signal))
    assert caught.value.status_code == 429
    assert signal.waits == [] and len(server.requests) == 1


@pytest.mark.parametrize("how", ["error event", "cut"])
def test_no_retry_once_the_reply_has_begun(server: Server, how: str) -> None:
    """A 5xx told in the stream, or a connection cut mid-body, after the first chunk: the
    error comes out, and nothing is sent again."""
    first = sse(chunk({"content": "字"}))
    if how == "error event":
        error = {"error": {"message": "upstream overloaded", "code": 503}}
        server.replies.append(Reply(pieces=[first, sse(error)], done=False))
    else:
        server.replies.append(Reply(pieces=[first], drop=True))
    signal = Signal()
    stream = model(server).chat_stream(REQ, signal)
    assert next(stream).content_delta == "字"
    expected = "APIError: upstream overloaded" if how == "error event" else "APIConnectionError: "
    with pytest.raises(ProviderError, match=f"^{expected}") as caught:
        next(stream)
    assert caught.value.__context__ is None
    assert len(server.requests) == 1 and signal.waits == []


def test_an_abort_during_the_backoff_ends_the_call_at_once(server: Server) -> None:
    server.replies += [Reply(503, headers={"Retry-After": "20"}), OK]
    signal = Signal(sleep=True)
    out: list[StreamChunk] = []
    consumer = threading.Thread(
        target=lambda: out.extend(model(server).chat_stream(REQ, signal)), daemon=True
    )
    consumer.start()
    assert signal.waiting.wait(10)
    signal.abort("stop")
    consumer.join(10)
    assert not consumer.is_alive()  # not the 20 s the server asked for
    assert out == [] and signal.waits == [20.0] and signal.woken == [True]
    assert len(server.requests) == 1  # nothing is sent after the stop


# --- reasoning_effort ------------------------------------------------------------------


@pytest.mark.parametrize(
    "refusal",
    [
        "Unrecognized request argument supplied: reasoning_effort",
        "Unsupported parameter: 'reasoning_effort' is not supported with this model.",
        "[{'type': 'extra_forbidden', 'loc': ('body', 'reasoning_effort'), "
        "'msg': 'Extra inputs are not permitted'}]",
    ],
)
def test_a_server_refusing_reasoning_effort_is_asked_again_without_it(
    server: Server, refusal: str
) -> None:
    """The 400 is answered once; the model remembers it for its later calls."""
    server.replies += [Reply(400, message=refusal), OK, OK]
    m = model(server, think_levels={"high": "high"})
    high = ChatRequest(messages=REQ.messages, think="high")
    assert text(list(m.chat_stream(high, AbortSignal()))) == "好"
    assert text(list(m.chat_stream(high, AbortSignal()))) == "好"
    assert ["reasoning_effort" in r for r in server.requests] == [True, False, False]
    assert server.requests[0]["reasoning_effort"] == "high"


def test_a_refused_effort_value_is_not_a_refused_parameter(server: Server) -> None:
    """``Unsupported value``: this level is wrong, not the parameter; nothing is retried
    and the next call still sends its level."""
    refusal = (
        "Unsupported value: 'reasoning_effort' does not support 'minimal' with this model. "
        "Supported values are: 'low', 'medium', and 'high'."
    )
    server.replies += [Reply(400, message=refusal), OK]
    m = model(server, think_levels={"minimal": "minimal", "low": "low"})
    with pytest.raises(ProviderError, match=r"^BadRequestError: Error code: 400 - Unsupported"):
        list(m.chat_stream(ChatRequest(messages=REQ.messages, think="minimal"), AbortSignal()))
    list(m.chat_stream(ChatRequest(messages=REQ.messages, think="low"), AbortSignal()))
    assert [r["reasoning_effort"] for r in server.requests] == ["minimal", "low"]


# --- the event stream ------------------------------------------------------------------


def _awkward() -> tuple[bytes, list[int]]:
    """Four events (LF and CRLF line ends, a comment, data over two lines) and the places
    to cut them: inside a character, inside ``data:``, between CR and LF, inside JSON."""
    raw = (
        sse(chunk({"content": "你好"}))
        + b": keep-alive\n\n"
        + sse(chunk({"reasoning_content": "想想"}), end="\r\n")
        + b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "\xe4\xb8\x96"}}]}\n\n'
        + sse(chunk({"content": "界"}, "stop"))
    )
    ni = raw.index("你".encode()) + 1  # 1 of its 3 bytes
    data = raw.index(b"data:", raw.index(b"keep-alive")) + 2  # "da" | "ta:"
    crlf = raw.index(b"\r\n") + 1  # CR | LF
    shi = raw.index("世".encode()) + 2  # 2 of its 3 bytes
    jie = raw.index("界".encode()) - 3  # inside the JSON, before the last character
    return raw, sorted({ni, data, crlf, shi, jie})


def test_an_event_stream_cut_at_awkward_places_reads_whole(server: Server) -> None:
    raw, cuts = _awkward()
    bounds = [0, *cuts, len(raw)]
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    server.replies.append(Reply(pieces=pieces))
    out = list(model(server).chat_stream(REQ, AbortSignal()))
    assert text(out) == "你好世界"
    assert [c.reasoning_delta for c in out if c.reasoning_delta] == ["想想"]
    assert out[-1].done


def test_the_event_parser_gives_the_same_events_wherever_the_bytes_are_cut() -> None:
    raw, _ = _awkward()
    whole = _Events()
    expected = whole.feed(raw) + whole.end()
    assert len(expected) == 4 and expected[2].startswith(b'{"choices": [{"index": 0,\n"delta"')
    for cut in range(len(raw) + 1):
        events = _Events()
        assert events.feed(raw[:cut]) + events.feed(raw[cut:]) + events.end() == expected, cut
    bytewise = _Events()
    got = [data for i in range(len(raw)) for data in bytewise.feed(raw[i : i + 1])]
    assert got + bytewise.end() == expected


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"data: {not json\n\n", "not JSON"), (b"data: [1, 2]\n\n", "not a JSON object")],
)
def test_a_malformed_event_is_a_clear_provider_error(
    server: Server, data: bytes, reason: str
) -> None:
    server.replies.append(Reply(pieces=[sse(chunk({"content": "好"})), data]))
    stream = model(server).chat_stream(REQ, AbortSignal())
    assert next(stream).content_delta == "好"
    with pytest.raises(ProviderError, match=r"^APIError: malformed event in the stream") as caught:
        next(stream)
    assert reason in str(caught.value) and caught.value.kind == "APIError"
    assert caught.value.__context__ is None


def test_an_event_the_server_does_not_close_is_still_read(server: Server) -> None:
    """The body ends right after an event's data line, with no blank line nor [DONE]."""
    last = 'data: {"choices": [{"delta": {"content": "好"}, "finish_reason": "stop"}]}'.encode()
    server.replies.append(Reply(pieces=[last], done=False))
    assert text(list(model(server).chat_stream(REQ, AbortSignal()))) == "好"


def test_a_stream_cut_short_is_an_error_not_a_whole_reply(server: Server) -> None:
    """The body ends cleanly (its last chunk sent) but the reply never said it was whole:
    no [DONE] and no finish_reason. What came is a cut reply: an APIConnectionError,
    after the text that did come was streamed."""
    server.replies.append(
        Reply(pieces=[sse(chunk({"content": "半"})), sse(chunk({"content": "句"}))], done=False)
    )
    stream = model(server).chat_stream(REQ, AbortSignal())
    assert [next(stream).content_delta for _ in range(2)] == ["半", "句"]
    with pytest.raises(ProviderError, match=r"^APIConnectionError: the stream ended before") as e:
        next(stream)
    assert e.value.kind == "APIConnectionError"


def test_a_finish_reason_without_done_is_a_whole_reply(server: Server) -> None:
    """Some servers end the body without [DONE]; a finish_reason says the reply is whole."""
    server.replies.append(Reply(pieces=[sse(chunk({"content": "好"}, "stop"))], done=False))
    chunks = list(model(server).chat_stream(REQ, AbortSignal()))
    assert text(chunks) == "好" and chunks[-1].done


MIB = b"x" * (1 << 20)


@pytest.mark.parametrize(
    "pieces",
    [
        [b'data: {"choices": [{"delta": {"content": "', *[MIB] * 17],
        [b": keep-alive ", *[MIB] * 17],
        [b"data: " + MIB[7:] + b"\n"] * 17,
    ],
    ids=["a data line without end", "a comment line without end", "an event without end"],
)
def test_an_event_past_16_mib_is_an_error_and_not_gathered_further(
    server: Server, pieces: list[bytes]
) -> None:
    """A line that does not end, or an event whose data lines are never followed by the
    blank line ending it, is not gathered past 16 MiB (a server's endless line would fill
    the memory): the call ends there with an error naming the limit."""
    server.replies.append(Reply(pieces=[sse(chunk({"content": "好"})), *pieces], done=False))
    stream = model(server).chat_stream(REQ, AbortSignal())
    assert next(stream).content_delta == "好"
    with pytest.raises(ProviderError, match=r"^APIError: an event in the stream is longer") as e:
        next(stream)
    assert "16 MiB" in str(e.value) and e.value.kind == "APIError"


def test_a_byte_order_mark_before_the_stream_is_left_out(server: Server) -> None:
    """A UTF-8 byte order mark starting the body (a server's text encoder adds it) is not
    part of the first line, however the bytes are cut: its event is read, not dropped."""
    bom = b"\xef\xbb\xbf"
    first = sse(chunk({"content": "你"}))
    pieces = [bom[:2], bom[2:] + first[:2], first[2:], sse(chunk({"content": "好"}, "stop"))]
    server.replies.append(Reply(pieces=pieces))
    assert text(list(model(server).chat_stream(REQ, AbortSignal()))) == "你好"
    later = _Events()  # only at the start: elsewhere it is a line's own text
    assert later.feed(b"data: a\n\n" + bom + b"data: b\n\n") == [b"a"]


def test_tool_call_arguments_past_what_the_output_limit_holds_are_not_read_further(
    server: Server,
) -> None:
    """``max_output_tokens`` 10: a call's arguments can hold 1,280 characters (128 a
    token). A server streaming more ends the reply there, cut at the output limit, the
    arguments kept to the 1,280; what it sends after is not read (nor held in memory)."""
    start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "echo"}}
    more = {"index": 0, "function": {"arguments": "a" * 100}}
    pieces = [sse(chunk({"tool_calls": [start]})), *[sse(chunk({"tool_calls": [more]}))] * 100]
    server.replies.append(Reply(pieces=[*pieces, sse(chunk({}, "tool_calls"))]))
    out = list(model(server, max_output_tokens=10).chat_stream(REQ, AbortSignal()))
    assert out[-1].done and out[-1].cut
    assert [(c.id, c.name, c.arguments) for c in out[-1].tool_calls] == [
        ("call_1", "echo", "a" * 1280)
    ]
    progress = [c.tool_call_progress for c in out if c.tool_call_progress is not None]
    assert len(progress) == 1 + 13 and progress[-1].chars_accumulated == 1280


def test_a_tool_call_name_past_1024_characters_is_an_error(server: Server) -> None:
    """A name growing without end (each delta adds to it) names no tool: the call ends
    with an error saying so, rather than the name growing (and being announced whole with
    each delta) for as long as the server sends."""
    more = {"index": 0, "id": "call_1", "function": {"name": "n" * 100}}
    server.replies.append(Reply(pieces=[sse(chunk({"tool_calls": [more]}))] * 100))
    stream = model(server).chat_stream(REQ, AbortSignal())
    names = [next(stream).tool_call_progress for _ in range(10)]
    assert [p.name for p in names if p is not None] == ["n" * 100 * k for k in range(1, 11)]
    with pytest.raises(ProviderError, match=r"^APIError: a tool call's name in the stream is"):
        next(stream)


def test_a_compressed_body_is_inflated_a_little_at_a_time() -> None:
    """A few kilobytes of gzip can hold gigabytes: each piece is inflated at most 64 KiB at
    a time, so an endless line in it ends at the event limit, not past the memory."""
    packer = zlib.compressobj(wbits=31)
    body = packer.compress(b"data: " + b"x" * (64 << 20)) + packer.flush()
    assert len(body) < 100_000  # one read of the connection
    sizes = [len(piece) for piece in _inflated(iter([body]), gzip=True)]
    assert max(sizes) <= 64 * 1024 and sum(sizes) == 6 + (64 << 20)
    second = zlib.compressobj(wbits=31)  # a member after one inflated in many pieces
    two = body + second.compress(b"data: more\n\n") + second.flush()
    whole = b"".join(_inflated(iter([two[:5000], two[5000:]]), gzip=True))
    assert whole == b"data: " + b"x" * (64 << 20) + b"data: more\n\n"


def test_a_compressed_body_that_cannot_be_inflated_is_a_clear_provider_error(
    server: Server,
) -> None:
    gzipped = {"Content-Encoding": "gzip"}
    server.replies.append(Reply(pieces=[b"\x1f\x8b\x08\x00 not gzip at all"], headers=gzipped))
    with pytest.raises(ProviderError, match=r"^APIError: the server's compressed answer") as e:
        list(model(server).chat_stream(REQ, AbortSignal()))
    assert "gzip" in str(e.value) and e.value.kind == "APIError"


def test_a_raw_deflate_body_is_inflated_however_its_first_bytes_are_cut() -> None:
    """``deflate`` sent raw (without its zlib wrapping) is told apart when the wrapped
    reading fails, also when that is only at its second read."""
    packer = zlib.compressobj(wbits=-15)
    body = packer.compress(b"data: hello\n\n" * 100) + packer.flush()
    for cut in range(4):
        pieces = iter([body[:cut], body[cut:]])
        assert b"".join(_inflated(pieces, gzip=False)) == b"data: hello\n\n" * 100, cut


# --- connections -----------------------------------------------------------------------


def test_a_reply_read_to_its_end_leaves_its_connection_to_the_next_call(server: Server) -> None:
    m = model(server)
    for _ in range(3):
        assert text(list(m.chat_stream(REQ, AbortSignal()))) == "好"
    assert len(server.ports) == 3 and len(set(server.ports)) == 1


def test_a_stop_ends_a_stream_whose_server_has_gone_silent(server: Server) -> None:
    """The server sends one chunk and then nothing: the stop shuts the connection down,
    the blocked read returns, and the stream ends without its final chunk."""
    hold = threading.Event()
    server.replies += [Reply(pieces=[sse(chunk({"content": "字"}))], hold=hold), OK]
    abort = AbortSignal()
    stream = model(server).chat_stream(REQ, abort)
    assert next(stream).content_delta == "字"
    rest: list[StreamChunk] = []
    consumer = threading.Thread(target=lambda: rest.extend(stream), daemon=True)
    consumer.start()
    abort.abort("stop")
    consumer.join(10)
    assert not consumer.is_alive() and not hold.is_set()  # the server never spoke again
    assert rest == []
    hold.set()
    # The connection was dropped, not kept: the next call is answered on a new one.
    assert text(list(model(server).chat_stream(REQ, AbortSignal()))) == "好"
    assert server.ports[0] != server.ports[1]


def test_a_stop_before_the_server_answers_ends_the_call_at_once(server: Server) -> None:
    """The server reads the request and says nothing (a long prompt being read): the stop
    shuts the connection down at once, not at the read timeout (30 s here)."""
    hold = threading.Event()
    server.replies += [Reply(hold_answer=hold), OK]
    abort = AbortSignal()
    out: list[StreamChunk] = []
    m = model(server, timeout_s=30)
    caller = threading.Thread(target=lambda: out.extend(m.chat_stream(REQ, abort)), daemon=True)
    caller.start()
    assert server.holding.wait(10)
    t0 = time.monotonic()
    abort.abort("stop")
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - t0 < 2.0
    assert out == []  # stopped: no reply, not even an empty one
    hold.set()
    # The next call is answered (on a connection of its own).
    assert text(list(m.chat_stream(REQ, AbortSignal()))) == "好"


def test_a_stop_while_the_connection_is_still_being_made_ends_the_call_at_once() -> None:
    """A host that does not answer the connection (here: a listener whose accept queue is
    full, so its SYNs go unanswered): the stop ends the connect, not the connect timeout
    (30 s here)."""
    import socket

    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(4):  # fill its accept queue (never accepted)
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.2)
        with socket.socket() as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                pass
            else:
                pytest.skip("this machine answers a connection to a full accept queue")
        m = OpenAICompatibleModel(base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=30)
        abort = AbortSignal()
        out: list[StreamChunk] = []
        failed: list[BaseException] = []

        def call() -> None:
            try:
                out.extend(m.chat_stream(REQ, abort))
            except BaseException as exc:
                failed.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        time.sleep(0.5)  # connecting
        t0 = time.monotonic()
        abort.abort("stop")
        caller.join(10)
        assert not caller.is_alive() and time.monotonic() - t0 < 2.0
        assert out == [] and failed == []  # stopped: nothing, and no error
    finally:
        for sock in (*fillers, listener):
            sock.close()


def test_a_stop_that_came_before_the_request_was_sent_sends_nothing_more(
    server: Server,
) -> None:
    """A stop between the 429 and its retry: the retry is not sent, and the kept
    connection the first attempt used is left alone for other calls."""
    server.replies += [Reply(429, headers={"Retry-After": "5"}), OK]
    abort = Signal(sleep=True)
    out: list[StreamChunk] = []
    m = model(server)
    caller = threading.Thread(target=lambda: out.extend(m.chat_stream(REQ, abort)), daemon=True)
    caller.start()
    assert abort.waiting.wait(10)
    abort.abort("stop")
    caller.join(10)
    assert not caller.is_alive() and out == [] and len(server.requests) == 1
    # The first attempt's connection was kept and still serves the next call.
    assert text(list(m.chat_stream(REQ, AbortSignal()))) == "好"
    assert server.ports[0] == server.ports[1]


def test_a_gzipped_stream_is_read_and_a_stop_on_it_still_ends_it_at_once(
    server: Server,
) -> None:
    """A server that gzips its events though asked not to: they are inflated as they
    come, and a stop while it is silent shuts the connection as for a plain body (it
    waited for the read timeout, 30 s here)."""
    server.replies.append(
        Reply(
            pieces=[sse(chunk({"content": "压"})), sse(chunk({"content": "缩"}, "stop"))], gzip=True
        )
    )
    assert text(list(model(server).chat_stream(REQ, AbortSignal()))) == "压缩"
    hold = threading.Event()
    server.replies.append(Reply(pieces=[sse(chunk({"content": "字"}))], hold=hold, gzip=True))
    abort = AbortSignal()
    stream = model(server, timeout_s=30).chat_stream(REQ, abort)
    assert next(stream).content_delta == "字"
    rest: list[StreamChunk] = []
    consumer = threading.Thread(target=lambda: rest.extend(stream), daemon=True)
    consumer.start()
    t0 = time.monotonic()
    abort.abort("stop")
    consumer.join(10)
    assert not consumer.is_alive() and time.monotonic() - t0 < 2.0 and rest == []
    hold.set()


def test_nothing_more_is_yielded_once_stopped_even_from_the_same_event(server: Server) -> None:
    """One event carrying reasoning, text and a tool call: a stop while the first of its
    chunks is handled ends the stream there."""
    delta = {
        "reasoning_content": "想",
        "content": "说",
        "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}],
    }
    server.replies.append(Reply(pieces=[sse(chunk(delta, "tool_calls"))]))
    abort = AbortSignal()
    stream = model(server).chat_stream(REQ, abort)
    assert next(stream).reasoning_delta == "想"
    abort.abort("stop")
    assert list(stream) == []


def test_a_listing_that_is_not_one_is_a_provider_error(server: Server) -> None:
    server.listing = b'{"models": ["a", "b"]}'
    with pytest.raises(ProviderError, match=r"^APIResponseValidationError: not a model"):
        list_server_models(server.url, None)
    server.listing = b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}]}'
    assert list_server_models(server.url, None) == ["a", "b"]


# --- proxies ---------------------------------------------------------------------------


@pytest.fixture
def fresh_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's shared HTTP clients built anew (under this test's environment)."""
    monkeypatch.setattr(openai_compat, "_clients", {})


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8000/v1", True),
        ("http://127.8.9.10/v1", True),
        ("http://[::1]:11434/v1", True),
        ("http://LOCALHOST:1234/v1", True),
        ("http://ollama.localhost/v1", True),
        ("http://localhost./v1", True),
        ("http://[::ffff:127.0.0.1]:8000/v1", True),
        ("http://127.1:8000/v1", True),
        ("http://2130706433:8000/v1", True),
        ("http://0x7f000001:8000/v1", True),
        ("http://0.0.0.0:8000/v1", True),
        ("http://[::]:8000/v1", True),
        ("http://[::1%25lo]:8000/v1", True),
        ("http://[::ffff:10.0.0.1]/v1", False),
        ("http://10.1/v1", False),
        ("http://1e100.net/v1", False),
        ("https://api.openai.com/v1", False),
        ("http://10.0.0.5:8000/v1", False),
        ("http://localhost.example.com/v1", False),
        ("http://[::1/v1", False),  # not a URL
    ],
)
def test_which_servers_are_on_this_machine(url: str, loopback: bool) -> None:
    assert openai_compat._is_loopback(url) is loopback


def test_a_server_on_this_machine_is_reached_directly_whatever_proxy_is_set(
    server: Server, fresh_clients: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy in the environment (here one that refuses every connection) is not asked
    to reach a model on loopback: the request goes straight to it."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert text(list(model(server).chat_stream(REQ, AbortSignal()))) == "好"
    assert server.paths == ["/v1/chat/completions"]  # origin-form: not via a proxy


def test_a_remote_server_is_reached_through_the_proxy_the_environment_names(
    server: Server, fresh_clients: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loopback server plays the proxy: the request for a remote host reaches it in
    absolute form, as a proxy gets it (nothing leaves this machine)."""
    monkeypatch.setenv("HTTP_PROXY", server.url.removesuffix("/v1"))
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    remote = OpenAICompatibleModel(base_url="http://model.invalid/v1", model="m", env_key=False)
    assert text(list(remote.chat_stream(REQ, AbortSignal()))) == "好"
    assert server.paths == ["http://model.invalid/v1/chat/completions"]
