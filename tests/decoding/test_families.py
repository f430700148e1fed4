"""Every target family on the static engine: greedy equals transformers' own generate, and chain and tree speculation
and regeneration's batched greedy equal greedy, token for token, in float32.

Tiny random targets (hidden 64, 4 layers) with sliding windows of WINDOW tokens, so prompt and generation pass the
window; a random drafter, sharp enough (scale 0.2) that rounds accept and reject drafts."""

from __future__ import annotations

import types

import pytest
import torch
from factories import tiny_family_config, tiny_llama

from eyrie.decoding.batched_greedy import BatchedGreedy, BatchedModules, open_batched_greedy
from eyrie.decoding.decode import greedy_decode, speculative_decode, tree_decode
from eyrie.decoding.static import StaticLlama, open_decoder, open_engine
from eyrie.decoding.static_common import UnsupportedTargetError
from eyrie.decoding.static_modules import StaticModules
from eyrie.decoding.transformers_path import speculative_decode as transformers_speculative_decode
from eyrie.decoding.tree import tree_speculative_decode
from eyrie.drafter.model import DrafterShape, Eagle3Drafter

VOCAB, WINDOW, NEW = 300, 8, 24
FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text", "gemma3", "mistral")  # gemma3: multimodal
PROMPTS = [[5, 17, 33, 8, 91, 12, 7, 44, 3, 250, 19], [9, 4, 120], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]]
TREES = [(3, 2, 5), (4, 3, 8)]  # SGLang's (steps, topk, draft tokens)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


def family_model(family: str):
    if family == "llama":
        return tiny_llama(layers=4, vocab=VOCAB).eval()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_family_config(family, vocab=VOCAB, window=WINDOW)).eval()
    with torch.no_grad():  # random-init norms are all ones (Gemma's all zeros): noise makes a misread norm show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def drafter_for(model, draft_vocab: int = 100) -> Eagle3Drafter:
    torch.manual_seed(1)
    vocab = model.get_input_embeddings().num_embeddings
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    target_to_draft = torch.zeros(vocab, dtype=torch.bool)
    target_to_draft[kept] = True
    shape = DrafterShape.from_target(model.config.get_text_config(decoder=True), draft_vocab, [0, 1, 2])
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, kept - torch.arange(draft_vocab), target_to_draft)
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(family):
        if family not in built:
            model = family_model(family)
            built[family] = (model, drafter_for(model), open_engine(model, capacity=64, cuda_graphs=False))
        return built[family]

    return get


