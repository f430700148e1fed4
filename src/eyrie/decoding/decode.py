"""Greedy and speculative decoding on whichever decoder `open_decoder` chose: one call for both paths.

`target` is a transformers model (decoded on its own forward and DynamicCache, eyrie.decoding.transformers_path)
or an eyrie.decoding.static.StaticLlama wrapping one (the same weights on a static KV cache,
replayed as CUDA graphs on CUDA); both give the same tokens.
"""

from __future__ import annotations

import torch

from eyrie.decoding import static_tree
from eyrie.decoding import transformers_path as speculative
from eyrie.decoding.common import DecodeResult, SpecResult
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.tree import tree_speculative_decode


@torch.inference_mode()
def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> DecodeResult:
    """Plain greedy decoding, one token per target forward, with a KV cache."""
    if isinstance(target, StaticLlama):
        return target.greedy_decode(prompt_ids, max_new_tokens, stop_ids)
    return speculative.greedy_decode(target, prompt_ids, max_new_tokens, stop_ids)


@torch.inference_mode()
def speculative_decode(target, drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids, draft_tokens: int) -> SpecResult:
    """Greedy chain speculative decoding with an Eagle3Drafter or a DraftSession; equals greedy_decode token for token."""
    if isinstance(target, StaticLlama):
        return target.speculative_decode(drafter, prompt_ids, max_new_tokens, stop_ids, draft_tokens)
    return speculative.speculative_decode(target, drafter, prompt_ids, max_new_tokens, stop_ids, draft_tokens)


@torch.inference_mode()
def tree_decode(target, drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids, steps: int, topk: int, draft_tokens: int) -> SpecResult:
    """Greedy tree speculative decoding with SGLang's (--speculative-num-steps, --speculative-eagle-topk,
    --speculative-num-draft-tokens); equals greedy_decode token for token. accepted_per_position has `steps` entries.
    """
    if isinstance(target, StaticLlama):
        return static_tree.tree_decode(target, drafter, prompt_ids, max_new_tokens, stop_ids, steps, topk, draft_tokens)
    return tree_speculative_decode(target, drafter, prompt_ids, max_new_tokens, stop_ids, steps, topk, draft_tokens)
