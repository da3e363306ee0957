"""An OpenAI-compatible streaming chat model (OpenAI, DeepSeek, Ollama, vLLM, LM Studio).

The chat completions protocol spoken directly: the request body is encoded to JSON bytes
by msgspec and posted with httpx, and the reply is read as Server-Sent Events (``data:``
lines, ``[DONE]`` at the end), split only at line ends, so a character cut across two
network reads is whole again. Streams text, reasoning (``reasoning_content`` /
``reasoning`` deltas where the server sends them) and tool calls, whose arguments grow
chunk by chunk: each call is announced with its callId in a ``ToolCallProgress`` as soon
as it starts. Usage is requested in the stream; counts a server leaves out are completed.
A body that ends with neither ``[DONE]`` nor a ``finish_reason`` was cut short: that is
an ``APIConnectionError``, never a reply saved as whole. A tool call's arguments past what
the model's output limit can hold (:func:`services.llm.reply_limit`) are read no further:
the reply ends there, cut as at the output limit. A tool call's name past 1,024
characters (each delta may add to it) is an ``APIError``.
An abort closes the HTTP stream at once (its socket is shut down, so a read blocked on a
silent server returns), also while the request is still waiting for the server's answer
(a server still reading a long prompt), and ends a wait between retries at once.

Quirks of servers, learnt and remembered by the model: those that refuse
``stream_options`` or ``reasoning_effort``, or ``max_tokens`` (asking for
``max_completion_tokens``), with a 400 get the request again without / renamed, once.
Tool-call deltas without an ``index`` (some servers leave it out) are told apart by their
ids. A 429 or 5xx answer is retried (:data:`MAX_RETRIES` times, waiting as the server's
``Retry-After`` says, else backing off exponentially from :data:`RETRY_BACKOFF_S`, at
most :data:`MAX_RETRY_WAIT_S` in all); a reply that has begun is never sent again.

The API key comes from the argument; else, for an ``https`` server and unless
``env_key=False``, from ``OPENAI_API_KEY`` or ``AALIS_API_KEY`` (a plain-``http`` server,
typically a local one, never gets a key it was not given). It is never logged, and never
stored: the key is registered with :mod:`services.secrets` when the model is built, and
every error that leaves this module is a :class:`ProviderError` whose message has the
registered secrets masked and which carries neither the HTTP client's exception (it holds
the request's headers) nor the response, nor a chain to them. Error kinds keep the names
the ``openai`` library gives them (``BadRequestError``, ``RateLimitError``,
``APIConnectionError``…), so logs and stored errors read as before.

All models share one HTTP client (its connection pool and TLS context are built once per
process; a second one, which ignores proxy settings, serves servers on this machine); a
connection whose reply was read to its end is kept for the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import email.utils
import ipaddress
import json
import math
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
import msgspec
from aalis_agent.events.errors import ConfigError, ProviderError
from aalis_agent.events.schema import ChatMessage, ToolCall
from aalis_agent.services.abort import AbortSignal
from aalis_agent.services.llm import (
    ChatRequest,
    StreamChunk,
    ThinkLevel,
    ToolCallProgress,
    Usage,
    reply_limit,
)
from aalis_agent.services.secrets import register_secret

__all__ = ["OpenAICompatibleModel", "ProviderError", "list_server_models", "to_openai_message"]

MAX_RETRIES = 3
"""How many times a call answered 429 or 5xx is sent again (by default)."""
RETRY_BACKOFF_S = 0.5
"""The first wait before a retry when the server names none; it doubles each time."""
MAX_RETRY_WAIT_S = 30.0
"""The most a call waits between retries in all; a longer ``Retry-After`` is not waited."""
MAX_REPLY_S = 1800.0
"""The longest a reply may stream (by default): half an hour, past any real reply."""

MAX_EVENT_BYTES = 16 * 1024 * 1024
"""The most bytes one event (or any one line) of the stream may take, 16 MiB: far past a
chunk any server streams. A line that does not end, or an event that is not ended, is
not gathered further (it would fill the memory): the call ends with an ``APIError``."""

_NAME_LIMIT = 1024  # characters of a tool call's name: past any tool's
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error answer read for its message
_MESSAGE_LIMIT = 500  # characters of an error answer that is not an error object
_HEAD_LIMIT = 4096  # the start of an answer kept to say what it was
_INFLATE_PIECE = 64 * 1024  # the most bytes a compressed body is inflated to at a time
_DRAIN_LIMIT = 64 * 1024  # bytes after [DONE] read so that the connection can be kept
_DRAIN_TIMEOUT_S = 0.1  # the longest a server may take to end its reply after [DONE]

_STATUS_KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def _register_keys(base_url: str, api_key: str | None) -> None:
    """Register the key, and a password written into the server's URL."""
    register_secret(api_key)
    with contextlib.suppress(ValueError):  # not a URL the client would take either
        register_secret(urlsplit(base_url).password)


