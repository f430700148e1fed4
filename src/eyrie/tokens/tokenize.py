"""The tokenize job: turn a completions shard into a token shard (input_ids and an assistant-only loss mask).

The token shard's schema and reader belong to eyrie.tokens.shards. The completions shard is read whole,
its content digest checked first (eyrie.core.artifacts.read_parquet).
"""

from __future__ import annotations

import json

import pyarrow as pa

from eyrie.core.artifacts import PARQUET_KEY, parquet_metadata, read_parquet
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.errors import ContractError
from eyrie.tokens.shards import TOKENS_SCHEMA
from eyrie.generation.conversations import WRITTEN_BY as COMPLETIONS_WRITTEN_BY
from eyrie.target.chat_template import tokenize_conversation


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
    for record in completions.to_pylist():
        messages = answered_messages(record["messages"])
        if not messages:
            dropped["no_assistant_reply"] = dropped.get("no_assistant_reply", 0) + 1
            continue
        tokens = tokenize_conversation(tokenizer, messages, max_seq_len)
        assistant_tokens = sum(tokens.loss_mask)
        if assistant_tokens == 0:
            dropped["no_assistant_tokens_after_truncation"] = dropped.get("no_assistant_tokens_after_truncation", 0) + 1
            continue
        truncated += tokens.truncated
        rows.append(
            {
                "id": record["id"],
                "dataset": record["dataset"],
                "input_ids": tokens.input_ids,
                "loss_mask": tokens.loss_mask,
                "n_tokens": len(tokens.input_ids),
                "n_assistant_tokens": assistant_tokens,
                "truncated": tokens.truncated,
            }
        )
    stats = {
        "records": len(rows),
        "truncated": truncated,
        "dropped": dropped,
        "tokens": sum(r["n_tokens"] for r in rows),
        "assistant_tokens": sum(r["n_assistant_tokens"] for r in rows),
    }
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
