"""``aalis-agent chat``: talk to a session from a terminal, or script it through a pipe.

Lines typed while a turn runs go to the session at once and join or queue exactly as the
scheduler says; ``/stop`` stops the running turn; ``/session``, ``/session.set`` and
``/session.reset`` show and change the session's settings; at a terminal, Ctrl-C stops
the running turn the same way, and with no turn running it leaves; ``/model`` and ``/persona``
list the models and personas; the built-in tools (time, arithmetic) are offered to the
model and each call shows as a ``[工具]`` line; ``/quit`` (or end of input)
leaves once the last turn has ended. The reply streams as it comes, and a one-line
token-usage status follows each turn. Everything is persisted: ``aalis-agent replay DB``
shows it.

Input is read as bytes and decoded line by line: a line that is not valid UTF-8 is
reported on stderr (``chat: line 3 is not valid UTF-8; skipped``) and skipped, and the
chat goes on with the next one, so no undecodable text (no lone surrogate) reaches the
runtime.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any, TextIO

from aalis_agent.actors.commands import COMMANDS, handle_command
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.events import Input, Sender, SqliteEventStore
from aalis_agent.services import ChatModel, ChatRequest, ScriptedModel, ScriptedReply, Services
from aalis_agent.services.builtin_tools import builtin_tools

__all__ = ["default_model", "run_chat"]

CONSOLE = Sender(user_id="console", nickname="console")


def default_model() -> ScriptedModel:
    """The embedded default: a scripted model that says what it received since its last
    answer (lines that joined a running turn are answered together)."""

    def reply(request: ChatRequest, n: int) -> ScriptedReply:
        said: list[str] = []  # the user messages since the last answer, oldest first
        for m in reversed(request.messages):
            if m.role == "assistant":
                break
            if m.role == "user":
                said.insert(
                    0, m.content.split(") ", 1)[-1] if m.content.startswith("(") else m.content
                )
        return ScriptedReply(text=f"（脚本模型）收到：{' / '.join(said)}", chunks=4)

    return ScriptedModel(reply, model_id="scripted", provider_id="demo")


def _status(usage: Mapping[str, Any]) -> str:
    ratio = usage.get("usageRatio", 0.0) * 100
    return (
        f"[用量] {usage.get('used')}/{usage.get('contextWindow')} ({ratio:.1f}%) "
        f"历史 {usage.get('historyMessages')} 条" + (" 已裁剪" if usage.get("trimmed") else "")
    )


def _lines(stdin: IO[Any]) -> Iterator[tuple[int, str | None]]:
    """``(number, text)`` for each line of ``stdin``, numbered from 1, its line end (LF or
    CR LF) removed; the text is ``None`` for a line that is not valid UTF-8.
    A text stream is read through its byte buffer when it has one; a line of a text stream
    without one (a ``StringIO``) that holds a lone surrogate counts as not valid."""
    source: IO[Any] = getattr(stdin, "buffer", stdin)
    number = 0
    while raw := source.readline():  # not iteration: each line as soon as it is there
        number += 1
        text: str | None
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")  # strict: never a surrogate
            except UnicodeDecodeError:
                text = None
        else:
            text = raw
            try:
                raw.encode("utf-8")
            except UnicodeEncodeError:
                text = None
        if text is not None:
            text = text.removesuffix("\n").removesuffix("\r")
        yield number, text


def run_chat(
    db_path: str,
    session_id: str,
    model: ChatModel | None = None,
    *,
    services: Services | None = None,
    tools: bool = True,
    stdin: IO[Any] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Chat with ``session_id``; ``model`` (else ``services``' models, else the scripted
    default) answers. With ``tools``, a services without tools gets the built-in ones
    (``current_time``, ``calculate``). ``stdin`` (default: ``sys.stdin``) is read as
    UTF-8 bytes; a line that is not valid UTF-8 is reported on ``err`` (default:
    ``sys.stderr``) and skipped."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    interactive = stdin.isatty()
    services = services or Services(llm=default_model())
    if tools and not services.tools.available(None):
        for tool in builtin_tools(tz=services.tz):
            services.tools.register(tool)
    if model is not None:
        services.llm = model
    elif not services.models.providers:
        services.llm = default_model()
    store = SqliteEventStore(db_path)
    runtime = Runtime(store, services)
    lock = threading.Lock()
    last_usage: dict[str, Any] = {}
    running: set[str] = set()  # this session's turns that have opened and not ended
    held: list[str] = []  # command answers waiting for the streaming reply to end
    handles: list[SubmitHandle] = []

    def write(text: str) -> None:
        with lock:
            out.write(text)
            out.flush()

    def answer(text: str) -> None:
        """A command's answer: never in the middle of a streaming reply. While a turn of
        this session runs (or a message waits to open one), it is held and printed when
        the turn ends."""
        with lock:
            if running or any(not h.done() for h in handles):
                held.append(text)
                return
            out.write(text)
            out.flush()

    def release() -> None:
        with lock:
            if held and not running:
                out.write("".join(held))
                out.flush()
                held.clear()

    def on_event(topic: str, payload: Any) -> None:
        if payload.get("sessionId") != session_id:
            return
        if topic == "outbound:stream" and "contentDelta" in payload:
            write(payload["contentDelta"])
        elif topic == "token:usage":
            last_usage.clear()
            last_usage.update(payload)
        elif topic == "tool:execute" and payload.get("phase") == "end":
            failed = f" 失败：{payload['error'][:80]}" if payload.get("error") else ""
            write(f"\n[工具] {payload['name']}{failed}\n")
        elif topic == "outbound:message" and payload.get("kind") != "reply":
            write(f"\n{payload['content']}\n")
        elif topic == "turn:opened":
            with lock:
                running.add(payload["turnId"])
        elif topic == "turn:ended":
            reason = f"（{payload['reason']}）" if payload.get("reason") else ""
            end = "" if payload["outcome"] == "replied" else f" [{payload['outcome']}{reason}]"
            with lock:
                running.discard(payload["turnId"])
                out.write(f"{end}\n{_status(last_usage) if last_usage else ''}\n")
                out.flush()
            release()

    def on_interrupt(signum: int, frame: Any) -> None:
        """Ctrl-C: the stop button while a turn runs, else leave. The stop is asked from
        another thread: this handler may have interrupted a write holding ``lock``."""
        if not running:
            raise KeyboardInterrupt
        threading.Thread(
            target=runtime.stop,
            args=(session_id,),
            kwargs={"platform": "cli", "user_id": CONSOLE.user_id},
            daemon=True,
        ).start()

    runtime.subscribe("*", on_event)
    previous_handler = None
    if interactive:
        write(
            f"aalis-agent chat: session {session_id}, log {db_path}. "
            "/help lists the commands; Ctrl-C stops a reply; /quit leaves.\n"
        )
        if threading.current_thread() is threading.main_thread():
            previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    try:
        for number, line in _lines(stdin):
            if line is None:
                with lock:
                    err.write(f"chat: line {number} is not valid UTF-8; skipped\n")
                    err.flush()
                continue
            if not line.strip():
                continue
            if line.strip() == "/quit":
                break
            word = line.split(maxsplit=1)[0]
            if word in COMMANDS:
                reply = handle_command(runtime, session_id, line, platform="cli", user_id="console")
                if reply:
                    answer(f"{reply}\n")
                continue
            if word.startswith("/") and word.isascii() and len(word) > 1:
                answer(f"没有这个命令：{word}（/help 看有哪些）\n")
                continue
            handles.append(
                runtime.submit(
                    session_id, Input(id="", content=line, sender=CONSOLE, platform="cli")
                )
            )
        for handle in handles:
            handle.result(timeout=None)
        runtime.wait_idle(None)
        release()
    except KeyboardInterrupt:
        write("\n")
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
        runtime.shutdown(timeout=30)
        store.close()
        with lock:
            running.clear()
        release()
    write(f"Replay: aalis-agent replay {db_path} --session {session_id}\n")
    return 0
