"""train.fused_weight_grads: each trained matrix cast once a step and its gradient summed by the products gives plain
autograd's training: the same in float32, within bf16 rounding under bf16 autocast; no weight-sized adds or extra casts."""

from __future__ import annotations

import collections
import contextlib
import json

import pytest
import torch
from factories import random_samples, run_two_ranks, tiny_setup, train_tiny, training_drafter
from torch.utils._python_dispatch import TorchDispatchMode

from eyrie.drafter.model import DraftAttention, apply_linears
from eyrie.training import weight_grads
from eyrie.training.objective import TTTObjective, train_step
from eyrie.training.optimizer import make_optimizer
from eyrie.training.weight_grads import GradSum, add_float32_product, settle

H, V, VD, TTT = 32, 120, 40, 3


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


def tiny_batch(B=2, L=11, seed=5):
    """A batch for training_drafter (L = 11: no activation row count equals a weight's dimension, for the census)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([L] + [max(3, L - 4)] * (B - 1))  # a padded row too
    batch = {
        "aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g),
        "input_ids": torch.randint(0, V, (B, L), generator=g), "loss_mask": torch.rand(B, L, generator=g) > 0.2,
        "lengths": lengths, "tokens": int(lengths.sum()),
    }
    return batch, torch.randn(V, H, generator=g)


def train(fused, *, use_bf16=False, steps=3, attention="flex", recompute_mlp=False, chunked_loss=True, compile=False, lr=1e-3, seed=5,
          stacked=True):
    """steps train_steps of a fresh tiny drafter: (losses, step 0's gradients, the weights' moves over all steps).
    stacked: with fused, q, k and v as one product (TTTObjective's stacked_products)."""
    model = training_drafter(Vd=VD).train()
    batch, head = tiny_batch(seed=seed)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    objective = TTTObjective(model, TTT, 0.8, attention=attention, recompute_mlp=recompute_mlp, chunked_loss=chunked_loss, compile=compile,
                             fused_weight_grads=fused, stacked_products=stacked)
    optimizer = make_optimizer(model, lr, 0.0)
    losses, grads = [], None
    for step in range(steps):
        result = train_step(objective, optimizer, batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t, t2d=model.t2d,
                            max_grad_norm=1e6, use_bf16=use_bf16)  # no clipping: the raw gradients are compared
        losses.append(result["loss"])
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    moves = {n: p.detach() - start[n] for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads, moves


def relative(a: dict, b: dict) -> dict:
    """Per tensor: max |a - b| over max |b|."""
    return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b}


@pytest.mark.parametrize("fused", ["compute", "float32"])
@pytest.mark.parametrize("attention, recompute_mlp, chunked_loss", [("flex", False, True), ("eager", False, True), ("flex", True, True),
                                                                    ("eager", False, False)])
def test_float32_training_is_plain_autograds(fused, attention, recompute_mlp, chunked_loss):
    """In float32 every use's product and every sum is float32 either way: three steps give plain autograd's losses, each
    gradient (all 13 trained tensors, the head's through the chunked loss or the reference loss) and weights to 1e-6;
    MLP recompute replays the products through the step's copies."""
    plain = train(None, attention=attention, recompute_mlp=recompute_mlp, chunked_loss=chunked_loss)
    fused_run = train(fused, attention=attention, recompute_mlp=recompute_mlp, chunked_loss=chunked_loss)
    assert fused_run[0] == pytest.approx(plain[0], rel=1e-6)
    assert fused_run[1].keys() == plain[1].keys() and len(plain[1]) == 13
    for name, grad in plain[1].items():
        assert grad.abs().max() > 0, name  # not vacuous
        assert torch.allclose(fused_run[1][name], grad, rtol=1e-5, atol=1e-7), (name, (fused_run[1][name] - grad).abs().max())
    for name, move in plain[2].items():
        assert torch.allclose(fused_run[2][name], move, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("attention", ["flex", "eager"])
def test_q_k_v_as_one_stacked_product_or_three_give_plain_autograds_float32_training(stacked, attention):
    """q, k and v as one product over the stacked step copy (the default) or as three: plain autograd's losses and each
    gradient to float32 rounding, q's, k's and v's among them (each its own rows of the stacked sum)."""
    plain = train(None, attention=attention, steps=2)
    fused_run = train("compute", attention=attention, steps=2, stacked=stacked)
    assert fused_run[0] == pytest.approx(plain[0], rel=1e-6)
    assert fused_run[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        assert torch.allclose(fused_run[1][name], grad, rtol=1e-5, atol=1e-7), (name, (fused_run[1][name] - grad).abs().max())


def test_the_stacked_product_leaves_the_attention_and_its_checkpoint_as_they_were():
    """During the step the attention's q, k, v go through the step's stacked product; after it, through the class's plain
    products again (nothing left on the instance), and the state dict holds q_proj, k_proj and v_proj as before."""
    model = training_drafter(Vd=VD).train()
    attention = model.midlayer.self_attn
    keys = list(model.state_dict())
    batch, head = tiny_batch()
    objective = TTTObjective(model, TTT, 0.8, attention="flex", fused_weight_grads="compute")
    seen = []
    real_weights_for_step = TTTObjective.weights_for_step

    @contextlib.contextmanager
    def weights_for_step(self, dtype):
        with real_weights_for_step(self, dtype) as step:
            seen.append(attention.shared_input_linears)
            yield step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TTTObjective, "weights_for_step", weights_for_step)
        train_step(objective, make_optimizer(model, 1e-3, 0.0), batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t,
                   t2d=model.t2d, max_grad_norm=1e6, use_bf16=False)
    assert len(seen) == 1 and seen[0].__func__ is weight_grads.StepWeights.stacked_linear
    assert "shared_input_linears" not in vars(attention) and attention.shared_input_linears is apply_linears
    assert DraftAttention.shared_input_linears is apply_linears
    assert list(model.state_dict()) == keys
    assert {"midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"} <= set(keys)


@pytest.mark.parametrize("k_proj", ["frozen", "biased"])
def test_q_k_v_stay_three_products_unless_all_three_are_trained_bias_free_linears(k_proj, monkeypatch):
    """The stacked copy holds trained weights and no biases: with k_proj frozen or biased, q, k and v run as their own
    products (k's plain), no stacked copy is made, and the step gives plain autograd's gradients."""
    stacked_copies = []
    real_stacked_weight = weight_grads.StepWeights.stacked_weight

    def stacked_weight(self, weights):
        stacked_copies.append(weights)
        return real_stacked_weight(self, weights)

    monkeypatch.setattr(weight_grads.StepWeights, "stacked_weight", stacked_weight)

    def gradients(fused):
        model = training_drafter(Vd=VD).train()
        attention = model.midlayer.self_attn
        if k_proj == "frozen":
            attention.k_proj.weight.requires_grad_(False)
        else:
            biased = torch.nn.Linear(attention.k_proj.in_features, attention.k_proj.out_features)
            with torch.no_grad():
                biased.weight.copy_(attention.k_proj.weight)
            attention.k_proj = biased
        batch, head = tiny_batch()
        objective = TTTObjective(model, TTT, 0.8, attention="flex", fused_weight_grads=fused)
        result = train_step(objective, make_optimizer(model, 0.0, 0.0), batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t,
                            t2d=model.t2d, max_grad_norm=1e6, use_bf16=False)
        return result["loss"], {n: p.grad for n, p in model.named_parameters()}

    plain, fused = gradients(None), gradients("compute")
    assert not stacked_copies
    assert fused[0] == pytest.approx(plain[0], rel=1e-6)
    assert (plain[1]["midlayer.self_attn.k_proj.weight"] is None) == (k_proj == "frozen")
    for name, grad in plain[1].items():
        assert (grad is None) == (fused[1][name] is None), name
        if grad is not None:
            assert torch.allclose(fused[1][name], grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("stacked", [True, False])
def test_the_values_held_across_ttt_steps_hold_only_v(stacked, monkeypatch):
    """q, k and v as one product: the v the flex path holds for later TTT steps is a compact copy, not a view that would
    keep the whole product (q's and k's columns too) alive through the forward."""
    from eyrie.training import ttt_attention

    held = []
    real_attention = ttt_attention.flex_ttt_attention

    def flex_ttt_attention(q, keys, values, block_mask):
        held.append(values[-1].untyped_storage().nbytes() / (values[-1].numel() * values[-1].element_size()))
        return real_attention(q, keys, values, block_mask)

    monkeypatch.setattr(ttt_attention, "flex_ttt_attention", flex_ttt_attention)
    train("compute", steps=1, stacked=stacked)
    assert held == [1.0] * TTT


def test_with_train_compile_too():
    """train.compile runs the layer's products eagerly between its compiled pieces, so they go through the step's copies
    as well (MLP recompute replaying them): plain autograd's float32 training with train.compile."""
    plain = train(None, compile=True, recompute_mlp=True, steps=2)
    fused_run = train("compute", compile=True, recompute_mlp=True, steps=2)
    assert fused_run[0] == pytest.approx(plain[0], rel=1e-6)
    for name, grad in plain[1].items():
        assert torch.allclose(fused_run[1][name], grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("fused", ["compute", "float32"])
def test_bf16_autocast_training_is_plain_autograds_to_bf16_rounding(fused):
    """Under bf16 autocast (as on CUDA) the sums round differently (once per use, or not at all in float32) from plain
    autograd's bf16 adds: step 0's gradients within 2% of each tensor's largest of plain autograd's, no farther from
    float32 training's than plain autograd's are (x 1.2); the weights' moves over 3 AdamW steps within 10% of plain
    autograd's (norm of the difference, per tensor), and all together closer to plain autograd's than plain autograd's
    are to float32 training's."""
    reference = train(None)
    plain = train(None, use_bf16=True)
    fused_run = train(fused, use_bf16=True)
    assert fused_run[0] == pytest.approx(plain[0], rel=2e-3)
    assert max(relative(fused_run[1], plain[1]).values()) < 0.02, relative(fused_run[1], plain[1])
    assert max(relative(fused_run[1], reference[1]).values()) <= 1.2 * max(relative(plain[1], reference[1]).values())
    for name, move in plain[2].items():
        assert (fused_run[2][name] - move).norm() <= 0.1 * move.norm(), name

    def joined(moves):
        return torch.cat([moves[name].flatten() for name in sorted(moves)])

    assert (joined(fused_run[2]) - joined(plain[2])).norm() < (joined(plain[2]) - joined(reference[2])).norm()


STACKED_QKV = (32 + 16 + 16, 2 * H)  # training_drafter's q, k and v weights stacked by rows


class Census(TorchDispatchMode):
    """aten ops whose output has the shape of one of `shapes` (the trained matrices, the stacked q, k, v), by name, and by
    (name, shape)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.ops, self.by_shape = shapes, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_tensor(out) and out.dim() == 2 and tuple(out.shape) in self.shapes:
            self.ops[func.overloadpacket.__name__] += 1
            self.by_shape[func.overloadpacket.__name__, tuple(out.shape)] += 1
        return out


def census(fused, monkeypatch, stacked=True) -> Census:
    """Matrix-shaped aten ops of one bf16-autocast step's forward and backward (weights_for_step's span: the optimizer and
    clipping left out)."""
    model = training_drafter(Vd=VD).train()
    batch, head = tiny_batch()
    objective = TTTObjective(model, TTT, 0.8, attention="flex", fused_weight_grads=fused, stacked_products=stacked)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    shapes = {tuple(p.shape) for p in matrices} | {STACKED_QKV}
    assert len(matrices) == 9 and STACKED_QKV not in {tuple(p.shape) for p in matrices}
    assert 22 not in {d for shape in shapes for d in shape}  # B x L = 22 rows: no activation counted
    seen = Census(shapes)
    real_weights_for_step = TTTObjective.weights_for_step

    @contextlib.contextmanager
    def counted(self, dtype):
        with seen, real_weights_for_step(self, dtype) as step:
            yield step

    monkeypatch.setattr(TTTObjective, "weights_for_step", counted)
    train_step(objective, make_optimizer(model, 0.0, 0.0), batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t, t2d=model.t2d,
               max_grad_norm=1.0, use_bf16=True)
    monkeypatch.undo()
    return seen


def test_each_matrix_is_cast_once_and_its_uses_gradients_summed_by_the_products(monkeypatch):
    """The op census of one bf16 step (9 trained matrices, 3 TTT steps, one loss chunk per TTT step): plain autograd casts
    the 8 layer matrices and fc once (autocast's cache) and their bf16 sums back, the head twice per TTT step, and sums
    the uses with weight-sized adds; the fused path (q, k, v as three products) casts each matrix once, the 8
    compute-dtype sums back and the head once more for all its TTT steps' backwards, and adds nothing: each use's product
    writes into the sum (addmm_)."""
    plain, fused = census(None, monkeypatch).ops, census("compute", monkeypatch, stacked=False).ops
    uses = 1 + 7 * TTT + TTT  # fc, the layer's 7 matrices per TTT step, the head's one chunk per TTT step
    assert plain["_to_copy"] == 8 + 8 + 2 * TTT and plain["add"] == 7 * (TTT - 1) + (TTT - 1) and plain["add_"] == TTT
    assert plain["zeros"] == TTT and plain["mm"] == uses  # the head's per-step float32 gradient, zero-filled, then added to
    assert fused["_to_copy"] == 9 + 8 + 1
    assert fused["add"] == fused["add_"] == fused["zeros"] == 0
    assert fused["mm"] + fused["addmm_"] == uses and fused["mm"] == 9  # a sum's first product writes it, the others add into it


def test_q_k_v_are_cast_once_into_one_stacked_copy_and_their_gradient_is_one_product_per_use(monkeypatch):
    """Stacked (the default): q's, k's and v's weights are copied, cast, into one stacked copy once a step (no cast of
    their own), each TTT step's use is one weight-gradient product into the stacked sum, and the sum's row slices are
    cast back to the three weights; the other 6 matrices as before, and still no weight-sized adds."""
    seen = census("compute", monkeypatch)
    ops, by_shape = seen.ops, seen.by_shape
    assert by_shape["copy_", (32, 2 * H)] == 1 and by_shape["copy_", (16, 2 * H)] == 2 and ops["copy_"] == 3  # into the stacked copy's rows
    stacked = {name: n for (name, shape), n in by_shape.items() if shape == STACKED_QKV}
    assert stacked == {"new_empty": 1, "t": TTT, "mm": 1, "addmm_": TTT - 1}  # one copy, a forward and a weight-gradient product per TTT step
    uses = 1 + 5 * TTT + TTT  # fc, the stacked q, k, v and o, gate, up, down per TTT step, the head's one chunk per TTT step
    assert ops["mm"] + ops["addmm_"] == uses and ops["mm"] == 7
    assert ops["_to_copy"] == 6 + 8 + 1  # 6 casts (the stacked copy's are its copy_), 8 sums back (q, k, v: the stacked sum's rows), the head
    assert ops["add"] == ops["add_"] == ops["zeros"] == 0


def test_the_heads_backwards_share_one_cast_dropped_after_the_last(monkeypatch):
    """The draft head's TTT steps' backwards (the chunked loss) read one bf16 cast of the head, made by the first of them;
    the last drops it, so it is not held through the layer's backward."""
    returned, dropped = [], []
    real_get, real_done = GradSum.weight_for_backward, GradSum.backward_done

    def weight_for_backward(self, dtype):
        w = real_get(self, dtype)
        returned.append((w.data_ptr(), w.dtype, tuple(w.shape)))
        return w

    def backward_done(self):
        real_done(self)
        dropped.append(self.backward_copy is None)

    monkeypatch.setattr(GradSum, "weight_for_backward", weight_for_backward)
    monkeypatch.setattr(GradSum, "backward_done", backward_done)
    model = training_drafter(Vd=VD).train()
    batch, head = tiny_batch()
    objective = TTTObjective(model, TTT, 0.8, attention="flex", fused_weight_grads="compute")
    train_step(objective, make_optimizer(model, 1e-3, 0.0), batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t, t2d=model.t2d,
               max_grad_norm=1e6, use_bf16=True)
    assert len(returned) == TTT and len(set(returned)) == 1
    assert returned[0][1:] == (torch.bfloat16, tuple(model.lm_head.weight.shape))
    assert dropped == [False] * (TTT - 1) + [True]
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()


def test_a_float32_sum_becomes_the_gradient_without_a_copy(monkeypatch):
    """AccumulateGrad keeps the sum the uses wrote as .grad (no weight-sized copy), and the head's sum is float32; q's, k's
    and v's gradients are the stacked sum's rows, in place."""
    taken = {}
    real_take = GradSum.take

    def take(self):
        total = real_take(self)
        if self.weight is None:  # the stacked q, k, v: each weight's rows of the sum
            model_attention = model.midlayer.self_attn
            weights = (model_attention.q_proj.weight, model_attention.k_proj.weight, model_attention.v_proj.weight)
            for weight, rows in zip(weights, total.split([w.shape[0] for w in weights])):
                taken[id(weight)] = (rows.data_ptr(), rows.dtype)
        else:
            taken[id(self.weight)] = (total.data_ptr(), total.dtype)
        return total

    monkeypatch.setattr(GradSum, "take", take)
    model = training_drafter(Vd=VD).train()
    batch, head = tiny_batch()
    objective = TTTObjective(model, TTT, 0.8, attention="flex", fused_weight_grads="float32")
    train_step(objective, make_optimizer(model, 0.0, 0.0), batch, target_lm_head=head, draft_ids=torch.arange(VD) + model.d2t, t2d=model.t2d,
               max_grad_norm=1e6, use_bf16=True)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert len(matrices) == len(taken) == 9
    for p in matrices:
        assert taken[id(p)] == (p.grad.data_ptr(), torch.float32)


def test_the_float32_sum_of_bf16_products_is_exact_where_bf16_sums_round():
    """Seven uses' bf16 products: the float32 sum (one product each, accumulating in float32) is the float64 sum to float32
    rounding; bf16 sums round at each use, the compute-dtype sum once (the product and the sum in one), plain autograd's
    twice (the product, then the add): RMS errors about 3e-3 and 4e-3 of the sum's RMS."""
    g = torch.Generator().manual_seed(0)
    uses = [(torch.randn(64, 48, generator=g).bfloat16(), torch.randn(64, 40, generator=g).bfloat16()) for _ in range(7)]
    exact = sum(dy.double().T @ x.double() for dy, x in uses)
    float32_sum, compute_sum = GradSum(torch.float32, torch.zeros(48, 40)), GradSum(torch.bfloat16, torch.zeros(48, 40))
    for dy, x in uses:
        float32_sum.add(dy, x)
        compute_sum.add(dy, x)
    plain = sum((dy.T @ x for dy, x in uses[1:]), uses[0][0].T @ uses[0][1])  # bf16 products, bf16 adds
    def rms_error(total):
        return float((total.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())

    assert rms_error(float32_sum.take()) < 1e-6 < rms_error(compute_sum.take()) < rms_error(plain) < 1e-2


def test_float32_products_off_cuda_go_through_float32_copies():
    a, b = torch.randn(5, 7).bfloat16(), torch.randn(7, 3).bfloat16()
    total = add_float32_product(None, a, b)
    assert total.dtype == torch.float32 and torch.equal(total, a.float() @ b.float())
    assert add_float32_product(total, a, b) is total and torch.allclose(total, 2 * (a.float() @ b.float()))
    assert weight_grads.fallback_reason is None  # no CUDA attempt here, so nothing fell back


def test_a_torch_without_float32_products_falls_back_with_a_warning_and_says_why(monkeypatch):
    """The first float32 product of bf16 inputs on CUDA probes torch.mm / torch.addmm(out_dtype=float32) once, against
    float64's products; where they fail (here a CPU lacks them) the sums go through float32 copies, with a warning, and
    weight_grads.fallback_reason (the benchmark's line, config.json's fused_weight_grads.fallback) says why."""
    monkeypatch.setitem(weight_grads._FLOAT32_PRODUCTS, "work", None)
    monkeypatch.setattr(weight_grads, "fallback_reason", None)
    monkeypatch.setattr(weight_grads, "_probe", lambda device: "torch.mm / torch.addmm(..., out_dtype=torch.float32): simulated")
    with pytest.warns(RuntimeWarning, match="train.fused_weight_grads: .*simulated; float32 gradient sums go through float32 copies"):
        assert weight_grads._float32_products_work(torch.device("cpu")) is False
    assert weight_grads._float32_products_work(torch.device("cpu")) is False  # probed once
    assert weight_grads.fallback_reason.endswith("simulated")


def test_the_probe_checks_the_products_values():
    """On this CPU torch the out_dtype products are missing (the probe says so); where they run, their values were checked."""
    reason = weight_grads._probe(torch.device("cpu"))
    assert reason is None or reason.startswith("torch.mm / torch.addmm(..., out_dtype=torch.float32)")


@pytest.mark.parametrize("setting, device, settled", [("auto", "cuda", "compute"), ("auto", "cuda:1", "compute"), ("auto", "cpu", None),
                                                      (True, "cpu", "compute"), (False, "cuda", None), ("float32", "cpu", "float32")])
def test_auto_fuses_on_cuda_only(setting, device, settled):
    assert settle(setting, device) == settled


def test_a_run_resumes_across_the_fused_weight_grads_setting():
    """fused_weight_grads computes the same steps up to rounding, so it is no part of the run identity."""
    from eyrie.training.state import run_identity

    def identity(train):
        return run_identity([{"ids": ["a"]}], torch.zeros(4, dtype=torch.int64), {}, train, "t" * 64, "f" * 64)

    assert identity({"epochs": 1, "fused_weight_grads": "auto"}) == identity({"epochs": 1, "fused_weight_grads": "float32"})
    assert identity({"epochs": 1, "fused_weight_grads": False}) == identity({"epochs": 1}) != identity({"epochs": 2})


def test_a_training_job_with_fused_weight_grads_follows_plain_autograd_and_says_so(tmp_path):
    """train.fused_weight_grads true on the CPU (float32): the loss curve of plain autograd, and config.json records it."""
    inputs = tiny_setup(tmp_path, samples=random_samples(4, 24, 120, seed=3))
    plain = train_tiny(tmp_path, inputs, "plain", train={"fused_weight_grads": False, "epochs": 2, "batch_tokens": 48})
    fused = train_tiny(tmp_path, inputs, "fused", train={"fused_weight_grads": True, "epochs": 2, "batch_tokens": 48})
    log_plain = json.loads((tmp_path / "plain" / "training_log.json").read_text())
    log_fused = json.loads((tmp_path / "fused" / "training_log.json").read_text())
    assert len(log_plain) == len(log_fused) == plain["steps"] == fused["steps"] == 4
    for a, b in zip(log_plain, log_fused):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["eyrie"]["metrics"]["fused_weight_grads"] == {"sums": "compute", "fallback": None}
    assert "fused_weight_grads" not in json.loads((tmp_path / "plain" / "config.json").read_text())["eyrie"]["metrics"]


def test_two_ranks_with_fused_weight_grads_follow_one_plain_rank(tmp_path):
    """torchrun, 2 gloo ranks: the sums reach the weights through autograd, so DistributedDataParallel all-reduces them;
    the loss curve and final weights are those of one rank with plain autograd."""
    from safetensors.torch import load_file

    samples = random_samples(6, [32, 30, 29, 40, 44, 90], V, seed=7)
    inputs = tiny_setup(tmp_path, samples=samples, V=V)
    train_cfg = {"epochs": 2, "batch_tokens": 96, "learning_rate": 3e-3, "warmup_ratio": 0.2, "attention": "eager"}
    train_tiny(tmp_path, inputs, "one", train={**train_cfg, "fused_weight_grads": False})
    run_two_ranks(tmp_path, inputs, "two", {**train_cfg, "fused_weight_grads": True})
    log_one = json.loads((tmp_path / "one" / "training_log.json").read_text())
    log_two = json.loads((tmp_path / "two" / "training_log.json").read_text())
    assert len(log_one) == len(log_two) == 6
    for a, b in zip(log_one, log_two):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
    w_one, w_two = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    for key in w_one:
        assert torch.allclose(w_one[key].float(), w_two[key].float(), atol=1e-4), key
