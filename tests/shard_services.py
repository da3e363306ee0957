"""Services for the worker processes of ``tests/test_process_shards.py`` (module-level
functions: a worker builds its services from a pickled reference to one).

The model answers at once: "好的 <n>" for a plain message, and for a message
``block <dir>`` a call of the ``block`` tool, which writes ``<dir>/started-<pid>`` and waits
until ``<dir>/release`` exists (then "released"); the turn then replies."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from aalis_agent.events import ToolCall
from aalis_agent.services import ScriptedModel, ScriptedReply, Services, Tool, ToolRegistry


def _reply(request: Any, n: int) -> ScriptedReply:
    last = request.messages[-1]
    text = last.content if isinstance(last.content, str) else ""
    if last.role == "user" and "block " in text:
        folder = text.split("block ", 1)[1].strip()
        call = ToolCall(id=f"b{n}", name="block", arguments=json.dumps({"dir": folder}))
        return ScriptedReply(tool_calls=(call,))
    return ScriptedReply(text=f"好的 {n}")


def _block(args: Any, ctx: Any) -> str:
    folder = Path(args["dir"])
    (folder / f"started-{os.getpid()}").write_text("", encoding="utf-8")
    deadline = time.monotonic() + 60
    while not (folder / "release").exists():
        if time.monotonic() > deadline:
            return "gave up"
        time.sleep(0.005)
    return "released"


def services() -> Services:
    return Services(
        llm=ScriptedModel(_reply, keep_requests=0),
        tools=ToolRegistry([Tool("block", _block)]),
    )


def logged_services(log_file: str) -> Services:
    """:func:`services`, with the worker's warnings logged to ``log_file``."""
    logging.basicConfig(
        filename=log_file, level=logging.WARNING, format="%(process)d %(name)s %(message)s"
    )
    return services()


def broken_services() -> Services:
    raise RuntimeError("no model configured for this shard")


def gated_services(folder: str) -> Services:
    """:func:`services`, except that while ``<folder>/hold`` exists a worker starting
    writes ``<folder>/starting-<pid>`` and waits until ``hold`` is gone."""
    gate = Path(folder)
    if (gate / "hold").exists():
        (gate / f"starting-{os.getpid()}").write_text("", encoding="utf-8")
        deadline = time.monotonic() + 60
        while (gate / "hold").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    return services()


def fails_once_services(folder: str) -> Services:
    """:func:`services`, except that a worker starting while ``<folder>/fail`` exists
    removes it and raises (a configuration service away for a moment)."""
    fail = Path(folder) / "fail"
    if fail.exists():
        fail.unlink()
        raise ConnectionError("the configuration service did not answer")
    return services()


def slow_once_services(folder: str) -> Services:
    """:func:`services`, except that a worker starting while ``<folder>/slow`` exists
    removes it and takes a minute: one start that outlasts a short ``start_timeout_s``."""
    slow = Path(folder) / "slow"
    if slow.exists():
        slow.unlink()
        time.sleep(60)
    return services()


class _Opaque:
    """An object of a class of its own: msgpack cannot carry it."""


def odd_payload_services() -> Services:
    """:func:`services`, with a hook publishing on the bus at each turn's opening: an
    event with a set (carried as a list), one with an object msgpack cannot carry, then
    ``custom:ok``."""
    built = services()
    bus = built.bus
    opened = [0]

    def republish(topic: str, payload: Any) -> None:
        opened[0] += 1
        bus.publish("custom:set", {"n": opened[0], "tags": {"a"}})
        bus.publish("custom:opaque", {"n": opened[0], "value": _Opaque()})
        bus.publish("custom:ok", {"n": opened[0]})

    bus.subscribe("turn:opened", republish)
    return built
