"""Render conversations with the target's own chat template and mark the assistant tokens.

A message is stored flat (``MESSAGE_TYPE``): role, content, and where present the assistant's
``reasoning_content`` and ``tool_calls`` (a JSON list) and a tool result's ``tool_call_id`` and
``name``; a record's tool definitions travel beside its messages. A file none of whose messages
has those fields stores role and content alone (``messages_type``), so plain chat data is
written as it always was. ``template_messages`` turns
that into what chat templates read (tool calls as objects, absent fields left out).

The loss mask covers each assistant turn as the template renders it after the generation
prompt: thinking, tool calls, answer and the end-of-turn token that closes it (the drafter
must learn to predict the stop), and nothing of the template's scaffolding, of the user's
turns or of tool results. Each turn's context is ``render(messages[:j], add_generation_prompt=True)``,
what a server sends the target before turn j.

Two layouts (``tokenize_conversation``):
- shared: one sample holds every turn, where the template renders each such context as a
  prefix of the whole conversation (ChatML, Llama-3, SmolLM2's: history rendered stably), so
  each turn's context in the sample is exactly its serving context; the default target's case,
  and the cheapest (one sample per conversation in the hidden-state cache);
- per turn: one sample per assistant turn, its context rendered on its own, where the template
  renders history differently once the conversation goes on (a Qwen3-style template drops the
  thinking of turns before the last user message). A turn whose own rendering does not start
  with its context cannot be located; it is counted (``unstable_turns``), never trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa

from eyrie.core.errors import ContractError

MESSAGE_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.string()),  # JSON list of {"id"?, "type": "function", "function": {"name", "arguments": {...}}}
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
MESSAGES_TYPE = pa.list_(MESSAGE_TYPE)
PLAIN_MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
OPTIONAL_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


def is_plain(messages: list[dict]) -> bool:
    """Whether every message is role and content alone."""
    return all(message.get(key) is None for message in messages for key in OPTIONAL_FIELDS)


def messages_type(conversations: list[list[dict]]) -> pa.DataType:
    """The messages column's type for these conversations: role and content alone where that holds everything."""
    return PLAIN_MESSAGES_TYPE if all(is_plain(messages) for messages in conversations) else MESSAGES_TYPE


def stored_messages(messages: list[dict], plain: bool = False) -> list[dict]:
    """Messages in MESSAGE_TYPE's shape (tool_calls as JSON text, every field present, None where absent), or in
    PLAIN_MESSAGES_TYPE's."""
    stored = []
    for message in messages:
        row = {"role": message["role"], "content": message.get("content") or ""}
        if plain:
            stored.append(row)
            continue
        for key in OPTIONAL_FIELDS:
            value = message.get(key)
            row[key] = json.dumps(value, ensure_ascii=False, sort_keys=True) if key == "tool_calls" and value is not None and not isinstance(value, str) else value
        stored.append(row)
    return stored


def template_messages(messages: list[dict]) -> list[dict]:
    """What a chat template reads: absent fields left out (templates test `is defined`), tool calls as objects."""
    out = []
    for message in messages:
        row = {"role": message["role"], "content": message.get("content") or ""}
        for key in OPTIONAL_FIELDS:
            value = message.get(key)
            if value is None or value == "":
                continue
            row[key] = json.loads(value) if key == "tool_calls" and isinstance(value, str) else value
        out.append(row)
    return out


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None, **template_kwargs) -> str:
    """template_kwargs: switches the template reads (e.g. enable_thinking), passed through as serving passes them."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra, **template_kwargs)


def parse_tools(tools: str | list | None) -> list[dict] | None:
    """A record's tool definitions as stored (JSON text) or as objects; None when it has none."""
    if tools is None or tools == "":
        return None
    return json.loads(tools) if isinstance(tools, str) else tools


def _end_of_turn_tokens(tokenizer) -> list[str]:
    """Special tokens that may close an assistant turn, longest first."""
    candidates = set(tokenizer.all_special_tokens)
    if tokenizer.eos_token:
        candidates.add(tokenizer.eos_token)
    return sorted((t for t in candidates if t), key=len, reverse=True)


def _turn_end(after: str, start: int, message: dict, end_tokens: list[str], index: int) -> int:
    """Where assistant turn `index` ends in `after` (its rendering, from `start`): past the end-of-turn token that
    closes it, else past its last non-space character."""
    content = message.get("content") or ""
    offset = after.find(content, start) if content else start
    if offset < 0:
        raise ContractError(f"the chat template changes assistant content (message {index}); cannot build a loss mask")
    end = offset + len(content)
    tail = after[end:]
    closing = next((t for t in end_tokens if tail.lstrip(" ").startswith(t)), None)
    if closing is not None:
        return after.index(closing, end) + len(closing)
    # Tool calls or thinking rendered after the content: the turn runs to the last end-of-turn token, else the text's end.
    last = max((after.rfind(t, end) + len(t) for t in end_tokens if after.rfind(t, end) >= 0), default=-1)
    return last if last > start else len(after.rstrip())


