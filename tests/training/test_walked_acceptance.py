"""The walked simulation (eyrie.training.acceptance): a served chain's rounds replayed along cached tokens.

Training's per-position forms average every position alike; a decoder jumps past what it accepted, so they
overestimate what it serves. The walked form must equal, on the same tokens, what the decoder measures.
"""

from __future__ import annotations

import pytest
import torch
from factories import tree_target

from eyrie.decoding.decode import speculative_decode
from eyrie.drafter.model import DrafterShape, Eagle3Drafter
from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids
from eyrie.target.states import TargetStates
from eyrie.training.acceptance import (
    COPY_DRAFTER,
    COPY_LOOKUP,
    COPY_MIN_DRAFTS,
    COPY_POSITIONS,
    EMITTED,
    FIRST_EMITTED,
    FIRST_ROUNDS,
    LOOKUP_K,
    ROUNDS,
    ROWS,
    acceptance_line,
    acceptance_summary,
    batch_counts,
    copy_slice,
    first_reply,
    walk_rounds,
)
from eyrie.training.inputs import padded_batch


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


def test_walk_rounds_jumps_past_what_each_round_accepted():
    runs = [3, 0, 0, 2, 5, 5, 5, 5, 0, 1]
    starts = [True] * 10
    # k = 2: t=0 accepts 2 (emits 3) -> t=3 accepts 2 -> t=6 accepts 2 -> t=9 accepts 1 (emits 2): 4 rounds, 11 tokens.
    assert walk_rounds(runs, starts, 2) == (4, 11)
    # k = 4: t=0 accepts 3 -> t=4 accepts 4 -> t=9 accepts 1: 3 rounds, 4 + 5 + 2 tokens.
    assert walk_rounds(runs, starts, 4) == (3, 11)
    # No round starts outside the assistant's tokens; the walk moves on one position at a time there.
    # t=3 accepts 2 (to t=6, no start), t=8 accepts 0, t=9 accepts 1: 3 rounds, 3 + 1 + 2 tokens.
    assert walk_rounds(runs, [False, False, False, True, False, False, False, False, True, True], 2) == (3, 6)
    # An easy stretch then a hard one: the walk crosses the easy one in one round, so it weighs what a decoder
    # meets; the per-position average 1 + mean(min(k, run)) overweights the easy stretch.
    easy_then_hard = [4, 3, 2, 1, 0, 0, 0, 0]
    assert walk_rounds(easy_then_hard, [True] * 8, 4) == (4, 8)
    assert 1 + sum(easy_then_hard) / 8 == 2.25 > 8 / 4


def test_summary_reports_walked_length_per_k():
    totals = [[8, 6], [10, 10], [8, 4], [10, 8], [5, 4], [9, 9]]
    summary = acceptance_summary(totals, source="held-out cache samples", samples=3)
    assert summary["walked_length"] == pytest.approx([9 / 5, 9 / 4]) and summary["walked_rounds"] == [5, 4]
    # Records of four rows (before the walk existed) still read, without a walked length.
    assert acceptance_summary(totals[:4], source="x", samples=1)["walked_length"] == [None, None]
    # Records of six rows (before the first-turn walk) read without it.
    assert acceptance_summary(totals, source="x", samples=1)["walked_first_turn_length"] == [None, None]
    first = acceptance_summary(totals + [[2, 2], [3, 5]], source="x", samples=1)
    assert first["walked_first_turn_length"] == pytest.approx([3 / 2, 5 / 2]) and first["walked_first_turn_rounds"] == [2, 2]


def test_first_reply_is_each_rows_first_run_of_loss_positions():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert first_reply(mask).int().tolist() == [[0, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0] * 7, [0, 0, 1, 1, 1, 1, 1]]


