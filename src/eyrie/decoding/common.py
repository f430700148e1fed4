"""What every decoder shares: result types, the drafter-session protocol, the accept rule and the round.

One speculative round is three steps, as in gpt-fast:
  draft   catch the drafter up on the target's features of the newly accepted positions,
          then chain k tokens one by one;
  verify  [current, *drafts] in one target forward;
  accept  the longest prefix the target agrees with, plus the target's own next token (the bonus).

`speculative_rounds` runs those rounds driven from the host, for any `Verifier` (transformers'
DynamicCache path, eyrie's static cache) and any `DraftSession`. The static decoder's graphed
round (decoding one replay per round) keeps the same three steps on device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch


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
    """What a speculative decoder needs from a drafter. Eagle3Chain is the real one; tests pass doubles."""

    aux_layer_ids: list[int]  # SGLang convention, see eyrie.target.aux_layers

    def extend(self, aux_hidden: torch.Tensor, next_ids: list[int], start: int) -> None:
        """Target features (1, m, 3H) of positions start..start+m-1 and the token after each of them.

        Forgets everything the session drafted at positions >= start.
        """

    def draft(self, k: int) -> list[int]:
        """k target token ids, chained from the last extended position."""


class Verifier(Protocol):
    """The target side of a round: one forward over many tokens, with the aux features the drafter reads."""

    def prefill(self, prompt_ids: list[int]) -> tuple[int, torch.Tensor]:
        """(first new token, aux features (1, P, 3H) of the prompt's positions)."""

    def verify(self, ids: list[int], position: int) -> tuple[list[int], torch.Tensor]:
        """(predicted[i]: the target's token after ids[i], aux (1, len(ids), 3H)) for ids starting at `position`."""

    def keep(self, length: int) -> None:
        """Only the first `length` positions of the KV cache are valid from now on."""


def finished(tokens: list[int], max_new_tokens: int, stop_ids) -> bool:
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


def emit(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """The part of `new` plain greedy would also have produced: up to the first stop token, within the budget."""
    for i, token in enumerate(new):
        if token in stop_ids:
            new = new[: i + 1]
            break
    return new[: max_new_tokens - len(tokens)]


def speculative_rounds(verifier: Verifier, session: DraftSession, prompt_ids: list[int], max_new_tokens: int, stop_ids, k: int) -> SpecResult:
    """Greedy chain speculative decoding, one host-driven round at a time; equals greedy decoding token for token."""
    start_time = time.perf_counter()
    first, aux = verifier.prefill(prompt_ids)
    tokens = [first]
    forwards, lengths, accepted_per_position = 1, [], [0] * k
    # What the drafter has not seen yet: target features, the token after each position, the first position.
    pending = (aux, list(prompt_ids[1:]) + tokens, 0)
    while not finished(tokens, max_new_tokens, stop_ids):
        current_position = len(prompt_ids) + len(tokens) - 1  # tokens[-1] is not in the target cache yet

        # Draft: the drafter takes the target's features of the newly accepted positions, then chains k tokens.
        session.extend(*pending)
        drafts = session.draft(k)

        # Verify: [current, *drafts] in one target forward; predicted[i] is the target's token after input i.
        predicted, aux = verifier.verify([tokens[-1], *drafts], current_position)
        forwards += 1

        # Accept: the longest agreeing prefix, then the target's own next token (the bonus).
        accepted, new = accept(drafts, predicted, accepted_per_position)
        emitted = emit(tokens, new, max_new_tokens, stop_ids)
        tokens += emitted
        lengths.append(len(emitted))
        verifier.keep(current_position + accepted + 1)  # the prompt, the current token and the accepted drafts
        pending = (aux[:, : accepted + 1], new, current_position)

    return SpecResult(tokens, time.perf_counter() - start_time, forwards, lengths, accepted_per_position)
