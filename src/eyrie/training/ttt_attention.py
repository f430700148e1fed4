"""Fast training-time-test (TTT) attention: flex attention over the concatenated key blocks.

At TTT step j the queries (positions t of step j) attend to the keys [k_0 | k_1 | ... | k_j]:
block 0 (the step-0 keys) causally and only within the sample's length, block i >= 1 on its
diagonal only (key position == query position). ``DraftAttention.attend`` computes the same
softmax eagerly (fp32 scores of every block, repeated KV heads) and stays the reference and the
CPU path; here flex attention skips the masked tiles and never materialises the scores.

On CUDA flex_attention runs compiled (torch.compile; the mask and lengths are tensors so a new
batch does not recompile, and the first shape change turns on dynamic shapes). Elsewhere (no flex
backward off CUDA) the same mask_mod is materialised and fed to scaled_dot_product_attention:
only for tests and CPU smoke runs.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from eyrie.core.errors import EyrieError

ATTENTION_CHOICES = ("auto", "flex", "eager")
FLEX_BLOCK = 128  # flex attention's tile; CUDA sequence lengths are padded to a multiple of it


class AttentionUnavailable(EyrieError):
    """The requested TTT attention implementation cannot run here."""


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


FLEX_MIN_HEAD_DIM = 16  # compiled flex attention's kernels need head_dim >= 16


def resolve_attention(setting: str, device, head_dim: int = FLEX_MIN_HEAD_DIM) -> str:
    """'flex' or 'eager' for train.attention (auto: flex on CUDA when torch has it and head_dim allows, eager elsewhere)."""
    if setting not in ATTENTION_CHOICES:
        raise AttentionUnavailable(f"train.attention is {setting!r}; use one of {', '.join(ATTENTION_CHOICES)}")
    if setting == "eager":
        return "eager"
    if setting == "flex":
        if not flex_available():
            raise AttentionUnavailable(
                f"train.attention is 'flex' but torch {torch.__version__} has no torch.nn.attention.flex_attention; "
                "use 'eager' or torch >= 2.5"
            )
        if torch.device(device).type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
            raise AttentionUnavailable(f"train.attention is 'flex' but the drafter's head_dim {head_dim} < {FLEX_MIN_HEAD_DIM}; use 'eager'")
        return "flex"
    cuda = torch.device(device).type == "cuda"
    return "flex" if cuda and flex_available() and head_dim >= FLEX_MIN_HEAD_DIM else "eager"


# At least two tiles: a one-tile length specialises compiled flex attention's size-1 dims, and on an
# H200 that recompile cost 23-27 s, more than padding the few short batches of a run to 256 ever does.
MIN_FLEX_BLOCKS = 2


def padded_length(length: int, device) -> int:
    """L rounded up to whole flex tiles on CUDA, at least MIN_FLEX_BLOCKS (fewer distinct shapes); unchanged elsewhere."""
    if torch.device(device).type != "cuda":
        return length
    return FLEX_BLOCK * max(MIN_FLEX_BLOCKS, math.ceil(length / FLEX_BLOCK))


def _ttt_mask_mod(key_position: torch.Tensor, key_is_diagonal: torch.Tensor):
    """mask_mod of one TTT step: block 0 causal, blocks >= 1 diagonal.

    No per-sample length term: a real query t < length sees causal keys <= t, all real, so the
    mask is the same for every batch and its BlockMask is built once per shape. Padded queries see
    padding, but their outputs are never selected for a loss.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        position = key_position[kv_idx]
        return torch.where(key_is_diagonal[kv_idx], position == q_idx, position <= q_idx)

    return mask_mod


