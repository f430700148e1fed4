"""Render conversations with the target's own chat template and mark the assistant tokens.

The loss mask covers each assistant reply and the end-of-turn token that closes it (the
drafter must learn to predict the stop), and nothing of the template's scaffolding.
Spans are found by rendering growing prefixes of the conversation, which works for any
template whose rendering of a prefix is a prefix of the whole (ChatML, Llama-3, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from eyrie.core.errors import ContractError


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _end_of_turn_tokens(tokenizer) -> list[str]:
    """Special tokens that may close an assistant turn, longest first."""
    candidates = set(tokenizer.all_special_tokens)
    if tokenizer.eos_token:
        candidates.add(tokenizer.eos_token)
    return sorted((t for t in candidates if t), key=len, reverse=True)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply plus its end-of-turn token."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    end_tokens = _end_of_turn_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        after = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(after) and after.startswith(before)):
            raise ContractError(
                "the chat template does not render prefixes of a conversation as prefixes of the whole "
                f"(at message {i}); eyrie cannot locate assistant tokens with this template"
            )
        offset = after.find(message["content"], len(before))
        if offset < 0:
            raise ContractError(f"the chat template changes assistant content (message {i}); cannot build a loss mask")
        end = offset + len(message["content"])
        tail = after[end:]
        closing = next((t for t in end_tokens if tail.lstrip(" ").startswith(t)), None)
        if closing is not None:
            end = after.index(closing, end) + len(closing)
        spans.append((offset, end))
    return full, spans


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> TokenizedConversation:
    """input_ids of the rendered conversation and a 0/1 mask over assistant tokens, cut at max_len."""
    text, spans = assistant_spans(tokenizer, messages)
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
    truncated = len(ids) > max_len
    return TokenizedConversation(ids[:max_len], mask[:max_len], truncated)
