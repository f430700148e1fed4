"""The training recipe's options: keep the best epoch (train.keep_best), noise on the cached states (train.hidden_noise),
the learning-rate schedule (train.lr_schedule), labels inside copied stretches weighted (train.copy_weight), the prompts'
tokens trained on (train.prompt_label_weight) and the EAGLE-3.1 norms in training (drafter.norm_before_fc, norm_output)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from factories import random_samples, tiny_setup, train_step_once, train_tiny, training_drafter, without_seconds
from safetensors.torch import load_file

import eyrie.training.train as train_module
from eyrie.drafter.checkpoint import load_drafter, read_simulated_acceptance
from eyrie.training.acceptance import acceptance_summary
from eyrie.training.noise import add_hidden_noise
from eyrie.training.optimizer import learning_rate


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Tiny models: one thread is fastest."""


# 5 samples in batches of <= 40 tokens: 4 steps per epoch, epochs end at steps 4, 8, 12.
SAMPLES = {"n": 5, "length": [20, 14, 30, 9, 25], "V": 120, "seed": 5}
TRAIN = {"batch_tokens": 40, "learning_rate": 3e-3, "warmup_ratio": 0.2}


def scripted_simulation(monkeypatch, hits_by_step: dict[int, int], snapshots: dict | None = None) -> None:
    """Each epoch-end simulation reports per-step accuracy hits/10 (so length(k=3) = 1 + a + a^2 + a^3) instead of simulating;
    snapshots[step] gets the trained weights it was asked about. Training itself is untouched (the real simulation touches nothing)."""

    def simulate(run_, trainer, step):
        if snapshots is not None:
            snapshots[step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        hits = hits_by_step[step]
        counts = [[hits] * 3, [10] * 3, [hits] * 3, [10] * 3]
        return {"epoch": step / run_.steps_per_epoch, "step": step, **acceptance_summary(counts, source="held-out cache samples", samples=4)}

    monkeypatch.setattr(train_module, "_simulate", simulate)


def length_of(hits: int) -> float:
    a = hits / 10
    return 1 + a + a**2 + a**3


# --------------------------------------------------------------------------- train.keep_best


@pytest.mark.parametrize(
    "hits, kept_step",
    [
        ({4: 5, 8: 9, 12: 6}, 8),  # the middle epoch is best: its weights, not the last epoch's
        ({4: 9, 8: 9, 12: 5}, 8),  # a tie goes to the later epoch
        ({4: 5, 8: 6, 12: 7}, 12),  # the last epoch is best
    ],
)
def test_keep_best_writes_the_best_epochs_weights_and_says_so(tmp_path, monkeypatch, hits, kept_step):
    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    snapshots: dict = {}
    scripted_simulation(monkeypatch, hits, snapshots)
    summary = train_tiny(tmp_path, inputs, train={**TRAIN, "epochs": 3})
    assert summary["steps"] == 12 and sorted(snapshots) == [4, 8, 12]

    written = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    for name, weight in snapshots[kept_step].items():  # train.dtype float32: the kept weights exactly
        assert torch.equal(written[name], weight), name
    if kept_step != 12:
        assert any(not torch.equal(written[n], w) for n, w in snapshots[12].items())  # not vacuous: the last epoch differs

    # config.json's simulated acceptance is the kept epoch's (what the benchmark's parity gate compares with) ...
    acceptance = read_simulated_acceptance(tmp_path / "drafter")
    assert acceptance["step"] == kept_step and acceptance["length"][-1] == pytest.approx(length_of(hits[kept_step]))
    # ... and the training log's last entry and config.json say which epoch was kept and why.
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    kept = log[-1]["kept"]
    assert kept == config["eyrie"]["kept"] == summary["kept"]
    assert kept["step"] == kept_step and kept["epoch"] == kept_step / 4 and kept["k"] == 3
    assert kept["length"] == pytest.approx(length_of(hits[kept_step])) and kept["last_epoch_length"] == pytest.approx(length_of(hits[12]))
    assert "train.keep_best" in kept["by"] and "4 held-out cache samples" in kept["by"]
    assert [e for e in log[:-1] if "kept" in e] == []  # one note, on the last entry


def test_without_keep_best_the_last_epoch_is_written(tmp_path, monkeypatch):
    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    snapshots: dict = {}
    scripted_simulation(monkeypatch, {4: 5, 8: 9, 12: 6}, snapshots)
    summary = train_tiny(tmp_path, inputs, train={**TRAIN, "epochs": 3, "keep_best": False})
    written = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    for name, weight in snapshots[12].items():
        assert torch.equal(written[name], weight), name
    assert read_simulated_acceptance(tmp_path / "drafter")["step"] == 12
    assert summary["kept"] == {"epoch": 3.0, "step": 12, "by": "the last epoch (train.keep_best: false)"}


def test_a_kill_and_resume_with_every_recipe_option_writes_the_same_bytes(tmp_path, monkeypatch):
    """keep_best (the best epoch is the first, the run is killed two steps after its last save, in epoch 2), hidden noise,
    labels half the target's argmax, a linear schedule and both EAGLE-3.1 norms: the resumed run writes the uninterrupted run's files, byte for byte;
    the kept weights came back from the resume state."""
    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    train = {**TRAIN, "epochs": 2.5, "lr_schedule": "linear", "hidden_noise": 0.3, "hard_label_weight": 0.5}
    drafter = {"norm_before_fc": True, "norm_output": True}
    hits = {4: 9, 8: 5, 10: 6}
    snapshots: dict = {}
    scripted_simulation(monkeypatch, hits, snapshots)
    full = train_tiny(tmp_path, inputs, "full", drafter=drafter, train=train)
    assert full["steps"] == 10 and full["kept"]["step"] == 4

    class Crash(RuntimeError):
        pass

    def crash_at_7(step):
        if step == 7:
            raise Crash

    with pytest.raises(Crash):
        train_tiny(tmp_path, inputs, "resumed", drafter=drafter, train=train, save_every_steps=3, on_step=crash_at_7)
    state = json.loads((tmp_path / "resumed.state" / "state.json").read_text())
    assert state["step"] == 6 and state["best"]["step"] == 4  # saved at steps 3, 4 (epoch end) and 6
    resumed = train_tiny(tmp_path, inputs, "resumed", drafter=drafter, train=train, save_every_steps=3)
    assert resumed["resumed_from_step"] == 6 and resumed["kept"] == full["kept"]
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == (tmp_path / "resumed" / "model.safetensors").read_bytes()
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("full", "resumed")]
    for config in configs:
        del config["eyrie"]["metrics"], config["eyrie"]["files"], config["eyrie_digest"]  # wall times, and digests of files holding them
    assert configs[0] == configs[1]
    log_full = json.loads((tmp_path / "full" / "training_log.json").read_text())
    log_resumed = json.loads((tmp_path / "resumed" / "training_log.json").read_text())
    assert [e["loss"] for e in log_full] == [e["loss"] for e in log_resumed] and [e["lr"] for e in log_full] == [e["lr"] for e in log_resumed]

    written = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert written["input_norm.weight"].shape == (96,)  # 3 x target hidden 32
    for name, weight in snapshots[4].items():
        assert torch.equal(written[name], weight), name
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["norm_before_fc"] is config["eagle_config"]["norm_before_fc"] is config["norm_output"] is True
    assert config["eyrie"]["drafter"]["norm_before_fc"] is True and config["eyrie"]["train"]["hidden_noise"] == 0.3
    model = load_drafter(tmp_path / "full", torch.randn(120, 32))
    assert model.shape.norm_before_fc and model.shape.norm_output and torch.equal(model.input_norm.weight, written["input_norm.weight"])


