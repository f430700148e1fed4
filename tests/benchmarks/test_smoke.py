"""Every kept benchmark runs for real at its smallest size on the CPU, so that a benchmark cannot rot unseen: in this
process through runpy, or as a subprocess where it launches ranks or Snakemake; the probes of a finished pipeline run
read conftest's complete_run. Each test checks the figures the script writes (the keys benchmarks/README.md names,
finite and positive), and benchmarks/README.md lists exactly the scripts here.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from factories import TOOLS_TEMPLATE, byte_tokenizer, tiny_llama

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
KEPT = {"decode_floor.py", "train_throughput.py", "specforge_step.py", "extraction.py", "regeneration.py", "dag_scale.py", "recipe_ablation.py", "drafter_probe.py"}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def run_here(script: str, *args, monkeypatch) -> None:
    """The script as `python benchmarks/<script> args` would run it, in this process."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # decode_floor reads extraction's shapes, as it does run from there
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    grad, threads, dtype = torch.is_grad_enabled(), torch.get_num_threads(), torch.get_default_dtype()
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), f"{script} exited {exit.code}"
    finally:
        # A script may set torch's process-wide state for itself; the tests after it must not inherit it.
        changed = (torch.is_grad_enabled(), torch.get_default_dtype()) != (grad, dtype)
        torch.set_grad_enabled(grad), torch.set_num_threads(threads), torch.set_default_dtype(dtype)
    assert not changed, f"{script} changed torch's grad mode or default dtype for the whole process"


