"""The device's copyable positions against prompt lookup itself, position by position."""

import pytest
import torch

from eyrie.decoding.ngram import lookup
from eyrie.training.copyable import copyable_positions


def reference(tokens: list[int], length: int, min_run: int) -> list[bool]:
    """Prompt lookup itself: its first min_run drafts from each position, all right and all inside the row."""
    return [s + min_run < length and (lookup(tokens[: s + 1], min_run) or []) == tokens[s + 1 : s + 1 + min_run] for s in range(len(tokens))]


@pytest.mark.parametrize("min_run", [1, 3])
@pytest.mark.parametrize("vocab, seed", [(2, 0), (3, 1), (7, 2), (49152, 3)])
def test_copyable_positions_are_where_prompt_lookup_drafts_the_next_tokens(vocab, seed, min_run):
    generator = torch.Generator().manual_seed(seed)
    B, L = 4, 70
    ids = torch.randint(0, vocab, (B, L), generator=generator)
    ids[1, 30:58] = ids[1, 2:30]  # a quoted stretch
    ids[2, 10:70] = ids[2, 3:10].repeat(9)[:60]  # a loop of period 7
    lengths = torch.tensor([70, 58, 70, 23])  # rows shorter than the batch: padding never matches
    ids[3, 23:] = ids[3, :23].repeat(3)[: L - 23]  # padding that repeats the row would match, were it counted
    got = copyable_positions(ids, lengths, vocab, min_run)
    for b in range(B):
        length = int(lengths[b])
        expected = reference(ids[b, :length].tolist(), length, min_run) + [False] * (L - length)
        assert got[b].tolist() == expected, b
    if vocab > 1000:  # no n-gram repeats inside the loop's period: every next token in it is copyable
        assert got[2, 20 : 70 - min_run].all()
    assert not got[3, 22:].any()


def test_a_vocabulary_too_large_for_trigram_keys_falls_back_to_bigrams():
    """At 2^21 ids three tokens and the row no longer fit an int64 key, so the longest n-gram is 2."""
    ids = torch.tensor([[1, 5, 6, 7, 2, 5, 6, 8, 1, 5, 6, 7]])
    lengths = torch.tensor([12])
    # At s = 10 the trigram "1 5 6" was last followed by 7 (right), the bigram "5 6" by 8 (wrong).
    assert copyable_positions(ids, lengths, 100)[0, 10].item() is True
    assert copyable_positions(ids, lengths, 1 << 21)[0, 10].item() is False
