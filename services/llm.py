"""The llm port: a streaming chat model, and the scripted model that stands in for one.

Stream chunks follow the original framework's shape: text deltas, reasoning deltas, tool
calls (accepted from any chunk), tool-call progress (index, name, characters so far),
``done`` and ``usage`` (None means unknown, distinct from 0).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ChatMessage, ToolCall
from aalis_agent.request.limits import MAX_DEPTH, json_too_deep, toml_too_deep
from aalis_agent.services.abort import AbortSignal

MAX_CHUNKS = 100_000
"""Most pieces a scripted reply may be streamed in (a file's ``chunks``)."""
MAX_CHUNK_DELAY_S = 3600.0
"""Longest wait between two chunks of a scripted reply (a file's ``chunk_delay_s``)."""
REPLY_CHARS_PER_TOKEN = 128
"""Characters a model's output token can hold at most (cl100k's longest token is 128
bytes, and a character at least one): :func:`reply_limit` allows that many a token."""

__all__ = [
    "ChatModel",
    "ChatRequest",
    "ScriptedModel",
    "ScriptedReply",
    "StreamChunk",
    "ThinkLevel",
    "ToolCallProgress",
    "Usage",
    "reply_limit",
]


def reply_limit(model: Any) -> int:
    """The most characters a call's reply (its text and reasoning together), or one tool
    call's arguments, may take: what the model's output limit can hold
    (``max_output_tokens`` × :data:`REPLY_CHARS_PER_TOKEN`; 4,096 tokens: 524,288). A
    stream past it is a broken or hostile endpoint: it is cut there (the call ``cut``, as
    at the output limit), so that counting and storing it stays bounded."""
    tokens = getattr(model, "max_output_tokens", None)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        tokens = 4096
    return tokens * REPLY_CHARS_PER_TOKEN


class ThinkLevel(msgspec.Struct, frozen=True, kw_only=True):
    """A thinking level a model declares (SET2): its id, the name the UI shows, and what
    the provider sends for it (``reasoning_effort`` on OpenAI-compatible servers)."""

    id: str
    name: str = ""
    effort: str | None = None

    @property
    def label(self) -> str:
        return self.name or self.id


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token usage a provider reports for one call."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cached_prompt_tokens: int | None = None

    def sane(self) -> Usage:
        """These counts as the runtime keeps them: a count that is not an integer from
        0 to 2**53 (a server's nonsense: negative, fractional, past what the log and
        JSON hold exactly) is dropped, as if the provider had not given it."""
        fields = (
            self.prompt_tokens,
            self.completion_tokens,
            self.total_tokens,
            self.cached_prompt_tokens,
        )
        if all(v is None or (type(v) is int and 0 <= v <= _MAX_COUNT) for v in fields):
            return self
        kept = [v if type(v) is int and 0 <= v <= _MAX_COUNT else None for v in fields]
        return Usage(
            prompt_tokens=kept[0],
            completion_tokens=kept[1],
            total_tokens=kept[2],
            cached_prompt_tokens=kept[3],
        )


_MAX_COUNT = 2**53  # counts past this are not exact as JSON numbers


class ToolCallProgress(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call being generated: announced with its callId while its arguments grow."""

    index: int
    name: str
    call_id: str
    chars_accumulated: int = 0


class StreamChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of a streamed reply."""

    content_delta: str | None = None
    reasoning_delta: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_progress: ToolCallProgress | None = None
    done: bool = False
    usage: Usage | None = None
    cut: bool = False
    """On the last chunk: the reply was cut off at the output limit (a server's
    ``finish_reason`` ``length``), so its last tool call's arguments may be incomplete."""


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What one model call sends (ACC1: session id and purpose ride along)."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()
    model: str | None = None
    think: str | None = None
    session_id: str | None = None
    purpose: str = "对话"


class ChatModel(Protocol):
    """A streaming chat model. ``chat_stream`` stops yielding soon after ``abort`` is set.

    A model may also declare ``name`` (shown in listings), ``think_levels`` (a tuple of
    :class:`ThinkLevel`) and ``default_think`` (the id of its default level); the llm
    service reads them with defaults when absent.
    """

    id: str
    provider_id: str
    context_length: int
    max_output_tokens: int

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]: ...


class ScriptedReply(msgspec.Struct, frozen=True, kw_only=True):
    """One scripted response: text and/or tool calls, streamed in ``chunks`` pieces."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    chunks: int = 1
    chunk_delay_s: float = 0.0
    usage: Usage | None = None


Responder = Callable[[ChatRequest, int], ScriptedReply]


def _refuse_unknown_keys(raw: object) -> None:
    """A key a model script's reply (or its tool call, or usage) does not know is an
    error naming it, as in every other input file: a misspelt ``txt`` would otherwise be
    dropped and its reply be empty. Anything not shaped as a list of tables is left for
    the conversion to name."""
    if not isinstance(raw, list):
        return
    for n, reply in enumerate(raw, 1):
        if not isinstance(reply, dict):
            continue
        _known(reply, ScriptedReply, f"reply {n}")
        calls = reply.get("tool_calls")
        if isinstance(calls, list):
            for k, call in enumerate(calls, 1):
                if isinstance(call, dict):
                    _known(call, ToolCall, f"reply {n}: tool call {k}")
        usage = reply.get("usage")
        if isinstance(usage, dict):
            _known(usage, Usage, f"reply {n}: usage")


def _known(table: dict[Any, Any], kind: type[msgspec.Struct], where: str) -> None:
    fields = kind.__struct_fields__
    for key in table:
        if key not in fields:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(fields))})")


def _kind(value: object, toml: bool) -> str:
    """What a value read from a TOML or JSON file is, in that file's words."""
    if isinstance(value, dict):
        return "a table" if toml else "an object"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, int | float) else type(value).__name__


