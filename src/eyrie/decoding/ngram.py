"""A training-free drafter: prompt lookup (n-gram matching), the baseline a trained drafter must beat.

Like transformers' prompt_lookup and vLLM's ngram proposer: find the most recent earlier occurrence
of the last n tokens of the sequence so far (prompt and accepted tokens; n from max_ngram down to
min_ngram) and propose the k tokens that followed it. Copying runs on into the proposed tokens
themselves, so a match that ends just before the present still yields k tokens and a loop of
period p is proposed whole. With no match it proposes k copies of the last token: verification
rejects whatever is wrong, so a bad guess costs speed, never correctness.

`NgramSession` is a DraftSession (eyrie.decoding.common): any decoder that runs host-driven rounds
takes it. It ignores the target's aux features, but the verifiers compute them from
`aux_layer_ids`, so those must be valid for the target.

`NgramDecoder` is what the benchmark times. On a StaticLlama the (k + 1)-token verify runs as one
CUDA graph replay per round, as the drafter's round and the greedy step do, and without the aux
features nothing reads. On an H200 (a SmolLM2-135M-shaped target, fp32, k = 4) an eager verify cost
17 to 26 ms per round, the graphed one 5.7 ms, the drafter's graphed round 6.0 ms and a graphed
greedy step 4.2 ms: eager verifies would have measured launch overhead, not drafting.
"""

from __future__ import annotations

import functools

import torch

from eyrie.decoding.common import SpecResult, speculative_rounds
from eyrie.decoding.decode import speculative_decode
from eyrie.decoding.graphs import Replay
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_common import needed_capacity, span_for, spans_up_to
from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids

MAX_NGRAM = 3  # vLLM's and transformers' usual ceiling: longer n rarely matches, shorter is tried next
MIN_NGRAM = 1


def lookup(sequence: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int] | None:
    """The k tokens that followed the most recent earlier occurrence of sequence's last n tokens, longest n first; None when none matches."""
    last = len(sequence) - 1
    # Where an earlier n-gram could end: earlier copies of the last token, most recent first (one pass for every n).
    ends = [j for j in range(last - 1, -1, -1) if sequence[j] == sequence[last]]
    for n in range(min(max_ngram, last), min_ngram - 1, -1):  # an earlier n-gram ends at n - 1 <= j < last
        suffix = sequence[last - n + 1 :]
        end = next((j for j in ends if j >= n - 1 and sequence[j - n + 1 : j + 1] == suffix), None)
        if end is not None:
            proposed: list[int] = []
            for j in range(end + 1, end + 1 + k):  # copying may run on into its own proposals: index j < len + copied
                proposed.append(sequence[j] if j <= last else proposed[j - last - 1])
            return proposed
    return None