def _env_key() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("AALIS_API_KEY")


def _endpoint(base_url: str, path: str) -> str:
    return f"{base_url.rstrip('/')}/{path}"


# --- the shared HTTP client ------------------------------------------------------------

_clients: dict[bool, httpx.Client] = {}
_client_lock = threading.Lock()


def _is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine: ``localhost`` (and ``*.localhost``), an address
    in ``127.0.0.0/8`` however it is spelt (``127.1``, ``2130706433``, ``0x7f000001``,
    ``::ffff:127.0.0.1``), ``::1``, or the unspecified ``0.0.0.0`` / ``::`` (which a
    connection takes to mean this machine, and servers print as where they listen)."""
    try:
        host = (urlsplit(url).hostname or "").rstrip(".").lower()
    except ValueError:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not host or not host[0].isdigit():
            return False
        try:  # the shorter and numeric IPv4 forms a connection takes as well
            ip = ipaddress.IPv4Address(socket.inet_aton(host))
        except (OSError, ValueError):
            return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _http(loopback: bool = False) -> httpx.Client:
    """The process's HTTP client, built at first use (loading the certificate store takes
    tens of milliseconds) and closed at exit. Timeouts are set per request, retries are
    this module's, redirects are not followed. Proxies come from the environment
    (``HTTPS_PROXY``, ``NO_PROXY``…), except for a server on this machine (``loopback``):
    a local model is reached directly, never through a proxy elsewhere."""
    client = _clients.get(loopback)
    if client is None:
        with _client_lock:
            client = _clients.get(loopback)
            if client is None:
                client = httpx.Client(
                    limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
                    follow_redirects=False,
                    trust_env=not loopback,
                )
                _watch_streams(client)
                atexit.register(client.close)
                _clients[loopback] = client
    return client


# --- a stop before the answer ----------------------------------------------------------
# httpx gives a response's connection only once its headers came. A stop while the
# server has not answered yet (it may read a long prompt for a minute first) reaches the
# connection through its stream: each stream the client's connection pools open is
# wrapped, and tells the call this thread is sending (``_sending``) which stream it is.

_sending = threading.local()  # .exchange: the call this thread is sending, until answered


class _Stream(httpcore.NetworkStream):
    """A connection's stream, which names itself to the call being sent on it."""

    __slots__ = ("_inner",)

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def _used(self) -> None:
        exchange = getattr(_sending, "exchange", None)
        if exchange is not None:
            exchange.sending_on(self)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._used()
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._used()
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """A pool's network backend whose streams are :class:`_Stream`."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        exchange = getattr(_sending, "exchange", None)
        if exchange is None or _SyncStream is None or not isinstance(self._inner, _SyncBackend):
            inner = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
            return _Stream(inner)
        # As httpcore's own backend connects, but with the socket known to the call first,
        # so that a stop while the connection is still being made (a host that does not
        # answer) ends it at once.
        source = None if local_address is None else (local_address, 0)
        try:
            sock = _connect(host, port, timeout, source, exchange)
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(exc) from exc
        except OSError as exc:
            raise httpcore.ConnectError(exc) from exc
        return _Stream(_SyncStream(sock))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(*args, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


try:  # httpcore's own stream over a socket, for the connections made here
    from httpcore._backends.sync import SyncBackend as _SyncBackend
    from httpcore._backends.sync import SyncStream as _SyncStream
except ImportError:  # pragma: no cover - moved: connections are made by httpcore then
    _SyncBackend = _SyncStream = None  # type: ignore[assignment,misc]


def _connect(
    host: str,
    port: int,
    timeout: float | None,
    source: tuple[str, int] | None,
    exchange: _Exchange,
) -> socket.socket:
    """``socket.create_connection``, each socket shown to ``exchange`` before it connects
    (a stop shuts it down, which ends a connect still waiting on the host)."""
    failure: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if not exchange.connecting(sock):
                raise ConnectionAbortedError("stopped while connecting")
            sock.settimeout(timeout)
            if source is not None:
                sock.bind(source)
            sock.connect(address)
            return sock
        except ConnectionAbortedError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            if exchange.stopped:
                raise ConnectionAbortedError("stopped while connecting") from None
            failure = exc
    raise failure if failure is not None else OSError(f"no address for {host!r}")


def _watch_streams(client: httpx.Client) -> None:
    """Wrap the network backend of each of ``client``'s connection pools (its own and a
    proxy's). Reached through httpx's and httpcore's internals: should they change, a
    stop before the answer takes effect when the answer comes, as without this."""
    transports = [client._transport, *client._mounts.values()]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if isinstance(backend, httpcore.NetworkBackend) and not isinstance(backend, _Backend):
            pool._network_backend = _Backend(backend)  # type: ignore[union-attr]


def _transport_failure(exc: BaseException) -> ProviderError:
    """The masked stand-in for a failure to reach the server or to read its reply."""
    if isinstance(exc, ProviderError):
        return exc  # already said (a compressed answer that cannot be inflated)
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return ProviderError(
            f"APITimeoutError: Request timed out ({detail})", kind="APITimeoutError"
        )
    if isinstance(exc, httpx.TransportError | httpx.InvalidURL | OSError):
        return ProviderError(
            f"APIConnectionError: Connection error ({detail})", kind="APIConnectionError"
        )
    return ProviderError.of(exc)


def _message_of(raw: bytes) -> str:
    """What an error answer says: its error object's ``message`` (or the error itself when
    it is text), else the start of the answer."""
    with contextlib.suppress(msgspec.DecodeError):
        body = msgspec.json.decode(raw)
        error = body.get("error", body) if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message
    return raw.decode("utf-8", "replace").strip()[:_MESSAGE_LIMIT]


def _status_failure(status: int, message: str, retries: int = 0) -> ProviderError:
    kind = _STATUS_KINDS.get(status) or (
        "InternalServerError" if status >= 500 else "APIStatusError"
    )
    text = f"{kind}: Error code: {status}" + (f" - {message}" if message else "")
    if retries:
        text += f" (after {retries} {'retry' if retries == 1 else 'retries'})"
    return ProviderError(text, kind=kind, status_code=status)


def _read_error(response: httpx.Response) -> str:
    """The message of an error answer (at most its first 64 KiB are read); closes it."""
    raw = bytearray()
    try:
        for piece in response.iter_bytes():
            raw += piece
            if len(raw) >= _ERROR_BODY_LIMIT:
                break
    except Exception:
        pass  # what was read is the message; the status still says what happened
    finally:
        response.close()
    return _message_of(bytes(raw))


def _retry_after(headers: httpx.Headers) -> float | None:
    """The wait a server asks for: ``retry-after-ms``, or ``Retry-After`` in seconds or as
    an HTTP date; None when it names none, nothing readable, or a date already past (a
    clock that differs from ours, most likely: the call backs off as if none were named,
    rather than asking again at once)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            with contextlib.suppress(ValueError):
                seconds = float(value) * scale
                if math.isfinite(seconds) and seconds >= 0:
                    return seconds
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    left = (when - datetime.now(UTC)).total_seconds()
    return left if left > 0 else None


