"""An OpenAI-compatible streaming chat model (OpenAI, DeepSeek, Ollama, vLLM, LM Studio).

Built on the ``openai`` client library. Streams text, reasoning (``reasoning_content`` /
``reasoning`` deltas where the server sends them) and tool calls, whose arguments grow
chunk by chunk: each call is announced with its callId in a ``ToolCallProgress`` as soon
as it starts. Usage is requested in the stream. An abort closes the HTTP stream at once.
Servers that refuse ``stream_options`` or ``max_tokens`` (asking for
``max_completion_tokens``) with a 400 get the request again without / renamed, once, and
the model remembers it. Tool-call deltas without an ``index`` (some servers leave it out)
are told apart by their ids. The API key comes from the argument; else, for an
``https`` server and unless ``env_key=False``, from ``OPENAI_API_KEY`` or
``AALIS_API_KEY`` (a plain-``http`` server, typically a local one, never gets a key it
was not given). It is never logged, and never stored: the key is registered with
:mod:`services.secrets` when the model is built, and every error that leaves this module
is a :class:`ProviderError` whose message has the registered secrets masked and which
carries neither the client's exception (it holds the request's headers and the response
body, where some servers echo the key) nor a chain to it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aalis_agent.events.errors import ConfigError, ProviderError
from aalis_agent.events.schema import ChatMessage, ToolCall
from aalis_agent.services.abort import AbortSignal
from aalis_agent.services.llm import ChatRequest, StreamChunk, ThinkLevel, ToolCallProgress, Usage
from aalis_agent.services.secrets import register_secret

__all__ = ["OpenAICompatibleModel", "ProviderError", "list_server_models", "to_openai_message"]


def _register_keys(base_url: str, api_key: str | None) -> None:
    """Register the key, and a password written into the server's URL."""
    register_secret(api_key)
    with contextlib.suppress(ValueError):  # not a URL the client would take either
        register_secret(urlsplit(base_url).password)


def _env_key() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("AALIS_API_KEY")


def list_server_models(base_url: str, api_key: str | None, *, timeout_s: float = 30.0) -> list[str]:
    """The ids of the models an OpenAI-compatible server lists (``GET /models``); without
    a key a placeholder is sent, never one from the environment."""
    import openai

    _register_keys(base_url, api_key)
    client = openai.OpenAI(
        base_url=base_url,
        api_key=api_key or "not-needed",
        max_retries=0,
        timeout=timeout_s,
    )
    try:
        try:
            return [m.id for m in client.models.list()]
        except Exception as exc:
            failure = ProviderError.of(exc)
        raise failure from None  # outside the handler: no __context__ either
    finally:
        client.close()


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


@dataclass
class _Pending:
    """A tool call being streamed: its id, name and the argument text so far."""

    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _index_of(tc: Any, pending: dict[int, _Pending]) -> int:
    """The slot of a tool-call delta: its ``index``; without one (some servers leave it
    out), a delta with a new id starts the next call and one without continues the last."""
    if tc.index is not None:
        return int(tc.index)
    if not pending:
        return 0
    last = max(pending)
    if tc.id and tc.id != pending[last].id:
        return last + 1
    return last


_END = object()


def _next(chunks: Iterator[Any]) -> Any:
    """The stream's next chunk, or ``_END``; the client's errors come out as ProviderError."""
    try:
        return next(chunks, _END)
    except Exception as exc:
        failure = ProviderError.of(exc)
    raise failure from None  # outside the handler: no __context__ either


def _usage(u: Any) -> Usage:
    """Usage from a chunk; counts a server leaves out are 0, a missing total is the sum."""
    prompt = u.prompt_tokens or 0
    completion = u.completion_tokens or 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=u.total_tokens or prompt + completion,
    )


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
    ) -> None:
        import openai

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
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=key or "not-needed",  # local servers accept any key
            max_retries=0,
            timeout=timeout_s,
        )
        # what this server accepts, learnt from its 400s (see _adapt)
        self._usage_option = True
        self._max_tokens_key = "max_tokens"

    def _request(self, request: ChatRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.id,
            "messages": [to_openai_message(m) for m in request.messages],
            "stream": True,
            self._max_tokens_key: self.max_output_tokens,
        }
        if self._usage_option:
            kwargs["stream_options"] = {"include_usage": True}
        if request.tools:
            kwargs["tools"] = list(request.tools)
        if request.think is not None and request.think in self._efforts:
            kwargs["reasoning_effort"] = self._efforts[request.think]
        return kwargs

    def _open(self, request: ChatRequest) -> Any:
        """Start the streamed call; a 400 naming a parameter this server will not take is
        answered by adapting the request (see :meth:`_adapt`) and sending it again."""
        import openai

        while True:
            kwargs = self._request(request)
            try:
                return self._client.chat.completions.create(**kwargs)
            except openai.BadRequestError as e:
                if self._adapt(str(e)):
                    continue
                failure = ProviderError.of(e)
            except Exception as e:
                failure = ProviderError.of(e)
            raise failure from None  # outside the handler: no __context__ either

    def _adapt(self, message: str) -> bool:
        """Learn from a 400's message; True when the request changed and may be retried."""
        text = message.lower()
        if self._usage_option and "stream_options" in text:
            self._usage_option = False  # usage is then counted locally (ACC)
            return True
        if self._max_tokens_key == "max_tokens" and "max_completion_tokens" in text:
            self._max_tokens_key = "max_completion_tokens"
            return True
        return False

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAICompatibleModel(provider={self.provider_id!r}, model={self.id!r})"

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        if abort.aborted:
            return
        stream = self._open(request)
        closed = threading.Event()

        def close() -> None:
            if not closed.is_set():
                closed.set()
                # The HTTP response ends at once: the stream is abandoned. A failure to
                # close is not the caller's (and would be the client's unmasked exception).
                with contextlib.suppress(Exception):
                    stream.close()

        abort.add_callback(close)
        pending: dict[int, _Pending] = {}
        usage: Usage | None = None
        chunks = iter(stream)
        try:
            while (chunk := _next(chunks)) is not _END:
                if abort.aborted:
                    return
                if chunk.usage is not None:
                    usage = _usage(chunk.usage)
                for choice in chunk.choices:
                    delta = choice.delta
                    reasoning = getattr(delta, "reasoning_content", None) or getattr(
                        delta, "reasoning", None
                    )
                    if reasoning:
                        yield StreamChunk(reasoning_delta=reasoning)
                    if delta.content:
                        yield StreamChunk(content_delta=delta.content)
                    for tc in delta.tool_calls or ():
                        index = _index_of(tc, pending)
                        call = pending.get(index)
                        if call is None:
                            call_id = tc.id or f"call-{uuid.uuid4().hex[:12]}"
                            call = pending[index] = _Pending(call_id)
                        if tc.function is not None:
                            if tc.function.name:
                                call.name += tc.function.name
                            if tc.function.arguments:
                                call.arguments.append(tc.function.arguments)
                        yield StreamChunk(
                            tool_call_progress=ToolCallProgress(
                                index=index,
                                name=call.name,
                                call_id=call.id,
                                chars_accumulated=sum(len(a) for a in call.arguments),
                            )
                        )
        except Exception:
            if abort.aborted:
                return  # closed under us by a stop
            raise
        finally:
            close()
        calls = tuple(
            ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments))
            for _, c in sorted(pending.items())
        )
        yield StreamChunk(tool_calls=calls, done=True, usage=usage)
