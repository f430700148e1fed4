"""Prompt-lookup drafting: the lookup itself, a history in step with the rounds, and lossless decoding on both decoders."""

from __future__ import annotations

import pytest
import torch
from factories import tiny_llama

from eyrie.decoding.decode import greedy_decode, speculative_decode
from eyrie.decoding.ngram import NgramDecoder, NgramSession, lookup, lookup_runs
from eyrie.decoding.static import StaticLlama
from eyrie.target.aux_layers import AuxLayerError, default_aux_layer_ids
from eyrie.target.chat_template import render

MAX_NEW = 24
QUESTIONS = ["Write a Python function that reverses a string.", "What is the capital of France?"]
COPY_REQUEST = "Copy the following text exactly:\nThe cat sat on the mat. The dog sat on the log."


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


class RecordingSession(NgramSession):
    """An NgramSession that keeps what it knew and what it proposed at each draft."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.known, self.drafted = [], []

    def draft(self, k):
        self.known.append(list(self.next_ids))
        self.drafted.append(super().draft(k))
        return self.drafted[-1]


def engine(model, decoder: str):
    return StaticLlama(model, cuda_graphs=False) if decoder == "static" else model


def encode(tokenizer, question: str) -> list[int]:
    return tokenizer(render(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True), add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- the lookup


def test_lookup_proposes_what_followed_the_most_recent_match():
    #           0  1  2  3  4  5  6  7  8
    sequence = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert lookup(sequence, 2) == [5, 6]  # [1, 2] also occurs at 0, followed by 3, 4: the later one wins


def test_lookup_tries_the_longest_ngram_first():
    # The last token 3 most recently follows 9 (-> 7), but the trigram [1, 2, 3] occurred earlier (-> 4).
    sequence = [1, 2, 3, 4, 9, 3, 7, 1, 2, 3]
    assert lookup(sequence, 1) == [4]
    assert lookup(sequence, 1, max_ngram=1) == [7]


def test_lookup_without_a_match_is_none_and_the_session_repeats_the_last_token():
    assert lookup([5, 6, 7, 8], 3) is None
    assert lookup([5], 3) is None
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], 2, min_ngram=3) is None  # only bigrams recur
    session = NgramSession(8)
    session.extend(None, [5, 6, 7, 8], 0)
    assert session.draft(3) == [8, 8, 8]


def test_lookup_copies_on_into_its_own_proposals():
    # The match ends right before the present: a loop of period 2 is proposed for all k tokens.
    assert lookup([9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert lookup([4, 4], 3) == [4, 4, 4]


def test_session_history_follows_extend_start():
    session = NgramSession(8)
    session.extend(None, [10, 11, 12], 0)  # tokens after positions 0, 1, 2
    session.extend(None, [13, 14, 15], 3)  # a round: current token and two accepted drafts
    assert session.next_ids == [10, 11, 12, 13, 14, 15]
    session.extend(None, [20, 21], 4)  # the round from position 4 replaces what followed it
    assert session.next_ids == [10, 11, 12, 13, 20, 21]
    with pytest.raises(ValueError, match="from position 9"):
        session.extend(None, [1], 9)  # a gap: the session would draft from a sequence it does not have


def test_session_aux_layer_ids_are_valid_for_the_target():
    assert NgramSession(30).aux_layer_ids == default_aux_layer_ids(30)
    assert NgramSession(8, aux_layer_ids=[0, 2, 5]).aux_layer_ids == [0, 2, 5]
    with pytest.raises(AuxLayerError):
        NgramSession(8, aux_layer_ids=[0, 2, 7])  # layer 7's output is the final state, not an aux one
    with pytest.raises(ValueError, match="min_ngram"):
        NgramSession(8, max_ngram=1, min_ngram=2)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("decoder", ["transformers", "static"])
def test_ngram_is_lossless_on_tiny_random_targets(decoder):
    accepted = 0
    for vocab_size, seed in ((40, 0), (300, 1)):
        model = tiny_llama(vocab=vocab_size, seed=seed, positions=256)
        target = engine(model, decoder)
        generator = torch.Generator().manual_seed(seed)
        for prompt_length, stop_ids in ((5, set()), (30, {3, 7})):
            prompt = torch.randint(vocab_size, (prompt_length,), generator=generator).tolist()
            greedy = greedy_decode(target, prompt, MAX_NEW, stop_ids)
            for k in (1, 3, 5):
                session = RecordingSession(model.config.num_hidden_layers)
                result = speculative_decode(target, session, prompt, MAX_NEW, stop_ids, k)
                assert result.tokens == greedy.tokens, (vocab_size, prompt_length, k)
                assert result.target_forwards == result.rounds + 1 and sum(result.acceptance_lengths) == len(result.tokens) - 1
                # The history in every round: the prompt after position 0 and every token emitted so far.
                for i, known in enumerate(session.known):
                    assert known == (prompt[1:] + result.tokens)[: len(known)]
                    assert len(known) == len(prompt) + sum(result.acceptance_lengths[:i])
                accepted += sum(result.accepted_per_position)
    assert accepted > 0  # the random targets loop, so lookup has something to match


@pytest.fixture(scope="module")
def default_prompts(target):
    _, tokenizer = target
    return [encode(tokenizer, q) for q in QUESTIONS]


@pytest.mark.parametrize("decoder", ["transformers", "static"])
def test_ngram_is_lossless_on_the_default_target(target, default_prompts, decoder):
    model, tokenizer = target
    stop_ids = {tokenizer.eos_token_id}
    decode_on = engine(model, decoder)
    for prompt in default_prompts:
        greedy = greedy_decode(decode_on, prompt, MAX_NEW, stop_ids)
        result = speculative_decode(decode_on, NgramSession(model.config.num_hidden_layers), prompt, MAX_NEW, stop_ids, 4)
        assert result.tokens == greedy.tokens
        assert all(1 <= length <= 5 for length in result.acceptance_lengths)
        timed = NgramDecoder(decode_on).decode(prompt, MAX_NEW, stop_ids, 4)  # what the benchmark times
        assert timed.tokens == greedy.tokens and timed.acceptance_lengths == result.acceptance_lengths


@pytest.mark.parametrize("decoder", ["transformers", "static"])
def test_ngram_accepts_several_tokens_per_round_when_the_reply_copies_the_prompt(target, decoder):
    model, tokenizer = target
    stop_ids = {tokenizer.eos_token_id}
    prompt = encode(tokenizer, COPY_REQUEST)
    decode_on = engine(model, decoder)
    greedy = greedy_decode(decode_on, prompt, MAX_NEW, stop_ids)
    result = NgramDecoder(decode_on).decode(prompt, MAX_NEW, stop_ids, 4)
    assert result.tokens == greedy.tokens
    mean = sum(result.acceptance_lengths) / result.rounds
    assert mean > 2.0, f"prompt lookup accepted {mean:.2f} tokens per round on a copy of the prompt"
    assert result.target_forwards < greedy.forwards / 2


def test_ngram_decoder_on_the_static_cache_rounds_exactly_like_the_session():
    """NgramDecoder's verify (static buffers, one replay per round on CUDA) against the host-driven rounds, across k and a growing cache."""
    model = tiny_llama(vocab=40, seed=0, positions=256)
    static = StaticLlama(model, capacity=64, cuda_graphs=False)
    decoder = NgramDecoder(static)
    generator = torch.Generator().manual_seed(2)
    for prompt_length, max_new, k in ((6, 20, 3), (6, 20, 5), (200, 100, 5)):  # the last grows the cache past 256: new spans
        prompt = torch.randint(40, (prompt_length,), generator=generator).tolist()
        greedy = greedy_decode(static, prompt, max_new, {5})
        rounds = speculative_decode(static, NgramSession(8), prompt, max_new, {5}, k)
        timed = decoder.decode(prompt, max_new, {5}, k)
        assert timed.tokens == rounds.tokens == greedy.tokens
        assert timed.acceptance_lengths == rounds.acceptance_lengths and timed.accepted_per_position == rounds.accepted_per_position
        assert decoder.verifier.k == k and decoder.verifier.keys is static.keys
    assert static.capacity > 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_ngram_graph_replays_equal_eager_runs():
    model = tiny_llama(vocab=40, seed=0, positions=256).cuda()
    prompt = torch.randint(40, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    eager, graphed = StaticLlama(model, 64, cuda_graphs=False), StaticLlama(model, 64, cuda_graphs=True)
    for k in (1, 4):
        a = NgramDecoder(eager).decode(prompt, 60, set(), k)
        b = NgramDecoder(graphed).decode(prompt, 60, set(), k)
        assert a.tokens == b.tokens == greedy_decode(eager, prompt, 60, set()).tokens
        assert a.acceptance_lengths == b.acceptance_lengths and sum(b.accepted_per_position) > 0
    assert graphed.label == "static-cudagraph"


@pytest.mark.parametrize("vocab, length, seed", [(2, 60, 0), (3, 80, 1), (5, 120, 2), (50, 200, 3)])
def test_lookup_runs_equal_lookup_at_every_position(vocab, length, seed):
    """The one-pass runs match what `lookup` proposes at each position, loops that copy their own proposals included."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
    tokens += tokens[-7:] * 4  # a loop of period 7: proposals run past the present
    for k in (1, 4, 8):
        runs = lookup_runs(tokens, k)
        for e in range(len(tokens)):
            proposed = lookup(tokens[: e + 1], k) or []
            expected = 0
            for guess, truth in zip(proposed, tokens[e + 1 :]):
                if guess != truth:
                    break
                expected += 1
            assert runs[e] == expected, (k, e)
