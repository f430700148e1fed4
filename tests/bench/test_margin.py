"""The logit margin where a speculative decode parted from greedy: a near-tie or a bug."""

from __future__ import annotations

import torch
from factories import tree_target

from eyrie.bench.margin import add_margins, top2_margin


def test_margin_is_greedys_top2_gap_at_the_parting_token():
    model = tree_target(vocab_size=300)
    prompt, greedy = [5, 9, 2, 7], [11, 40, 3, 8]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    top = logits.topk(2).values
    assert abs(top2_margin(model, prompt, greedy, 2) - float(top[0] - top[1])) < 1e-5
    assert top2_margin(model, prompt, greedy, None) is None and top2_margin(model, prompt, greedy, 4) is None


def test_rows_that_did_not_part_get_no_margin():
    model = tree_target(vocab_size=300)
    rows = [{"id": "a", "first_divergence": None}, {"id": "b", "first_divergence": 1}]
    add_margins(model, rows, {"a": [1, 2], "b": [3, 4]}, {"a": [7, 8], "b": [9, 10]})
    assert rows[0]["margin_at_divergence"] is None and rows[1]["margin_at_divergence"] > 0