# --------------------------------------------------------------------------- train.hard_label_weight


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_hard_labels_mix_a_one_hot_on_the_targets_argmax_into_its_distribution(weight):
    """Each needed position's label is (1 - w) * the target's draft-vocab distribution + w * a one-hot on its argmax; a position
    whose full-vocabulary argmax lies outside the draft vocabulary (never trained) keeps the plain distribution."""
    from eyrie.training.objective import target_distribution

    g = torch.Generator().manual_seed(1)
    B, L, H, V = 2, 9, 16, 50
    final, lm_head = torch.randn(B, L, H, generator=g), torch.randn(V, H, generator=g)
    needed = torch.rand(B, L, generator=g) > 0.3
    draft_ids = torch.arange(0, V, 2)  # the even tokens: about half the argmaxes fall outside
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    plain, row, arg = target_distribution(final, needed, lm_head, draft_ids, t2d)
    mixed, row_mixed, arg_mixed = target_distribution(final, needed, lm_head, draft_ids, t2d, hard_label_weight=weight)
    assert torch.equal(row, row_mixed) and torch.equal(arg, arg_mixed)
    draft_arg = torch.full((plain.shape[0],), -1, dtype=torch.long)
    draft_arg[row[row >= 0]] = arg[row >= 0]
    inside = draft_arg >= 0
    assert 0 < int(inside.sum()) < plain.shape[0]  # both kinds of row occur
    expected = plain.clone()
    expected[inside] = (1 - weight) * plain[inside] + weight * torch.nn.functional.one_hot(draft_arg[inside], plain.shape[1]).float()
    assert torch.allclose(mixed, expected, atol=1e-7)
    assert torch.equal(mixed[~inside], plain[~inside])
    assert torch.allclose(mixed.sum(-1), torch.ones(plain.shape[0]), atol=1e-6)


