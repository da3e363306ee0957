"""``aalis-agent chat``: talk to a session from a terminal, or script it through a pipe.

Lines typed while a turn runs go to the session at once and join or queue exactly as the
scheduler says; ``/stop`` stops the running turn; ``/session``, ``/session.set`` and
``/session.reset`` show and change the session's settings; at a terminal, Ctrl-C stops
the running turn the same way, and with no turn running it leaves; ``/model`` and ``/persona``
list the models and personas; the built-in tools (time, arithmetic) are offered to the
model and each call shows as a ``[工具]`` line; ``/quit`` (or end of input)
leaves once the last turn has ended. The reply streams as it comes, and a one-line
token-usage status follows each turn. Everything is persisted: ``aalis-agent replay DB``
shows it. A chat started on a log whose previous chat of the same session was killed
mid-turn first finishes that run's work (``Runtime.recover`` of this session only): the cut
turn is recorded (``aborted``, reason ``crash``) and the lines it had taken and not
answered are answered, their replies printed as any, while new lines are read.

Input is read as bytes and decoded line by line: a line that is not valid UTF-8 is
reported on stderr (``chat: line 3 is not valid UTF-8; skipped``) and skipped, and the
chat goes on with the next one, so no undecodable text (no lone surrogate) reaches the
runtime; it then ends with status 1, as when a line is refused (a line was not sent).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any, TextIO

from aalis_agent.actors.commands import COMMANDS, handle_command
from aalis_agent.actors.runtime import Runtime, SubmitHandle
from aalis_agent.actors.scheduler import Where
from aalis_agent.cli.main import Terminated
from aalis_agent.events import Input, InvalidInput, Sender, UsageError
from aalis_agent.events.codec import checked_session_id
from aalis_agent.events.open import open_store
from aalis_agent.request.texts import ZH, Texts
from aalis_agent.services import ChatModel, ChatRequest, ScriptedModel, ScriptedReply, Services
from aalis_agent.services.builtin_tools import builtin_tools

__all__ = ["WHERE", "default_model", "listed_limits", "run_chat"]

CONSOLE = Sender(user_id="console", nickname="console")

WHERE = {
    w: ZH(f"chat.where.{w}") for w in (Where.OPENED, Where.PENDING, Where.QUEUED, Where.RELEASED)
}
"""What a typed line's ``SubmitHandle.where`` means, shown after it at a terminal (``zh``;
a locale's: ``chat.where.<where>``)."""

NO_USAGE = ZH("chat.no_usage")
"""The status of a turn that finished no model call (stopped before the answer)."""

PROMPT = "> "


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
        return ScriptedReply(text=ZH("chat.scripted_reply", said=" / ".join(said)), chunks=4)

    return ScriptedModel(reply, model_id="scripted", provider_id="demo")


def _status(usage: Mapping[str, Any], texts: Texts = ZH) -> str:
    ratio = usage.get("usageRatio", 0.0) * 100
    line = texts(
        "chat.usage",
        used=usage.get("used"),
        window=usage.get("contextWindow"),
        ratio=f"{ratio:.1f}",
        history=usage.get("historyMessages"),
    )
    return line + (texts("chat.usage_trimmed") if usage.get("trimmed") else "")


def _where_text(texts: Texts, where: str) -> str:
    """``[where] what it means``, in ``texts``' words, after a typed line."""
    key = f"chat.where.{where}"
    try:
        note = texts(key)
    except KeyError:  # dropped, deferred, or unknown: the word again, as before
        note = texts.where(where)
    return f"[{texts.where(where)}] {note}"


def listed_limits(
    base_url: str, api_key: str | None, model: str, *, timeout_s: float = 10.0
) -> tuple[int | None, int | None]:
    """``(context length, max output tokens)`` of ``model`` as the server's model listing
    (``GET /models``) gives them, each None when it gives none (Ollama's, OpenAI's) or
    the listing cannot be read. Keys read: ``context_length``, ``max_model_len`` (vLLM),
    ``max_context_length`` (LM Studio), ``context_window``; ``max_completion_tokens``,
    ``max_output_tokens``; also under ``top_provider`` (OpenRouter). A value that is not
    a whole number from 1 to 2**31 - 1 counts as not given."""
    import httpx
    import msgspec

    try:
        response = httpx.get(
            f"{base_url.rstrip('/')}/models",
            headers={"Authorization": f"Bearer {api_key or 'not-needed'}"},
            timeout=timeout_s,
            follow_redirects=False,
        )
        listing = msgspec.json.decode(response.content) if response.is_success else None
    except Exception:  # the listing is a convenience: without it the defaults hold
        return None, None
    data = listing.get("data") if isinstance(listing, dict) else None
    entry = next((m for m in data or () if isinstance(m, dict) and m.get("id") == model), None)
    if entry is None:
        return None, None
    places = [entry, entry.get("top_provider") or {}]

    def first(*keys: str) -> int | None:
        for place in places:
            for key in keys:
                value = place.get(key) if isinstance(place, dict) else None
                if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
                    return value  # past 2**31 tokens a listing is nonsense: not taken
        return None

    return (
        first("context_length", "max_model_len", "max_context_length", "context_window"),
        first("max_completion_tokens", "max_output_tokens"),
    )


