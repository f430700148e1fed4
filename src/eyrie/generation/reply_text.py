"""A target's decoded reply split as a server's parsers split it: content, reasoning_content and tool_calls.

What SGLang's and vLLM's reasoning parsers (qwen3, deepseek-r1) and tool parsers (hermes, qwen25) do for the
common formats, so an in-process row holds what a server's would (eyrie.generation.conversations.reply_fields):
- thinking: a reply that starts with the thinking open marker, or whose generation prompt opened it, is reasoning
  up to the close marker; unclosed, up to a tool-call open marker (Qwen3.5 calls without closing), else to the end
  (cut by max_new_tokens). A thinking block elsewhere in the reply stays inline.
- tool calls: each `<tool_call>` block whose body is JSON `{"name": str, "arguments": {...}}` is one call, several
  are parallel calls. Any other block (not that JSON, unclosed, or another family's tool-call format) stays inline
  exactly as generated and is counted (`tool_calls_unparsed`): nothing is dropped or rewritten silently.
Only markers the tokenizer or its template knows are split: a part the template cannot render would be lost.
"""

from __future__ import annotations

import json

from eyrie.target.markers import known_text, pick_markers

HERMES_CALL = ("<tool_call>", "</tool_call>")  # Qwen's and Hermes' JSON calls: the one tool-call format parsed
# Templates put newlines, and only newlines, around the parts they render (Qwen3: "<think>\n…\n</think>\n\n",
# "\n<tool_call>\n…\n</tool_call>"): those are stripped at the cuts, any other whitespace is the target's.
TEMPLATE_SPACE = "\n"


def reply_markers(tokenizer) -> dict[str, tuple[str, str]]:
    """{span: (open, close)} of pick_markers whose open marker the tokenizer or its template knows. gpt-oss's harmony
    channels are no tag pairs (and their markers are special tokens, gone from the decoded text): never split."""
    known = known_text(tokenizer)
    return {span: pair for span, pair in pick_markers(known).items() if pair[0] in known and not pair[0].startswith("<|channel|>")}


def opens_thinking(prompt_text: str, markers: dict[str, tuple[str, str]]) -> bool:
    """Whether the rendered prompt ends inside thinking: its generation prompt opened the thinking marker."""
    return "thinking" in markers and prompt_text.rstrip().endswith(markers["thinking"][0])


def split_reply(text: str, markers: dict[str, tuple[str, str]], in_thinking: bool = False) -> tuple[str, dict]:
    """(content, fields): the reply text with the parsed parts removed, and the row fields beside it
    (reasoning_content, tool_calls, tool_calls_unparsed: each only where there is one)."""
    fields: dict = {}
    tool_open = markers.get("tool_call", ("", ""))[0]
    if "thinking" in markers:
        reasoning, text = _split_thinking(text, markers["thinking"], in_thinking, tool_open)
        if reasoning:
            fields["reasoning_content"] = reasoning
    if "tool_call" in markers:
        text, calls, unparsed = _split_calls(text, markers["tool_call"])
        if calls:
            fields["tool_calls"] = calls
        if unparsed:
            fields["tool_calls_unparsed"] = unparsed
    return text, fields


def _split_thinking(text: str, pair: tuple[str, str], in_thinking: bool, tool_open: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest)."""
    open_, close = pair
    if not in_thinking:
        if not text.lstrip(TEMPLATE_SPACE).startswith(open_):
            return None, text
        text = text.lstrip(TEMPLATE_SPACE)[len(open_):]
    end = text.find(close)
    if end >= 0:
        return text[:end].strip(TEMPLATE_SPACE), text[end + len(close):].lstrip(TEMPLATE_SPACE)
    cut = text.find(tool_open) if tool_open else -1
    if cut >= 0:
        return text[:cut].strip(TEMPLATE_SPACE), text[cut:]
    return text.strip(TEMPLATE_SPACE), ""


def _split_calls(text: str, pair: tuple[str, str]) -> tuple[str, list[dict], int]:
    """(content, parsed calls, blocks left inline)."""
    open_, close = pair
    if pair != HERMES_CALL:
        return text, [], text.count(open_)
    segments, calls, unparsed, position = [""], [], 0, 0
    while (start := text.find(open_, position)) >= 0:
        end = text.find(close, start + len(open_))
        stop = len(text) if end < 0 else end + len(close)
        call = _hermes_call(text[start + len(open_):end]) if end >= 0 else None
        if call is None:
            unparsed += 1
            segments[-1] += text[position:stop]
        else:
            calls.append(call)
            segments[-1] += text[position:start]
            segments.append("")
        position = stop
    segments[-1] += text[position:]
    if not calls:
        return text, [], unparsed
    last = len(segments) - 1
    # Cut at each removed call: the newlines beside it are the template's; text on both sides stays on its own lines.
    pieces = [s.lstrip(TEMPLATE_SPACE) if i else s for i, s in enumerate(segments)]
    pieces = [s.rstrip(TEMPLATE_SPACE) if i < last else s for i, s in enumerate(pieces)]
    return "\n".join(s for s in pieces if s), calls, unparsed


def _hermes_call(body: str) -> dict | None:
    """The call a block's body holds, or None where it is not exactly {"name": str, "arguments": {...}}."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or set(parsed) != {"name", "arguments"}:
        return None
    if not isinstance(parsed["name"], str) or not isinstance(parsed["arguments"], dict):
        return None
    return {"type": "function", "function": {"name": parsed["name"], "arguments": parsed["arguments"]}}
