"""Batched speculative decoding: every row's tokens equal its own batch-1 greedy decode, whatever the batch, the prompt
lengths or how many drafts each row accepts; a finished row stops."""

from __future__ import annotations

import pytest
import torch
from factories import random_drafter, tree_target

from eyrie.decoding.batched_greedy import BatchedGreedy
from eyrie.decoding.batched_speculative import BatchedSpeculative, needed_slots, trimmed
from eyrie.decoding.static import StaticLlama

MAX_NEW = 14
K = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def setup():
    """A 5-token vocabulary: a random drafter's drafts match the target's often enough that rows accept 0..k."""
    model = tree_target(vocab_size=5, seed=3)
    drafter = random_drafter(model, scale=0.3)
    return model, drafter


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * i) % 11 for i in range(count)]  # mixed: 3, 8, 13, 7, 12, ...
    return [torch.randint(0, 5, (n,), generator=g).tolist() for n in lengths]


def batch1_greedy(model, prompts, stop_ids, max_new=MAX_NEW):
    engine = StaticLlama(model, capacity=128, cuda_graphs=False)
    return [engine.greedy_decode(p, max_new, stop_ids).tokens for p in prompts]


@pytest.mark.parametrize("count", [1, 3, 5])
@pytest.mark.parametrize("drafting", ["chain", "ngram"])
def test_each_row_equals_its_greedy(setup, count, drafting):
    model, drafter = setup
    prompts = prompts_of(count, seed=count)
    expected = batch1_greedy(model, prompts, set())
    engine = BatchedGreedy(model, 0, set(), cuda_graphs=False)
    decoder = BatchedSpeculative(engine, drafter if drafting == "chain" else "ngram")
    result = decoder.generate(prompts, MAX_NEW, set(), K)
    assert result.tokens == expected
    assert all(len(t) == MAX_NEW for t in result.tokens)
    for row, lengths in zip(result.tokens, result.acceptance_lengths):
        assert sum(lengths) == len(row) - 1  # the prefill gives the first token, the rounds the rest
        assert all(1 <= n <= K + 1 for n in lengths)
    # The same engine's batched greedy agrees too, so the benchmark's baseline and its check are the same tokens.
    assert [trimmed(r, set()) for r in engine.generate(prompts, MAX_NEW)] == expected


def test_rows_accept_different_counts_and_batch_1_matches(setup):
    model, drafter = setup
    prompts = prompts_of(5, seed=11)
    engine = BatchedGreedy(model, 0, set(), cuda_graphs=False)
    batched = BatchedSpeculative(engine, drafter).generate(prompts, MAX_NEW, set(), K)
    # Rows part ways: in some round two rows accepted different numbers of drafts.
    assert any(len({lengths[i] for lengths in batched.acceptance_lengths if len(lengths) > i}) > 1 for i in range(3))
    assert max(max(lengths) for lengths in batched.acceptance_lengths) > 1  # drafts were accepted
    alone = [BatchedSpeculative(BatchedGreedy(model, 0, set(), cuda_graphs=False), drafter).generate([p], MAX_NEW, set(), K) for p in prompts]
    assert batched.tokens == [a.tokens[0] for a in alone]
    # A row's rounds do not depend on its neighbours: its drafts see only its own sequence.
    assert batched.acceptance_lengths == [a.acceptance_lengths[0] for a in alone]


def test_a_finished_row_stops(setup):
    """A stop token ends its row at once: its tokens end there and it runs no more rounds, while others go on."""
    model, drafter = setup
    prompts = prompts_of(5, seed=4)
    free = batch1_greedy(model, prompts, set(), max_new=30)
    stop = next(t for t in range(5) if any(t in row[1:25] for row in free) and not all(t in row[:25] for row in free))
    expected = batch1_greedy(model, prompts, {stop}, max_new=30)
    for drafter_or_ngram in (drafter, "ngram"):
        engine = BatchedGreedy(model, 0, {stop}, cuda_graphs=False)
        result = BatchedSpeculative(engine, drafter_or_ngram).generate(prompts, 30, {stop}, K)
        assert result.tokens == expected
        stopped = [i for i, row in enumerate(result.tokens) if row[-1] == stop]
        running = [i for i, row in enumerate(result.tokens) if row[-1] != stop]
        assert stopped and running
        for i in stopped:  # no round after the stop token: the rounds add up to the tokens
            assert sum(result.acceptance_lengths[i]) == len(result.tokens[i]) - 1
            assert len(result.acceptance_lengths[i]) < result.rounds


def test_cache_slots_cover_the_worst_case():
    """Every round may emit only its bonus token: max_new_tokens - 1 rounds, each moving the caches on by S + 1 slots
    (the longest path a round can keep) and writing its rows from there; a tree's width costs one round's slots, not
    one per round."""
    target, drafter = needed_slots(13, 20, 5, 5, 8)  # a chain of 4: 5 verified rows, 8 drafter slots a round
    assert target >= 13 + 18 * 5 + 5 and target % 64 == 0
    assert drafter >= 13 + 18 * 5 + 8
    tree, _ = needed_slots(13, 20, 9, 64, 0)  # an (8, 10, 64) tree
    assert 13 + 18 * 9 + 64 <= tree < 13 + 19 * 64


@pytest.mark.parametrize("shape", [(3, 2, 6), (2, 3, 5), (3, 1, 4)])
def test_trees_give_each_rows_greedy_and_match_batch_1_acceptance(setup, shape):
    """Batched trees: every row's tokens are its greedy decode; with one row, each round accepts what the batch-1 tree
    round (eyrie.decoding.static_tree) accepts on the same drafter."""
    from eyrie.decoding.batched_tree import TreeDrafts
    from eyrie.decoding.static_tree import tree_decode
    from eyrie.decoding.tree import TreeShape

    model, drafter = setup
    prompts = prompts_of(5, seed=7)
    expected = batch1_greedy(model, prompts, set())
    engine = BatchedGreedy(model, 0, set(), cuda_graphs=False)
    result = BatchedSpeculative(engine, TreeDrafts(engine, drafter, TreeShape(*shape))).generate(prompts, MAX_NEW, set(), shape[0])
    assert result.tokens == expected
    assert max(max(lengths) for lengths in result.acceptance_lengths) > 2  # some round kept a path of two drafts or more
    single = StaticLlama(model, capacity=128, cuda_graphs=False)
    with torch.inference_mode():
        alone = [tree_decode(single, drafter, prompt, MAX_NEW, set(), *shape).acceptance_lengths for prompt in prompts]
    assert alone == result.acceptance_lengths


def test_every_round_graph_and_greedy_step_of_an_engine_captures_into_its_one_pool(setup, monkeypatch):
    """Round graphs per setting and span pair at B = 64 summed past 60 GiB with a pool each: they share the engine's."""
    import eyrie.decoding.batched_greedy as batched_greedy_module
    import eyrie.decoding.batched_speculative as batched_module

    model, drafter = setup
    pools = []

    class Recording:
        def __init__(self, fn, use_graph, failures, pool=None):
            pools.append(pool)
            self.fn = fn

        def __call__(self):
            self.fn()

    monkeypatch.setattr(batched_module, "Replay", Recording)
    monkeypatch.setattr(batched_greedy_module, "Replay", Recording)
    engine = BatchedGreedy(model, pad_id=0, stop_ids=set(), rows=2, cuda_graphs=False)
    engine.graph_pool = ("the engine's pool",)
    for drafts in (drafter, "ngram"):
        BatchedSpeculative(engine, drafts).prepare(2, 9, MAX_NEW, K)
    assert len(pools) > 2 and set(pools) == {("the engine's pool",)}
