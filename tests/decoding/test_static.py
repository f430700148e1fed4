"""The static-cache decoder: same logits, same greedy tokens and lossless speculation as transformers' decode."""

from __future__ import annotations

import pytest
import torch
from factories import random_target_drafter, six_layer_target, wide_drafter

from eyrie.decoding.decode import greedy_decode, speculative_decode
from eyrie.decoding.static import StaticLlama, llama_reason, open_decoder, unsupported_reason
from eyrie.decoding.static_common import UnsupportedTargetError, needed_capacity
from eyrie.decoding.static_drafter import MergedProducts
from eyrie.decoding.static_modules import StaticModules
from eyrie.decoding.transformers_path import Eagle3Chain
from eyrie.target.aux_layers import capture_indices
from eyrie.target.chat_template import render

MAX_NEW = 20
QUESTIONS = ["Write a Python function that reverses a string.", "What is the capital of France?"]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


class RecordingChain(Eagle3Chain):
    """transformers' path with the real drafter, keeping each round's drafts."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.drafted = []

    def draft(self, k):
        drafts = super().draft(k)
        self.drafted.append(drafts)
        return drafts


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_static_forward_logits_equal_transformers(kind):
    """Prefill, then decode steps one and three tokens at a time: each equals the full forward (GQA, biases for qwen2)."""
    changes = {"sliding_window": None} if kind == "mistral" else {}
    model = six_layer_target(kind, **changes)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    engine = StaticLlama(model, capacity=40, cuda_graphs=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.inference_mode():
        expected = model(ids).logits  # (1, 24, V)
        prefill = engine.logits(ids[:, :16], torch.arange(16))
        one = engine.logits(ids[:, 16:17], torch.tensor([16]))
        three = engine.logits(ids[:, 17:20], torch.arange(17, 20))
        # Rejected slots 20..22 hold other tokens' K/V; rewriting from 20 must not see them.
        engine.logits(torch.randint(0, model.config.vocab_size, (1, 3)), torch.arange(20, 23))
        rewritten = engine.logits(ids[:, 20:24], torch.arange(20, 24))
    got = torch.cat([prefill, one, three, rewritten], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_and_aux_states_match_transformers():
    model = six_layer_target("llama", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    engine = StaticLlama(model, capacity=32, cuda_graphs=False)
    ids = torch.randint(0, 300, (1, 12))
    aux_layer_ids = [0, 2, 3]
    with torch.inference_mode():
        states = model(ids, output_hidden_states=True).hidden_states
        predicted, aux = engine.predict(ids, torch.arange(12), aux_layers=tuple(aux_layer_ids))
        logits = model(ids).logits
    expected = torch.cat([states[i] for i in capture_indices(aux_layer_ids, 6)], dim=-1)
    torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)
    assert predicted.tolist() == logits.argmax(-1).tolist()


# --------------------------------------------------------------------------- speculative, tiny target


@pytest.mark.parametrize("k", [1, 3, 5])
def test_static_rounds_draft_exactly_like_the_eagle3_chain(k):
    """Round by round the same drafts and accepts as transformers' path with Eagle3Chain, and greedy's tokens."""
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)  # a tiny vocabulary: drafts often agree
    drafter = wide_drafter(model)
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    prompt, max_new = torch.randint(0, 5, (12,)).tolist(), 60
    greedy = greedy_decode(model, prompt, max_new, set()).tokens
    chain = RecordingChain(drafter)
    reference = speculative_decode(model, chain, prompt, max_new, set(), draft_tokens=k)
    static = speculative_decode(engine, drafter, prompt, max_new, set(), draft_tokens=k)
    static_drafter = engine.drafter_for(drafter)
    assert static.tokens == reference.tokens == greedy
    assert static_drafter.drafted == chain.drafted
    assert static.acceptance_lengths == reference.acceptance_lengths
    assert static.accepted_per_position == reference.accepted_per_position
    assert static.target_forwards == static.rounds + 1
    if k > 1:  # partial accepts happened, so padded extends of several sizes were exercised
        assert len({length for length in static.acceptance_lengths}) >= 2 and max(static.acceptance_lengths) > 1


def matrix_products(function, *args):
    """(function's result, how many aten matrix products it ran)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        products = 0

        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            Count.products += op.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm)
            return op(*args, **(kwargs or {}))

    with Count():
        result = function(*args)
    return result, Count.products


