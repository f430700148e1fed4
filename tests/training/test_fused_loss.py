"""train.fused_loss: the chunked draft loss's per-chunk work through torch.compile gives eager's values."""

from __future__ import annotations

import pytest
import torch
from factories import failing_compile

from eyrie.training import draft_loss
from eyrie.training.draft_loss import EAGER, LossChunks, chunked_soft_cross_entropy


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


def _loss_and_grads(chunks, n, seed=4, chunk_rows=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    H, Vd, N = 8, 37, 30
    x = torch.randn(n, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(Vd, H, generator=g, dtype=dtype).requires_grad_()
    probs = torch.softmax(2 * torch.randn(N, Vd, generator=g, dtype=dtype), -1)
    rows = torch.randint(0, N, (n,), generator=g)
    argmax = (x.detach() @ weight.detach().T).argmax(-1)
    argmax[::3] = -1  # target argmaxes the drafter cannot hit
    loss, correct = chunked_soft_cross_entropy(x, weight, probs, rows, argmax, chunk_rows=chunk_rows, chunks=chunks)
    gx, gw = torch.autograd.grad(1.7 * loss, [x, weight])
    return float(loss), int(correct), gx, gw


@pytest.mark.parametrize("n", [13, 11])  # chunks of 4 rows, the last one ragged: 1 and 3 rows
def test_fused_chunks_give_the_eager_loss_and_gradients(n):
    chunks = LossChunks(fused=True)
    loss, correct, gx, gw = _loss_and_grads(chunks, n)
    assert chunks.error is None and chunks.active  # it ran compiled
    ref_loss, ref_correct, rgx, rgw = _loss_and_grads(EAGER, n)
    assert correct == ref_correct == n - len(range(0, n, 3))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert torch.allclose(gx, rgx, rtol=1e-5, atol=1e-6) and torch.allclose(gw, rgw, rtol=1e-5, atol=1e-6)


def test_a_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    monkeypatch.setattr(draft_loss, "_compiled", failing_compile)
    chunks = LossChunks(fused=True)
    with pytest.warns(RuntimeWarning, match="train.fused_loss: torch.compile failed.*simulated inductor failure"):
        loss, correct, gx, gw = _loss_and_grads(chunks, 13)
    assert chunks.error == "forward: RuntimeError: simulated inductor failure" and not chunks.active and chunks.fused
    ref_loss, ref_correct, rgx, rgw = _loss_and_grads(EAGER, 13)
    assert (loss, correct) == (ref_loss, ref_correct) and torch.equal(gx, rgx) and torch.equal(gw, rgw)


def test_fused_chunks_hold_twice_the_rows_and_a_fallback_returns_to_the_eager_size(monkeypatch):
    """Fused, a chunk keeps no float32 [rows, Vd] intermediates, so twice the rows fit: one chunk for a step of 2,048 rows
    at Vd 32000. After a compile failure the chunks run eagerly, at the eager size again."""
    fused, eager = LossChunks(fused=True), LossChunks(fused=False)
    assert draft_loss.chunk_rows_for(32000, fused.chunk_elements) >= 2048 > draft_loss.chunk_rows_for(32000, eager.chunk_elements)
    assert LossChunks(fused=True, chunk_elements=1 << 20).chunk_elements == 1 << 20
    sizes = []
    real = draft_loss._ChunkedSoftCrossEntropy.apply
    monkeypatch.setattr(draft_loss._ChunkedSoftCrossEntropy, "apply", lambda *a: (sizes.append(a[6]), real(*a))[1])
    monkeypatch.setattr(draft_loss, "_compiled", failing_compile)
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 8, generator=g), torch.randn(1 << 12, 8, generator=g)
    probs, rows, argmax = torch.softmax(torch.randn(5, 1 << 12, generator=g), -1), torch.arange(5), torch.zeros(5, dtype=torch.long)
    with pytest.warns(RuntimeWarning, match="train.fused_loss: torch.compile failed"):
        chunked_soft_cross_entropy(x, weight, probs, rows, argmax, chunks=fused)
    chunked_soft_cross_entropy(x, weight, probs, rows, argmax, chunks=fused)
    assert sizes == [draft_loss.FUSED_CHUNK_ELEMENTS >> 12, draft_loss.DEFAULT_CHUNK_ELEMENTS >> 12]
