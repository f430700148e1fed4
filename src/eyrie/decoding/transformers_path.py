"""Decoding on transformers' own forward and DynamicCache (batch 1, greedy): the reference path.

Positions are 0-based: token p of the sequence sits at rotary position p. The drafter step at
position p reads the target's fused aux features at p (or its own previous pre-norm output) and
the embedding of token p + 1, and predicts token p + 2 -- the alignment the drafter is trained on.

`Eagle3Chain` is the real drafter session; `TransformersVerifier` is the target side of a round
(eyrie.decoding.common.speculative_rounds). Both decoders share `_forward`, the stopping rule and
the timing, so the speed ratio is fair. eyrie.decoding.static runs the same weights on a static KV
cache with CUDA graphs; eyrie.decoding.decode picks between the two.
"""

from __future__ import annotations

import functools
import inspect
import time

import torch
from transformers import DynamicCache

from eyrie.decoding.common import DecodeResult, DraftSession, SpecResult, finished, speculative_rounds
from eyrie.drafter.model import DraftCache, Eagle3Drafter
from eyrie.target.aux_layers import capture_indices


class Eagle3Chain:
    """An Eagle3Drafter with its KV cache: one session per generated sequence."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter, self.cache = drafter, DraftCache()
        self.aux_layer_ids = list(drafter.shape.aux_layer_ids)
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype

    def _decode(self, hidden: torch.Tensor, ids: list[int], first_position: int):
        input_ids = torch.tensor([ids], device=self.device)
        positions = torch.arange(first_position, first_position + len(ids), device=self.device)[None]
        return self.drafter.decode(hidden, input_ids, positions, self.cache)

    def extend(self, aux_hidden, next_ids, start):
        self.cache.crop(start)  # the chained drafts of the last round sat at positions >= start
        hidden = self.drafter.project_aux(aux_hidden.to(self.dtype))  # (1, m, 3H) -> (1, m, H)
        logits, out = self._decode(hidden, next_ids, start)
        self.logits, self.out, self.last = logits[:, -1:], out[:, -1:], start + len(next_ids) - 1

    def draft(self, k):
        logits, out, drafts = self.logits, self.out, []
        for j in range(k):
            drafts.append(int(self.drafter.draft_ids_to_target(logits[0, -1].argmax())))
            if j + 1 < k:  # the next step: own output at the last position, embedding of this draft
                logits, out = self._decode(out, drafts[-1:], self.last + j + 1)
        return drafts


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: `cache` in recent transformers, `past_key_values` before.

    Passing the wrong one is silent (it lands in **kwargs) and decodes every token without context:
    seen on an H200 with transformers 5.17, where the speculative baseline then accepted nothing.
    """
    return _cache_keyword_of(type(model))


@functools.cache
def _cache_keyword_of(model_class) -> str:  # per class, not per decoded token: the baseline's loop is timed
    parameters = inspect.signature(model_class.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{model_class.__name__}.forward takes neither `cache` nor `past_key_values`: cannot decode with a KV cache")


def _forward(target, ids: list[int], cache: DynamicCache, hidden_states: bool = False, last_only: bool = False):
    """One target forward that extends the cache; last_only skips the vocab projection of earlier positions."""
    input_ids = torch.tensor([ids], device=target.device)
    return target(
        input_ids=input_ids,
        **{cache_keyword(target): cache},
        use_cache=True,
        output_hidden_states=hidden_states,
        logits_to_keep=1 if last_only else 0,  # 0 keeps all
    )


def decode_cache(target) -> DynamicCache:
    """The decode's DynamicCache. For a target with sliding-window layers every layer keeps every position: the
    sliding layers DynamicCache(config) builds drop what falls out of the window, and then cannot be cropped back
    after a rejected draft nor gathered along a tree's path. The model's own masks still apply each window."""
    config = target.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None or any(kind != "full_attention" for kind in layer_types):
        return DynamicCache()
    return DynamicCache(config=target.config)


def _crop(cache: DynamicCache, length: int) -> None:
    # transformers >= 5 takes the number of tokens to remove, as a negative count.
    cache.crop(length - cache.get_seq_length())


@torch.inference_mode()
def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> DecodeResult:
    """Plain greedy decoding, one token per target forward, with a KV cache."""
    start = time.perf_counter()
    cache = decode_cache(target)
    logits = _forward(target, prompt_ids, cache, last_only=True).logits  # prefill
    tokens, forwards = [int(logits[0, -1].argmax())], 1
    while not finished(tokens, max_new_tokens, stop_ids):
        logits = _forward(target, tokens[-1:], cache).logits
        tokens.append(int(logits[0, -1].argmax()))
        forwards += 1
    return DecodeResult(tokens, time.perf_counter() - start, forwards)


class TransformersVerifier:
    """The target side of a speculative round on transformers' forward and DynamicCache."""

    def __init__(self, target, aux_layer_ids):
        self.target, self.cache = target, decode_cache(target)
        self.capture = capture_indices(aux_layer_ids, target.config.get_text_config(decoder=True).num_hidden_layers)

    def _aux(self, out) -> torch.Tensor:  # (1, T, 3H): the fused features of every position of this forward
        return torch.cat([out.hidden_states[i] for i in self.capture], dim=-1)

    def prefill(self, prompt_ids):
        out = _forward(self.target, prompt_ids, self.cache, hidden_states=True, last_only=True)
        return int(out.logits[0, -1].argmax()), self._aux(out)

    def verify(self, ids, position):
        out = _forward(self.target, ids, self.cache, hidden_states=True)
        return out.logits[0].argmax(-1).tolist(), self._aux(out)

    def keep(self, length):
        _crop(self.cache, length)


@torch.inference_mode()
def speculative_decode(
    target, drafter: Eagle3Drafter | DraftSession, prompt_ids: list[int], max_new_tokens: int, stop_ids, draft_tokens: int
) -> SpecResult:
    """Greedy chain speculative decoding; the output equals greedy_decode's token for token."""
    session = Eagle3Chain(drafter) if isinstance(drafter, Eagle3Drafter) else drafter
    verifier = TransformersVerifier(target, session.aux_layer_ids)
    return speculative_rounds(verifier, session, prompt_ids, max_new_tokens, stop_ids, draft_tokens)
