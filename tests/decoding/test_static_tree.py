"""Tree rounds on the static cache (one replay per round): the reference tree decoder's tokens, round by round."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from factories import TREE_SHAPES, check_tree_result, random_drafter, six_layer_target, tree_target, wide_drafter

from eyrie.decoding.decode import greedy_decode, speculative_decode, tree_decode
from eyrie.decoding.graphs import cuda_graphs_usable
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_tree import StaticTree
from eyrie.decoding.tree import TreeShape, tree_speculative_decode

ALL_SHAPES = TREE_SHAPES + [(1, 3, 3), (2, 2, 7), (6, 8, 32)]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


@pytest.mark.parametrize("steps, topk, draft_tokens", ALL_SHAPES)
def test_static_trees_equal_the_reference_round_by_round(steps, topk, draft_tokens):
    """Same tokens, same accepted lengths per round and per depth as the host-built tree on transformers' cache."""
    for vocab_size, draft_vocab_size in ((5, None), (300, 100)):
        if topk > vocab_size:
            continue  # top-K of a 5-token vocabulary
        model = tree_target(vocab_size)
        drafter = random_drafter(model, draft_vocab_size, scale=0.2)
        engine = StaticLlama(model, capacity=64, cuda_graphs=False)
        prompt = torch.randint(0, vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
        expected = greedy_decode(model, prompt, 50, set()).tokens
        reference = tree_speculative_decode(model, drafter, prompt, 50, set(), steps, topk, draft_tokens)
        static = tree_decode(engine, drafter, prompt, 50, set(), steps, topk, draft_tokens)
        check_tree_result(static, expected, steps)
        assert static.acceptance_lengths == reference.acceptance_lengths
        assert static.accepted_per_position == reference.accepted_per_position
        if vocab_size == 5 and draft_tokens > 3:
            assert max(static.acceptance_lengths) >= 3  # deep paths were accepted, so the cache gather ran


@pytest.mark.parametrize("way", ["ranked"])
@pytest.mark.parametrize("steps, topk, draft_tokens", [(5, 4, 8), (6, 8, 32)])
def test_the_top_k_ways_cuda_takes_draft_the_same_trees(steps, topk, draft_tokens, way, monkeypatch):
    """On CUDA the frontier's top-K is ranked_top_k (eyrie.decoding.topk.top_k), which CPU runs never
    take: forced here, eager static trees equal the host-built reference (torch.topk) round by round, and compiled ones
    the same compiled rounds with torch.topk (compiled rounds round differently from eager ones, so they can part from
    the reference at a near-tie: this shape does at round 32 with any top-K)."""
    import eyrie.decoding.static_drafter as static_drafter
    from eyrie.decoding.topk import ranked_top_k

    model = tree_target(300)
    drafter = random_drafter(model, 100, scale=0.2)
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = tree_speculative_decode(model, drafter, prompt, 40, set(), steps, topk, draft_tokens)
    for compile in (False, True):
        decoded = {}
        ways = {"torch": lambda values, k: values.topk(k, dim=-1), "ranked": ranked_top_k}
        for name in ("torch", way):
            monkeypatch.setattr(static_drafter, "top_k", ways[name])
            engine = StaticLlama(model, capacity=64, cuda_graphs=False, compile=compile)
            decoded[name] = tree_decode(engine, drafter, prompt, 40, set(), steps, topk, draft_tokens)
            assert engine.drafter_for(drafter).fusion_failure is None
        taken, expected = decoded[way], reference if not compile else decoded["torch"]
        assert taken.tokens == expected.tokens == reference.tokens
        assert taken.acceptance_lengths == expected.acceptance_lengths


def test_accepted_paths_leave_the_first_branch():
    """A shape where the accepted node is often not the first child: the K/V gather moves non-contiguous rows."""
    model = tree_target(vocab_size=5)
    drafter = random_drafter(model, scale=0.2)
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    reference = tree_speculative_decode(model, drafter, prompt, 60, set(), 4, 3, 10)
    static = tree_decode(engine, drafter, prompt, 60, set(), 4, 3, 10)
    assert static.tokens == reference.tokens == greedy_decode(model, prompt, 60, set()).tokens
    assert static.acceptance_lengths == reference.acceptance_lengths
    # The chain that drafts each round's top-1 path accepts less: the tree's extra branches were used.
    chain = speculative_decode(engine, drafter, prompt, 60, set(), draft_tokens=4)
    assert sum(static.acceptance_lengths) / static.rounds > sum(chain.acceptance_lengths) / chain.rounds


def test_a_chain_setting_runs_on_the_chain_rounds_which_draft_what_a_one_wide_tree_drafts():
    """(S, 1, S + 1) is a chain of S: tree_decode runs it on the chain's rounds (fused, fewer kernels per step). The
    tree's own rounds with K = 1 and the host-built reference give the same tokens and accepted lengths, so the
    routing changes the speed only."""
    model = six_layer_target("llama", vocab_size=5, initializer_range=0.2)
    drafter = wide_drafter(model)
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    eagle = engine.drafter_for(drafter)
    for steps in (1, 3):
        chain = speculative_decode(engine, drafter, prompt, 40, set(), draft_tokens=steps)
        routed = tree_decode(engine, drafter, prompt, 40, set(), steps, 1, steps + 1)
        with torch.inference_mode():  # as tree_decode runs it
            one_wide = StaticTree(eagle, TreeShape(steps, 1, steps + 1)).decode(prompt, 40, set())
        reference = tree_speculative_decode(model, drafter, prompt, 40, set(), steps, 1, steps + 1)
        for result in (routed, one_wide, reference):
            assert result.tokens == chain.tokens and result.acceptance_lengths == chain.acceptance_lengths
        assert steps in eagle.rounds
    assert not eagle.trees  # the routed settings built no tree rounds
    assert max(chain.acceptance_lengths) > 1  # drafts were accepted: the comparison covers accepted paths


def counted(pieces: dict, calls: Counter) -> dict:
    """The same pieces, each counting its calls in `calls` by name."""
    def counting(name, piece):
        def run(*args):
            calls[name] += 1
            return piece(*args)
        return run
    return {name: counting(name, piece) for name, piece in pieces.items()}


def test_compiled_tree_rounds_fuse_the_drafters_steps_and_decode_like_eager_rounds():
    """With compile, a tree round runs in fused pieces with no drafting work between them: the extend with the root's
    top-K, one piece per frontier step (the drafter's layer with its tree-slot writes, attention, output, top-K,
    scores, sort), the selection, the target's head and the accept with the next round's buffers; the tokens and
    accepted lengths are the eager rounds'. Five tokens, so that a random drafter's drafts are accepted: the
    accept's next-round buffers decide what later rounds accept (an extend started late accepted less, losslessly)."""
    model = tree_target(vocab_size=5)
    drafter = normed_drafter(model)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    steps, topk, draft_tokens = 3, 2, 6
    eager = tree_decode(StaticLlama(model, capacity=128, cuda_graphs=False), drafter, prompt, 30, set(), steps, topk, draft_tokens)
    engine = StaticLlama(model, capacity=128, cuda_graphs=False, compile=True)
    eagle = engine.drafter_for(drafter)
    shape = TreeShape(steps, topk, draft_tokens)
    eagle.trees[shape] = tree = StaticTree(eagle, shape)
    calls = Counter()
    eagle._fused, tree._fused = counted(eagle._fused, calls), counted(tree._fused, calls)
    engine._fused_head = counted({"head": engine._fused_head}, calls)["head"]
    fused = tree_decode(engine, drafter, prompt, 30, set(), steps, topk, draft_tokens)
    assert fused.tokens == eager.tokens and fused.acceptance_lengths == eager.acceptance_lengths
    assert max(eager.acceptance_lengths) > 1
    assert eagle.fusion_failure is None
    rounds = len(fused.acceptance_lengths)
    assert calls == {"_extend_top": rounds, "_step": rounds * (steps - 1), "_select": rounds, "head": rounds, "_accept": rounds}


def test_a_longer_attention_span_compiles_nothing_new():
    """Every compiled piece of a chain or tree round is specialised to a step width (and a tree shape), none to an
    attention span: the drafter attends over its whole cache and the tree's verify mask covers the whole cache, of
    which the verify takes its span's columns. A decode that reaches a longer span replays what a short one compiled.
    With a piece per span, warm-up took ~100 s per benchmark job on an H200."""
    import torch._dynamo

    model = tree_target(vocab_size=300)
    drafter = random_drafter(model, 100, scale=0.2)
    engine = StaticLlama(model, capacity=600, cuda_graphs=False, compile=True)
    short = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    long = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(2)).tolist()  # past 256 slots: span 512
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def decode_both(prompt):
        chain = speculative_decode(engine, drafter, prompt, 12, set(), 3)
        tree = tree_decode(engine, drafter, prompt, 12, set(), 3, 2, 6)
        assert chain.tokens == tree.tokens == greedy_decode(model, prompt, 12, set()).tokens

    decode_both(short)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled > 0
    decode_both(long)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    assert engine.drafter_for(drafter).fusion_failure is None