def run_apart(script: str, *args, cwd: Path, timeout: int = 240) -> str:
    """The script in its own interpreter (it starts torchrun ranks or Snakemake); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_readme_lists_exactly_the_kept_scripts():
    readme = (BENCHMARKS / "README.md").read_text()
    kept_table, retired_table = readme.split("## Retired")
    listed = set(re.findall(r"^\| `([a-z_]+\.py)`", kept_table, re.MULTILINE))
    retired = set(re.findall(r"^\| `([a-z_]+\.py)`", retired_table, re.MULTILINE))
    assert {path.name for path in BENCHMARKS.glob("*.py")} == KEPT == listed
    assert len(KEPT) <= 8
    assert not KEPT & retired  # a retired probe is gone from the tree


# --------------------------------------------------------------------------- random weights, nothing built


def test_decode_floor_times_the_floor_and_the_static_decoder(tmp_path, monkeypatch):
    out = tmp_path / "floor.json"
    run_here("decode_floor.py", "--small", "--tokens", 8, "--no-compile", "--dtypes", "float32", "--repeats", 1, "--drafter-k", 2,
             "--draft-vocab", 64, "--trees", "2,2,4", "--out", out, monkeypatch=monkeypatch)
    rows = {row["decoder"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"floor", "static"}
    static = rows["static"]
    assert positive(rows["floor"]["ms_per_token"]) and positive(static["ms_per_token"]) and positive(static["ms_per_round"])
    assert static["first_divergence_from_floor"] is None  # float32: the same tokens as the floor
    assert static["spec_lossless"] and [(t["steps"], t["topk"], t["draft_tokens"], t["lossless"]) for t in static["trees"]] == [(2, 2, 4, True)]
    assert positive(static["trees"][0]["ms_per_round"])


def test_decode_floor_batches_time_each_load_and_match_eager(tmp_path, monkeypatch):
    out = tmp_path / "batches.json"
    run_here("decode_floor.py", "--small", "--tokens", 8, "--dtypes", "float32", "--repeats", 1, "--drafter-k", 2, "--draft-vocab", 64,
             "--batches", 1, 3, "--trees", "2,2,4", "--compile-mode", "default", "--out", out, monkeypatch=monkeypatch)
    rows = json.loads(out.read_text())["batches"]
    assert [(r["batch"], r["rows"]) for r in rows] == [(1, 8), (3, 8)]  # rows are allocated in multiples of 8
    for row in rows:
        assert positive(row["greedy_ms_per_step"])
        assert list(row["settings"]) == ["chain 2", "tree 2-2-4", "n-gram 2"]
        for setting in row["settings"].values():
            assert positive(setting["ms_per_round"]) and setting["graphs_match_eager"]


def test_decode_floor_profile_round_names_where_each_round_goes(tmp_path, monkeypatch):
    out = tmp_path / "profile.json"
    run_here("decode_floor.py", "--profile-round", "--small", "--trees", "2,2,4", "--no-compile", "--rounds", 2, "--drafter-k", 2,
             "--prompt-tokens", 8, "--draft-vocab", 64, "--dtypes", "float32", "--out", out, monkeypatch=monkeypatch)
    profiles = json.loads(out.read_text())["profiles"]["float32"]
    assert set(profiles) == {"greedy step", "chain 2 round", "tree (2, 2, 4) round"}
    for label, ranges in profiles.items():
        assert positive(ranges["whole step"]["cpu_us"]), label
        assert {"target attend", "target head"} <= set(ranges), label  # the target's pieces ran inside their ranges
    assert any(name.startswith("piece ") for name in profiles["tree (2, 2, 4) round"])  # and the drafter's


def test_decode_floor_profile_round_at_each_batch_names_drafting_verify_and_the_path_move(tmp_path, monkeypatch):
    out = tmp_path / "profile.json"
    run_here("decode_floor.py", "--profile-round", "--batches", 1, 3, "--small", "--trees", "2,2,4", "--no-compile", "--rounds", 2,
             "--drafter-k", 2, "--prompt-tokens", 8, "--tokens", 32, "--draft-vocab", 64, "--dtypes", "float32", "--out", out, monkeypatch=monkeypatch)
    profiles = json.loads(out.read_text())["profiles"]["float32"]
    assert set(profiles) == {f"B {b}: {label} round" for b in (1, 3) for label in ("chain 2", "tree 2-2-4")}
    for label, ranges in profiles.items():
        assert positive(ranges["whole step"]["cpu_us"]) and {"piece draft", "target verify"} <= set(ranges), label
    assert "piece move path" in profiles["B 3: tree 2-2-4 round"]  # a tree's accepted path moves; a chain's needs no move


def test_train_throughput_measures_each_variant(tmp_path, monkeypatch):
    out = tmp_path / "train.json"
    run_here("train_throughput.py", "--small", "--variants", "baseline,flex+chunked", "--warmup", 1, "--steps", 1, "--seq-len", 32,
             "--ttt-steps", 2, "--out", out, monkeypatch=monkeypatch)
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"baseline", "flex+chunked"} and positive(report["flops_per_token"])
    for name, variant in report["variants"].items():
        assert "error" not in variant, variant
        assert positive(variant["tokens_per_second"]) and len(variant["losses"]) == 2 and all(map(positive, variant["losses"])), name


def test_train_throughput_times_specforges_own_step_beside_eyries(tmp_path):
    """SpecForge's wheel fetched by the harness (into the ignored .specforge/), its step run on train_throughput's inputs."""
    out = tmp_path / "beside.json"
    stdout = run_apart("train_throughput.py", "--small", "--variants", "flex+fused-loss", "--warmup", 1, "--steps", 1, "--seq-len", 32,
                       "--ttt-steps", 2, "--specforge", BENCHMARKS / "specforge_step.py", "--out", out, cwd=tmp_path, timeout=600)
    specforge = json.loads(out.read_text())["specforge"]
    assert "error" not in specforge, specforge
    assert positive(specforge["tokens_per_second"]) and specforge["specforge"].startswith("specforge-0.2.0"), specforge
    assert specforge["seq_len"] == 32 and specforge["ttt_steps"] == 2 and all(map(positive, specforge["losses"])), specforge
    assert re.search(r"^specforge +\d+ ", stdout, re.MULTILINE), stdout[-2000:]  # its line in the summary


def test_train_throughput_processes_trains_the_same_batches_on_two_ranks(tmp_path):
    out = tmp_path / "ddp.json"
    run_apart("train_throughput.py", "--processes", 2, "--small", "--steps", 1, "--warmup", 0, "--batch", 2, "--ttt-steps", 2,
              "--seq-len", 16, "--out", out, cwd=tmp_path)
    report = json.loads(out.read_text())
    assert positive(report["one"]["tokens_per_second"]) and positive(report["many"]["tokens_per_second"])
    assert len(report["one"]["losses"]) == len(report["many"]["losses"]) == 1
    assert report["max_abs_loss_diff"] < 1e-4 and positive(report["scaling_efficiency"])


def test_extraction_measures_forwards_and_caches(tmp_path, monkeypatch):
    out = tmp_path / "extraction.json"
    run_here("extraction.py", "--small", "--tokens", 256, "--batch-tokens", 128, "--repeats", 1, "--matmul-size", 64, "--out", out,
             monkeypatch=monkeypatch)
    figures = json.loads(out.read_text())
    assert not figures["errors"]
    assert set(figures["variants"]) == {"forward_all_hidden@128", "forward_last_only@128", "extract_bf16@128", "extract_fp8@128"}
    assert all(positive(v["tokens_per_s"]) for v in figures["variants"].values()) and positive(figures["roofline_tokens_per_s"])
    assert 0 < figures["variants"]["extract_fp8@128"]["bytes_per_token"] < figures["variants"]["extract_bf16@128"]["bytes_per_token"]


def test_extraction_tensor_parallel_writes_the_same_cache_on_two_ranks(tmp_path):
    """Two gloo ranks on the CPU, the 8b phase on a tiny target saved here (the shard's vocabulary, 1,000): one process
    against two, caches compared."""
    tiny_llama(tmp_path / "target", vocab=1000, hidden=64, layers=8, heads=4, kv_heads=2)
    out = tmp_path / "tp.json"
    run_apart("extraction.py", "--tensor-parallel", 2, "--small", "--phases", "8b", "--no-reference", "--model-dir", tmp_path / "target",
              "--tokens", 256, "--batch-tokens", 128, "--repeats", 1, "--workdir", tmp_path / "work", "--out", out, cwd=tmp_path)
    phase = json.loads(out.read_text())["phases"]["8b"]
    assert (phase["tp1"]["ranks"], phase["tp2"]["ranks"]) == (1, 2) and phase["tp1"]["tokens"] == phase["tp2"]["tokens"] == 256
    assert positive(phase["tp1"]["tokens_per_s"]) and positive(phase["tp2"]["tokens_per_s"]) and positive(phase["speedup"])
    assert phase["equality"]["equal"] and phase["equality"]["same_header"]


def test_regeneration_measures_each_batching(tmp_path, monkeypatch):
    model = tmp_path / "model"
    tokenizer = byte_tokenizer(TOOLS_TEMPLATE)
    tiny_llama(model, vocab=len(tokenizer), hidden=32, layers=2, heads=2, kv_heads=1)
    tokenizer.save_pretrained(model)
    out = tmp_path / "regeneration.json"
    run_here("regeneration.py", "--model", model, "--small", "--out", out, monkeypatch=monkeypatch)
    result = json.loads(out.read_text())
    rows = {f"{row['batching']}@{row['batch_size']}": row for row in result["variants"]}
    assert set(rows) == {"padded@3", "static@3", "continuous@6"}
    for name, row in rows.items():
        assert "error" not in row, row
        assert positive(row["tokens_per_s"]) and 0 < row["tokens"] <= 6 * 8, name
    assert result["baseline"] == rows["padded@3"]


def test_dag_scale_plans_every_job(tmp_path):
    printed = run_apart("dag_scale.py", "--shards", 2, cwd=tmp_path)
    row = re.search(r"^\s+2\s+(\d+)\s+([\d.]+) /\s+([\d.]+)", printed, re.MULTILINE)
    assert row, printed
    assert int(row.group(1)) > 2 and positive(float(row.group(2)))  # the jobs planned and the dry run's seconds


def test_drafter_probe_what_if_reprices_the_sweep(tmp_path, monkeypatch):
    """copy what-if on a benchmark JSON whose answer is known: the setting accepted 2, prompt lookup 4, capped at 3."""
    bench = {"sweep": {"settings": [{"label": "tree 2-2-4", "per_prompt": [{"id": "a", "acceptance_length_mean": 2.0, "new_tokens": 10, "seconds": 1.0}]}]},
             "ngram": {"per_prompt": [{"id": "a", "acceptance_length_mean": 4.0, "new_tokens": 10, "seconds": 2.0}]}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "what_if.json"
    run_here("drafter_probe.py", "copy", "what-if", "--bench", tmp_path / "bench.json", "--setting", "tree 2-2-4", "--cap", 3,
             "--out", out, monkeypatch=monkeypatch)
    figures = json.loads(out.read_text())
    assert figures["measured_over_ngram"] == pytest.approx(2.0)  # 10 tok/s over the n-gram's 5
    assert figures["what_if_over_ngram"] == pytest.approx(3.0)  # as many rounds as 2 / 3 of them, each as long


# --------------------------------------------------------------------------- on a finished pipeline run


@pytest.mark.e2e
def test_recipe_ablation_trains_a_setting_on_the_runs_cache(complete_run, tmp_path, monkeypatch):
    out = tmp_path / "ablation.json"
    run_here("recipe_ablation.py", complete_run, "--setting", "baseline=", "--set", "train.epochs=1", "--quiet", "--out", out,
             monkeypatch=monkeypatch)
    (row,) = json.loads(out.read_text())
    assert row["setting"] == "baseline" and row["every_setting"] == {"train.epochs": 1}
    assert row["steps"] > 0 and positive(row["tokens_per_second"]) and all(map(positive, row["length"]))


@pytest.fixture(scope="module")
def run_files(complete_run):
    """The run's target, drafter, held-out prompts and benchmark, as the probes take them."""
    heldout = complete_run / "results" / "prompts" / "sharegpt" / "heldout.parquet"
    return {"target": next((complete_run / "resources" / "models").iterdir()), "drafter": complete_run / "results" / "drafter",
            "heldout": heldout, "bench": complete_run / "results" / "bench" / "sharegpt.json",
            "id": pq.read_table(heldout, columns=["id"]).column("id")[0].as_py()}


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["decode", "steps", "vocab"])
def test_drafter_probe_copy_sets_the_drafter_beside_prompt_lookup(mode, run_files, tmp_path, monkeypatch):
    out = tmp_path / f"{mode}.json"
    run_here("drafter_probe.py", "copy", mode, "--target", run_files["target"], "--drafter", run_files["drafter"], "--heldout",
             run_files["heldout"], "--ids", run_files["id"], "--steps", 3, "--max-new-tokens", 8, "--out", out, monkeypatch=monkeypatch)
    figures = json.loads(out.read_text())
    (prompt,) = figures["prompts"]
    assert prompt["id"] == run_files["id"] and 0 < prompt["new_tokens"] <= 8
    if mode == "decode":
        assert 1 <= prompt["drafter_accepted"] <= 4 and 1 <= prompt["lookup_accepted"] <= LOOKUP_K_PLUS_BONUS
        assert sum(a for a, _ in prompt["per_round"]) + 1 >= prompt["new_tokens"]  # after the prefill's token, each came out of a round
    elif mode == "steps":
        assert len(prompt["per_step"]) == 3
        # Labels count where the target's argmax lies in the draft vocabulary, which the tiny run's few hundred ids may miss.
        for j, step in enumerate(prompt["per_step"]):
            assert set(step) == {"copyable", "other"}
            assert sum(cell["labels"] for cell in step.values()) <= prompt["new_tokens"] - 1 - j
            assert all((cell["accuracy"] is None) == (cell["labels"] == 0) for cell in step.values())
            assert all(0 <= cell["accuracy"] <= 1 for cell in step.values() if cell["labels"])
    else:
        assert figures["walked"]["outside drafted right"]["length"] >= figures["walked"]["as is"]["length"] >= 1


