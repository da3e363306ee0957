"""Tool-call pairing: which results answer which calls, whatever the call ids are.

Providers pair an assistant message's tool calls with the tool results that follow it,
by id. Ids are not globally unique: servers that number calls per response send
``call_0``, ``call_1``, ... in every response, and some send two parallel calls with one
id. So a result is never looked up by id across a whole conversation: a tool group is an
assistant message with tool calls and the results that follow it, and ids are matched
within that group only, one result per call (the k-th result with an id answers the k-th
call with that id).

- :func:`unique_call_ids` makes the ids inside one assistant message unique before its
  calls are stored, so each result names exactly one call.
- :func:`group_results` finds an assistant message's results in a request (they follow it
  at once), :func:`pair_results` pairs them with its calls.
- :func:`pairing_violations` checks a request, counting duplicate ids one call each.
"""

from __future__ import annotations

from collections.abc import Sequence

from aalis_agent.events.schema import ChatMessage, ToolCall

__all__ = [
    "DUPLICATE_MARK",
    "group_results",
    "pair_results",
    "pairing_violations",
    "unique_call_ids",
]

DUPLICATE_MARK = "~"
"""A repeated id ``x`` becomes ``x~2``, ``x~3``, ...: the first keeps ``x``."""


def unique_call_ids(calls: Sequence[ToolCall]) -> list[ToolCall]:
    """The calls with the ids inside this one message made unique, deterministically.

    The first call with an id keeps it; each later one becomes ``id~2``, ``id~3``, ...
    skipping any id another call of the message has (or was given), so no two calls end
    up with one id. Calls with unique ids are returned as they are (the same objects).
    """
    taken = {c.id for c in calls}
    seen: set[str] = set()
    following: dict[str, int] = {}  # per repeated id, the next number to try
    out: list[ToolCall] = []
    for call in calls:
        if call.id not in seen:
            seen.add(call.id)
            out.append(call)
            continue
        n = following.get(call.id, 2)
        while f"{call.id}{DUPLICATE_MARK}{n}" in taken:
            n += 1
        following[call.id] = n + 1
        new_id = f"{call.id}{DUPLICATE_MARK}{n}"
        taken.add(new_id)
        seen.add(new_id)
        out.append(ToolCall(id=new_id, name=call.name, arguments=call.arguments))
    return out


def group_results(messages: Sequence[ChatMessage], index: int) -> list[int]:
    """Indexes of the results of the assistant message at ``index``: the tool messages
    right after it, each answering one of its calls not answered yet (by id, within this
    message only). Stops at the first message that is not such a result.

    Empty when ``messages[index]`` makes no tool calls.
    """
    message = messages[index]
    waiting: dict[str, int] = {}
    for call in message.tool_calls:
        waiting[call.id] = waiting.get(call.id, 0) + 1
    out: list[int] = []
    j = index + 1
    while j < len(messages) and waiting:
        other = messages[j]
        left = waiting.get(other.tool_call_id or "", 0) if other.role == "tool" else 0
        if not left:
            break
        if left == 1:
            del waiting[other.tool_call_id or ""]
        else:
            waiting[other.tool_call_id or ""] = left - 1
        out.append(j)
        j += 1
    return out


def pair_results(
    calls: Sequence[ToolCall], results: Sequence[ChatMessage]
) -> list[ChatMessage | None]:
    """For each call in order, the result that answers it (or None): the k-th result with
    an id answers the k-th call with that id."""
    by_id: dict[str, list[ChatMessage]] = {}
    for r in results:
        by_id.setdefault(r.tool_call_id or "", []).append(r)
    out: list[ChatMessage | None] = []
    for call in calls:
        queue = by_id.get(call.id)
        out.append(queue.pop(0) if queue else None)
    return out


def pairing_violations(messages: Sequence[ChatMessage]) -> list[str]:
    """Every breach of the pairing rule, as readable lines (empty when the request pairs).

    Each assistant tool call is answered by exactly one tool result, right after its
    message and before any other message; two calls with one id need two results. No
    result comes without a call of the message before it still waiting for it.
    """
    problems: list[str] = []
    waiting: dict[str, int] = {}
    for i, m in enumerate(messages):
        if m.role == "tool":
            key = m.tool_call_id or ""
            left = waiting.get(key, 0)
            if not left:
                problems.append(f"#{i} tool result {m.tool_call_id!r} without its call")
            elif left == 1:
                del waiting[key]
            else:
                waiting[key] = left - 1
            continue
        if waiting:
            problems.append(f"#{i} {m.role} message before the results of {sorted(waiting)}")
            waiting = {}
        if m.role == "assistant":
            for call in m.tool_calls:
                waiting[call.id] = waiting.get(call.id, 0) + 1
    if waiting:
        problems.append(f"end: calls without results {sorted(waiting)}")
    return problems
