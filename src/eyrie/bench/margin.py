"""How close to a tie greedy decoding was where a speculative decode parted from it, in the timing dtype.

Timed in bf16, a verify over several tokens rounds differently from one-token decoding, so at a near-tie the two
greedy paths can part although both are "greedy". The margin between greedy's top two logits at that position says
whether a divergence is such a tie (a margin of a few hundredths in bf16) or a bug (a wide margin); float32_check
gives the verdict either way.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def top2_margin(model, prompt_ids: list[int], greedy_tokens: list[int], at: int) -> float | None:
    """top-1 minus top-2 logit of `model` (a transformers causal LM) for new token `at` of greedy's path."""
    if at is None or at >= len(greedy_tokens):
        return None
    ids = torch.tensor([list(prompt_ids) + list(greedy_tokens[:at])], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def add_margins(model, rows: list[dict], prompts: dict[str, list[int]], greedy: dict[str, list[int]]) -> None:
    """Each row that parted from greedy gets `margin_at_divergence` (None where it did not part)."""
    for row in rows:
        at = row.get("first_divergence")
        row["margin_at_divergence"] = None if at is None else top2_margin(model, prompts[row["id"]], greedy[row["id"]], at)
