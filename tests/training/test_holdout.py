"""The held-out cache samples split records, not samples: the per-turn samples of one conversation share its earlier
turns, so a turn held out while its sibling trains would be scored on context the drafter was trained on."""

from __future__ import annotations

from eyrie.tokens.shards import record_of, turn_sample_id
from eyrie.training.holdout import eval_unit, held_out_indices


def test_a_per_turn_sample_names_its_record_and_other_ids_are_records_themselves():
    assert record_of(turn_sample_id("abc", 3)) == "abc"
    assert record_of(turn_sample_id("a#b", 12)) == "a#b"
    assert record_of("plain-id") == "plain-id"
    assert record_of("tag#x") == "tag#x"  # a '#' not followed by a message index is part of the id


def test_every_turn_of_a_record_falls_on_the_side_of_its_record():
    ids = [turn_sample_id(f"rec-{r}", turn) for r in range(60) for turn in (1, 3, 5)]
    held = set(held_out_indices(ids, 0.2))
    assert held and len(held) < len(ids)
    for r in range(60):
        sides = {ids.index(turn_sample_id(f"rec-{r}", turn)) in held for turn in (1, 3, 5)}
        assert len(sides) == 1, f"rec-{r}'s turns are split between training and the held-out samples"


def test_a_conversation_sample_keeps_the_unit_its_id_always_had():
    """Conversations stored as one sample (the default template's case) are held out exactly as before."""
    import hashlib

    for sample_id in ("QWJhYvA_0", "local-2", "x"):
        expected = int.from_bytes(hashlib.sha256(f"eval:{sample_id}".encode()).digest()[:8], "big") / 2**64
        assert eval_unit(sample_id) == expected
