"""The sweep's pure parts: settings checked as SGLang would check them, the recommendation, and the block's figures."""

from __future__ import annotations

import pytest

from eyrie.bench.sweep import check_sweep, label, recommend, sglang_flags, sweep_block
from eyrie.core.errors import ConfigError


def candidate(name: str, tokens_per_s: float | None, lossless: bool | None) -> dict:
    return {"label": name, "steps": 3, "topk": 1, "draft_tokens": 4, "tokens_per_s": tokens_per_s, "lossless": lossless}


def test_the_recommendation_is_the_fastest_lossless_candidate():
    candidates = [
        candidate("chain 4 (bench.draft_tokens)", 120.0, True),
        candidate("tree 6-8-32", 300.0, False),  # fastest, but changed the output: never recommended
        candidate("tree 5-4-8", 150.0, True),
        candidate("chain 7", 149.9, True),
        candidate("unmeasured", None, True),
    ]
    assert recommend(candidates)["label"] == "tree 5-4-8"
    assert recommend([candidate("a", 100.0, True), candidate("b", 100.0, True)])["label"] == "a"  # a tie goes to the first
    assert recommend([candidate("a", 100.0, False), candidate("b", 90.0, None)]) is None  # nothing lossless: no recommendation
    assert recommend([]) is None


