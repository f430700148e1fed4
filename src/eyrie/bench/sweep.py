"""The benchmark's sweep: the same prompts drafted as chains and SGLang-style trees, and the fastest lossless setting.

A setting is SGLang's (--speculative-num-steps S, --speculative-eagle-topk K, --speculative-num-draft-tokens N),
checked by eyrie.decoding.tree.TreeShape; K = 1 and N = S + 1 is a chain of S drafts. The benchmark decodes each
prompt with every setting on its engine right after that prompt's plain greedy decode (eyrie.bench.benchmark.measure),
so drift over the run hits every setting alike. The JSON's `sweep` block holds, per setting, the acceptance (per
depth), tokens/s, speedups and losslessness; `best` is the lossless candidate with the highest tokens/s, the
benchmark's main chain (bench.draft_tokens) among the candidates, and `sglang_flags` serves it.
"""

from __future__ import annotations

import random
import shlex

from eyrie.bench.rounds import acceptance_summary, timed_row
from eyrie.core.errors import ConfigError
from eyrie.target.serving import eagle3_flags

SETTING_KEYS = ("steps", "topk", "draft_tokens")
# What a recommendation carries, whether it is a sweep setting or the main chain.
CANDIDATE_KEYS = ("label", *SETTING_KEYS, "mean_acceptance_length", "tokens_per_s", "speedup", "speedup_over_ngram", "lossless")


def check_sweep(settings: list | None, draft_vocab_size: int | None = None) -> list:
    """bench.sweep as TreeShapes, after refusing any setting SGLang would refuse; the error names bench.sweep[i]."""
    from eyrie.decoding.tree import TreeShape

    shapes = []
    for i, setting in enumerate(settings or []):
        where = f"bench.sweep[{i}]"
        if not isinstance(setting, dict) or set(setting) != set(SETTING_KEYS):
            raise ConfigError(f"{where}: expected {{steps: S, topk: K, draft_tokens: N}} (SGLang's three EAGLE flags), got {setting!r}")
        try:
            shape = TreeShape(*(setting[key] for key in SETTING_KEYS))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where} {setting}: {err}") from None
        if shape in shapes:
            raise ConfigError(f"{where} {setting}: repeats bench.sweep[{shapes.index(shape)}]; list each setting once")
        if draft_vocab_size is not None and shape.topk > draft_vocab_size:
            raise ConfigError(f"{where} {setting}: topk {shape.topk} exceeds the drafter's draft vocabulary ({draft_vocab_size} tokens)")
        shapes.append(shape)
    return shapes


def widest_draft(draft_tokens: int, settings: list | None) -> int:
    """The most cache slots past the current token any decode may use: the chain's k, a tree's N verified or S*K drafted nodes."""
    return max([draft_tokens, *(max(s["draft_tokens"], s["steps"] * s["topk"]) for s in settings or [])])


def label(setting) -> str:
    """'chain S' for K = 1 and N = S + 1, else 'tree S-K-N' (SGLang's flags in their order)."""
    steps, topk, draft_tokens = _flags(setting)
    return f"chain {steps}" if topk == 1 and draft_tokens == steps + 1 else f"tree {steps}-{topk}-{draft_tokens}"


def sglang_flags(setting) -> str:
    """The flags that make SGLang draft this way (the drafter's path aside)."""
    return shlex.join(eagle3_flags(*_flags(setting)))


def _flags(setting) -> tuple[int, int, int]:
    """(S, K, N) of a TreeShape or of a dict with those keys."""
    if isinstance(setting, dict):
        return tuple(setting[key] for key in SETTING_KEYS)
    return setting.steps, setting.topk, setting.draft_tokens


# --------------------------------------------------------------------------- decoding


def warm_up(engine, drafter, prompt_ids: list[int], tokens: int, stop_ids, shapes: list) -> None:
    """Each setting once, untimed, so its first timed prompt pays no one-time costs (allocations, graph capture)."""
    from eyrie.decoding.decode import tree_decode

    for shape in shapes:
        tree_decode(engine, drafter, prompt_ids, tokens, stop_ids, shape.steps, shape.topk, shape.draft_tokens)


