"""Tree speculative decoding with SGLang's (steps, topk, draft tokens): the tree, its masks, lossless decoding."""

from __future__ import annotations

import random

import pytest
import torch
from factories import TREE_SHAPES, check_tree_result, random_drafter, tree_target

from eyrie.decoding.transformers_path import Eagle3Chain, cache_keyword, greedy_decode, speculative_decode
from eyrie.decoding.tree import (
    Candidates,
    Eagle3Tree,
    TreeShape,
    TreeVerifier,
    VerifyTree,
    accept_path,
    grow_tree,
    select_nodes,
    tree_mask,
    tree_speculative_decode,
)
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.chat_template import render


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


class ScriptedTree:
    """Test double: at each node on the greedy continuation, the true next token sits at rank `rank(index)` of the
    drafter's distribution (0: top-1 by far; None: below the top-K); elsewhere the distribution is arbitrary."""

    def __init__(self, aux_layer_ids, sequence, vocab_size, rank=lambda index: 0):
        self.aux_layer_ids, self.sequence, self.vocab_size, self.rank = aux_layer_ids, sequence, vocab_size, rank
        self.calls, self.trees = [], []

    def extend(self, aux_hidden, next_ids, start):
        self.calls.append((aux_hidden.clone(), list(next_ids), start))
        self.first = start + len(next_ids) + 1  # sequence index of the depth-1 nodes

    def draft_tree(self, shape):
        def expand(tree, nodes):
            return torch.stack([self.logprobs([tree.tokens[n] for n in tree.path(node)]) for node in nodes])

        tree = grow_tree(shape, self.logprobs([]), expand)
        self.trees.append(tree)
        return tree

    def logprobs(self, path):
        index = self.first + len(path)
        seed = hash((index, *path)) % (2**31)
        values = torch.rand(self.vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
        if index < len(self.sequence) and path == self.sequence[self.first : index]:
            true, rank = self.sequence[index], self.rank(index)
            values[true] = -1.0  # below every other token: outside the top-K unless ranked
            ranked = values.sort(descending=True).values
            if rank is not None:
                values[true] = ranked[0] + 10 if rank == 0 else (ranked[rank - 1] + ranked[rank]) / 2
        return torch.log_softmax(values, dim=-1)


def scripted(model, prompt, continuation, rank=lambda index: 0):
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    return ScriptedTree(layers, list(prompt) + list(continuation), model.config.vocab_size, rank)


# --------------------------------------------------------------------------- the tree itself


def test_shape_checks_name_the_sglang_flag():
    assert TreeShape(5, 4, 8).nodes == 4 + 4 * 16 and TreeShape(3, 1, 4).nodes == 3
    for args, flag in [((0, 1, 2), "num-steps"), ((2, 0, 2), "eagle-topk"), ((2, 2, 1), "num-draft-tokens"),
                       ((3, 1, 5), "num-draft-tokens 5"), ((2, 2, 8), "drafts only 6 nodes")]:
        with pytest.raises(ValueError, match=flag):
            TreeShape(*args)
    with pytest.raises(TypeError, match="num-steps must be an integer"):
        TreeShape(2.0, 1, 2)
    TreeShape(2, 2, 7)  # exactly every node


def test_grow_tree_keeps_the_best_k_by_cumulative_log_probability():
    """Hand-checked: 2 steps deep, K = 2; scripted log-probs over a 6-token vocabulary."""
    first = torch.tensor([-0.2, -3.0, -1.0, -5.0, -6.0, -7.0])  # top-2: token 0 (-0.2), token 2 (-1.0)
    after = {0: torch.tensor([-4.0, -3.5, -9.0, -9.0, -9.0, -9.0]), 2: torch.tensor([-9.0, -9.0, -9.0, -0.1, -0.5, -9.0])}
    seen = []

    def expand(tree, nodes):
        seen.append([tree.tokens[n] for n in nodes])
        return torch.stack([after.get(tree.tokens[n], torch.full((6,), -9.0)) for n in nodes])

    tree = grow_tree(TreeShape(3, 2, 5), first, expand)
    # Step 2 candidates: 0->1 (-3.7), 0->0 (-4.2), 2->3 (-1.1), 2->4 (-1.5): the frontier is 2->3, 2->4.
    assert seen == [[0, 2], [3, 4]]
    assert tree.tokens[:6] == [0, 2, 1, 0, 3, 4] and tree.parents[:6] == [-1, -1, 0, 0, 1, 1]
    assert len(tree.tokens) == TreeShape(3, 2, 5).nodes == 10
    torch.testing.assert_close(torch.tensor(tree.scores[:6]), torch.tensor([-0.2, -1.0, -3.7, -4.2, -1.1, -1.5]))
    # The 4 best overall: 0 (-0.2), 2 (-1.0), 2->3 (-1.1), 2->4 (-1.5); in drafting order.
    assert select_nodes(tree, 4) == [0, 1, 4, 5]


def test_selection_breaks_ties_toward_the_parent_and_is_ancestor_closed():
    tree = Candidates()
    root = tree.add(7, -1, 1, 0.0)
    child = tree.add(8, root, 2, 0.0)  # a certain child: the same score as its parent
    tree.add(9, child, 3, 0.0)
    tree.add(6, -1, 1, -1.0)
    assert select_nodes(tree, 1) == [0] and select_nodes(tree, 2) == [0, 1] and select_nodes(tree, 3) == [0, 1, 2]
    broken = Candidates([1, 2], [-1, 0], [1, 2], [-1.0, -0.5])  # a child better than its parent: not SGLang's tree
    with pytest.raises(AssertionError, match="ancestor-closed"):
        select_nodes(broken, 1)


def test_tree_mask_hand_checked():
    #      0 (current)
    #     / \
    #    1   2
    #   / \   \
    #  3   4   5
    parents = [-1, 0, 0, 1, 1, 2]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(parents), expected)
    tree = VerifyTree([10, 11, 12, 13, 14, 15], parents, [0, 1, 1, 2, 2, 2])
    assert accept_path(tree, [12, 0, 15, 0, 0, 99]) == [2, 5]  # 12 after 10, 15 after 12
    assert accept_path(tree, [11, 14, 0, 0, 0, 0]) == [1, 4]  # the second child of 1
    assert accept_path(tree, [5, 0, 0, 0, 0, 0]) == []


