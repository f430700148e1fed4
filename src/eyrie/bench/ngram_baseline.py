"""The benchmark JSON's `ngram` block: prompt lookup (eyrie.decoding.ngram.NgramDecoder) with the drafter's k, on the same engine.

A trained drafter is worth its training only where it beats drafting for free: the n-gram baseline
decodes the same prompts in the same process, right after the drafter, and its block sits beside
the drafter's numbers (`speedup_over_ngram`).
"""

from __future__ import annotations

from eyrie.bench.rounds import acceptance_summary, timed_row
from eyrie.decoding.ngram import MAX_NGRAM, MIN_NGRAM


def ngram_row(prompt_id: str, plain, spec) -> dict:
    """One prompt's n-gram decode (a SpecResult) against its plain greedy decode: a sweep setting's row, the same fields."""
    return timed_row(prompt_id, plain, spec)


def ngram_block(rows: list[dict], draft_tokens: int, greedy_tokens_per_s: float) -> dict:
    """Aggregates over all prompts, token-weighted like the drafter's (eyrie.bench.rounds.acceptance_summary)."""
    tokens_per_s = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    return {
        "method": "prompt lookup",
        "max_ngram": MAX_NGRAM,
        "min_ngram": MIN_NGRAM,
        "draft_tokens": draft_tokens,
        **acceptance_summary(rows, draft_tokens),
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / greedy_tokens_per_s,
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "per_prompt": rows,
    }
