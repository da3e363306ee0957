"""An asyncio multi-room bot on aalis-agent, over a tiny in-process fake chat platform.

Two rooms (``lobby``, ``garden``), three users (alice, bob, carol), a scripted model (so
it runs offline) and one tool. It shows:

- a tool call (``multiply``), and a message that arrives while the tool runs and joins
  the running turn (``pending``: the model's next call sees it);
- an injection (a reminder) that arrives while a reply streams and waits in the queue
  (``queued``), then runs as its own turn;
- ``/stop``: refused to someone who is not in the turn, obeyed for the one who is;
- every room served from one event loop: submits are awaited, turn results carry the
  reply text, and one task renders the typed event stream of all rooms.

Run it: ``.venv/bin/python examples/asyncio_bot.py``
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aalis_agent.actors.aio import AsyncHandle, AsyncRuntime, EventsDropped
from aalis_agent.events import ToolCall
from aalis_agent.services import AgentConfig
from aalis_agent.services.bus_events import (
    MessageSent,
    QueueChanged,
    StreamDelta,
    ToolExecution,
    TurnEnded,
    TurnStarted,
)

from aalis_agent import (
    ChatRequest,
    InMemoryEventStore,
    Input,
    Runtime,
    ScriptedModel,
    ScriptedReply,
    Sender,
    Services,
    Tool,
    ToolCallContext,
    ToolRegistry,
)

PLATFORM = "fake"
WHERE = {
    "opened": "opens a turn",
    "pending": "joins the running turn",
    "queued": "queued",
    "released": "released",
    "dropped": "dropped",
}


# --- the fake chat platform --------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    room: str
    user: str
    text: str
    source: str | None = None  # set for messages the bot's own timers inject


@dataclass
class FakeChat:
    """Rooms the bot is in: what people say arrives in ``inbox``; what the bot posts is
    printed (and kept per room)."""

    rooms: tuple[str, ...] = ("lobby", "garden")
    users: tuple[str, ...] = ("alice", "bob", "carol")
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    transcript: dict[str, list[str]] = field(default_factory=dict)

    async def say(self, room: str, user: str, text: str) -> None:
        self.line(room, f"{user}: {text}")
        await self.inbox.put(Message(room, user, text))

    async def inject(self, room: str, text: str, source: str) -> None:
        self.line(room, f"({source}) {text}")
        await self.inbox.put(Message(room, source, text, source=source))

    def line(self, room: str, text: str) -> None:
        self.transcript.setdefault(room, []).append(text)
        print(f"[{room}] {text}", flush=True)


def session_of(room: str) -> str:
    return f"{PLATFORM}:group:{room}"


def room_of(session_id: str) -> str:
    return session_id.rsplit(":", 1)[-1]


# --- the model and the tool --------------------------------------------------------------

TOOL_GATE = threading.Event()
"""The tool waits on it, so the demo can speak while the tool runs (a real tool would
just take its time)."""


def multiply(args: Mapping[str, Any], ctx: ToolCallContext) -> str:
    TOOL_GATE.wait(10)
    return str(int(args["a"]) * int(args["b"]))


MULTIPLY = Tool(
    "multiply",
    multiply,
    description="Multiply two integers.",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)

STORY = "Once upon a time, a gardener planted a seed that grew a little every day. " * 4


def respond(request: ChatRequest, n: int) -> ScriptedReply:
    """The scripted model: what it answers depends on what the request holds."""
    said = [m.content for m in request.messages if m.role == "user"]
    results = [m.content for m in request.messages if m.role == "tool"]
    if request.session_id == session_of("lobby"):
        if not results:
            call = ToolCall(id="call-mul", name="multiply", arguments='{"a": 17, "b": 23}')
            return ScriptedReply(tool_calls=(call,))
        product = int(results[-1])
        if any("add 1" in text for text in said):
            text = f"17 × 23 = {product}, and adding 1 makes {product + 1}."
        else:
            text = f"17 × 23 = {product}."
        return ScriptedReply(text=text, chunks=4)
    if said and "story" in said[-1]:
        return ScriptedReply(text=STORY, chunks=60, chunk_delay_s=0.05)  # ~3 s
    return ScriptedReply(text="Time to water the plants!", chunks=2)


# --- the bot -----------------------------------------------------------------------------


class Bot:
    """Takes messages from the platform, hands them to the runtime, and renders the
    runtime's events back into the rooms."""

    def __init__(self, aruntime: AsyncRuntime, chat: FakeChat) -> None:
        self.aruntime = aruntime
        self.chat = chat
        self.handles: list[tuple[str, AsyncHandle]] = []
        self.streaming: set[str] = set()
        self.seen: list[Any] = []  # every event, for the demo's script to wait on
        self.changed = asyncio.Condition()

    async def serve(self) -> None:
        while True:
            msg = await self.chat.inbox.get()
            try:
                await self.handle(msg)
            finally:
                self.chat.inbox.task_done()

    async def handle(self, msg: Message) -> None:
        session_id = session_of(msg.room)
        if msg.source is None and msg.text.startswith("/"):
            reply = await self.aruntime.acommand(
                session_id, msg.text, platform=PLATFORM, user_id=msg.user
            )
            self.chat.line(msg.room, f"bot: {reply}" if reply else "  -> stopped")
            return
        # A person's message names its sender; a timer's injection names its source.
        who: dict[str, Any] = (
            {"source": msg.source}
            if msg.source
            else {"sender": Sender(user_id=msg.user, nickname=msg.user)}
        )
        inp = Input(id="", content=msg.text, platform=PLATFORM, group_id=msg.room, **who)
        handle = await self.aruntime.asubmit(session_id, inp)
        self.chat.line(msg.room, f"  -> {msg.user}'s message {WHERE.get(handle.where, '?')}")
        self.handles.append((msg.room, handle))

    async def render(self) -> None:
        async for event in self.aruntime.events():
            if isinstance(event, EventsDropped):
                print(f"(fell behind: {event.count} events dropped)", flush=True)
                continue
            room = room_of(event.session_id or "")
            if isinstance(event, TurnStarted):
                self.chat.line(room, f"(turn opened with {len(event.input_ids)} message(s))")
            elif isinstance(event, StreamDelta) and event.turn_id not in self.streaming:
                self.streaming.add(event.turn_id)
                self.chat.line(room, "(bot is typing...)")
            elif isinstance(event, ToolExecution):
                state = "started" if event.phase == "start" else "finished"
                self.chat.line(room, f"(tool {event.name} {state})")
            elif isinstance(event, QueueChanged) and event.items:
                waiting = ", ".join(f"{i.source or 'human'} {i.state}" for i in event.items)
                self.chat.line(room, f"(waiting: {waiting})")
            elif isinstance(event, MessageSent):
                self.chat.line(room, f"bot: {event.content}")
            elif isinstance(event, TurnEnded):
                why = f", {event.reason}" if event.reason else ""
                self.chat.line(room, f"(turn ended: {event.outcome}{why})")
            async with self.changed:
                self.seen.append(event)
                self.changed.notify_all()

    async def wait_for(self, test: Any) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: any(test(e) for e in self.seen))


