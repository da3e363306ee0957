"""Many rooms over two worker processes on one machine (``ProcessShards``).

One process runs one thread's Python at a time, so one runtime's turns use about one
core. Here 40 rooms are served by two worker processes, each a runtime over its own
SQLite log in one directory; four threads send the rooms' messages as a host's
connection handlers would. It shows:

- ``run`` from several threads (each room's messages in order), and where each room
  lives (``shard_of``: a stable hash of its id);
- ``submit``: it returns once the input is durable in its shard; the handle gives how it
  ended;
- a worker killed (SIGKILL) with a turn in its tool: the next call starts it again, the
  new worker finishes the cut turn from its log, and the input sent again under its id
  is answered from the log, not run twice;
- each shard file is an ordinary event database (``aalis-agent replay`` reads it).

Run it: ``.venv/bin/python examples/process_shards.py [DIRECTORY]`` (a new temporary
directory unless one is given). It runs offline, with a scripted model.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aalis_agent.events import ToolCall
from aalis_agent.scale.processes import ProcessShards

from aalis_agent import Input, ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry

ROOMS = [f"qq:group:{n}" for n in range(40)]


def _reply(request: Any, n: int) -> ScriptedReply:
    """The model: a message asking about the weather gets a ``weather`` call first."""
    last = request.messages[-1]
    if last.role == "user" and "天气" in last.content:
        return ScriptedReply(tool_calls=(ToolCall(id=f"w{n}", name="weather", arguments="{}"),))
    if last.role == "tool":
        return ScriptedReply(text=f"查到了: {last.content}")
    return ScriptedReply(text=f"好的 (第 {n} 次回答)")


def _weather(args: Any, ctx: Any) -> str:
    slow = Path(os.environ.get("EXAMPLE_SLOW_TOOL", "/nonexistent"))
    if slow.exists():  # the example holds one tool here while it kills the worker
        mark = slow.with_suffix(".started")  # written whole (renamed), read as it shows
        mark.with_suffix(".tmp").write_text(str(os.getpid()), encoding="utf-8")
        os.replace(mark.with_suffix(".tmp"), mark)
        time.sleep(30)
    return "上海 多云 14-21 度"


def make_services() -> Services:
    """Each worker builds its services with this (a module-level function: it is sent to
    the worker by reference)."""
    return Services(
        llm=ScriptedModel(_reply, keep_requests=0),
        tools=ToolRegistry([Tool("weather", _weather, description="今天的天气")]),
    )


def main(directory: Path) -> None:
    with ProcessShards(directory, make_services, shards=2) as shards:
        print(f"2 workers: pids {[i['pid'] for i in shards.info()]}, logs in {directory}")
        placed = Counter(shards.shard_of(room) for room in ROOMS)
        print(f"{len(ROOMS)} rooms: {placed[0]} on shard 0, {placed[1]} on shard 1")

        def converse(room: str) -> list[str]:
            return [
                shards.run(room, Input(id="", content=text)).outcome
                for text in ("你好", "明天什么天气?", "谢谢")
            ]

        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            outcomes = Counter(o for seen in pool.map(converse, ROOMS) for o in seen)
        took = time.perf_counter() - start
        print(f"{sum(outcomes.values())} turns from 4 threads in {took:.2f} s: {dict(outcomes)}")

        handle = shards.submit("qq:group:7", Input(id="late-1", content="再见"))
        print(f"submit: {handle.where}; then {handle.result(timeout=30).outcome}")

        # A worker killed while a turn is in its tool.
        flag = directory / "slow-tool"
        flag.write_text("", encoding="utf-8")
        room = "qq:group:3"
        shard = shards.shard_of(room)
        box: list[Any] = []
        call = threading.Thread(
            target=lambda: box.append(shards.run(room, Input(id="cut-1", content="天气呢?")))
        )
        call.start()
        started = flag.with_suffix(".started")
        while not started.exists():
            time.sleep(0.01)
        flag.unlink()
        pid = int(started.read_text(encoding="utf-8"))
        os.kill(pid, signal.SIGKILL)
        call.join(60)
        info = shards.info()[shard]
        print(
            f"worker {pid} of shard {shard} killed in the tool; the call was answered "
            f"{box[0].outcome!r} (the cut turn, from the log) by worker {info['pid']}, "
            f"started again ({info['restarts']} restart)"
        )
        again = shards.run(room, Input(id="cut-1", content="天气呢?"))
        same = again.turn_id == box[0].turn_id
        print(f"the same input sent again: {again.outcome!r}, from the same turn: {same}")
        print(f"next message: {shards.run(room, Input(id='', content='你好')).outcome}")
    print(f"read a shard's log: aalis-agent replay {directory / 'shard-0.db'}")


if __name__ == "__main__":  # the workers import this module: nothing runs on import
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    os.environ["EXAMPLE_SLOW_TOOL"] = str(target / "slow-tool")  # the workers inherit it
    main(target)
