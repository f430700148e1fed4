"""The benchmark's concurrency block: its rows per B, the recommendation per load (or no speculation) and the serving
flags, vLLM's batch-aware schedule checked by vLLM's own code."""

from __future__ import annotations

import json
import shlex

import pytest
from factories import random_drafter, sglang_argv, tree_target
from target.engine_sources import class_fields, function_from, sglang_file, vllm_file  # noqa: F401

from eyrie.bench.concurrency import (ADAPTIVE_CONFIG_FILE, NO_SPECULATION, OFF_REASON, concurrency_block, recommend, sglang_adaptive_config,
                                    sglang_adaptive_flags, vllm_flags, vllm_schedule)
from eyrie.decoding.batched_greedy import open_batched_greedy
from eyrie.decoding.tree import TreeShape


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


def test_the_block_measures_each_batch_and_recommends(tmp_path):
    import torch

    model = tree_target(vocab_size=5, seed=3)
    drafter = random_drafter(model, scale=0.3)
    g = torch.Generator().manual_seed(0)
    encoded = [(f"p{i}", torch.randint(0, 5, (n,), generator=g).tolist()) for i, n in enumerate([4, 9, 6])]
    cfg = {"concurrency": [4, 1], "draft_tokens": 3, "max_new_tokens": 12, "ngram": True}
    opened = []

    def open_engine(model, rows):
        opened.append(rows)
        return open_batched_greedy(model, 0, set(), rows=rows, cuda_graphs=False, row_step=1)

    block = concurrency_block(model, open_engine, drafter, encoded, cfg, set(), sweep=[TreeShape(2, 1, 3), TreeShape(2, 2, 4)])
    assert block["batches"] == [1, 4] and block["off_reason"] is None
    assert opened == [1, 4]  # an engine per load, of exactly B rows (no dummy rows computed beside B requests)
    assert [entry["engine_rows"] for entry in block["per_batch"]] == [1, 4]
    assert block["settings"] == ["chain 3", "chain 2", "tree 2-2-4", "n-gram 3"]  # the sweep's chain and tree batched too
    for entry, batch, waves in zip(block["per_batch"], [1, 4], [3, 1]):
        # every load decodes every prompt: B = 1 in three waves, B = 4 in one (the first prompt twice)
        assert entry["batch"] == batch and entry["waves"] == waves and entry["distinct_prompts"] == 3
        assert entry["greedy"]["new_tokens"] == 12 * batch * waves
        for row in entry["settings"]:
            assert row["rows"] == batch * waves and row["new_tokens"] == 12 * batch * waves
            assert row["lossless"] and row["identical_rows"] == batch * waves  # float32: each row is its greedy
            assert row["speedup"] == pytest.approx(row["tokens_per_s"] / entry["greedy"]["tokens_per_s"])
            assert row["per_request_tokens_per_s"] == pytest.approx(row["tokens_per_s"] / batch)
            assert 1.0 <= row["mean_acceptance_length"] <= row["steps"] + 1
        best = recommend(entry["settings"])
        assert entry["recommendation"] == (NO_SPECULATION if best is None else best["label"])
        assert (entry["sglang_flags"] == "") == (best is None)
        chain = recommend([r for r in entry["settings"] if r["kind"] == "chain"])
        assert (entry["chain"] or {}).get("label") == (chain or {}).get("label")  # the schedules' chain at this load
    json.dumps(block)  # the JSON holds it as is


def test_a_setting_the_float32_check_rejects_is_not_lossless_and_the_log_says_so(monkeypatch, capsys):
    """Timed in bf16, the float32 pass decides: a setting with one row unlike greedy's is not lossless, never recommended,
    and the job's progress line names it."""
    import torch

    import eyrie.bench.concurrency as concurrency

    model = tree_target(vocab_size=5, seed=3)
    drafter = random_drafter(model, scale=0.3)
    encoded = [("p0", [1, 2, 3]), ("p1", [4, 0, 2, 1])]
    cfg = {"concurrency": [2], "draft_tokens": 2, "max_new_tokens": 6, "ngram": False}
    monkeypatch.setattr(concurrency, "float32_identical", lambda model, drafter, settings, waves, *rest: [1] + [2] * (len(settings) - 1))
    block = concurrency_block(model.to(torch.bfloat16), lambda m, rows: open_batched_greedy(m, 0, set(), rows=rows, cuda_graphs=False, row_step=1),
                              drafter.to(torch.bfloat16), encoded, cfg, set())
    entry = block["per_batch"][0]
    chain = entry["settings"][0]
    assert chain["label"] == "chain 2" and not chain["lossless"] and chain["float32_identical_rows"] == 1 and chain["rows"] == 2
    assert entry["recommendation"] == NO_SPECULATION  # the only setting is not lossless
    assert "chain 2" in capsys.readouterr().out.split("NOT lossless: 1/2 rows")[0]


def test_every_load_decodes_every_prompt_in_waves():
    from eyrie.bench.concurrency import prompt_waves

    encoded = [(f"p{i}", [i]) for i in range(5)]
    assert prompt_waves(encoded, 1) == [[[i]] for i in range(5)]
    assert prompt_waves(encoded, 2) == [[[0], [1]], [[2], [3]], [[4], [0]]]  # the last wave filled from the first prompts
    assert prompt_waves(encoded, 8) == [[[0], [1], [2], [3], [4], [0], [1], [2]]]  # a load larger than P repeats them


