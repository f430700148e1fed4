"""The tokenize job: turn a completions shard into a token shard (input_ids and an assistant-only loss mask).

The token shard's schema and reader belong to eyrie.tokens.shards. The completions shard is read whole,
its content digest checked first (eyrie.core.artifacts.read_parquet).

Each conversation gives one sample, or one per assistant turn where the chat template renders its history unstably
(eyrie.target.chat_template: which layout, and why). Per-turn samples are counted in the stats (``turn_samples``,
``per_turn_records``), as are turns that could not be located (``unstable_turns``, with record ids in
``unstable_examples``) and samples cut at max_seq_len (``truncated``, also a warning in the job log).
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa

from eyrie.core.artifacts import PARQUET_KEY, parquet_metadata, read_parquet
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.errors import ContractError
from eyrie.generation.conversations import WRITTEN_BY as COMPLETIONS_WRITTEN_BY
from eyrie.target.chat_template import parse_tools, tokenize_record
from eyrie.tokens.shards import TOKENS_SCHEMA, turn_sample_id

MAX_EXAMPLES = 5


def answered_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to its last assistant reply: an unanswered trailing user turn teaches nothing."""
    last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[: last_reply + 1]


def tokenize_shard(*, completions_path: str, out_path: str, tokenizer, template_sha256: str, max_seq_len: int) -> dict:
    completions = read_parquet(completions_path, written_by=COMPLETIONS_WRITTEN_BY)
    source = parquet_metadata(completions.schema.metadata, completions_path)
    if source.get("template_sha256") not in (None, template_sha256):
        raise ContractError(
            f"{completions_path}: was generated with chat template {source['template_sha256'][:12]}, "
            f"but the tokenizer's template is {template_sha256[:12]}; regenerate or point model.path at the same target"
        )
    rows, dropped, truncated = [], {}, 0
    per_turn_records = turn_samples = unstable_turns = reasoning_dropped = calls_dropped = per_turn_tokens = one_sample_tokens = 0
    unstable_examples, cut_examples = [], []
    for record in completions.to_pylist():
        messages = answered_messages(record["messages"])
        if not messages:
            dropped["no_assistant_reply"] = dropped.get("no_assistant_reply", 0) + 1
            continue
        tokenized = tokenize_record(tokenizer, messages, max_seq_len, parse_tools(record.get("tools")))
        per_turn_records += tokenized.per_turn
        one_sample_tokens += tokenized.one_sample_tokens
        reasoning_dropped += tokenized.reasoning_dropped
        calls_dropped += tokenized.tool_calls_dropped
        if tokenized.unstable_turns:
            unstable_turns += len(tokenized.unstable_turns)
            if len(unstable_examples) < MAX_EXAMPLES:
                unstable_examples.append({"id": record["id"], "messages": tokenized.unstable_turns})
        for tokens in tokenized.samples:
            assistant_tokens = sum(tokens.loss_mask)
            if assistant_tokens == 0:
                dropped["no_assistant_tokens_after_truncation"] = dropped.get("no_assistant_tokens_after_truncation", 0) + 1
                continue
            truncated += tokens.truncated
            if tokens.truncated and len(cut_examples) < MAX_EXAMPLES:
                cut_examples.append(record["id"])
            # A per-turn sample is named by its record and the message index of the turn it trains.
            sample_id = record["id"] if tokens.turn is None else turn_sample_id(record["id"], tokens.turn)
            turn_samples += tokens.turn is not None
            per_turn_tokens += len(tokens.input_ids) if tokens.turn is not None else 0
            rows.append(
                {
                    "id": sample_id,
                    "dataset": record["dataset"],
                    "input_ids": tokens.input_ids,
                    "loss_mask": tokens.loss_mask,
                    "n_tokens": len(tokens.input_ids),
                    "n_assistant_tokens": assistant_tokens,
                    "truncated": tokens.truncated,
                }
            )
    if truncated:
        print(
            f"warning: {completions_path}: {truncated} sample(s) cut at tokenize.max_seq_len = {max_seq_len} tokens "
            f"(e.g. {', '.join(cut_examples)}); raise it to train them whole", file=sys.stderr,
        )
    if unstable_turns:
        print(f"warning: {completions_path}: {unstable_turns} assistant turn(s) whose rendering does not start with their "
              f"context, not trained (e.g. {unstable_examples})", file=sys.stderr)
    stats = {
        "records": len(rows),
        "truncated": truncated,
        "dropped": dropped,
        "tokens": sum(r["n_tokens"] for r in rows),
        "assistant_tokens": sum(r["n_assistant_tokens"] for r in rows),
    }
    if per_turn_records or unstable_turns or reasoning_dropped or calls_dropped:  # only then: a plain chat shard's stats stay as they were
        stats.update({
            "per_turn_records": per_turn_records,
            "turn_samples": turn_samples,
            # The cache's cost of per-turn samples: their tokens against what those conversations hold as one sample each.
            "per_turn_tokens": per_turn_tokens,
            "per_turn_tokens_as_one_sample": one_sample_tokens,
            "unstable_turns": unstable_turns,
            "unstable_examples": unstable_examples,
            # turns whose reasoning or tool calls the chat template leaves out: not trained, so counted
            "reasoning_not_rendered": reasoning_dropped,
            "tool_calls_not_rendered": calls_dropped,
        })
    metadata = {
        "dataset": source.get("dataset"),
        "shard": source.get("shard"),
        "template_sha256": template_sha256,
        "max_seq_len": max_seq_len,
        "stats": stats,
    }
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({PARQUET_KEY: json.dumps(metadata).encode()})
    write_parquet_atomically(table, out_path)
    return stats
