"""Regenerate one prompt shard with the target, turn by turn, resumable at any moment.

Multi-turn conversations are answered on the target's own earlier replies. Each finished
turn goes to a PartialLog as soon as its batch ends; the declared Parquet output is
written once, atomically, when every turn of every prompt is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from eyrie.engine import plan_batches, stable_seed
from eyrie.partial import PartialLog

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
    ]
)
PROMPT_TOO_LONG = "prompt_too_long"


def settings_key(settings: dict, model_fingerprint: str) -> str:
    """Names the partial log: turns made under other settings or another model are never reused."""
    payload = json.dumps({"settings": settings, "model": model_fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Conversation:
    """One prompt's progress: its user turns and the turns already answered."""

    id: str
    system: list[dict]
    users: list[str]
    answered: list[dict] = field(default_factory=list)  # partial-log rows, in turn order

    @property
    def ended(self) -> bool:
        return len(self.answered) == len(self.users) or (
            bool(self.answered) and self.answered[-1]["finish_reason"] == PROMPT_TOO_LONG
        )

    def messages(self, upto_turn: int | None = None) -> list[dict]:
        """system + alternating user/assistant turns; with upto_turn, ends with that turn's user message."""
        messages = list(self.system)
        for row in self.answered:
            if row["finish_reason"] == PROMPT_TOO_LONG:
                break
            messages += [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": row["reply"]}]
        if upto_turn is not None:
            messages.append({"role": "user", "content": self.users[upto_turn]})
        return messages


def load_conversations(prompts_path: str, max_turns: int) -> list[Conversation]:
    conversations = []
    for record in pq.read_table(prompts_path).to_pylist():
        system = [m for m in record["messages"] if m["role"] == "system"][:1]
        users = [m["content"] for m in record["messages"] if m["role"] == "user"][:max_turns]
        conversations.append(Conversation(record["id"], system, users))
    return conversations


def resume(conversations: list[Conversation], done: dict[tuple[str, int], dict]) -> int:
    """Attach finished turns from the log; a turn whose user text changed since is not reused."""
    reused = 0
    for conversation in conversations:
        for turn, user in enumerate(conversation.users):
            row = done.get((conversation.id, turn))
            if row is None or row["user"] != user:
                break
            conversation.answered.append(row)
            reused += 1
            if row["finish_reason"] == PROMPT_TOO_LONG:
                break
    return reused


def to_record(conversation: Conversation, dataset: str) -> dict:
    rows = conversation.answered
    messages = conversation.messages()
    if not any(m["role"] == "assistant" for m in messages):
        # Nothing answered (first prompt too long): keep the question so the record explains itself.
        messages = conversation.system + [{"role": "user", "content": conversation.users[0]}]
    return {
        "id": conversation.id,
        "dataset": dataset,
        "messages": messages,
        "n_turns": sum(r["finish_reason"] != PROMPT_TOO_LONG for r in rows),
        "finish_reason": rows[-1]["finish_reason"],
        "finish_reasons": [r["finish_reason"] for r in rows],
        "prompt_tokens": [r["prompt_tokens"] for r in rows],
        "completion_tokens": [r["completion_tokens"] for r in rows],
        "seconds": sum(r["seconds"] for r in rows),
    }


def shard_stats(records: list[dict], reused_turns: int) -> dict:
    finish_reasons: dict[str, int] = {}
    for record in records:
        for reason in record["finish_reasons"]:
            finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
    completion_tokens = sum(sum(r["completion_tokens"]) for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {
        "records": len(records),
        "turns": sum(len(r["finish_reasons"]) for r in records),
        "completion_tokens": completion_tokens,
        "prompt_tokens": sum(sum(r["prompt_tokens"]) for r in records),
        "generation_seconds": seconds,
        "tokens_per_second": completion_tokens / seconds if seconds > 0 else None,
        "finish_reasons": finish_reasons,
        "resumed_turns": reused_turns,
    }


def write_parquet_atomic(table: pa.Table, out_path: str | Path) -> None:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out_path)


def regenerate_shard(
    *,
    prompts_path: str,
    out_path: str,
    partial_dir: str,
    dataset: str,
    shard: str,
    settings: dict,
    engine_settings: dict,
    engine,
    model_fingerprint: str,
    template_sha256: str,
) -> dict:
    """Answer every turn of every prompt in the shard; returns the shard's stats."""
    conversations = load_conversations(prompts_path, settings["max_turns"])
    log = PartialLog(Path(partial_dir) / f"{settings_key(settings, model_fingerprint)}.jsonl")
    reused = resume(conversations, log.load())

    remaining = sum(len(c.users) - len(c.answered) for c in conversations if not c.ended)
    progress = tqdm(
        total=remaining,
        desc=f"regenerate {dataset}/{shard}",
        unit="turn",
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 10,
        dynamic_ncols=True,
    )
    new_tokens, busy_seconds = 0, 0.0
    while pending := [c for c in conversations if not c.ended]:
        requests = [(c, len(c.answered)) for c in pending]
        prompt_ids = [engine.prompt_ids(c.messages(upto_turn=turn)) for c, turn in requests]

        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) > settings["max_prompt_tokens"]]
        if too_long:
            rows = [_row(requests[i], PROMPT_TOO_LONG, "", len(prompt_ids[i]), 0, 0.0) for i in too_long]
            log.append(rows)
            for i, row in zip(too_long, rows):
                requests[i][0].answered.append(row)
            progress.update(sum(len(requests[i][0].users) - requests[i][1] for i in too_long))
        fitting = [i for i in range(len(requests)) if i not in set(too_long)]

        lengths = [len(prompt_ids[i]) for i in fitting]
        for batch in plan_batches(lengths, settings["max_new_tokens"], engine_settings["max_batch_tokens"], engine_settings["max_batch_size"]):
            members = [fitting[b] for b in batch]
            if settings["temperature"] > 0:
                import torch

                torch.manual_seed(stable_seed(settings["seed"], requests[members[0]][0].id, requests[members[0]][1]))
            started = time.perf_counter()
            results = engine.generate([prompt_ids[i] for i in members], settings)
            elapsed = time.perf_counter() - started
            batch_tokens = sum(r.completion_tokens for r in results) or 1
            rows = [
                # Each turn carries its share of the batch time, so sums over any subset give throughput.
                _row(requests[i], r.finish_reason, r.reply, r.prompt_tokens, r.completion_tokens, elapsed * r.completion_tokens / batch_tokens)
                for i, r in zip(members, results)
            ]
            log.append(rows)
            for i, row in zip(members, rows):
                requests[i][0].answered.append(row)
            new_tokens += sum(r.completion_tokens for r in results)
            busy_seconds += elapsed
            progress.update(len(members))
            finished = sum(c.ended for c in conversations)
            progress.set_postfix_str(f"prompts {finished}/{len(conversations)}, {new_tokens / busy_seconds:.1f} tok/s")
    progress.close()

    records = [to_record(c, dataset) for c in conversations]
    stats = shard_stats(records, reused)
    metadata = {
        "dataset": dataset,
        "shard": shard,
        "settings": settings,
        "model_fingerprint": model_fingerprint,
        "template_sha256": template_sha256,
        "stats": stats,
    }
    table = pa.Table.from_pylist(records, schema=COMPLETIONS_SCHEMA)
    table = table.replace_schema_metadata({b"eyrie": json.dumps(metadata).encode()})
    write_parquet_atomic(table, out_path)
    return stats


def _row(request, finish_reason: str, reply: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> dict:
    conversation, turn = request
    return {
        "id": conversation.id,
        "turn": turn,
        "user": conversation.users[turn],
        "reply": reply,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "seconds": seconds,
    }