def test_hard_label_weight_one_trains_on_the_targets_argmax_alone(tmp_path):
    """w = 1: the loss of a training step is the cross-entropy of the draft logits against the target's argmax, computed
    here from the drafter's own logits; training with it writes other weights than soft labels and records the setting."""

    from eyrie.training.objective import TTTObjective, needed_targets, step_targets, target_distribution, train_step, ttt_hidden
    from eyrie.training.optimizer import make_optimizer

    g = torch.Generator().manual_seed(4)
    B, L, H, V = 2, 13, 32, 120
    lengths = torch.tensor([L, L - 4])
    batch = {"aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g),
             "input_ids": torch.randint(0, V, (B, L), generator=g), "loss_mask": torch.rand(B, L, generator=g) > 0.2,
             "lengths": lengths, "tokens": int(lengths.sum())}
    head = torch.randn(V, H, generator=g)
    model = training_drafter(Vd=40)
    draft_ids = torch.arange(40) + model.d2t
    with torch.no_grad():  # the expected loss, before the step changes the weights: sum_j 0.8^j * mean_j CE(logits, argmax)
        _, row, arg = target_distribution(batch["final"], needed_targets(batch["loss_mask"], lengths), head, draft_ids, model.t2d)
        targets = [step_targets(j, row, arg, batch["loss_mask"], lengths) for j in range(3)]
        outs = ttt_hidden(model, batch["aux"], batch["input_ids"], lengths, 3, select=[t[0] for t in targets])
        expected = sum(0.8**j * torch.nn.functional.cross_entropy(model.head(out), a[valid]).item()
                       for j, (out, (valid, _, a)) in enumerate(zip(outs, targets)))
    objective = TTTObjective(model, 3, 0.8, hard_label_weight=1.0)
    result = train_step(objective, make_optimizer(model, 1e-2, 0.0), batch, target_lm_head=head, draft_ids=draft_ids, t2d=model.t2d,
                        max_grad_norm=1e6, use_bf16=False)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)

    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    train_tiny(tmp_path, inputs, "soft", train={**TRAIN, "epochs": 1})
    train_tiny(tmp_path, inputs, "hard", train={**TRAIN, "epochs": 1, "hard_label_weight": 1.0})
    soft, hard = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("soft", "hard"))
    assert not torch.equal(soft["fc.weight"], hard["fc.weight"])
    assert json.loads((tmp_path / "hard" / "config.json").read_text())["eyrie"]["train"]["hard_label_weight"] == 1.0


