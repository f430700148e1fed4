"""What every speculative decoder's figures share, the drafter's and the n-gram baseline's alike.

Per prompt: the acceptance of its verify rounds and whether its output equals plain greedy's.
Over prompts: token-weighted aggregates (every round emits its accepted drafts plus the bonus),
not a mean of per-prompt means.
"""

from __future__ import annotations


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Where b first differs from a: None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def round_fields(plain, spec) -> dict:
    """One prompt's speculative decode (a SpecResult) against its plain greedy decode (a DecodeResult)."""
    divergence = first_divergence(plain.tokens, spec.tokens)
    return {
        "acceptance_length_mean": sum(spec.acceptance_lengths) / spec.rounds if spec.rounds else None,
        "acceptance_lengths": spec.acceptance_lengths,
        "accepted_per_position": spec.accepted_per_position,
        "rounds": spec.rounds,
        "identical": divergence is None,
        "first_divergence": divergence,
    }


def timed_row(prompt_id: str, plain, spec) -> dict:
    """One prompt's speculative decode (a SpecResult), timed, against its plain greedy decode: a sweep setting's row."""
    return {
        "id": prompt_id,
        "new_tokens": len(spec.tokens),
        "tokens_per_s": len(spec.tokens) / spec.seconds,
        "seconds": spec.seconds,
        "target_forwards": spec.target_forwards,
        **round_fields(plain, spec),
    }


def acceptance_summary(rows: list[dict], draft_tokens: int) -> dict:
    """Mean acceptance length, per-position acceptance rate, rounds and losslessness over rows of round_fields."""
    rounds = sum(r["rounds"] for r in rows)
    emitted = sum(sum(r["acceptance_lengths"]) for r in rows)
    accepted = [sum(r["accepted_per_position"][j] for r in rows) for j in range(draft_tokens)]
    return {
        "mean_acceptance_length": emitted / rounds if rounds else None,
        "acceptance_rate_per_position": [a / rounds if rounds else None for a in accepted],
        "rounds": rounds,
        "lossless": all(r["identical"] for r in rows),
    }
