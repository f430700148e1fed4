"""train.fused_norms: the drafter RMSNorm's forward and backward math through torch.compile gives eager's values."""

from __future__ import annotations


import pytest
import torch
from factories import assert_fused_job_follows_eager, failing_compile, training_drafter

from eyrie.drafter import rms_norm
from eyrie.drafter.rms_norm import EAGER_NORMS, NormKernels, RMSNorm, use_norm_kernels


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


def _norm_and_grads(kernels, dtype, x_grad=True, seed=2):
    """(output, grad_x or None, grad_weight) of an 8-wide RMSNorm with a moved weight over x [2, 5, 8] in dtype."""
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(8, 1e-6)
    norm.kernels = kernels
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(8, generator=g))
    x = (3 * torch.randn(2, 5, 8, generator=g)).to(dtype).requires_grad_(x_grad)
    grad = torch.randn(2, 5, 8, generator=g)
    out = norm(x)
    wanted = [x, norm.weight] if x_grad else [norm.weight]
    grads = torch.autograd.grad(out, wanted, grad)
    return out.detach(), (grads[0] if x_grad else None), grads[-1]


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 2e-2, 2e-2)])
def test_fused_norms_give_the_eager_output_and_gradients(dtype, rtol, atol):
    kernels = NormKernels(fused=True)
    out, gx, gw = _norm_and_grads(kernels, dtype)
    assert kernels.error is None and kernels.active  # it ran compiled
    ref_out, ref_gx, ref_gw = _norm_and_grads(EAGER_NORMS, dtype)
    assert out.dtype == ref_out.dtype == torch.float32  # the weight's dtype wins, as eagerly
    assert gx.dtype == ref_gx.dtype == dtype and gw.dtype == ref_gw.dtype == torch.float32
    assert torch.allclose(out, ref_out, rtol=rtol, atol=atol)
    assert torch.allclose(gx.float(), ref_gx.float(), rtol=rtol, atol=atol) and torch.allclose(gw, ref_gw, rtol=rtol, atol=atol)
    assert gx.abs().max() > 0.1 and gw.abs().max() > 0.1  # not vacuous


def test_fused_norms_give_only_the_weight_gradient_for_a_frozen_input():
    """The drafter's input_layernorm reads the frozen embeddings: its backward computes the weight's gradient alone."""
    kernels = NormKernels(fused=True)
    _, gx, gw = _norm_and_grads(kernels, torch.float32, x_grad=False)
    _, _, ref_gw = _norm_and_grads(EAGER_NORMS, torch.float32, x_grad=False)
    assert kernels.active and gx is None and torch.allclose(gw, ref_gw, rtol=1e-5, atol=1e-6)


def test_a_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    monkeypatch.setattr(rms_norm, "_compiled", failing_compile)
    kernels = NormKernels(fused=True)
    with pytest.warns(RuntimeWarning, match="train.fused_norms: torch.compile failed.*simulated inductor failure"):
        out, gx, gw = _norm_and_grads(kernels, torch.bfloat16)
    assert kernels.error == "forward: RuntimeError: simulated inductor failure" and not kernels.active and kernels.fused
    ref_out, ref_gx, ref_gw = _norm_and_grads(EAGER_NORMS, torch.bfloat16)
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)


def test_inside_an_outer_compile_the_norm_runs_its_eager_math(monkeypatch):
    """train.compile's pieces trace through the norms: the outer graph takes the eager math, no nested compile is asked for."""
    asked = []
    monkeypatch.setattr(rms_norm, "_compiled", lambda name: asked.append(name))
    kernels = NormKernels(fused=True)
    traced = torch.compile(lambda norm, x: 2 * norm(x), backend="aot_eager", fullgraph=True)

    def run(kernels):
        norm = RMSNorm(8, 1e-6)
        norm.kernels = kernels
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = traced(norm, x)
        return (out.detach(), *torch.autograd.grad(out.sum(), [x, norm.weight]))

    fused, eager = run(kernels), run(EAGER_NORMS)
    assert asked == [] and kernels.error is None
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(fused, eager))


def test_use_norm_kernels_reaches_every_norm_of_the_drafter_and_leaves_its_state_dict():
    model = training_drafter(Vd=40, norm_before_fc=True)
    keys = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert all(m.kernels is EAGER_NORMS for m in model.modules() if isinstance(m, RMSNorm))
    kernels = NormKernels(fused=True)
    # input_norm (norm_before_fc), input_layernorm, hidden_norm, post_attention_layernorm, norm
    assert use_norm_kernels(model, kernels) == 5
    assert all(m.kernels is kernels for m in model.modules() if isinstance(m, RMSNorm))
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == keys


def test_the_objective_fuses_the_drafter_norms_only_when_asked():
    from eyrie.training.objective import TTTObjective

    model = training_drafter(Vd=40)
    plain = TTTObjective(model, 3, 0.8)
    assert not plain.norm_kernels.fused and model.norm.kernels is EAGER_NORMS
    fused = TTTObjective(model, 3, 0.8, fused_norms=True)
    assert fused.norm_kernels.active and all(m.kernels is fused.norm_kernels for m in model.modules() if isinstance(m, RMSNorm))


def test_a_training_job_with_fused_norms_follows_the_eager_run_and_says_so(tmp_path):
    """train.fused_norms true on the CPU: the same loss curve as eager, and config.json records that it ran fused."""
    assert_fused_job_follows_eager(tmp_path, "fused_norms")
