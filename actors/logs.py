"""The scheduler's log lines (SCH8), exactly as specified; never message text or names.

The words come from the locale (``zh`` by default: the specified lines)."""

from __future__ import annotations

from collections.abc import Iterable

from aalis_agent.actors.scheduler import Where
from aalis_agent.request.texts import ZH, Texts

__all__ = ["handed_on", "turn_ended"]


def _seq(seq: int | None) -> str:
    # Inputs that did not come through the gateway have no arrival number.
    return f" #{seq}" if seq is not None else ""


def handed_on(
    where: str,
    seq: int | None,
    session_id: str,
    turn_id: str | None = None,
    *,
    texts: Texts = ZH,
) -> str:
    """``→ 待插入|排队|放掉 #<seq> session=…`` or ``→ 开轮|插入 #<seq> session=… turn=…``.
    ``where`` is a :class:`Where` (or its ``zh`` word), shown in ``texts``' words."""
    turn = f" turn={turn_id}" if turn_id is not None else ""
    try:
        shown = texts.where(Where.of(where))
    except ValueError:  # a word no outcome has: shown as given
        shown = str(where)
    return texts("log.handed_on", where=shown, seq=_seq(seq), session_id=session_id, turn=turn)


def turn_ended(
    turn_id: str,
    session_id: str,
    outcome: str,
    reason: str | None,
    duration_ms: int,
    seqs: Iterable[int | None],
    *,
    texts: Texts = ZH,
) -> str:
    """``回合结束 turn=… session=… 结局=… 原因=… 用时=…ms 输入 #… #…`` (原因 only when stopped)."""
    parts = [texts("log.turn_ended", turn_id=turn_id, session_id=session_id, outcome=outcome)]
    if outcome == "aborted" and reason:
        parts.append(texts("log.turn_ended.reason", reason=reason))
    parts.append(texts("log.turn_ended.duration", duration_ms=duration_ms))
    numbered = [f"#{s}" for s in seqs if s is not None]
    if numbered:
        parts.append(texts("log.turn_ended.inputs", seqs=" ".join(numbered)))
    return " ".join(parts)
