"""Test doubles that let a test drive turns step by step, and wait for quiet."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pykka
from aalis_agent.actors.messages import Ping
from aalis_agent.actors.runtime import Runtime
from aalis_agent.events import ToolCall
from aalis_agent.services import AbortSignal, ChatRequest, StreamChunk, ToolCallContext
from aalis_agent.services.llm import Usage


@dataclass
class PendingCall:
    """A model call waiting for the test's answer."""

    request: ChatRequest
    abort: AbortSignal
    text: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    answered: bool = False
    abandoned: bool = False


class GatedModel:
    """A chat model whose every call waits until the test answers it (or it is aborted)."""

    id = "gated"
    provider_id = "test"
    context_length = 32_000
    max_output_tokens = 4096

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.calls: list[PendingCall] = []

    def chat_stream(self, request: ChatRequest, abort: AbortSignal) -> Iterator[StreamChunk]:
        call = PendingCall(request, abort)
        with self._cv:
            self.calls.append(call)
            self._cv.notify_all()
        abort.add_callback(self._wake)
        with self._cv:
            while not call.answered and not abort.aborted:
                self._cv.wait()
            if not call.answered:
                call.abandoned = True
                self._cv.notify_all()
                return
        if call.text:
            yield StreamChunk(content_delta=call.text)
        yield StreamChunk(tool_calls=call.tool_calls, done=True, usage=Usage(prompt_tokens=100))

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    @property
    def parked(self) -> list[PendingCall]:
        """Calls waiting for an answer (a call whose turn was stopped is on its way out)."""
        with self._cv:
            return [
                c for c in self.calls if not c.answered and not c.abandoned and not c.abort.aborted
            ]

    def wait_call(self, timeout: float = 5.0) -> PendingCall:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                parked = [c for c in self.calls if not c.answered and not c.abandoned]
                if parked:
                    return parked[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no model call is waiting")
                self._cv.wait(remaining)

    def answer(
        self, text: str = "", tool_calls: tuple[ToolCall, ...] = (), timeout: float = 5.0
    ) -> PendingCall:
        call = self.wait_call(timeout)
        with self._cv:
            call.text = text
            call.tool_calls = tool_calls
            call.answered = True
            self._cv.notify_all()
        return call


@dataclass
class GatedTool:
    """A tool handler that blocks until released; it records the contexts it ran with."""

    name: str = "slow"
    result: str = "done"
    ignore_abort: bool = True
    contexts: list[ToolCallContext] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _released: int = 0
    _running: int = 0
    _active: set[int] = field(default_factory=set)

    def __call__(self, args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        with self._cv:
            self.contexts.append(ctx)
            self._running += 1
            self._cv.notify_all()
            ticket = len(self.contexts)
            self._active.add(ticket)
            if not self.ignore_abort:
                ctx.abort.add_callback(self._wake)
            while self._released < ticket and (self.ignore_abort or not ctx.abort.aborted):
                self._cv.wait()
            self._running -= 1
            self._active.discard(ticket)
            self._cv.notify_all()
        return self.result

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    @property
    def running(self) -> int:
        """Calls inside the tool that have not been released (parked)."""
        with self._cv:
            return (
                sum(1 for t in self._active if t > self._released)
                if self.ignore_abort
                else sum(
                    1
                    for t in self._active
                    if t > self._released and not self.contexts[t - 1].abort.aborted
                )
            )

    def wait_running(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._running == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the tool is not running")
                self._cv.wait(remaining)

    def release(self, n: int = 1) -> None:
        with self._cv:
            self._released += n
            self._cv.notify_all()


def settle(
    runtime: Runtime, model: GatedModel, tools: tuple[GatedTool, ...] = (), timeout: float = 10.0
) -> None:
    """Wait until every actor has handled its mail and every running turn is parked at a
    model call or a tool the test controls (or has ended): the same quiet snapshot —
    runners, parked calls and log length — seen twice in a row."""
    deadline = time.monotonic() + timeout
    last: tuple[int, int, int] | None = None
    live = parked = 0
    while time.monotonic() < deadline:
        with runtime._lock:
            refs = [e.ref for e in runtime._entries.values()]
        for ref in refs:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.ask(Ping(), timeout=timeout)
        with runtime._runners_idle:
            live = len(runtime._runners)
        parked = len(model.parked) + sum(t.running for t in tools)
        store = runtime.store
        logged = sum(store.last_seq(s) for s in store.sessions())
        snapshot = (live, parked, logged)
        if live == parked and snapshot == last:
            return
        last = snapshot if live == parked else None
        if last is None:
            time.sleep(0.001)
    raise TimeoutError(f"runtime did not settle: {live} runners, {parked} parked")


ROOT = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str, stdin: str = "", env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``aalis-agent ARGS`` in a subprocess from the repository root, ``stdin`` piped in."""
    return subprocess.run(
        [sys.executable, "-m", "aalis_agent.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
        env=None if env is None else dict(env),
    )


class LoopbackServer:
    """A real HTTP server on 127.0.0.1 (a random port) serving ``handler`` on a thread;
    ``url`` is its OpenAI-style base URL. Subclasses build their handler, then call
    :meth:`serve`."""

    httpd: ThreadingHTTPServer

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