# --- listing ---------------------------------------------------------------------------


def list_server_models(base_url: str, api_key: str | None, *, timeout_s: float = 30.0) -> list[str]:
    """The ids of the models an OpenAI-compatible server lists (``GET /models``); without
    a key a placeholder is sent, never one from the environment."""
    _register_keys(base_url, api_key)
    client = _http(_is_loopback(base_url))
    failure: ProviderError | None = None
    try:
        response = client.get(
            _endpoint(base_url, "models"),
            headers={"Authorization": f"Bearer {api_key or 'not-needed'}"},
            timeout=timeout_s,
        )
    except Exception as exc:
        failure = _transport_failure(exc)
    if failure is not None:
        raise failure from None  # outside the handler: no __context__ either
    if not response.is_success:
        raise _status_failure(response.status_code, _message_of(response.content)) from None
    with contextlib.suppress(msgspec.DecodeError):
        listing = msgspec.json.decode(response.content)
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list):
            ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            if len(ids) == len(data):
                return ids
    start = response.content[:200].decode("utf-8", "replace")
    raise ProviderError(
        f"APIResponseValidationError: not a model listing (a JSON object whose data is a "
        f"list of models with an id): {start!r}",
        kind="APIResponseValidationError",
        status_code=response.status_code,
    ) from None


# --- the request -----------------------------------------------------------------------