_AT_REPLY = re.compile(r"^(?P<problem>.*) - at `\$\[(?P<index>\d+)\]\.?(?P<path>.*)`$", re.S)


def _where_invalid(exc: msgspec.ValidationError) -> str:
    """A wrong value in a model script, named as its reply and key are elsewhere
    (``reply 2: usage: prompt_tokens: Expected `int | null`, got `str```), not by the
    list's 0-based index (``$[1].usage.prompt_tokens``)."""
    text = str(exc)
    found = _AT_REPLY.match(text)
    if found is None:
        return text
    parts = [f"reply {int(found['index']) + 1}"]
    for key in found["path"].split(".") if found["path"] else ():
        call = re.fullmatch(r"tool_calls\[(\d+)\]", key)
        parts.append(f"tool call {int(call[1]) + 1}" if call else key)
    return f"{': '.join(parts)}: {found['problem']}"


def _replies_checked(replies: Any) -> list[ScriptedReply]:
    """``replies`` as a list, each a :class:`ScriptedReply`, or a TypeError naming the
    first that is not (a bare text would be read letter by letter, or fail mid-turn)."""
    if isinstance(replies, str | bytes):
        raise TypeError(
            "ScriptedModel takes a list of ScriptedReply or a function (request, n), "
            f"not a {type(replies).__name__}: write [ScriptedReply(text={replies!r:.60})]"
        )
    listed = list(replies)
    for k, reply in enumerate(listed):
        if not isinstance(reply, ScriptedReply):
            hint = f": write ScriptedReply(text={reply!r:.60})" if isinstance(reply, str) else ""
            raise TypeError(
                f"ScriptedModel reply {k} is {type(reply).__name__} {reply!r:.80}, "
                f"not a ScriptedReply{hint}"
            )
    return listed


