"""The engine of a dataset that keeps its source's replies (`replies: source`): every turn is answered with the reply
the source gives it, cut to max_new_tokens tokens; nothing is generated.

It is a conversation engine like eyrie.generation.openai_engine's (`regenerate(conversations, settings, log,
progress)`), so the shard job, its resume log and its output are the regenerate job's: the same completions FORMAT,
the same prompt-length rule (a turn whose prompt is longer than max_prompt_tokens ends the conversation), and the
token counts the target's tokenizer gives. Where the target is read afterwards (extraction), the drafter learns the
target's own distribution at every position of text the target did not write.

A reply with reasoning and tool calls keeps them (the cut counts the reasoning's tokens first, then the text's); a
reply cut short loses its tool calls, and then the source's tool results after it end the conversation
(eyrie.generation.conversations.TOOL_CALLS_DIFFER).
"""

from __future__ import annotations

import json
import time

from eyrie.generation.conversations import PROMPT_TOO_LONG, Conversation, make_row
from eyrie.target.chat_template import render

# A reply cut at max_new_tokens is marked as a generated one would be; a whole reply as one that ended its turn.
WHOLE, CUT = "stop", "length"


class SourceRepliesError(ValueError):
    """A prompt shard without the replies this engine answers with."""


class SourceReplies:
    """Answers each pending turn with the source's reply; `tokenizer` is the target's (token counts, cuts)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def regenerate(self, conversations: list[Conversation], settings: dict, log, progress) -> dict:
        started = time.perf_counter()
        for conversation in conversations:
            if len(conversation.replies) < len(conversation.users) or any(r is None for r in conversation.replies[: len(conversation.users)]):
                raise SourceRepliesError(
                    f"prompt {conversation.id!r}: {len(conversation.users)} user turn(s) but {len(conversation.replies)} "
                    "source repl(ies); its prompt shard was built without replies: source (rerun the dataset's prompts job)"
                )
            rows = []
            while not conversation.ended:
                row = self.answer(conversation, len(conversation.answered), settings)
                conversation.answered.append(row)
                rows.append(row)
            if rows:  # one conversation at a time: a kill loses at most the one in hand
                log.append(rows)
            for row in rows:
                progress.turn_done(conversation, row)
        wall = time.perf_counter() - started
        return {"engine": "source", "wall_seconds": wall, "busy_seconds": 0.0}

    def answer(self, conversation: Conversation, turn: int, settings: dict) -> dict:
        """One turn's row: the source's reply, or prompt_too_long where the prompt is over max_prompt_tokens."""
        prompt = render(self.tokenizer, conversation.messages(upto_turn=turn), add_generation_prompt=True, tools=conversation.tools)
        prompt_tokens = len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if prompt_tokens > settings["max_prompt_tokens"]:
            return make_row(conversation, turn, PROMPT_TOO_LONG, "", prompt_tokens, 0, 0.0)
        source = conversation.replies[turn]
        if isinstance(source, str):
            source = {"content": source}
        budget, extra, finish_reason, used = settings["max_new_tokens"], {}, WHOLE, 0
        texts = {}
        for key in ("reasoning_content", "content"):
            text = source.get(key) or ""
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            if len(ids) > budget - used:
                ids, finish_reason = ids[: max(budget - used, 0)], CUT
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            texts[key], used = text, used + len(ids)
            if finish_reason == CUT:
                break
        if texts.get("reasoning_content"):
            extra["reasoning_content"] = texts["reasoning_content"]
        if source.get("tool_calls") and finish_reason == WHOLE:
            calls = source["tool_calls"]
            extra["tool_calls"] = calls
            used += len(self.tokenizer(calls if isinstance(calls, str) else json.dumps(calls), add_special_tokens=False)["input_ids"])
        # seconds 0: nothing was generated, so the shard's generation throughput stays None rather than infinite.
        return make_row(conversation, turn, finish_reason, texts.get("content", ""), prompt_tokens, used, 0.0, **extra)
