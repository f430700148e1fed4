"""The token shard FORMAT: its schema, and the one reader of its token columns.

A token shard (``results/tokens/<dataset>/<shard>.parquet``, written by the extraction job before it
extracts, or by the tokenize job with hidden.mode online; eyrie.tokens.tokenize) holds one row per
conversation, or one per assistant turn (id ``<record id>#<message index>``) where the chat template
renders its history unstably (eyrie.target.chat_template): ``input_ids`` and an assistant-only
``loss_mask`` of the same length, with the chat template's fingerprint in its ``eyrie`` metadata.
Extraction and the draft vocabulary read it through ``read_tokens`` (the content digest checked first,
eyrie.core.digest) and ``shard_template``; a shard that cannot be read is an ArtifactError naming the
file, the job that wrote it and the command that rebuilds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eyrie.core.artifacts import read_parquet, read_parquet_metadata
from eyrie.core.errors import ArtifactError

TOKENS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("n_tokens", pa.int32()),
        ("n_assistant_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)
# The Snakemake rule that writes a token shard, named in read errors: extraction tokenizes its own shard (one job per
# shard, not two); with hidden.mode online nothing is extracted and tokenize_shard writes it.
WRITTEN_BY = "extract_hidden (tokenize_shard with hidden.mode online)"


def turn_sample_id(record_id: str, turn: int) -> str:
    """The id of the sample that trains one assistant turn (message index `turn`) of a record."""
    return f"{record_id}#{turn}"


def record_of(sample_id: str) -> str:
    """The record a sample comes from: its id less a per-turn ``#<message index>`` suffix (one conversation's turns
    share their earlier context, so whatever splits samples into sets must split records)."""
    record, sep, turn = sample_id.rpartition("#")
    return record if sep and turn.isdigit() else sample_id


class TokenColumns(NamedTuple):
    """A shard's samples back to back: sample k is input_ids[offsets[k] : offsets[k + 1]]."""

    ids: list[str] | None  # sample ids in shard order; None unless asked for
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T], 1 on assistant tokens
    offsets: np.ndarray  # int64 [samples + 1]


def shard_template(path: str | Path) -> str | None:
    """The chat template fingerprint the shard was tokenized with (None when it records none)."""
    return read_parquet_metadata(path, written_by=WRITTEN_BY).get("template_sha256")


def read_tokens(path: str | Path, error: type[Exception], with_ids: bool = True) -> TokenColumns:
    """input_ids, loss_mask and offsets of every sample; raises `error` (the caller's stage error) when a row's
    input_ids and loss_mask differ in length."""
    table = read_parquet(path, (["id"] if with_ids else []) + ["input_ids", "loss_mask"], written_by=WRITTEN_BY)
    ids_col = table.column("input_ids").combine_chunks()
    mask_col = table.column("loss_mask").combine_chunks()
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    mask_lengths = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False).astype(np.int64)
    if not np.array_equal(lengths, mask_lengths):
        row = int(np.flatnonzero(lengths != mask_lengths)[0])
        raise error(f"{path}: row {row}: input_ids and loss_mask differ in length; re-run the tokenize stage")
    input_ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    loss_mask = mask_col.flatten().to_numpy(zero_copy_only=False).astype(np.int8)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenColumns(table.column("id").to_pylist() if with_ids else None, input_ids, loss_mask, offsets)


def per_turn_cost(paths) -> str | None:
    """What per-turn samples (eyrie.target.chat_template) cost the hidden-state cache in these token shards, as a line;
    None where no shard has any (or none is tokenized yet)."""
    records = samples = tokens = as_one = unstable = 0
    for path in paths:
        if not Path(path).exists():
            continue
        try:
            stats = read_parquet_metadata(path, written_by=WRITTEN_BY).get("stats") or {}
        except (ArtifactError, OSError):  # an unreadable shard is eyrie verify's to name; the plan only informs
            continue
        records += stats.get("per_turn_records", 0)
        samples += stats.get("turn_samples", 0)
        tokens += stats.get("per_turn_tokens", 0)
        as_one += stats.get("per_turn_tokens_as_one_sample", 0)
        unstable += stats.get("unstable_turns", 0)
    if not records and not unstable:
        return None
    ratio = f", {tokens / as_one:.2f}x the {as_one:,} tokens they hold as one sample each" if as_one else ""
    return (f"  per-turn samples: {samples:,} from {records:,} conversations whose template renders history unstably: "
            f"{tokens:,} tokens in the cache{ratio}; {unstable:,} turns not locatable, not trained")
