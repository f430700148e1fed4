"""Chain speculative decoding with an EAGLE-3 drafter (batch 1, greedy), and the plain greedy baseline.

Positions are 0-based: token p of the sequence sits at rotary position p. The drafter step at
position p reads the target's fused aux features at p (or its own previous pre-norm output) and
the embedding of token p + 1, and predicts token p + 2 -- the alignment the drafter is trained on.

One round is three steps, as in gpt-fast:
  draft   catch the drafter up on the target's features of the newly accepted positions,
          then chain k tokens one by one;
  verify  [current, *drafts] in one target forward;
  accept  the longest prefix the target agrees with, plus the target's own next token (the bonus).

Both decoders share `_forward`, the stopping rule and the timing, so the speed ratio is fair.
`target` is a transformers model, or an eyrie.static_decode.StaticLlama wrapping one (the same
weights on a static KV cache, replayed as CUDA graphs on CUDA): both functions then hand over to it,
with the same results.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from eyrie.drafter import DraftCache, Eagle3Drafter
from eyrie.hidden import capture_indices


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens only, ending with the stop token if one was produced
    seconds: float
    forwards: int  # target forwards, the prefill included


@dataclass
class SpecResult:
    tokens: list[int]
    seconds: float
    target_forwards: int  # prefill + one per verify round
    acceptance_lengths: list[int]  # per verify round: tokens it emitted (accepted drafts + the bonus)
    accepted_per_position: list[int]  # [j]: rounds in which the target agreed with draft j + 1

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)


class DraftSession(Protocol):
    """What speculative_decode needs from a drafter. Eagle3Chain is the real one; tests pass doubles."""

    aux_layer_ids: list[int]  # SGLang convention, see eyrie.hidden.capture_indices

    def extend(self, aux_hidden: torch.Tensor, next_ids: list[int], start: int) -> None:
        """Target features (1, m, 3H) of positions start..start+m-1 and the token after each of them.

        Forgets everything the session drafted at positions >= start.
        """

    def draft(self, k: int) -> list[int]:
        """k target token ids, chained from the last extended position."""


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
        hidden = self.drafter.fc(aux_hidden.to(self.dtype))  # (1, m, 3H) -> (1, m, H)
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


def _crop(cache: DynamicCache, length: int) -> None:
    # transformers >= 5 takes the number of tokens to remove, as a negative count.
    cache.crop(length - cache.get_seq_length())


def _finished(tokens: list[int], max_new_tokens: int, stop_ids) -> bool:
    return len(tokens) >= max_new_tokens or tokens[-1] in stop_ids


def accept(drafts: list[int], predicted: list[int], accepted_per_position: list[int]) -> tuple[int, list[int]]:
    """(accepted drafts, tokens the round yields): the longest prefix the target agrees with, then its own next token.

    predicted[i] is the target's token after input i of [current, *drafts]; accepted_per_position counts agreements.
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted_per_position[accepted] += 1
        accepted += 1
    return accepted, drafts[:accepted] + [predicted[accepted]]


def _emit(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """The part of `new` plain greedy would also have produced: up to the first stop token, within the budget."""
    for i, token in enumerate(new):
        if token in stop_ids:
            new = new[: i + 1]
            break
    return new[: max_new_tokens - len(tokens)]


def _is_static(target) -> bool:
    from eyrie.static_decode import StaticLlama  # it imports this module

    return isinstance(target, StaticLlama)


@torch.inference_mode()
def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> DecodeResult:
    """Plain greedy decoding, one token per target forward, with a KV cache."""
    if _is_static(target):
        return target.greedy_decode(prompt_ids, max_new_tokens, stop_ids)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    logits = _forward(target, prompt_ids, cache, last_only=True).logits  # prefill
    tokens, forwards = [int(logits[0, -1].argmax())], 1
    while not _finished(tokens, max_new_tokens, stop_ids):
        logits = _forward(target, tokens[-1:], cache).logits
        tokens.append(int(logits[0, -1].argmax()))
        forwards += 1
    return DecodeResult(tokens, time.perf_counter() - start, forwards)


@torch.inference_mode()
def speculative_decode(
    target, drafter: Eagle3Drafter | DraftSession, prompt_ids: list[int], max_new_tokens: int, stop_ids, draft_tokens: int
) -> SpecResult:
    """Greedy chain speculative decoding; the output equals greedy_decode's token for token."""
    if _is_static(target):
        return target.speculative_decode(drafter, prompt_ids, max_new_tokens, stop_ids, draft_tokens)
    start_time = time.perf_counter()
    k = draft_tokens
    session = Eagle3Chain(drafter) if isinstance(drafter, Eagle3Drafter) else drafter
    capture = capture_indices(session.aux_layer_ids, target.config.num_hidden_layers)

    def aux_hidden(out, count):  # (1, count, 3H): fused features of the first `count` positions of this forward
        return torch.cat([out.hidden_states[i][:, :count] for i in capture], dim=-1)

    # Prefill: the prompt's aux features and the first new token.
    cache = DynamicCache(config=target.config)
    out = _forward(target, prompt_ids, cache, hidden_states=True, last_only=True)
    tokens = [int(out.logits[0, -1].argmax())]
    forwards, lengths, accepted_per_position = 1, [], [0] * k
    # What the drafter has not seen yet: target features, the token after each position, the first position.
    pending = (aux_hidden(out, len(prompt_ids)), list(prompt_ids[1:]) + tokens, 0)
    while not _finished(tokens, max_new_tokens, stop_ids):
        current_position = len(prompt_ids) + len(tokens) - 1  # tokens[-1] is not in the target cache yet

        # Draft: the drafter takes the target's features of the newly accepted positions, then chains k tokens.
        session.extend(*pending)
        drafts = session.draft(k)

        # Verify: [current, *drafts] in one target forward; predicted[i] is the target's token after input i.
        out = _forward(target, [tokens[-1], *drafts], cache, hidden_states=True)
        forwards += 1
        predicted = out.logits[0].argmax(-1).tolist()

        # Accept: the longest agreeing prefix, then the target's own next token (the bonus).
        accepted, new = accept(drafts, predicted, accepted_per_position)
        emitted = _emit(tokens, new, max_new_tokens, stop_ids)
        tokens += emitted
        lengths.append(len(emitted))
        _crop(cache, current_position + accepted + 1)  # the prompt, the current token and the accepted drafts
        pending = (aux_hidden(out, accepted + 1), new, current_position)

    return SpecResult(tokens, time.perf_counter() - start_time, forwards, lengths, accepted_per_position)
