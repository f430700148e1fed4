"""Which labels lie inside copied stretches: the positions from which prompt lookup would have several drafts accepted.

copyable[b, s] is True when prompt lookup (eyrie.decoding.ngram.lookup, the benchmark's n-gram baseline), knowing
row b's tokens up to s, would have its first min_run drafts accepted: the most recent earlier occurrence of the longest
suffix n-gram (n = 3, 2, 1) ending at s was followed by tokens s + 1 .. s + min_run. train.copy_weight weights the loss
of the label s + 1 at those positions, with min_run = 3: the stretches training's copy slice measures
(eyrie.training.acceptance). With min_run = 1, 48% of the CPU default's regenerated assistant tokens qualify, most of
them on a one-token match; with 3, 34%.

The drafter decoded on the H200 missed exactly such tokens: in a reply that repeats one sentence it failed at the
same places every time the sentence came round, where prompt lookup accepted 8-9 a round
(`benchmarks/drafter_probe.py copy decode`). A single drafter layer can copy (a key sees its position's token through the target's features,
a value the next token through the input embedding); weighting these labels asks it to.

On the device, without a host loop: each n-gram becomes one exact int64 key (its tokens' ids in base 2^bits and the
row), and a stable sort puts each position right after the most recent earlier position with the same key.
"""

from __future__ import annotations

import torch

from eyrie.decoding.ngram import MAX_NGRAM

COPY_MIN_RUN = 3  # eyrie.training.acceptance.COPY_MIN_DRAFTS: a label counts as copied inside such a stretch


def copyable_positions(input_ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int, min_run: int = 1) -> torch.Tensor:
    """[B, L] bool: prompt lookup over row b's tokens up to s would draft tokens s + 1 .. s + min_run (all < lengths[b])."""
    B, L = input_ids.shape
    bits = max(1, (vocab_size - 1).bit_length())
    row_bits = max(1, (B - 1).bit_length())
    longest = min(MAX_NGRAM, (62 - row_bits) // bits)  # keys must fit an int64: a huge vocabulary drops to shorter n
    positions = torch.arange(L, device=input_ids.device)
    inside = positions[None, :] < lengths[:, None]
    chosen = torch.full((B, L), -1, dtype=torch.long, device=input_ids.device)  # the matched n-gram's end, longest n first
    for n in range(longest, 0, -1):
        key = torch.zeros((B, L), dtype=torch.long, device=input_ids.device)
        for i in range(n):  # the n-gram ending at s: tokens s - n + 1 .. s
            key = (key << bits) | torch.roll(input_ids, n - 1 - i, dims=1)
        key = key | (torch.arange(B, device=input_ids.device)[:, None] << (n * bits))
        valid = inside & (positions[None, :] >= n - 1)
        # Invalid positions get keys of their own (negative, distinct) so they match nothing.
        key = torch.where(valid, key, -1 - (torch.arange(B * L, device=input_ids.device).view(B, L)))
        order = torch.sort(key.flatten(), stable=True).indices  # equal keys stay in position order
        sorted_key = key.flatten()[order]
        previous = torch.full_like(order, -1)
        same = sorted_key[1:] == sorted_key[:-1]
        previous[1:] = torch.where(same, order[:-1], previous[1:])
        earlier = torch.full((B * L,), -1, dtype=torch.long, device=input_ids.device)
        earlier[order] = previous
        earlier = torch.where(earlier >= 0, earlier % L, earlier).view(B, L)  # flat index -> position in its row
        chosen = torch.where((chosen < 0) & valid, earlier, chosen)
    copyable = chosen >= 0
    for i in range(1, min_run + 1):  # draft i copies the token i after the match (itself a copy once past the present)
        following = input_ids.gather(1, (chosen + i).clamp(min=0, max=L - 1))
        copyable &= (positions[None, :] + i < lengths[:, None]) & (following == torch.roll(input_ids, -i, dims=1))
    return copyable