def to_openai_message(m: ChatMessage) -> dict[str, Any]:
    """One message in the wire format of the chat completions API."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in m.tool_calls
        ]
        if not m.content:
            out["content"] = None
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


class _WireFunction(msgspec.Struct, gc=False):
    name: str
    arguments: str


class _WireCall(msgspec.Struct, gc=False):
    id: str
    type: str
    function: _WireFunction


class _WireMessage(msgspec.Struct, omit_defaults=True, gc=False):
    """A message as :func:`to_openai_message` writes it, built and encoded faster (no
    dict per message, nothing for the garbage collector to track)."""

    role: str
    content: str | None
    tool_calls: list[_WireCall] | msgspec.UnsetType = msgspec.UNSET
    tool_call_id: str | msgspec.UnsetType | None = msgspec.UNSET


def _wire(m: ChatMessage) -> _WireMessage:
    call_id = m.tool_call_id if m.role == "tool" else msgspec.UNSET
    if m.tool_calls:
        calls = [
            _WireCall(c.id, "function", _WireFunction(c.name, c.arguments)) for c in m.tool_calls
        ]
        return _WireMessage(m.role, m.content or None, calls, call_id)
    return _WireMessage(m.role, m.content, tool_call_id=call_id)


def _refuses_effort(text: str) -> bool:
    """Whether a 400's (lower-cased) message refuses ``reasoning_effort`` as a parameter:
    unsupported, unrecognized, unknown, not permitted... A value the server does not take
    (``Unsupported value: 'reasoning_effort' does not support 'minimal'``) is not that:
    another level may still do."""
    if "reasoning_effort" not in text or "unsupported value" in text:
        return False
    if "supported values" in text or "invalid value" in text:
        return False
    return any(
        word in text
        for word in (
            "unsupported",
            "unrecognized",
            "not support",
            "unknown",
            "extra",
            "not permitted",
            "not allowed",
            "unexpected",
        )
    )


# --- the reply -------------------------------------------------------------------------


class _Events:
    """The data of the Server-Sent Events in a byte stream, however it was split: bytes
    are cut into lines only at line ends (CR, LF or CRLF), so a character split across
    two reads is joined before it is decoded. An event's ``data:`` lines are joined by
    LF; other fields and comments carry nothing a chat completion uses. A byte order mark
    starting the stream is left out. An event or a line longer than
    :data:`MAX_EVENT_BYTES` is a ProviderError."""

    __slots__ = ("_cr", "_data", "_data_bytes", "_partial", "_partial_bytes", "_started")

    def __init__(self) -> None:
        self._partial: list[bytes] = []  # the start of a line whose end has not come
        self._data: list[bytes] = []  # the data lines of the event being read
        self._partial_bytes = self._data_bytes = 0  # the bytes in each
        self._cr = False  # the last piece ended in CR: a LF starting the next belongs to it
        self._started = False  # the first line has come (a byte order mark is left out)

    def feed(self, piece: bytes) -> list[bytes]:
        """The data of the events this piece completes."""
        if self._cr and piece.startswith(b"\n"):
            piece = piece[1:]
        self._cr = piece.endswith(b"\r")
        if b"\r" in piece:
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in piece:
            if piece:
                self._partial.append(piece)
                self._partial_bytes += len(piece)
                self._check()
            return []
        lines = piece.split(b"\n")
        if self._partial:
            self._partial.append(lines[0])
            lines[0] = b"".join(self._partial)
            self._partial = []
        if not self._started:
            self._started = True
            lines[0] = lines[0].removeprefix(b"\xef\xbb\xbf")
        tail = lines.pop()
        if tail:
            self._partial.append(tail)
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:  # an event ends
                if data:
                    joined = data[0] if len(data) == 1 else b"\n".join(data)
                    data.clear()
                    self._data_bytes = 0
                    if joined:
                        out.append(joined)
            elif line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
                self._data_bytes += len(line)
                if self._data_bytes > MAX_EVENT_BYTES:
                    raise _too_long()
            elif line == b"data":
                data.append(b"")
            elif len(line) > MAX_EVENT_BYTES:
                raise _too_long()
        self._partial_bytes = len(tail)
        self._check()
        return out

    def _check(self) -> None:
        if self._data_bytes + self._partial_bytes > MAX_EVENT_BYTES:
            raise _too_long()

    def end(self) -> list[bytes]:
        """At the end of the body: an event the server did not close with a blank line."""
        return self.feed(b"\n\n")


def _too_long() -> ProviderError:
    return ProviderError(
        f"APIError: an event in the stream is longer than {MAX_EVENT_BYTES >> 20} MiB "
        "(a line or an event that does not end)",
        kind="APIError",
    )


def _name_too_long(name: str) -> ProviderError:
    return ProviderError(
        f"APIError: a tool call's name in the stream is longer than {_NAME_LIMIT} "
        f"characters: {name[:100]!r}...",
        kind="APIError",
    )


def _malformed(data: bytes, reason: str) -> ProviderError:
    start = data[:200].decode("utf-8", "replace")
    return ProviderError(
        f"APIError: malformed event in the stream ({reason}): {start!r}", kind="APIError"
    )


def _decode(data: bytes) -> dict[str, Any]:
    """One event's data as a JSON object; anything else is a ProviderError. A lone
    surrogate escape (half an emoji, cut between two events by a server's encoder) is
    read as such, for the turn to join the halves again."""
    failure: ProviderError | None = None
    try:
        obj = msgspec.json.decode(data)
    except RecursionError:
        failure = _malformed(data, "its data is nested too deep")
    except msgspec.DecodeError as exc:
        try:  # the standard library's reader takes lone surrogate escapes
            obj = json.loads(data)
        except (ValueError, RecursionError):
            failure = _malformed(data, f"its data is not JSON: {exc}")
    if failure is not None:
        raise failure from None  # outside the handler: no __context__ either
    if not isinstance(obj, dict):
        raise _malformed(data, "its data is not a JSON object") from None
    return obj


def _stream_error(error: Any) -> ProviderError:
    """An error the server sent in the stream (``{"error": {...}}``)."""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message:
        message = "An error occurred during streaming"
    return ProviderError(f"APIError: {message}", kind="APIError")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _count(value: Any) -> int:
    """A token count as a server gives it: an integer, or a finite number past 0 (``1234.0``
    from a server that sends floats: 「不是正的有限数时」 is when the estimate stands in),
    rounded to the nearest count; anything else is 0 (none given)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and 0 < value <= _FLOAT_COUNT:  # NaN fails the test too
        return math.floor(value + 0.5)
    return 0


_FLOAT_COUNT = float(2**53)  # past this a float is no exact count (Usage.sane drops it)


def _usage(u: Mapping[str, Any]) -> Usage:
    """Usage from a chunk; counts a server leaves out are 0, a missing total is the sum."""
    prompt = _count(u.get("prompt_tokens"))
    completion = _count(u.get("completion_tokens"))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=_count(u.get("total_tokens")) or prompt + completion,
    )