def random_drafter(model, seed: int = 1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    V = model.config.vocab_size
    shape = DrafterShape.from_target(model.config, V, default_aux_layer_ids(model.config.num_hidden_layers))
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.05)
    return drafter.eval()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_walked_length_equals_the_served_chain_on_the_same_tokens(k):
    """Decode with the served chain, then simulate on the decoded tokens (loss mask on the new ones, states as
    extraction computes them): rounds, tokens and so acceptance length agree exactly, while the per-position
    conditional form does not."""
    model = tree_target(vocab_size=4)  # a vocabulary of 4: a random drafter's drafts then often hit
    drafter = random_drafter(model)
    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    V = model.config.vocab_size
    rounds = emitted = 0
    totals = torch.zeros(len(ROWS), k, dtype=torch.int64)
    for prompt in ([1, 2, 3, 0, 0, 2], [3, 3, 1], [0, 0, 1, 2, 2, 3, 1, 0]):
        served = speculative_decode(model, drafter, prompt, 40, set(), k)
        rounds += served.rounds
        emitted += sum(served.acceptance_lengths)
        ids = torch.tensor([prompt + served.tokens])
        with torch.no_grad(), TargetStates(model, capture) as target:
            aux, final = target.states(ids, torch.arange(ids.shape[1]))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        batch = padded_batch(aux[None], final[None], ids, mask, torch.tensor([ids.shape[1]]), "cpu")
        totals += batch_counts(drafter, batch, target_lm_head=model.lm_head.weight.detach(), draft_ids=torch.arange(V), t2d=drafter.t2d,
                               steps=k, attention="eager", use_bf16=False)
    # The decoder's last round may be cut by max_new_tokens; the walk stops where the tokens stop, two positions early.
    assert abs(int(totals[ROUNDS, k - 1]) - rounds) <= 3, (int(totals[ROUNDS, k - 1]), rounds)
    walked = acceptance_summary(totals.tolist(), source="served", samples=3)["walked_length"][k - 1]
    served_length = emitted / rounds
    assert walked == pytest.approx(served_length, abs=0.05), (walked, served_length)
    conditional = acceptance_summary(totals.tolist(), source="served", samples=3)["conditional_length"][k - 1]
    if k > 1:  # the per-position form overestimates the chain (1.52 against 1.39 served at k = 3)
        assert abs(walked - served_length) < conditional - served_length, (walked, conditional, served_length)
    assert 1.15 < emitted / rounds  # drafts do hit: the comparison is not between two trivial 1.0s


def counts_on(model, drafter, ids: list[int], replies: list[tuple[int, int]], k: int) -> torch.Tensor:
    """batch_counts of one sample whose loss mask covers the given [start, stop) replies, states as extraction computes them."""
    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    V = model.config.vocab_size
    t = torch.tensor([ids])
    with torch.no_grad(), TargetStates(model, capture) as target:
        aux, final = target.states(t, torch.arange(t.shape[1]))
    mask = torch.zeros_like(t, dtype=torch.bool)
    for a, b in replies:
        mask[0, a:b] = True
    batch = padded_batch(aux[None], final[None], t, mask, torch.tensor([t.shape[1]]), "cpu")
    return batch_counts(drafter, batch, target_lm_head=model.lm_head.weight.detach(), draft_ids=torch.arange(V), t2d=drafter.t2d,
                        steps=k, attention="eager", use_bf16=False)


def test_the_first_turn_walk_of_a_two_turn_sample_is_the_walk_of_its_first_reply_alone():
    """A cached sample holds both replies of a conversation; the benchmark serves first turns. The first-turn rows
    count exactly what the first reply alone would (the target is causal and no round crosses a user turn), and
    the all-turn rows add the second reply's rounds."""
    model = tree_target(vocab_size=4)
    drafter = random_drafter(model)
    k = 3
    prompt = [1, 2, 3, 0, 0, 2]
    first = speculative_decode(model, drafter, prompt, 30, set(), k).tokens
    user = [3, 1, 1]
    context = prompt + first + user
    second = speculative_decode(model, drafter, context, 30, set(), k).tokens
    both = counts_on(model, drafter, context + second, [(len(prompt), len(prompt) + len(first)), (len(context), len(context) + len(second))], k)
    alone = counts_on(model, drafter, prompt + first, [(len(prompt), len(prompt) + len(first))], k)
    later = counts_on(model, drafter, context + second, [(len(context), len(context) + len(second))], k)
    assert torch.equal(both[FIRST_ROUNDS], alone[ROUNDS]) and torch.equal(both[FIRST_EMITTED], alone[EMITTED])
    assert torch.equal(both[ROUNDS], alone[ROUNDS] + later[ROUNDS]) and torch.equal(both[EMITTED], alone[EMITTED] + later[EMITTED])
    assert int(later[ROUNDS, k - 1]) > 0 and torch.equal(later[FIRST_ROUNDS], later[ROUNDS])  # one reply: its first turn is all of it


