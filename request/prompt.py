"""Prompt assembly (FLOW3, FLOW4, FLOW6, INS1-INS4): pure functions, no I/O.

The request has three parts, which trimming (TRIM) relies on:

* **head** — the system prompt (persona + ``systemPrompt`` + the input convention), then
  contribution blocks at ``identity`` (right after it), ``knowledge`` and ``context``
  (at the end of the head, knowledge first);
* **history** — the archived conversation (``historyLimit`` window, tool groups), user
  messages with their time and sender labels, replies with their visible text;
* **turn** — ``turn-context`` material, the volatile context, ``turn-hint`` material, the
  instruction block of an instruction turn or this turn's inputs, then what the turn adds
  (inserts, focus guides, tool groups). Both anchors sit after all history (INS4).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo

import msgspec
from aalis_agent.events.schema import ChatMessage, Input, MessageMeta
from aalis_agent.request.labels import sender_label, time_label
from aalis_agent.request.texts import ZH, Texts

__all__ = [
    "Block",
    "TurnPrompt",
    "assemble",
    "assemble_at",
    "instruction_block",
    "is_instruction",
    "render_history",
    "render_input",
    "render_message",
    "split_parts",
    "system_prompt",
]

HEAD_ANCHORS = ("identity", "knowledge", "context")
TURN_ANCHORS = ("turn-context", "turn-hint")
_TURN_BLOCK = "turn-block:"
_TURN_IDS = frozenset({"volatile", "batch-prefix"})


@dataclass(frozen=True, slots=True)
class Block:
    """A contribution's block, materialised as a system message at its anchor."""

    anchor: str
    injector: str
    text: str


def system_prompt(persona_prompt: str | None, configured: str, *, texts: Texts = ZH) -> str:
    """Persona prompt, then ``systemPrompt`` (alone without a persona), then the fixed
    input-convention block at the end (FLOW3, CFG1), in ``texts``' language."""
    parts = [p.strip() for p in (persona_prompt, configured) if p and p.strip()]
    parts.append(texts.input_convention)
    return "\n\n".join(parts)


def is_instruction(inp: Input) -> bool:
    """Delegated tasks, host notices and idle prompts are instructions, not speech (INS)."""
    return (
        inp.trigger_type == "proactive" or inp.host_notice is not None or inp.trigger_type == "idle"
    )


def instruction_block(inp: Input, now_ms: int, tz: tzinfo, *, texts: Texts = ZH) -> ChatMessage:
    """The system block an instruction turn shows instead of a current user message."""
    if inp.host_notice is not None:
        parts = [texts("prompt.host_notice_head"), inp.content]
        if inp.host_notice.untrusted:
            parts.append(inp.host_notice.untrusted)  # this turn only, never archived (INS2)
        text, injector = "\n".join(parts), "host-notice"
    elif inp.trigger_type == "proactive":
        head = texts("prompt.delegation_head")
        text, injector = f"{head}\n{inp.content}", "cross-session-delegation"
    else:
        when = time_label(inp.timestamp or now_ms, now_ms, tz)
        text, injector = f"({when}) {inp.content}", "idle-prompt"
    return ChatMessage(
        id=f"instruction:{inp.id}",
        role="system",
        content=text,
        meta=MessageMeta(injector=injector, input_id=inp.id),
    )


def render_input(message: ChatMessage, now_ms: int, tz: tzinfo) -> ChatMessage:
    """A user message as the model sees it: ``(time) [nickname(id)]: text`` (FLOW4)."""
    meta = message.meta
    when = time_label(meta.timestamp if meta.timestamp is not None else now_ms, now_ms, tz)
    sender = meta.sender
    who = sender_label(
        meta.platform, sender.user_id if sender else None, sender.nickname if sender else None
    )
    return msgspec.structs.replace(message, content=f"({when}) {who}{message.content}")


def render_message(m: ChatMessage, now_ms: int, tz: tzinfo) -> ChatMessage:
    """One history message as sent: a user message labelled, a reply with its visible
    text, anything else as it is (FLOW4)."""
    if m.role == "user":
        return render_input(m, now_ms, tz)
    if m.role == "assistant" and m.meta.visible_content is not None:
        return msgspec.structs.replace(m, content=m.meta.visible_content)
    return m


def render_history(messages: Sequence[ChatMessage], now_ms: int, tz: tzinfo) -> list[ChatMessage]:
    """History as sent (FLOW4): each message through :func:`render_message`. A session's
    turns keep theirs rendered and extend it (actors/history_cache.py)."""
    return [render_message(m, now_ms, tz) for m in messages]


def _block_message(block: Block, n: int) -> ChatMessage:
    # Turn-anchored blocks are told apart by id, so that ``split_parts`` keeps them in the
    # turn part even when there is no history between them and the head.
    kind = _TURN_BLOCK if block.anchor in TURN_ANCHORS else "block:"
    return ChatMessage(
        id=f"{kind}{block.injector}:{n}",
        role="system",
        content=block.text,
        meta=MessageMeta(injector=block.injector),
    )


