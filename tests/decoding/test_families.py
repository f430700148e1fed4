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
    kept = torch.sort(torch.randperm(VOCAB)[:draft_vocab]).values
    target_to_draft = torch.zeros(VOCAB, dtype=torch.bool)
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
    """transformers' own greedy generate, with no stop token (min_new_tokens would mask the stop token's logit instead)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
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
