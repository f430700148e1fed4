"""One configured dataset to prompt shards: read its source (file, hub, synthetic or rework) and build_prompts."""

from __future__ import annotations

from eyrie.data.prompts import build_prompts
from eyrie.data.rework import ReworkCounts, rework_records
from eyrie.data.sources import RecordReader, read_source
from eyrie.data.synthetic import read_summary as read_synthetic_summary


def build_prompts_for_dataset(
    *, dataset: str, spec: dict, source_path: str | None, shard_paths: list[str], heldout_path: str, summary_path: str,
    heldout_of: tuple[str, float] | None = None,
) -> dict:
    """build_prompts for one validated dataset entry of the config (what the Snakemake rule calls).

    heldout_of: for a rework dataset, (dataset, heldout_fraction) of the dataset named by its skip_heldout_of.
    """
    source = spec["source"]
    synthetic = rework = None
    if "hf" in source:
        records = read_source("hf", source_path or source["hf"]["path"], source["hf"].get("split", "train"))
    else:
        if "synthetic" in source:  # results/synthetic/<dataset>.parquet, the synthesize_prompts rule's output
            synthetic = read_synthetic_summary(source_path)
        records = read_source("file", source_path)
    fmt = spec["format"]
    if spec.get("rework") is not None:
        rework = ReworkCounts()
        # Wrapped in a reader of the same label, which hands on the file's truncation when the records run out.
        records = RecordReader(records.label, rework_records(records, spec["rework"], fmt=fmt, file=records.label, heldout_of=heldout_of,
                                                             counts=rework))
        fmt = "openai"  # what rework_records writes
    return build_prompts(
        dataset=dataset,
        records=records,
        fmt=fmt,
        limit=spec["limit"],
        n_shards=spec["shards"],
        heldout_fraction=spec["heldout_fraction"],
        on_bad_record=spec["on_bad_record"],
        shard_paths=shard_paths,
        heldout_path=heldout_path,
        summary_path=summary_path,
        synthetic=synthetic,
        rework=rework,
        dedupe_first_turn=spec.get("dedupe_first_turn", True),
        keep_replies=spec.get("replies", "target") == "source",
    )
