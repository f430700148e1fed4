"""train.fused_pointwise: the rotary on q and k and SiLU * up through torch.compile, each with its own backward, give eager's
values."""

from __future__ import annotations


import pytest
import torch
from factories import assert_fused_job_follows_eager, failing_compile, training_drafter

from eyrie.drafter import pointwise
from eyrie.drafter.pointwise import EAGER_POINTWISE, PointwiseKernels, apply_rotary, swiglu


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
    kernels = PointwiseKernels(fused=True)
    fused = _rotated_and_grads(kernels, dtype, out_dtype)
    assert kernels.error is None and kernels.active  # it ran compiled
    eager = _rotated_and_grads(EAGER_POINTWISE, dtype, out_dtype)
    # rotated in the dtype plain tensor math gives (float32 against the float32 tables) or out_dtype; gradients in the inputs'
    assert [t.dtype for t in fused] == [t.dtype for t in eager] == [out_dtype or torch.float32] * 2 + [dtype] * 2
    for a, b in zip(fused, eager):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    assert all(t.abs().max() > 0.5 for t in fused)  # not vacuous


def test_the_rotary_backward_is_the_formulas_transpose_in_float64():
    """The hand-written backward against autograd of the formula, exactly in float64 (eager math through the Function)."""
    kernels = PointwiseKernels(fused=True)
    kernels.compiled = lambda name: pointwise.PIECES[name]  # the Function's path, eager math
    fused = _rotated_and_grads(kernels, torch.float64)
    eager = _rotated_and_grads(EAGER_POINTWISE, torch.float64)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(fused, eager))


def _swiglu_and_grads(kernels, dtype, seed=4):
    """(silu(gate) * up, grad_gate, grad_up) for gate and up [3, 5, 16] in dtype and a random output gradient."""
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(3, 5, 16, generator=g)).to(dtype).requires_grad_(True)
    up = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_(True)
    out = swiglu(gate, up, kernels)
    return out.detach(), *torch.autograd.grad(out, [gate, up], torch.randn(out.shape, generator=g).to(dtype))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_swiglu_gives_the_eager_values_and_gradients(dtype, tol):
    kernels = PointwiseKernels(fused=True)
    fused = _swiglu_and_grads(kernels, dtype)
    assert kernels.error is None and kernels.active
    eager = _swiglu_and_grads(EAGER_POINTWISE, dtype)
    assert [t.dtype for t in fused] == [t.dtype for t in eager] == [dtype] * 3
    for a, b in zip(fused, eager):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    assert all(t.abs().max() > 0.5 for t in fused)


def test_the_swiglu_backward_is_the_formulas_derivative_in_float64():
    kernels = PointwiseKernels(fused=True)
    kernels.compiled = lambda name: pointwise.PIECES[name]  # the Function's path, eager math
    fused, eager = _swiglu_and_grads(kernels, torch.float64), _swiglu_and_grads(EAGER_POINTWISE, torch.float64)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(fused, eager))


def test_a_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    monkeypatch.setattr(pointwise, "_compiled", failing_compile)
    kernels = PointwiseKernels(fused=True)
    with pytest.warns(RuntimeWarning, match="train.fused_pointwise: torch.compile failed.*simulated inductor failure"):
        fused = _rotated_and_grads(kernels, torch.float32)
    assert kernels.error == "rotary_forward: RuntimeError: simulated inductor failure" and not kernels.active and kernels.fused
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(fused, _rotated_and_grads(EAGER_POINTWISE, torch.float32)))


def test_the_objective_fuses_the_layers_pointwise_pieces_only_when_asked_and_leaves_its_state_dict():
    from eyrie.training.objective import TTTObjective

    model = training_drafter(Vd=40)
    keys = set(model.state_dict())
    layer = (model.midlayer.self_attn, model.midlayer.mlp)
    assert all(part.pointwise_kernels is EAGER_POINTWISE for part in layer)
    plain = TTTObjective(model, 3, 0.8)
    assert not plain.pointwise_kernels.fused and not any(part.pointwise_kernels.active for part in layer)
    fused = TTTObjective(model, 3, 0.8, fused_pointwise=True)
    assert fused.pointwise_kernels.active and all(part.pointwise_kernels is fused.pointwise_kernels for part in layer)
    assert set(model.state_dict()) == keys


def test_a_training_job_with_fused_pointwise_pieces_follows_the_eager_run_and_says_so(tmp_path):
    """train.fused_pointwise true on the CPU: the same loss curve as eager, and config.json records that it ran fused."""
    assert_fused_job_follows_eager(tmp_path, "fused_pointwise")
