"""The benchmark JSON's `ngram` block: prompt lookup (eyrie.decoding.ngram.NgramDecoder) with the drafter's k, on the same engine.

A trained drafter is worth its training only where it beats drafting for free: the n-gram baseline
decodes the same prompts in the same process, right after the drafter, and its block sits beside
the drafter's numbers (`speedup_over_ngram`).
"""

from __future__ import annotations

from eyrie.bench.divergence import first_divergence
from eyrie.decoding.ngram import MAX_NGRAM, MIN_NGRAM


def ngram_row(prompt_id: str, plain, spec) -> dict:
    """One prompt's n-gram decode (a SpecResult) against its plain greedy decode."""
    divergence = first_divergence(plain.tokens, spec.tokens)
    return {
        "id": prompt_id,
        "new_tokens": len(spec.tokens),
        "tokens_per_s": len(spec.tokens) / spec.seconds,
        "seconds": spec.seconds,
        "target_forwards": spec.target_forwards,
        "acceptance_length_mean": sum(spec.acceptance_lengths) / spec.rounds if spec.rounds else None,
        "acceptance_lengths": spec.acceptance_lengths,
        "accepted_per_position": spec.accepted_per_position,
        "rounds": spec.rounds,
        "identical": divergence is None,
        "first_divergence": divergence,
    }


def ngram_block(rows: list[dict], draft_tokens: int, greedy_tokens_per_s: float) -> dict:
    """Aggregates over all prompts, token-weighted like the drafter's (eyrie.bench.benchmark.summarise)."""
    rounds = sum(r["rounds"] for r in rows)
    emitted = sum(sum(r["acceptance_lengths"]) for r in rows)
    accepted = [sum(r["accepted_per_position"][j] for r in rows) for j in range(draft_tokens)]
    tokens_per_s = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    return {
        "method": "prompt lookup",
        "max_ngram": MAX_NGRAM,
        "min_ngram": MIN_NGRAM,
        "draft_tokens": draft_tokens,
        "mean_acceptance_length": emitted / rounds if rounds else None,
        "acceptance_rate_per_position": [a / rounds if rounds else None for a in accepted],
        "rounds": rounds,
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / greedy_tokens_per_s,
        "lossless": all(r["identical"] for r in rows),
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "per_prompt": rows,
    }
