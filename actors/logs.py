"""The scheduler's log lines (SCH8), exactly as specified; never message text or names."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["handed_on", "turn_ended"]


def _seq(seq: int | None) -> str:
    # Inputs that did not come through the gateway have no arrival number.
    return f" #{seq}" if seq is not None else ""


def handed_on(where: str, seq: int | None, session_id: str, turn_id: str | None = None) -> str:
    """``→ 待插入|排队|放掉 #<seq> session=…`` or ``→ 开轮|插入 #<seq> session=… turn=…``."""
    turn = f" turn={turn_id}" if turn_id is not None else ""
    return f"→ {where}{_seq(seq)} session={session_id}{turn}"


def turn_ended(
    turn_id: str,
    session_id: str,
    outcome: str,
    reason: str | None,
    duration_ms: int,
    seqs: Iterable[int | None],
) -> str:
    """``回合结束 turn=… session=… 结局=… 原因=… 用时=…ms 输入 #… #…`` (原因 only when stopped)."""
    parts = [f"回合结束 turn={turn_id} session={session_id} 结局={outcome}"]
    if outcome == "aborted" and reason:
        parts.append(f"原因={reason}")
    parts.append(f"用时={duration_ms}ms")
    numbered = [f"#{s}" for s in seqs if s is not None]
    if numbered:
        parts.append("输入 " + " ".join(numbered))
    return " ".join(parts)
