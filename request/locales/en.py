"""The ``en`` pack: every text of the ``zh`` pack, in English, with the same keys and the
same placeholders per key."""

from __future__ import annotations

TEXTS: dict[str, str] = {
    # --- the request: what the model reads ----------------------------------------------
    "prompt.input_convention": (
        "[Input convention] The (month/day hour:minute) at the start of a user message is the "
        "time the message entered the conversation; with several people, the "
        "[nickname(account)]: after the time is who is speaking. The system adds these "
        "labels; they are not what the person typed, so do not copy them into your reply."
    ),
    "prompt.volatile": "[Current situation] It is {time} now, platform {platform}, {where}.",
    "prompt.volatile.multi_party": "a group chat with several people",
    "prompt.volatile.one_on_one": "a one-on-one conversation",
    "prompt.volatile.unknown_platform": "unknown",
    "prompt.batch_prefix": "The following messages arrived while your last turn was running",
    "prompt.batch_no_reply_needed": "If none of them needs an answer, you may stay silent",
    "prompt.focus_guide_head": (
        "[Focus guide] Messages that came in during this turn and address you:"
    ),
    "prompt.focus_guide_line": "({when}) {who}",
    "prompt.delegation_head": "[Delegated from another session]",
    "prompt.host_notice_head": "[Host notice]",
    "prompt.continuation_hint": (
        "[System hint] Because of the context length limit, some earlier messages were "
        "compressed or removed. Keep working on the task from the context you can see and the "
        "latest user request; do not stop because earlier details are missing. If you were "
        "running a multi-step task or plan, check the conversation summary and the todo-list "
        "tool for where you are, then continue with the steps not yet done."
    ),
    "prompt.collapsed_tools": "[Earlier tool call]",
    "prompt.truncated_suffix": "…[truncated, originally {length} characters]",
    "prompt.format_retry": "Please answer again in the required format.",
    # --- stopping -----------------------------------------------------------------------
    "stop.marker_prefix": "[Stopped]",
    "stop.marker": (
        "{prefix} The last turn was stopped{who} before it finished; what it had not said "
        "was not kept, and the tool calls already run are as recorded."
    ),
    "stop.marker_by": " by {name}",
    "stop.denied": "Only the people taking part in this turn and the owner can stop it",
    "stop.no_running_turn": "No turn is running",
    # --- notices sent to the room -------------------------------------------------------
    "notice.error_prefix": "[Error]",
    "notice.system_prefix": "[System]",
    "notice.turn_failed": "{prefix} This turn failed ({error}), turn={turn_id}",
    # --- tool errors the model reads ----------------------------------------------------
    "tool.bad_arguments": (
        "[Error] The tool arguments are not a valid JSON object; the call did not run. "
        "Please generate them again. The first 200 characters: {raw}"
    ),
    "tool.arguments_too_deep": (
        "[Error] The tool arguments nest deeper than {max_depth} levels; the call did not "
        "run. Please generate flatter arguments. The first 200 characters: {raw}"
    ),
    "tool.arguments_too_long": (
        "[Error] The tool arguments are {length} characters, over the limit of {max_chars}; "
        "the call did not run. Please shorten them. The first 200 characters: {raw}"
    ),
    "tool.arguments_number_too_long": (
        "[Error] A number in the tool arguments has more than {max_digits} digits; the call "
        "did not run. Please write it shorter (or as text). The first 200 characters: {raw}"
    ),
    "tool.arguments_cut": (
        "[Error] The reply was cut off at the output length limit, so this tool call's "
        "arguments are incomplete; the call did not run. Please generate it again with "
        "shorter arguments. The first 200 characters: {raw}"
    ),
    "tool.result_type": (
        "The tool returned {type}, which cannot be made text (only text, bytes, a JSON "
        "object or array, a number, a boolean or None are taken)"
    ),
    "tool.result_too_deep": (
        "The tool's result nests deeper than {max_depth} levels, so it cannot be made text{where}"
    ),
    "tool.result_nan": "The tool's result holds NaN or infinity, which JSON cannot hold{where}",
    "tool.result_key": (
        "The tool's result holds a key that is not text, which JSON cannot hold{where}"
    ),
    "tool.result_value": "The tool's result holds {type}, which JSON cannot hold{where}",
    "tool.result_not_json": "The tool's result cannot be made JSON text: {error}",
    "tool.result_where": " (at {path})",
    "tool.not_found": "There is no tool named {name}",
    "tool.blocked": "The tool call was blocked and did not run",
    "tool.builtin.current_time": "The current date and time (optionally at a UTC offset in hours)",
    "tool.builtin.current_time.utc_offset_hours": "e.g. 8 for UTC+8",
    "tool.builtin.calculate": (
        "Evaluate an arithmetic expression: + - * / // % **, parentheses, "
        "sqrt abs round log sin cos tan pi e"
    ),
    "tool.builtin.calculate.expression": "e.g. (3+4)*2",
    # --- scheduling outcomes ------------------------------------------------------------
    "where.opened": "opened",
    "where.pending": "pending",
    "where.queued": "queued",
    "where.released": "released",
    "where.joined": "joined",
    "where.dropped": "dropped",
    "where.deferred": "deferred",
    "where.handled": "handled",
    # --- the scheduler's log lines ------------------------------------------------------
    "log.handed_on": "→ {where}{seq} session={session_id}{turn}",
    "log.turn_ended": "turn ended turn={turn_id} session={session_id} outcome={outcome}",
    "log.turn_ended.reason": "reason={reason}",
    "log.turn_ended.duration": "took={duration_ms}ms",
    "log.turn_ended.inputs": "inputs {seqs}",
    # --- session settings ---------------------------------------------------------------
    "setting.llm": "Model",
    "setting.llm.unset": "follows the service preference",
    "setting.think": "Thinking",
    "setting.think.unset": "the model's default level",
    "setting.maxToolIterations": "Max tool iterations",
    "setting.maxToolIterations.unset": "unlimited",
    "setting.historyLimit": "History limit",
    "setting.historyLimit.unset": "0",
    "setting.persona": "Persona",
    "setting.persona.unset": "default persona",
    "setting.enabledToolGroups": "Tool groups",
    "setting.enabledToolGroups.unset": "all",
    "setting.line": "{label} ({key}): {text}{where}",
    "setting.line.layer": " · {layer}",
    "setting.layer.plugin config": "plugin config",
    "setting.layer.platform profile": "platform profile",
    "setting.layer.platform-type profile": "platform-type profile",
    "setting.layer.venue": "venue",
    "setting.layer.session": "this session",
    "setting.think_not_tunable": "not adjustable for the current model",
    "setting.unlimited": "unlimited",
    "setting.follow_preference": "follows the service preference (now: {model})",
    "setting.think_not_in_model": "the current model has no such level; default ({default})",
    "setting.think_default": "the model's default level ({default})",
    "setting.no_model": "no model available",
    "setting.model_missing": "{wanted} (not available, using {model})",
    "setting.remark": "{text} ({remark})",
    "setting.remark_open": " (",
    "setting.all": "all",
    "setting.none": "none",
    "setting.list_separator": ", ",
    # --- slash commands -----------------------------------------------------------------
    "command.help": (
        "/stop  stop the running turn (its participants and the owner)\n"
        "/session  show this session's settings: model, thinking, max tool iterations, "
        "history limit, persona, tool groups\n"
        "/session.set <key> <value>  change one of this session's settings "
        "(e.g. /session.set llm openai/gpt-4o)\n"
        "/session.reset <key>  reset a setting\n"
        "/model [keyword] [-p page]  list / search chat models\n"
        "/persona [keyword] [-p page]  list / search personas"
    ),
    "command.usage": (
        "Usage: /session, /session.set <key> <value>, /session.reset <key>, "
        "/model [keyword] [-p page]"
    ),
    "command.reset_done": "Reset {label} ({key}): {text}",
    "command.set_done": "Set {label} ({key}) = {given}{note}",
    "command.set_note": ", now: {text}",
    "command.owner_only": "Only the owner can change {label} ({key})",
    "command.set_failed": "Setting failed: {error}",
    "command.page_missing": "-p needs a page number",
    "command.page_not_positive": "the page must be a positive integer, not {given}",
    "command.page_too_large": "page number too large: {given}",
    "command.error": "{command}: {error}",
    "listing.models": "chat models",
    "listing.personas": "personas",
    "listing.no_persona_service": "No persona service; /persona has nothing to list",
    "listing.context": " · context {context_length}",
    "listing.none": "No {what} available",
    "listing.none_matching": "No {what} containing “{keyword}”",
    "listing.no_page": "There is no page {page} ({pages} pages)",
    "listing.in_use": "  ← in use",
    "listing.header": "{total} {what}{found}, page {page}/{pages}",
    "listing.header_found": " containing “{keyword}”",
    "listing.footer_next": "{command} -p {page} for the next page, ",
    "listing.footer_search": "{command} <keyword> to search",
    # --- aalis-agent chat ---------------------------------------------------------------
    "chat.where.opened": "opened a new turn",
    "chat.where.pending": "joins the running turn",
    "chat.where.queued": "queued; answered after this turn",
    "chat.where.released": "not sent to the model",
    "chat.no_usage": "[usage] none",
    "chat.usage": "[usage] {used}/{window} ({ratio}%) history {history} messages",
    "chat.usage_trimmed": " trimmed",
    "chat.tool": "[tool] {name}{failed}",
    "chat.tool_failed": " failed: {error}",
    "chat.reason": " ({reason})",
    "chat.unknown_command": "No such command: {command} (/help lists them)",
    "chat.scripted_reply": "(scripted model) received: {said}",
    "chat.resumed": (
        "[resumed] the previous run's unfinished work: the cut turn recorded, the "
        "messages still waiting answered"
    ),
}
