"""The completions FORMAT and each request's identity: what regeneration writes and what others read of it.

A completions shard (``results/completions/<dataset>/<shard>.parquet``, written by the regenerate
job, eyrie.generation.regenerate) holds one record per prompt in ``COMPLETIONS_SCHEMA``. While a
shard runs, each finished turn is one partial-log row (``make_row``), keyed by (prompt id, turn);
a ``Conversation`` holds one prompt's user turns and the rows answered so far. ``settings_key``
names the partial log and ``stable_seed`` a request's sampling seed, so a rerun reuses and
redraws exactly what the first run did. ``load_conversations`` reads a prompt shard (written by the
prompts job) with its content digest checked first (eyrie.core.artifacts.read_parquet).

A turn is one assistant reply and its input: a user message, or the tool results answering the
reply before it (which cannot be regenerated: they are the source's). The reply keeps what the
target emits: its text, and where the engine gives them its ``reasoning_content`` and
``tool_calls``. Where a turn's input is tool results and the reply before them called other
tools than the source's, the conversation ends after that reply (``TOOL_CALLS_DIFFER``,
counted): the source's results no longer answer it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from eyrie.core.artifacts import read_parquet
from eyrie.target.chat_template import PLAIN_MESSAGES_TYPE, is_plain, messages_type, parse_tools, stored_messages, template_messages

MESSAGES_TYPE = PLAIN_MESSAGES_TYPE
COMPLETIONS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("messages", MESSAGES_TYPE),
        ("n_turns", pa.int32()),
        ("finish_reason", pa.string()),
        ("finish_reasons", pa.list_(pa.string())),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("completion_tokens", pa.list_(pa.int32())),
        ("seconds", pa.float64()),
        ("generation", pa.string()),  # the settings that made this record, as JSON
    ]
)
PROMPT_TOO_LONG = "prompt_too_long"
# A request the server rejected for good (e.g. a prompt over its context): counted, kept as a
# row, and it ends its conversation. Unlike prompt_too_long it is asked again on a rerun (a
# rejection costs nothing, and one caused by a misconfigured server must not stick).
ERROR = "error"
ENDS_CONVERSATION = (PROMPT_TOO_LONG, ERROR)
WRITTEN_BY = "regenerate_shard"  # the Snakemake rule that writes a completions shard, named in read errors
# A row's `ends_conversation`: the reply is kept, but the source's tool results after it answer other calls.
TOOL_CALLS_DIFFER = "tool_calls_differ"
REPLY_FIELDS = ("reasoning_content", "tool_calls")  # what a row may carry beside its reply text
REPLY_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")  # any of them non-empty: the reply says something


def completions_schema(records: list[dict]) -> pa.Schema:
    """COMPLETIONS_SCHEMA, with the messages' optional fields and a `tools` column (JSON) where some record has them."""
    schema = COMPLETIONS_SCHEMA.set(2, pa.field("messages", messages_type([r["messages"] for r in records])))
    return schema.append(pa.field("tools", pa.string())) if any(r.get("tools") for r in records) else schema


def same_tool_calls(a: list | str | None, b: list | str | None) -> bool:
    """Whether two turns call the same functions with the same arguments, in the same order (ids aside)."""
    def calls(value):
        value = json.loads(value) if isinstance(value, str) else value or []
        return [(c["function"]["name"], c["function"].get("arguments")) for c in value]
    return calls(a) == calls(b)