def generated(model, prompt, new=NEW):
    """transformers' own greedy generate, with no stop token (min_new_tokens would mask the stop token's logit instead)
    and every prompt token attended (without a mask, generate masks the tokens equal to pad_token_id)."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + new
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_static_greedy_equals_transformers_generate(family, models):
    model, _, engine = models(family)
    assert type(engine) is (StaticLlama if family == "llama" else StaticModules)
    if family != "llama":
        assert engine.windowed == (family in ("gpt_oss", "gemma3_text", "gemma3", "mistral"))
    for prompt in PROMPTS:
        assert len(prompt) + NEW > 2 * WINDOW
        assert greedy_decode(engine, prompt, NEW, set()).tokens == generated(model, prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_and_tree_speculation_equal_greedy(family, models):
    model, drafter, engine = models(family)
    rejected = 0
    for prompt in PROMPTS[:2]:
        expected = generated(model, prompt)
        for k in (1, 3):
            result = speculative_decode(engine, drafter, prompt, NEW, set(), k)
            assert result.tokens == expected, k
            rejected += sum(length <= k for length in result.acceptance_lengths)
        # transformers' own forward and cache (the reference path), cropped after rejected drafts past the window
        assert transformers_speculative_decode(model, drafter, prompt, NEW, set(), 3).tokens == expected
        for steps, topk, draft_tokens in TREES:
            static = tree_decode(engine, drafter, prompt, NEW, set(), steps, topk, draft_tokens)
            reference = tree_speculative_decode(model, drafter, prompt, NEW, set(), steps, topk, draft_tokens)
            assert static.tokens == expected and reference.tokens == expected, (steps, topk, draft_tokens)
            # The same trees drafted and accepted: the static rounds are the host-built reference's.
            assert static.acceptance_lengths == reference.acceptance_lengths
    assert rejected > 0, "some drafts must be rejected for the rounds to test anything"


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_each_prompts_generate(family, models):
    model, _, _ = models(family)
    loop = open_batched_greedy(model, pad_id=0, stop_ids=set(), cuda_graphs=False)
    assert type(loop) is (BatchedGreedy if family == "llama" else BatchedModules)
    assert loop.generate(PROMPTS, NEW) == [generated(model, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_speculation_gives_each_rows_greedy(family, models):
    """The benchmark's batched chain, tree and prompt lookup on every family's engine (sliding windows, MLA, MoE):
    each row's tokens are that prompt's greedy decode."""
    from eyrie.decoding.batched_speculative import BatchedSpeculative
    from eyrie.decoding.batched_tree import TreeDrafts
    from eyrie.decoding.tree import TreeShape

    model, drafter, _ = models(family)
    expected = [generated(model, prompt) for prompt in PROMPTS]
    engine = open_batched_greedy(model, pad_id=0, stop_ids=set(), cuda_graphs=False)
    steps, topk, draft_tokens = TREES[0]
    for drafts, k in ((drafter, 3), ("ngram", 3), (TreeDrafts(engine, drafter, TreeShape(steps, topk, draft_tokens)), steps)):
        assert BatchedSpeculative(engine, drafts).generate(PROMPTS, NEW, set(), k).tokens == expected, drafts


def test_the_generic_engine_runs_llama_as_the_fast_path_does(models):
    """StaticModules on a Llama (the target's own layers) gives the fast path's logits and tokens."""
    model, drafter, fast = models("llama")
    generic = StaticModules(model, capacity=64, cuda_graphs=False)
    ids, positions = torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0]))
    with torch.inference_mode():  # the engines' caches are inference tensors
        torch.testing.assert_close(generic.logits(ids, positions), fast.logits(ids, positions), rtol=1e-5, atol=1e-5)
    assert greedy_decode(generic, PROMPTS[0], NEW, set()).tokens == greedy_decode(fast, PROMPTS[0], NEW, set()).tokens
    assert tree_decode(generic, drafter, PROMPTS[0], NEW, set(), 3, 2, 5).tokens == tree_decode(fast, drafter, PROMPTS[0], NEW, set(), 3, 2, 5).tokens


def test_a_target_the_engine_disagrees_with_falls_back_with_the_numbers(models):
    """The self-check: a model whose own forward does more than its layers (here: negated logits) is refused, and the
    benchmark's decoder says transformers and why."""
    model = family_model("qwen3")
    plain = model.forward
    model.forward = lambda *args, **kwargs: types.SimpleNamespace(logits=-plain(*args, **kwargs).logits)
    engine, label, reason = open_decoder(model, "auto", capacity=64, cuda_graphs=False)
    assert engine is model and label == "transformers"
    assert "differ from the model's own forward" in reason and "probe tokens" in reason


# --------------------------------------------------------------------------- scaled rope

# Rope scalings whose tables the static engines build once (static_common.STATIC_ROPE_TYPES), from a context of 32 that
# the longest prompt's generation passes (it reaches position 37). None of these families' modeling code applies a
# partial_rotary_factor (their attention rotates the whole head), so partial rotary has no target here.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # Llama 3.1's, its context aside
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32, "rope_theta": 1000000.0}  # factor: max_position_embeddings 1024 / 32
DEEPSEEK_YARN = {**YARN, "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}  # mscale scales its softmax too
ROPE_TARGETS = {"llama-llama3": ("llama", LLAMA3), "llama-yarn": ("llama", YARN), "qwen3-yarn": ("qwen3", YARN),
                "deepseek_v3-yarn": ("deepseek_v3", DEEPSEEK_YARN)}
# A vocabulary of 8 (6 drafted) so that a random drafter's chains and trees accept some drafts; weights of std 0.2,
# since at 0.02 attention is nearly uniform and the tokens barely depend on the rope.
ROPE_VOCAB, ROPE_DRAFT_VOCAB = 8, 6
ROPE_PROMPTS = [[token % ROPE_VOCAB for token in prompt] for prompt in PROMPTS]
# Rope types whose frequencies change with the sequence length: one static table cannot hold them.
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0}  # 8 factors: head_dim 16 / 2


