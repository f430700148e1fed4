"""Drafter training: TTT alignment tied to inference, SGLang checkpoint layout, resume, guards, overfitting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from factories import (
    TRAIN_FINGERPRINT,
    TRAIN_TEMPLATE,
    random_samples,
    run_two_ranks,
    tiny_setup,
    tiny_target_dir,
    train_step_once,
    train_tiny,
    training_drafter,
    without_seconds,
    write_training_cache,
    write_training_vocab,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyrie.core.errors import EyrieError
from eyrie.drafter.checkpoint import CheckpointError, check_checkpoint, load_drafter
from eyrie.drafter.model import DraftCache, DrafterShape
from eyrie.target.head import load_target_head, target_text_config
from eyrie.training.errors import TrainingInputError
from eyrie.training.objective import needed_targets, step_targets, target_distribution, ttt_forward, ttt_loss

TEMPLATE, FINGERPRINT = TRAIN_TEMPLATE, TRAIN_FINGERPRINT


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These models are tiny: one thread is fastest, and immune to a busy machine's oversubscription."""


# --------------------------------------------------------------------------- builders


# --------------------------------------------------------------------------- TTT alignment


def test_step_inputs_are_tokens_t_plus_1_plus_j_at_rotary_position_t_plus_j(monkeypatch):
    model = training_drafter()
    L, steps = 10, 4
    ids = torch.arange(100, 100 + L).unsqueeze(0)  # token t is 100 + t: the fed ids name their index
    seen = []
    original = model.layer_inputs

    def spy(hidden, input_ids, positions, rotary=None):
        seen.append((input_ids.clone(), positions.clone(), rotary))
        return original(hidden, input_ids, positions, rotary)

    monkeypatch.setattr(model, "layer_inputs", spy)
    ttt_forward(model, torch.randn(1, L, 96), ids, torch.tensor([L]), steps)
    assert len(seen) == steps
    for j, (tokens, positions, rotary) in enumerate(seen):
        # the rotary tables handed in (sliced from one table for every step) are those of positions t + j
        wanted = model.rotary(torch.empty(0), (torch.arange(L) + j)[None])
        assert rotary is not None and all(torch.equal(a.expand_as(b), b) for a, b in zip(rotary, wanted))
        for t in range(L):
            assert positions[0, t] == t + j
            expected = 100 + t + 1 + j if t + 1 + j < L else 0  # past the end: padding, masked out of the loss
            assert tokens[0, t] == expected, (j, t)


def test_step_targets_are_the_target_distribution_at_t_plus_1_plus_j():
    B, L = 2, 9
    lengths = torch.tensor([9, 6])
    # Position s's probability row and argmax both name s.
    row = torch.full((B, L), -1)
    arg = torch.full((B, L), -1)
    for b in range(B):
        for s in range(int(lengths[b])):
            row[b, s] = 100 * b + s
            arg[b, s] = s
    arg[0, 5] = -1  # the target's argmax at position 5 of sample 0 lies outside the draft vocab
    loss_mask = torch.ones(B, L, dtype=torch.bool)
    loss_mask[0, 4] = False  # token 4 of sample 0 is not an assistant token
    for j in range(4):
        valid, r, a = step_targets(j, row, arg, loss_mask, lengths)
        for b in range(B):
            n = int(lengths[b])
            for t in range(L):
                s = t + 1 + j  # the target position; it predicts token t + 2 + j
                expect_valid = t + 2 + j < n and bool(loss_mask[b, t + 2 + j]) and not (b == 0 and s == 5)
                assert bool(valid[b, t]) == expect_valid, (j, b, t)
                if expect_valid:
                    assert int(a[b, t]) == s and int(r[b, t]) == 100 * b + s


def test_needed_targets_are_positions_before_assistant_tokens():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    needed = needed_targets(loss_mask, torch.tensor([6, 3]))
    assert needed.tolist() == [[0, 1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]]
    # Every position any step trains on uses a needed target.
    row = torch.where(needed, torch.arange(7).expand(2, 7), torch.tensor(-1))
    for j in range(3):
        valid, r, _ = step_targets(j, torch.arange(7).expand(2, 7), torch.zeros(2, 7, dtype=torch.long), loss_mask, torch.tensor([6, 3]))
        valid_needed, _, _ = step_targets(j, row, torch.zeros(2, 7, dtype=torch.long), loss_mask, torch.tensor([6, 3]))
        assert torch.equal(valid, valid_needed)


