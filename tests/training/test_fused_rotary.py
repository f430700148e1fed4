"""train.fused_rotary: the rotary on q and k through torch.compile, with its own backward, gives eager's values."""

from __future__ import annotations

import json

import pytest
import torch
from factories import random_samples, tiny_setup, train_tiny, training_drafter

from eyrie.drafter import rotary
from eyrie.drafter.rotary import EAGER_ROTARY, RotaryKernels, apply_rotary


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


def _rotated_and_grads(kernels, dtype, out_dtype=None, seed=3):
    """(q', k', grad_q, grad_k) for q [2, 4, 6, 8] and GQA k [2, 2, 6, 8] in dtype, cos and sin float32 tables of one row
    broadcast over rows and heads (as training passes them), and random output gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 6, 8, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 6, 8, generator=g).to(dtype).requires_grad_(True)
    angles = torch.randn(1, 1, 6, 4, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_out, k_out = apply_rotary(q, k, cos, sin, kernels, out_dtype)
    grads = torch.autograd.grad([q_out, k_out], [q, k], [torch.randn(q_out.shape, generator=g).to(q_out.dtype),
                                                          torch.randn(k_out.shape, generator=g).to(k_out.dtype)])
    return q_out.detach(), k_out.detach(), *grads


# bf16 gradients: eager rounds each of the two products' contributions to bf16 and adds them, fused rounds their sum once
@pytest.mark.parametrize("dtype, out_dtype, tol", [(torch.float32, None, 1e-6), (torch.bfloat16, None, 2e-2),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_fused_rotary_gives_the_eager_values_and_gradients(dtype, out_dtype, tol):
    kernels = RotaryKernels(fused=True)
    fused = _rotated_and_grads(kernels, dtype, out_dtype)
    assert kernels.error is None and kernels.active  # it ran compiled
    eager = _rotated_and_grads(EAGER_ROTARY, dtype, out_dtype)
    # rotated in the dtype plain tensor math gives (float32 against the float32 tables) or out_dtype; gradients in the inputs'
    assert [t.dtype for t in fused] == [t.dtype for t in eager] == [out_dtype or torch.float32] * 2 + [dtype] * 2
    for a, b in zip(fused, eager):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    assert all(t.abs().max() > 0.5 for t in fused)  # not vacuous


def test_the_backward_is_the_formulas_transpose_in_float64():
    """The hand-written backward against autograd of the formula, exactly in float64 (eager math through the Function)."""
    kernels = RotaryKernels(fused=True)
    kernels.compiled = lambda name: rotary.PIECES[name]  # the Function's path, eager math
    fused = _rotated_and_grads(kernels, torch.float64)
    eager = _rotated_and_grads(EAGER_ROTARY, torch.float64)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(fused, eager))


def test_a_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    def failing(name):
        def call(*args):
            raise RuntimeError("simulated inductor failure")

        return call

    monkeypatch.setattr(rotary, "_compiled", failing)
    kernels = RotaryKernels(fused=True)
    with pytest.warns(RuntimeWarning, match="train.fused_rotary: torch.compile failed.*simulated inductor failure"):
        fused = _rotated_and_grads(kernels, torch.float32)
    assert kernels.error == "forward: RuntimeError: simulated inductor failure" and not kernels.active and kernels.fused
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(fused, _rotated_and_grads(EAGER_ROTARY, torch.float32)))


def test_the_objective_fuses_the_drafter_rotary_only_when_asked_and_leaves_its_state_dict():
    from eyrie.training.objective import TTTObjective

    model = training_drafter(Vd=40)
    keys = set(model.state_dict())
    attention = model.midlayer.self_attn
    assert attention.rotary_kernels is EAGER_ROTARY
    plain = TTTObjective(model, 3, 0.8)
    assert not plain.rotary_kernels.fused and not attention.rotary_kernels.active
    fused = TTTObjective(model, 3, 0.8, fused_rotary=True)
    assert fused.rotary_kernels.active and attention.rotary_kernels is fused.rotary_kernels
    assert set(model.state_dict()) == keys


def test_a_training_job_with_fused_rotary_follows_the_eager_run_and_says_so(tmp_path):
    """train.fused_rotary true on the CPU: the same loss curve as eager, and config.json records that it ran fused."""
    inputs = tiny_setup(tmp_path, samples=random_samples(4, 24, 120, seed=3))
    eager = train_tiny(tmp_path, inputs, "eager", train={"fused_rotary": False, "epochs": 2, "batch_tokens": 48})
    fused = train_tiny(tmp_path, inputs, "fused", train={"fused_rotary": True, "epochs": 2, "batch_tokens": 48})
    assert "fused_rotary" not in eager and fused["fused_rotary"] == {"fused": True, "fallback": None}
    eager_losses, fused_losses = ([entry["loss"] for entry in json.loads((tmp_path / name / "training_log.json").read_text()) if "loss" in entry]
                                  for name in ("eager", "fused"))
    assert len(fused_losses) == len(eager_losses) > 1
    assert fused_losses == pytest.approx(eager_losses, rel=1e-5)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["eyrie"]["metrics"]["fused_rotary"] == {"fused": True, "fallback": None}