# --------------------------------------------------------------------------- train.copy_weight


def _looping_batch(B=2, L=24, H=32, V=120, seed=6):
    """A batch whose rows repeat themselves, so that prompt lookup drafts many of their labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    ids[:, 12:] = ids[:, 2:14]  # each row quotes its own start
    lengths = torch.tensor([L, L - 3])
    return {"aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g), "input_ids": ids,
            "loss_mask": torch.arange(L)[None, :].expand(B, L) >= 4, "lengths": lengths, "tokens": int(lengths.sum())}


def _loss_by_hand(model, batch: dict, head, draft_ids, trained, weight_at) -> tuple[float, list]:
    """(sum_j 0.8^j * sum over step j's trained positions t of weight_at(j)[t] * CE(label) / count_j, step j's targets),
    from the drafter's own logits over 3 TTT steps: what train_step's loss must come to."""
    from eyrie.training.objective import needed_targets, step_targets, target_distribution, ttt_hidden

    lengths = batch["lengths"]
    with torch.no_grad():
        probs, row, arg = target_distribution(batch["final"], needed_targets(trained, lengths), head, draft_ids, model.t2d)
        targets = [step_targets(j, row, arg, trained, lengths) for j in range(3)]
        outs = ttt_hidden(model, batch["aux"], batch["input_ids"], lengths, 3, select=[t[0] for t in targets])
        expected = 0.0
        for j, (out, (valid, rows, _)) in enumerate(zip(outs, targets)):
            cross_entropy = -(probs[rows[valid]] * torch.log_softmax(model.head(out).float(), -1)).sum(-1)
            expected += 0.8**j * (weight_at(j)[valid] * cross_entropy).sum().item() / int(valid.sum())
    return expected, targets


def test_copy_weight_scales_the_label_rows_prompt_lookup_would_draft():
    from eyrie.training.copyable import copyable_positions
    from eyrie.training.objective import needed_targets, target_distribution, weight_copyable_labels

    batch = _looping_batch()
    g = torch.Generator().manual_seed(2)
    head, draft_ids = torch.randn(120, 32, generator=g), torch.arange(120)
    needed = needed_targets(batch["loss_mask"], batch["lengths"])
    probs, row, _ = target_distribution(batch["final"], needed, head, draft_ids, torch.ones(120, dtype=torch.bool))
    weighted = weight_copyable_labels(probs.clone(), row, batch["input_ids"], batch["lengths"], 120, 3.0)
    copyable = copyable_positions(batch["input_ids"], batch["lengths"], 120, 3) & (row >= 0)
    assert 5 < int(copyable.sum()) < int((row >= 0).sum())  # both kinds of label occur
    scaled = torch.zeros(probs.shape[0], dtype=torch.bool)
    scaled[row[copyable]] = True
    assert torch.allclose(weighted[scaled], 3.0 * probs[scaled]) and torch.equal(weighted[~scaled], probs[~scaled])
    assert weight_copyable_labels(probs, row, batch["input_ids"], batch["lengths"], 120, 1.0) is probs  # 1: untouched


def test_a_training_step_with_copy_weight_weighs_each_copyable_label_w_times(tmp_path):
    """The step's loss is sum_j 0.8^j * sum over step j's positions of w(label) * CE(label) / count_j, computed here from the
    drafter's own logits; a run with it trains other weights than without, and records the setting."""

    from eyrie.training.copyable import copyable_positions
    from eyrie.training.objective import TTTObjective, train_step
    from eyrie.training.optimizer import make_optimizer

    batch = _looping_batch()
    lengths, w = batch["lengths"], 4.0
    head = torch.randn(120, 32, generator=torch.Generator().manual_seed(3))
    model = training_drafter(Vd=120)
    draft_ids = torch.arange(120) + model.d2t
    copyable = copyable_positions(batch["input_ids"], lengths, 120, 3)
    # The label's row sits at t + 1 + j.
    expected, _ = _loss_by_hand(model, batch, head, draft_ids, batch["loss_mask"], lambda j: torch.where(torch.roll(copyable, -(1 + j), dims=1), w, 1.0))
    objective = TTTObjective(model, 3, 0.8, copy_weight=w)
    result = train_step(objective, make_optimizer(model, 1e-2, 0.0), batch, target_lm_head=head, draft_ids=draft_ids, t2d=model.t2d,
                        max_grad_norm=1e6, use_bf16=False)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)

    samples = [(ids + ids[2:], [0] * 2 + [1] * (2 * len(ids) - 4)) for ids, _ in random_samples(**SAMPLES)]  # replies that quote
    inputs = tiny_setup(tmp_path, samples=samples, V=120)
    train_tiny(tmp_path, inputs, "plain", train={**TRAIN, "epochs": 1})
    train_tiny(tmp_path, inputs, "copying", train={**TRAIN, "epochs": 1, "copy_weight": 4.0})
    plain, copying = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("plain", "copying"))
    assert not torch.equal(plain["fc.weight"], copying["fc.weight"])
    assert json.loads((tmp_path / "copying" / "config.json").read_text())["eyrie"]["train"]["copy_weight"] == 4.0


