"""Text clean-up for model output and tool results (FLOW10, CFG4)."""

from __future__ import annotations

import re

from aalis_agent.projections.texts import TRUNCATED_SUFFIX

__all__ = ["strip_leaked_special_tokens", "truncate"]

# Tool-call markup that some servers leak into the text of an OpenAI-compatible reply:
# whole tool-call sections first, then stray special tokens. Nothing else is rewritten.
_SECTIONS = re.compile(
    r"<\|tool▁calls▁begin\|>.*?(?:<\|tool▁calls▁end\|>|$)"
    r"|<tool_call>.*?(?:</tool_call>|$)"
    r"|<\|tool_calls_section_begin\|>.*?(?:<\|tool_calls_section_end\|>|$)"
    r"|\[TOOL_CALLS\]\s*\[.*?\](?=\s|$)",
    re.DOTALL,
)
_TOKENS = re.compile(
    r"<\|(?:tool▁[a-z▁]+|tool_call[a-z_]*|tool_calls[a-z_]*|im_start|im_end|"
    r"python_tag|eom_id|eot_id|start_header_id|end_header_id|endoftext|"
    r"fim_prefix|fim_middle|fim_suffix|endofprompt|begin_of_text|end_of_text)\|>"
)


def strip_leaked_special_tokens(text: str) -> str:
    """Remove leaked tool-call sections and special tokens; only strip, never execute."""
    if "<" not in text and "[TOOL_CALLS]" not in text:
        return text
    cleaned = _TOKENS.sub("", _SECTIONS.sub("", text))
    return cleaned.strip() if cleaned != text else text


def truncate(text: str, max_chars: int) -> str:
    """Cut ``text`` to ``max_chars`` with a visible suffix naming the original length."""
    if max_chars < 0 or len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATED_SUFFIX.format(length=len(text))
