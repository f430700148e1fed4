"""The benchmark: measured (the drafter and the n-gram baseline), written even when it fails, and refusing a drafter trained on another template."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import random_target_drafter
import torch

from eyrie.bench.benchmark import run_benchmark
from eyrie.bench.errors import DrafterNotEngagedError
from eyrie.bench.prompt_files import load_benchmark_prompts
from eyrie.core.errors import BadRecordError, ContractError

PROMPTS = [
    {"id": "p-1", "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
    {
        "id": "p-2",
        "messages": [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    },
]
# No sweep unless a test is about it: its settings are measured in the tests below.
CFG = {"draft_tokens": 3, "max_new_tokens": 12, "min_acceptance_length": 1.05, "dtype": "float32", "sweep": []}
# A chain of 2 and a small tree, on transformers' decoder (eyrie.decoding.tree): what the sweep tests measure.
SWEEP = [{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": 2, "draft_tokens": 4}]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def drafter(target):
    return random_target_drafter(target[0])


def save_drafter(drafter, out_dir, template_sha256: str, **eyrie):
    """A drafter directory as the train stage writes it: SGLang's config plus eyrie's block, safetensors."""
    from safetensors.torch import save_file

    from eyrie.drafter.checkpoint import checkpoint_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    config = drafter.shape.sglang_config(torch_dtype="float32")
    config["eyrie"] = {"template_sha256": template_sha256, **eyrie}
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file(checkpoint_tensors(drafter, torch.float32), str(out_dir / "model.safetensors"))
    return out_dir


def test_a_benchmark_without_prompts_is_recorded_not_failed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eyrie.bench.benchmark import run_benchmark_job

    heldout = tmp_path / "heldout.parquet"
    from eyrie.data.prompts import PROMPT_SCHEMA

    pq.write_table(pa.Table.from_pylist([], schema=PROMPT_SCHEMA), heldout)
    out = tmp_path / "bench" / "small.json"
    result = run_benchmark_job(benchmark="small", prompts_path=heldout, drafter_dir="unused", target_dir="unused", bench_cfg=CFG, out_path=out)
    assert result["prompts"] == 0 and result["mean_acceptance_length"] is None and result["error"] is None
    assert json.loads(out.read_text())["note"].startswith("no held-out prompts")


def test_not_engaged_drafter_fails_after_writing_everything_measured(tmp_path, model_dir, target, drafter):
    from eyrie.target.model import template_fingerprint

    _, tokenizer = target
    drafter_dir = save_drafter(drafter, tmp_path / "drafter", template_fingerprint(tokenizer))
    out = tmp_path / "bench" / "local.json"
    with pytest.raises(DrafterNotEngagedError) as raised:
        run_benchmark(
            target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS, benchmark_name="local",
            bench_cfg=CFG, out_path=out, template_sha256_expected=template_fingerprint(tokenizer), device="cpu",
        )
    message = str(raised.value)
    for cause in ("EAGLE3", "off by one", "d2t", "chat template", "fc fed"):
        assert cause in message
    written = json.loads(out.read_text())
    assert message.startswith(written["error"])
    # Snakemake deletes the declared output of a failed job; a copy beside it keeps the measurements.
    assert json.loads((out.parent / "local.failed.json").read_text()) == written
    assert 1.0 <= written["mean_acceptance_length"] < CFG["min_acceptance_length"]
    assert written["lossless"] is True  # float32: speculation never changes the output, even with a useless drafter
    assert written["prompts"] == 2 and written["draft_tokens"] == 3 and written["dtype"] == "float32"
    assert written["device"] == "cpu" and "torch threads" in written["hardware"]
    assert len(written["acceptance_rate_per_position"]) == 3
    assert written["speedup"] == pytest.approx(written["spec_tokens_per_s"] / written["greedy_tokens_per_s"])
    rows = {row["id"]: row for row in written["per_prompt"]}
    assert set(rows) == {"p-1", "p-2"}
    for row in rows.values():
        assert row["identical"] is True and row["first_divergence"] is None
        assert 1 <= row["new_tokens"] <= CFG["max_new_tokens"] and row["rounds"] == len(row["acceptance_lengths"])
        assert row["greedy_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
    rounds = sum(row["rounds"] for row in rows.values())
    assert written["mean_acceptance_length"] == pytest.approx(sum(sum(r["acceptance_lengths"]) for r in rows.values()) / rounds)
    # The n-gram baseline ran on the same prompts before the failure, and its block is in the JSON.
    ngram = written["ngram"]
    assert ngram["lossless"] is True and ngram["draft_tokens"] == 3 and (ngram["max_ngram"], ngram["min_ngram"]) == (3, 1)
    assert [row["id"] for row in ngram["per_prompt"]] == [row["id"] for row in written["per_prompt"]]
    assert len(ngram["acceptance_rate_per_position"]) == 3 and ngram["rounds"] == sum(r["rounds"] for r in ngram["per_prompt"])
    for row in ngram["per_prompt"]:
        assert row["identical"] and row["new_tokens"] == rows[row["id"]]["new_tokens"] and row["tokens_per_s"] > 0
        assert all(1 <= length <= 4 for length in row["acceptance_lengths"]) and row["rounds"] == len(row["acceptance_lengths"])
    assert ngram["mean_acceptance_length"] == pytest.approx(sum(sum(r["acceptance_lengths"]) for r in ngram["per_prompt"]) / ngram["rounds"])
    assert ngram["speedup"] == pytest.approx(ngram["tokens_per_s"] / written["greedy_tokens_per_s"])
    assert written["speedup_over_ngram"] == pytest.approx(written["spec_tokens_per_s"] / ngram["tokens_per_s"])


def test_engaged_run_returns_what_it_writes(tmp_path, model_dir, drafter):
    out = tmp_path / "bench.json"
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0}, out_path=out, device="cpu",
    )
    assert result["error"] is None
    assert result["decoder"] == "static" and result["decoder_fallback_reason"] is None  # auto: the Llama target runs static
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    outside = result["outside_draft_vocab"]  # greedy reply tokens the drafter's vocabulary lacks, counted over every prompt
    assert outside["new_tokens"] == sum(row["new_tokens"] for row in result["per_prompt"]) and 0 <= outside["outside"] <= outside["new_tokens"]
    assert sum(t["count"] for t in outside["most_common"]) <= outside["outside"]
    assert all(not bool(drafter.t2d[t["id"]]) and isinstance(t["text"], str) for t in outside["most_common"])
    spans = result["acceptance_by_span"]  # every round counts for one span: together they are the run's rounds and mean
    assert sum(spans[s]["rounds"] for s in ("thinking", "tool_call", "answer")) == result["rounds"] > 0
    emitted = sum(spans[s]["rounds"] * spans[s]["mean"] for s in ("thinking", "tool_call", "answer") if spans[s]["rounds"])
    assert emitted / result["rounds"] == pytest.approx(result["mean_acceptance_length"])


def test_transformers_decoder_is_recorded_with_the_reason(tmp_path, model_dir, drafter):
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 4, "min_acceptance_length": 1.0, "decoder": "transformers"},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    assert result["decoder"] == "transformers" and "transformers" in result["decoder_fallback_reason"]
    assert result["lossless"] is True and result["ngram"]["lossless"] is True


def test_timing_in_bfloat16_proves_losslessness_in_float32_on_the_same_prompts(tmp_path, model_dir, target, drafter):
    from eyrie.target.model import template_fingerprint

    drafter_dir = save_drafter(drafter, tmp_path / "drafter", template_fingerprint(target[1]))  # loaded afresh in each dtype
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "dtype": "bfloat16", "ngram": False},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    assert result["dtype"] == "bfloat16"  # the timing
    check = result["float32_check"]
    assert check["dtype"] == "float32" and check["checked"] == 1 and check["different"] == [] and check["lossless"] is True
    assert result["lossless"] is True  # the verdict is float32's
    assert result["agreement_in_timing_dtype"]["dtype"] == "bfloat16" and result["agreement_in_timing_dtype"]["checked"] == 1
    assert "largest_margin_at_divergence" in result["agreement_in_timing_dtype"]
    assert all("margin_at_divergence" in row for row in result["per_prompt"])


def test_each_load_runs_on_an_engine_of_its_own_rows_and_is_proved_lossless_in_float32(tmp_path, model_dir, target, drafter):
    from eyrie.target.model import template_fingerprint

    drafter_dir = save_drafter(drafter, tmp_path / "drafter", template_fingerprint(target[1]))
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 5, "min_acceptance_length": 1.0, "dtype": "bfloat16", "concurrency": [2, 1]},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    block = result["concurrency"]
    assert block["off_reason"] is None and block["batches"] == [1, 2]
    assert [(e["batch"], e["engine_rows"]) for e in block["per_batch"]] == [(1, 1), (2, 2)]  # no dummy rows timed
    for entry in block["per_batch"]:
        for row in entry["settings"]:  # timed in bf16, checked row by row against float32 batched greedy
            assert row["float32_identical_rows"] == row["rows"] == entry["batch"] * entry["waves"] and row["lossless"] is True


def test_ngram_false_skips_the_baseline(tmp_path, model_dir, drafter):
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 4, "min_acceptance_length": 1.0, "ngram": False},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    assert result["ngram"] is None and result["speedup_over_ngram"] is None
    assert result["prompts"] == 1 and result["lossless"] is True
    assert result["float32_check"] is None  # timed in float32: the timed run itself is the check


def test_the_ngram_baseline_is_its_fastest_draft_length(tmp_path, model_dir, drafter):
    """bench.ngram_draft_tokens: prompt lookup decodes every prompt at each length, and the fastest is the baseline the
    drafter's speedup_over_ngram is taken against; every length's figures stay in the block."""
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS, benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "ngram_draft_tokens": [2, 5]},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    ngram = result["ngram"]
    lengths = {entry["draft_tokens"]: entry for entry in ngram["by_draft_tokens"]}
    assert set(lengths) == {2, 5} and all(entry["lossless"] for entry in lengths.values())
    assert ngram["tokens_per_s"] == max(entry["tokens_per_s"] for entry in lengths.values())
    assert lengths[ngram["draft_tokens"]]["tokens_per_s"] == ngram["tokens_per_s"]
    assert len(ngram["acceptance_rate_per_position"]) == ngram["draft_tokens"]  # the chosen length's own rows
    assert result["speedup_over_ngram"] == pytest.approx(result["spec_tokens_per_s"] / ngram["tokens_per_s"])


def test_fastest_ngram_takes_the_quicker_length_and_the_first_on_a_tie():
    from eyrie.bench.ngram_baseline import fastest_ngram

    def rows(seconds, k):
        return [{"id": "a", "new_tokens": 10, "seconds": seconds, "identical": True, "acceptance_lengths": [2] * 5,
                 "accepted_per_position": [5] + [0] * (k - 1), "rounds": 5}]

    block, chosen = fastest_ngram({4: rows(2.0, 4), 8: rows(1.0, 8)}, greedy_tokens_per_s=4.0)
    assert block["draft_tokens"] == 8 and chosen == rows(1.0, 8) and block["speedup"] == pytest.approx(2.5)
    assert [(e["draft_tokens"], e["tokens_per_s"]) for e in block["by_draft_tokens"]] == [(4, 5.0), (8, 10.0)]
    assert fastest_ngram({4: rows(1.0, 4), 8: rows(1.0, 8)}, 4.0)[0]["draft_tokens"] == 4


# --------------------------------------------------------------------------- the sweep


def test_the_sweep_decodes_every_setting_on_the_same_prompts_and_recommends_the_fastest_lossless(tmp_path, model_dir, drafter, capsys):
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS, benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "decoder": "transformers", "sweep": SWEEP},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    sweep = result["sweep"]
    assert json.loads((tmp_path / "bench.json").read_text())["sweep"] == json.loads(json.dumps(sweep))
    assert [s["label"] for s in sweep["settings"]] == ["chain 2", "tree 2-2-4"]
    assert sweep["lossless_checked_in"] == "float32" and result["float32_check"] is None  # timed in float32: the run is the check
    greedy_tokens = {row["id"]: row["new_tokens"] for row in result["per_prompt"]}
    for setting, asked in zip(sweep["settings"], SWEEP):
        assert {k: setting[k] for k in asked} == asked
        rows = setting["per_prompt"]
        assert [r["id"] for r in rows] == ["p-1", "p-2"]  # every prompt, in the drafter's order
        for row in rows:
            assert row["identical"] and row["first_divergence"] is None and row["new_tokens"] == greedy_tokens[row["id"]]
            assert row["rounds"] == len(row["acceptance_lengths"]) and all(1 <= n <= 1 + asked["steps"] for n in row["acceptance_lengths"])
        rounds = sum(r["rounds"] for r in rows)
        assert setting["rounds"] == rounds and setting["new_tokens"] == sum(greedy_tokens.values())
        assert setting["mean_acceptance_length"] == pytest.approx(sum(sum(r["acceptance_lengths"]) for r in rows) / rounds)
        per_depth = setting["acceptance_rate_per_depth"]
        assert len(per_depth) == asked["steps"] and per_depth == [pytest.approx(sum(r["accepted_per_position"][d] for r in rows) / rounds) for d in range(asked["steps"])]
        assert setting["tokens_per_s"] == pytest.approx(setting["new_tokens"] / sum(r["seconds"] for r in rows))
        assert setting["speedup"] == pytest.approx(setting["tokens_per_s"] / result["greedy_tokens_per_s"])
        assert setting["speedup_over_ngram"] == pytest.approx(setting["tokens_per_s"] / result["ngram"]["tokens_per_s"])
        assert setting["lossless"] is True and setting["different"] == []
        flags = f"--speculative-num-steps {asked['steps']} --speculative-eagle-topk {asked['topk']} --speculative-num-draft-tokens {asked['draft_tokens']}"
        assert setting["sglang_flags"] == "--speculative-algorithm EAGLE3 " + flags
    main = sweep["main"]
    assert main["label"] == "chain 3 (bench.draft_tokens)" and (main["steps"], main["topk"], main["draft_tokens"]) == (3, 1, 4)
    assert main["tokens_per_s"] == result["spec_tokens_per_s"] and main["lossless"] is True
    # The recommendation: the fastest of the lossless candidates, the main chain among them.
    candidates = [main, *sweep["settings"]]
    fastest = max(candidates, key=lambda c: c["tokens_per_s"])
    best = sweep["best"]
    assert (best["label"], best["tokens_per_s"], best["main_chain"]) == (fastest["label"], fastest["tokens_per_s"], fastest is main)
    assert sweep["sglang_flags"] == (f"--speculative-algorithm EAGLE3 --speculative-num-steps {best['steps']} "
                                     f"--speculative-eagle-topk {best['topk']} --speculative-num-draft-tokens {best['draft_tokens']}")
    # The main measurement and its gate are what they were without a sweep.
    assert result["draft_tokens"] == 3 and len(result["acceptance_rate_per_position"]) == 3 and result["lossless"] is True
    # The job's log says which decoder the warm-up (minutes of compiling and tuning on a GPU) has reached, each as it ends.
    log = capsys.readouterr().out
    parts = [log.index(f"bench local:   {what}: ") for what in ("greedy", "chain 3", "chain 2", "tree 2-2-4")]
    assert parts == sorted(parts) and parts[-1] < log.index("bench local: warm-up (compile, capture): ")


def test_the_float32_check_decodes_the_sweep_too_and_decides_its_losslessness(tmp_path, model_dir, target, drafter):
    from eyrie.target.model import template_fingerprint

    drafter_dir = save_drafter(drafter, tmp_path / "drafter", template_fingerprint(target[1]))
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 4, "min_acceptance_length": 1.0, "dtype": "bfloat16", "ngram": False,
                   "decoder": "transformers", "sweep": SWEEP[1:]},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    check = result["float32_check"]
    assert check["sweep"] == [{"label": "tree 2-2-4", "checked": 1, "identical": 1, "different": [], "lossless": True}]
    assert check["lossless"] is True and result["lossless"] is True
    setting = result["sweep"]["settings"][0]
    assert result["sweep"]["lossless_checked_in"] == "float32" and setting["lossless"] is True
    assert setting["agreement_in_timing_dtype"]["dtype"] == "bfloat16" and setting["agreement_in_timing_dtype"]["checked"] == 1
    assert setting["speedup_over_ngram"] is None and result["sweep"]["best"] is not None


def test_the_sweep_runs_on_the_static_decoder(tmp_path, model_dir, drafter):
    result = run_benchmark(
        target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[1:], benchmark_name="local",
        bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "ngram": False, "sweep": SWEEP},
        out_path=tmp_path / "bench.json", device="cpu",
    )
    assert result["decoder"] == "static"
    assert [s["lossless"] for s in result["sweep"]["settings"]] == [True, True] and result["sweep"]["best"] is not None


def test_a_sweep_setting_sglang_would_refuse_stops_the_benchmark_before_any_model_loads(tmp_path):
    from eyrie.core.errors import ConfigError

    sweep = [SWEEP[0], {"steps": 2, "topk": 2, "draft_tokens": 8}]  # 2 + 4 nodes drafted, 7 to verify
    with pytest.raises(ConfigError, match=r"bench\.sweep\[1\].*--speculative-num-draft-tokens 8 verifies 7 drafts"):
        run_benchmark(target_dir=tmp_path / "no-model", drafter_dir_or_model=tmp_path / "no-drafter", prompts=PROMPTS, benchmark_name="local",
                      bench_cfg={**CFG, "sweep": sweep}, out_path=tmp_path / "bench.json", device="cpu")
    assert not (tmp_path / "bench.json").exists()


def test_template_or_target_mismatch_is_refused(tmp_path, model_dir, target, drafter):
    from eyrie.target.model import template_fingerprint

    out = tmp_path / "bench.json"
    with pytest.raises(ContractError, match="template_sha256_expected is 000000000000"):
        run_benchmark(
            target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS, benchmark_name="local",
            bench_cfg=CFG, out_path=out, template_sha256_expected="0" * 64, device="cpu",
        )
    drafter_dir = save_drafter(drafter, tmp_path / "drafter", "f" * 64)
    with pytest.raises(ContractError, match="config.json eyrie.template_sha256 is ffffffffffff"):
        run_benchmark(
            target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS, benchmark_name="local",
            bench_cfg=CFG, out_path=out, device="cpu",
        )
    other_target = save_drafter(drafter, tmp_path / "other", template_fingerprint(target[1]), target_fingerprint="0" * 64)
    with pytest.raises(ContractError, match="trained for another target"):
        run_benchmark(
            target_dir=model_dir, drafter_dir_or_model=other_target, prompts=PROMPTS, benchmark_name="local",
            bench_cfg=CFG, out_path=out, device="cpu",
        )
    assert not out.exists()


def test_benchmark_prompts_from_heldout_parquet_and_humaneval(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.string()), ("dataset", pa.string()), ("messages", pa.list_(message))])
    rows = [{"id": f"r{i}", "dataset": "d", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "heldout.parquet")
    heldout = load_benchmark_prompts("d", tmp_path / "heldout.parquet", limit=2)
    assert heldout == [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]

    records = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n"} for i in range(3)]
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    humaneval = load_benchmark_prompts("humaneval", tmp_path / "HumanEval.jsonl.gz", limit=2)
    assert [p["id"] for p in humaneval] == ["HumanEval/0", "HumanEval/1"]
    assert humaneval[1]["messages"][0]["role"] == "user" and records[1]["prompt"] in humaneval[1]["messages"][0]["content"]

    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0"}) + "\n")
    with pytest.raises(BadRecordError, match="line 1"):
        load_benchmark_prompts("humaneval", tmp_path / "bad.jsonl.gz")


def mtbench_file(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_mtbench_prompts_are_first_turns_spread_over_categories(tmp_path):
    # As in question.jsonl: sorted by category, two turns each.
    records = [{"question_id": 81 + i, "category": category, "turns": [f"{category} question {i}", "follow-up"]}
               for i, category in enumerate(["writing"] * 3 + ["roleplay"] * 3 + ["math"] * 2)]
    path = mtbench_file(tmp_path / "question.jsonl", records)
    prompts = load_benchmark_prompts("mtbench", path, limit=4)
    assert [p["id"] for p in prompts] == ["mtbench-81", "mtbench-84", "mtbench-87", "mtbench-82"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "writing question 0"}]  # the first turn only
    assert len(load_benchmark_prompts("mtbench", path)) == 8


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"question_id": 90, "category": "math", "turns": []}, "turns"),
        ({"question_id": 90, "category": "math", "turns": [7, "x"]}, "turns"),
        ({"question_id": 90, "turns": ["q"]}, "category"),
        ({"category": "math", "turns": ["q"]}, "question_id"),
    ],
)
def test_a_bad_mtbench_record_names_the_file_line_and_field(tmp_path, line, field):
    good = {"question_id": 81, "category": "writing", "turns": ["q", "q2"]}
    path = mtbench_file(tmp_path / "question.jsonl", [good, "", line])
    with pytest.raises(BadRecordError, match=f"question.jsonl: line 3.*field '{field}'"):
        load_benchmark_prompts("mtbench", path, limit=1)  # a bad record fails even past the limit: categories need the whole file


def test_an_mtbench_line_that_is_not_json_is_named(tmp_path):
    path = mtbench_file(tmp_path / "question.jsonl", ['{"question_id": 81,'])
    with pytest.raises(BadRecordError, match="question.jsonl: line 1: not JSON"):
        load_benchmark_prompts("mtbench", path)


# --------------------------------------------------------------------------- the parity gate


def write_drafter_config(directory, summary) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eyrie": {"simulated_acceptance": summary}}))


SUMMARY = {
    "k": [1, 2, 3], "length": [1.8, 2.4, 2.9], "per_step_accuracy": [0.8, 0.75, 0.7],
    "conditional_length": [1.8, 2.3, 2.6], "conditional_accuracy": [0.8, 0.6, 0.5],
    "eval_samples": 12, "source": "held-out cache samples",
}


def test_parity_compares_with_the_conditional_chain_and_fails_a_gap_with_the_usual_causes(tmp_path):
    from eyrie.bench.parity import parity

    write_drafter_config(tmp_path / "drafter", SUMMARY)
    close = parity(tmp_path / "drafter", 2.1, 2, 0.15, gated=True)
    assert close["simulated"] == 2.3 and close["gap"] == pytest.approx(1 - 2.1 / 2.3) and close["judged"] and close["error"] is None
    far = parity(tmp_path / "drafter", 1.5, 2, 0.15, gated=True)
    assert far["gap"] == pytest.approx(1 - 1.5 / 2.3)
    assert "35% below the 2.300 training predicted on 12 held-out cache samples" in far["error"] and "d2t" in far["error"]
    assert parity(tmp_path / "drafter", 1.5, 5, 0.15, gated=True)["simulated"] is None  # k beyond the trained steps



def test_the_measurements_interval_over_its_prompts_is_recorded_and_named_when_the_gate_fails(tmp_path):
    """A gap is judged as before; the error then says whether the measurement's own prompt-to-prompt spread could hold the
    prediction, so a user with 16 prompts is not sent hunting for an aux-layer bug that sampling explains."""
    from eyrie.bench.parity import measured_interval, parity

    write_drafter_config(tmp_path / "drafter", SUMMARY)
    rows = [{"acceptance_lengths": [a] * n, "rounds": n} for a, n in ((1, 10), (3, 10), (1, 30), (3, 5))]
    low, high = measured_interval(rows)
    pooled = (10 + 30 + 30 + 15) / 55
    assert low < pooled < high and 1.0 <= low and high <= 3.0
    assert measured_interval(rows) == [low, high]  # a fixed seed: the same record for the same measurement
    assert measured_interval(rows[:1]) is None and measured_interval([]) is None
    wide = parity(tmp_path / "drafter", 1.5, 2, 0.15, gated=True, interval=[1.3, 2.4])
    assert wide["interval"] == [1.3, 2.4] and "1.300-2.400 and holds the prediction" in wide["error"]
    narrow = parity(tmp_path / "drafter", 1.5, 2, 0.15, gated=True, interval=[1.45, 1.55])
    assert "1.450-1.550" in narrow["error"] and "holds the prediction" not in narrow["error"]


def test_parity_prefers_the_first_turn_walk_then_the_walk_over_every_turn(tmp_path):
    """The benchmark serves first user turns: the first-turn walk is its yardstick; drafters trained before it fall back."""
    from eyrie.bench.parity import parity

    walked = {**SUMMARY, "walked_length": [1.7, 2.2, 2.5]}
    write_drafter_config(tmp_path / "walked", walked)
    block = parity(tmp_path / "walked", 1.9, 2, 0.15, gated=True)
    assert (block["form"], block["simulated"]) == ("walked_length", 2.2)
    write_drafter_config(tmp_path / "first", {**walked, "walked_first_turn_length": [1.6, 1.95, 2.1]})
    block = parity(tmp_path / "first", 1.9, 2, 0.15, gated=True)
    assert (block["form"], block["simulated"]) == ("walked_first_turn_length", 1.95) and block["error"] is None
    write_drafter_config(tmp_path / "unmeasured", {**walked, "walked_first_turn_length": [None, None, None]})
    assert parity(tmp_path / "unmeasured", 1.9, 2, 0.15, gated=True)["form"] == "walked_length"

@pytest.mark.parametrize(
    "summary_change, max_gap, gated, reason",
    [
        ({}, 0.15, False, "not from the training datasets"),  # HumanEval, MT-bench
        ({}, None, True, "max_parity_gap is null"),
        ({"source": "training samples"}, 0.15, True, "optimistic"),  # the drafter has seen them
        ({"eval_samples": 2}, 0.15, True, "held out 2 cache samples, fewer than 8"),
    ],
)
def test_parity_records_without_judging_what_it_cannot_trust(tmp_path, summary_change, max_gap, gated, reason):
    from eyrie.bench.parity import parity

    write_drafter_config(tmp_path / "drafter", {**SUMMARY, **summary_change})
    block = parity(tmp_path / "drafter", 1.5, 2, max_gap, gated=gated)
    assert block["gap"] == pytest.approx(1 - 1.5 / 2.3) and not block["judged"] and block["error"] is None
    assert reason in block["not_judged_because"]


def test_parity_needs_a_recorded_prediction(tmp_path):
    from eyrie.bench.parity import parity

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"eyrie": {}}))
    assert parity(tmp_path / "old", 1.2, 3, 0.15, gated=True)["simulated"] is None  # trained before training recorded it
    assert parity(None, 1.2, 3, 0.15, gated=True)["simulated"] is None  # an in-memory drafter


def save_parity_samples(drafter_dir, samples: list[dict]) -> None:
    """parity_samples.json beside a saved drafter, its digest in config.json's eyrie.files, as training writes them."""
    from eyrie.core.atomic import write_json_atomically
    from eyrie.core.digest import file_digest

    write_json_atomically(drafter_dir / "parity_samples.json", {"source": "held-out cache samples", "k": [1, 2, 3], "samples": samples})
    config = json.loads((drafter_dir / "config.json").read_text())
    config["eyrie"]["files"] = {"parity_samples.json": file_digest(drafter_dir / "parity_samples.json")}
    (drafter_dir / "config.json").write_text(json.dumps(config))