# --------------------------------------------------------------------------- train.prompt_label_weight


def test_prompt_labels_add_the_prompts_tokens_and_weigh_only_their_rows():
    from eyrie.training.objective import needed_targets, step_targets, target_distribution, trained_tokens, weight_prompt_labels

    batch = _looping_batch()
    loss_mask, lengths = batch["loss_mask"], batch["lengths"]
    assert trained_tokens(loss_mask, lengths, 0.0) is loss_mask  # 0: replies only, as before
    trained = trained_tokens(loss_mask, lengths, 0.5)
    assert torch.equal(trained, torch.arange(loss_mask.shape[1])[None, :] < lengths[:, None])  # every real token, no padding

    g = torch.Generator().manual_seed(4)
    head, draft_ids, t2d = torch.randn(120, 32, generator=g), torch.arange(120), torch.ones(120, dtype=torch.bool)
    probs, row, arg = target_distribution(batch["final"], needed_targets(trained, lengths), head, draft_ids, t2d)
    replies_only = step_targets(0, *target_distribution(batch["final"], needed_targets(loss_mask, lengths), head, draft_ids, t2d)[1:],
                                loss_mask, lengths)[0]
    with_prompts = step_targets(0, row, arg, trained, lengths)[0]
    assert int(with_prompts.sum()) > int(replies_only.sum()) and bool((with_prompts | ~replies_only).all())  # a superset

    weighted = weight_prompt_labels(probs.clone(), row, loss_mask, 0.25)
    prompt_rows = row[(row >= 0) & ~loss_mask.roll(-1, dims=1)]  # row s predicts token s + 1
    scaled = torch.zeros(probs.shape[0], dtype=torch.bool)
    scaled[prompt_rows] = True
    assert 0 < int(scaled.sum()) < probs.shape[0]  # both kinds of label occur
    assert torch.allclose(weighted[scaled], 0.25 * probs[scaled]) and torch.equal(weighted[~scaled], probs[~scaled])
    assert weight_prompt_labels(probs, row, loss_mask, 1.0) is probs


