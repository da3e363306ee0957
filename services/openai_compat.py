"""An OpenAI-compatible streaming chat model (OpenAI, DeepSeek, Ollama, vLLM, LM Studio).

Built on the ``openai`` client library. Streams text, reasoning (``reasoning_content`` /
``reasoning`` deltas where the server sends them) and tool calls, whose arguments grow
chunk by chunk: each call is announced with its callId in a ``ToolCallProgress`` as soon
as it starts. Usage is requested in the stream. An abort closes the HTTP stream at once.
The API key comes from the argument; else, for an ``https`` server and unless
``env_key=False``, from ``OPENAI_API_KEY`` or ``AALIS_API_KEY`` (a plain-``http`` server,
typically a local one, never gets a key it was not given). It is never logged.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from events.errors import ConfigError
from events.schema import ChatMessage, ToolCall
from services.abort import AbortSignal
from services.llm import ChatRequest, StreamChunk, ThinkLevel, ToolCallProgress, Usage

__all__ = ["OpenAICompatibleModel", "list_server_models", "to_openai_message"]


def _env_key() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("AALIS_API_KEY")


def list_server_models(base_url: str, api_key: str | None, *, timeout_s: float = 30.0) -> list[str]:
    """The ids of the models an OpenAI-compatible server lists (``GET /models``); without
    a key a placeholder is sent, never one from the environment."""
    import openai

    client = openai.OpenAI(
        base_url=base_url,
        api_key=api_key or "not-needed",
        max_retries=0,
        timeout=timeout_s,
    )
    try:
        return [m.id for m in client.models.list()]
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

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAICompatibleModel(provider={self.provider_id!r}, model={self.id!r})"

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        kwargs: dict[str, Any] = {
            "model": self.id,
            "messages": [to_openai_message(m) for m in request.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_output_tokens,
        }
        if request.tools:
            kwargs["tools"] = list(request.tools)
        if request.think is not None and request.think in self._efforts:
            kwargs["reasoning_effort"] = self._efforts[request.think]
        if abort.aborted:
            return
        stream = self._client.chat.completions.create(**kwargs)
        closed = threading.Event()

        def close() -> None:
            if not closed.is_set():
                closed.set()
                stream.close()  # the HTTP response ends at once: the stream is abandoned

        abort.add_callback(close)
        pending: dict[int, _Pending] = {}
        usage: Usage | None = None
        try:
            for chunk in stream:
                if abort.aborted:
                    return
                if chunk.usage is not None:
                    usage = Usage(
                        prompt_tokens=chunk.usage.prompt_tokens,
                        completion_tokens=chunk.usage.completion_tokens,
                        total_tokens=chunk.usage.total_tokens,
                    )
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
                        call = pending.get(tc.index)
                        if call is None:
                            call_id = tc.id or f"call-{uuid.uuid4().hex[:12]}"
                            call = pending[tc.index] = _Pending(call_id)
                        if tc.function is not None:
                            if tc.function.name:
                                call.name += tc.function.name
                            if tc.function.arguments:
                                call.arguments.append(tc.function.arguments)
                        yield StreamChunk(
                            tool_call_progress=ToolCallProgress(
                                index=tc.index,
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
