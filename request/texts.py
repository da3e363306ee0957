"""Every exact string the model, the user or the logs see, in one place.

The source document's punctuation was normalised to ASCII; the original writes full-width
punctuation in Chinese text, and so do these strings. Tests quote them from here.
"""

from __future__ import annotations

__all__ = [
    "BATCH_NO_REPLY_NEEDED",
    "BATCH_PREFIX",
    "CONTINUATION_HINT",
    "DELEGATION_HEAD",
    "ERROR_PREFIX",
    "FOCUS_GUIDE_HEAD",
    "HOST_NOTICE_HEAD",
    "INPUT_CONVENTION",
    "NO_RUNNING_TURN",
    "STOP_DENIED",
    "STOP_MARKER_PREFIX",
    "SYSTEM_PREFIX",
    "THINK_NOT_TUNABLE",
    "TRUNCATED_SUFFIX",
    "UNLIMITED",
    "focus_guide",
    "follow_preference",
    "listing_footer",
    "listing_header",
    "stop_marker_text",
    "think_not_in_model",
    "tool_bad_arguments",
    "volatile_context",
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


DELEGATION_HEAD = "[跨会话委派]"
"""Head of the task block of a delegated (``proactive``) turn (INS1)."""

HOST_NOTICE_HEAD = "[宿主通知]"
"""Head of a host notice's instruction block (INS2)."""

ERROR_PREFIX = "[错误]"
"""Start of an error notice sent to the room (OUT2)."""

SYSTEM_PREFIX = "[系统]"
"""Start of a system notice sent to the room (OUT2)."""

INPUT_CONVENTION = (
    "[输入约定] 用户消息开头的（月/日 时:分）是这条消息进入对话的时间；多人场合里，时间之后的"
    "[昵称(账号)]: 是说话的人。这些标注由系统加上，不是对方打的字，回复里不要照抄。"
)
"""The fixed block at the end of the system prompt (FLOW3)."""

CONTINUATION_HINT = (
    "[系统提示] 由于上下文长度限制，部分历史消息已被压缩或移除。请基于当前可见的上下文和最新"
    "用户请求继续完成任务，不要因为看不到之前的细节而停止工作。如果你之前有正在执行的多步骤"
    "任务或计划，请查看对话摘要和 todo-list 工具确认当前进度，然后继续未完成的步骤。"
)
"""Inserted after a trim that reached step 4 and removed six or more messages (TRIM-H)."""

TRUNCATED_SUFFIX = "…[已截断，原文 {length} 字]"
"""Appended to text cut short, with the original length."""


def volatile_context(time_label: str, platform: str | None, multi_party: bool) -> str:
    """The per-turn context block (current time and where the conversation is)."""
    where = "多人群聊" if multi_party else "单独对话"
    return f"[当前情况] 现在是 {time_label}，平台 {platform or '未知'}，{where}。"


# --- session settings (SET) and listings (CMD1-CMD2) -----------------------------------

THINK_NOT_TUNABLE = "当前模型不能调"
"""The thinking-level field when the session's model declares no levels (SET2)."""

UNLIMITED = "不限"
"""``maxToolIterations`` unset (SET3)."""


def follow_preference(model_name: str) -> str:
    """The model field when no layer sets ``llm`` (SET1)."""
    return f"跟随服务偏好（此刻：{model_name}）"


def think_not_in_model(default_name: str) -> str:
    """After the name of a level the session's model does not have (SET2)."""
    return f"当前模型没有这一档，按默认（{default_name}）"


def listing_header(what: str, total: int, page: int, pages: int, keyword: str | None) -> str:
    """The first line of a paged listing (CMD1-CMD2): the count and the page."""
    found = f"含“{keyword}”的" if keyword else ""
    return f"{found}{what}共 {total} 个，第 {page}/{pages} 页"


def listing_footer(command: str, page: int, pages: int) -> str:
    """The last line of a paged listing: how to turn the page or search."""
    turn = f"{command} -p {page + 1} 看下一页，" if page < pages else ""
    return f"{turn}{command} <关键词> 搜索"