def test_the_gate_serves_trainings_own_held_out_prompts_and_judges_like_with_like(tmp_path, model_dir, target, drafter):
    """A drafter with parity samples: their prompts are decoded with the chain for as many tokens as each reply held, and the
    gate sets that beside the walk over exactly those replies (longer than bench.max_new_tokens here: the decoder is sized
    for them); the benchmark's own prompts are recorded beside, not judged.
    A walk far above what serving gives fails the job naming like-with-like; the walk equal to it passes."""
    from eyrie.bench.errors import ParityGapError
    from eyrie.target.chat_template import render
    from eyrie.target.model import template_fingerprint

    _, tokenizer = target
    summary = {**SUMMARY, "walked_first_turn_length": [1.2, 1.3, 1.4], "walked_first_turn_rounds": [40, 40, 40]}
    prompt_ids = tokenizer(render(tokenizer, PROMPTS[0]["messages"], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    walked = [{"id": f"s{i}", "prompt_ids": prompt_ids[: len(prompt_ids) - i], "reply_tokens": 10, "rounds": [5] * 3, "emitted": [10, 12, 14]}
              for i in range(8)]
    cfg = {**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "ngram": False}
    drafter_dir = save_drafter(drafter, tmp_path / "far", template_fingerprint(tokenizer), simulated_acceptance=summary)
    save_parity_samples(drafter_dir, walked)
    out = tmp_path / "far.json"
    with pytest.raises(ParityGapError, match="on the prompts of 8 of its own held-out cache samples, served here"):
        run_benchmark(target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS, benchmark_name="local", bench_cfg=cfg,
                      out_path=out, template_sha256_expected=template_fingerprint(tokenizer), device="cpu")
    failed = json.loads((tmp_path / "far.failed.json").read_text())
    block = failed["parity"]
    served = block["served"]
    assert block["form"] == "served_parity_samples" and block["judged"] and block["eval_samples"] == served["samples"] == 8
    assert block["simulated"] == served["simulated"] == pytest.approx(14 / 5)
    rows = served["per_sample"]
    assert [r["id"] for r in rows] == [f"s{i}" for i in range(8)] and all(1 <= r["emitted"] <= 10 for r in rows)  # each reply's length, beyond bench.max_new_tokens
    assert block["measured"] == pytest.approx(sum(r["emitted"] for r in rows) / sum(r["rounds"] for r in rows))
    own = block["heldout_prompts"]
    assert own["simulated"] == 1.4 and own["form"] == "walked_first_turn_length" and own["measured"] == pytest.approx(failed["mean_acceptance_length"])
    assert "parity (8 held-out cache samples)" in failed["phase_seconds"]  # untimed, after the timed decoding

    # The same replies walked as serving decoded them: no gap, judged, passed.
    equal = [{**sample, "rounds": [r["rounds"]] * 3, "emitted": [r["emitted"]] * 3} for sample, r in zip(walked, rows)]
    drafter_dir = save_drafter(drafter, tmp_path / "equal", template_fingerprint(tokenizer), simulated_acceptance=summary)
    save_parity_samples(drafter_dir, equal)
    result = run_benchmark(target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS, benchmark_name="local", bench_cfg=cfg,
                           out_path=tmp_path / "equal.json", template_sha256_expected=template_fingerprint(tokenizer), device="cpu")
    assert result["parity"]["judged"] and result["parity"]["gap"] == pytest.approx(0) and result["error"] is None
    # HumanEval and MT-bench are not the training datasets: nothing is served for the gate there.
    assert parity_prompts_for(drafter_dir, gated=False) == [] and len(parity_prompts_for(drafter_dir, gated=True)) == 8


def test_a_benchmarks_own_prompts_are_set_beside_the_walk_of_their_own_dataset(tmp_path, target, drafter):
    """Trained on several datasets, training walked each one's held-out samples alone: a held-out benchmark's own
    prompts are recorded beside their dataset's walk, not the mixture's; the judged like-with-like figure is unchanged."""
    from eyrie.bench.parity import parity
    from eyrie.drafter.checkpoint import CheckpointError, read_simulated_acceptance
    from eyrie.target.model import template_fingerprint

    _, tokenizer = target
    first = {"walked_first_turn_length": [1.2, 1.3, 1.4], "walked_first_turn_rounds": [40, 40, 40]}
    by_dataset = {"sharegpt": {**SUMMARY, **first, "walked_first_turn_length": [1.1, 1.2, 1.25], "eval_samples": 9},
                  "magpie": {**SUMMARY, **first, "walked_first_turn_length": [1.5, 1.7, 1.85], "eval_samples": 3}}
    drafter_dir = save_drafter(drafter, tmp_path / "mixed", template_fingerprint(tokenizer),
                               simulated_acceptance={**SUMMARY, **first, "by_dataset": by_dataset})
    served = {"measured": 1.3, "simulated": 1.35, "interval": [1.2, 1.4], "samples": 8}
    own = parity(drafter_dir, 1.0, 3, 0.15, gated=True, served=served, dataset="sharegpt")
    assert own["heldout_prompts"]["simulated"] == 1.25 and own["heldout_prompts"]["dataset"] == "sharegpt"
    assert own["heldout_prompts"]["eval_samples"] == 9 and own["heldout_prompts"]["gap"] == pytest.approx(1 - 1.0 / 1.25)
    assert own["simulated"] == 1.35 and own["judged"] and own["gap"] == pytest.approx(1 - 1.3 / 1.35)  # the judged figure: served samples
    whole = parity(drafter_dir, 1.0, 3, 0.15, gated=True, served=served, dataset="elsewhere")  # no walk of its own: the mixture's
    assert whole["heldout_prompts"]["simulated"] == 1.4 and whole["heldout_prompts"]["dataset"] is None

    broken = save_drafter(drafter, tmp_path / "broken", template_fingerprint(tokenizer),
                          simulated_acceptance={**SUMMARY, "by_dataset": {"magpie": {**SUMMARY, "k": [1, 3, 2]}}})
    with pytest.raises(CheckpointError, match=r"by_dataset\.magpie.*k is \[1, 3, 2\]"):
        read_simulated_acceptance(broken)


def test_training_prediction_is_set_beside_each_swept_setting_it_walked(tmp_path, model_dir, target, drafter):
    """A chain training walked gets its walk over first replies, a one-step tree (1, N, N) its one-step trees' walk; a
    deeper tree gets nothing (training does not walk it). Recorded with the gap, never judged."""
    from eyrie.bench.parity import predict_settings
    from eyrie.target.model import template_fingerprint

    _, tokenizer = target
    summary = {**SUMMARY, "walked_first_turn_length": [1.2, 1.3, 1.4], "walked_first_turn_rounds": [40, 40, 40],
               "one_step_trees": {"draft_tokens": [4, 10], "walked_first_turn_length": [1.35, 1.5]}}
    drafter_dir = save_drafter(drafter, tmp_path / "walked", template_fingerprint(tokenizer), simulated_acceptance=summary)
    sweep = [{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 1, "topk": 4, "draft_tokens": 4}, {"steps": 2, "topk": 2, "draft_tokens": 4}]
    result = run_benchmark(target_dir=model_dir, drafter_dir_or_model=drafter_dir, prompts=PROMPTS, benchmark_name="local",
                           bench_cfg={**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "decoder": "transformers", "sweep": sweep,
                                      "max_parity_gap": None},  # a random drafter: its gap is not the subject here
                           out_path=tmp_path / "bench.json", template_sha256_expected=template_fingerprint(tokenizer), device="cpu")
    chain, one_step, deeper = result["sweep"]["settings"]
    assert chain["predicted"]["length"] == 1.3 and chain["predicted"]["form"] == "walked_first_turn_length"
    assert one_step["predicted"]["length"] == 1.35 and one_step["predicted"]["form"] == "one_step_trees"
    assert one_step["predicted"]["gap"] == pytest.approx(1 - one_step["mean_acceptance_length"] / 1.35)
    assert one_step["predicted"]["eval_samples"] == 12 and "predicted" not in deeper
    assert result["sweep"]["main"]["predicted"]["length"] == 1.4  # the main chain of 3
    # Without a drafter directory (an in-memory drafter) nothing is predicted.
    bare = json.loads(json.dumps(result["sweep"]["settings"]))
    for setting in bare:
        setting.pop("predicted", None)
    predict_settings(bare, None)
    assert all("predicted" not in s for s in bare)


@pytest.mark.parametrize("trees, message", [
    ({"draft_tokens": [1], "walked_first_turn_length": [1.2]}, r"expected \{draft_tokens: \[N >= 2"),
    ({"draft_tokens": [10, 32], "walked_first_turn_length": [1.2]}, "one length in \\[1, 2\\]"),
    ({"draft_tokens": [10], "walked_first_turn_length": [2.5]}, "one length in \\[1, 2\\]"),
])
def test_a_malformed_one_step_tree_walk_is_named(tmp_path, trees, message):
    from eyrie.drafter.checkpoint import CheckpointError, read_simulated_acceptance

    write_drafter_config(tmp_path / "drafter", {**SUMMARY, "one_step_trees": trees})
    with pytest.raises(CheckpointError, match=message):
        read_simulated_acceptance(tmp_path / "drafter")


def parity_prompts_for(drafter_dir, gated: bool) -> list:
    from eyrie.bench.parity import parity_prompts

    return parity_prompts(drafter_dir, 3, 0.15, gated)


def test_the_floors_cache_is_sized_in_powers_of_two_so_benchmarks_share_its_compiled_step():
    """MT-bench's and HumanEval's first prompts (53 and 167 tokens, 256 new) needed 320 and 448 slots and compiled
    twice; bucketed, both get 512. A bucket always holds what was needed, and never more than twice it (or 256)."""
    from eyrie.bench.floor import floor_capacity

    assert floor_capacity(53 + 256 + 2) == floor_capacity(167 + 256 + 2) == 512
    assert [floor_capacity(n) for n in (1, 256, 257, 512, 513, 1790)] == [256, 256, 512, 512, 1024, 2048]
    for needed in range(1, 5000, 7):
        capacity = floor_capacity(needed)
        assert needed <= capacity <= max(256, 2 * needed) and capacity & (capacity - 1) == 0


def test_floor_block_times_greedy_beside_the_minimal_step(tmp_path, model_dir, drafter):
    """bench.floor: true on the CPU: both decoders ran on the same prompt, the ratio is theirs; auto leaves it out on the CPU."""
    cfg = {**CFG, "max_new_tokens": 6, "min_acceptance_length": 1.0, "ngram": False, "sweep": []}
    result = run_benchmark(target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[:1], benchmark_name="local",
                           bench_cfg={**cfg, "floor": True}, out_path=tmp_path / "bench.json", device="cpu")
    floor = result["floor"]
    assert floor["error"] is None and floor["prompt"] == PROMPTS[0]["id"] and floor["new_tokens"] == 6
    assert floor["floor_ms_per_token"] > 0 and floor["greedy_ms_per_token"] > 0
    assert abs(floor["ratio"] - floor["greedy_ms_per_token"] / floor["floor_ms_per_token"]) < 1e-9
    assert floor["capacity"] == 256 >= floor["prompt_tokens"] + 8  # the smallest bucket holds prompt, reply and two spare slots
    assert floor["floor_mode"] is None and floor["engine_mode"] is None  # nothing fused: bench.compile is off on the CPU
    auto = run_benchmark(target_dir=model_dir, drafter_dir_or_model=drafter, prompts=PROMPTS[:1], benchmark_name="local",
                         bench_cfg=cfg, out_path=tmp_path / "auto.json", device="cpu")
    assert auto["floor"] is None
