"""Turn raw records into prompt shards: normalise, drop duplicates, hold some out, shard by id.

A prompt is the leading system turn (if any) plus the user turns in order; the
assistant turns are dropped because the target model regenerates them, unless the dataset
keeps its source's replies (`replies: source`): then each user turn is followed by the reply
the source gives it, and the conversation ends before the first user turn without one. Which
shard a record lands in, and whether it is held out, depends on its id alone, so
adding, removing or reordering other records never moves it.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from eyrie.core.atomic import write_json_atomically, write_parquet_atomically
from eyrie.core.errors import InputFileError
from eyrie.data.sources import BadRecord, RawRecord

FORMATS = ("auto", "sharegpt", "openai")
BAD_RECORD_POLICIES = ("error", "skip")
MAX_BAD_EXAMPLES = 5

# per shape: the key holding the turns, then each turn's role key and content key
SHAPES = {
    "sharegpt": ("conversations", "from", "value"),
    "openai": ("messages", "role", "content"),
}
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}

PROMPT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("dataset", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("n_user_turns", pa.int32()),
])

_SURROGATE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------- id-only assignment


def stable_unit(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (sha256), the same on every machine and run."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def shard_of(record_id: str, n_shards: int) -> int:
    """The shard a training record belongs to, from its id alone."""
    return int(hashlib.sha256(f"shard:{record_id}".encode("utf-8")).hexdigest(), 16) % n_shards


def is_heldout(dataset: str, record_id: str, fraction: float) -> bool:
    """Whether a record is kept out of training for the benchmark; salted by dataset so datasets split independently."""
    return stable_unit(f"{dataset}:holdout:{record_id}") < fraction


# ---------------------------------------------------------------- normalising one record


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    n_user_turns: int


class _Problem(Exception):
    """What is wrong inside a record; normalise_record adds the file, location and id."""

    def __init__(self, kind: str, problem: str, field: str | None = None):
        super().__init__(problem)
        self.kind, self.problem, self.field = kind, problem, field


def shape_of(data: dict, fmt: str) -> str:
    """The record's shape (a key of SHAPES): `fmt` itself, or for auto the first shape whose turn list it holds."""
    if fmt != "auto":
        return fmt
    for shape, (turns_key, _, _) in SHAPES.items():
        if turns_key in data:
            return shape
    raise _Problem("no_turn_list", "has neither a 'conversations' list (sharegpt) nor a 'messages' list (openai)")


def _check_text(value: str, field: str) -> None:
    """Lone surrogates mark invalid UTF-8 in the file (or a broken \\ud800-style escape); neither can be written out."""
    found = _SURROGATE.search(value)
    if found is None:
        return
    code = ord(found.group())
    if 0xDC80 <= code <= 0xDCFF:
        raise _Problem("invalid_utf8", f"invalid UTF-8: byte 0x{code - 0xDC00:02X} at character {found.start()}", field)
    raise _Problem("invalid_utf8", f"lone UTF-16 surrogate \\u{code:04x} at character {found.start()}", field)


def _raw_id(data: dict) -> str | None:
    """The record's own id as a string, or None when it has none (then one is derived from the content)."""
    value = data.get("id")
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Problem("bad_id", f"id must be a string or a number, got {type(value).__name__}", "id")
    text = str(value)
    _check_text(text, "id")
    return text


def _derived_id(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "sha1:" + hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:16]


def _role_of(turn: Any, shape: str, where: str) -> str:
    _, role_key, _ = SHAPES[shape]
    if not isinstance(turn, dict):
        raise _Problem("not_an_object", f"a turn must be a JSON object, got {type(turn).__name__}", where)
    raw_role = turn.get(role_key)
    role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise _Problem("unknown_role", f"unknown role {raw_role!r}; known roles: {', '.join(ROLE_MAP)}", f"{where}.{role_key}")
    return role


def _content_of(turn: dict, shape: str, where: str) -> str:
    _, _, content_key = SHAPES[shape]
    content = turn.get(content_key)
    if not isinstance(content, str):
        got = "nothing" if content_key not in turn else type(content).__name__
        raise _Problem("non_string_content", f"content must be a string, got {got}", f"{where}.{content_key}")
    _check_text(content, f"{where}.{content_key}")
    return content


