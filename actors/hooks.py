"""Middleware chains (``agent:*`` hooks), prompt contributions and input preprocessors.

A middleware is ``fn(ctx, next)``: it may change ``ctx``, call ``next()`` to run the rest
of the chain (ending in the default action) and return what it returns, or not call it,
which ends the chain there — the default action does not run. The chain's result is
what the outermost middleware returns.

A contribution (``agent:prompt``) builds text for an anchor; builds run concurrently
and one that raises or outlives ``promptBuildTimeoutMs`` is absent this turn (CFG3).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from aalis_agent.events import ChatMessage, Input
from aalis_agent.events.codec import clean_text
from aalis_agent.services import ToolCallContext

__all__ = [
    "ANCHORS",
    "HOOK_KEYS",
    "MAX_FORMAT_RETRIES",
    "Anchor",
    "BuiltContribution",
    "Contribution",
    "ContributionView",
    "Hooks",
    "LlmAfter",
    "LlmBefore",
    "Middleware",
    "ReplyBefore",
    "ToolAfter",
    "ToolBefore",
    "TurnAfter",
    "TurnBefore",
]

log = structlog.get_logger("aalis.hooks")

HOOK_KEYS = (
    "agent:input:before",
    "agent:turn:before",
    "agent:llm:before",
    "agent:llm:after",
    "agent:tool:before",
    "agent:tool:after",
    "agent:reply:before",
    "agent:turn:after",
)

Anchor = Literal["identity", "knowledge", "context", "turn-context", "turn-hint"]
ANCHORS: tuple[Anchor, ...] = ("identity", "knowledge", "context", "turn-context", "turn-hint")

Middleware = Callable[[Any, Callable[[], Any]], Any]


def _refuse_async(fn: object, what: str) -> None:
    """TypeError naming ``what`` when ``fn`` is an ``async`` function (or an object with
    an ``async def __call__``): hooks are called synchronously, and its coroutine would
    never run (an ``agent:input:before`` middleware would drop every input unseen)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method, not callable()
    ):
        raise TypeError(
            f"{what}: {fn!r} is async; hooks are called synchronously (their coroutine "
            "would never run): pass a plain function (run async work with "
            "asyncio.run_coroutine_threadsafe on your loop and wait for it there)"
        )


@dataclass(frozen=True)
class ContributionView:
    """What a contribution's build sees (dryRun is true for ``token:request`` snapshots)."""

    session_id: str
    user_id: str | None
    platform: str | None
    trigger_type: str | None
    dry_run: bool
    messages: Sequence[Any]


@dataclass(frozen=True)
class Contribution:
    """An ``agent:prompt`` contribution; its injector key is ``<plugin>/<id>``."""

    plugin: str
    id: str
    anchor: Anchor
    build: Callable[[ContributionView], str | list[str] | None]

    @property
    def injector(self) -> str:
        return f"{self.plugin}/{self.id}"


@dataclass(frozen=True)
class BuiltContribution:
    """The blocks a contribution built for this turn, in order."""

    contribution: Contribution
    blocks: tuple[str, ...]


