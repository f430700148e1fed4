"""The benchmark JSON's `ngram` block: prompt lookup (eyrie.decoding.ngram.NgramDecoder) on the same engine, with the
drafter's k or, given bench.ngram_draft_tokens, at each of those draft lengths with the fastest as the baseline.

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


def fastest_ngram(rows_by_k: dict[int, list[dict]], greedy_tokens_per_s: float) -> tuple[dict, list[dict]]:
    """(the block of the fastest draft length, with every length's figures under `by_draft_tokens`; its per-prompt
    rows): the n-gram at its best on these prompts is the baseline a drafter has to beat, not at the drafter's k."""
    blocks = {k: ngram_block(rows, k, greedy_tokens_per_s) for k, rows in rows_by_k.items()}
    best = max(blocks, key=lambda k: blocks[k]["tokens_per_s"])  # the first listed on a tie
    by_length = [{key: block[key] for key in ("draft_tokens", "mean_acceptance_length", "tokens_per_s", "speedup", "lossless")}
                 for block in blocks.values()]
    return {**blocks[best], "by_draft_tokens": by_length}, rows_by_k[best]