def test_the_copy_slice_holds_the_round_starts_where_prompt_lookup_copies_and_stops_at_the_reply():
    """A reply that repeats its prompt: the slice counts each round start where prompt lookup would have at least
    COPY_MIN_DRAFTS drafts accepted, with both sides' accepted drafts; lookup's stop where the assistant's tokens do."""
    from eyrie.decoding.ngram import lookup

    prompt = [7, 1, 2, 3, 4, 5, 6, 8]
    reply = [1, 2, 3, 4, 5, 6, 9, 9]
    ids = prompt + reply + [1, 2, 3]  # a user turn after the reply: prompt lookup would copy on into it
    mask = [False] * len(prompt) + [True] * len(reply) + [False] * 3
    starts = [mask[t + 1] and mask[t + 2] for t in range(len(ids) - 2)]
    runs = [t % 3 for t in range(len(ids))]  # the drafter's consecutive hits, made up
    positions, drafter, lookup_sum = copy_slice(runs, starts, ids, mask, steps=4)

    expected_positions, expected_lookup, expected_drafter = 0, 0, [0] * 4
    for t, start in enumerate(starts):
        accepted = 0
        for guess, truth, assistant in zip(lookup(ids[: t + 2], LOOKUP_K) or [], ids[t + 2 :], mask[t + 2 :]):
            if guess != truth or not assistant:
                break
            accepted += 1
        if start and accepted >= COPY_MIN_DRAFTS:
            expected_positions += 1
            expected_lookup += accepted
            expected_drafter = [d + min(k, runs[t]) for d, k in zip(expected_drafter, range(1, 5))]
    assert expected_positions >= 2  # the reply's copy of the prompt is in the slice
    assert (positions, drafter, lookup_sum) == (expected_positions, expected_drafter, expected_lookup)
    assert lookup_sum <= positions * (len(reply) - 1)  # never counted past the reply's end


def test_the_copy_slice_reaches_the_summary_and_the_progress_line():
    model = tree_target(vocab_size=4)
    drafter = random_drafter(model)
    k = 3
    prompt = [1, 2, 3, 0, 0, 2, 1, 3]
    reply = prompt * 3  # the reply repeats the prompt: prompt lookup copies it whole
    counts = counts_on(model, drafter, prompt + reply, [(len(prompt), len(prompt) + len(reply))], k)
    positions = int(counts[COPY_POSITIONS, 0])
    assert positions > 10
    assert all(int(counts[COPY_DRAFTER, j]) <= positions * (j + 1) for j in range(k))
    summary = acceptance_summary(counts.tolist(), source="held-out cache samples", samples=1)
    copy = summary["copy"]
    assert copy["positions"] == positions and copy["lookup_accepted"] == int(counts[COPY_LOOKUP, 0]) / positions
    assert copy["lookup_accepted"] >= COPY_MIN_DRAFTS and len(copy["drafter_accepted"]) == k
    line = acceptance_line({**summary, "epoch": 1})
    assert f"where prompt lookup copies >= {COPY_MIN_DRAFTS} ({positions} round starts)" in line


def test_a_summary_of_counts_without_the_copy_rows_reports_no_copy_slice():
    """Counts written before the copy slice existed (8 rows) still summarise, with an empty slice and no words for it."""
    summary = acceptance_summary([[1, 1]] * 8, source="held-out cache samples", samples=1)
    assert summary["copy"]["positions"] == 0 and summary["copy"]["lookup_accepted"] is None
    assert "prompt lookup copies" not in acceptance_line({**summary, "epoch": 1})


@pytest.mark.parametrize("widths", [(3, 4)])
def test_the_one_step_tree_walk_equals_the_served_tree_on_the_same_tokens(monkeypatch, widths):
    """A served (1, N, N) tree accepts its draft when the target's token is among the drafter's top N - 1 (the N
    verified tokens hold the bonus token): the walk over first replies, replayed on the tokens the tree decoded, gives
    its rounds and acceptance length."""
    import eyrie.training.acceptance as acceptance
    from eyrie.decoding.decode import tree_decode

    monkeypatch.setattr(acceptance, "ONE_STEP_TREES", widths)  # the vocabulary of 4 leaves no room for 10 or 32: top 2 and 3
    model = tree_target(vocab_size=4)
    drafter = random_drafter(model)
    prompt = [1, 2, 3, 0, 0, 2]
    lengths = []
    for i, width in enumerate(widths):
        served = tree_decode(model, drafter, prompt, 40, set(), 1, width, width)
        counts = counts_on(model, drafter, prompt + served.tokens, [(len(prompt), len(prompt) + len(served.tokens))], 1)
        summary = acceptance_summary(counts.tolist(), source="served", samples=1)
        walked = summary["one_step_trees"]["walked_first_turn_length"][i]
        # The decoder's last round may be cut by max_new_tokens; the walk stops two positions before the tokens do.
        assert abs(int(counts[acceptance.TREE_FIRST_ROUNDS + i, 0]) - served.rounds) <= 2
        assert walked == pytest.approx(sum(served.acceptance_lengths) / served.rounds, abs=0.05)
        lengths.append(walked)
    top1 = acceptance_summary(counts.tolist(), source="served", samples=1)["walked_first_turn_length"][0]
    assert top1 < lengths[0] < lengths[1] < 2.0  # wider trees accept more, and not every round
    assert f"(1, {widths[1]}, {widths[1]}) {lengths[1]:.2f}" in acceptance_line({**summary, "epoch": 1})