def decode_settings(engine, drafter, prompt_id: str, prompt_ids: list[int], plain, max_new_tokens: int, stop_ids, shapes: list) -> list[dict]:
    """One prompt decoded with every setting, in order: a timed_row each, against its plain greedy decode `plain`."""
    from eyrie.decoding.decode import tree_decode

    return [
        timed_row(prompt_id, plain, tree_decode(engine, drafter, prompt_ids, max_new_tokens, stop_ids, shape.steps, shape.topk, shape.draft_tokens))
        for shape in shapes
    ]


def verdicts(shapes: list, rows_per_setting: list[list[dict]]) -> list[dict]:
    """Per setting, whether every prompt's output equals greedy's: the float32 check's verdict on the sweep."""
    found = []
    for shape, rows in zip(shapes, rows_per_setting):
        different = [{"id": r["id"], "at": r["first_divergence"]} for r in rows if not r["identical"]]
        found.append({"label": label(shape), "checked": len(rows), "identical": len(rows) - len(different), "different": different,
                      "lossless": not different})
    return found


# --------------------------------------------------------------------------- the block


def setting_figures(shape, rows: list[dict], greedy_tokens_per_s: float, ngram_tokens_per_s: float | None) -> dict:
    """One setting over all prompts, token-weighted like the drafter's main figures (eyrie.bench.rounds.acceptance_summary)."""
    tokens_per_s = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    acceptance = acceptance_summary(rows, shape.steps)  # accepted_per_position is per depth for a tree
    return {
        "label": label(shape),
        "steps": shape.steps,
        "topk": shape.topk,
        "draft_tokens": shape.draft_tokens,
        "mean_acceptance_length": acceptance["mean_acceptance_length"],
        "acceptance_rate_per_depth": acceptance["acceptance_rate_per_position"],
        "rounds": acceptance["rounds"],
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / greedy_tokens_per_s,
        "speedup_over_ngram": tokens_per_s / ngram_tokens_per_s if ngram_tokens_per_s else None,
        "lossless": acceptance["lossless"],
        "different": [{"id": r["id"], "at": r["first_divergence"]} for r in rows if not r["identical"]],
        "sglang_flags": sglang_flags(shape),
        "per_prompt": rows,
    }


def main_chain(summary: dict, draft_tokens: int, speedup_over_ngram: float | None) -> dict:
    """The benchmark's primary measurement (bench.draft_tokens) as a candidate: a chain of k is SGLang's (k, 1, k + 1)."""
    setting = {"steps": draft_tokens, "topk": 1, "draft_tokens": draft_tokens + 1}
    return {
        "label": f"{label(setting)} (bench.draft_tokens)",
        **setting,
        "mean_acceptance_length": summary["mean_acceptance_length"],
        "tokens_per_s": summary["spec_tokens_per_s"],
        "speedup": summary["speedup"],
        "speedup_over_ngram": speedup_over_ngram,
        "lossless": summary["lossless"],
    }


def paired_interval(numerator: dict, denominator: dict, draws: int = 2000, seed: int = 0) -> list[float] | None:
    """95% interval of numerator's tokens/s over denominator's, each pooled over the same prompts drawn again with
    replacement ({prompt id: (new tokens, seconds)} each): how much of the gap between two decoders another handful of
    prompts could move. Both decoded every prompt back to back, so what a prompt does to both cancels. None under 2."""
    ids = sorted(set(numerator) & set(denominator))
    if len(ids) < 2:
        return None
    pick = random.Random(seed)
    ratios = []
    for _ in range(draws):
        drawn = [ids[pick.randrange(len(ids))] for _ in ids]
        top = sum(numerator[i][0] for i in drawn) / sum(numerator[i][1] for i in drawn)
        ratios.append(top / (sum(denominator[i][0] for i in drawn) / sum(denominator[i][1] for i in drawn)))
    ratios.sort()
    return [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]]


def _timings(rows: list[dict], tokens: str, seconds: str) -> dict:
    return {r["id"]: (r[tokens], r[seconds]) for r in rows}


def recommend(candidates: list[dict]) -> dict | None:
    """The lossless candidate with the highest tokens/s, the first one on a tie; None when no candidate is lossless."""
    lossless = [c for c in candidates if c.get("lossless") is True and c.get("tokens_per_s") is not None]
    return max(lossless, key=lambda c: c["tokens_per_s"], default=None)


