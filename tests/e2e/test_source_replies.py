"""A dataset that keeps ShareGPT's own replies, on the real Snakefile: no generation, the replies tokenized as the
assistant turns, the same held-out split as a regenerated dataset of that name."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_workdir, snakemake

from eyrie.data.prompts import is_heldout

pytestmark = pytest.mark.e2e


def with_source_replies(config):
    sharegpt = config["datasets"]["sharegpt"]
    config["datasets"] = {"sharegpt": {**sharegpt, "replies": "source", "limit": 6, "shards": 1, "generation": {"max_new_tokens": 24}}}


def test_source_replies_are_tokenized_as_the_assistant_turns_without_generating(tmp_path, shared_resources):
    workdir = make_workdir(tmp_path / "source", shared_resources, with_source_replies)
    tokens = "results/tokens/sharegpt/0000.parquet"
    snakemake(workdir, tokens)

    summary = json.loads((workdir / "results/prompts/sharegpt/summary.json").read_text())
    assert summary["replies"] == "source" and summary["used"] == 6
    prompts = {p["id"]: p for p in pq.read_table(workdir / "results/prompts/sharegpt/0000.parquet").to_pylist()}
    assert prompts and not any(is_heldout("sharegpt", pid, 0.2) for pid in prompts)  # the split a regenerated dataset has
    completions = pq.read_table(workdir / "results/completions/sharegpt/0000.parquet")
    stats = json.loads(completions.schema.metadata[b"eyrie"])["stats"]
    assert stats["run"]["engine"] == "source" and stats["tokens_per_second"] is None
    for record in completions.to_pylist():
        source = [m["content"] for m in prompts[record["id"]]["messages"] if m["role"] == "assistant"]
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert replies and all(s.startswith(r) for s, r in zip(source, replies))  # each the source's, cut at 24 tokens
        assert max(record["completion_tokens"]) <= 24
    tokenized = pq.read_table(workdir / tokens).to_pylist()
    assert len(tokenized) == len(prompts) and all(sum(r["loss_mask"]) > 0 for r in tokenized)

    again = snakemake(workdir, "-n", tokens)
    assert "Nothing to be done" in again.stdout + again.stderr
