"""train.hidden_noise: uniform noise on the cached aux states, in training steps only.

EAGLE-1 and speculators both train on features with noise added, so that the drafter learns on
inputs a little off the exact target states it will see at serving time. They differ:

    EAGLE-1      noise = (U[0,1) - 0.5) * std * 512 / L on each sample of L tokens, std 0.2: U(-0.1, 0.1)
                 at 512 tokens, wider for shorter samples, narrower for longer ones
    speculators  noise = 2 * (U[0,1) - 0.5) * std on the concatenated aux states, std 0.05 by
                 default: U(-0.05, 0.05), whatever the length (speculators/train/noise_transforms.py)

eyrie implements speculators': each element of a training sample's aux states [n, 3H] gets
U(-a, a), a = train.hidden_noise, added before anything else reads them (before input_norm with
drafter.norm_before_fc). EAGLE-1's 0.2 is a = 0.1 at 512-token samples. Padding, the final states
(the target's distribution) and the held-out simulation are never noised.

The noise of a sample is a function of (train.seed, epoch, the sample's place in the cache) alone,
drawn from its own generator: a resumed run, a batch padded to another length and a sample dealt
to another data-parallel rank all see the same noise, and the global random stream is untouched.
"""

from __future__ import annotations

import numpy as np
import torch


def sample_seed(seed: int, epoch: int, shard: int, start: int) -> int:
    """The seed of one sample's noise in one epoch: SeedSequence mixing, so nearby tuples give unrelated streams."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(shard), int(start)]).generate_state(1, np.uint64)[0] >> 1)


@torch.no_grad()
def add_hidden_noise(aux: torch.Tensor, refs: list, amplitude: float, *, seed: int, epoch: int) -> None:
    """aux [B, L, 3H] += U(-amplitude, amplitude) over each row's real tokens, in place; refs[row] = (shard, start, length)."""
    width = aux.shape[-1]
    for row, (shard, start, length) in enumerate(refs):
        generator = torch.Generator(device=aux.device).manual_seed(sample_seed(seed, epoch, shard, start))
        unit = torch.rand(length, width, generator=generator, device=aux.device, dtype=torch.float32)  # [0, 1)
        # Added in float32 and rounded once to the batch's dtype (bf16 under autocast), as speculators adds to its bf16 states.
        aux[row, :length] = (aux[row, :length].float() + (2.0 * unit - 1.0) * amplitude).to(aux.dtype)