def _stable_spans(tokenizer, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]] | None:
    """The shared layout: the whole rendering and each assistant turn's span, or None when some turn's context is not
    a prefix of the whole."""
    full = render(tokenizer, messages, False, tools)
    end_tokens = _end_of_turn_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], True, tools)
        after = render(tokenizer, messages[: i + 1], False, tools)
        if not (full.startswith(after) and after.startswith(before)):
            return None
        spans.append((len(before), _turn_end(after, len(before), message, end_tokens, i)))
    return full, spans


def assistant_spans(tokenizer, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn plus its end-of-turn token, for a
    template that renders history stably; a ContractError otherwise."""
    stable = _stable_spans(tokenizer, messages, tools)
    if stable is None:
        raise ContractError(
            "the chat template does not render prefixes of a conversation as prefixes of the whole; "
            "eyrie cannot locate every assistant turn in one sample with this template"
        )
    return stable


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    turn: int | None = None  # the message index of the one turn a per-turn sample trains, None for a shared sample


@dataclass
class TokenizedRecord:
    """The samples of one conversation and what could not be trained of it."""

    samples: list[TokenizedConversation]
    per_turn: bool = False  # the template renders this history unstably: one sample per assistant turn
    unstable_turns: list[int] = field(default_factory=list)  # message indices of turns that could not be located
    reasoning_dropped: int = 0  # turns whose reasoning_content the template does not render (so it is not trained)
    tool_calls_dropped: int = 0  # turns whose tool calls the template does not render
    one_sample_tokens: int = 0  # per turn: the tokens the whole conversation renders to, what one shared sample would hold


def _mask_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    # The template already writes any BOS it wants; adding special tokens again would double it.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = [0] * len(ids)
    span_index = 0
    for position, (start, end) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index < len(spans) and end > start:
            span_start, span_end = spans[span_index]
            if start >= span_start and end <= span_end:
                mask[position] = 1
    return ids, mask


def _cut(ids: list[int], mask: list[int], max_len: int, turn: int | None = None) -> TokenizedConversation:
    return TokenizedConversation(ids[:max_len], mask[:max_len], len(ids) > max_len, turn)


def _not_rendered(text: str, spans: list[tuple[int, int]], messages: list[dict]) -> tuple[int, int]:
    """Assistant turns whose reasoning, and whose tool calls (by function name), the template leaves out of their span."""
    turns = [m for m in messages if m["role"] == "assistant"]
    reasoning = calls = 0
    for message, (a, b) in zip(turns, spans):
        thought = (message.get("reasoning_content") or "").strip()
        reasoning += bool(thought) and thought not in text[a:b]
        tool_calls = message.get("tool_calls")
        tool_calls = json.loads(tool_calls) if isinstance(tool_calls, str) else tool_calls or []
        calls += any(c["function"]["name"] not in text[a:b] for c in tool_calls)
    return reasoning, calls


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int, tools=None) -> TokenizedConversation:
    """input_ids of the rendered conversation and a 0/1 mask over assistant tokens, cut at max_len (shared layout)."""
    text, spans = assistant_spans(tokenizer, messages, tools)
    ids, mask = _mask_spans(tokenizer, text, spans)
    return _cut(ids, mask, max_len)


def tokenize_record(tokenizer, messages: list[dict], max_len: int, tools=None) -> TokenizedRecord:
    """The samples that train every assistant turn of a conversation in the context serving renders (module doc)."""
    stable = _stable_spans(tokenizer, messages, tools)
    if stable is not None:
        text, spans = stable
        ids, mask = _mask_spans(tokenizer, text, spans)
        reasoning, calls = _not_rendered(text, spans, messages)
        return TokenizedRecord([_cut(ids, mask, max_len)], reasoning_dropped=reasoning, tool_calls_dropped=calls)
    whole = tokenizer(render(tokenizer, messages, False, tools), add_special_tokens=False)["input_ids"]
    record = TokenizedRecord([], per_turn=True, one_sample_tokens=len(whole))
    end_tokens = _end_of_turn_tokens(tokenizer)
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = render(tokenizer, messages[:j], True, tools)
        after = render(tokenizer, messages[: j + 1], False, tools)
        if not after.startswith(context):
            record.unstable_turns.append(j)
            continue
        try:
            end = _turn_end(after, len(context), message, end_tokens, j)
        except ContractError:
            record.unstable_turns.append(j)
            continue
        reply = after[len(context):end]
        reasoning, calls = _not_rendered(after, [(len(context), end)], [message])
        record.reasoning_dropped += reasoning
        record.tool_calls_dropped += calls
        # The context tokenized on its own, as a server tokenizes the prompt it is sent; the turn after it.
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        record.samples.append(_cut(context_ids + reply_ids, [0] * len(context_ids) + [1] * len(reply_ids), max_len, j))
    return record