@dataclass
class _Pending:
    """A tool call being streamed: its id, name and the argument text so far."""

    id: str
    place: int = 0  # its place among the calls, in the order they began
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    chars: int = 0


def _index_of(tc: Mapping[str, Any], pending: dict[int, _Pending], last: int | None) -> int:
    """The slot of a tool-call delta: its ``index``; without one (some servers leave it
    out), a delta with a new id starts the next call and one without continues the last
    (``last``: the highest slot so far, None before the first)."""
    index = tc.get("index")
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if isinstance(index, str) and index.isascii() and index.isdigit() and len(index) < 10:
        return int(index)
    if last is None:
        return 0
    call_id = _text(tc.get("id"))
    if call_id and call_id != pending[last].id:
        return last + 1
    return last


class _Exchange:
    """The response a call is reading, as the thread that stops the call sees it.

    A stop shuts the connection's socket down, so that a read blocked on it returns at
    once; the reading thread closes the response when it is done with it. Once it is done
    (or stopped) nothing is touched any more: the connection may by then be serving
    another call."""

    __slots__ = ("_lock", "_over", "_response", "_socket")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._over = False
        self._response: httpx.Response | None = None
        self._socket: socket.socket | None = None

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around sending the request and waiting for its answer on this thread: a stop
        meanwhile shuts down the connection it is sent on (see :meth:`sending_on`)."""
        _sending.exchange = self
        try:
            yield
        finally:
            _sending.exchange = None
            with self._lock:
                # Answered (or failed): that connection may go back to the pool and serve
                # another call; only a response attached after this is this call's.
                self._socket = None

    @property
    def stopped(self) -> bool:
        return self._over and self._response is None

    def connecting(self, sock: socket.socket) -> bool:
        """A socket about to connect for this call; False when stopped already."""
        with self._lock:
            if self._over:
                return False
            self._socket = sock
            return True

    def sending_on(self, stream: httpcore.NetworkStream) -> None:
        """The request is being sent, or its answer waited for, on ``stream``."""
        sock = None
        with contextlib.suppress(Exception):
            sock = stream.get_extra_info("socket")
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            if not self._over:
                self._socket = sock
                return
        # Stopped already: the read (or write) about to be made returns at once.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def attach(self, response: httpx.Response, *, raw: bool) -> bool:
        """Take the response to read; False (and it is closed) when stopped already.
        ``raw``: the body is read from the connection itself, so its socket may be shut."""
        sock = None
        if raw:
            stream = response.extensions.get("network_stream")
            with contextlib.suppress(Exception):
                sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            if not self._over:
                self._response = response
                self._socket = sock if isinstance(sock, socket.socket) else None
                return True
        response.close()
        return False

    def interrupt(self) -> None:
        """A stop, from any thread: the reply is abandoned at once."""
        with self._lock:
            if self._over:
                return
            self._over = True
            if self._socket is not None:
                # The plain socket's shutdown, also under TLS: the reader's blocked
                # recv returns; closing is left to the reader.
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(self._socket, socket.SHUT_RDWR)
                return
            response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # a failure to close is not the caller's
                response.close()

    def finish(self) -> None:
        """The reader is done: the response is closed (its connection kept when the body
        was read to its end)."""
        with self._lock:
            self._over = True
            response, self._response, self._socket = self._response, None, None
        if response is not None:
            with contextlib.suppress(Exception):
                response.close()


def _next_piece(pieces: Iterator[bytes]) -> bytes | None:
    """The body's next bytes, or None at its end; read errors come out as ProviderError."""
    failure: ProviderError | None = None
    try:
        return next(pieces, None)
    except Exception as exc:
        failure = _transport_failure(exc)
    raise failure from None  # outside the handler: no __context__ either