def _turn_error(runtime: Runtime, session_id: str, turn_id: str) -> str | None:
    """What the last failed model call of ``turn_id`` said (masked, as stored)."""
    from aalis_agent.events import ModelCallEnded

    errors = [
        e.error
        for e in runtime.store.read(session_id)
        if isinstance(e, ModelCallEnded) and e.turn_id == turn_id and e.error
    ]
    return errors[-1] if errors else None


class _SignalsHeld:
    """On the main thread, a Ctrl-C or SIGTERM arriving inside the block is held until
    the block is left, then handled by the handler in place before it (the command's:
    the chat leaves with 130 or 143). Around the store's closing at the chat's end, so
    that a second signal cannot cut it short: SQLite's last connection closed copies the
    WAL back and removes it (the file is left whole either way, only not tidied)."""

    __slots__ = ("_held", "_previous")

    def __enter__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._held: list[tuple[int, Any]] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._hold)

    def _hold(self, signum: int, frame: Any) -> None:
        self._held.append((signum, frame))

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._held:
            signum, frame = self._held[0]
            previous = self._previous[signum]
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signum)  # its default action, now


def _typed_lines(prompt: Any, on_ctrl_c: Any) -> Iterator[tuple[int, str | None]]:
    """Lines typed at the terminal through ``prompt`` (a prompt_toolkit
    ``PromptSession``), numbered from 1; ends at Ctrl-D, at a Ctrl-C for which
    ``on_ctrl_c()`` says False (it stops a running turn and says True), or at a SIGTERM
    (``Terminated``, raised on)."""
    number = 0
    while True:
        try:
            text = prompt.prompt(PROMPT)
        except EOFError:
            return
        except KeyboardInterrupt as exc:
            # A SIGTERM (``Terminated``) leaves whatever runs: its handler stopped the turn.
            if not isinstance(exc, Terminated) and on_ctrl_c():
                continue
            raise
        number += 1
        yield number, text


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
    sync: str | None = None,
) -> int:
    """Chat with ``session_id``; ``model`` (else ``services``' models, else the scripted
    default) answers. With ``tools``, a services without tools gets the built-in ones
    (``current_time``, ``calculate``). ``stdin`` (default: ``sys.stdin``) is read as
    UTF-8 bytes; a line that is not valid UTF-8 is reported on ``err`` (default:
    ``sys.stderr``) and skipped. At a terminal, lines are edited with prompt_toolkit
    (history, the reply printed above the input line), and each shows where it went.
    Returns 1 when a turn failed (its error in one line on ``err``) or a line was not
    sent: refused (too long for ``Runtime.max_input_bytes``: its reason on ``err``) or
    not valid UTF-8 (the next lines go on), 130 when a Ctrl-C left piped lines unsent,
    143 when a SIGTERM ended it (a running turn stopped, as a Ctrl-C stops it, then the
    chat leaves), else 0."""
    stdin = sys.stdin if stdin is None else stdin
    err = sys.stderr if err is None else err
    if stdin is None or (out is None and sys.stdout is None):
        # Started with its input (or output) closed: nothing to read lines from.
        raise UsageError("chat needs its standard input and output open")
    if not db_path:  # SQLite would keep the chat in a temporary file, gone at its end
        raise UsageError("--db must name a database file (or a postgresql:// URL)")
    # Refused here, before the database is opened: else every line would be, one by one.
    session_id = checked_session_id(session_id)
    interactive = stdin.isatty()
    # At a terminal, output goes through prompt_toolkit's stdout proxy (set below), so it
    # prints above the line being typed; ``sink`` is the stream of the moment.
    sink: list[TextIO] = [sys.stdout if out is None else out]
    services = services or Services(llm=default_model())
    if tools and not services.tools.available(None):
        for tool in builtin_tools(tz=services.tz, texts=services.texts_for("cli")):
            services.tools.register(tool)
    if model is not None:
        services.llm = model
    elif not services.models.providers:
        services.llm = default_model()
    store = open_store(db_path, sync=sync)
    runtime = Runtime(store, services)
    texts = services.texts_for("cli")  # the chat's platform
    lock = threading.Lock()
    usage: dict[str, Mapping[str, Any]] = {}  # the last token:usage of each running turn
    running: set[str] = set()  # this session's turns that have opened and not ended
    held: list[str] = []  # command answers waiting for the streaming reply to end
    handles: list[SubmitHandle] = []
    errors: list[str] = []  # the failed turns' errors, each shown once
    refused_lines: list[str] = []  # lines not sent: refused (too long, say), undecodable
    cut = False
    at_line_start = [True]
    paused: list[list[str] | None] = [None]  # output held while a typed line is sent

    def emit(text: str) -> None:  # with ``lock`` held
        if paused[0] is not None:
            paused[0].append(text)
        elif text:
            sink[0].write(text)
            sink[0].flush()
            at_line_start[0] = text.endswith("\n")

    def write(text: str) -> None:
        with lock:
            emit(text)

    def answer(text: str) -> None:
        """A command's answer: never in the middle of a streaming reply. While a turn of
        this session runs (or a message waits to open one), it is held and printed when
        the turn ends."""
        with lock:
            if running or any(not h.done() for h in handles):
                held.append(text)
                return
            emit(text)

    def release() -> None:
        with lock:
            if held and not running:
                emit("".join(held))
                held.clear()

    def report_failure(turn_id: str, reason: str | None) -> None:
        error = _turn_error(runtime, session_id, turn_id) or reason or "error"
        with lock:
            if error in errors:
                return
            errors.append(error)
            err.write(f"aalis-agent chat: error: turn failed: {error}\n")
            err.flush()

    def on_event(topic: str, payload: Any) -> None:
        if payload.get("sessionId") != session_id:
            return
        if topic == "outbound:stream" and "contentDelta" in payload:
            write(payload["contentDelta"])
        elif topic == "token:usage" and payload.get("turnId"):
            with lock:
                usage[payload["turnId"]] = payload
        elif topic == "tool:execute" and payload.get("phase") == "end":
            error = payload.get("error")
            failed = texts("chat.tool_failed", error=error[:80]) if error else ""
            write(f"\n{texts('chat.tool', name=payload['name'], failed=failed)}\n")
        elif topic == "outbound:message" and payload.get("kind") != "reply":
            write(f"\n{payload['content']}\n")
        elif topic == "turn:opened":
            with lock:
                running.add(payload["turnId"])
        elif topic == "turn:ended":
            turn_id = payload["turnId"]
            reason = texts("chat.reason", reason=payload["reason"]) if payload.get("reason") else ""
            end = "" if payload["outcome"] == "replied" else f" [{payload['outcome']}{reason}]"
            with lock:
                running.discard(turn_id)
                used = usage.pop(turn_id, None)  # this turn's own numbers, or none
                emit(f"{end}\n{_status(used, texts) if used else texts('chat.no_usage')}\n")
            if payload["outcome"] == "error":
                report_failure(turn_id, payload.get("reason"))
            release()

    def stop_running() -> bool:
        """Ctrl-C: the stop button while a turn runs (True), else leave (False). The stop
        is asked from another thread: a signal may have interrupted a write holding
        ``lock``."""
        if not running:
            return False
        threading.Thread(
            target=runtime.stop,
            args=(session_id,),
            kwargs={"platform": "cli", "user_id": CONSOLE.user_id},
            daemon=True,
        ).start()
        return True

    def on_interrupt(signum: int, frame: Any) -> None:
        if not stop_running():
            raise KeyboardInterrupt

    def on_terminate(signum: int, frame: Any) -> None:
        stop_running()  # a turn running is stopped: its reply is not waited for
        raise Terminated

    def submit(line: str, echo: bool) -> None:
        """Send a typed line, or run it as a command. ``echo``: at a terminal, show the
        line again with where it went (the prompt erased it)."""
        word = line.split(maxsplit=1)[0]
        shown = f"{PROMPT}{line}"
        if word in COMMANDS:
            if echo:
                write(("" if at_line_start[0] else "\n") + shown + "\n")
            reply = handle_command(runtime, session_id, line, platform="cli", user_id="console")
            if reply:
                answer(f"{reply}\n")
            return
        if word.startswith("/") and word.isascii() and len(word) > 1:
            if echo:
                write(("" if at_line_start[0] else "\n") + shown + "\n")
            answer(texts("chat.unknown_command", command=word) + "\n")
            return
        if not echo:
            try:
                handles.append(
                    runtime.submit(
                        session_id, Input(id="", content=line, sender=CONSOLE, platform="cli")
                    )
                )
            except InvalidInput as exc:  # refused (too long, say): said, the next goes on
                refuse(exc)
            return
        # The line and where it went are shown before anything its turn prints: output
        # that comes while it is being sent waits (never a lock held across the submit).
        with lock:
            paused[0] = []
        where = "?"
        refused: InvalidInput | None = None
        try:
            handle = runtime.submit(
                session_id, Input(id="", content=line, sender=CONSOLE, platform="cli")
            )
            handles.append(handle)
            where = handle.where
        except InvalidInput as exc:
            refused = exc
        finally:
            with lock:
                waiting, paused[0] = paused[0] or [], None
                note = _where_text(texts, where)
                shown_line = shown if len(shown) <= 2_000 else shown[:1_999] + "…"
                emit(("" if at_line_start[0] else "\n") + f"{shown_line}  {note}\n")
                emit("".join(waiting))
        if refused is not None:
            refuse(refused)

    def refuse(exc: InvalidInput) -> None:
        """A line the runtime refused: the reason on stderr, the chat goes on, and it
        ends with status 1 (a line was not sent)."""
        with lock:
            refused_lines.append(str(exc))
            err.write(f"chat: line not sent: {exc}\n")
            err.flush()

    # The topics shown, each on its own: a topic no one listens to builds no payload
    # (agent:queue lists every waiting input at each change).
    for topic in (
        "outbound:stream",
        "token:usage",
        "tool:execute",
        "outbound:message",
        "turn:opened",
        "turn:ended",
    ):
        runtime.subscribe(topic, on_event)
    previous_handler = None
    prompt_session: Any = None
    proxy: Any = contextlib.nullcontext()
    if interactive:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.patch_stdout import patch_stdout

        prompt_session = PromptSession(history=InMemoryHistory(), erase_when_done=True)
        proxy = patch_stdout(raw=True)
        write(
            f"aalis-agent chat: session {session_id}, log {db_path}. "
            "/help lists the commands; Ctrl-C stops a reply; /quit leaves.\n"
        )
        if threading.current_thread() is threading.main_thread():
            previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, on_terminate)
    terminated = False
    outer = sink[0]
    try:
        with proxy:
            if interactive:
                with lock:
                    sink[0] = sys.stdout  # the proxy
            # What a previous run of this session left (killed mid-turn): its cut turn is
            # recorded and the lines it had taken are answered now, not at the next line
            # typed. This session only: others in the file are their own runtimes' work.
            # Its output waits for the line saying so (as a typed line's does).
            with lock:
                paused[0] = []
            resumed: list[str] = []
            try:
                resumed = runtime.recover(sessions=(session_id,))
            finally:
                with lock:
                    waiting, paused[0] = paused[0] or [], None
                    if resumed:
                        emit(texts("chat.resumed") + "\n")
                    emit("".join(waiting))
            lines = _typed_lines(prompt_session, stop_running) if interactive else _lines(stdin)
            for number, line in lines:
                if line is None:
                    with lock:
                        refused_lines.append(f"line {number} is not valid UTF-8")
                        err.write(f"chat: line {number} is not valid UTF-8; skipped\n")
                        err.flush()
                    continue
                if not line.strip():
                    continue
                if line.strip() == "/quit":
                    break
                submit(line, echo=interactive)
            for handle in handles:
                handle.result(timeout=None)
            runtime.wait_idle(None)
            release()
    except KeyboardInterrupt as exc:
        write("\n")
        cut = not interactive  # piped lines left unsent (at a terminal, Ctrl-C leaves)
        terminated = isinstance(exc, Terminated)
    finally:
        try:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            if previous_term is not None:
                signal.signal(signal.SIGTERM, previous_term)
            # A second Ctrl-C or SIGTERM cuts this short (a turn ignoring its stop, say),
            # not the store's closing below: every commit taken is whole either way.
            runtime.shutdown(timeout=30)
        finally:
            with _SignalsHeld():  # a further one is handled once the store is closed
                store.close()
        with lock:
            sink[0] = outer
            running.clear()
        release()
    # Quoted for a shell: it can be pasted whatever the path or the id holds.
    replay = shlex.join(["aalis-agent", "replay", str(db_path), "--session", session_id])
    write(f"Replay: {replay}\n")
    if terminated:
        return 143
    return 130 if cut else 1 if errors or refused_lines else 0
