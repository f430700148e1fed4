"""Which of the target's greedy reply tokens the drafter cannot propose: those outside its draft vocabulary.

A drafter drafts only the ids its vocabulary holds (t2d). When the target copies names or quoted text from the prompt
that it never wrote in training, every such token ends a round however well the drafter copies; on the held-out
ShareGPT prompts of the default target these were 1.8% of the reply tokens, and walking the replies as if they had
been drafted right gave +4.2% acceptance (`benchmarks/drafter_probe.py copy vocab`). The benchmark reports the share
so that a user sees when the vocabulary, not the drafter, is the limit.
"""

from __future__ import annotations

from collections import Counter

MOST_COMMON = 5


def outside_draft_vocab(greedy_paths: dict[str, list[int]], t2d, decode=None) -> dict:
    """{new_tokens, outside, fraction, prompts_with_any, most_common: [{id, text, count}]} over every prompt's greedy
    tokens; t2d: the drafter's bool mask over the target vocabulary; decode: ids -> text (the tokenizer's), optional."""
    allowed = t2d.tolist()
    missing = Counter()
    total = prompts_with_any = 0
    for tokens in greedy_paths.values():
        outside = [t for t in tokens if not allowed[t]]
        missing.update(outside)
        total += len(tokens)
        prompts_with_any += bool(outside)
    count = sum(missing.values())
    return {
        "new_tokens": total,
        "outside": count,
        "fraction": count / total if total else None,
        "prompts_with_any": prompts_with_any,
        "most_common": [{"id": token, "text": decode([token]) if decode else None, "count": n} for token, n in missing.most_common(MOST_COMMON)],
    }