def lookup_runs(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """runs[e]: how many of `lookup(tokens[:e + 1], k)`'s proposals match tokens[e + 1:] in a row (0 with no match),
    for every e at once in one pass. Training's evaluation asks this at every position of its held-out samples
    (eyrie.training.acceptance), where calling `lookup` per position would cost a scan of the sequence each time.

    Per n, the latest end of each n-gram seen so far is kept, so the most recent earlier occurrence is one dict
    lookup. A proposal that runs past the present copies the proposal itself; while every earlier proposal matched,
    that equals tokens[end + 1 + i], so the run compares tokens with tokens.
    """
    latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
    runs = [0] * len(tokens)
    for e in range(len(tokens)):
        for n in range(min(max_ngram, e), min_ngram - 1, -1):  # an earlier n-gram needs n - 1 <= its end < e
            end = latest[n].get(tuple(tokens[e - n + 1 : e + 1]))
            if end is not None:
                run = 0
                while run < k and e + 1 + run < len(tokens) and tokens[end + 1 + run] == tokens[e + 1 + run]:
                    run += 1
                runs[e] = run
                break
        for n in latest:  # the n-grams ending at e, for the positions after it
            if e + 1 >= n:
                latest[n][tuple(tokens[e - n + 1 : e + 1])] = e
    return runs


class NgramSession:
    """Prompt-lookup drafting over this session's own copy of the sequence, kept in step with `extend`."""

    def __init__(self, num_layers: int, aux_layer_ids: list[int] | None = None, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else list(aux_layer_ids)
        capture_indices(ids, num_layers)  # the verifiers capture these: refuse ids this target does not have
        self.aux_layer_ids = ids
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # next_ids[p]: the token after position p, i.e. the token at p + 1. The round never hands over
        # the token at position 0, and a lookup loses nothing that matters without it.
        self.next_ids: list[int] = []

    def extend(self, aux_hidden, next_ids: list[int], start: int) -> None:
        if start > len(self.next_ids):
            raise ValueError(f"extend from position {start}, but the session knows the tokens after positions 0..{len(self.next_ids) - 1} only")
        del self.next_ids[start:]  # the rejected drafts' positions, as the drafter crops its cache
        self.next_ids.extend(int(token) for token in next_ids)

    def draft(self, k: int) -> list[int]:
        if not self.next_ids:
            raise ValueError("draft before any extend: the session has no sequence to look up")
        proposed = lookup(self.next_ids, k, self.max_ngram, self.min_ngram)
        return proposed if proposed is not None else [self.next_ids[-1]] * k


class GraphedVerifier:
    """The target side of an n-gram round on a StaticLlama (eyrie.decoding.common.Verifier): the verify of
    exactly k + 1 tokens on static buffers, one Replay per attention span, captured before the prefill."""

    def __init__(self, target: StaticLlama, k: int):
        self.target, self.k = target, k
        device = target.device
        self.ids = torch.zeros(1, k + 1, dtype=torch.long, device=device)  # [current, *drafts]
        self.first = torch.zeros(1, dtype=torch.long, device=device)  # position of ids[0]
        self.offsets = torch.arange(k + 1, device=device)
        self.predicted = torch.zeros(1, k + 1, dtype=torch.long, device=device)
        self.keys = target.keys  # what the graphs write into: a grown cache has new buffers and needs new graphs
        step = target.step_function(self._verify)
        # Warm-ups and captures write slots 0..k: harmless before a prefill, which overwrites them.
        self.replays = {span: Replay(functools.partial(step, span), target.use_graphs, target.capture_failures) for span in spans_up_to(target.capacity)}

    def fits(self, k: int) -> bool:
        return k == self.k and self.keys is self.target.keys

    def _verify(self, span: int) -> None:
        predicted, _ = self.target.predict(self.ids, self.first + self.offsets, span=span)
        self.predicted.copy_(predicted)

    def _no_aux(self, length: int) -> torch.Tensor:  # prompt lookup reads no target features
        return torch.zeros(1, length, 0, device=self.target.device)

    def prefill(self, prompt_ids):
        predicted, _ = self.target.prefill(prompt_ids)
        return int(predicted[0, -1]), self._no_aux(len(prompt_ids))

    def verify(self, ids, position):
        if len(ids) != self.k + 1:
            raise ValueError(f"the graphed verify takes exactly {self.k + 1} tokens, got {len(ids)}")
        self.ids.copy_(torch.tensor([ids]))
        self.first.fill_(position)
        self.replays[span_for(position + self.k + 1, self.target.capacity)]()
        return self.predicted[0].tolist(), self._no_aux(self.k + 1)

    def keep(self, length):
        pass  # slots past `length` are overwritten by the next forward, never cropped


class NgramDecoder:
    """Prompt-lookup speculative decoding on what eyrie.decoding.static.open_decoder returned, a fresh session per decode:
    graphed verifies on a StaticLlama, transformers' path (eyrie.decoding.decode) on anything else."""

    def __init__(self, target, aux_layer_ids: list[int] | None = None, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.target, self.verifier = target, None
        self.session = functools.partial(NgramSession, target.config.get_text_config(decoder=True).num_hidden_layers, aux_layer_ids, max_ngram, min_ngram)
        self.session()  # refuse bad settings now, not at the first decode

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, stop_ids, k: int) -> SpecResult:
        """Same tokens as greedy decoding."""
        if not isinstance(self.target, StaticLlama):
            return speculative_decode(self.target, self.session(), prompt_ids, max_new_tokens, stop_ids, k)
        self.target.ensure_capacity(needed_capacity(len(prompt_ids), max_new_tokens, k))
        if self.verifier is None or not self.verifier.fits(k):
            self.verifier = None  # free the old graphs before capturing the next
            self.verifier = GraphedVerifier(self.target, k)
        return speculative_rounds(self.verifier, self.session(), prompt_ids, max_new_tokens, stop_ids, k)