def test_target_distribution_is_renormalised_over_draft_ids_and_chunked():
    torch.manual_seed(0)
    V, H, B, L = 50, 8, 2, 7
    lm_head = torch.randn(V, H)
    draft_ids = torch.arange(0, V, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    final = torch.randn(B, L, H) * 3
    needed = torch.ones(B, L, dtype=torch.bool)
    needed[1, 4:] = False
    needed[0, 2] = False
    probs, row, arg = target_distribution(final, needed, lm_head, draft_ids, t2d, chunk_rows=3)
    assert probs.shape == (int(needed.sum()), 25)
    for b in range(B):
        for s in range(L):
            if not needed[b, s]:
                assert arg[b, s] == -1 and row[b, s] == -1
                continue
            logits = lm_head @ final[b, s]
            assert torch.allclose(probs[row[b, s]], torch.softmax(logits[draft_ids], -1), atol=1e-6)
            full = int(logits.argmax())
            assert int(arg[b, s]) == (draft_ids.tolist().index(full) if full in draft_ids.tolist() else -1)
    assert (arg >= 0).any() and ((arg == -1) & needed).any()  # both cases occur in this draw


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True}])
def test_training_forward_equals_chained_inference_decode(norms):
    """Step j at position t in training == the j-th chained draft after position t at inference; also with the EAGLE-3.1 norms."""
    model = training_drafter(Vd=40, **norms)
    steps, lengths = 4, torch.tensor([12, 8])
    B, L = 2, 12
    torch.manual_seed(1)
    aux = torch.randn(B, L, 96)
    ids = torch.randint(0, 120, (B, L))
    with torch.no_grad():
        train_logits = ttt_forward(model, aux, ids, lengths, steps)
        for b in range(B):
            n = int(lengths[b])
            # Step 0 over the whole (unpadded) sample: one causal decode from an empty cache.
            cache = DraftCache()
            logits0, _ = model.decode(model.project_aux(aux[b : b + 1, : n - 1]), ids[b : b + 1, 1:n], torch.arange(n - 1)[None], cache)
            assert torch.allclose(train_logits[0][b, : n - 1], logits0[0], atol=1e-5)
            # Chains: after prefilling 0..t, feed the drafter's own output and the true tokens.
            for t in range(0, n - 2):
                cache = DraftCache()
                logits, out = model.decode(model.project_aux(aux[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2], torch.arange(t + 1)[None], cache)
                hidden = out[:, -1:]
                for j in range(1, steps):
                    if t + 1 + j >= n:
                        break
                    logits, hidden = model.decode(hidden, ids[b : b + 1, t + 1 + j : t + 2 + j], torch.tensor([[t + j]]), cache)
                    assert torch.allclose(train_logits[j][b, t], logits[0, 0], atol=1e-5), (b, t, j)


def test_loss_is_decay_weighted_soft_cross_entropy():
    model = training_drafter(Vd=40)
    torch.manual_seed(2)
    B, L, steps = 2, 10, 3
    lengths = torch.tensor([10, 7])
    aux, ids = torch.randn(B, L, 96), torch.randint(0, 120, (B, L))
    probs = torch.softmax(torch.randn(B * L, 40), -1)
    row = torch.arange(B * L).view(B, L)
    arg = torch.randint(-1, 40, (B, L))
    mask = torch.rand(B, L) > 0.2
    targets = [step_targets(j, row, arg, mask, lengths) for j in range(steps)]
    full = ttt_forward(model, aux, ids, lengths, steps)
    selected = ttt_forward(model, aux, ids, lengths, steps, select=[t[0] for t in targets])
    total, stats = ttt_loss(selected, targets, probs, 0.8)
    expected = 0.0
    for j, (valid, r, a) in enumerate(targets):
        assert torch.allclose(selected[j], full[j][valid], atol=1e-6)
        ce = -(probs[r[valid]] * torch.log_softmax(full[j][valid], -1)).sum(-1).mean()
        expected = expected + 0.8**j * ce
        assert stats[j][2] == int(valid.sum()) > 0
        assert stats[j][1] == int((full[j][valid].argmax(-1) == a[valid]).sum())
    assert torch.allclose(total, expected)


# --------------------------------------------------------------------------- end to end on tiny targets


def test_overfits_a_small_fixed_batch(tmp_path):
    V = 96
    inputs = tiny_setup(tmp_path, samples=random_samples(2, 48, V, seed=3), V=V, final_scale=3.0)
    summary = train_tiny(tmp_path, inputs, drafter={"ttt_steps": 3},
                  train={"epochs": 60, "learning_rate": 1e-2, "warmup_ratio": 0.05, "batch_tokens": 96, "max_grad_norm": 1.0})
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert summary["steps"] == 60 and len(log) == 60
    first, last = log[0], log[-1]
    assert last["loss"] < 0.3 * first["loss"], (first["loss"], last["loss"])
    assert first["acc_per_step"][0] < 0.3 and last["acc_per_step"][0] > 0.8, (first["acc_per_step"], last["acc_per_step"])
    assert last["acc_per_step"][2] > first["acc_per_step"][2]
    assert summary["final_accuracy_per_step"][0] > 0.8
    assert summary["tokens"] == 60 * 96 and summary["tokens_per_second"] > 0


def test_resume_continues_and_ends_with_the_same_weights(tmp_path):
    V = 120
    samples = random_samples(5, [20, 14, 30, 9, 25], V, seed=5)
    inputs = tiny_setup(tmp_path, samples=samples, V=V)
    train = {"epochs": 2.5, "batch_tokens": 40, "learning_rate": 3e-3, "warmup_ratio": 0.2}

    full = train_tiny(tmp_path, inputs, "full", train=train)
    assert full["steps"] == 10 and full["resumed_from_step"] == 0  # 4 batches per epoch

    class Crash(RuntimeError):
        pass

    def crash_at_5(step):
        if step == 5:
            raise Crash

    with pytest.raises(Crash):
        train_tiny(tmp_path, inputs, "resumed", train=train, save_every_steps=3, on_step=crash_at_5)
    assert not (tmp_path / "resumed").exists()  # the declared output is written once, at the end
    assert json.loads((tmp_path / "resumed.state" / "state.json").read_text())["step"] == 4  # saved at the end of epoch 1

    resumed = train_tiny(tmp_path, inputs, "resumed", train=train, save_every_steps=3)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 10
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    log_a = json.loads((tmp_path / "full" / "training_log.json").read_text())
    log_b = json.loads((tmp_path / "resumed" / "training_log.json").read_text())
    assert [e["step"] for e in log_a] == [e["step"] for e in log_b] == list(range(1, 11))
    assert [e["loss"] for e in log_a] == [e["loss"] for e in log_b]

    # A state from other settings is not resumed.
    again = train_tiny(tmp_path, inputs, "resumed", train={**train, "learning_rate": 1e-3})
    assert again["resumed_from_step"] == 0


def test_a_wider_mlp_is_trained_written_and_loaded_at_its_own_width(tmp_path):
    """drafter.intermediate_size widens the draft layer's MLP; the config.json SGLang and vLLM build the layer from carries
    the width, and the loader builds the same drafter from it."""
    from eyrie.drafter.checkpoint import load_drafter

    V = 96
    inputs = tiny_setup(tmp_path, samples=random_samples(3, 24, V, seed=4), V=V)
    train_tiny(tmp_path, inputs, drafter={"intermediate_size": 96}, train={"batch_tokens": 48})
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["intermediate_size"] == 96  # the target's is 64
    tensors = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert tensors["midlayer.mlp.gate_proj.weight"].shape == (96, 32) and tensors["midlayer.mlp.down_proj.weight"].shape == (32, 96)
    embeddings = load_file(str(tmp_path / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    loaded = load_drafter(tmp_path / "drafter", embeddings)
    assert loaded.shape.intermediate_size == 96
    assert torch.equal(loaded.midlayer.mlp.up_proj.weight.to(tensors["midlayer.mlp.up_proj.weight"].dtype), tensors["midlayer.mlp.up_proj.weight"])

    # The width is part of the run's identity: the default width does not resume the wider run's state.
    assert json.loads((tmp_path / "drafter.state" / "state.json").read_text())["step"] > 0
    assert train_tiny(tmp_path, inputs, train={"batch_tokens": 48})["resumed_from_step"] == 0


def test_only_draft_vocab_argmax_positions_are_trained(tmp_path):
    V = 120
    inputs = tiny_setup(tmp_path, V=V, draft_ids=range(0, V, 2))  # half of the target vocab
    summary = train_tiny(tmp_path, inputs)
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    # 2 samples x 24 tokens: step j could train 2 x (22 - j) positions; about half have an argmax outside.
    positions = log[0]["positions_per_step"]
    assert all(0 < positions[j] < 2 * (22 - j) for j in range(3)), positions
    assert summary["draft_vocab_size"] == 60


# --------------------------------------------------------------------------- guards


def _tamper_vocab_disagree(tmp_path, inputs):
    tensors = load_file(inputs["vocab_path"])
    tensors["t2d"][0] = ~tensors["t2d"][0]
    save_file(tensors, inputs["vocab_path"], metadata={"manifest": "{}"})


@pytest.mark.parametrize(
    "case, message",
    [
        ("template", "chat template fingerprint"),
        ("fingerprint", "target model fingerprint"),
        ("fc_width", "3 x target hidden"),
        ("vocab_too_large", "more than the target's vocabulary"),
        ("vocab_disagree", "t2d marks"),
        ("shards_disagree", "disagree on aux_layer_ids"),
        ("aux_out_of_range", "outside 0..6"),
        ("aux_not_the_cache", "aux layer ids"),
    ],
)
def test_guards_refuse_before_training(tmp_path, case, message):
    V, H, layers = 120, 32, 8
    inputs = tiny_setup(tmp_path, V=V, H=H, layers=layers)
    drafter = {}
    samples = random_samples(2, 24, V)
    if case == "template":
        inputs["hidden_paths"] = [write_training_cache(tmp_path / "h.safetensors", samples, H=H, layers=layers, template="b" * 64)]
    elif case == "fingerprint":
        inputs["hidden_paths"] = [write_training_cache(tmp_path / "h.safetensors", samples, H=H, layers=layers, fingerprint="0" * 64)]
    elif case == "fc_width":
        inputs["hidden_paths"] = [write_training_cache(tmp_path / "h.safetensors", samples, H=H, layers=layers, aux_width=H)]
    elif case == "vocab_too_large":
        inputs["vocab_path"] = write_training_vocab(tmp_path / "v.safetensors", range(V + 10), V + 10)
    elif case == "vocab_disagree":
        _tamper_vocab_disagree(tmp_path, inputs)
    elif case == "shards_disagree":
        other = write_training_cache(tmp_path / "h2.safetensors", samples, H=H, layers=layers, aux_ids=[2, 3, 4])
        inputs["hidden_paths"] = inputs["hidden_paths"] + [other]
    elif case == "aux_out_of_range":
        drafter = {"aux_layer_ids": [1, 3, 9]}
    elif case == "aux_not_the_cache":
        drafter = {"aux_layer_ids": [2, 3, 4]}
    with pytest.raises(EyrieError, match=message):
        train_tiny(tmp_path, inputs, drafter=drafter)
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "drafter.state").exists()


def test_guard_errors_are_training_input_errors(tmp_path):
    inputs = tiny_setup(tmp_path)
    inputs["vocab_path"] = write_training_vocab(tmp_path / "v.safetensors", range(130), 130)
    with pytest.raises(TrainingInputError):
        train_tiny(tmp_path, inputs)


# --------------------------------------------------------------------------- the real target and its checkpoint


def test_checkpoint_for_the_real_target_is_sglangs_layout(tmp_path, model_dir):
    config = target_text_config(model_dir)
    V, H, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    draft_ids = torch.randperm(V, generator=g)[:512].sort().values
    samples = [(draft_ids[torch.randint(0, 512, (20,), generator=g)].tolist(), [0, 0] + [1] * 18) for _ in range(2)]
    cache = write_training_cache(tmp_path / "hidden.safetensors", samples, H=H, layers=layers)
    vocab = write_training_vocab(tmp_path / "vocab.safetensors", draft_ids.tolist(), V)
    summary = train_tiny(
        tmp_path,
        {"target_dir": str(model_dir), "hidden_paths": [cache], "vocab_path": vocab},
        drafter={"ttt_steps": 2},
        train={"epochs": 2, "dtype": "auto", "batch_tokens": 64},
    )
    out = tmp_path / "drafter"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training_log.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 512 and cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H and cfg["hidden_size"] == H
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    assert cfg["max_position_embeddings"] == config.max_position_embeddings == 8192
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, layers // 2 - 1, layers - 4] == [1, 14, 26]
    assert cfg["eyrie"]["template_sha256"] == TEMPLATE and cfg["eyrie"]["target_fingerprint"] == FINGERPRINT
    assert cfg["eyrie"]["metrics"]["steps"] == summary["steps"] == 2
    assert len(cfg["eyrie"]["metrics"]["accuracy_per_step"]) == 2

    shape = DrafterShape.from_sglang_config(cfg)
    tensors = load_file(str(out / "model.safetensors"))
    expected = shape.expected_tensors()
    assert set(tensors) == set(expected)
    assert not any("embed" in k for k in tensors)
    for name, (dims, dtype) in expected.items():
        assert tuple(tensors[name].shape) == dims, name
        assert tensors[name].dtype == (dtype or torch.bfloat16), name
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert torch.equal(torch.arange(512) + tensors["d2t"], draft_ids)
    check_checkpoint(tensors, shape)

    # The head start: drafter lm_head rows began as the target's (tied) rows at the draft ids.
    head = load_target_head(model_dir)
    assert torch.equal(head["lm_head"], head["embed"])
    drift = (tensors["lm_head.weight"].float() - head["lm_head"][draft_ids]).abs().max()
    assert drift < 0.05

    model = load_drafter(out, head["embed"])
    assert not model.training and torch.equal(model.d2t, tensors["d2t"])
    with torch.no_grad():
        logits, _ = model.decode(torch.randn(1, 3, H), torch.tensor([[1, 2, 3]]), torch.arange(3)[None], DraftCache())
    assert logits.shape == (1, 3, 512)

    # Tampered checkpoints are refused, with the reason.
    extra = dict(tensors, **{"midlayer.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected midlayer.self_attn.extra.weight"):
        check_checkpoint(extra, shape)
    narrow = dict(tensors, **{"fc.weight": torch.zeros(H, H, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match="fc takes 576 inputs"):
        check_checkpoint(narrow, shape)
    save_file(narrow, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc takes 576 inputs"):
        load_drafter(out, head["embed"])


def test_load_target_head_reads_untied_heads(tmp_path):
    target = tiny_target_dir(tmp_path / "t", tied=False)
    head = load_target_head(target)
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        assert torch.equal(head["lm_head"], f.get_tensor("lm_head.weight"))
        assert torch.equal(head["norm"], f.get_tensor("model.norm.weight"))
    assert not torch.equal(head["lm_head"], head["embed"])


# --------------------------------------------------------------------------- fast paths: lean norm, flex attention, chunked loss


def test_rms_norm_backward_equals_autograd_on_the_plain_formula():
    from eyrie.drafter.model import RMSNorm

    torch.manual_seed(0)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        norm = RMSNorm(8, 1e-6)
        with torch.no_grad():
            norm.weight.add_(0.3 * torch.randn(8))
        x = (3 * torch.randn(2, 5, 8)).to(dtype).requires_grad_()
        grad = torch.randn(2, 5, 8)
        y = norm(x)
        gx, gw = torch.autograd.grad(y, [x, norm.weight], grad)
        # The formula the Function replaces, differentiated by autograd.
        x_ref = x.detach().clone().requires_grad_()
        w_ref = norm.weight.detach().clone().requires_grad_()
        xf = x_ref.float()
        y_ref = w_ref * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, [x_ref, w_ref], grad)
        assert y.dtype == y_ref.dtype == torch.float32 and torch.equal(y, y_ref)
        assert gx.dtype == dtype and torch.allclose(gx.float(), gx_ref.float(), atol=1e-5, rtol=rtol), dtype
        assert torch.allclose(gw, gw_ref, atol=1e-5, rtol=1e-5), dtype
        assert gx.abs().max() > 0.1 and gw.abs().max() > 0.1  # not vacuous


def _attention_inputs():
    torch.manual_seed(3)
    B, L = 2, 13
    lengths = torch.tensor([13, 6])  # the second row is mostly padding
    return torch.randn(B, L, 96), torch.randint(0, 120, (B, L)), lengths


def test_cuda_lengths_pad_to_whole_flex_tiles_and_never_to_one():
    """One 128-token tile recompiled flex attention (size-1 dims) for 23-27 s on an H200; CPU lengths stay as they are."""
    from eyrie.training.ttt_attention import FLEX_BLOCK, padded_length

    assert [padded_length(n, "cuda") for n in (1, 99, 256, 257, 2048)] == [2 * FLEX_BLOCK, 2 * FLEX_BLOCK, 256, 384, 2048]
    assert padded_length(99, "cpu") == 99


@pytest.mark.parametrize("pad_to", [1, 16])
def test_flex_ttt_attention_matches_eager_outputs_and_gradients(monkeypatch, pad_to):
    """Flex attention (unfused on CPU) over [k_0 | ... | k_j] == DraftAttention.attend, padded rows included."""
    import eyrie.training.ttt_attention as ttt_attention
    from eyrie.training.objective import ttt_hidden

    monkeypatch.setattr(ttt_attention, "padded_length", lambda length, device: pad_to * -(-length // pad_to))
    aux, ids, lengths = _attention_inputs()
    real = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)  # (B, L, 1)
    results = {}
    for attention in ("eager", "flex"):
        model = training_drafter(Vd=40).train()
        aux_in = aux.clone().requires_grad_()
        outs = ttt_hidden(model, aux_in, ids, lengths, 4, attention=attention)
        assert all(o.shape == (2, 13, 32) for o in outs)
        # Only real positions count: flex's mask leaves padded queries free (their outputs are never trained).
        outs = [o * real for o in outs]
        g = torch.Generator().manual_seed(0)
        (sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # not the head: ttt_hidden stops before it
        results[attention] = (outs, aux_in.grad, grads)
    (eager_outs, eager_aux, eager_grads), (flex_outs, flex_aux, flex_grads) = results["eager"], results["flex"]
    for j, (a, b) in enumerate(zip(eager_outs, flex_outs)):
        assert torch.allclose(a, b, atol=1e-5), (j, (a - b).abs().max())
    assert torch.allclose(eager_aux, flex_aux, atol=1e-5)
    assert eager_grads.keys() == flex_grads.keys() and len(eager_grads) == 11  # fc and the whole midlayer
    for name in eager_grads:
        assert torch.allclose(eager_grads[name], flex_grads[name], atol=1e-4, rtol=1e-4), name


def test_unfused_flex_attention_equals_the_dense_mask_path():
    """The CPU path (mask_mod materialised + SDPA) is what flex_attention itself computes."""
    from eyrie.training.ttt_attention import dense_ttt_attention, ttt_block_mask, unfused_flex_attention

    torch.manual_seed(5)
    B, h, kv_h, T, hd, blocks = 2, 4, 2, 9, 8, 3
    q = torch.randn(B, h, T, hd)
    k, v = torch.randn(B, kv_h, blocks * T, hd), torch.randn(B, kv_h, blocks * T, hd)
    block_mask = ttt_block_mask(T, blocks, "cpu")
    flex = unfused_flex_attention(q, k, v, block_mask, 0.3, True)
    dense = dense_ttt_attention(q, k, v, block_mask.mask_mod, 0.3, True)
    assert torch.allclose(flex, dense, atol=1e-5)
    # The mask itself: row t sees keys 0..t of block 0 and key t of blocks 1, 2.
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(block_mask.mask_mod, 1, 1, T, blocks * T, device="cpu")[0, 0]
    for t in range(T):
        seen = mask[t].nonzero().flatten().tolist()
        assert seen == list(range(t + 1)) + [T + t, 2 * T + t], (t, seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention needs CUDA")
def test_compiled_flex_matches_eager_on_cuda():
    from eyrie.training.objective import ttt_hidden

    _, ids, lengths = _attention_inputs()
    aux = torch.randn(2, 13, 192)  # H 64: compiled flex needs head_dim >= 16
    real = (torch.arange(13)[None, :] < lengths[:, None]).unsqueeze(-1).cuda()
    results = {}
    for attention in ("eager", "flex"):
        model = training_drafter(H=64, Vd=40).train().cuda()
        aux_in = aux.cuda().requires_grad_()
        outs = [o * real for o in ttt_hidden(model, aux_in, ids.cuda(), lengths.cuda(), 4, attention=attention)]
        sum(o.square().sum() for o in outs).backward()
        results[attention] = (outs, aux_in.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for a, b in zip(results["eager"][0], results["flex"][0]):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
    assert torch.allclose(results["eager"][1], results["flex"][1], atol=1e-3, rtol=1e-3)
    for name, grad in results["eager"][2].items():
        assert torch.allclose(grad, results["flex"][2][name], atol=1e-3, rtol=1e-3), name


def test_flex_selected_positions_equal_eager():
    from eyrie.training.objective import ttt_hidden

    aux, ids, lengths = _attention_inputs()
    model = training_drafter(Vd=40)
    real = torch.arange(13)[None, :] < lengths[:, None]  # training selects real positions only
    select = [(torch.rand(2, 13, generator=torch.Generator().manual_seed(j)) > 0.5) & real for j in range(3)]
    with torch.no_grad():
        eager = ttt_hidden(model, aux, ids, lengths, 3, select=select)
        flex = ttt_hidden(model, aux, ids, lengths, 3, select=select, attention="flex")
    for a, b in zip(eager, flex):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_resolve_attention():
    from eyrie.training.ttt_attention import AttentionUnavailable, resolve_attention

    assert resolve_attention("auto", "cpu") == "eager"
    assert resolve_attention("eager", "cpu") == "eager"
    assert resolve_attention("flex", "cpu") == "flex"
    with pytest.raises(AttentionUnavailable, match="train.attention"):
        resolve_attention("sdpa", "cpu")


def _reference_soft_ce(x, weight, probs, rows, argmax):
    logits = x @ weight.T
    loss = -(probs[rows] * torch.log_softmax(logits, -1)).sum()
    return loss, int((logits.argmax(-1) == argmax).sum())


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_chunked_soft_cross_entropy_equals_unchunked(dtype, tol):
    from eyrie.training.draft_loss import chunked_soft_cross_entropy

    torch.manual_seed(4)
    n, H, Vd, N = 13, 6, 11, 20
    x = torch.randn(n, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(Vd, H, dtype=dtype, requires_grad=True)
    probs = torch.softmax(2 * torch.randn(N, Vd, dtype=torch.float64), -1).to(dtype)
    rows = torch.randint(0, N, (n,))
    argmax = (x.detach() @ weight.detach().T).argmax(-1)
    argmax[::3] = -1  # some target argmaxes the drafter cannot hit
    loss, correct = chunked_soft_cross_entropy(x, weight, probs, rows, argmax, chunk_rows=4)
    gx, gw = torch.autograd.grad(2.5 * loss, [x, weight])
    ref_loss, ref_correct = _reference_soft_ce(x, weight, probs, rows, argmax)
    rgx, rgw = torch.autograd.grad(2.5 * ref_loss, [x, weight])
    assert torch.allclose(loss.double(), ref_loss.double(), atol=tol, rtol=tol)
    assert int(correct) == ref_correct == n - len(range(0, n, 3))
    assert torch.allclose(gx, rgx, atol=tol, rtol=tol) and torch.allclose(gw, rgw, atol=tol, rtol=tol)


def test_chunked_soft_cross_entropy_of_no_rows_gives_zero_gradients():
    from eyrie.training.draft_loss import chunked_soft_cross_entropy

    weight = torch.randn(5, 4, requires_grad=True)
    loss, correct = chunked_soft_cross_entropy(torch.zeros(0, 4, requires_grad=True), weight, torch.rand(3, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(correct) == 0 and torch.equal(weight.grad, torch.zeros(5, 4))


def test_objective_with_chunked_loss_equals_the_reference_loss():
    """TTTObjective (flex + chunked) gives the loss and gradients of ttt_forward + ttt_loss (eager, unchunked)."""
    from eyrie.training.objective import TTTObjective

    aux, ids, lengths = _attention_inputs()
    probs = torch.softmax(torch.randn(2 * 13, 40), -1)
    row = torch.arange(2 * 13).view(2, 13)
    arg = torch.randint(-1, 40, (2, 13))
    mask = torch.rand(2, 13) > 0.2
    targets = [step_targets(j, row, arg, mask, lengths) for j in range(3)]
    counts = torch.stack([t[0].sum() for t in targets]).double()

    model = training_drafter(Vd=40).train()
    ref_loss, ref_stats = ttt_loss(ttt_forward(model, aux, ids, lengths, 3, select=[t[0] for t in targets]), targets, probs, 0.8)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = training_drafter(Vd=40).train()
    with_counts = [(valid, row, arg, valid.sum()) for valid, row, arg in targets]
    loss, stats = TTTObjective(model, 3, 0.8, attention="flex", chunked_loss=True)(aux, ids, lengths, with_counts, probs, counts)
    loss.backward()
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    for j, (loss_j, correct, count) in enumerate(ref_stats):
        assert int(stats[j, 2]) == count and int(stats[j, 1]) == correct
        assert abs(float(stats[j, 0]) / count - loss_j) < 1e-5
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4), name


# --------------------------------------------------------------------------- data parallel


@pytest.mark.parametrize("compile", [False, True])
def test_two_ranks_follow_the_one_rank_loss_curve(tmp_path, compile):
    """torchrun, 2 gloo ranks, same global batches: the loss curve and final weights of one (eager) rank;
    also with train.compile in the ranks (compiled pieces inside DistributedDataParallel's forward)."""
    V = 96
    # Batches of 3, 2 and 1 rows (batch_tokens 96): uneven shares and a rank with a stand-in row.
    samples = random_samples(6, [32, 30, 29, 40, 44, 90], V, seed=7)
    inputs = tiny_setup(tmp_path, samples=samples, V=V)
    train = {"epochs": 2, "batch_tokens": 96, "learning_rate": 3e-3, "warmup_ratio": 0.2, "attention": "eager"}
    one = train_tiny(tmp_path, inputs, "one", train=train)
    run_two_ranks(tmp_path, inputs, "two", {**train, "compile": compile})

    log_one = json.loads((tmp_path / "one" / "training_log.json").read_text())
    log_two = json.loads((tmp_path / "two" / "training_log.json").read_text())
    assert one["steps"] == 6 and len(log_one) == len(log_two) == 6
    for a, b in zip(log_one, log_two):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert a["positions_per_step"] == b["positions_per_step"]
        assert b.get("compiled", False) is compile  # compiled throughout, no fallback
    # The simulated acceptance (on training batches here: 6 samples) is the same on two ranks as on one.
    assert [without_seconds(e.get("eval")) for e in log_one] == [without_seconds(e.get("eval")) for e in log_two]
    assert [len(e.get("eval", [])) for e in log_one] == [0, 0, 1, 0, 0, 1]
    w_one = load_file(str(tmp_path / "one" / "model.safetensors"))
    w_two = load_file(str(tmp_path / "two" / "model.safetensors"))
    for key in w_one:
        assert torch.allclose(w_one[key].float(), w_two[key].float(), atol=1e-4), key
    assert sorted(p.name for p in (tmp_path / "two.state").iterdir()) == sorted(p.name for p in (tmp_path / "one.state").iterdir())


def test_flat_position_indices_select_what_bool_masks_select(monkeypatch):
    """train_step selects trained positions by flat index (no host sync per use); the rows are the bool masks' rows."""
    import eyrie.training.ttt_attention as ttt_attention
    from eyrie.training.objective import pick_positions, positions_of, ttt_hidden

    g = torch.Generator().manual_seed(7)
    masks = [torch.rand(2, 13, generator=g) > 0.5 for _ in range(3)]
    indices = positions_of(masks)
    x = torch.randn(2, 13, 5)
    for mask, index in zip(masks, indices):
        assert index.dtype == torch.long and torch.equal(pick_positions(x, index), x[mask])
    # Through ttt_hidden, also where flex pads L = 13 to 16 and the flat indices must move with the padding.
    monkeypatch.setattr(ttt_attention, "padded_length", lambda length, device: 16 * -(-length // 16))
    aux, ids, lengths = _attention_inputs()
    real = torch.arange(13)[None, :] < lengths[:, None]
    select = [m & real for m in masks]
    model = training_drafter(Vd=40)
    with torch.no_grad():
        for attention in ("eager", "flex"):
            by_mask = ttt_hidden(model, aux, ids, lengths, 3, select=select, attention=attention)
            by_index = ttt_hidden(model, aux, ids, lengths, 3, select=positions_of(select), attention=attention)
            for a, b in zip(by_mask, by_index):
                assert a.shape == b.shape and a.shape[0] > 0 and torch.equal(a, b), attention


@pytest.mark.parametrize("host_copies", [True, False])
def test_train_step_equals_the_reference_where_argmaxes_fall_outside_the_draft_vocab(host_copies):
    """train_step selects each step's positions on the host copies of loss_mask and lengths (or reads them back, once,
    without them) by every test but the argmax's, and zeroes the label rows whose argmax lies outside the draft vocab:
    its loss, per-step (loss, correct, count) and gradients are the reference's, which selects by the whole mask."""
    from eyrie.training.objective import TTTObjective, needed_targets, step_targets, target_distribution, train_step, ttt_forward, ttt_loss
    from eyrie.training.optimizer import make_optimizer

    g = torch.Generator().manual_seed(11)
    B, L, H, V = 2, 13, 32, 120  # 40 of 120 ids in the draft vocab: most argmaxes fall outside it
    lengths = torch.tensor([L, L - 4])
    batch = {"aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g),
             "input_ids": torch.randint(0, V, (B, L), generator=g), "loss_mask": torch.rand(B, L, generator=g) > 0.2,
             "lengths": lengths, "tokens": int(lengths.sum())}
    head = torch.randn(V, H, generator=g)

    model = training_drafter(Vd=40).train()
    draft_ids = torch.arange(40) + model.d2t
    with torch.no_grad():
        probs, row, arg = target_distribution(batch["final"], needed_targets(batch["loss_mask"], lengths), head, draft_ids, model.t2d)
    targets = [step_targets(j, row, arg, batch["loss_mask"], lengths) for j in range(3)]
    assert ((row >= 0) & (arg < 0)).sum() > 3 and all(t[0].sum() > 0 for t in targets)  # not vacuous
    ref_loss, ref_stats = ttt_loss(ttt_forward(model, batch["aux"], batch["input_ids"], lengths, 3, select=[t[0] for t in targets]),
                                   targets, probs, 0.8)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model = training_drafter(Vd=40).train()
    if host_copies:
        batch = {**batch, "loss_mask_host": batch["loss_mask"].clone(), "lengths_host": lengths.clone()}
    result = train_step(TTTObjective(model, 3, 0.8), make_optimizer(model, 1e-2, 0.0), batch, target_lm_head=head, draft_ids=draft_ids,
                        t2d=model.t2d, max_grad_norm=1e6, use_bf16=False)
    assert result["loss"] == pytest.approx(float(ref_loss), rel=1e-5)
    for (loss_j, correct, count), (ref_loss_j, ref_correct, ref_count) in zip(result["stats"], ref_stats):
        assert (correct, count) == (ref_correct, ref_count) and loss_j == pytest.approx(ref_loss_j, rel=1e-5)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=1e-4), name


# --------------------------------------------------------------------------- train.compile (eyrie.training.compiled_layers)


def _compiled_graphs() -> dict[str, int]:
    """Dynamo's cache entries (compiled graphs) of each compiled piece."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from eyrie.training.compiled_layers import PIECES

    return {name: len(_debug_get_cache_entry_list(fn)) for name, fn in PIECES.items()}


@pytest.mark.parametrize("attention, recompute_mlp", [("eager", False), ("flex", False), ("flex", True), ("eager", True)])
def test_compiled_train_step_equals_eager_in_float32(monkeypatch, attention, recompute_mlp):
    """train.compile: one train_step's loss, per-step stats and every gradient are eager's (float32);
    flex attention with L = 13 padded to 16, as CUDA pads to whole tiles.

    (Not the updated weights: AdamW divides by sqrt(v), so a gradient element near zero turns a 1e-8
    difference into a visible step difference.)"""
    import eyrie.training.ttt_attention as ttt_attention

    monkeypatch.setattr(ttt_attention, "padded_length", lambda length, device: 16 * -(-length // 16))
    eager, eager_grads, none = train_step_once(False, attention, recompute_mlp)
    result, grads, compiled = train_step_once(True, attention, recompute_mlp)
    assert none is None and compiled.error is None, compiled.error  # ran compiled: no fallback
    assert all(n >= 1 for n in _compiled_graphs().values()), _compiled_graphs()
    assert abs(result["loss"] - eager["loss"]) <= 1e-6 * abs(eager["loss"]), (result["loss"], eager["loss"])
    for (loss, correct, count), (eager_loss, eager_correct, eager_count) in zip(result["stats"], eager["stats"]):
        assert count == eager_count > 0 and correct == eager_correct and abs(loss - eager_loss) <= 1e-6 * abs(eager_loss)
    assert grads.keys() == eager_grads.keys() and len(grads) == 13  # every trained tensor, the head included
    for name, grad in eager_grads.items():
        assert grad.abs().max() > 0, name  # not vacuous
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-6), (name, (grads[name] - grad).abs().max())


def test_compiled_train_step_under_bf16_autocast():
    """bf16 autocast (as on CUDA), flex attention and MLP recompute: compiled matches eager within bf16 rounding."""
    eager, eager_grads, _ = train_step_once(False, "flex", True, use_bf16=True)
    result, grads, compiled = train_step_once(True, "flex", True, use_bf16=True)
    assert compiled.error is None, compiled.error
    assert abs(result["loss"] - eager["loss"]) <= 1e-3 * abs(eager["loss"])
    for name, grad in eager_grads.items():  # inductor rounds to bf16 once per fused kernel, eager once per op
        assert (grads[name] - grad).abs().max() <= 0.05 * grad.abs().max(), name


def test_compiled_layers_do_not_recompile_for_new_batch_shapes():
    """dynamic=True: new row counts and lengths reuse the graphs (a one-row batch specialises once)."""
    train_step_once(True, "eager", False, B=2, L=13)
    before = _compiled_graphs()
    for B, L in ((3, 20), (2, 7), (4, 11)):
        assert train_step_once(True, "eager", False, B=B, L=L)[2].error is None
    assert _compiled_graphs() == before


def test_compile_failure_mid_step_falls_back_to_eager_and_recomputes_along_the_same_path(monkeypatch):
    """A piece that fails to compile in TTT step 1 runs eagerly from then on; MLP recompute replays each
    piece's path (step 0 compiled, later steps eager), so backward still works and gives eager's gradients."""
    from eyrie.training import compiled_layers

    real, calls = compiled_layers._compiled, {"mlp_input": 0}

    def failing(name):
        if name != "mlp_input":
            return real(name)

        def run(*args):
            calls["mlp_input"] += 1
            if calls["mlp_input"] == 2:  # the forward of TTT step 1 (the recompute replays without asking again)
                raise RuntimeError("simulated inductor failure")
            return real(name)(*args)

        return run

    monkeypatch.setattr(compiled_layers, "_compiled", failing)
    eager, eager_grads, _ = train_step_once(False, "flex", True)
    with pytest.warns(RuntimeWarning, match="train.compile: torch.compile failed, training goes on eagerly.*simulated inductor failure"):
        result, grads, compiled = train_step_once(True, "flex", True)
    assert compiled.error.startswith("mlp_input: RuntimeError: simulated inductor failure") and not compiled.active
    assert calls["mlp_input"] == 3  # step 0's forward, step 1's failed attempt, step 0's recompute
    assert abs(result["loss"] - eager["loss"]) <= 1e-6 * abs(eager["loss"])
    for name, grad in eager_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-6), name


def test_a_training_job_with_the_fused_loss_follows_the_eager_run_and_says_so(tmp_path):
    """train.fused_loss true on the CPU: the same loss curve as eager, and config.json records that it ran fused."""
    inputs = tiny_setup(tmp_path, samples=random_samples(4, 24, 120, seed=3))
    eager = train_tiny(tmp_path, inputs, "eager", train={"fused_loss": False, "epochs": 2, "batch_tokens": 48})
    fused = train_tiny(tmp_path, inputs, "fused", train={"fused_loss": True, "epochs": 2, "batch_tokens": 48})
    assert "fused_loss" not in eager and fused["fused_loss"] == {"fused": True, "fallback": None}
    eager_log = json.loads((tmp_path / "eager" / "training_log.json").read_text())
    fused_log = json.loads((tmp_path / "fused" / "training_log.json").read_text())
    eager_losses = [entry["loss"] for entry in eager_log if "loss" in entry]
    fused_losses = [entry["loss"] for entry in fused_log if "loss" in entry]
    assert len(fused_losses) == len(eager_losses) > 1
    assert fused_losses == pytest.approx(eager_losses, rel=1e-5)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["eyrie"]["metrics"]["fused_loss"] == {"fused": True, "fallback": None}


def test_training_without_a_cxx_compiler_falls_back_to_eager_and_logs_it(tmp_path):
    """Inductor without a working C++ compiler: train_drafter warns, trains eagerly (the eager run's losses)
    and records the fallback in training_log.json and config.json."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # forget the graphs earlier tests compiled: this run must compile (and fail)
    # torch's own config.patch, not monkeypatch: monkeypatch's undo deletes a config module's entry, and every later
    # compile in the process then fails ("enable_autograd_cache does not exist"). No kernels from the disk caches either.
    no_compiler = inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False})
    try:
        with no_compiler, functorch_config.patch(enable_autograd_cache=False):
            inputs = tiny_setup(tmp_path, samples=random_samples(4, 24, 120, seed=3))
            train_tiny(tmp_path, inputs, "eager")
            with pytest.warns(RuntimeWarning, match="train.compile: torch.compile failed.*C\\+\\+ compiler"):
                summary = train_tiny(tmp_path, inputs, "compiled", train={"compile": True})
    finally:
        torch._dynamo.reset()
    assert summary["compile"]["compiled"] is False and summary["compile"]["fallback"]["step"] == 1
    assert "C++ compiler" in summary["compile"]["fallback"]["error"]
    log = json.loads((tmp_path / "compiled" / "training_log.json").read_text())
    eager_log = json.loads((tmp_path / "eager" / "training_log.json").read_text())
    assert [e["compiled"] for e in log] == [False] * len(log) and "compiled" not in eager_log[0]
    assert [e["loss"] for e in log] == [e["loss"] for e in eager_log]  # every step ran the eager code
    config = json.loads((tmp_path / "compiled" / "config.json").read_text())
    assert config["eyrie"]["train"]["compile"] is True and config["eyrie"]["metrics"]["compile"]["compiled"] is False


# --------------------------------------------------------------------------- simulated acceptance on held-out samples


def test_held_out_samples_are_chosen_by_id_and_adding_samples_moves_none():
    from eyrie.training.holdout import MAX_HELD_OUT, held_out_indices

    ids = [f"conv{k}_0" for k in range(400)]
    held = {ids[k] for k in held_out_indices(ids, 0.05)}
    assert 5 <= len(held) <= 40  # about 20
    # More shards (new ids, anywhere in the order): every old sample stays on its side.
    grown = [f"new{k}_0" for k in range(300)] + ids[::-1]
    held_grown = {grown[k] for k in held_out_indices(grown, 0.05)}
    assert held_grown & set(ids) == held and held_grown - set(ids)
    # Bounds: none below 20 samples or at fraction 0; at least 1; at most MAX_HELD_OUT.
    assert held_out_indices(ids[:19], 0.5) == [] and held_out_indices(ids, 0.0) == []
    assert len(held_out_indices(ids[:20], 1e-9)) == 1
    assert len(held_out_indices([f"x{k}" for k in range(2000)], 0.5)) == MAX_HELD_OUT


def test_read_inputs_holds_out_by_id_across_shards(tmp_path):
    from eyrie.training.inputs import read_inputs

    V, H, layers = 120, 32, 8
    inputs = tiny_setup(tmp_path, V=V)
    shard_a = write_training_cache(tmp_path / "a.safetensors", random_samples(30, 12, V, seed=1), H=H, layers=layers, sample_ids=[f"a{k}" for k in range(30)])
    shard_b = write_training_cache(tmp_path / "b.safetensors", random_samples(30, 12, V, seed=2), H=H, layers=layers, sample_ids=[f"b{k}" for k in range(30)])

    def held_out_ids(paths, fraction=0.2):
        read = read_inputs(hidden_paths=paths, vocab_path=inputs["vocab_path"], target_dir=inputs["target_dir"], drafter_cfg={"ttt_steps": 3},
                           batch_tokens=64, template_sha256=TEMPLATE, target_fingerprint=FINGERPRINT, eval_fraction=fraction)
        ids = dict(zip([(s, a) for s, a, _ in read.samples + read.held_out], read.states.sample_ids(read.samples + read.held_out)))
        assert not set(read.samples) & set(read.held_out) and len(read.samples) + len(read.held_out) == 30 * len(paths)
        if read.held_out:  # the simulation runs on exactly the held-out samples
            assert sorted(r for b in read.eval_batches for r in b) == sorted(read.held_out)
        return {ids[(s, a)] for s, a, _ in read.held_out}, read

    alone, _ = held_out_ids([shard_a])
    both, read_ab = held_out_ids([shard_b, shard_a])  # the other shard first: positions move, ids do not
    assert alone and {i for i in both if i.startswith("a")} == alone and both - alone
    assert "held out of training" in read_ab.eval_note
    none, read_none = held_out_ids([shard_a], fraction=0.0)
    assert none == set() and "train.eval_fraction is 0" in read_none.eval_note
    assert len(read_none.samples) == 30 and read_none.eval_batches and all(b in read_none.batches for b in read_none.eval_batches)


def test_simulated_length_formula_on_known_accuracies():
    from eyrie.training.acceptance import acceptance_lengths, acceptance_summary

    lengths = acceptance_lengths([0.8, 0.5, 0.25])
    assert lengths == pytest.approx([1.8, 1.8 + 0.4, 1.8 + 0.4 + 0.1])
    assert acceptance_lengths([1.0, 1.0, 1.0, 1.0]) == [2.0, 3.0, 4.0, 5.0]  # a perfect drafter: k + 1
    assert acceptance_lengths([0.5, None, 0.5]) == [1.5, None, None]  # unmeasured from step 1 on
    assert acceptance_lengths([0.0, None]) == [1.0, 1.0]  # the chain stops at step 0: later steps add nothing
    # From counts: step 0 hits 8 of 10; the chain reaches step 1 at those 8 positions and hits 4 of them.
    summary = acceptance_summary([[8, 6], [10, 10], [8, 4], [10, 8]], source="held-out cache samples", samples=3)
    assert summary["per_step_accuracy"] == [0.8, 0.6] and summary["length"] == pytest.approx([1.8, 1.8 + 0.48])
    assert summary["conditional_accuracy"] == [0.8, 0.5] and summary["conditional_length"] == pytest.approx([1.8, 2.2])
    assert summary["k"] == [1, 2] and summary["eval_samples"] == 3 and summary["positions_per_step"] == [10, 10]


def test_eval_counts_use_the_training_masking():
    """batch_counts' per-step hits and positions are ttt_loss's (the training statistics); its chain counts are
    the leading run of hits at each position, recounted here by hand."""
    from eyrie.training.acceptance import CHAIN_HITS, CHAIN_REACH, COUNT, HITS, batch_counts

    model = training_drafter(Vd=60)
    g = torch.Generator().manual_seed(11)
    B, L, H, V, steps = 2, 14, 32, 120, 3
    lengths = torch.tensor([14, 9])
    batch = {"aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g),
             "input_ids": torch.randint(0, V, (B, L), generator=g), "loss_mask": torch.rand(B, L, generator=g) > 0.2, "lengths": lengths}
    lm_head, draft_ids = torch.randn(V, H, generator=g), torch.arange(60) * 2
    with torch.no_grad():  # a head started from the target's rows, so that some drafts hit
        model.lm_head.weight.copy_(lm_head[draft_ids])
    counts = batch_counts(model, batch, target_lm_head=lm_head, draft_ids=draft_ids, t2d=model.t2d, steps=steps, attention="eager", use_bf16=False)

    probs, row, arg = target_distribution(batch["final"], needed_targets(batch["loss_mask"], lengths), lm_head, draft_ids, model.t2d)
    targets = [step_targets(j, row, arg, batch["loss_mask"], lengths) for j in range(steps)]
    with torch.no_grad():
        full = ttt_forward(model, batch["aux"], batch["input_ids"], lengths, steps)
        _, stats = ttt_loss([f[t[0]] for f, t in zip(full, targets)], targets, probs, 0.8)
    assert counts[HITS].tolist() == [c for _, c, _ in stats] and counts[COUNT].tolist() == [n for _, _, n in stats]
    assert counts[HITS].sum() > 0
    for j in range(steps):
        reach = hits = 0
        for b in range(B):
            for t in range(L):
                ok = [bool(targets[i][0][b, t]) and int(full[i][b, t].argmax()) == int(targets[i][2][b, t]) for i in range(j)]
                if all(ok) and targets[j][0][b, t]:
                    reach += 1
                    hits += int(full[j][b, t].argmax()) == int(targets[j][2][b, t])
        assert (int(counts[CHAIN_REACH, j]), int(counts[CHAIN_HITS, j])) == (reach, hits), j


def _cyclic_setup(tmp_path, n_samples=24, length=20, V=64, H=32, layers=8, period=16, cache="hidden.safetensors"):
    """A scripted cache: each sample walks one cycle of `period` tokens from its own start, and every state is a fixed
    function of its token, so the target's next token is a function of the drafter's input token at every TTT step:
    what training learns carries over to held-out samples."""
    g = torch.Generator().manual_seed(21)
    cycle = torch.randperm(V, generator=g)[:period]
    aux_table, final_table = torch.randn(V, 3 * H, generator=g), 3 * torch.randn(V, H, generator=g)
    samples, starts = [], torch.randint(0, period, (n_samples,), generator=g).tolist()
    for start in starts:
        tokens = [int(cycle[(start + t) % period]) for t in range(length)]
        samples.append((tokens, [0, 0] + [1] * (length - 2)))
    ids = torch.tensor([t for tokens, _ in samples for t in tokens])
    target = tiny_target_dir(tmp_path / "target", hidden=H, vocab=V, layers=layers)
    (tmp_path / cache).parent.mkdir(parents=True, exist_ok=True)
    cache = write_training_cache(tmp_path / cache, samples, H=H, layers=layers, sample_ids=[f"walk{k}" for k in range(n_samples)],
                        states=(aux_table[ids], final_table[ids]))
    vocab = write_training_vocab(tmp_path / "vocab.safetensors", range(V), V)
    return {"target_dir": str(target), "hidden_paths": [cache], "vocab_path": vocab}


def test_held_out_samples_of_several_datasets_are_also_simulated_per_dataset(tmp_path):
    """A run that mixes datasets reports each one's walk beside the whole, so it compares with a run on one of them."""
    from eyrie.training.acceptance import acceptance_line
    from eyrie.training.inputs import read_inputs

    inputs = _cyclic_setup(tmp_path, cache="hidden/cyclic/0000.safetensors")  # learnable: states are a function of the token
    (tmp_path / "hidden" / "noise").mkdir()
    noise = write_training_cache(tmp_path / "hidden" / "noise" / "0000.safetensors", random_samples(24, 20, 64, seed=5), H=32, layers=8,
                        sample_ids=[f"noise{k}" for k in range(24)], seed=5)  # random states: the target's next token is noise
    inputs["hidden_paths"] = [noise, *inputs["hidden_paths"]]
    read = read_inputs(hidden_paths=inputs["hidden_paths"], vocab_path=inputs["vocab_path"], target_dir=inputs["target_dir"],
                       drafter_cfg={"ttt_steps": 3}, batch_tokens=100, template_sha256=TEMPLATE, target_fingerprint=FINGERPRINT,
                       eval_fraction=0.2)
    assert sorted(set(read.eval_datasets)) == ["cyclic", "noise"] and len(read.eval_datasets) == len(read.eval_batches)
    paths = read.states.paths
    assert all({Path(paths[s]).parent.name for s, _, _ in batch} == {name} for batch, name in zip(read.eval_batches, read.eval_datasets))
    one = read_inputs(hidden_paths=[noise], vocab_path=inputs["vocab_path"], target_dir=inputs["target_dir"], drafter_cfg={"ttt_steps": 3},
                      batch_tokens=100, template_sha256=TEMPLATE, target_fingerprint=FINGERPRINT, eval_fraction=0.2)
    assert one.held_out and one.eval_datasets == []  # one dataset: the whole is the dataset

    train_tiny(tmp_path, inputs, train={"epochs": 10, "learning_rate": 1e-2, "batch_tokens": 100, "eval_fraction": 0.2, "log_every": 5})
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    last = [e for entry in log for e in entry.get("eval", [])][-1]
    cyclic, noisy = last["by_dataset"]["cyclic"], last["by_dataset"]["noise"]
    # The datasets partition the whole: their samples and walked rounds add up to it.
    assert cyclic["eval_samples"] + noisy["eval_samples"] == last["eval_samples"] and min(cyclic["eval_samples"], noisy["eval_samples"]) >= 1
    for key in ("walked_rounds", "walked_first_turn_rounds", "positions_per_step"):
        assert [a + b for a, b in zip(cyclic[key], noisy[key])] == last[key], key
    # The learnable dataset walks far further than the noise, and the whole lies between them.
    assert cyclic["walked_first_turn_length"][-1] > noisy["walked_first_turn_length"][-1] + 1
    assert noisy["walked_first_turn_length"][-1] < last["walked_first_turn_length"][-1] < cyclic["walked_first_turn_length"][-1]
    assert "; cyclic alone, walked over first replies " in acceptance_line(last) and "; noise alone" in acceptance_line(last)
    # Each dataset's copy slice is its own, and their round starts add up to the whole's.
    assert cyclic["copy"]["positions"] + noisy["copy"]["positions"] == last["copy"]["positions"]
    assert cyclic["copy"]["positions"] > 0 == noisy["copy"]["positions"]  # prompt lookup copies a cycle, never noise
    line = acceptance_line(last)
    assert f"copy slice drafter {cyclic['copy']['drafter_accepted'][-1]:.2f} / prompt lookup " in line.split("; noise alone")[0]
    assert "copy slice" not in line.split("; noise alone")[1]


def test_a_drafter_that_learned_the_rule_simulates_nearly_k_plus_1_on_held_out_samples(tmp_path):
    from eyrie.drafter.checkpoint import read_simulated_acceptance, simulated_length

    inputs = _cyclic_setup(tmp_path)
    summary = train_tiny(tmp_path, inputs, train={"epochs": 15, "learning_rate": 1e-2, "batch_tokens": 100, "eval_fraction": 0.2, "log_every": 5})
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    evaluations = [e for entry in log for e in entry.get("eval", [])]
    assert [e["epoch"] for e in evaluations] == list(range(1, 16))
    first, last = evaluations[0], evaluations[-1]
    held_out = last["eval_samples"]
    assert last["source"] == "held-out cache samples" and 1 <= held_out < 24 and summary["samples"] == 24 - held_out
    assert last["k"] == [1, 2, 3] and min(last["per_step_accuracy"]) > 0.9, last["per_step_accuracy"]
    assert last["length"][-1] > 3.6 and last["length"][-1] > first["length"][-1] + 1, (first["length"], last["length"])
    assert last["conditional_length"][-1] > 3.6
    # The walk replays a decoder's rounds, which stop at each sample's end: a perfect drafter takes ceil(18 / (k + 1))
    # rounds over a sample's 18 loss tokens, so its walked length is 18 / 5 = 3.6 at k = 3, the most there is.
    assert last["walked_rounds"] == [held_out * math.ceil(18 / (k + 1)) for k in (1, 2, 3)]
    assert last["walked_length"][-1] == pytest.approx(18 / 5)
    # train.keep_best (the default): the written drafter is the epoch of the best walked k=3 length, the later one on ties.
    best = max(reversed(evaluations), key=lambda e: e["walked_length"][-1])
    written = read_simulated_acceptance(tmp_path / "drafter")
    assert without_seconds(written) == without_seconds(best) == without_seconds(summary["simulated_acceptance"])
    assert log[-1]["kept"]["epoch"] == best["epoch"] == summary["kept"]["epoch"]
    assert simulated_length(written, 3) == best["walked_length"][2] and simulated_length(written, 4) is None  # the walked chain first


def test_simulated_acceptance_round_trips_through_config_json_and_old_drafters_read_none(tmp_path):
    from eyrie.drafter.checkpoint import read_simulated_acceptance, simulated_length

    inputs = tiny_setup(tmp_path)  # 2 samples: no held-out set, training batches instead, said so
    summary = train_tiny(tmp_path, inputs)
    config_path = tmp_path / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    written = config["eyrie"]["simulated_acceptance"]
    assert written["source"] == "training samples" and written["eval_samples"] == 2 and written["k"] == [1, 2, 3]
    assert read_simulated_acceptance(tmp_path / "drafter") == written == summary["simulated_acceptance"]
    assert [simulated_length(written, k) for k in (1, 2, 3, 4)] == [*written["walked_length"], None]  # the walked chain first
    assert config["eyrie"]["train"]["eval_fraction"] == 0.05 and "metrics" in config["eyrie"]  # every earlier key stays
    # A drafter trained before the simulation existed: no summary, no error (and no content digest: older still).
    del config["eyrie"]["simulated_acceptance"], config["eyrie_digest"]
    config_path.write_text(json.dumps(config))
    assert read_simulated_acceptance(tmp_path / "drafter") is None and simulated_length(None, 2) is None


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda s: s.pop("length"), "missing length"),
        (lambda s: s.update(k=[1, 3, 4]), "k is \\[1, 3, 4\\]"),
        (lambda s: s.update(length=[1.5, 2.0]), "length has 2 entries, k has 3"),
        (lambda s: s.update(per_step_accuracy=[0.5, "high", 0.1]), "per_step_accuracy is"),
        (lambda s: s.update(length=[2.5, 2.6, 2.7]), "length\\[0\\] is 2.5, outside \\[1, 2\\]"),
        (lambda s: s.update(eval_samples=-1), "eval_samples is -1"),
        (lambda s: s.clear() or s.update(k="all"), "k is 'all'"),
    ],
)
def test_malformed_simulated_acceptance_names_the_file(tmp_path, tamper, message):
    from eyrie.drafter.checkpoint import read_simulated_acceptance

    directory = tmp_path / "drafter"
    directory.mkdir()
    summary = {"k": [1, 2, 3], "length": [1.5, 1.7, 1.8], "per_step_accuracy": [0.5, 0.4, 0.5], "eval_samples": 4, "source": "held-out cache samples"}
    tamper(summary)
    (directory / "config.json").write_text(json.dumps({"eyrie": {"simulated_acceptance": summary}}))
    with pytest.raises(CheckpointError, match=f"{directory / 'config.json'}: eyrie.simulated_acceptance is malformed: .*{message}"):
        read_simulated_acceptance(directory)
    (directory / "config.json").write_text(json.dumps({"eyrie": {"simulated_acceptance": [1.8]}}))
    with pytest.raises(CheckpointError, match="config.json: eyrie.simulated_acceptance is list, expected an object"):
        read_simulated_acceptance(directory)


def test_the_simulation_leaves_training_unchanged(tmp_path, monkeypatch):
    """The epoch-end simulation touches no weight, optimizer state or random stream: a run without it (stubbed out)
    writes the same bytes. Held out samples change what trains, so eval_fraction is part of the run identity."""
    import eyrie.training.train as train_module
    from eyrie.training.acceptance import acceptance_summary
    from eyrie.training.state import run_identity

    V = 120
    inputs = tiny_setup(tmp_path, samples=random_samples(24, [10 + k for k in range(24)], V, seed=4), V=V)
    train = {"epochs": 2, "batch_tokens": 80, "learning_rate": 3e-3, "keep_best": False}  # the last epoch's weights, whatever it simulates
    train_tiny(tmp_path, inputs, "simulated", train={**train, "eval_fraction": 0})
    monkeypatch.setattr(train_module, "simulate_acceptance",
                        lambda *a, steps, **kw: acceptance_summary([[0] * steps] * 4, source="training samples", samples=0))
    train_tiny(tmp_path, inputs, "stubbed", train={**train, "eval_fraction": 0})
    assert (tmp_path / "simulated" / "model.safetensors").read_bytes() == (tmp_path / "stubbed" / "model.safetensors").read_bytes()
    monkeypatch.undo()
    held = train_tiny(tmp_path, inputs, "held", train=train)  # the default 0.05 of 24 samples holds some out: other batches, other weights
    assert held["samples"] < 24 and held["simulated_acceptance"]["source"] == "held-out cache samples"

    d2t = torch.zeros(4, dtype=torch.int64)
    identity = [run_identity([{"ids": ["a"]}], d2t, {}, {"epochs": 1, "eval_fraction": f}, TEMPLATE, FINGERPRINT) for f in (0.0, 0.05)]
    assert identity[0] != identity[1]


def test_two_ranks_simulate_the_same_acceptance_on_held_out_samples(tmp_path):
    """Held-out batches are dealt to ranks whole and the counts all-reduced: two ranks give one rank's figures."""
    V = 96
    inputs = tiny_setup(tmp_path, samples=random_samples(24, [12 + (k * 5) % 20 for k in range(24)], V, seed=8), V=V)
    train = {"epochs": 1, "batch_tokens": 64, "learning_rate": 3e-3, "attention": "eager", "eval_fraction": 0.25}
    one = train_tiny(tmp_path, inputs, "one", train=train)
    run_two_ranks(tmp_path, inputs, "two", train)
    evaluation = one["simulated_acceptance"]
    assert evaluation["source"] == "held-out cache samples" and evaluation["eval_samples"] >= 3
    config_two = json.loads((tmp_path / "two" / "config.json").read_text())
    assert without_seconds(config_two["eyrie"]["simulated_acceptance"]) == without_seconds(evaluation)


def test_a_forced_rerun_after_a_finished_run_writes_the_same_bytes(tmp_path):
    """Snakemake's --force deletes the drafter, not the resume state: the rerun resumes at the last step and must
    write what the finished run wrote (weights, the kept epoch, the log), not the last step's weights or a new log."""
    import shutil

    V = 120
    inputs = tiny_setup(tmp_path, samples=random_samples(6, [20, 14, 30, 9, 25, 18], V, seed=7), V=V)
    # A rate this high peaks in epoch 1 and degrades: the kept weights are not the last step's.
    train = {"epochs": 5, "batch_tokens": 40, "learning_rate": 0.3, "lr_schedule": "constant", "warmup_ratio": 0.2, "eval_fraction": 0.3}
    first = train_tiny(tmp_path, inputs, "drafter", train=train)
    assert first["kept"]["epoch"] < 5
    written = {p.name: p.read_bytes() for p in (tmp_path / "drafter").iterdir()}
    shutil.rmtree(tmp_path / "drafter")
    again = train_tiny(tmp_path, inputs, "drafter", train=train)
    assert again["resumed_from_step"] == first["steps"]
    rewritten = {p.name: p.read_bytes() for p in (tmp_path / "drafter").iterdir()}
    assert rewritten.keys() == written.keys()
    differing = [name for name in written if rewritten[name] != written[name]]
    assert not differing, differing
