"""The held-out cache samples: a small share of the hidden-state cache kept out of training.

train.eval_fraction picks them by a stable hash of the sample id (the cache manifest's ``ids``),
never by position: a sample is held out when its id's unit number is below the fraction, so adding
shards moves no sample between the sets. Each epoch the drafter is run on them without gradients
(eyrie.training.acceptance). Bounds: at least 1 held-out sample (the lowest unit number when none
falls below the fraction) and at most MAX_HELD_OUT (the lowest unit numbers); only at those bounds
can new samples push one back into training. A cache of fewer than MIN_CACHE_SAMPLES trainable
samples holds none out (tiny configs train on everything).
"""

from __future__ import annotations

import hashlib

from eyrie.tokens.shards import record_of

MIN_CACHE_SAMPLES = 20
MAX_HELD_OUT = 256
TRAINING_BATCHES = 4  # without held-out samples, the simulation runs on this many training batches
HELD_OUT_SOURCE = "held-out cache samples"
TRAINING_SOURCE = "training samples"


def eval_unit(sample_id: str) -> float:
    """A number in [0, 1) fixed by the sample's record alone (sha256), so the per-turn samples of one conversation, which
    share its earlier turns, fall on one side together; salted so it is independent of the data stage's holdout and shards."""
    return int.from_bytes(hashlib.sha256(f"eval:{record_of(sample_id)}".encode()).digest()[:8], "big") / 2**64


def held_out_indices(sample_ids: list[str], fraction: float) -> list[int]:
    """Indices (ascending) of the samples held out of training; [] when fraction is 0 or there are too few samples."""
    if fraction <= 0 or len(sample_ids) < MIN_CACHE_SAMPLES:
        return []
    units = [eval_unit(str(i)) for i in sample_ids]
    by_unit = sorted(range(len(units)), key=lambda k: (units[k], k))
    below = [k for k in by_unit if units[k] < fraction]
    return sorted((below or by_unit[:1])[:MAX_HELD_OUT])


def held_out_note(fraction: float, cache_samples: int, held_out: int) -> str:
    """The log line that says which samples the simulated acceptance runs on, and why."""
    if held_out:
        return (
            f"train: eval: {held_out} of {cache_samples} cache samples held out of training (train.eval_fraction {fraction:g}, "
            f"by sample id); simulated acceptance each epoch on them"
        )
    if fraction <= 0:
        why = "train.eval_fraction is 0"
    else:
        why = f"the cache has {cache_samples} trainable samples, fewer than {MIN_CACHE_SAMPLES}"
    return f"train: eval: no held-out samples ({why}); simulated acceptance each epoch on {TRAINING_BATCHES} or fewer training batches"


def spread_batches(batches: list, count: int = TRAINING_BATCHES) -> list:
    """Up to `count` batches spread over the plan (which runs longest first), so short and long samples both count."""
    stride = max(1, len(batches) // count)
    return batches[::stride][:count]