def sweep_block(shapes: list, rows_per_setting: list[list[dict]], summary: dict, draft_tokens: int, *, ngram: dict | None = None,
                speedup_over_ngram: float | None = None, check: dict | None = None, timing_dtype: str | None = None,
                main_rows: list[dict] | None = None, ngram_rows: list[dict] | None = None) -> dict | None:
    """The JSON's `sweep` block; None when bench.sweep is empty.

    check: the float32 check of a run timed in another dtype; its per-setting verdicts then decide losslessness,
    as its chain verdict decides the main one, and each setting keeps its timed dtype's agreement beside it.
    main_rows, ngram_rows: the per-prompt rows of the main chain and the n-gram; when the sweep decoded only some
    prompts (bench.sweep_prompts), greedy, the main chain and the n-gram are taken over those same prompts, so every
    speedup and the recommendation compare like with like.
    """
    if not shapes:
        return None
    ngram_tokens_per_s = ngram["tokens_per_s"] if ngram else None
    swept = {r["id"] for r in rows_per_setting[0]}
    same = None if main_rows is None else [r for r in main_rows if r["id"] in swept]
    if main_rows is not None and swept != {r["id"] for r in main_rows}:
        greedy = sum(r["new_tokens"] for r in same) / sum(r["greedy_seconds"] for r in same)
        chain = sum(r["spec_new_tokens"] for r in same) / sum(r["spec_seconds"] for r in same)
        summary = {**summary, "greedy_tokens_per_s": greedy, "spec_tokens_per_s": chain, "speedup": chain / greedy,
                   **acceptance_summary(same, draft_tokens), "lossless": summary["lossless"]}
        if ngram_rows:
            lookup = [r for r in ngram_rows if r["id"] in swept]
            ngram_tokens_per_s = sum(r["new_tokens"] for r in lookup) / sum(r["seconds"] for r in lookup)
            speedup_over_ngram = chain / ngram_tokens_per_s
    settings = [setting_figures(s, rows, summary["greedy_tokens_per_s"], ngram_tokens_per_s) for s, rows in zip(shapes, rows_per_setting)]
    if check is not None:
        for figures, verdict in zip(settings, check["sweep"]):
            timed = figures["per_prompt"]
            figures["agreement_in_timing_dtype"] = {"dtype": timing_dtype, "identical": sum(r["identical"] for r in timed), "checked": len(timed)}
            figures.update(lossless=verdict["lossless"], different=verdict["different"])
    main = main_chain(summary, draft_tokens, speedup_over_ngram)
    best = recommend([main, *settings])
    within_noise = None
    if same:  # each candidate's speedup with its 95% interval over prompts, and which ones the recommendation does not beat
        greedy = _timings(same, "new_tokens", "greedy_seconds")
        lookup = _timings([r for r in ngram_rows or [] if r["id"] in swept], "new_tokens", "seconds")
        timed = [(main, _timings(same, "spec_new_tokens", "spec_seconds"))] + [(f, _timings(f["per_prompt"], "new_tokens", "seconds")) for f in settings]
        for candidate, timing in timed:
            candidate["speedup_interval"] = paired_interval(timing, greedy)
            # The n-gram's acceptance moves with the text decoded (a few prompts' continuations changed HumanEval's
            # by 11% between two engines' bf16 roundings), so its ratio gets an interval too.
            candidate["speedup_over_ngram_interval"] = paired_interval(timing, lookup)
        if best is not None:
            best_timing = next(timing for candidate, timing in timed if candidate is best)
            within_noise = [c["label"] for c, timing in timed if c is not best and c.get("lossless") is True
                            and (paired_interval(timing, best_timing) or [0.0, 0.0])[1] >= 1.0]
    return {
        "lossless_checked_in": "float32" if check is not None else timing_dtype,
        "prompts": len(swept),
        "settings": settings,
        "main": main,
        "best": None if best is None else {**{key: best[key] for key in CANDIDATE_KEYS}, "main_chain": best is main,
                                           "speedup_interval": best.get("speedup_interval"),
                                           "speedup_over_ngram_interval": best.get("speedup_over_ngram_interval"), "within_noise": within_noise},
        "sglang_flags": None if best is None else sglang_flags(best),
    }
