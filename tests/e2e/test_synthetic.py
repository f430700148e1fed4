"""A synthetic dataset on the real Snakefile: the target writes the prompts, and they go on like any other dataset's."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import TINY_CONFIG, make_workdir, snakemake
from factories import plans_of

from eyrie.core.digest import verify

SYNTHETIC = {"count": 3, "topics": ["Python functions", "math word problems"], "max_tokens": 40, "batch_size": 8, "max_samples": 16}


def only_a_synthetic_dataset(config):
    config["datasets"] = {"syn": {"source": {"synthetic": dict(SYNTHETIC)}, "shards": 2, "heldout_fraction": 0.25}}
    config["generation"]["max_new_tokens"] = 8
    config["generation"]["max_turns"] = 1


def test_planned_outputs_of_a_synthetic_dataset_are_what_snakemake_plans(tmp_path):
    """eyrie.plan's list (rule all, eyrie verify) and the rules agree on the synthetic file and what is made from it."""
    config = yaml.safe_load(TINY_CONFIG.read_text())
    only_a_synthetic_dataset(config)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake_plans, planned, undeclared = plans_of(tmp_path)
    assert ("results/synthetic/syn.parquet", "synthesize_prompts") in planned
    assert undeclared and snakemake_plans == planned - undeclared


@pytest.mark.e2e
def test_the_target_writes_a_datasets_prompts_and_they_flow_to_tokens(tmp_path, shared_resources):
    workdir = make_workdir(tmp_path / "syn", shared_resources, only_a_synthetic_dataset)
    tokens = ["results/tokens/syn/0000.parquet", "results/tokens/syn/0001.parquet"]
    snakemake(workdir, *tokens)

    made = workdir / "results/synthetic/syn.parquet"
    assert verify(made) is not None
    records = pq.read_table(made).to_pylist()
    meta = json.loads(pq.read_schema(made).metadata[b"eyrie"])
    assert len(records) == meta["stats"]["kept"] >= 1 and meta["end_of_turn"] == "<|im_end|>"
    assert all(r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip() for r in records)

    summary = json.loads((workdir / "results/prompts/syn/summary.json").read_text())
    assert summary["used"] == len(records) == summary["train"] + summary["heldout"]
    assert summary["synthetic"]["kept"] == len(records) and summary["synthetic"]["topics"] == SYNTHETIC["topics"]
    tokenized = [r for path in tokens for r in pq.read_table(workdir / path).to_pylist()]
    assert {r["id"] for r in tokenized} <= {r["id"] for r in records} and 1 <= len(tokenized) <= summary["train"]
    assert all(sum(r["loss_mask"]) > 0 for r in tokenized)

    again = snakemake(workdir, "-n", *tokens)
    assert "Nothing to be done" in again.stdout + again.stderr
