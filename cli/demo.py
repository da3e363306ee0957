"""``aalis-agent demo``: live turns on the embedded defaults, then their replay.

A scripted model stands in for a real one; everything else is the real runtime: session
actors, the scheduler, turn runners, tools and the SQLite event log. The demo shows a
human-opened turn with a tool call, a message inserted mid-turn, a queued injection run
as its own turn, a malformed tool call answered with its error, and a stop whose marker
the next turn reads.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
from collections.abc import Mapping
from typing import Any, TextIO

from aalis_agent.actors.runtime import Runtime
from aalis_agent.cli.replay import render_state, replay_session, run_replay
from aalis_agent.events import EventStore, Input, Sender, SequentialIds, ToolCall, UsageError
from aalis_agent.events.open import open_store
from aalis_agent.services import (
    ChatRequest,
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    StaticSessions,
    Tool,
    ToolCallContext,
    ToolRegistry,
)

__all__ = ["DEMO_SESSION", "run_demo"]

DEMO_SESSION = "demo:room-1"
ALICE = Sender(user_id="10001", nickname="Alice")
BOB = Sender(user_id="10002", nickname="Bob")


class _Script:
    """The model's side of the demo, one reply per call, with hooks to time the story."""

    def __init__(self) -> None:
        self.streaming = threading.Event()

    def __call__(self, request: ChatRequest, n: int) -> ScriptedReply:
        if n == 1:
            call = ToolCall(id="call-weather", name="weather", arguments='{"city": "上海"}')
            return ScriptedReply(tool_calls=(call,))
        if n == 2:
            return ScriptedReply(
                text="上海明天多云，14 到 21 度；杭州明天小雨，记得带伞。", chunks=4
            )
        if n == 3:  # the model writes broken JSON arguments
            call = ToolCall(id="call-remind", name="remind", arguments='{"text": "喝水", "at": ')
            return ScriptedReply(tool_calls=(call,))
        if n == 4:
            return ScriptedReply(text="该喝水啦。")
        if n == 5:  # a long answer, stopped while it streams
            self.streaming.set()
            return ScriptedReply(text="后天的天气是这样的……" * 40, chunks=40, chunk_delay_s=0.05)
        return ScriptedReply(text="好的，上一条没说完被停下了。杭州后天转晴，18 到 25 度。")


def run_demo(db_path: str, out: TextIO | None = None) -> int:
    """Run the demo turns against ``db_path``, print the transcript, timeline and state."""
    out = sys.stdout if out is None else out
    if not db_path:  # SQLite would write to a temporary file, gone at once
        raise UsageError("--db must name a database file (or a postgresql:// URL)")
    tool_started = threading.Event()
    release_tool = threading.Event()

    def weather(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        tool_started.set()
        release_tool.wait(10)
        return f"{args.get('city', '?')}明天多云，14 到 21 度。"

    def remind(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
        return "已设好提醒"

    script = _Script()
    store = open_store(db_path)
    session_id = _free_session_id(store)
    model = ScriptedModel(script, model_id="scripted", provider_id="demo")
    services = Services(
        llm=model,
        tools=ToolRegistry([Tool("weather", weather), Tool("remind", remind)]),
        sessions=StaticSessions({session_id: SessionInfo(session_id, "qq", multi_party=True)}),
    )
    runtime = Runtime(store, services, ids=SequentialIds(), janitor=False)

    closed = threading.Event()  # the reader left (``demo | head``): wind down at once

    def say(line: str) -> None:
        try:
            out.write(line + "\n")
            out.flush()
        except BrokenPipeError:
            closed.set()
            release_tool.set()  # nothing waits for a tool nobody will see
            raise

    def on_event(topic: str, payload: Any) -> None:
        if closed.is_set():
            return
        with contextlib.suppress(BrokenPipeError):  # the main thread stops at its next line
            _show(topic, payload)

    def _show(topic: str, payload: Any) -> None:
        if topic == "turn:opened":
            say(f"  ⟳ {payload['turnId']} opened for {', '.join(payload['inputIds'])}")
        elif topic == "outbound:message":
            say(f"  ← [{payload['turnId']}] {payload['content']}")
        elif topic == "turn:ended":
            reason = f" ({payload['reason']})" if payload["reason"] else ""
            say(f"  ✓ {payload['turnId']} {payload['outcome']}{reason}")

    # The topics shown, each on its own: a topic no one listens to builds no payload
    # (agent:queue lists every waiting input at each change).
    for topic in ("turn:opened", "outbound:message", "turn:ended"):
        runtime.subscribe(topic, on_event)
    room: dict[str, Any] = {"platform": "qq", "group_id": "g1"}
    try:
        say(f"Session {session_id} in {db_path} (scripted model, real runtime)\n")
        say("→ Alice: 帮我查一下明天上海的天气")
        first = runtime.submit(
            session_id, Input(id="", content="帮我查一下明天上海的天气", sender=ALICE, **room)
        )
        tool_started.wait(10)
        say("  (the weather tool is running)")
        say("→ Bob: 顺便看看杭州                 [arrives mid-turn: joins before the next call]")
        runtime.submit(session_id, Input(id="", content="顺便看看杭州", sender=BOB, **room))
        say("→ schedule: 每日提醒：喝水          [an injection: queues, runs as its own turn]")
        notice = runtime.submit(
            session_id,
            Input(
                id="", content="每日提醒：喝水", source="schedule", trigger_type="interval", **room
            ),
        )
        release_tool.set()
        first.result(30)
        notice.result(30)
        say("→ Alice: 那后天呢？")
        third = runtime.submit(session_id, Input(id="", content="那后天呢？", sender=ALICE, **room))
        script.streaming.wait(10)
        say("  (Alice presses stop while the answer streams)")
        runtime.stop(session_id, platform="qq", user_id=ALICE.user_id)
        third.result(30)
        say("→ Alice: 算了，说说杭州吧")
        last = runtime.submit(
            session_id, Input(id="", content="算了，说说杭州吧", sender=ALICE, **room)
        )
        last.result(30)
        runtime.wait_idle(30)
        request = model.requests[-1]
        markers = [m.content for m in request.messages if m.kind == "turn-stopped"]
        say(f"\nThe last turn's model read the stop marker: {markers[0] if markers else 'no'}\n")
    finally:
        release_tool.set()
        runtime.shutdown(timeout=30)
    say("Timeline, replayed from the log:")
    run_replay(store, [session_id], at=None, as_json=False, out=out)
    out.write("\n" + render_state(replay_session(store, session_id)) + "\n\n")
    store.close()
    replay = shlex.join(["aalis-agent", "replay", db_path, "--session", session_id])
    out.write(f"Replay it yourself:\n  {replay}\n  {replay} --at 20\n  {replay} --json\n")
    return 0


def _free_session_id(store: EventStore) -> str:
    existing = set(store.sessions())
    if DEMO_SESSION not in existing:
        return DEMO_SESSION
    n = 2
    while f"{DEMO_SESSION}-{n}" in existing:
        n += 1
    return f"{DEMO_SESSION}-{n}"