def test_a_training_step_with_prompt_labels_trains_the_prompts_positions_at_their_weight(tmp_path):
    """The step's loss is sum_j 0.8^j * sum over step j's positions (now the prompts' too) of w(label) * CE(label) / count_j;
    a run with it trains other weights than without, and records the setting; its held-out simulation counts replies only."""

    from eyrie.training.objective import TTTObjective, train_step, trained_tokens
    from eyrie.training.optimizer import make_optimizer

    batch = _looping_batch()
    loss_mask, lengths, w = batch["loss_mask"], batch["lengths"], 0.5
    head = torch.randn(120, 32, generator=torch.Generator().manual_seed(3))
    model = training_drafter(Vd=120)
    draft_ids = torch.arange(120) + model.d2t
    trained = trained_tokens(loss_mask, lengths, w)
    # Step j predicts token t + 2 + j.
    expected, targets = _loss_by_hand(model, batch, head, draft_ids, trained, lambda j: torch.where(torch.roll(loss_mask, -(2 + j), dims=1), 1.0, w))
    objective = TTTObjective(model, 3, 0.8, prompt_label_weight=w)
    result = train_step(objective, make_optimizer(model, 1e-2, 0.0), batch, target_lm_head=head, draft_ids=draft_ids, t2d=model.t2d,
                        max_grad_norm=1e6, use_bf16=False)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["stats"][0][2] == int(targets[0][0].sum())

    samples = [(ids, [0] * 6 + [1] * (len(ids) - 6)) for ids, _ in random_samples(**SAMPLES)]  # prompts of 6 tokens
    inputs = tiny_setup(tmp_path, samples=samples, V=120)
    train_tiny(tmp_path, inputs, "replies", train={**TRAIN, "epochs": 1})
    train_tiny(tmp_path, inputs, "prompts", train={**TRAIN, "epochs": 1, "prompt_label_weight": 1.0})
    replies, prompts = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("replies", "prompts"))
    assert not torch.equal(replies["fc.weight"], prompts["fc.weight"])
    config = json.loads((tmp_path / "prompts" / "config.json").read_text())
    assert config["eyrie"]["train"]["prompt_label_weight"] == 1.0
    logs = [json.loads((tmp_path / name / "training_log.json").read_text()) for name in ("replies", "prompts")]
    trained = [log[0]["positions_per_step"][0] for log in logs]  # the first step's trained positions
    assert trained[1] > trained[0]
    simulated = [[e["positions_per_step"] for entry in log for e in entry.get("eval") or []] for log in logs]
    assert simulated[0] and simulated[0] == simulated[1]  # the simulation drafts the same reply positions in both


# --------------------------------------------------------------------------- train.hidden_noise


def test_hidden_noise_is_uniform_per_sample_and_independent_of_the_batch():
    """U(-a, a) on each real token's aux states, none on padding; a sample's noise depends on the seed, the epoch and
    the sample alone: the same in another batch, row or padded length (resume, data-parallel ranks)."""
    a, width = 0.05, 96
    refs = [(0, 0, 30), (1, 7, 12)]
    aux = torch.zeros(2, 30, width)
    add_hidden_noise(aux, refs, a, seed=3, epoch=1)
    real = aux[0].flatten()
    assert real.abs().max() <= a and real.min() < -0.9 * a and real.max() > 0.9 * a and abs(float(real.mean())) < 0.01
    assert aux[1, :12].abs().max() <= a and aux[1, 12:].abs().max() == 0  # padding stays as it is

    alone = torch.zeros(1, 12, width)
    add_hidden_noise(alone, [(1, 7, 12)], a, seed=3, epoch=1)
    assert torch.equal(alone[0], aux[1, :12])
    base = torch.randn(1, 12, width)
    shifted = base.clone()
    add_hidden_noise(shifted, [(1, 7, 12)], a, seed=3, epoch=1)
    assert torch.allclose(shifted - base, alone, atol=1e-6)  # added to the states, not replacing them
    for seed, epoch, ref in ((4, 1, (1, 7, 12)), (3, 2, (1, 7, 12)), (3, 1, (1, 8, 12)), (3, 1, (0, 7, 12))):
        other = torch.zeros(1, 12, width)
        add_hidden_noise(other, [ref], a, seed=seed, epoch=epoch)
        assert not torch.equal(other, alone), (seed, epoch, ref)


