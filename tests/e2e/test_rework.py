"""A rework dataset on the real Snakefile: ShareGPT's replies handed back to the target, regenerated and tokenized."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_workdir, snakemake

from eyrie.data.prompts import is_heldout

pytestmark = pytest.mark.e2e


def with_a_rework_dataset(config):
    sharegpt = config["datasets"]["sharegpt"]
    config["datasets"] = {
        "sharegpt": sharegpt,
        "rework": {"source": sharegpt["source"], "rework": {"skip_heldout_of": "sharegpt", "max_chars": 1200},
                   "limit": 3, "shards": 1, "heldout_fraction": 0.0, "on_bad_record": "skip", "generation": {"max_new_tokens": 8}},
    }


def test_replies_handed_back_are_regenerated_and_tokenized_and_skip_what_sharegpt_holds_out(tmp_path, shared_resources):
    workdir = make_workdir(tmp_path / "rework", shared_resources, with_a_rework_dataset)
    tokens = "results/tokens/rework/0000.parquet"
    snakemake(workdir, tokens)

    summary = json.loads((workdir / "results/prompts/rework/summary.json").read_text())
    assert summary["used"] == summary["train"] == 3 and summary["rework"]["made"] >= 3 and summary["rework"]["heldout_skipped"] >= 1
    prompts = pq.read_table(workdir / "results/prompts/rework/0000.parquet").to_pylist()
    assert all(p["id"].startswith("rework:") and not is_heldout("sharegpt", p["id"].removeprefix("rework:"), 0.2) for p in prompts)
    completions = pq.read_table(workdir / "results/completions/rework/0000.parquet").to_pylist()
    assert {c["id"] for c in completions} == {p["id"] for p in prompts}
    assert all([m["role"] for m in c["messages"]] == ["user", "assistant"] and c["messages"][1]["content"] for c in completions)
    tokenized = pq.read_table(workdir / tokens).to_pylist()
    assert len(tokenized) == 3 and all(sum(r["loss_mask"]) > 0 for r in tokenized)

    again = snakemake(workdir, "-n", tokens)
    assert "Nothing to be done" in again.stdout + again.stderr