@pytest.mark.parametrize("steps, topk, draft_tokens", TREE_SHAPES + [(2, 2, 7)])
def test_drafted_trees_are_ancestor_closed_with_n_minus_1_nodes(steps, topk, draft_tokens):
    model = tree_target(vocab_size=300)
    session = Eagle3Tree(random_drafter(model, draft_vocab_size=100, scale=0.3))
    shape = TreeShape(steps, topk, draft_tokens)
    with torch.inference_mode():
        session.extend(torch.randn(1, 9, 3 * 64), torch.randint(0, 300, (9,)).tolist(), start=0)
        tree = session.draft_tree(shape)
    assert len(tree.tokens) == shape.nodes and len(session.slots) == (steps - 1) * topk  # only frontiers are run
    assert set(tree.tokens) <= set(torch.nonzero(session.drafter.t2d).flatten().tolist())  # target ids of the draft vocab
    for depth in range(1, steps + 1):
        for parent in {p for p, d in zip(tree.parents, tree.depths) if d == depth}:
            siblings = [t for t, p, d in zip(tree.tokens, tree.parents, tree.depths) if p == parent and d == depth]
            assert len(siblings) == topk == len(set(siblings))  # the top-K children, distinct
    chosen = select_nodes(tree, draft_tokens - 1)
    assert len(chosen) == draft_tokens - 1 and all(tree.parents[n] in set(chosen) | {-1} for n in chosen)
    best = sorted(tree.scores, reverse=True)[draft_tokens - 2]
    assert all(tree.scores[n] >= best for n in chosen)