def _prompt_messages(turns: list, shape: str, keep_replies: bool = False) -> list[dict[str, str]]:
    """System turn (only if first) plus the non-empty user turns; assistant turns are left for regeneration.

    keep_replies: each user turn is followed by the non-empty assistant turn that answers it, and the messages end
    before the first user turn that has none (a later reply would answer a question the conversation lost)."""
    turns_key = SHAPES[shape][0]
    messages = []
    awaiting_reply = closed = asked = False
    for index, turn in enumerate(turns):
        where = f"{turns_key}[{index}]"
        role = _role_of(turn, shape, where)
        content = _content_of(turn, shape, where)
        if role == "system" and index > 0:
            raise _Problem("misplaced_system", "a system turn may only come first", where)
        if closed:
            continue  # every turn is still checked, none is kept
        if role == "system":
            messages.append({"role": role, "content": content})
        elif role == "user" and content.strip():
            asked = True
            if keep_replies and awaiting_reply:  # two user turns in a row: the first has no reply
                closed = True
                continue
            messages.append({"role": role, "content": content})
            awaiting_reply = keep_replies
        elif role == "assistant" and awaiting_reply and content.strip():
            messages.append({"role": role, "content": content})
            awaiting_reply = False
    if awaiting_reply:
        messages.pop()  # the last user turn kept has no reply
    if not any(message["role"] == "user" for message in messages):
        if asked:  # only keep_replies drops a user turn with text
            raise _Problem("no_source_reply", "no user turn with text is followed by an assistant reply with text (replies: source)", turns_key)
        raise _Problem("no_user_turn", "no user turn with text", turns_key)
    return messages


def _normalise(data: Any, fmt: str, keep_replies: bool = False) -> Prompt:
    if not isinstance(data, dict):
        raise _Problem("not_an_object", f"a record must be a JSON object, got {type(data).__name__}")
    record_id = _raw_id(data)
    shape = shape_of(data, fmt)
    turns_key = SHAPES[shape][0]
    turns = data.get(turns_key)
    if not isinstance(turns, list):
        got = "nothing" if turns_key not in data else type(turns).__name__
        raise _Problem("no_turn_list", f"expected a list of turns ({shape} format), got {got}", turns_key)
    messages = _prompt_messages(turns, shape, keep_replies)
    n_user_turns = sum(message["role"] == "user" for message in messages)
    # A derived id reads the prompt alone, so keeping the replies does not move a record between shards or splits.
    prompt_only = [m for m in messages if m["role"] != "assistant"]
    return Prompt(record_id or _derived_id(prompt_only), messages, n_user_turns)


def _id_for_messages(data: Any) -> str | None:
    """The record's id as written, only to name the record in an error message."""
    try:
        return _raw_id(data) if isinstance(data, dict) else None
    except _Problem:
        return None


def normalise_record(record: RawRecord, fmt: str, file: str, keep_replies: bool = False) -> Prompt:
    """The prompt in a raw record; raises BadRecord naming the file, the location, the id and the field."""
    if record.error is not None:
        raise record.error
    try:
        return _normalise(record.data, fmt, keep_replies)
    except _Problem as problem:
        raise BadRecord(problem.kind, file, record.location, problem.problem,
                        record_id=_id_for_messages(record.data), field=problem.field) from None


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


# ---------------------------------------------------------------- reading a whole source


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
            if key in seen_first_turns:
                collected.repeated_first_turns += 1
                continue
            seen_first_turns.add(key)
        collected.prompts.append(prompt)
    return collected


# ---------------------------------------------------------------- writing


def _write_prompts(path: str | Path, dataset: str, prompts: list[Prompt]) -> None:
    ordered = sorted(prompts, key=lambda prompt: prompt.id)  # sorted by id: the same records give the same file
    rows = [{"id": p.id, "dataset": dataset, "messages": p.messages, "n_user_turns": p.n_user_turns} for p in ordered]
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
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