def _check_responder(fn: Callable[..., Any]) -> None:
    """A TypeError now, naming the function, if it cannot be called as ``fn(request, n)``
    (it would fail every turn, each with a TypeError from deep in the call)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(None, 0)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"a ScriptedModel function is called as fn(request, n) (the request and the "
            f"call's number); {name}{signature} cannot be: {exc}"
        ) from None


class ScriptedModel:
    """A model that answers from a script: a list of replies used in order, or a function.

    The latest ``keep_requests`` requests (1,000 by default) are kept in
    :attr:`requests`, so tests can assert on exactly what was sent; :attr:`calls` counts
    them all. Delays wait on the abort signal, so a stop abandons the stream at once.
    """

    def __init__(
        self,
        replies: Sequence[ScriptedReply] | Responder = (),
        *,
        default: ScriptedReply | None = None,
        model_id: str = "scripted",
        provider_id: str = "demo",
        context_length: int = 32_000,
        max_output_tokens: int = 4096,
        name: str | None = None,
        think_levels: Sequence[ThinkLevel] = (),
        default_think: str | None = None,
        keep_requests: int = 1000,
    ) -> None:
        self.id = model_id
        self.provider_id = provider_id
        self.context_length = context_length
        self.max_output_tokens = max_output_tokens
        self.name = name or model_id
        self.think_levels = tuple(think_levels)
        self.default_think = default_think
        self._responder: Responder | None = replies if callable(replies) else None
        self._replies = [] if callable(replies) else _replies_checked(replies)
        if self._responder is not None:
            _check_responder(self._responder)
        self._default = default or ScriptedReply(text="好的。")
        self._lock = threading.Lock()
        self.requests: list[ChatRequest] = []
        self.calls = 0
        self._keep = max(keep_requests, 0)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> ScriptedModel:
        """Replies from a TOML file (``[[replies]]`` tables) or a JSON list, in call order.

        Each reply takes the fields of :class:`ScriptedReply`; ``tool_calls`` is a list of
        ``{id, name, arguments}`` with ``arguments`` as the raw text the model streams
        (so malformed JSON can be scripted), ``usage`` a table of token counts.
        """
        from aalis_agent.services.files import read_text_file

        path = Path(path)
        text = read_text_file(path, "model script")
        toml = path.suffix == ".toml"
        deep = toml_too_deep(text) if toml else json_too_deep(text, MAX_DEPTH)
        if deep:  # refused before a recursive parser sees it
            raise ConfigError(f"{path}: not a model script: nested deeper than {MAX_DEPTH} levels")
        # A TOML script named otherwise is read as JSON: say so, or the JSON error
        # alone leaves its reader guessing.
        hint = "" if toml else " (read as JSON: a TOML script's name ends in .toml)"
        try:
            if toml:
                table = tomllib.loads(text)
                if "replies" not in table:
                    raise ValueError("no [[replies]] table (one per model call, in order)")
                raw = table["replies"]
            else:
                raw = json.loads(text)
            if not isinstance(raw, list):
                what = "replies" if toml else "the JSON document"
                raise ValueError(f"{what} must be a list of replies, got {_kind(raw, toml)}")
            _refuse_unknown_keys(raw)
            replies = msgspec.convert(raw, list[ScriptedReply])
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: not a model script{hint}: {_where_invalid(exc)}") from None
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not a model script{hint}: {exc}") from None
        for n, reply in enumerate(replies, 1):
            if not 1 <= reply.chunks <= MAX_CHUNKS:
                raise ConfigError(f"{path}: reply {n}: chunks must be 1..{MAX_CHUNKS}")
            if not 0 <= reply.chunk_delay_s <= MAX_CHUNK_DELAY_S:  # NaN fails too
                raise ConfigError(
                    f"{path}: reply {n}: chunk_delay_s must be 0..{MAX_CHUNK_DELAY_S:g} "
                    f"seconds, got {reply.chunk_delay_s}"
                )
        return cls(replies, **kwargs)

    def _next(self, request: ChatRequest) -> ScriptedReply:
        with self._lock:
            self.calls += 1
            n = self.calls
            if self._keep:
                self.requests.append(request)
                if len(self.requests) > 2 * self._keep:
                    del self.requests[: -self._keep]
            if self._responder is not None:
                reply = self._responder(request, n)
                if not isinstance(reply, ScriptedReply):
                    raise TypeError(
                        f"the ScriptedModel's function returned {type(reply).__name__} "
                        f"{reply!r:.80} for call {n}, not a ScriptedReply"
                    )
                return reply
            if self._replies:
                return self._replies.pop(0)
            return self._default

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        reply = self._next(request)
        pieces = max(reply.chunks, 1)
        text = reply.text
        size = -(-len(text) // pieces) if text else 0
        if reply.reasoning:
            yield StreamChunk(reasoning_delta=reply.reasoning)
        for i in range(pieces):
            if reply.chunk_delay_s and abort.wait(reply.chunk_delay_s):
                return  # stopped: the stream is abandoned
            if abort.aborted:
                return
            delta = text[i * size : (i + 1) * size] if size else ""
            if delta:
                yield StreamChunk(content_delta=delta)
        for index, call in enumerate(reply.tool_calls):
            yield StreamChunk(
                tool_call_progress=ToolCallProgress(
                    index=index,
                    name=call.name,
                    call_id=call.id,
                    chars_accumulated=len(call.arguments),
                )
            )
        yield StreamChunk(tool_calls=reply.tool_calls, done=True, usage=reply.usage)
