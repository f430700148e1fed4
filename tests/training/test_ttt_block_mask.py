"""The TTT BlockMask written from its tiles equals the one create_block_mask derives from the dense mask; flex attention
runs without bounds checks exactly where the lengths allow it."""

import pytest
import torch

from eyrie.training.ttt_attention import (
    FLEX_BLOCK, _ttt_mask_mod, dense_ttt_attention, flex_kernel_options, padded_length, tiled_ttt_block_mask, ttt_block_mask, unfused_flex_attention,
)

pytest.importorskip("torch.nn.attention.flex_attention")


def _mask_mod(length: int, blocks: int):
    key_position = torch.arange(length).repeat(blocks)
    return _ttt_mask_mod(key_position, torch.arange(blocks * length) >= length)


ORDERED = [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
           ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]


@pytest.mark.parametrize("length,blocks", [(FLEX_BLOCK, 1), (2 * FLEX_BLOCK, 2), (3 * FLEX_BLOCK, 3), (4 * FLEX_BLOCK, 7)])
def test_tiled_block_mask_equals_create_block_mask(length, blocks):
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = _mask_mod(length, blocks)
    reference = create_block_mask(mask_mod, None, None, length, blocks * length, device="cpu")
    tiled = tiled_ttt_block_mask(mask_mod, length, blocks, "cpu")
    assert tiled.shape == reference.shape
    for counts_name, indices_name in ORDERED:
        counts, indices = getattr(reference, counts_name), getattr(reference, indices_name)
        assert torch.equal(getattr(tiled, counts_name), counts), counts_name
        assert getattr(tiled, indices_name).shape == indices.shape, indices_name
        for row, count in enumerate(counts[0, 0].tolist()):  # past count an index is unused
            assert torch.equal(getattr(tiled, indices_name)[0, 0, row, :count], indices[0, 0, row, :count]), (indices_name, row)


def test_tiled_block_mask_attends_as_the_dense_mask():
    torch.manual_seed(3)
    T, blocks = 2 * FLEX_BLOCK, 3
    block_mask = ttt_block_mask(T, blocks, "cpu")  # a whole number of tiles: built from the tiles
    q = torch.randn(1, 4, T, 16)
    k, v = torch.randn(1, 2, blocks * T, 16), torch.randn(1, 2, blocks * T, 16)
    flex = unfused_flex_attention(q, k, v, block_mask, 0.25, True)
    dense = dense_ttt_attention(q, k, v, block_mask.mask_mod, 0.25, True)
    assert torch.allclose(flex, dense, atol=1e-5)


def test_long_sample_mask_is_built_without_the_dense_mask():
    """32,768 tokens and 7 TTT blocks: a dense bool mask would be 7 GiB; the tiles' indices are a few MB."""
    T, blocks = 32768, 7
    block_mask = tiled_ttt_block_mask(_mask_mod(T, blocks), T, blocks, "cpu")
    n = T // FLEX_BLOCK
    assert block_mask.kv_num_blocks.flatten().tolist() == [blocks] * n
    assert block_mask.full_kv_num_blocks.flatten().tolist() == list(range(n))
    assert block_mask.kv_indices[0, 0, 5, :blocks].tolist() == [5 + n * b for b in range(blocks)]


def test_padded_lengths_drop_flex_bounds_checks_and_others_keep_them():
    for length in (1, 100, 128, 129, 2000, 2048, 8191, 8192):
        padded = padded_length(length, "cuda")
        for blocks in range(1, 8):
            assert flex_kernel_options(padded, blocks * padded) == {"IS_DIVISIBLE": True}, (length, blocks)
    for query, key in ((100, 700), (2000, 14000), (128, 200), (200, 256)):
        assert flex_kernel_options(query, key) == {}, (query, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length", [256, 640, 2048])
def test_flex_without_bounds_checks_gives_the_outputs_and_gradients_of_flex_with_them(length):
    from eyrie.training.ttt_attention import _compiled_flex

    torch.manual_seed(0)
    blocks = 3
    q = torch.randn(1, 4, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, blocks * length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, blocks * length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = ttt_block_mask(length, blocks, "cuda")
    results = []
    for options in ({}, flex_kernel_options(length, blocks * length)):
        out = _compiled_flex(True)(q, k, v, block_mask=mask, scale=0.125, enable_gqa=True, kernel_options=options)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), [q, k, v])))
    assert flex_kernel_options(length, blocks * length) == {"IS_DIVISIBLE": True}
    for plain, divisible in zip(*results):
        # Without bounds checks the kernel may sum in another order: values near zero then differ by far more than
        # bf16's relative step, but by under one step at the tensor's own scale (H100, 640 tokens: up to 4.9e-4 where
        # the outputs reach 2.64; dv 2e-3 where it reaches 11.4). A read past the row's end would be off by the scale.
        torch.testing.assert_close(divisible, plain, atol=plain.abs().max().item() * 2**-8, rtol=1.6e-2)
