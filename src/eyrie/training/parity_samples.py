"""Training's own held-out samples, kept for the benchmark to serve again: the parity gate's like-for-like comparison.

The gate (eyrie.bench.parity) asks whether the drafter is served as it was trained. Comparing a benchmark's
held-out prompts with the walk over the held-out cache samples mixes that question with another: the two
are different prompts. On the H200 run, sixteen ShareGPT prompts served 1.70 against a walk of 1.98 over
256 cache samples, while the first sixteen of those cache samples' own prompts, served, gave 1.945 against
a walk of 1.949 on the same tokens (benchmarks/drafter_probe.py parity --eval-samples). So training keeps, for
PARITY_SAMPLES held-out samples spread over the cache, the prompt before each first assistant reply and that
reply's walked chains for every k (eyrie.drafter.checkpoint writes them beside the drafter); the benchmark
decodes those prompts and sets its acceptance beside the walk over exactly those replies. Only a serving
difference (aux layers, template, d2t, rope) or numerics can part the two.
"""

from __future__ import annotations

from eyrie.training.acceptance import first_reply_walks
from eyrie.training.holdout import HELD_OUT_SOURCE

PARITY_SAMPLES = 16  # held-out samples kept: ~10 s of bf16 chain decoding on an H200 at 256-token replies
_BATCH = 4  # samples per forward: a few sequences of up to batch_tokens each


def parity_samples(model, states, held_out: list, *, device, dtype, steps: int, limit: int = PARITY_SAMPLES, **forward) -> dict | None:
    """{"source", "k", "samples": [{"id", "prompt_ids", "reply_tokens", "rounds", "emitted"}]} of `limit` held-out samples
    spread over them, those whose first reply holds a round (rounds and emitted per k = 1..steps); None without held-out samples.

    forward: first_reply_walks' keyword arguments (target_lm_head, draft_ids, t2d, attention, use_bf16).
    """
    refs = list(held_out[:: max(1, len(held_out) // limit)][:limit])  # spread over the shards (and so the datasets)
    if not refs:
        return None
    ids = states.sample_ids(refs)
    was_training = model.training
    model.eval()
    walks = []
    try:
        for a in range(0, len(refs), _BATCH):
            batch = states.batch(refs[a : a + _BATCH], device, dtype=dtype)
            walks += first_reply_walks(model, batch, steps=steps, **forward)
            del batch
    finally:
        model.train(was_training)
    samples = [{"id": str(sample_id), **walk} for sample_id, walk in zip(ids, walks) if walk["rounds"][0] > 0]
    return {"source": HELD_OUT_SOURCE, "k": list(range(1, steps + 1)), "samples": samples}
