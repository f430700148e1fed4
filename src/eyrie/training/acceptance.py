"""Simulated acceptance length: what training predicts the served drafter's chain acceptance to be.

The TTT forward (eyrie.training.objective) is run without gradients, in eval mode, on the held-out
cache samples (eyrie.training.holdout). Step j at position t is the j-th chained draft after t, so
per step j the accuracy a_j of the drafter's greedy token against the target's greedy token, over
the positions training trains on (token t+2+j exists and is an assistant token, the target's argmax
lies in the draft vocabulary), gives the expected acceptance length of a chain of k drafts, bonus
token counted (SpecForge's simulated_acc_len):

    length(k) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{k-1}

The product treats the steps as independent. The conditional form measures the chain directly:
c_j = P(step j hits | steps 0..j-1 all hit at the same position), length_conditional(k) = 1 + c_0
+ c_0 c_1 + ..., i.e. the mean accepted run per position. Both count only draft-vocabulary targets,
so a drafter whose vocabulary misses the target's tokens serves below them.

Counts are integers summed over batches (all-reduced over data-parallel ranks, each rank taking
whole batches), so one rank and several give the same numbers.
"""

from __future__ import annotations

import time

import torch

from eyrie.training.objective import needed_targets, step_targets, target_distribution, ttt_hidden

HITS, COUNT, CHAIN_HITS, CHAIN_REACH = range(4)  # rows of the count tensor, one column per TTT step


def acceptance_lengths(accuracy: list[float | None]) -> list[float | None]:
    """[length(k) for k = 1..len(accuracy)]: 1 + sum over i <= k of a_0 ... a_{i-1}; None from the first unmeasured step on
    (unless the chain already stopped: a product of 0 adds nothing whatever comes after)."""
    lengths: list[float | None] = []
    total, reach = 1.0, 1.0
    for a in accuracy:
        if total is None or (a is None and reach > 0):
            total = None
        elif reach > 0:
            reach *= a
            total += reach
        lengths.append(total)
    return lengths


@torch.no_grad()
def batch_counts(model, batch: dict, *, target_lm_head, draft_ids, t2d, steps: int, attention: str, use_bf16: bool) -> torch.Tensor:
    """[4, steps] int64 of one batch: per step hits and measured positions, and the chain's hits and reach (see the module docstring)."""
    lengths, loss_mask = batch["lengths"], batch["loss_mask"]
    _, target_row, target_arg = target_distribution(batch["final"], needed_targets(loss_mask, lengths), target_lm_head, draft_ids, t2d)
    device_type = batch["aux"].device.type
    counts = torch.zeros(4, steps, dtype=torch.int64, device=loss_mask.device)
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_bf16):
        # Eager layers (compiled=None): the same numbers as train.compile's, without compiling a no-grad variant.
        outs = ttt_hidden(model, batch["aux"], batch["input_ids"], lengths, steps, attention=attention)
        chain = torch.ones_like(loss_mask)  # positions whose drafts so far all hit
        for j, out in enumerate(outs):
            valid, _, arg = step_targets(j, target_row, target_arg, loss_mask, lengths)
            hit = torch.zeros_like(valid)
            hit[valid] = model.head(out[valid]).argmax(-1) == arg[valid]
            reach = chain & valid
            chain = reach & hit
            counts[:, j] = torch.stack([hit.sum(), valid.sum(), chain.sum(), reach.sum()])
    return counts


def simulate_acceptance(model, cache, batches: list, *, rank: int, world: int, device, dtype, source: str, samples: int, **forward) -> dict:
    """The simulated acceptance of the model on these batches (rank r takes batches r, r + world, ...), the same on every rank.

    forward: batch_counts' keyword arguments (target_lm_head, draft_ids, t2d, steps, attention, use_bf16).
    """
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, forward["steps"], dtype=torch.int64, device=device)
    try:
        for refs in batches[rank::world]:
            batch = cache.batch(refs, device, dtype=dtype)
            totals += batch_counts(model, batch, **forward)
            del batch
    finally:
        model.train(was_training)
    if world > 1:
        torch.distributed.all_reduce(totals)
    return acceptance_summary(totals.tolist(), source=source, samples=samples, seconds=time.perf_counter() - t0)


def acceptance_summary(totals: list[list[int]], *, source: str, samples: int, seconds: float = 0.0) -> dict:
    """The record of one simulation (training_log.json's eval entries, config.json's eyrie.simulated_acceptance) from its counts."""
    hits, count, chain_hits, chain_reach = totals

    def ratio(a, b):
        return a / b if b else None

    accuracy = [ratio(h, n) for h, n in zip(hits, count)]
    conditional = [ratio(h, n) for h, n in zip(chain_hits, chain_reach)]
    return {
        "k": list(range(1, len(hits) + 1)),
        "length": acceptance_lengths(accuracy),
        "per_step_accuracy": accuracy,
        "conditional_accuracy": conditional,
        "conditional_length": acceptance_lengths(conditional),
        "positions_per_step": list(count),
        "eval_samples": samples,
        "source": source,
        "seconds": seconds,
    }


def acceptance_line(result: dict) -> str:
    """The progress line of one simulation."""

    def figures(values, digits):
        return " ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)

    return (
        f"eval epoch {result['epoch']:g}: simulated acceptance (k=1..{len(result['k'])}) {figures(result['length'], 2)}; "
        f"conditional {figures(result['conditional_length'], 2)}; step accuracy {figures(result['per_step_accuracy'], 3)} "
        f"({result['eval_samples']} {result['source']})"
    )