def test_drafter_tree_nodes_equal_the_chain_decoding_of_their_path():
    """Each frontier node, run with the tree mask, is what the drafter gives decoding its own path as a chain."""
    model = tree_target(vocab_size=300)
    drafter = random_drafter(model, draft_vocab_size=100)  # default init: outputs of order 1, so 1e-5 is rounding
    aux, ids = torch.randn(1, 7, 3 * 64), torch.randint(0, 300, (7,)).tolist()
    with torch.inference_mode():
        session = Eagle3Tree(drafter)
        session.extend(aux, ids, start=0)
        tree = session.draft_tree(TreeShape(4, 3, 10))
        assert len(session.cache) == 7  # the tree never enters the drafter's cache
        for node in session.slots:
            chain = Eagle3Chain(drafter)
            chain.extend(aux, ids, start=0)
            out = chain.out
            for depth, step in enumerate(tree.path(node), start=1):
                _, out = chain._decode(out, [tree.tokens[step]], chain.last + depth)
            torch.testing.assert_close(session.outs[node], out[0, -1], atol=1e-5, rtol=1e-5)


def test_topk_1_tree_is_the_chain():
    """K = 1, N = S + 1: the same drafts as Eagle3Chain.draft(S), the same tokens and acceptance as the chain decoder."""
    model = tree_target()
    drafter = random_drafter(model, scale=0.2)
    aux, ids = torch.randn(1, 6, 3 * 64), torch.randint(0, 5, (6,)).tolist()
    with torch.inference_mode():
        chain, tree = Eagle3Chain(drafter), Eagle3Tree(drafter)
        chain.extend(aux, ids, 0)
        tree.extend(aux, ids, 0)
        drafted, chained = tree.draft_tree(TreeShape(4, 1, 5)), chain.draft(4)
    assert drafted.tokens == chained and drafted.parents == [-1, 0, 1, 2]
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    for steps in (1, 3, 5):
        reference = speculative_decode(model, drafter, prompt, 60, set(), draft_tokens=steps)
        result = tree_speculative_decode(model, drafter, prompt, 60, set(), steps=steps, topk=1, draft_tokens=steps + 1)
        assert result.tokens == reference.tokens == greedy_decode(model, prompt, 60, set()).tokens
        assert result.acceptance_lengths == reference.acceptance_lengths and max(result.acceptance_lengths) > 1
        assert result.accepted_per_position == reference.accepted_per_position


# --------------------------------------------------------------------------- verification on the target


def test_tree_verify_equals_a_causal_forward_of_each_path_and_keeps_only_the_accepted_one():
    model = tree_target(vocab_size=300)
    prompt = torch.randint(0, 300, (10,)).tolist()
    tree = VerifyTree([5, 17, 23, 40, 41, 42], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])
    with torch.inference_mode():
        verifier = TreeVerifier(model, default_aux_layer_ids(8))
        verifier.prefill(prompt)
        predicted, aux = verifier.verify_tree(tree, len(prompt))
        for row in range(6):
            path = [r for r in range(6) if tree_mask(tree.parents)[row, r]]
            out = model(torch.tensor([prompt + [tree.tokens[r] for r in path]]), output_hidden_states=True)
            assert predicted[row] == int(out.logits[0, -1].argmax())
            torch.testing.assert_close(aux[0, row], verifier._aux(out)[0, -1], atol=1e-4, rtol=1e-4)  # activations of order 10
        verifier.keep_rows(len(prompt), [0, 2, 5])  # a path off the first branch: rows are not contiguous
        assert verifier.cache.get_seq_length() == len(prompt) + 3
        following = [tree.tokens[r] for r in (0, 2, 5)]
        expected = model(torch.tensor([prompt + following + [7]])).logits[0, -1]
        got = model(torch.tensor([[7]]), **{cache_keyword(model): verifier.cache}).logits[0, -1]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- lossless decoding, tiny targets