def test_merged_products_compute_the_drafter_layers_values_in_fewer_products():
    """q, k, v in one product and gate, up in another: the drafter's own values (float32) in 1 + 2 products, not 3 + 3."""
    drafter = wide_drafter(six_layer_target())
    merged = MergedProducts(drafter)
    hidden, x = torch.randn(1, 5, 64), torch.randn(1, 5, 128)
    cos, sin = drafter.rotary(x, torch.arange(5)[None])
    separate, separate_count = matrix_products(drafter.midlayer.self_attn.project, x, cos, sin)
    together, together_count = matrix_products(merged.project, x, cos, sin)
    assert (separate_count, together_count) == (3, 1)
    for a, b in zip(separate, together):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    attended = torch.randn(1, 5, 64)
    separate, separate_count = matrix_products(drafter.layer_output, hidden, attended)
    together, together_count = matrix_products(merged.layer_output, hidden, attended)
    assert (separate_count, together_count) == (3, 2)
    torch.testing.assert_close(together, separate, rtol=1e-6, atol=1e-6)


def test_spans_double_from_the_smallest_and_end_at_the_capacity():
    from eyrie.decoding.static_common import span_for, spans_up_to

    assert spans_up_to(64) == [64] and spans_up_to(256) == [256] and spans_up_to(1344) == [256, 512, 1024, 1344]
    assert [span_for(n, 1344) for n in (1, 256, 257, 1024, 1025, 1344)] == [256, 256, 512, 1024, 1344, 1344]
    with pytest.raises(ValueError, match="holds 1344"):
        span_for(1345, 1344)


def test_decoding_across_attention_spans_equals_transformers():
    """A decode that grows from the 256-slot span through 512 into 1024 keeps greedy's tokens and the chain's drafts."""
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    drafter = wide_drafter(model)
    engine = StaticLlama(model, capacity=1024, cuda_graphs=False)
    prompt, max_new = torch.randint(0, 5, (250,), generator=torch.Generator().manual_seed(2)).tolist(), 300
    greedy = greedy_decode(model, prompt, max_new, set()).tokens
    assert greedy_decode(engine, prompt, max_new, set()).tokens == greedy
    chain = RecordingChain(drafter)
    reference = speculative_decode(model, chain, prompt, max_new, set(), draft_tokens=3)
    static = speculative_decode(engine, drafter, prompt, max_new, set(), draft_tokens=3)
    assert static.tokens == reference.tokens == greedy
    assert engine.drafter_for(drafter).drafted == chain.drafted
    assert static.acceptance_lengths == reference.acceptance_lengths


def test_static_greedy_stops_at_stop_tokens_and_budget():
    model = six_layer_target("llama")
    engine = StaticLlama(model, capacity=16, cuda_graphs=False)  # too small: grows on demand
    prompt = torch.randint(0, 300, (10,)).tolist()
    expected = greedy_decode(model, prompt, 30, set()).tokens
    assert greedy_decode(engine, prompt, 30, set()).tokens == expected
    assert engine.capacity >= needed_capacity(10, 30)
    stop = {expected[7]}
    cut = expected[: expected.index(expected[7]) + 1]
    assert greedy_decode(engine, prompt, 30, stop).tokens == cut
    drafter = wide_drafter(model)
    assert speculative_decode(engine, drafter, prompt, 30, stop, draft_tokens=4).tokens == cut
    for max_new in (1, 2, 7):
        assert speculative_decode(engine, drafter, prompt, max_new, set(), draft_tokens=5).tokens == expected[:max_new]


class RightSession:
    """Drafter double that knows the greedy continuation: every draft is accepted."""

    def __init__(self, aux_layer_ids, sequence):
        self.aux_layer_ids, self.sequence, self.calls = aux_layer_ids, sequence, []

    def extend(self, aux_hidden, next_ids, start):
        self.calls.append((aux_hidden.clone(), list(next_ids), start))
        self.first_draft = start + len(next_ids) + 1

    def draft(self, k):
        return self.sequence[self.first_draft : self.first_draft + k]