@dataclass
class TurnPrompt:
    """Everything one turn's requests are assembled from; the runner adds to ``tail``."""

    system: str
    history: Sequence[ChatMessage]
    blocks: list[Block] = field(default_factory=list)
    volatile: str | None = None
    instruction: ChatMessage | None = None
    inputs: list[ChatMessage] = field(default_factory=list)
    batch_prefix: str | None = None
    tail: list[ChatMessage] = field(default_factory=list)


def assemble(prompt: TurnPrompt) -> list[ChatMessage]:
    """The message list of one request: head, history, then the turn (INS4 placement)."""
    head, turn = _around_history(prompt)
    return [*head, *prompt.history, *turn, *prompt.tail]


def assemble_at(prompt: TurnPrompt) -> tuple[tuple[ChatMessage, ...], int]:
    """:func:`assemble` as a tuple (what a request carries), and where in it the history
    starts (the head's length).

    Built in one pass over the history: with a long history, each copy of it is most of
    a request's preparation."""
    head, turn = _around_history(prompt)
    return (*head, *prompt.history, *turn, *prompt.tail), len(head)


def _around_history(prompt: TurnPrompt) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """The head (before the history) and the turn (after it, before ``tail``)."""
    head = [ChatMessage(id="system", role="system", content=prompt.system)]
    turn: list[ChatMessage] = []
    hints: list[ChatMessage] = []
    if prompt.blocks:  # else no contribution to place
        # A contribution already present by injector key (added to the turn's messages
        # along the way) is not materialised again; archived history carries no injector
        # keys.
        present = {m.meta.injector for m in prompt.tail if m.meta.injector}
        by_anchor: dict[str, list[ChatMessage]] = {}
        for n, block in enumerate(prompt.blocks):
            if block.injector in present:
                continue
            by_anchor.setdefault(block.anchor, []).append(_block_message(block, n))
        head += by_anchor.get("identity", [])
        head += by_anchor.get("knowledge", [])
        head += by_anchor.get("context", [])
        turn += by_anchor.get("turn-context", [])
        hints = by_anchor.get("turn-hint", [])
    if prompt.volatile is not None:
        turn.append(ChatMessage(id="volatile", role="system", content=prompt.volatile))
    if prompt.instruction is not None:
        turn += hints
        turn.append(prompt.instruction)
    else:
        if prompt.batch_prefix:
            turn.append(ChatMessage(id="batch-prefix", role="system", content=prompt.batch_prefix))
        inputs = list(prompt.inputs)
        if hints and inputs:
            turn += inputs[:-1] + hints + inputs[-1:]
        else:
            turn += hints + inputs
    return head, turn


def split_parts(
    messages: Sequence[ChatMessage],
    history_ids: Container[str],
    history: Sequence[ChatMessage] | None = None,
    *,
    at: int | None = None,
) -> tuple[list[ChatMessage], Sequence[ChatMessage], list[ChatMessage]]:
    """Head (system messages before anything else, history's own excluded), history (the
    history's messages that follow) and the turn (the rest), for trimming (TRIM).

    The turn's own system messages (its anchored material, the volatile context, the batch
    prefix and the instruction block, which is this turn's input) start the turn part even
    when no history precedes them, so the continuation hint finds the turn's last input.

    ``history``, the history as assembled (its ids are ``history_ids``): when the list
    holds it unchanged right after the head, the history part is that very object and
    only the head and the turn are walked.

    ``at``: where the list holds ``history``, when the caller knows it holds it unchanged
    (the list as :func:`assemble_at` built it, seen by no hook); not checked, so the
    history is not walked at all."""
    if history is not None and at is not None:
        n = len(history)
        return list(messages[:at]), history, list(messages[at + n :])
    head: list[ChatMessage] = []
    hist: list[ChatMessage] = []
    rest: list[ChatMessage] = []
    if history:
        n, i = len(history), 0
        while i < len(messages):
            m = messages[i]
            if m.role != "system" or m.id in history_ids or _opens_turn(m):
                break
            i += 1
        if messages[i : i + n] == list(history) and (
            len(messages) == i + n or messages[i + n].id not in history_ids
        ):
            return list(messages[:i]), history, list(messages[i + n :])
    for m in messages:
        if (
            not hist
            and not rest
            and m.role == "system"
            and m.id not in history_ids
            and not _opens_turn(m)
        ):
            head.append(m)
        elif not rest and m.id in history_ids:
            hist.append(m)
        else:
            rest.append(m)
    return head, hist, rest


def _opens_turn(m: ChatMessage) -> bool:
    """A system message that belongs to the turn part: an input of this turn (the
    instruction block carries its input's id) or what ``assemble`` puts in the turn."""
    return m.meta.input_id is not None or m.id in _TURN_IDS or m.id.startswith(_TURN_BLOCK)


def volatile_for(
    now_ms: int, tz: tzinfo, platform: str | None, multi_party: bool, *, texts: Texts = ZH
) -> str:
    """The volatile context block of a turn, in ``texts``' language."""
    return texts.volatile_context(time_label(now_ms, now_ms, tz), platform, multi_party)
