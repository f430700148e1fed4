"""The markers a target's families write around thinking and tool calls, and which of them a tokenizer knows.

Read by the benchmark (acceptance per span, eyrie.bench.spans) and by regeneration (a reply split as a server's
parsers split it, eyrie.generation.reply_text).
"""

from __future__ import annotations

# Known (open, close) pairs: the first whose open marker a tokenizer knows is used, else the last (the fallback).
THINKING_MARKERS = (
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
    ("◁think▷", "◁/think▷"),  # Kimi-VL thinking
    ("<|channel|>analysis", "<|end|>"),  # gpt-oss (harmony): the analysis channel
    ("<think>", "</think>"),  # Qwen3, DeepSeek-R1, Kimi-K2-Thinking, GLM
)
TOOL_CALL_MARKERS = (
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),  # Kimi-K2
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),  # DeepSeek-V3/R1
    ("<|channel|>commentary to=functions.", "<|call|>"),  # gpt-oss (harmony)
    ("<tool_call>", "</tool_call>"),  # Qwen, Hermes
)


def known_text(tokenizer) -> str:
    """What a tokenizer declares: its added tokens and its chat template, searched for markers."""
    added = getattr(tokenizer, "get_added_vocab", dict)() or {}
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    return "\n".join([*added, template])


def pick_markers(known: str) -> dict[str, tuple[str, str]]:
    """{span: (open, close)} for thinking and tool_call: the first known pair whose open marker is in `known`."""
    def pick(pairs):
        return next((pair for pair in pairs if pair[0] in known), pairs[-1])

    return {"thinking": pick(THINKING_MARKERS), "tool_call": pick(TOOL_CALL_MARKERS)}