def test_drafter_session_double_on_the_static_target_gets_every_feature_once():
    model = six_layer_target("llama")
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    prompt = torch.randint(0, 300, (9,)).tolist()
    greedy = greedy_decode(model, prompt, 40, set()).tokens
    k, max_new = 3, 1 + 4 * 4
    session = RightSession([0, 2, 3], prompt + greedy)
    result = speculative_decode(engine, session, prompt, max_new, set(), draft_tokens=k)
    assert result.tokens == greedy[:max_new]
    assert result.acceptance_lengths == [k + 1] * 4 and result.accepted_per_position == [4] * k
    fed = torch.cat([aux for aux, _, _ in session.calls], dim=1)[0]
    sequence = prompt + result.tokens
    with torch.inference_mode():
        states = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0, : len(fed)] for i in capture_indices([0, 2, 3], 6)], dim=-1)
    torch.testing.assert_close(fed, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- support


def test_targets_pick_their_static_engine_and_unsupported_ones_fall_back_with_the_reason():
    qwen3 = six_layer_target("qwen3")  # qk-norm: not Llama's layer, so the target's own modules run on the static cache
    assert "qwen3" in llama_reason(qwen3) and unsupported_reason(qwen3) is None
    engine, label, reason = open_decoder(qwen3, "auto", capacity=32)
    assert isinstance(engine, StaticModules) and label.startswith("static-modules") and reason is None
    sliding = six_layer_target("mistral", sliding_window=16)
    assert "sliding" in llama_reason(sliding) and isinstance(open_decoder(sliding, "static", capacity=32)[0], StaticModules)
    dynamic = six_layer_target("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "dynamic" in unsupported_reason(dynamic)
    engine, label, reason = open_decoder(dynamic, "auto", capacity=32)
    assert engine is dynamic and label == "transformers" and "dynamic" in reason
    with pytest.raises(UnsupportedTargetError, match="dynamic"):
        open_decoder(dynamic, "static", capacity=32)
    llama = six_layer_target("llama")
    engine, label, reason = open_decoder(llama, "auto", capacity=32)
    assert type(engine) is StaticLlama and label == ("static-cudagraph" if torch.cuda.is_available() else "static") and reason is None
    assert open_decoder(llama, "transformers", capacity=32)[:2] == (llama, "transformers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_equal_eager_runs():
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2).cuda()
    drafter = wide_drafter(model).cuda()
    prompt = torch.randint(0, 5, (12,)).tolist()
    eager, graphed = StaticLlama(model, 64, cuda_graphs=False), StaticLlama(model, 64, cuda_graphs=True)
    assert greedy_decode(graphed, prompt, 40, set()).tokens == greedy_decode(eager, prompt, 40, set()).tokens
    for k in (1, 4):
        a = speculative_decode(eager, drafter, prompt, 40, set(), k)
        b = speculative_decode(graphed, drafter, prompt, 40, set(), k)
        assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths


def test_compiled_steps_decode_exactly_like_eager_steps():
    """compile fuses each step's kernels (inductor): the same greedy tokens and the same speculative rounds."""
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    drafter = wide_drafter(model)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    eager, fused = StaticLlama(model, 64, cuda_graphs=False), StaticLlama(model, 64, cuda_graphs=False, compile=True)
    assert fused.label == "static-compiled"
    assert greedy_decode(fused, prompt, 30, set()).tokens == greedy_decode(eager, prompt, 30, set()).tokens
    a = speculative_decode(eager, drafter, prompt, 30, set(), 3)
    b = speculative_decode(fused, drafter, prompt, 30, set(), 3)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths


def test_compiling_costs_two_small_graphs_per_step_width_whatever_the_spans_layers_and_draft_lengths():
    """Fusion is per layer: every layer, attention span and draft length shares the target's two compiled pieces of
    its step width (tokens per forward), and its head one more; the drafter's pieces are one per step width too (the
    extend, a draft step with its cache write, attending over its whole cache). Whole-step compiles cost one graph of
    all layers per span and
    draft length: minutes per benchmark job on an H200. Alternating draft lengths prompt by prompt (a sweep) replays
    rounds instead of capturing again."""
    import torch._dynamo

    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    drafter = wide_drafter(model)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fused = StaticLlama(model, 600, cuda_graphs=False, compile=True)  # spans 256, 512, 576: each replayed once in warm-up
    eager = StaticLlama(model, 600, cuda_graphs=False)
    assert greedy_decode(fused, prompt, 20, set()).tokens == greedy_decode(eager, prompt, 20, set()).tokens
    rounds = {}
    for k in (2, 3, 2, 3):
        a, b = speculative_decode(eager, drafter, prompt, 20, set(), k), speculative_decode(fused, drafter, prompt, 20, set(), k)
        assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
        chain = fused.drafter_for(drafter).rounds[k]
        assert rounds.setdefault(k, chain) is chain  # kept, not captured again
    widths = {1, 3, 4}  # greedy steps; verifies of k + 1 tokens
    # The target: project, finish and head per width. The drafter: the extend per k + 1, one draft step, its head's
    # token; each chain length's accept.
    assert fused.drafter_for(drafter).fusion_failure is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3 * len(widths) + 2 + 1 + 1 + 2


def test_every_step_width_of_a_sweep_runs_compiled():
    """A sweep feeds the drafter's pieces many widths (1, each chain's k + 1, each tree's K and S + 1): more than
    dynamo's default of 8 compiles per function, past which it runs a piece unfused without a word (an H200
    sweep did). The engine raises the limit, so each width gets its compiled graph."""
    import torch._dynamo

    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    widths = range(1, 11)
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default, whatever an earlier test left; restored after
        eagle = StaticLlama(model, 64, cuda_graphs=False, compile=True).drafter_for(wide_drafter(model))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with torch.inference_mode():
            for width in widths:
                eagle._fused["_token"](torch.randn(1, width, model.config.hidden_size))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(widths)


def test_a_drafter_piece_that_fails_to_compile_runs_eagerly_and_says_why():
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    drafter = wide_drafter(model)
    prompt = [1, 2, 3, 4, 0, 1]
    fused, eager = StaticLlama(model, 64, cuda_graphs=False, compile=True), StaticLlama(model, 64, cuda_graphs=False)
    eagle = fused.drafter_for(drafter)

    def broken(*args):
        raise RuntimeError("inductor could not lower this\nlong trace")

    eagle._fused["_draft_step"] = broken
    a, b = speculative_decode(eager, drafter, prompt, 16, set(), 3), speculative_decode(fused, drafter, prompt, 16, set(), 3)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert eagle.fusion_failure == "_draft_step: RuntimeError: inductor could not lower this"


def test_compile_auto_fuses_on_cuda_only():
    llama = six_layer_target("llama")
    assert open_decoder(llama, "auto", capacity=32, compile="auto")[1] == "static"  # a CPU target: nothing to fuse for
    assert open_decoder(llama, "auto", capacity=32, compile=True)[1] == "static-compiled"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_compiled_cuda_graph_replays_equal_eager_runs():
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2).cuda()
    drafter = wide_drafter(model).cuda()
    prompt = torch.randint(0, 5, (12,)).tolist()
    eager, fused = StaticLlama(model, 64, cuda_graphs=False), StaticLlama(model, 64, cuda_graphs=True, compile=True)
    assert greedy_decode(fused, prompt, 40, set()).tokens == greedy_decode(eager, prompt, 40, set()).tokens
    a = speculative_decode(eager, drafter, prompt, 40, set(), 4)
    b = speculative_decode(fused, drafter, prompt, 40, set(), 4)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert fused.label == "static-cudagraph-compiled" and not fused.capture_failures


# --------------------------------------------------------------------------- the real target


@pytest.fixture(scope="module")
def prompts(target):
    _, tokenizer = target
    rendered = [render(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]


def test_static_decoder_on_the_default_target_is_greedy_and_lossless(target, prompts):
    model, tokenizer = target
    stop_ids = {tokenizer.eos_token_id}
    engine = StaticLlama(model, capacity=needed_capacity(max(map(len, prompts)), MAX_NEW, 5), cuda_graphs=False)
    drafter = random_target_drafter(model)
    for prompt in prompts:
        expected = greedy_decode(model, prompt, MAX_NEW, stop_ids).tokens
        assert greedy_decode(engine, prompt, MAX_NEW, stop_ids).tokens == expected
        for k in (1, 3, 5):
            result = speculative_decode(engine, drafter, prompt, MAX_NEW, stop_ids, draft_tokens=k)
            assert result.tokens == expected
            assert sum(result.acceptance_lengths) == len(result.tokens) - 1


# --------------------------------------------------------------------------- batched greedy (regeneration)


def padded_generate(model, prompts, max_new, stop_ids, pad=0):
    """transformers' left-padded greedy generate(), each row cut after its first stop token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    rows = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=sorted(stop_ids) or None, pad_token_id=pad)[:, width:].tolist()
    return [cut_at_stop(row, stop_ids) for row in rows]


def cut_at_stop(row, stop_ids):
    return next((row[: i + 1] for i, token in enumerate(row) if token in stop_ids), row)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_greedy_equals_left_padded_generate(kind, monkeypatch):
    """Rows of different lengths (one a single token), stop tokens, chunked prefill, then a smaller batch on the same cache."""
    import eyrie.decoding.batched_greedy as static_generate

    model = six_layer_target(kind, vocab_size=50, initializer_range=0.2)
    torch.manual_seed(3)
    prompts = [torch.randint(1, 50, (n,)).tolist() for n in (5, 17, 1, 30, 9)]
    stop = {7}
    expected = padded_generate(model, prompts, 40, stop)
    assert {len(r) for r in expected} != {40}, "some rows must stop early for the test to mean something"
    loop = static_generate.BatchedGreedy(model, 0, stop, cuda_graphs=False)
    assert [cut_at_stop(r, stop) for r in loop.generate(prompts, 40)] == expected
    assert [cut_at_stop(r, stop) for r in loop.generate(prompts[3:], 40)] == expected[3:]
    monkeypatch.setattr(static_generate, "PREFILL_TOKENS", 40)  # one row per prefill chunk
    chunked = static_generate.BatchedGreedy(model, 0, stop, cuda_graphs=False).generate(prompts, 40)
    assert [cut_at_stop(r, stop) for r in chunked] == expected


def test_batched_greedy_across_attention_spans_and_early_exit():
    """Rows growing from the 256-slot span into 512; a batch whose rows all stop returns before the budget."""
    from eyrie.decoding.batched_greedy import CHECK_EVERY, BatchedGreedy

    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 5, (n,), generator=generator).tolist() for n in (240, 100)]
    loop = BatchedGreedy(model, 0, set(), cuda_graphs=False)
    assert loop.generate(prompts, 60) == padded_generate(model, prompts, 60, set())
    stops = {token for row in padded_generate(model, prompts, 3, set()) for token in row[:2]}
    rows = loop.generate(prompts, 200)  # no stop ids: full length
    early = BatchedGreedy(model, 0, stops, cuda_graphs=False).generate(prompts, 200)
    assert len(rows[0]) == 200 and len(early[0]) <= CHECK_EVERY
    assert [cut_at_stop(r, stops) for r in early] == padded_generate(model, prompts, 200, stops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_batched_greedy_graph_replays_equal_eager_runs():
    from eyrie.decoding.batched_greedy import BatchedGreedy

    model = six_layer_target("llama", vocab_size=50, initializer_range=0.2).cuda()
    prompts = [torch.randint(1, 50, (n,)).tolist() for n in (5, 300, 1, 30)]
    eager = BatchedGreedy(model, 0, {7}, cuda_graphs=False).generate(prompts, 60)
    assert BatchedGreedy(model, 0, {7}, cuda_graphs=True).generate(prompts, 60) == eager
