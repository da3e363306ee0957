"""The ``zh`` pack: the source document's exact strings, the default locale.

Keys name a text; values are ``str.format`` templates. The ``en`` pack has the same keys
and the same placeholders per key (``tests/test_locales.py`` checks both).
"""

from __future__ import annotations

TEXTS: dict[str, str] = {
    # --- the request: what the model reads (FLOW3, SCH2, SCH4, INS1-INS2, TRIM) --------
    "prompt.input_convention": (
        "[输入约定] 用户消息开头的（月/日 时:分）是这条消息进入对话的时间；多人场合里，时间之后的"
        "[昵称(账号)]: 是说话的人。这些标注由系统加上，不是对方打的字，回复里不要照抄。"
    ),
    "prompt.volatile": "[当前情况] 现在是 {time}，平台 {platform}，{where}。",
    "prompt.volatile.multi_party": "多人群聊",
    "prompt.volatile.one_on_one": "单独对话",
    "prompt.volatile.unknown_platform": "未知",
    "prompt.batch_prefix": "下面几条是你上一轮进行期间到的",
    "prompt.batch_no_reply_needed": "没有需要接的可以不说话",
    "prompt.focus_guide_head": "[焦点指引] 这一轮进行中插进来、点名你的消息：",
    "prompt.focus_guide_line": "({when}) {who}",
    "prompt.delegation_head": "[跨会话委派]",
    "prompt.host_notice_head": "[宿主通知]",
    "prompt.continuation_hint": (
        "[系统提示] 由于上下文长度限制，部分历史消息已被压缩或移除。请基于当前可见的上下文和最新"
        "用户请求继续完成任务，不要因为看不到之前的细节而停止工作。如果你之前有正在执行的多步骤"
        "任务或计划，请查看对话摘要和 todo-list 工具确认当前进度，然后继续未完成的步骤。"
    ),
    "prompt.collapsed_tools": "[历史工具调用]",
    "prompt.truncated_suffix": "…[已截断，原文 {length} 字]",
    "prompt.format_retry": "请按要求的格式重新回答。",
    # --- stopping (CMD3, SAVE6) ---------------------------------------------------------
    "stop.marker_prefix": "[已停下]",
    "stop.marker": (
        "{prefix} 上一轮没答完就{who}停下了，没说完的话没有留下，已执行的工具调用以记录为准。"
    ),
    "stop.marker_by": "被 {name} ",
    "stop.denied": "只有参与这一轮的人和 owner 能停",
    "stop.no_running_turn": "没有在跑的一轮",
    # --- notices sent to the room (OUT2) ------------------------------------------------
    "notice.error_prefix": "[错误]",
    "notice.system_prefix": "[系统]",
    "notice.turn_failed": "{prefix} 这一轮出错了（{error}），turn={turn_id}",
    # --- tool errors the model reads (FLOW13) -------------------------------------------
    "tool.bad_arguments": (
        "[错误] 工具参数不是合法的 JSON 对象，没有执行，请重新生成。原文前 200 字：{raw}"
    ),
    "tool.arguments_too_deep": (
        "[错误] 工具参数嵌套超过 {max_depth} 层，没有执行，请换成层次更浅的参数重新生成。"
        "原文前 200 字：{raw}"
    ),
    "tool.arguments_too_long": (
        "[错误] 工具参数有 {length} 字，超过上限 {max_chars} 字，没有执行，请精简后重新生成。"
        "原文前 200 字：{raw}"
    ),
    "tool.arguments_number_too_long": (
        "[错误] 工具参数里有超过 {max_digits} 位的数字，没有执行，"
        "请写短一些（或写成文本）后重新生成。原文前 200 字：{raw}"
    ),
    "tool.arguments_cut": (
        "[错误] 回复在输出长度上限处被截断，这次工具调用的参数不完整，没有执行，"
        "请用更短的参数重新生成。原文前 200 字：{raw}"
    ),
    "tool.result_type": (
        "工具返回了 {type}，不能转成文本（只接受文本、字节、JSON 对象、数组、数字、布尔或 None）"
    ),
    "tool.result_too_deep": "工具返回的结果嵌套超过 {max_depth} 层，不能转成文本{where}",
    "tool.result_nan": "工具返回的结果里有 NaN 或无穷大，JSON 表示不了{where}",
    "tool.result_key": "工具返回的结果里有不是文本的键，JSON 表示不了{where}",
    "tool.result_value": "工具返回的结果里有 {type}，JSON 表示不了{where}",
    "tool.result_not_json": "工具返回的结果不能转成 JSON 文本：{error}",
    "tool.result_where": "（位置 {path}）",
    "tool.not_found": "没有这个工具：{name}",
    "tool.blocked": "工具调用被拦下，没有执行",
    "tool.builtin.current_time": "当前日期与时间（可指定 UTC 偏移小时数）",
    "tool.builtin.current_time.utc_offset_hours": "如 8 表示 UTC+8",
    "tool.builtin.calculate": (
        "计算算术表达式：+ - * / // % **、括号、sqrt abs round log sin cos tan pi e"
    ),
    "tool.builtin.calculate.expression": "如 (3+4)*2",
    # --- scheduling outcomes (SubmitHandle.where, the SCH8 log line) --------------------
    "where.opened": "开轮",
    "where.pending": "待插入",
    "where.queued": "排队",
    "where.released": "放掉",
    "where.joined": "插入",
    "where.dropped": "dropped",
    "where.deferred": "deferred",
    "where.handled": "已处理",
    # --- the scheduler's log lines (SCH8) -----------------------------------------------
    "log.handed_on": "→ {where}{seq} session={session_id}{turn}",
    "log.turn_ended": "回合结束 turn={turn_id} session={session_id} 结局={outcome}",
    "log.turn_ended.reason": "原因={reason}",
    "log.turn_ended.duration": "用时={duration_ms}ms",
    "log.turn_ended.inputs": "输入 {seqs}",
    # --- session settings (SET1-SET4) as the settings UI and /session show them ---------
    "setting.llm": "模型",
    "setting.llm.unset": "跟随服务偏好",
    "setting.think": "深度思考",
    "setting.think.unset": "按模型的默认档",
    "setting.maxToolIterations": "最大工具迭代",
    "setting.maxToolIterations.unset": "不限",
    "setting.historyLimit": "历史条数上限",
    "setting.historyLimit.unset": "0",
    "setting.persona": "人设",
    "setting.persona.unset": "默认人设",
    "setting.enabledToolGroups": "工具分组",
    "setting.enabledToolGroups.unset": "全部",
    "setting.line": "{label}（{key}）：{text}{where}",
    "setting.line.layer": " · {layer}",
    "setting.layer.plugin config": "插件配置",
    "setting.layer.platform profile": "平台档",
    "setting.layer.platform-type profile": "平台类型档",
    "setting.layer.venue": "场所",
    "setting.layer.session": "本会话",
    "setting.think_not_tunable": "当前模型不能调",
    "setting.unlimited": "不限",
    "setting.follow_preference": "跟随服务偏好（此刻：{model}）",
    "setting.think_not_in_model": "当前模型没有这一档，按默认（{default}）",
    "setting.think_default": "按模型的默认档（{default}）",
    "setting.no_model": "没有可用的模型",
    "setting.model_missing": "{wanted}（不在，用的是 {model}）",
    "setting.remark": "{text}（{remark}）",
    "setting.remark_open": "（",
    "setting.all": "全部",
    "setting.none": "无",
    "setting.list_separator": "、",
    # --- slash commands (CMD1-CMD3, SET) ------------------------------------------------
    "command.help": (
        "/stop  停下在跑的一轮（参与这一轮的人和 owner）\n"
        "/session  看本会话的设置：模型、深度思考、最大工具迭代、历史条数上限、人设、工具分组\n"
        "/session.set <键> <值>  改本会话的一项设置（如 /session.set llm openai/gpt-4o）\n"
        "/session.reset <键>  恢复一项设置\n"
        "/model [关键词] [-p 页]  列出 / 搜索对话模型\n"
        "/persona [关键词] [-p 页]  列出 / 搜索人设"
    ),
    "command.usage": (
        "用法：/session、/session.set <键> <值>、/session.reset <键>、/model [关键词] [-p 页]"
    ),
    "command.reset_done": "已恢复{label}（{key}）：{text}",
    "command.set_done": "已设置{label}（{key}）= {given}{note}",
    "command.set_note": "，此刻：{text}",
    "command.owner_only": "{label}（{key}）只有 owner 能改",
    "command.set_failed": "设置失败：{error}",
    "command.page_missing": "-p 后面要跟页码",
    "command.page_not_positive": "页码要是正整数，不是 {given}",
    "command.page_too_large": "页码太大：{given}",
    "command.error": "{command}：{error}",
    "listing.models": "对话模型",
    "listing.personas": "人设",
    "listing.no_persona_service": "没有人设服务，/persona 无可列",
    "listing.context": " · 上下文 {context_length}",
    "listing.none": "没有可用的{what}",
    "listing.none_matching": "没有含“{keyword}”的{what}",
    "listing.no_page": "没有第 {page} 页（共 {pages} 页）",
    "listing.in_use": "  ← 此刻在用",
    "listing.header": "{found}{what}共 {total} 个，第 {page}/{pages} 页",
    "listing.header_found": "含“{keyword}”的",
    "listing.footer_next": "{command} -p {page} 看下一页，",
    "listing.footer_search": "{command} <关键词> 搜索",
    # --- aalis-agent chat -----------------------------------------------------------------
    "chat.where.opened": "开了新的一轮",
    "chat.where.pending": "并入正在跑的这一轮",
    "chat.where.queued": "排队，这一轮结束后再答",
    "chat.where.released": "没有送给模型",
    "chat.no_usage": "[用量] 无",
    "chat.usage": "[用量] {used}/{window} ({ratio}%) 历史 {history} 条",
    "chat.usage_trimmed": " 已裁剪",
    "chat.tool": "[工具] {name}{failed}",
    "chat.tool_failed": " 失败：{error}",
    "chat.reason": "（{reason}）",
    "chat.unknown_command": "没有这个命令：{command}（/help 看有哪些）",
    "chat.scripted_reply": "（脚本模型）收到：{said}",
    "chat.resumed": "[恢复] 上次没做完的：记下被中断的那一轮，回答还在等的消息",
}
