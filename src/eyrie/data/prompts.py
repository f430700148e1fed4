"""Turn raw records into prompt shards: normalise (eyrie.data.normalise), drop duplicates, hold some out, shard by id.

Which shard a record lands in, and whether it is held out, depends on its id alone, so
adding, removing or reordering other records never moves it.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from eyrie.core.atomic import write_json_atomically, write_parquet_atomically
from eyrie.core.errors import InputFileError
from eyrie.data.normalise import SHAPES, Prompt, normalise_record
from eyrie.data.sources import BadRecord, RawRecord
from eyrie.target.chat_template import PLAIN_MESSAGES_TYPE, is_plain, messages_type, stored_messages

FORMATS = ("auto", "sharegpt", "openai")
BAD_RECORD_POLICIES = ("error", "skip")
MAX_BAD_EXAMPLES = 5

PROMPT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("dataset", pa.string()),
    ("messages", PLAIN_MESSAGES_TYPE),
    ("n_user_turns", pa.int32()),
])


def prompt_schema(prompts: list[Prompt]) -> pa.Schema:
    """PROMPT_SCHEMA, with the messages' optional fields (eyrie.target.chat_template.messages_type) and a `tools`
    column (the record's tool definitions as JSON) where some prompt of the file has them."""
    schema = PROMPT_SCHEMA.set(2, pa.field("messages", messages_type([p.messages for p in prompts])))
    return schema.append(pa.field("tools", pa.string())) if any(p.tools for p in prompts) else schema


# ---------------------------------------------------------------- id-only assignment


def stable_unit(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (sha256), the same on every machine and run."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def shard_of(record_id: str, n_shards: int) -> int:
    """The shard a training record belongs to, from its id alone."""
    return int(hashlib.sha256(f"shard:{record_id}".encode()).hexdigest(), 16) % n_shards


def is_heldout(dataset: str, record_id: str, fraction: float) -> bool:
    """Whether a record is kept out of training for the benchmark; salted by dataset so datasets split independently."""
    return stable_unit(f"{dataset}:holdout:{record_id}") < fraction


# ---------------------------------------------------------------- reading a whole source


def _raw_roles(data: Any) -> list[str]:
    """Every role as written in a record's turns (even unknown ones), to show what the file contains."""
    if not isinstance(data, dict):
        return []
    roles = []
    for turns_key, role_key, _ in SHAPES.values():
        turns = data.get(turns_key)
        if isinstance(turns, list):
            roles += [t.get(role_key) if isinstance(t.get(role_key), str) else repr(t.get(role_key))
                      for t in turns if isinstance(t, dict)]
    return roles


AGENTIC_KINDS = ("messages_with_reasoning", "messages_with_tool_calls", "tool_calls", "tool_results", "records_with_tools")


def agentic_kinds(messages: list[dict], tools: list | None) -> Counter:
    """How many of a record's kept messages carry reasoning, tool calls (and how many calls) and tool results."""
    return Counter(
        messages_with_reasoning=sum(bool(m.get("reasoning_content")) for m in messages),
        messages_with_tool_calls=sum(bool(m.get("tool_calls")) for m in messages),
        tool_calls=sum(len(m.get("tool_calls") or []) for m in messages),
        tool_results=sum(m["role"] == "tool" for m in messages),
        records_with_tools=int(bool(tools)),
    )



@dataclass
class _Collected:
    """What one pass over the records found; `prompts` are distinct by id, in file order."""

    prompts: list[Prompt] = field(default_factory=list)
    records_read: int = 0
    duplicates: int = 0
    repeated_first_turns: int = 0
    bad_counts: Counter = field(default_factory=Counter)
    bad_examples: list[str] = field(default_factory=list)
    roles_seen: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=lambda: Counter(dict.fromkeys(AGENTIC_KINDS, 0)))

    def count_kinds(self, prompt: Prompt) -> None:
        self.kinds.update(agentic_kinds(prompt.messages, prompt.tools))

    def count_bad(self, error: BadRecord) -> None:
        self.bad_counts[error.kind] += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append(str(error))


def first_turn_key(messages: list[dict[str, str]]) -> str:
    """What decides a greedy target's first reply: the turns up to the first user turn, whitespace and case folded."""
    head = []
    for message in messages:
        head.append((message["role"], " ".join(message["content"].split()).casefold()))
        if message["role"] == "user":
            break
    return json.dumps(head)


def _collect(records: Iterable[RawRecord], fmt: str, file: str, on_bad_record: str, dedupe_first_turn: bool = False,
             keep_replies: bool = False) -> _Collected:
    """dedupe_first_turn: keep only the first record of each first_turn_key. ShareGPT repeats first turns (9% of its
    first 12,000 records; "continue" 142 times): a greedy target answers each copy alike, so they add no data, and a
    copy on each side of the held-out split lets the drafter be scored on replies it was trained on."""
    collected = _Collected()
    seen_ids: set[str] = set()
    seen_first_turns: set[str] = set()
    for record in records:
        collected.records_read += 1
        collected.roles_seen.update(_raw_roles(record.data))
        try:
            prompt = normalise_record(record, fmt, file, keep_replies)
        except BadRecord as error:
            if on_bad_record == "error":
                raise
            collected.count_bad(error)
            continue
        if prompt.id in seen_ids:
            collected.duplicates += 1
            continue
        seen_ids.add(prompt.id)
        if dedupe_first_turn:
            key = first_turn_key(prompt.messages)
            if prompt.tools:  # the same question with other tools gets another reply
                key += json.dumps(prompt.tools, sort_keys=True)
            if key in seen_first_turns:
                collected.repeated_first_turns += 1
                continue
            seen_first_turns.add(key)
        collected.prompts.append(prompt)
        collected.count_kinds(prompt)
    return collected


# ---------------------------------------------------------------- writing


def _write_prompts(path: str | Path, dataset: str, prompts: list[Prompt]) -> None:
    ordered = sorted(prompts, key=lambda prompt: prompt.id)  # sorted by id: the same records give the same file
    plain = all(is_plain(p.messages) for p in ordered)
    rows = [{"id": p.id, "dataset": dataset, "messages": stored_messages(p.messages, plain), "n_user_turns": p.n_user_turns,
             "tools": json.dumps(p.tools, ensure_ascii=False, sort_keys=True) if p.tools else None} for p in ordered]
    table = pa.Table.from_pylist(rows, schema=prompt_schema(ordered))
    _write_unless_unchanged(table, Path(path))


def _write_unless_unchanged(table: pa.Table, path: Path) -> None:
    """Write `table` to `path`, but leave a file there that already holds exactly these bytes, and its time, alone.

    The Snakefile declares the prompt shards to Snakemake only once lost, so a rerun of the prompts job (forced, or
    after a kill) finds the old shards in place. Regeneration depends on the dataset's summary, whose checksum
    Snakemake records: an unchanged summary reruns nothing, and an unchanged shard must not look newer than the
    completions made from it either (`eyrie verify` compares their times). A damaged shard differs, so it is rewritten.
    """
    if not path.exists():
        write_parquet_atomically(table, path)
        return
    fresh = path.with_name(f".{path.name}.fresh")
    write_parquet_atomically(table, fresh)  # the same writer writes the same bytes for the same rows
    if filecmp.cmp(fresh, path, shallow=False):
        fresh.unlink()
    else:
        os.replace(fresh, path)


def _check_arguments(fmt: str, limit: int | None, n_shards: int, heldout_fraction: float,
                     on_bad_record: str, shard_paths: list) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise ValueError(f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got {on_bad_record!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or at least 1, got {limit}")
    if n_shards < 1 or len(shard_paths) != n_shards:
        raise ValueError(f"need n_shards >= 1 and one path per shard: n_shards={n_shards}, {len(shard_paths)} paths")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")


def build_prompts(
    *,
    dataset: str,
    records: Iterable[RawRecord],
    source_label: str | None = None,
    fmt: str = "auto",
    limit: int | None = None,
    n_shards: int,
    heldout_fraction: float,
    on_bad_record: str = "error",
    shard_paths: list[str | Path],
    heldout_path: str | Path,
    summary_path: str | Path,
    synthetic: dict | None = None,
    rework: Any = None,
    dedupe_first_turn: bool = False,
    keep_replies: bool = False,
) -> dict:
    """Normalise every record, keep the first `limit` distinct ones, and write shard, held-out and summary files.

    `records` is usually a RecordReader (its `label` names the input and its `truncation` is reported);
    any iterable of RawRecord works. `synthetic`: for a synthetic source, what its file says of how the
    prompts were made (eyrie.data.synthetic.read_summary), carried into the summary for the report. `rework`: for a
    rework dataset, its eyrie.data.rework.ReworkCounts, filled while `records` is read.
    Returns the summary that was written to `summary_path`.
    """
    _check_arguments(fmt, limit, n_shards, heldout_fraction, on_bad_record, shard_paths)
    source = source_label or getattr(records, "label", "<records>")
    collected = _collect(records, fmt, source, on_bad_record, dedupe_first_turn, keep_replies)
    truncation = getattr(records, "truncation", None)  # known only once the reader is exhausted
    if not collected.prompts:
        raise InputFileError(
            f"{source}: no usable records ({collected.records_read} read, {collected.duplicates} duplicates, "
            f"bad records: {dict(collected.bad_counts) or 'none'})"
        )

    used = collected.prompts[:limit]  # the whole file was still read, so the counts above are complete
    heldout = [p for p in used if is_heldout(dataset, p.id, heldout_fraction)]
    shards: list[list[Prompt]] = [[] for _ in range(n_shards)]
    for prompt in used:
        if not is_heldout(dataset, prompt.id, heldout_fraction):
            shards[shard_of(prompt.id, n_shards)].append(prompt)

    for path, shard in zip(shard_paths, shards):
        _write_prompts(path, dataset, shard)
    _write_prompts(heldout_path, dataset, heldout)

    summary = {
        "dataset": dataset,
        "source": source,
        "format": fmt,
        "records_read": collected.records_read,
        "bad_records": dict(sorted(collected.bad_counts.items())),
        "bad_examples": collected.bad_examples,
        "duplicates": collected.duplicates,
        "repeated_first_turns": collected.repeated_first_turns if dedupe_first_turn else None,
        "usable": len(collected.prompts),
        "limit": limit,
        "used": len(used),
        "heldout": len(heldout),
        "train": len(used) - len(heldout),
        "shards": {f"{index:04d}": len(shard) for index, shard in enumerate(shards)},
        "truncation": truncation.as_dict() if truncation is not None else None,
        "roles_seen": dict(collected.roles_seen.most_common()),
    }
    if any(collected.kinds.values()):  # only then: an unchanged summary of any other dataset reruns nothing downstream
        summary["agentic"] = dict(collected.kinds)
    if keep_replies:  # only then: an unchanged summary of any other dataset reruns nothing downstream
        summary["replies"] = "source"
    if synthetic is not None:
        summary["synthetic"] = synthetic
    if rework is not None:
        summary["rework"] = rework.as_dict()
    write_json_atomically(summary_path, summary)  # written last: its presence means the prompt files are complete
    return summary


def lost_shards(summary_path: str | Path, shard_paths: list[str]) -> list[str]:
    """The shards that are gone although the job that writes them finished: its summary, written last, is there.

    The Snakefile declares these (and only these) as the prompts job's outputs, so that Snakemake reruns the job
    for a target that asks for them. Declaring every shard would make planning quadratic in the shard count:
    every regeneration job depends on the prompts job, and Snakemake walks all of its outputs for each one.
    Costs one stat per shard once the prompts exist, one in all before.
    """
    if not os.path.exists(summary_path):
        return []  # not built yet, or killed before it finished (its declared outputs are then missing too)
    return [path for path in shard_paths if not os.path.exists(path)]