@pytest.mark.parametrize("steps, topk, draft_tokens", TREE_SHAPES)
def test_random_eagle3_drafter_trees_are_lossless_on_tiny_targets(steps, topk, draft_tokens):
    for vocab_size, draft_vocab_size in ((5, None), (300, 100)):
        model = tree_target(vocab_size)
        drafter = random_drafter(model, draft_vocab_size, scale=0.2)
        prompt = torch.randint(0, vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
        expected = greedy_decode(model, prompt, 50, set()).tokens
        result = tree_speculative_decode(model, drafter, prompt, 50, set(), steps, topk, draft_tokens)
        check_tree_result(result, expected, steps)
        if vocab_size == 5:
            assert max(result.acceptance_lengths) >= 3  # trees over a tiny vocabulary do get accepted


@pytest.mark.parametrize("steps, topk, draft_tokens", TREE_SHAPES)
def test_partly_right_drafter_accepts_off_the_first_branch_and_stays_lossless(steps, topk, draft_tokens):
    """The target's token at rank 0..K-1 or outside the top-K: accepted paths leave the first branch, caches are gathered."""
    model = tree_target(vocab_size=300)
    prompt = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = greedy_decode(model, prompt, 60 + steps + 2, set()).tokens
    coin = random.Random(steps)
    ranks = {index: coin.choice([*range(topk), None]) for index in range(200)}
    session = scripted(model, prompt, greedy, rank=ranks.__getitem__)
    result = tree_speculative_decode(model, session, prompt, 60, set(), steps, topk, draft_tokens)
    check_tree_result(result, greedy[:60], steps)
    assert any(length > 1 for length in result.acceptance_lengths) and any(length == 1 for length in result.acceptance_lengths)
    # The drafter was fed each accepted position once, in order, with the token after it.
    sequence = prompt + greedy
    next_ids = [token for _, ids, _ in session.calls for token in ids]
    assert next_ids == sequence[1 : 1 + len(next_ids)]
    assert sum(aux.shape[1] for aux, _, _ in session.calls) == len(next_ids)


@pytest.mark.parametrize("steps, topk, draft_tokens", TREE_SHAPES)
def test_right_drafter_is_accepted_to_full_depth_every_round(steps, topk, draft_tokens):
    model = tree_target(vocab_size=300)
    prompt = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    max_new = 1 + 4 * (steps + 1)  # the prefill's token, then four full rounds
    greedy = greedy_decode(model, prompt, max_new + steps + 2, set()).tokens
    result = tree_speculative_decode(model, scripted(model, prompt, greedy), prompt, max_new, set(), steps, topk, draft_tokens)
    assert result.tokens == greedy[:max_new]
    assert result.acceptance_lengths == [steps + 1] * 4 and result.accepted_per_position == [4] * steps
    assert result.target_forwards == 5


def test_stop_tokens_and_budget_are_respected_like_greedy():
    model = tree_target(vocab_size=300)
    prompt = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    answer = greedy_decode(model, prompt, 40, set()).tokens
    stop_at = next(i for i in range(4, len(answer)) if answer[i] not in answer[:i])
    stop = {answer[stop_at]}
    expected = greedy_decode(model, prompt, 30, stop).tokens
    assert expected == answer[: stop_at + 1]
    for session in (scripted(model, prompt, answer), random_drafter(model, 100)):
        assert tree_speculative_decode(model, session, prompt, 30, stop, 5, 4, 8).tokens == expected
    for max_new in (1, 2, 7):
        spec = tree_speculative_decode(model, scripted(model, prompt, answer), prompt, max_new, set(), 5, 4, 8)
        assert spec.tokens == answer[:max_new] and sum(spec.acceptance_lengths) == max_new - 1


# --------------------------------------------------------------------------- the real default target (float32)


QUESTIONS = ["Write a Python function that reverses a string.", "What is the capital of France?"]


def test_trees_are_lossless_on_the_default_target(target):
    model, tokenizer = target
    stop_ids, max_new = {tokenizer.eos_token_id}, 16
    drafter = random_drafter(model, draft_vocab_size=4096, seed=0)
    for question in QUESTIONS:
        text = render(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        greedy = greedy_decode(model, prompt, max_new + 8, stop_ids).tokens
        expected = greedy[:max_new]
        check_tree_result(tree_speculative_decode(model, drafter, prompt, max_new, stop_ids, 5, 4, 8), expected, 5)
        coin = random.Random(8)
        ranks = {index: coin.choices([0, 1, 2, 3, None], weights=[4, 2, 1, 1, 1])[0] for index in range(1000)}
        partly = tree_speculative_decode(model, scripted(model, prompt, greedy, ranks.__getitem__), prompt, max_new, stop_ids, 5, 4, 8)
        check_tree_result(partly, expected, 5)
        assert max(partly.acceptance_lengths) > 2
        right = tree_speculative_decode(model, scripted(model, prompt, greedy), prompt, max_new, stop_ids, 5, 4, 8)
        check_tree_result(right, expected, 5)
        assert right.acceptance_lengths[:-1] == [6] * (right.rounds - 1)  # full depth but where the answer ends