def test_stops_budget_spans_and_capacity_growth():
    """Stop tokens and budgets as greedy; a decode longer than the smallest span and a cache that grows mid-run."""
    model = tree_target(vocab_size=300)
    drafter = random_drafter(model, 100, scale=0.2)
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    prompt = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    answer = greedy_decode(model, prompt, 40, set()).tokens
    stop = {answer[next(i for i in range(4, len(answer)) if answer[i] not in answer[:i])]}
    assert tree_decode(engine, drafter, prompt, 30, stop, 5, 4, 8).tokens == greedy_decode(model, prompt, 30, stop).tokens
    for max_new in (1, 2, 7):
        assert tree_decode(engine, drafter, prompt, max_new, set(), 5, 4, 8).tokens == answer[:max_new]
    long_prompt = torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(8)).tolist()
    result = tree_decode(engine, drafter, long_prompt, 20, set(), 3, 2, 6)  # grows the cache past 256 slots: two spans
    assert engine.capacity > 256
    assert result.tokens == greedy_decode(model, long_prompt, 20, set()).tokens


def test_drafter_doubles_are_refused_with_the_reference_named():
    model = tree_target(vocab_size=5)
    engine = StaticLlama(model, capacity=64, cuda_graphs=False)
    with pytest.raises(TypeError, match="tree_speculative_decode"):
        tree_decode(engine, object(), [1, 2, 3], 5, set(), 2, 2, 4)