def settings_key(settings: dict, model_fingerprint: str) -> str:
    """Names the partial log: turns made under other settings or another model are never reused."""
    payload = json.dumps({"settings": settings, "model": model_fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def stable_seed(*parts) -> int:
    """A request's sampling seed from its identity (settings seed, conversation id, turn): a rerun draws the same."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


@dataclass
class Conversation:
    """One prompt's progress: its turns' inputs and the turns already answered.

    users: each turn's identity, what a partial-log row must match to be reused: the user's text for a turn asked by
    a user alone (plain chat data, unchanged), else the turn's input messages as JSON. inputs: each turn's input
    messages (None: one user message per entry of users)."""

    id: str
    system: list[dict]
    users: list[str]
    answered: list[dict] = field(default_factory=list)  # partial-log rows, in turn order
    replies: list = field(default_factory=list)  # the source's reply to each turn (text or message), where it has them
    inputs: list[list[dict]] | None = None
    tools: list[dict] | None = None

    def turn_input(self, turn: int) -> list[dict]:
        return self.inputs[turn] if self.inputs is not None else [{"role": "user", "content": self.users[turn]}]

    @property
    def ended(self) -> bool:
        return len(self.answered) == len(self.users) or (
            bool(self.answered) and (self.answered[-1]["finish_reason"] in ENDS_CONVERSATION or bool(self.answered[-1].get("ends_conversation")))
        )

    def messages(self, upto_turn: int | None = None) -> list[dict]:
        """system + each turn's input and reply; with upto_turn, ends with that turn's input."""
        messages = list(self.system)
        for row in self.answered:
            if row["finish_reason"] in ENDS_CONVERSATION:
                break
            messages += self.turn_input(row["turn"]) + [reply_message(row)]
        if upto_turn is not None:
            messages += self.turn_input(upto_turn)
        return messages

    def ends_after(self, turn: int, tool_calls) -> str | None:
        """TOOL_CALLS_DIFFER where the next turn's input is the source's tool results and these calls are not the
        source's; else None."""
        if turn + 1 >= len(self.users) or turn >= len(self.replies) or not isinstance(self.replies[turn], dict):
            return None
        if not any(m["role"] == "tool" for m in self.turn_input(turn + 1)):
            return None
        return None if same_tool_calls(tool_calls, self.replies[turn].get("tool_calls")) else TOOL_CALLS_DIFFER


def empty_reply(message) -> bool:
    """Whether a chat completion's message (or a logged row read as one) says nothing: no content, no reasoning, no
    tool call (None, "" or [])."""
    return not isinstance(message, dict) or not any(message.get(key) for key in REPLY_KEYS)


def reply_fields(message: dict) -> dict:
    """What a chat completion's message holds beside its text, as a row's extra fields: the reasoning a server's
    reasoning parser split off (`reasoning_content`, or vLLM's `reasoning`) and the calls its tool parser found
    (arguments decoded from JSON where they are JSON). Empty where the server splits nothing: the raw text is the reply."""
    fields = {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        fields["reasoning_content"] = reasoning
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # kept as the text the target wrote: that is what it emitted
        calls.append({**({"id": call["id"]} if call.get("id") else {}), "type": "function", "function": function})
    if calls:
        fields["tool_calls"] = calls
    return fields


def openai_messages(messages: list[dict]) -> list[dict]:
    """Messages as an OpenAI-compatible server reads them: tool-call arguments as JSON text, absent fields left out."""
    out = []
    for message in template_messages(messages):
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": call["function"]["arguments"] if isinstance(call["function"].get("arguments"), str)
                                      else json.dumps(call["function"].get("arguments", {}), ensure_ascii=False)}}
                for call in message["tool_calls"]
            ]
        out.append(message)
    return out


def reply_message(row: dict) -> dict:
    """A partial-log row's reply as an assistant message."""
    message = {"role": "assistant", "content": row["reply"]}
    message.update({key: row[key] for key in REPLY_FIELDS if row.get(key)})
    return message


def split_turns(messages: list[dict], max_turns: int) -> tuple[list[dict], list[list[dict]], list[dict | None]]:
    """A prompt's messages as (system, each turn's input, the source's reply to each turn or None), keeping the turns
    that answer the first max_turns user messages."""
    system = [m for m in messages if m["role"] == "system"][:1]
    inputs, replies, pending, users = [], [], [], 0
    for message in messages:
        role = message["role"]
        if role == "system":
            continue
        if role == "user":
            if any(m["role"] == "user" for m in pending):  # a user turn the source left unanswered (target regenerates)
                inputs.append(pending)
                replies.append(None)
                pending = []
            users += 1
            if users > max_turns:
                break
        if role == "assistant":
            if pending:
                inputs.append(pending)
                replies.append(message)
            pending = []
            continue
        pending.append(message)
    if pending and users <= max_turns and any(m["role"] == "user" for m in pending):
        inputs.append(pending)
        replies.append(None)
    return system, inputs, replies


