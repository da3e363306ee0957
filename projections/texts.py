"""Every exact string the model, the user or the logs see, in one place.

The source document's punctuation was normalised to ASCII; the original writes full-width
punctuation in Chinese text, and so do these strings. Tests quote them from here.
"""

from __future__ import annotations

__all__ = [
    "BATCH_NO_REPLY_NEEDED",
    "BATCH_PREFIX",
    "FOCUS_GUIDE_HEAD",
    "NO_RUNNING_TURN",
    "STOP_DENIED",
    "STOP_MARKER_PREFIX",
    "focus_guide",
    "stop_marker_text",
    "tool_bad_arguments",
]

BATCH_PREFIX = "下面几条是你上一轮进行期间到的"
"""Before a batch of human inputs that queued while the last turn ran (SCH4)."""

BATCH_NO_REPLY_NEEDED = "没有需要接的可以不说话"
"""Added in a multi-party room when no input of the batch addresses the agent (SCH4)."""

STOP_DENIED = "只有参与这一轮的人和 owner 能停"
"""``/stop`` from someone who is neither a participant of the turn nor the owner (CMD3)."""

NO_RUNNING_TURN = "没有在跑的一轮"
"""``/stop`` when no turn runs (CMD3)."""

STOP_MARKER_PREFIX = "[已停下]"
"""The start of the ``turn-stopped`` marker (SAVE6)."""

FOCUS_GUIDE_HEAD = "[焦点指引] 这一轮进行中插进来、点名你的消息："
"""Head of the focus-guide block before addressed inserts in multi-party rooms (SCH2)."""


def focus_guide(entries: list[tuple[str, str]]) -> str:
    """The focus-guide block: every addressed insert so far, as ``(time) account`` lines."""
    return "\n".join([FOCUS_GUIDE_HEAD, *(f"({when}) {who}" for when, who in entries)])


def stop_marker_text(stopped_by: str | None) -> str:
    """The one sentence the next turn's model reads about a stopped turn (SAVE6)."""
    who = f"被 {stopped_by} " if stopped_by else ""
    return (
        f"{STOP_MARKER_PREFIX} 上一轮没答完就{who}停下了，没说完的话没有留下，"
        "已执行的工具调用以记录为准。"
    )


def tool_bad_arguments(raw: str) -> str:
    """The result a call with arguments that are not a JSON object gets (FLOW13)."""
    return f"[错误] 工具参数不是合法的 JSON 对象，没有执行，请重新生成。原文前 200 字：{raw[:200]}"