async def conversation(chat: FakeChat, bot: Bot) -> None:
    """What the people in the rooms do; each step waits for what it reacts to."""
    lobby, garden = session_of("lobby"), session_of("garden")
    await chat.say("lobby", "alice", "What is 17 times 23?")
    await bot.wait_for(lambda e: isinstance(e, ToolExecution) and e.session_id == lobby)
    await chat.say("lobby", "bob", "...and add 1 to it, please")
    await chat.inbox.join()  # bob's message is in before the tool returns
    TOOL_GATE.set()

    await chat.say("garden", "carol", "Tell me a long story")
    await bot.wait_for(lambda e: isinstance(e, StreamDelta) and e.session_id == garden)
    await chat.inject("garden", "Reminder: water the plants", source="reminder")
    await chat.say("garden", "bob", "/stop")  # bob is not in carol's turn: refused
    await chat.say("garden", "carol", "/stop")
    await chat.inbox.join()


async def main() -> dict[str, list[str]]:
    runtime = Runtime(
        InMemoryEventStore(),
        Services(
            llm=ScriptedModel(respond),
            tools=ToolRegistry([MULTIPLY]),
            config=AgentConfig(locale="en"),  # what the model and people read, in English
        ),
    )
    chat = FakeChat()
    async with AsyncRuntime(runtime) as aruntime:
        bot = Bot(aruntime, chat)
        tasks = [asyncio.create_task(bot.render()), asyncio.create_task(bot.serve())]
        await conversation(chat, bot)
        for room, handle in bot.handles:  # every message's turn has ended
            result = await handle
            reply = f": {result.reply!r}" if result.reply else ""
            print(f"[{room}] result {handle.input_id[:6]}..: {result.outcome}{reply}", flush=True)
        await aruntime.await_idle(30)
        tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # the event stream has ended
    print("--- transcripts ---")
    for room in chat.rooms:
        print(f"== {room} ==")
        for line in chat.transcript.get(room, []):
            print(f"  {line}")
    return chat.transcript


if __name__ == "__main__":
    asyncio.run(main())