def turn_key(turn_input: list[dict]) -> str:
    """A turn's identity in the partial log (Conversation.users)."""
    if len(turn_input) == 1 and turn_input[0]["role"] == "user" and is_plain(turn_input):
        return turn_input[0]["content"]
    return json.dumps([{k: v for k, v in m.items() if v is not None} for m in turn_input], ensure_ascii=False, sort_keys=True)


def load_conversations(prompts_path: str, max_turns: int) -> list[Conversation]:
    """A prompt shard's prompts, nothing answered yet: the leading system turn and the turns answering at most
    max_turns user turns (and the source's replies to them, where the prompts keep them)."""
    conversations = []
    prompts = read_parquet(prompts_path, written_by=f"build_prompts_{Path(prompts_path).parent.name}")
    for record in prompts.to_pylist():
        messages = [{k: v for k, v in m.items() if v is not None} for m in record["messages"]]
        system, inputs, replies = split_turns(messages, max_turns)
        # A dataset that keeps its source's replies has one after each turn (eyrie.data.normalise); others have none.
        kept = [r for r in replies if r is not None]
        plain = all(len(i) == 1 and i[0]["role"] == "user" and is_plain(i) for i in inputs) and is_plain(kept)
        conversations.append(Conversation(
            record["id"], system, [turn_key(i) for i in inputs],
            # plain chat: the replies' text (none where the target regenerates); else each turn's message or None
            replies=[r["content"] for r in kept] if plain else replies,
            inputs=None if plain else inputs, tools=parse_tools(record.get("tools")),
        ))
    return conversations


def make_row(conversation: Conversation, turn: int, finish_reason: str, reply: str, prompt_tokens: int, completion_tokens: int, seconds: float, **extra) -> dict:
    """One partial-log row: a finished turn, keyed by (id, turn). `extra` holds latency, error, reasoning_content,
    tool_calls, ... A reply whose tool calls are not the source's, before the source's results, ends the conversation."""
    row = {
        "id": conversation.id,
        "turn": turn,
        "user": conversation.users[turn],
        "reply": reply,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "seconds": seconds,
        **extra,
    }
    if finish_reason not in ENDS_CONVERSATION:
        ends = conversation.ends_after(turn, extra.get("tool_calls"))
        if ends is not None:
            row["ends_conversation"] = ends
    return row


def to_record(conversation: Conversation, dataset: str, settings: dict) -> dict:
    """The completions record (one row of completions_schema) of a conversation whose turns are all done."""
    rows = conversation.answered
    messages = conversation.messages()
    if not any(m["role"] == "assistant" for m in messages):
        # Nothing answered (first prompt too long): keep the question so the record explains itself.
        messages = conversation.system + conversation.turn_input(0)
    record = {
        "id": conversation.id,
        "dataset": dataset,
        "messages": stored_messages(messages, plain=is_plain(messages)),
        "n_turns": sum(r["finish_reason"] not in ENDS_CONVERSATION for r in rows),
        "finish_reason": rows[-1]["finish_reason"],
        "finish_reasons": [r["finish_reason"] for r in rows],
        "prompt_tokens": [r["prompt_tokens"] for r in rows],
        "completion_tokens": [r["completion_tokens"] for r in rows],
        "seconds": sum(r["seconds"] for r in rows),
        "generation": json.dumps(settings, sort_keys=True),
    }
    if conversation.tools:
        record["tools"] = json.dumps(conversation.tools, ensure_ascii=False, sort_keys=True)
    return record