# Every (padded length, TTT step) of a run: 16 lengths up to 2,048 x 7 steps = 112. A smaller cache
# thrashes when an epoch visits lengths in random order, rebuilding masks every step.
MASK_CACHE_SIZE = 512
# Dynamic from the first step: torch.compile's default compiles the first shape static and recompiles
# at the first change (13 s on an H200; benchmarks/README.md, retired probes); every run's shapes change.
FLEX_DYNAMIC: bool | None = True


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def ttt_block_mask(length: int, blocks: int, device: str):
    """BlockMask for queries [0, length) over `blocks` concatenated key blocks of `length` each.

    Cached: building one evaluates the mask over [length, blocks * length], tens of milliseconds at
    2048 tokens and 7 blocks, which per step would cost more than the attention itself.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    key_position = torch.arange(length, device=device).repeat(blocks)  # (blocks * length,)
    key_is_diagonal = torch.arange(blocks * length, device=device) >= length
    mask_mod = _ttt_mask_mod(key_position, key_is_diagonal)
    if length % FLEX_BLOCK == 0:
        return tiled_ttt_block_mask(mask_mod, length, blocks, device)
    return create_block_mask(mask_mod, None, None, length, blocks * length, device=device)


def tiled_ttt_block_mask(mask_mod, length: int, blocks: int, device: str):
    """The BlockMask create_block_mask builds for the TTT mask, written down from the mask's known tiles.

    create_block_mask evaluates mask_mod over every (query, key) pair first: a dense bool [length, blocks * length],
    7 GiB at 32,768 tokens and 7 blocks, with as much again in temporaries. Here, for length a whole number of tiles
    (n of them), query tile i sees block 0's tiles 0..i-1 fully and its tile i causally (partial), and in each block
    b >= 1 only the diagonal of tile b * n + i (partial); mask_mod is applied inside the partial tiles as before.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = length // FLEX_BLOCK
    tile = torch.arange(n, device=device, dtype=torch.int32)
    width = blocks * n  # kv_indices spans every key tile, as create_block_mask's does
    partial = torch.zeros(n, width, dtype=torch.int32, device=device)
    partial[:, :blocks] = tile[:, None] + n * torch.arange(blocks, device=device, dtype=torch.int32)[None, :]
    full = torch.zeros(n, width, dtype=torch.int32, device=device)
    full[:, :n] = torch.where(tile[None, :] < tile[:, None], tile[None, :], 0)  # row i: 0..i-1, then unused
    return BlockMask.from_kv_blocks(
        torch.full((1, 1, n), blocks, dtype=torch.int32, device=device), partial[None, None],
        tile.clone()[None, None], full[None, None],
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(length, blocks * length),
    )


# Inductor drops flex attention's bounds checks (IS_DIVISIBLE) only when it can prove both lengths are multiples of 128;
# under dynamic shapes it never can, though padded_length makes them so. Said outright, the kernels ran 3% faster at
# 2,048 tokens and 11% at 8,192 (benchmarks/train_throughput.py, H100).
DIVISIBLE_LENGTH = 128


def flex_kernel_options(query_length: int, key_length: int) -> dict:
    """flex attention's kernel_options for these lengths: IS_DIVISIBLE where both are whole multiples of 128."""
    if query_length % DIVISIBLE_LENGTH == 0 and key_length % DIVISIBLE_LENGTH == 0:
        return {"IS_DIVISIBLE": True}
    return {}


@functools.cache
def _compiled_flex(dynamic: bool | None):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


def flex_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], block_mask) -> torch.Tensor:
    """Per-head attention outputs (B, h, T, hd) of q (B, h, T, hd) over the key blocks (each (B, kv_h, T, hd)).

    CUDA: compiled flex attention. Elsewhere flex attention has no backward, so the same mask_mod
    is evaluated densely and fed to scaled_dot_product_attention (tests, CPU smoke runs).
    q, k, v are brought to v's dtype: under bf16 autocast the rotary leaves q, k in float32.
    """
    dtype = values[0].dtype
    k = torch.cat(keys, dim=2).to(dtype)  # (B, kv_h, blocks * T, hd)
    v = torch.cat(values, dim=2)
    q = q.to(dtype)
    enable_gqa = q.shape[1] != k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.is_cuda:
        return _compiled_flex(FLEX_DYNAMIC)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                            kernel_options=flex_kernel_options(q.shape[2], k.shape[2]))
    return dense_ttt_attention(q, k, v, block_mask.mask_mod, scale, enable_gqa)


def dense_ttt_attention(q, k, v, mask_mod, scale: float, enable_gqa: bool) -> torch.Tensor:
    """flex attention's result, computed with the mask_mod materialised: O(T x blocks*T) memory."""
    from torch.nn.attention.flex_attention import create_mask

    B, _, T, _ = q.shape
    mask = create_mask(mask_mod, B, 1, T, k.shape[2], device=q.device)  # (B, 1, T, blocks * T)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def unfused_flex_attention(q, k, v, block_mask, scale: float, enable_gqa: bool) -> torch.Tensor:
    """flex_attention itself without torch.compile (forward only off CUDA): checks dense_ttt_attention."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # unfused is intended here, not a mistake to warn about
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
