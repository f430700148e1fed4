"""BFCL through the real Snakefile on a finished tiny run: turning bench.bfcl on fetches BFCL's questions from the wheel,
benchmarks them with their tools and adds the benchmark to the report, and reruns nothing upstream."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import copy_of, snakemake

pytestmark = pytest.mark.e2e

BFCL = {"package": "bfcl-eval==2026.3.23", "member": "bfcl_eval/data/BFCL_v4_multiple.json", "limit": 1}


def test_bfcl_joins_a_finished_run_as_one_more_benchmark(tmp_path, complete_run):
    workdir = copy_of(complete_run, tmp_path / "run")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["bench"]["bfcl"] = BFCL
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    done = snakemake(workdir, "report.html")
    ran = done.stdout + done.stderr
    assert "benchmark_bfcl" in ran and not any(rule in ran for rule in ("rule train_drafter", "rule extract_hidden", "rule regenerate_shard"))
    result = json.loads((workdir / "results" / "bench" / "bfcl.json").read_text())
    assert result["benchmark"] == "bfcl" and result["prompts"] == 1 and result["per_prompt"][0]["id"] == "bfcl-multiple_0"
    spans = result["acceptance_by_span"]
    assert sum(spans[s]["rounds"] for s in ("thinking", "tool_call", "answer")) == result["rounds"] > 0
    assert (workdir / "resources" / "downloads" / "bfcl-eval" / "BFCL_v4_multiple.json").is_file()
    assert 'href="#bench-' in (page := (workdir / "report.html").read_text()) and ">bfcl</a>" in page