@dataclass
class Hooks:
    """Every hook chain, the contributions and the input preprocessors of a runtime."""

    _chains: dict[str, list[tuple[int, int, Middleware]]] = field(default_factory=dict)
    # Each chain as run: replaced whole on every change, read without the lock.
    _running: dict[str, tuple[Middleware, ...]] = field(default_factory=dict)
    _contributions: list[Contribution] = field(default_factory=list)
    # A build that outlived its turn's timeout and has not returned yet, by contribution:
    # that contribution is left out of later turns until it does (each would leave
    # another thread waiting on the same hung call).
    _stuck: dict[int, Future[Any]] = field(default_factory=dict)
    _preprocessors: list[Callable[[Any], Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _order: int = 0

    def use(self, key: str, middleware: Middleware, *, priority: int = 0) -> Callable[[], None]:
        """Add a middleware to ``key``'s chain (higher priority runs outer); returns a remover."""
        if key not in HOOK_KEYS:
            raise ValueError(f"unknown hook {key!r}; known: {', '.join(HOOK_KEYS)}")
        _refuse_async(middleware, key)
        with self._lock:
            self._order += 1
            entry = (-priority, self._order, middleware)
            self._chains.setdefault(key, []).append(entry)
            self._chains[key].sort(key=lambda e: (e[0], e[1]))
            self._running[key] = tuple(m for _, _, m in self._chains[key])

        def remove() -> None:
            with self._lock:
                chain = self._chains.get(key, [])
                if entry in chain:
                    chain.remove(entry)
                    self._running[key] = tuple(m for _, _, m in chain)

        return remove

    def run(self, key: str, ctx: Any, default: Callable[[Any], Any]) -> tuple[bool, Any]:
        """Run ``key``'s chain around ``default(ctx)``.

        Returns whether the default action ran (False: a middleware ended the chain
        without calling ``next()``) and what the outermost middleware returned.
        """
        chain = self._running.get(key, ())
        if not chain:
            return True, default(ctx)
        ran = False

        def call(i: int) -> Any:
            nonlocal ran
            if i == len(chain):
                ran = True
                return default(ctx)
            return chain[i](ctx, lambda: call(i + 1))

        value = call(0)
        return ran, value

    def has_middleware(self, key: str) -> bool:
        """Whether any middleware is on ``key``."""
        return bool(self._running.get(key))

    def has_contributions(self) -> bool:
        """Whether any ``agent:prompt`` contribution is registered."""
        return bool(self._contributions)

    def quiet(self, *keys: str) -> bool:
        """Whether no middleware is on any of ``keys`` and no contribution is registered:
        then nothing outside the runtime runs between a turn's open and its first call."""
        running = self._running
        return not self._contributions and not any(running.get(k) for k in keys)

    def contribute(self, contribution: Contribution) -> None:
        if contribution.anchor not in ANCHORS:
            raise ValueError(
                f"contribution {contribution.injector}: unknown anchor {contribution.anchor!r}"
            )
        _refuse_async(contribution.build, contribution.injector)
        with self._lock:
            self._contributions.append(contribution)

    def add_preprocessor(self, fn: Callable[[Any], Any]) -> None:
        """A function applied to every input before ``agent:input:before``: once per
        input (not to one sent again under an id its session received)."""
        _refuse_async(fn, "input preprocessor")
        with self._lock:
            self._preprocessors.append(fn)

    def has_preprocessors(self) -> bool:
        """Whether any input preprocessor is registered."""
        return bool(self._preprocessors)

    def preprocess(self, inp: Any) -> Any:
        with self._lock:
            fns = list(self._preprocessors)
        for fn in fns:
            inp = fn(inp)
        return inp

    def build_contributions(
        self, view: ContributionView, timeout_ms: int
    ) -> list[BuiltContribution]:
        """Build every contribution concurrently; slow or failing ones are left out (CFG3)."""
        with self._lock:
            contributions = []
            for c in self._contributions:
                stuck = self._stuck.get(id(c))
                if stuck is None:
                    contributions.append(c)
                elif stuck.done():
                    del self._stuck[id(c)]
                    contributions.append(c)
                else:
                    log.warning(
                        "prompt contribution left out: its build from an earlier turn has "
                        "not returned",
                        injector=c.injector,
                    )
        if not contributions:
            return []
        pool = ThreadPoolExecutor(
            max_workers=min(8, len(contributions)), thread_name_prefix="prompt"
        )
        futures: list[tuple[Contribution, Future[str | list[str] | None]]] = [
            (c, pool.submit(c.build, view)) for c in contributions
        ]
        built: list[BuiltContribution] = []
        timeout = None if timeout_ms <= 0 else timeout_ms / 1000
        deadline = None if timeout is None else time.monotonic() + timeout
        for contribution, future in futures:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
            try:
                value = future.result(timeout=remaining)
            except FutureTimeout:
                log.warning("prompt contribution timed out", injector=contribution.injector)
                with self._lock:
                    self._stuck[id(contribution)] = future
                continue
            except Exception:
                log.exception("prompt contribution failed", injector=contribution.injector)
                continue
            if value is None:
                continue
            built_blocks = (value,) if isinstance(value, str) else value
            if not isinstance(built_blocks, list | tuple) or not all(
                isinstance(v, str) for v in built_blocks
            ):  # left out, as a build that raises is
                log.error(
                    "prompt contribution built other than text",
                    injector=contribution.injector,
                    value=repr(value)[:200],
                )
                continue
            # As text a provider's encoder takes: lone surrogates replaced (a str
            # subclass as plain text).
            blocks = tuple(clean_text(v) for v in built_blocks if v)
            if blocks:
                built.append(BuiltContribution(contribution, blocks))
        pool.shutdown(wait=False, cancel_futures=True)
        return built


# --- hook payloads (the original framework's shapes, UPSTREAM-FACTS) --------------------

MAX_FORMAT_RETRIES = 2


@dataclass
class TurnBefore:
    turn_id: str
    session_id: str
    inputs: list[Input]


@dataclass
class LlmBefore:
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    session_id: str
    user_id: str | None
    platform: str | None
    trigger_type: str | None
    dry_run: bool = False


@dataclass
class LlmAfter:
    response: dict[str, Any]
    messages: list[ChatMessage]


@dataclass
class ToolBefore:
    name: str
    args: dict[str, Any]
    tool_call_context: ToolCallContext


@dataclass
class ToolAfter:
    name: str
    result: str | None
    tool_call_context: ToolCallContext
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplyBefore:
    content: str
    session_id: str
    platform: str | None
    user_id: str | None
    trigger_type: str | None
    archive_content: str | None = None
    retry_requested: bool = False
    retry_feedback: str | None = None
    attempt: int = 0
    max_retries: int = MAX_FORMAT_RETRIES


@dataclass
class TurnAfter:
    message: list[Input]
    reply: str | None
    outcome: str
    session_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
