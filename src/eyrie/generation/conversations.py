"""The completions FORMAT and each request's identity: what regeneration writes and what others read of it.

A completions shard (``results/completions/<dataset>/<shard>.parquet``, written by the regenerate
job, eyrie.generation.regenerate) holds one record per prompt in ``COMPLETIONS_SCHEMA``. While a
shard runs, each finished turn is one partial-log row (``make_row``), keyed by (prompt id, turn);
a ``Conversation`` holds one prompt's user turns and the rows answered so far. ``settings_key``
names the partial log and ``stable_seed`` a request's sampling seed, so a rerun reuses and
redraws exactly what the first run did. ``load_conversations`` reads a prompt shard (written by the
prompts job) with its content digest checked first (eyrie.core.artifacts.read_parquet).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from eyrie.core.artifacts import read_parquet

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
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


def settings_key(settings: dict, model_fingerprint: str) -> str:
    """Names the partial log: turns made under other settings or another model are never reused."""
    payload = json.dumps({"settings": settings, "model": model_fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def stable_seed(*parts) -> int:
    """A request's sampling seed from its identity (settings seed, conversation id, turn): a rerun draws the same."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


@dataclass
class Conversation:
    """One prompt's progress: its user turns and the turns already answered."""

    id: str
    system: list[dict]
    users: list[str]
    answered: list[dict] = field(default_factory=list)  # partial-log rows, in turn order
    replies: list[str] = field(default_factory=list)  # the source's reply to each user turn (replies: source), else empty

    @property
    def ended(self) -> bool:
        return len(self.answered) == len(self.users) or (
            bool(self.answered) and self.answered[-1]["finish_reason"] in ENDS_CONVERSATION
        )

    def messages(self, upto_turn: int | None = None) -> list[dict]:
        """system + alternating user/assistant turns; with upto_turn, ends with that turn's user message."""
        messages = list(self.system)
        for row in self.answered:
            if row["finish_reason"] in ENDS_CONVERSATION:
                break
            messages += [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": row["reply"]}]
        if upto_turn is not None:
            messages.append({"role": "user", "content": self.users[upto_turn]})
        return messages


def load_conversations(prompts_path: str, max_turns: int) -> list[Conversation]:
    """A prompt shard's prompts, nothing answered yet: the leading system turn and at most max_turns user turns (and
    the source's replies to them, where the prompts keep them)."""
    conversations = []
    prompts = read_parquet(prompts_path, written_by=f"build_prompts_{Path(prompts_path).parent.name}")
    for record in prompts.to_pylist():
        system = [m for m in record["messages"] if m["role"] == "system"][:1]
        users = [m["content"] for m in record["messages"] if m["role"] == "user"][:max_turns]
        # A dataset that keeps its source's replies has one after each user turn (eyrie.data.prompts); others have none.
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"][:max_turns]
        conversations.append(Conversation(record["id"], system, users, replies=replies))
    return conversations


def make_row(conversation: Conversation, turn: int, finish_reason: str, reply: str, prompt_tokens: int, completion_tokens: int, seconds: float, **extra) -> dict:
    """One partial-log row: a finished turn, keyed by (id, turn). `extra` holds latency, error, ..."""
    return {
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


def to_record(conversation: Conversation, dataset: str, settings: dict) -> dict:
    """The completions record (one row of COMPLETIONS_SCHEMA) of a conversation whose turns are all done."""
    rows = conversation.answered
    messages = conversation.messages()
    if not any(m["role"] == "assistant" for m in messages):
        # Nothing answered (first prompt too long): keep the question so the record explains itself.
        messages = conversation.system + [{"role": "user", "content": conversation.users[0]}]
    return {
        "id": conversation.id,
        "dataset": dataset,
        "messages": messages,
        "n_turns": sum(r["finish_reason"] not in ENDS_CONVERSATION for r in rows),
        "finish_reason": rows[-1]["finish_reason"],
        "finish_reasons": [r["finish_reason"] for r in rows],
        "prompt_tokens": [r["prompt_tokens"] for r in rows],
        "completion_tokens": [r["completion_tokens"] for r in rows],
        "seconds": sum(r["seconds"] for r in rows),
        "generation": json.dumps(settings, sort_keys=True),
    }