def test_off_by_default_with_the_reason():
    block = concurrency_block(None, None, None, [], {"concurrency": [], "draft_tokens": 4, "max_new_tokens": 8}, set())
    assert block["per_batch"] == [] and block["off_reason"] == OFF_REASON


def row(label, kind, k, tokens_per_s, speedup, lossless=True):
    return {"label": label, "kind": kind, "draft_tokens": k, "tokens_per_s": tokens_per_s, "speedup": speedup, "lossless": lossless}


def test_the_recommendation_rule():
    assert recommend([row("chain 4", "chain", 4, 90.0, 0.9), row("n-gram 4", "ngram", 4, 95.0, 0.95)]) is None  # nothing beats greedy
    lossy = row("chain 4", "chain", 4, 300.0, 3.0, lossless=False)
    assert recommend([lossy, row("chain 2", "chain", 2, 150.0, 1.5)])["label"] == "chain 2"  # never a lossy setting
    assert recommend([row("chain 2", "chain", 2, 150.0, 1.5), row("n-gram 4", "ngram", 4, 160.0, 1.6)])["label"] == "n-gram 4"


def test_vllm_schedule_is_read_by_vllms_own_code():
    per_batch = [{"batch": 1, "chain": {"kind": "chain", "draft_tokens": 4}}, {"batch": 4, "chain": {"kind": "chain", "draft_tokens": 2}},
                 {"batch": 16, "chain": None}, {"batch": 64, "chain": None}]
    schedule = vllm_schedule(per_batch)
    assert schedule == [[1, 3, 4], [4, 15, 2], [16, 63, 0], [64, 64, 0]]
    source = vllm_file("v1/spec_decode/dynamic/utils.py")
    validate = function_from(source, "validate_and_normalize_dynamic_sd_schedule", DynamicSDSchedule=list)
    lookup = function_from(source, "build_dynamic_sd_schedule_lookup", validate_and_normalize_dynamic_sd_schedule=validate)
    dense = lookup(schedule, 128, 4)
    assert [dense[b] for b in (1, 3, 4, 15, 16, 64, 128)] == [4, 4, 2, 2, 0, 0, 0]  # vLLM carries the last k past 64
    flags = shlex.split(vllm_flags(schedule, "/drafters/d"))
    config = json.loads(flags[flags.index("--speculative-config") + 1])
    assert set(config) <= set(class_fields(vllm_file("config/speculative.py"), "SpeculativeConfig"))
    assert config["num_speculative_tokens"] == 4
    assert vllm_schedule([{"batch": 1, "chain": None}]) is None  # no chain anywhere: serve without speculation


def test_sglang_adaptive_tiers_are_read_by_sglangs_own_code(tmp_path, sglang_parser):
    import types

    from sglang.srt.arg_groups.speculative_hook import _init_adaptive_speculative_params
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams, _load_adaptive_config, adaptive_unsupported_reason

    from eyrie.target.serving import launch_command

    parser, _ = sglang_parser
    per_batch = [{"batch": 2, "chain": {"kind": "chain", "draft_tokens": 4}}, {"batch": 8, "chain": {"kind": "chain", "draft_tokens": 2}},
                 {"batch": 32, "chain": None}, {"batch": 64, "chain": None}]
    adaptive = sglang_adaptive_config(per_batch)
    assert adaptive == {"1": {"candidate_steps": [4]}, "8": {"candidate_steps": [2]}, "32": {"candidate_steps": [0]}, "64": {"candidate_steps": [0]}}
    path = tmp_path / ADAPTIVE_CONFIG_FILE
    path.write_text(json.dumps(adaptive))
    _, tiers = _load_adaptive_config(str(path))
    assert sorted(tiers) == [1, 8, 32, 64]
    flags = shlex.split(sglang_adaptive_flags(adaptive, str(path)))
    command = launch_command("/models/target", 30000, extra_args=["--speculative-draft-model-path", "/drafters/d", *flags])
    args = parser.parse_args(sglang_argv(command))
    assert args.speculative_adaptive and args.speculative_adaptive_config == str(path) and args.speculative_algorithm == "EAGLE3"
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (4, 1)
    resolved = types.SimpleNamespace(**vars(args))  # SGLang's own checks and resolution, on the parsed command
    assert adaptive_unsupported_reason(resolved) is None
    _init_adaptive_speculative_params(resolved)  # raises when --speculative-num-steps is in no tier
    assert resolved._resolved_overrides[-1][1] == {"speculative_num_draft_tokens": 5}
    router = AdaptiveSpeculativeParams(args.speculative_num_steps, str(path))
    steps = {b: router.get_steps_for_batch(b) for b in (1, 2, 7, 8, 31, 32, 64, 200)}
    assert steps == {1: 4, 2: 4, 7: 4, 8: 2, 31: 2, 32: 0, 64: 0, 200: 0}  # each load served what was measured there
    for _ in range(40):  # a single candidate per tier: SGLang's acceptance tracking keeps it whatever it observes
        router.on_verify_complete([0] * 8, 8)
        router.on_verify_complete([4], 1)
    assert (router.get_steps_for_batch(8), router.get_steps_for_batch(1)) == (2, 4)
    assert sglang_adaptive_config([{"batch": 1, "chain": None}]) is None  # no chain anywhere
    assert sglang_adaptive_flags(None) is None