def test_hidden_noise_reaches_training_steps_only(tmp_path, monkeypatch):
    """train.hidden_noise: every training batch is noised once, the held-out simulation's never; it changes the weights; 0 is off."""
    import eyrie.training.noise as noise_module

    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    calls = []
    real_noise = noise_module.add_hidden_noise

    def spy(aux, refs, amplitude, *, seed, epoch):
        calls.append((sorted(refs), amplitude, epoch))
        real_noise(aux, refs, amplitude, seed=seed, epoch=epoch)

    monkeypatch.setattr(train_module, "add_hidden_noise", spy)
    train_tiny(tmp_path, inputs, "noised", train={**TRAIN, "epochs": 2, "hidden_noise": 0.5, "keep_best": False})
    batches = [sorted(r) for r, _, _ in calls]
    assert len(calls) == 8 and {amplitude for _, amplitude, _ in calls} == {0.5} and [e for _, _, e in calls] == [0] * 4 + [1] * 4
    samples = sorted(ref for refs in batches[:4] for ref in refs)
    assert len(samples) == 5 and sorted(ref for refs in batches[4:] for ref in refs) == samples  # each training sample once per epoch
    train_tiny(tmp_path, inputs, "plain", train={**TRAIN, "epochs": 2, "keep_best": False})
    assert len(calls) == 8  # hidden_noise 0: never called
    noised, plain = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("noised", "plain"))
    assert not torch.equal(noised["fc.weight"], plain["fc.weight"])


# --------------------------------------------------------------------------- train.lr_schedule


def test_learning_rate_schedules_share_the_warmup_then_decay_as_named():
    total, base, warmup_ratio = 20, 1e-3, 0.25  # 5 warmup steps
    schedules = {s: [learning_rate(step, total, base, warmup_ratio, s) for step in range(total)] for s in ("cosine", "linear", "constant")}
    warmup = [base * (step + 1) / 5 for step in range(5)]
    for lrs in schedules.values():
        assert lrs[:5] == pytest.approx(warmup) and lrs[5] == pytest.approx(base)
    assert schedules["constant"][5:] == [base] * 15
    assert schedules["linear"][5:] == pytest.approx([base * (1 - k / 15) for k in range(15)])
    assert schedules["cosine"][5:] == pytest.approx([base * 0.5 * (1 + math.cos(math.pi * k / 15)) for k in range(15)])
    assert [learning_rate(step, total, base, warmup_ratio) for step in range(total)] == schedules["cosine"]  # the default, as before
    with pytest.raises(ValueError, match="train.lr_schedule is 'step'"):
        learning_rate(0, total, base, warmup_ratio, "step")


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_the_training_log_follows_the_schedule(tmp_path, schedule):
    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    train_tiny(tmp_path, inputs, train={**TRAIN, "epochs": 2, "lr_schedule": schedule})
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert [e["lr"] for e in log] == [learning_rate(step, 8, 3e-3, 0.2, schedule) for step in range(8)]


# --------------------------------------------------------------------------- the EAGLE-3.1 norms in training


def test_compiled_train_step_with_both_norms_equals_eager():
    """train.compile's layer_output applies norm_output's norm as the eager layer does (with MLP recompute replaying it)."""
    norms = {"norm_before_fc": True, "norm_output": True}
    eager, eager_grads, _ = train_step_once(False, "eager", True, **norms)
    result, grads, compiled = train_step_once(True, "eager", True, **norms)
    assert compiled.error is None, compiled.error
    assert abs(result["loss"] - eager["loss"]) <= 1e-6 * abs(eager["loss"])
    assert len(grads) == 14 and grads["input_norm.weight"].abs().max() > 0  # the aux norm trains
    for name, grad in eager_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-6), name


def test_the_held_out_simulation_runs_the_normed_drafter(tmp_path):
    """Both norms through a real run: the simulation ran (no scripted stand-in) and its record is config.json's."""
    inputs = tiny_setup(tmp_path, samples=random_samples(**SAMPLES), V=120)
    summary = train_tiny(tmp_path, inputs, drafter={"norm_before_fc": True, "norm_output": True}, train={**TRAIN, "epochs": 1})
    assert without_seconds(read_simulated_acceptance(tmp_path / "drafter")) == without_seconds(summary["simulated_acceptance"])
    assert summary["simulated_acceptance"]["positions_per_step"][0] > 0