def _body_pieces(response: httpx.Response) -> tuple[Iterator[bytes], bool]:
    """The body's bytes as they arrive, and whether they are read raw from the connection
    (and the response not closed behind our back at the body's end, so that a stop may
    shut its socket). A server that compresses the stream though asked not to (gzip or
    deflate) is inflated here, from the raw bytes; another encoding is left to httpx."""
    stream = response.stream
    if not isinstance(stream, httpx.SyncByteStream):
        return response.iter_bytes(), False
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return iter(stream), True
    if encoding in ("gzip", "x-gzip", "deflate"):
        return _inflated(iter(stream), gzip=encoding != "deflate"), True
    return response.iter_bytes(), False


def _inflated(pieces: Iterator[bytes], *, gzip: bool) -> Iterator[bytes]:
    """Compressed body bytes inflated as they come: gzip (member after member), or
    ``deflate``, zlib-wrapped or raw as servers send it either way; at most
    :data:`_INFLATE_PIECE` bytes at a time (a few kilobytes may hold gigabytes)."""
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)
    begun: bytes | None = None if gzip else b""  # deflate's bytes read while nothing came
    for piece in pieces:
        while piece:
            failure: ProviderError | None = None
            try:
                out = inflate.decompress(piece, _INFLATE_PIECE)
            except zlib.error as exc:
                if begun is None:
                    failure = _corrupt(exc, gzip=gzip)
                else:  # deflate sent raw: read again from its start
                    piece, begun = begun + piece, None
                    inflate = zlib.decompressobj(-zlib.MAX_WBITS)
                    try:
                        out = inflate.decompress(piece, _INFLATE_PIECE)
                    except zlib.error as again:
                        failure = _corrupt(again, gzip=gzip)
            if failure is not None:
                raise failure from None  # outside the handler: no __context__ either
            if begun is not None:  # kept until something came (at most 64 KiB of it)
                begun = None if out or len(begun) > _INFLATE_PIECE else begun + piece
            while out:
                yield out
                if inflate.eof or (len(out) < _INFLATE_PIECE and not inflate.unconsumed_tail):
                    break
                # more to inflate from this piece, or held in the inflater
                out = inflate.decompress(inflate.unconsumed_tail, _INFLATE_PIECE)
            piece = inflate.unused_data
            if piece and inflate.eof and gzip:
                inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)  # the next member
            elif piece:
                break  # data after the end of a deflate stream: left out
    tail = inflate.flush()
    if tail:
        yield tail


def _corrupt(exc: zlib.error, *, gzip: bool) -> ProviderError:
    return ProviderError(
        f"APIError: the server's compressed answer cannot be inflated "
        f"({'gzip' if gzip else 'deflate'}: {exc})",
        kind="APIError",
    )


def _drain(pieces: Iterator[bytes], exchange: _Exchange) -> None:
    """Read what the server still sends after ``[DONE]`` (the end of the chunked body,
    usually in the same packet), so that the connection can serve the next call; a server
    that has not ended its reply within a moment loses the connection instead."""
    timer = threading.Timer(_DRAIN_TIMEOUT_S, exchange.interrupt)
    timer.daemon = True
    timer.start()
    try:
        left = _DRAIN_LIMIT
        for piece in pieces:
            left -= len(piece)
            if left < 0:
                break
    except Exception:
        pass  # the reply was complete; the connection is dropped, that is all
    finally:
        timer.cancel()


