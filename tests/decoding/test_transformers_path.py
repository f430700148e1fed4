"""Speculative decoding against the real target: lossless, honest acceptance counts, same stopping as greedy."""

from __future__ import annotations

import random

import pytest
import torch
from factories import llama_config

from eyrie.decoding.transformers_path import Eagle3Chain, greedy_decode, speculative_decode
from eyrie.drafter.model import DraftCache, DrafterShape, Eagle3Drafter
from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids
from eyrie.target.chat_template import render

MAX_NEW = 24
QUESTIONS = [
    "Write a Python function that reverses a string.",  # long answer: runs to the budget
    "What is the capital of France?",  # short answer: ends with EOS well inside the budget
    "Name a colour.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def prompts(target):
    _, tokenizer = target
    return [
        tokenizer(render(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def stop_ids(target):
    _, tokenizer = target
    return {tokenizer.eos_token_id}


@pytest.fixture(scope="module")
def greedy(target, prompts, stop_ids):
    """Plain greedy output per prompt, with room beyond MAX_NEW for the scripted drafters to look ahead."""
    model, _ = target
    return [greedy_decode(model, p, MAX_NEW + 16, stop_ids).tokens for p in prompts]


def random_drafter(model, draft_vocab_size: int = 4096, seed: int = 0) -> Eagle3Drafter:
    """An untrained EAGLE-3 drafter: random weights, a random draft vocabulary, the target's embeddings."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab_size]).values
    draft_to_target = kept - torch.arange(draft_vocab_size)  # offsets, as SGLang reads d2t
    target_to_draft = torch.zeros(vocab, dtype=torch.bool)
    target_to_draft[kept] = True
    shape = DrafterShape.from_target(model.config, draft_vocab_size, default_aux_layer_ids(model.config.num_hidden_layers))
    return Eagle3Drafter(shape, model.get_input_embeddings().weight, draft_to_target, target_to_draft).eval()


class ScriptedDrafter:
    """Test double: proposes the known greedy continuation, turned wrong wherever `wrong(index)` says so."""

    def __init__(self, aux_layer_ids, sequence, wrong=lambda index: False):
        self.aux_layer_ids, self.sequence, self.wrong = aux_layer_ids, sequence, wrong
        self.calls = []

    def extend(self, aux_hidden, next_ids, start):
        self.calls.append((aux_hidden.clone(), list(next_ids), start))
        self.first_draft = start + len(next_ids) + 1  # features up to p predict the token at p + 2

    def draft(self, k):
        drafts = []
        for index in range(self.first_draft, self.first_draft + k):
            token = self.sequence[index]
            drafts.append(token + 1 if self.wrong(index) else token)
        return drafts


def scripted(model, prompt, continuation, wrong=lambda index: False):
    return ScriptedDrafter(default_aux_layer_ids(model.config.num_hidden_layers), list(prompt) + list(continuation), wrong)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_eagle3_drafter_is_lossless(target, prompts, greedy, stop_ids, k):
    model, _ = target
    drafter = random_drafter(model)
    for prompt, expected in zip(prompts, greedy):
        result = speculative_decode(model, drafter, prompt, MAX_NEW, stop_ids, draft_tokens=k)
        assert result.tokens == expected[:MAX_NEW]
        assert result.target_forwards == result.rounds + 1
        assert sum(result.acceptance_lengths) == len(result.tokens) - 1  # the prefill's token is not a round's
        assert all(1 <= length <= k + 1 for length in result.acceptance_lengths)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_right_drafter_is_accepted_every_round(target, prompts, greedy, stop_ids, k):
    model, _ = target
    max_new = 1 + 4 * (k + 1)  # the prefill's token, then four full rounds
    drafter = scripted(model, prompts[0], greedy[0])
    result = speculative_decode(model, drafter, prompts[0], max_new, stop_ids, draft_tokens=k)
    assert result.tokens == greedy[0][:max_new]
    assert result.acceptance_lengths == [k + 1] * 4
    assert result.target_forwards == 1 + (max_new - 1) // (k + 1)
    assert result.accepted_per_position == [4] * k


def test_wrong_drafter_accepts_nothing(target, prompts, greedy, stop_ids):
    model, _ = target
    drafter = scripted(model, prompts[0], greedy[0], wrong=lambda index: True)
    result = speculative_decode(model, drafter, prompts[0], MAX_NEW, stop_ids, draft_tokens=3)
    assert result.tokens == greedy[0][:MAX_NEW]
    assert sum(result.acceptance_lengths) / result.rounds == 1.0
    assert result.accepted_per_position == [0, 0, 0]
    assert result.target_forwards == MAX_NEW


def test_partly_right_drafter_is_lossless(target, prompts, greedy, stop_ids):
    model, _ = target
    coin = random.Random(1)
    wrong = {index: coin.random() < 0.4 for index in range(1000)}
    drafter = scripted(model, prompts[0], greedy[0], wrong=wrong.__getitem__)
    result = speculative_decode(model, drafter, prompts[0], MAX_NEW, stop_ids, draft_tokens=4)
    assert result.tokens == greedy[0][:MAX_NEW]
    assert any(1 < length < 5 for length in result.acceptance_lengths)  # partial accepts did happen


def test_drafter_gets_the_aux_features_of_every_position_once(target, prompts, greedy, stop_ids):
    """Fused features at p = cat(hidden_states[i + 1][p] for i in aux_layer_ids), with token p + 1 beside them."""
    model, _ = target
    prompt, continuation = prompts[0], greedy[0][:MAX_NEW]
    coin = random.Random(2)
    drafter = scripted(model, prompt, greedy[0], wrong=lambda index: coin.random() < 0.5)
    speculative_decode(model, drafter, prompt, MAX_NEW, stop_ids, draft_tokens=3)
    sequence = list(prompt) + continuation
    starts = [start for _, _, start in drafter.calls]
    fed = torch.cat([aux for aux, _, _ in drafter.calls], dim=1)[0]
    next_ids = [token for _, ids, _ in drafter.calls for token in ids]
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    assert next_ids == sequence[1 : 1 + len(next_ids)]
    with torch.inference_mode():
        states = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    capture = capture_indices(drafter.aux_layer_ids, model.config.num_hidden_layers)
    assert capture == [i + 1 for i in drafter.aux_layer_ids]
    expected = torch.cat([states[i][0, : len(fed)] for i in capture], dim=-1)
    torch.testing.assert_close(fed, expected, atol=2e-4, rtol=1e-4)


def test_stop_token_and_budget_are_respected_like_greedy(target, prompts, greedy, stop_ids):
    model, _ = target
    prompt, long_answer = prompts[0], greedy[0]
    # A stop token in the middle of the answer, crossed by a drafter that is always right.
    stop_at = next(i for i in range(4, len(long_answer)) if long_answer[i] not in long_answer[:i])
    stop = {long_answer[stop_at]}
    expected = greedy_decode(model, prompt, MAX_NEW, stop).tokens
    assert expected == long_answer[: stop_at + 1]
    for drafter in (scripted(model, prompt, long_answer), random_drafter(model)):
        assert speculative_decode(model, drafter, prompt, MAX_NEW, stop, draft_tokens=5).tokens == expected
    # Budgets shorter than one round, and one that ends inside a round.
    for max_new in (1, 2, 7):
        plain = greedy_decode(model, prompt, max_new, stop_ids)
        spec = speculative_decode(model, scripted(model, prompt, long_answer), prompt, max_new, stop_ids, draft_tokens=5)
        assert plain.tokens == spec.tokens == long_answer[:max_new]
        assert sum(spec.acceptance_lengths) == max_new - 1
    # A natural EOS: the short answer ends with it, well inside the budget, in both decoders.
    short = speculative_decode(model, random_drafter(model), prompts[1], MAX_NEW, stop_ids, draft_tokens=3).tokens
    assert short == greedy[1] and short[-1] in stop_ids and len(short) < MAX_NEW


def test_chain_extend_after_drafting_equals_decoding_from_scratch():
    """Cropping the drafts and extending with target features leaves the drafter's cache as if it never drafted."""
    torch.manual_seed(0)
    config = llama_config(hidden=64, layers=8, vocab=300, intermediate=128, positions=128)
    shape = DrafterShape.from_target(config, 100, [1, 3, 4])
    drafter = Eagle3Drafter(shape, torch.randn(300, 64), torch.arange(100) * 2, torch.arange(300) % 2 == 0).eval()
    aux, ids = torch.randn(1, 9, 3 * 64), torch.randint(0, 300, (9,)).tolist()
    with torch.inference_mode():
        chain = Eagle3Chain(drafter)
        chain.extend(aux[:, :6], ids[:6], start=0)
        first = chain.draft(4)
        assert len(chain.cache) == 6 + 3 and all(t % 2 == 0 for t in first)  # draft ids map to even target ids
        chain.extend(aux[:, 6:], ids[6:], start=6)
        full_logits, _ = drafter.decode(drafter.project_aux(aux), torch.tensor([ids]), torch.arange(9)[None], DraftCache())
        torch.testing.assert_close(chain.logits[0, -1], full_logits[0, -1], atol=1e-5, rtol=1e-5)


def test_greedy_baseline_equals_transformers_generate(target, prompts, greedy, stop_ids):
    """The HF-path baseline decodes with its KV cache: its tokens are model.generate's (a cache passed under the
    wrong keyword is silently ignored and every token is decoded without context)."""
    model, _ = target
    for prompt, ours in zip(prompts[:2], greedy):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False, eos_token_id=sorted(stop_ids))
        assert reference[0, len(prompt) :].tolist() == ours[: reference.shape[1] - len(prompt)]


def test_cache_keyword_follows_the_forward_signature():
    from eyrie.decoding.transformers_path import cache_keyword

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs): ...

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    with pytest.raises(TypeError, match="neither"):
        cache_keyword(Neither())