def test_trees_on_the_default_target_are_lossless(target):
    """The pipeline's own target, float32: random-drafter trees on the static cache give greedy's tokens."""
    from eyrie.target.chat_template import render

    model, tokenizer = target
    drafter = random_drafter(model, draft_vocab_size=4096, seed=0)
    engine = StaticLlama(model, capacity=256, cuda_graphs=False)
    text = render(tokenizer, [{"role": "user", "content": "Write a Python function that reverses a string."}], add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    stop = {tokenizer.eos_token_id}
    expected = greedy_decode(model, prompt, 16, stop).tokens
    check_tree_result(tree_decode(engine, drafter, prompt, 16, stop, 5, 4, 8), expected, 5)


@pytest.mark.skipif(not torch.cuda.is_available() or not cuda_graphs_usable(torch.device("cuda")), reason="needs CUDA for graph capture")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_tree_rounds_equal_eager_rounds(compile):
    model = tree_target(vocab_size=300).cuda()
    drafter = random_drafter(model.cpu(), 100, scale=0.2).cuda()
    model = model.cuda()
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    eager = tree_decode(StaticLlama(model, capacity=128, cuda_graphs=False), drafter, prompt, 40, set(), 5, 4, 8)
    graphed_engine = StaticLlama(model, capacity=128, cuda_graphs=True, compile=compile)
    graphed = tree_decode(graphed_engine, drafter, prompt, 40, set(), 5, 4, 8)
    assert not graphed_engine.capture_failures, graphed_engine.capture_failures
    assert graphed.tokens == eager.tokens and graphed.acceptance_lengths == eager.acceptance_lengths


def normed_drafter(model, scale: float = 0.2):
    """A random drafter with both EAGLE-3.1 norms (norm_before_fc's input_norm, norm_output's fed-back normed state)."""
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter
    from eyrie.target.aux_layers import default_aux_layer_ids

    vocab = model.config.vocab_size
    shape = DrafterShape.from_target(model.config, vocab, default_aux_layer_ids(model.config.num_hidden_layers),
                                     norm_before_fc=True, norm_output=True)
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, weight in drafter.named_parameters():
            if weight.dim() == 2:
                weight.normal_(0, scale)
            elif name.endswith("input_norm.weight"):
                weight.uniform_(0.5, 1.5)  # not the identity: the norm must be applied where SGLang applies it
    return drafter.eval()


@pytest.mark.parametrize("compile", [False, True])
def test_eagle31_norms_decode_alike_on_every_path(compile):
    """A drafter with norm_before_fc and norm_output: the static chain and tree, eager and in compiled pieces (as the
    GPU config serves it since the norms were kept), equal transformers' chain and tree."""
    model = tree_target(vocab_size=5)
    drafter = normed_drafter(model)
    engine = StaticLlama(model, capacity=256, cuda_graphs=False, compile=compile)
    ran, eagle = Counter(), engine.drafter_for(drafter)
    eagle._fused = counted(eagle._fused, ran)
    prompt = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    greedy = greedy_decode(model, prompt, 40, set()).tokens
    chain_reference = speculative_decode(model, drafter, prompt, 40, set(), draft_tokens=3)
    chain_static = speculative_decode(engine, drafter, prompt, 40, set(), draft_tokens=3)
    tree_reference = tree_speculative_decode(model, drafter, prompt, 40, set(), 4, 3, 10)
    tree_static = tree_decode(engine, drafter, prompt, 40, set(), 4, 3, 10)
    assert chain_static.tokens == chain_reference.tokens == tree_static.tokens == tree_reference.tokens == greedy
    assert chain_static.acceptance_lengths == chain_reference.acceptance_lengths and max(chain_static.acceptance_lengths) > 1
    assert tree_static.acceptance_lengths == tree_reference.acceptance_lengths and max(tree_static.acceptance_lengths) > 1
    assert eagle.fusion_failure is None and (ran["_extend"] > 0) == compile  # compiled pieces ran, not an eager fallback


def test_every_piece_fuses_in_the_engines_compile_mode(monkeypatch):
    """bench.compile_mode reaches every compiled piece: the target's layer pieces and head, the drafter's, the chain's
    accept and a tree's; an unknown mode is refused before anything compiles."""
    from eyrie.decoding.static_common import AUTOTUNED, fused

    modes = []
    monkeypatch.setattr(torch, "compile", lambda function, dynamic, mode: modes.append((function.__name__, mode)) or function)
    model = tree_target(vocab_size=5)
    engine = StaticLlama(model, capacity=128, cuda_graphs=False, compile=True, compile_mode=AUTOTUNED)
    eagle = engine.drafter_for(normed_drafter(model))
    with torch.inference_mode():  # as a decode builds them
        eagle._rounds_for(2)
        StaticTree(eagle, TreeShape(3, 2, 6))
    names = {name for name, _ in modes}
    assert {"_project", "_finish", "_head", "_accept", "_extend_top", "_step", "_select"} <= names
    assert {mode for _, mode in modes} == {AUTOTUNED} and engine.label == "static-autotuned"
    modes.clear()
    assert StaticLlama(model, capacity=128, cuda_graphs=False, compile=True).label == "static-compiled"
    assert {mode for _, mode in modes} == {None}  # inductor's default mode
    with pytest.raises(ValueError, match="reduce-overhead"):
        fused(engine._head, "reduce-overhead")