LOOKUP_K_PLUS_BONUS = 9  # prompt lookup drafts 8 (drafter_probe.LOOKUP_K) and the round adds the target's own token


@pytest.mark.e2e
def test_drafter_probe_parity_sets_the_served_chain_beside_the_simulation(complete_run, tmp_path, monkeypatch):
    out = tmp_path / "parity.json"
    run_here("drafter_probe.py", "parity", "--workdir", complete_run, "--prompts", 1, "--max-new-tokens", 8, "--k", 3, "--device", "cpu",
             "--out", out, monkeypatch=monkeypatch)
    first = json.loads(out.read_text())["first turn"]
    assert first["served"]["prompts"] == 1 and first["served"]["rounds"] > 0 and 1 <= first["served"]["length"] <= 4
    assert len(first["served"]["rate_per_position"]) == 3
    simulated = first["simulated_on_served_tokens"]
    assert len(simulated["positions_per_step"]) == 3  # a step without positions (argmax outside the tiny vocabulary) has no length
    assert all(value is None or 1 <= value <= 4 for value in simulated["length"])


@pytest.mark.e2e
def test_drafter_probe_trees_measures_each_shape_losslessly(run_files, tmp_path, monkeypatch):
    out = tmp_path / "trees.json"
    run_here("drafter_probe.py", "trees", "--target", run_files["target"], "--drafter", run_files["drafter"], "--prompts-file",
             run_files["heldout"], "--bench", run_files["bench"], "--shapes", "2,2,4", "1,2,2", "--prompts", 1, "--max-new-tokens", 8,
             "--out", out, monkeypatch=monkeypatch)
    figures = json.loads(out.read_text())
    assert figures["round_time_line"] is None  # the CPU run's benchmark times no sweep
    assert [row["shape"] for row in figures["shapes"]] == [[2, 2, 4], [1, 2, 2]]
    for row in figures["shapes"]:
        assert row["rounds"] > 0 and 1 <= row["cpu_acceptance"] <= 3 and positive(row["cpu_seconds"])