class _Ending:
    """How a reply's stream ended: ``done`` once its ``[DONE]`` was read."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


def _events(
    pieces: Iterator[bytes],
    exchange: _Exchange,
    deadline: float | None = None,
    ending: _Ending | None = None,
) -> Iterator[dict[str, Any]]:
    """The reply's chunks (JSON objects) up to ``[DONE]`` (noted in ``ending``) or the end
    of the body; an error the server sends in the stream, data that is not a JSON object,
    or a reply still streaming at ``deadline`` (``time.monotonic``) is a ProviderError."""
    parser = _Events()
    head = bytearray()  # the answer's start, to say what it was when it held no events
    seen = False
    while True:
        piece = _next_piece(pieces)
        if deadline is not None and piece is not None and time.monotonic() > deadline:
            raise ProviderError(
                "APITimeoutError: the reply was still streaming when its time ran out "
                "(max_reply_s)",
                kind="APITimeoutError",
            )
        if piece is not None and len(head) < _HEAD_LIMIT:
            head += piece[: _HEAD_LIMIT - len(head)]
        datas = parser.end() if piece is None else parser.feed(piece)
        for data in datas:
            seen = True
            if data.startswith(b"[DONE]"):
                if ending is not None:
                    ending.done = True
                if piece is not None:
                    _drain(pieces, exchange)
                return
            obj = _decode(data)
            error = obj.get("error")
            if error:
                raise _stream_error(error) from None
            yield obj
        if piece is None:
            if not seen:  # an HTML page, a JSON error or a whole completion: no stream
                said = _message_of(bytes(head)) or "an empty answer"
                raise ProviderError(
                    f"APIError: the server's answer is not an event stream: {said}",
                    kind="APIError",
                )
            return


class OpenAICompatibleModel:
    """A :class:`services.llm.ChatModel` speaking the OpenAI chat completions protocol."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        provider_id: str = "openai",
        context_length: int = 128_000,
        max_output_tokens: int = 4096,
        timeout_s: float = 120.0,
        think_levels: Mapping[str, str] | Sequence[ThinkLevel] | None = None,
        default_think: str | None = None,
        name: str | None = None,
        env_key: bool = True,
        max_retries: int = MAX_RETRIES,
        retry_backoff_s: float = RETRY_BACKOFF_S,
        max_retry_wait_s: float = MAX_RETRY_WAIT_S,
        max_reply_s: float | None = MAX_REPLY_S,
    ) -> None:
        """``timeout_s`` bounds each wait on the server (to connect, for the next piece);
        ``max_reply_s`` a whole reply's streaming (an endless or dripping stream ends
        with ``APITimeoutError`` then; None: no bound)."""
        from_env = env_key and base_url.lower().startswith("https://")
        key = api_key or (_env_key() if from_env else None)
        _register_keys(base_url, key)
        if not base_url:
            raise ConfigError("base_url must name the server, e.g. http://127.0.0.1:11434/v1")
        if not model:
            raise ConfigError("model must name a model the server serves")
        self.id = model
        self.provider_id = provider_id
        self.context_length = context_length
        self.max_output_tokens = max_output_tokens
        self.name = name or model
        if isinstance(think_levels, Mapping):  # level id -> reasoning_effort
            think_levels = [ThinkLevel(id=k, effort=v) for k, v in think_levels.items()]
        self.think_levels = tuple(think_levels or ())
        self.default_think = default_think
        self._efforts = {level.id: level.effort or level.id for level in self.think_levels}
        self.max_retries = max(0, max_retries)
        self.retry_backoff_s = max(0.0, retry_backoff_s)
        self.max_retry_wait_s = max(0.0, max_retry_wait_s)
        if max_reply_s is not None and not max_reply_s > 0:  # NaN fails too
            raise ConfigError(f"max_reply_s must be more than 0 seconds, got {max_reply_s}")
        self.max_reply_s = max_reply_s
        self._url = _endpoint(base_url, "chat/completions")
        self._timeout = httpx.Timeout(timeout_s)
        self._headers = {
            "Authorization": f"Bearer {key or 'not-needed'}",  # local servers accept any key
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",  # events as they are sent, none held back
        }
        self._loopback = _is_loopback(self._url)
        _http(self._loopback)  # built now rather than on the first call's clock
        # what this server accepts, learnt from its 400s (see _adapt)
        self._usage_option = True
        self._max_tokens_key = "max_tokens"
        self._effort_option = True

    def _request(self, request: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.id,
            "messages": [_wire(m) for m in request.messages],  # as to_openai_message
            "stream": True,
            self._max_tokens_key: self.max_output_tokens,
        }
        if self._usage_option:
            body["stream_options"] = {"include_usage": True}
        if request.tools:
            body["tools"] = list(request.tools)
        if self._effort_option and request.think is not None and request.think in self._efforts:
            body["reasoning_effort"] = self._efforts[request.think]
        return body

    def _encode(self, request: ChatRequest) -> tuple[bytes, bool]:
        """The request body as JSON bytes, and whether it carries ``reasoning_effort``."""
        body = self._request(request)
        failure: ProviderError | None = None
        try:
            return msgspec.json.encode(body), "reasoning_effort" in body
        except Exception as exc:  # a tool definition that is not JSON
            failure = ProviderError.of(exc)
        raise failure from None

    def _open(
        self, request: ChatRequest, abort: AbortSignal, exchange: _Exchange
    ) -> Iterator[bytes] | None:
        """Start the streamed call: the body's bytes as they arrive (given to ``exchange``),
        or None when stopped first.

        A 400 naming a parameter this server will not take is answered by adapting the
        request (see :meth:`_adapt`) and sending it again; a 429 or 5xx by waiting (as the
        server asks, else backing off) and sending it again, within the retry budget."""
        client = _http(self._loopback)
        retries = 0
        waited = 0.0
        while True:
            body, effort = self._encode(request)
            failure: ProviderError | None = None
            try:
                sent = client.build_request(
                    "POST", self._url, content=body, headers=self._headers, timeout=self._timeout
                )
                with exchange.sending():
                    response = client.send(sent, stream=True)
            except Exception as exc:
                failure = _transport_failure(exc)
            if failure is not None:
                raise failure from None  # outside the handler: no __context__ either
            status = response.status_code
            if 200 <= status < 300:
                pieces, raw = _body_pieces(response)
                return pieces if exchange.attach(response, raw=raw) else None
            asked = _retry_after(response.headers)
            message = _read_error(response)
            if status == 400 and self._adapt(message, effort=effort):
                continue
            if status == 429 or status >= 500:
                wait = asked if asked is not None else self.retry_backoff_s * 2**retries
                if retries < self.max_retries and waited + wait <= self.max_retry_wait_s:
                    retries += 1
                    waited += wait
                    if abort.wait(wait):
                        return None  # stopped while waiting: nothing more is sent
                    continue
            raise _status_failure(status, message, retries) from None

    def _adapt(self, message: str, *, effort: bool = False) -> bool:
        """Learn from a 400's message; True when the request changed and may be retried.
        ``effort``: the refused request carried ``reasoning_effort``."""
        text = message.lower()
        if self._usage_option and "stream_options" in text:
            self._usage_option = False  # usage is then counted locally (ACC)
            return True
        if self._max_tokens_key == "max_tokens" and "max_completion_tokens" in text:
            self._max_tokens_key = "max_completion_tokens"
            return True
        if effort and self._effort_option and _refuses_effort(text):
            self._effort_option = False  # think levels are then not sent to this server
            return True
        return False

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAICompatibleModel(provider={self.provider_id!r}, model={self.id!r})"

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        if abort.aborted:
            return
        exchange = _Exchange()
        abort.add_callback(exchange.interrupt)
        pending: dict[int, _Pending] = {}
        top: int | None = None  # the highest slot in pending
        usage: Usage | None = None
        ending = _Ending()
        finished = False  # a choice said why it finished (finish_reason)
        cut = False  # ... and that was the output limit (finish_reason "length")
        limit = reply_limit(self)  # a tool call's arguments past it: cut there
        over = False  # one was: the stream is read no further
        try:
            pieces = self._open(request, abort, exchange)
            if pieces is None:
                return
            deadline = None if self.max_reply_s is None else time.monotonic() + self.max_reply_s
            for chunk in _events(pieces, exchange, deadline, ending):
                if abort.aborted:
                    return
                u = chunk.get("usage")
                if isinstance(u, dict):
                    usage = _usage(u)
                choices = chunk.get("choices")
                for choice in choices if isinstance(choices, list) else ():
                    if not isinstance(choice, dict):
                        continue
                    reason = choice.get("finish_reason")
                    if reason:
                        finished = True
                        cut = reason == "length"
                    delta = choice.get("delta")
                    if not isinstance(delta, dict):
                        continue
                    reasoning = _text(delta.get("reasoning_content")) or _text(
                        delta.get("reasoning")
                    )
                    if reasoning:
                        yield StreamChunk(reasoning_delta=reasoning)
                        if abort.aborted:
                            return  # stopped while the chunk was handled
                    content = _text(delta.get("content"))
                    if content:
                        yield StreamChunk(content_delta=content)
                        if abort.aborted:
                            return  # stopped while the chunk was handled
                    tool_calls = delta.get("tool_calls")
                    for tc in tool_calls if isinstance(tool_calls, list) else ():
                        if not isinstance(tc, dict):
                            continue
                        index = _index_of(tc, pending, top)
                        call = pending.get(index)
                        if call is None:
                            call_id = _text(tc.get("id")) or f"call-{uuid.uuid4().hex[:12]}"
                            call = pending[index] = _Pending(call_id, len(pending))
                            top = index if top is None else max(top, index)
                        function = tc.get("function")
                        if isinstance(function, dict):
                            if name := _text(function.get("name")):
                                if len(call.name) + len(name) > _NAME_LIMIT:
                                    raise _name_too_long(call.name + name)
                                call.name += name
                            if arguments := _text(function.get("arguments")):
                                room = limit - call.chars
                                over = len(arguments) > room
                                arguments = arguments[:room]
                                call.arguments.append(arguments)
                                call.chars += len(arguments)
                        yield StreamChunk(
                            tool_call_progress=ToolCallProgress(
                                # Its place among the calls (the order they began in): the
                                # server's index need not start at 0 nor be contiguous.
                                index=call.place,
                                name=call.name,
                                call_id=call.id,
                                chars_accumulated=call.chars,
                            )
                        )
                        if abort.aborted:
                            return
                        if over:
                            break
                    if over:
                        break
                if over:
                    # More than the output limit can hold: a broken or hostile server. The
                    # reply is cut there, as at the output limit, and the rest not read.
                    cut = True
                    break
            if abort.aborted:
                return  # the stream ended because a stop closed it
            if not over and not ending.done and not finished:
                # The body ended (a connection closed, a length reached) before the reply
                # said it was whole: what came is a cut reply, not one to save as whole.
                raise ProviderError(
                    "APIConnectionError: the stream ended before the reply did "
                    "(no [DONE] and no finish_reason)",
                    kind="APIConnectionError",
                )
        except Exception:
            if abort.aborted:
                return  # closed under us by a stop
            raise
        finally:
            exchange.finish()
        calls = tuple(  # in the order they began, as their progress numbered them
            ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments)) for c in pending.values()
        )
        yield StreamChunk(tool_calls=calls, done=True, usage=usage, cut=cut)