def test_labels_and_flags_follow_sglangs_three_flags():
    assert label({"steps": 3, "topk": 1, "draft_tokens": 4}) == "chain 3"
    assert label({"steps": 5, "topk": 4, "draft_tokens": 8}) == "tree 5-4-8"
    assert label({"steps": 5, "topk": 1, "draft_tokens": 3}) == "tree 5-1-3"  # a chain verified only in part is not the chain
    assert sglang_flags({"steps": 5, "topk": 4, "draft_tokens": 8}) == (
        "--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
    )


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ([{"steps": 3, "topk": 1, "draft_tokens": 4}, {"steps": 2, "topk": 2, "draft_tokens": 8}],
         r"bench\.sweep\[1\] .*--speculative-num-draft-tokens 8 verifies 7 drafts, but --speculative-num-steps 2 with --speculative-eagle-topk 2 drafts only 6 nodes"),
        ([{"steps": 0, "topk": 1, "draft_tokens": 2}], r"bench\.sweep\[0\] .*--speculative-num-steps must be >= 1"),
        ([{"steps": 2, "topk": 0, "draft_tokens": 2}], r"bench\.sweep\[0\] .*--speculative-eagle-topk must be >= 1"),
        ([{"steps": 2, "topk": 1, "draft_tokens": 1}], r"bench\.sweep\[0\] .*--speculative-num-draft-tokens must be >= 2"),
        ([{"steps": 2.5, "topk": 1, "draft_tokens": 3}], r"bench\.sweep\[0\] .*--speculative-num-steps must be an integer"),
        ([{"steps": True, "topk": 1, "draft_tokens": 3}], r"bench\.sweep\[0\] .*must be an integer"),
        ([{"steps": 2, "topk": 1}], r"bench\.sweep\[0\]: expected \{steps: S, topk: K, draft_tokens: N\}"),
        ([{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": 1, "draft_tokens": 3}], r"bench\.sweep\[1\] .*repeats bench\.sweep\[0\]"),
    ],
)
def test_a_setting_sglang_would_refuse_is_named_by_its_place_in_bench_sweep(sweep, message):
    with pytest.raises(ConfigError, match=message):
        check_sweep(sweep)


def test_check_sweep_accepts_the_largest_tree_and_checks_topk_against_the_draft_vocabulary():
    shapes = check_sweep([{"steps": 8, "topk": 10, "draft_tokens": 64}, {"steps": 2, "topk": 2, "draft_tokens": 7}])  # 7 = 1 + 2 + 4
    assert [(s.steps, s.topk, s.draft_tokens) for s in shapes] == [(8, 10, 64), (2, 2, 7)]
    assert check_sweep([]) == [] and check_sweep(None) == []
    with pytest.raises(ConfigError, match=r"bench\.sweep\[0\] .*topk 10 exceeds the drafter's draft vocabulary \(8 tokens\)"):
        check_sweep([{"steps": 8, "topk": 10, "draft_tokens": 64}], draft_vocab_size=8)


def row(prompt_id: str, new_tokens: int, seconds: float, lengths: list[int], per_depth: list[int], identical: bool = True) -> dict:
    return {"id": prompt_id, "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": new_tokens / seconds, "acceptance_lengths": lengths,
            "accepted_per_position": per_depth, "rounds": len(lengths), "identical": identical, "first_divergence": None if identical else 3}


def test_the_block_weighs_by_tokens_and_recommends_among_lossless_settings_and_the_main_chain():
    shapes = check_sweep([{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": 2, "draft_tokens": 4}])
    rows = [
        [row("a", 6, 1.0, [3, 3], [2, 2]), row("b", 4, 3.0, [2, 1, 1], [1, 0])],  # chain 2: 10 tokens in 4 s
        [row("a", 6, 0.5, [3, 3], [2, 2]), row("b", 4, 0.5, [3, 1], [1, 1], identical=False)],  # faster, but not lossless
    ]
    summary = {"greedy_tokens_per_s": 2.0, "spec_tokens_per_s": 2.0, "speedup": 1.0, "mean_acceptance_length": 1.5, "lossless": True}
    block = sweep_block(shapes, rows, summary, 3, ngram={"tokens_per_s": 5.0}, speedup_over_ngram=0.4, timing_dtype="float32")
    chain, tree = block["settings"]
    assert chain["tokens_per_s"] == pytest.approx(10 / 4) and chain["speedup"] == pytest.approx(2.5 / 2.0)
    assert chain["speedup_over_ngram"] == pytest.approx(2.5 / 5.0)
    assert chain["mean_acceptance_length"] == pytest.approx(10 / 5) and chain["acceptance_rate_per_depth"] == [pytest.approx(3 / 5), pytest.approx(2 / 5)]
    assert tree["lossless"] is False and tree["different"] == [{"id": "b", "at": 3}]
    assert block["best"]["label"] == "chain 2" and block["best"]["main_chain"] is False
    assert block["sglang_flags"].endswith("--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3")
    assert block["main"]["label"] == "chain 3 (bench.draft_tokens)" and block["lossless_checked_in"] == "float32"
    # In bf16 the float32 check decides: here it clears the tree, which then wins.
    check = {"sweep": [{"lossless": True, "different": []}, {"lossless": True, "different": []}]}
    checked = sweep_block(shapes, rows, summary, 3, check=check, timing_dtype="bfloat16")
    assert checked["best"]["label"] == "tree 2-2-4" and checked["lossless_checked_in"] == "float32"
    assert checked["settings"][1]["agreement_in_timing_dtype"] == {"dtype": "bfloat16", "identical": 1, "checked": 2}
    assert checked["settings"][1]["speedup_over_ngram"] is None
    # The main chain wins when it is the fastest lossless candidate; an empty sweep writes no block.
    fast_main = sweep_block(shapes, rows, {**summary, "spec_tokens_per_s": 9.0}, 3, timing_dtype="float32")
    assert fast_main["best"]["main_chain"] is True and fast_main["sglang_flags"].endswith("--speculative-num-draft-tokens 4")
    assert sweep_block([], [], summary, 3) is None


def test_a_sweep_over_fewer_prompts_compares_greedy_and_the_chain_on_those_prompts():
    """bench.sweep_prompts: speedups and the main chain candidate come from the swept prompts only."""
    from eyrie.bench.sweep import sweep_block
    from eyrie.decoding.tree import TreeShape

    def row(pid, greedy_s, spec_s):
        return {"id": pid, "new_tokens": 10, "spec_new_tokens": 10, "greedy_seconds": greedy_s, "spec_seconds": spec_s, "identical": True,
                "acceptance_lengths": [2] * 5, "accepted_per_position": [5, 0], "rounds": 5}

    main_rows = [row("a", 1.0, 0.5), row("b", 10.0, 20.0)]  # the chain is 2x on a, 0.5x on b
    setting = [{"id": "a", "new_tokens": 10, "tokens_per_s": 10 / 0.25, "seconds": 0.25, "identical": True,
                "acceptance_lengths": [3] * 3 + [1], "accepted_per_position": [3, 3], "rounds": 4, "first_divergence": None}]
    summary = {"greedy_tokens_per_s": 20 / 11, "spec_tokens_per_s": 20 / 20.5, "speedup": 11 / 20.5, "lossless": True,
               "mean_acceptance_length": 2.0}
    block = sweep_block([TreeShape(2, 2, 4)], [setting], summary, 2, main_rows=main_rows)
    assert block["prompts"] == 1
    assert block["settings"][0]["speedup"] == 40 / 10  # against greedy on prompt a (10 tok/s), not over both prompts
    assert block["main"]["tokens_per_s"] == 20 and block["main"]["speedup"] == 2.0
    assert block["best"]["label"] == "tree 2-2-4"


def test_each_speedup_has_its_interval_over_prompts_and_the_best_names_who_it_does_not_beat():
    """Paired over the same prompts: a setting faster than greedy on every prompt has an interval above 1; one that
    trades places with the best from prompt to prompt is within noise of it, one slower on every prompt is not."""
    from eyrie.bench.sweep import paired_interval, sweep_block
    from eyrie.decoding.tree import TreeShape

    ids = [f"p{i}" for i in range(8)]
    greedy = [1.0, 2.0, 1.5, 3.0, 1.0, 2.5, 2.0, 1.2]  # seconds per prompt for 10 tokens: prompts differ a lot

    def main_row(pid, greedy_s, spec_s):
        return {"id": pid, "new_tokens": 10, "spec_new_tokens": 10, "greedy_seconds": greedy_s, "spec_seconds": spec_s, "identical": True,
                "acceptance_lengths": [2] * 5, "accepted_per_position": [5, 0, 0, 0], "rounds": 5}

    def setting_rows(factors, steps):
        return [{"id": pid, "new_tokens": 10, "seconds": g * f, "tokens_per_s": 10 / (g * f), "identical": True, "acceptance_lengths": [2] * 5,
                 "accepted_per_position": [5] + [0] * (steps - 1), "rounds": 5, "first_divergence": None} for pid, g, f in zip(ids, greedy, factors)]

    main_rows = [main_row(pid, g, g * 0.5) for pid, g in zip(ids, greedy)]  # the main chain: 2x on every prompt
    rival = setting_rows([0.45, 0.55] * 4, 3)  # about as fast as the main chain: faster on half the prompts, slower on the rest
    slow = setting_rows([0.8] * 8, 5)  # 1.25x greedy on every prompt
    summary = {"greedy_tokens_per_s": 80 / sum(greedy), "spec_tokens_per_s": 160 / sum(greedy), "speedup": 2.0, "lossless": True,
               "mean_acceptance_length": 2.0}
    ngram_rows = [{"id": pid, "new_tokens": 10, "seconds": g * 0.625} for pid, g in zip(ids, greedy)]  # 1.6x greedy on every prompt
    block = sweep_block([TreeShape(3, 1, 4), TreeShape(5, 4, 8)], [rival, slow], summary, 4, main_rows=main_rows, ngram_rows=ngram_rows,
                        ngram={"tokens_per_s": 80 / (0.625 * sum(greedy))})
    rival_figures, slow_figures = block["settings"]
    assert block["main"]["speedup_over_ngram_interval"] == [pytest.approx(1.25), pytest.approx(1.25)]  # 2x against 1.6x, every prompt
    assert slow_figures["speedup_over_ngram_interval"] == [pytest.approx(0.78125), pytest.approx(0.78125)]
    low, high = rival_figures["speedup_over_ngram_interval"]
    assert low < rival_figures["speedup_over_ngram"] < high and high - low > 0.05  # trades places prompt by prompt: a real width
    assert block["main"]["speedup_interval"] == [pytest.approx(2.0), pytest.approx(2.0)]  # the same 2x on every prompt
    low, high = slow_figures["speedup_interval"]
    assert low == pytest.approx(1.25) and high == pytest.approx(1.25)
    low, high = rival_figures["speedup_interval"]
    assert low < rival_figures["speedup"] < high and 1.7 < low and high < 2.3
    best = block["best"]
    assert best["speedup_interval"] is not None and best["label"] in ("chain 3", "chain 4 (bench.draft_tokens)")
    assert best["speedup_over_ngram_interval"] is not None
    other = "chain 4 (bench.draft_tokens)" if best["label"] == "chain 3" else "chain 3"
    assert best["within_noise"] == [other]  # the rival and the main chain cannot be told apart; the slow tree can
    assert paired_interval({"a": (1, 1.0)}, {"a": (1, 1.0)}) is None  # one prompt: no interval
    assert sweep_block([TreeShape(3, 1, 4)], [rival], summary, 4)["best"]["within_noise"] is None  # without per-prompt greedy
