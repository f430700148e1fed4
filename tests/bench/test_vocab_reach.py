"""The benchmark's count of greedy reply tokens outside the draft vocabulary."""

from __future__ import annotations

import torch

from eyrie.bench.vocab_reach import outside_draft_vocab


def test_counts_the_tokens_no_drafter_step_could_propose_and_names_the_most_common():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 3]] = True
    paths = {"a": [1, 2, 7, 3, 7, 7], "b": [2, 2, 2], "c": [9, 1]}
    figures = outside_draft_vocab(paths, t2d, decode=lambda ids: f"<{ids[0]}>")
    assert figures["new_tokens"] == 11 and figures["outside"] == 4
    assert figures["fraction"] == 4 / 11 and figures["prompts_with_any"] == 2
    assert figures["most_common"] == [{"id": 7, "text": "<7>", "count": 3}, {"id": 9, "text": "<9>", "count": 1}]


def test_nothing_outside_and_nothing_decoded():
    t2d = torch.ones(4, dtype=torch.bool)
    assert outside_draft_vocab({"a": [0, 3]}, t2d) == {"new_tokens": 2, "outside": 0, "fraction": 0.0, "prompts_with_any": 0, "most_common": []}
    assert outside_draft_vocab({}, t2d)["fraction"] is None