def rope_model(family: str, rope: dict):
    """A 4-layer target of `family` with `rope` as its rope_parameters, norms with noise as family_model's."""
    if family == "llama":
        return tiny_llama(layers=4, vocab=ROPE_VOCAB, positions=1024, initializer_range=0.2, rope_parameters=dict(rope)).eval()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_family_config(family, vocab=ROPE_VOCAB, window=WINDOW, layers=4, rope=dict(rope), initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def rope_models():
    built = {}

    def get(target):
        if target not in built:
            model = rope_model(*ROPE_TARGETS[target])
            built[target] = (model, drafter_for(model, ROPE_DRAFT_VOCAB), open_engine(model, capacity=64, cuda_graphs=False))
        return built[target]

    return get


@pytest.mark.parametrize("target", ROPE_TARGETS)
def test_static_greedy_equals_transformers_generate_under_scaled_rope(target, rope_models):
    model, _, engine = rope_models(target)
    family, rope = ROPE_TARGETS[target]
    assert type(engine) is (StaticLlama if family == "llama" else StaticModules)
    assert model.get_decoder().rotary_emb.rope_type == rope["rope_type"]
    assert max(map(len, ROPE_PROMPTS)) + NEW > rope["original_max_position_embeddings"] + 4
    expected = [generated(model, prompt) for prompt in ROPE_PROMPTS]
    for prompt, tokens in zip(ROPE_PROMPTS, expected):
        assert greedy_decode(engine, prompt, NEW, set()).tokens == tokens
    # The scaling reaches the tokens: the same weights under unscaled rope generate otherwise, so an engine that
    # dropped the scaling would fail the comparison above.
    unscaled = rope_model(family, {"rope_type": "default", "rope_theta": rope["rope_theta"]})
    assert [generated(unscaled, prompt) for prompt in ROPE_PROMPTS] != expected


@pytest.mark.parametrize("target", ROPE_TARGETS)
def test_chain_and_tree_speculation_equal_greedy_under_scaled_rope(target, rope_models):
    """The drafter takes the target's rope (DrafterShape.from_target), so its static tables are scaled too."""
    model, drafter, engine = rope_models(target)
    assert drafter.rotary.rope.rope_type == ROPE_TARGETS[target][1]["rope_type"]
    steps, topk, draft_tokens = TREES[0]
    chain_lengths, tree_lengths = [], []
    for prompt in ROPE_PROMPTS[:2]:
        expected = generated(model, prompt)
        chain = speculative_decode(engine, drafter, prompt, NEW, set(), 3)
        assert chain.tokens == expected
        static = tree_decode(engine, drafter, prompt, NEW, set(), steps, topk, draft_tokens)
        reference = tree_speculative_decode(model, drafter, prompt, NEW, set(), steps, topk, draft_tokens)
        assert static.tokens == expected and reference.tokens == expected
        assert static.acceptance_lengths == reference.acceptance_lengths
        chain_lengths += chain.acceptance_lengths
        tree_lengths += static.acceptance_lengths
    # Rounds that accept drafts and rounds that reject some, or the rounds test little.
    for lengths in (chain_lengths, tree_lengths):
        assert max(lengths) > 1 and min(lengths) <= 3, lengths


@pytest.mark.parametrize(("family", "rope"), [("llama", DYNAMIC), ("qwen3", DYNAMIC), ("llama", LONGROPE)],
                         ids=["llama-dynamic", "qwen3-dynamic", "llama-longrope"])
def test_a_rope_that_changes_with_the_length_is_refused_by_name(family, rope):
    """No static table for it: open_engine refuses, naming the rope type, and the benchmark's decoder falls back to
    transformers with that reason rather than decoding with a table of the wrong frequencies."""
    model = rope_model(family, rope)
    named = f"rope_type {rope['rope_type']!r}"
    with pytest.raises(UnsupportedTargetError, match=named):
        open_engine(model, capacity=64, cuda_graphs=False)
    with pytest.raises(UnsupportedTargetError, match=named):
        open_decoder(model, "static", capacity=64, cuda_graphs=False)
    engine, label, reason = open_decoder(model, "auto", capacity=64, cuda_graphs=False)
    assert engine is model and label == "transformers" and named in reason


def test_a_drafter_whose_rope_changes_with_the_length_is_refused_by_name(rope_models):
    """A static target with a drafter built for a dynamic-rope target: the static rounds refuse the drafter."""
    _, _, engine = rope_models("llama-llama3")
    drafter = drafter_for(rope_model("llama", DYNAMIC), ROPE_DRAFT_VOCAB)
    assert drafter.rotary.rope.rope_type == "dynamic"
    with pytest.raises(UnsupportedTargetError, match="rope_type 'dynamic'"):
        speculative_decode(engine, drafter, ROPE_PROMPTS[0], NEW, set(), 3)
    with pytest.raises(UnsupportedTargetError, match="rope_type 'dynamic'"):
        tree_decode(engine, drafter, ROPE_PROMPTS[0], NEW, set(), *TREES[0])
