"""End to end on the real Snakefile with the tiny config and the real default model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import SNAKEMAKE, TINY_CONFIG, copy_of, make_workdir, snakemake
from factories import CHROMIUM, chromium, page_text

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def built(tmp_path_factory, complete_run):
    """One complete run of the tiny config up to report.html: the test run's complete run (everything up to the drafter
    is the same), taken on to the tiny config's own benchmarks (two prompts, the sweep, HumanEval and MT-bench)."""
    workdir = copy_of(complete_run, tmp_path_factory.mktemp("e2e") / "run")
    (workdir / "config.yaml").write_text(TINY_CONFIG.read_text())
    done = snakemake(workdir, "report.html")
    assert "rule regenerate_shard:" not in done.stdout + done.stderr and "rule benchmark_mtbench:" in done.stdout + done.stderr
    return workdir


def dry_run_jobs(workdir) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job a dry run would execute."""
    out = snakemake(workdir, "-n", "report.html").stdout
    jobs, rule = set(), None
    for line in out.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):", line.strip()):
            rule = m.group(1)
            jobs.add((rule, ""))
        elif rule and (m := re.match(r"wildcards: (.*)", line.strip())):
            jobs.discard((rule, ""))
            jobs.add((rule, m.group(1)))
    return jobs


def test_chain_builds_and_second_run_does_nothing(built):
    for dataset, shards in (("sharegpt", 2), ("local", 1)):
        summary = json.loads((built / f"results/prompts/{dataset}/summary.json").read_text())
        assert summary["used"] == summary["train"] + summary["heldout"]
        for shard in range(shards):
            completions = pq.read_table(built / f"results/completions/{dataset}/{shard:04d}.parquet").to_pylist()
            tokens = pq.read_table(built / f"results/tokens/{dataset}/{shard:04d}.parquet").to_pylist()
            assert {r["id"] for r in tokens} <= {r["id"] for r in completions}
            for record in completions:
                replies = [m for m in record["messages"] if m["role"] == "assistant"]
                assert len(replies) == record["n_turns"] >= 1
    local = pq.read_table(built / "results/completions/local/0000.parquet").to_pylist()
    two_turns = next(r for r in local if r["id"] == "local-2")
    # The dataset's own assistant reply ("4") is replaced by the target's, and both user turns are answered.
    assert [m["role"] for m in two_turns["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert len(two_turns["completion_tokens"]) == 2 and min(two_turns["completion_tokens"]) > 0
    assert (built / "report.html").stat().st_size > 1000

    again = snakemake(built, "report.html")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_loss_mask_covers_exactly_the_assistant_replies(built, tokenizer):
    completions = {r["id"]: r for r in pq.read_table(built / "results/completions/local/0000.parquet").to_pylist()}
    for record in pq.read_table(built / "results/tokens/local/0000.parquet").to_pylist():
        runs, current = [], []
        for token, masked in zip(record["input_ids"], record["loss_mask"]):
            if masked:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        replies = [m["content"] for m in completions[record["id"]]["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in runs] == [reply + tokenizer.eos_token for reply in replies]


def test_changing_one_dataset_setting_reruns_only_that_dataset(built):
    config_path = built / "config.yaml"
    original = config_path.read_text()
    config = yaml.safe_load(original)
    config["datasets"]["local"]["generation"]["max_new_tokens"] = 9
    config_path.write_text(yaml.safe_dump(config))
    try:
        jobs = dry_run_jobs(built)
    finally:
        config_path.write_text(original)
    # Per-shard work reruns for that dataset only; what pools every dataset (vocab, drafter, benchmarks) follows.
    shard_jobs = {(rule, wc) for rule, wc in jobs if "shard=" in wc}
    assert shard_jobs == {
        ("regenerate_shard", "dataset=local, shard=0000"),
        ("extract_hidden", "dataset=local, shard=0000"),  # which tokenizes the shard too
    }
    assert not any(rule.startswith("build_prompts") for rule, _ in jobs)
    assert {rule for rule, _ in jobs} - {r for r, _ in shard_jobs} <= {
        "build_draft_vocab", "train_drafter", "export_speculators", "benchmark_heldout", "benchmark_humaneval", "benchmark_mtbench",
        "write_report",
    }


def test_plan_reports_finished_work(built):
    from eyrie import config as cfg
    from eyrie.plan import build_plan

    table, summary = build_plan(cfg.load(built / "config.yaml"), built)
    assert set(table["state"]) == {"done"}
    assert (table["left"] == 0).all()
    assert summary["basis"].startswith("measured")


def test_kill_during_regeneration_then_rerun_keeps_each_prompt_once(tmp_path, shared_resources):
    prompts = [{"id": f"k{i}", "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]} for i in range(12)]

    def one_prompt_per_batch(config):
        config["datasets"] = {"local": {"source": {"file": "data/local.jsonl"}, "shards": 1, "heldout_fraction": 0.0}}
        config["engine"]["max_batch_size"] = 1
        config["generation"]["max_new_tokens"] = 16
        config["generation"]["max_turns"] = 1

    workdir = make_workdir(tmp_path / "kill", shared_resources, one_prompt_per_batch, prompts)
    partial_dir = workdir / "results/partial/completions/local/0000"
    process = subprocess.Popen(
        [*SNAKEMAKE, "-d", str(workdir), "--cores", "2", "results/completions/local/0000.parquet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        logs = list(partial_dir.glob("*.jsonl"))
        if logs and logs[0].read_text().count("\n") >= 3:
            break
        time.sleep(0.2)
    assert process.poll() is None, "regeneration finished before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (workdir / "results/completions/local/0000.parquet").exists()
    kept = (partial_dir / next(partial_dir.iterdir()).name).read_text().count("\n")

    snakemake(workdir, "--unlock")
    snakemake(workdir, "--rerun-incomplete", "results/completions/local/0000.parquet")
    table = pq.read_table(workdir / "results/completions/local/0000.parquet")
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(p["id"] for p in prompts)
    stats = json.loads(table.schema.metadata[b"eyrie"])["stats"]
    assert stats["resumed_turns"] >= kept >= 3


def test_reordering_the_config_reruns_nothing(built):
    config_path = built / "config.yaml"
    original = config_path.read_text()
    config = yaml.safe_load(original)
    reordered = {key: config[key] for key in reversed(list(config))}
    reordered["datasets"] = {name: dict(reversed(list(spec.items()))) for name, spec in reversed(list(config["datasets"].items()))}
    config_path.write_text(yaml.safe_dump(reordered, sort_keys=False))
    try:
        out = snakemake(built, "-n", "report.html")
    finally:
        config_path.write_text(original)
    assert "Nothing to be done" in out.stdout + out.stderr


def test_whole_chain_produced_a_servable_drafter_and_measured_benchmarks(built):
    from safetensors.torch import load_file

    from eyrie.drafter.checkpoint import check_checkpoint
    from eyrie.drafter.model import DrafterShape

    config = json.loads((built / "results/drafter/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    check_checkpoint(load_file(built / "results/drafter/model.safetensors"), DrafterShape.from_sglang_config(config))
    for name in ("sharegpt", "humaneval"):
        bench = json.loads((built / f"results/bench/{name}.json").read_text())
        if bench["prompts"]:
            assert bench["lossless"] is True  # float32: speculation never changes the greedy output
            assert bench["mean_acceptance_length"] >= 1.0 and bench["greedy_tokens_per_s"] > 0


def test_trained_drafter_beats_a_random_one_on_acceptance(built, model_dir):
    """On the target's own replies, a few training steps already make drafts that the target accepts."""
    import torch

    from eyrie.decoding.transformers_path import speculative_decode
    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.target.chat_template import render
    from eyrie.target.model import load_target

    torch.manual_seed(0)
    target, tokenizer = load_target(built / "resources/models/SmolLM2-135M-Instruct", dtype="float32", device="cpu")
    embeddings = target.get_input_embeddings().weight
    trained = load_drafter(built / "results/drafter", embeddings)
    random_drafter = load_drafter(built / "results/drafter", embeddings)
    for parameter in random_drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    records = pq.read_table(built / "results/completions/local/0000.parquet").to_pylist()
    stop_ids = [tokenizer.eos_token_id]

    def mean_acceptance(drafter):
        lengths = []
        for record in records:
            first_turn = record["messages"][: next(i for i, m in enumerate(record["messages"]) if m["role"] == "user") + 1]
            prompt = tokenizer(render(tokenizer, first_turn, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            lengths += speculative_decode(target, drafter, prompt, 8, stop_ids, draft_tokens=3).acceptance_lengths
        return sum(lengths) / len(lengths)

    assert mean_acceptance(trained) > mean_acceptance(random_drafter)


def test_the_real_report_opens_in_chromium_and_shows_the_benchmark(built, tmp_path):
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    artifacts = Path(os.environ.get("EYRIE_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "e2e-report.png"
    dom = chromium(built / "report.html", tmp_path / "profile", "--dump-dom").stdout
    chromium(built / "report.html", tmp_path / "profile2", f"--screenshot={screenshot}")
    text = page_text(dom)
    bench = json.loads((built / "results/bench/humaneval.json").read_text())
    assert "humaneval" in text and f"{bench['mean_acceptance_length']:.2f}" in text
    assert "LlamaForCausalLMEagle3" in text or "EAGLE3" in text
    assert screenshot.stat().st_size > 10_000


def test_two_training_processes_through_the_snakefile(built):
    """train.processes: 2 reruns training (and what follows) as two torchrun ranks, and the drafter is servable."""
    from safetensors.torch import load_file

    from eyrie.drafter.checkpoint import check_checkpoint
    from eyrie.drafter.model import DrafterShape

    config_path = built / "config.yaml"
    original = config_path.read_text()
    config = yaml.safe_load(original)
    config["train"]["processes"] = 2
    config_path.write_text(yaml.safe_dump(config))
    try:
        jobs = {rule for rule, _ in dry_run_jobs(built)}
        assert jobs - {"all"} == {"train_drafter", "export_speculators", "benchmark_heldout", "benchmark_humaneval", "benchmark_mtbench",
                                  "write_report"}
        snakemake(built, "results/drafter")  # the benchmarks that follow are the same code as for one process
        log = (built / "logs/train/drafter.log").read_text()
        assert "2 ranks" in log and json.loads((built / "results/partial/train/launch.json").read_text())["train_cfg"]["processes"] == 2
        drafter = built / "results/drafter"
        check_checkpoint(load_file(str(drafter / "model.safetensors")), DrafterShape.from_sglang_config(json.loads((drafter / "config.json").read_text())))
    finally:
        config_path.write_text(original)  # the last test of this module: the workdir is not built back
