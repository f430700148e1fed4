"""clipped_step: fused AdamW clipping inside its kernel gives clip_grad_norm_ + step's updates, norms and gradients."""

import pytest
import torch

from eyrie.training.optimizer import clipped_step


def _params_and_grads(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(48, 24, generator=g).requires_grad_(), torch.randn(24, generator=g).requires_grad_()]
    grads = [[torch.randn(p.shape, generator=g) * scale for p in params] for _ in range(4)]
    return params, grads


def _optimizer(params, fused: bool):
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clipped", "under-the-bound"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_clipped_step_equals_clip_grad_norm_then_step(fused, scale):
    reference, grads = _params_and_grads(0, scale)
    params = [p.detach().clone().requires_grad_() for p in reference]
    ref_opt, opt = _optimizer(reference, fused), _optimizer(params, fused)
    for step_grads in grads:
        for p, q, grad in zip(reference, params, step_grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5)
        ref_opt.step()
        norm = clipped_step(opt, params, 0.5)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        for p, q in zip(reference, params):
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)  # .grad ends clipped either way
    assert not hasattr(opt, "grad_scale")  # the clip's factor does not outlive the step


def test_the_fused_optimizer_is_handed_the_clip_as_its_grad_scale(monkeypatch):
    params, grads = _params_and_grads(1, 10.0)
    opt = _optimizer(params, fused=True)
    for p, grad in zip(params, grads[0]):
        p.grad = grad
    seen = []
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: pytest.fail("fused AdamW clips in its kernel"))
    step = opt.step
    monkeypatch.setattr(opt, "step", lambda: (seen.append(opt.grad_scale.item()), step()))
    norm = clipped_step(opt, params, 0.5)
    assert seen == [pytest.approx(norm.item() / 0.5, rel=1e-5)]
