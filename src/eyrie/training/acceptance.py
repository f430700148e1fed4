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

Both average over every position alike, and a served chain does not: it verifies a round, jumps past
what was accepted and starts the next round there. Easy stretches (long accepted runs) are crossed in
a few rounds, hard ones are visited position by position, so a per-position average overweights the
easy stretches and predicts more than a decoder gets (on the H200 run's held-out prompts: conditional
2.32, served 1.70; benchmarks/drafter_probe.py parity). The walked form replays the decoder: along each sample
a round starts at t (token t+1 is the bonus token, an assistant token, and token t+2 is one too),
accepts a = min(k, the run of consecutive hits of steps 0, 1, ... at t), emits a + 1 tokens and the next
round starts at t + a + 1. walked_length(k) = emitted / rounds, the served acceptance length of a chain
of k drafts on these very tokens (a target argmax outside the draft vocabulary is a miss, as served).

A benchmark serves the first user turn of each held-out prompt, while a cache sample holds every turn of its
conversation, and later replies (with the earlier ones in context) are easier to draft: on the H200 run's drafter,
served 1.69 on first turns and 2.01 on second turns of the same 16 prompts, each matched by the walk to 0.3%
(benchmarks/drafter_probe.py parity --second-turn). So the walk is also counted over each sample's first assistant reply
alone (walked_first_turn_length), the prediction the parity gate compares a benchmark with.

Where prompt lookup would copy (the copy slice): at each round start t where prompt lookup (the benchmark's n-gram
baseline at k = 8) would have its first COPY_MIN_DRAFTS drafts or more accepted, the drafter's accepted drafts
min(k, run) beside prompt lookup's. A drafter that learned to copy from its context accepts about as much there. An
H200 drafter of the GPU config, decoded on three held-out ShareGPT prompts that quote or loop, accepted 2-4 tokens a
round where prompt lookup would have accepted 8-9 (`benchmarks/drafter_probe.py copy decode`), and that gap was what held-out ShareGPT's ratio
over the n-gram lacked.

Counts are integers summed over batches (all-reduced over data-parallel ranks, each rank taking
whole batches), so one rank and several give the same numbers.
"""

from __future__ import annotations

import time

import torch

from eyrie.decoding.ngram import lookup_runs
from eyrie.training.copyable import COPY_MIN_RUN
from eyrie.training.objective import needed_targets, shift_left, step_targets, target_distribution, ttt_hidden

HITS, COUNT, CHAIN_HITS, CHAIN_REACH, ROUNDS, EMITTED, FIRST_ROUNDS, FIRST_EMITTED, COPY_POSITIONS, COPY_DRAFTER, COPY_LOOKUP = range(11)
# One-step trees (1, N, N): N verified tokens are the bonus token and the drafter's top N - 1 first drafts, so a round
# accepts one draft when the target's token is among them. The CPU default's sweep serves these (its drafts past the
# first are ~never accepted).
ONE_STEP_TREES = (10, 32)
TREE_FIRST_ROUNDS, TREE_FIRST_EMITTED = 11, 11 + len(ONE_STEP_TREES)
# rows of the count tensor, one column per TTT step (ROUNDS and EMITTED: column k - 1 holds the walked chain of k
# drafts; FIRST_*: the same over each sample's first assistant reply; COPY_*: the copy slice, its drafter column k - 1
# for a chain of k; TREE_FIRST_*: row + i, column 0, the walked one-step tree (1, N, N), N = ONE_STEP_TREES[i], over first replies)
ROWS = ("hits", "count", "chain_hits", "chain_reach", "rounds", "emitted", "first_rounds", "first_emitted",
        "copy_positions", "copy_drafter", "copy_lookup", *(f"tree_first_rounds_{w}" for w in ONE_STEP_TREES),
        *(f"tree_first_emitted_{w}" for w in ONE_STEP_TREES))
LOOKUP_K = 8  # prompt lookup's drafts per round: the n-gram baseline's fastest on all three H200 benchmarks
COPY_MIN_DRAFTS = COPY_MIN_RUN  # a round start belongs to the copy slice when prompt lookup would have this many drafts accepted


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


def walk_rounds(runs: list[int], starts: list[bool], k: int) -> tuple[int, int]:
    """(rounds, tokens emitted) of a chain of k drafts decoding along one sample: runs[t] is the run of consecutive
    draft hits at position t, starts[t] whether a round can start there (see the module docstring)."""
    rounds = emitted = 0
    t = 0
    while t < len(runs):
        if not starts[t]:
            t += 1
            continue
        accepted = min(k, runs[t])
        rounds += 1
        emitted += accepted + 1
        t += accepted + 1
    return rounds, emitted


@torch.no_grad()
def batch_counts(model, batch: dict, *, target_lm_head, draft_ids, t2d, steps: int, attention: str, use_bf16: bool) -> torch.Tensor:
    """[len(ROWS), steps] int64 of one batch: per step hits and measured positions, the chain's hits and reach, and the walked
    chains' rounds and emitted tokens, over every turn and over first replies (see the module docstring)."""
    counts, runs, starts, first_starts, top_hits = _hits_and_runs(model, batch, target_lm_head=target_lm_head, draft_ids=draft_ids, t2d=t2d,
                                                                  steps=steps, attention=attention, use_bf16=use_bf16)
    rows = zip(runs.tolist(), starts.tolist(), first_starts.tolist(), batch["input_ids"].tolist(), batch["loss_mask"].tolist(),
               batch["lengths"].tolist(), top_hits.tolist())
    for sample_runs, sample_starts, sample_first, ids, mask, length, sample_top in rows:
        for i, hits in enumerate(sample_top):  # a one-step tree walks like a chain of one draft that hits on a top N - 1 hit
            rounds, emitted = walk_rounds(hits, sample_first, 1)
            counts[TREE_FIRST_ROUNDS + i, 0] += rounds
            counts[TREE_FIRST_EMITTED + i, 0] += emitted
        for k in range(1, steps + 1):
            for rounds_row, emitted_row, where in ((ROUNDS, EMITTED, sample_starts), (FIRST_ROUNDS, FIRST_EMITTED, sample_first)):
                rounds, emitted = walk_rounds(sample_runs, where, k)
                counts[rounds_row, k - 1] += rounds
                counts[emitted_row, k - 1] += emitted
        positions, drafter, lookup = copy_slice(sample_runs, sample_starts, ids[:length], mask[:length], steps)
        counts[COPY_POSITIONS] += positions
        counts[COPY_DRAFTER] += torch.tensor(drafter, dtype=counts.dtype, device=counts.device)
        counts[COPY_LOOKUP] += lookup
    return counts


def copy_slice(runs: list[int], starts: list[bool], ids: list[int], mask: list[bool], steps: int) -> tuple[int, list[int], int]:
    """One sample's copy slice: (round starts in it, the drafter's accepted drafts there summed for chains of
    k = 1..steps, prompt lookup's summed). A round at t knows tokens up to t + 1 (the bonus token) and drafts t + 2 on;
    prompt lookup's accepted drafts stop where the assistant's tokens do, as the drafter's do."""
    proposed_runs = lookup_runs(ids, LOOKUP_K)
    positions, lookup, drafter = 0, 0, [0] * steps
    for t, start in enumerate(starts[: len(ids) - 2]):
        if not start:
            continue
        accepted = 0
        while accepted < proposed_runs[t + 1] and mask[t + 2 + accepted]:
            accepted += 1
        if accepted >= COPY_MIN_DRAFTS:
            positions += 1
            lookup += accepted
            for k in range(1, steps + 1):
                drafter[k - 1] += min(k, runs[t])
    return positions, drafter, lookup


@torch.no_grad()
def first_reply_walks(model, batch: dict, *, target_lm_head, draft_ids, t2d, steps: int, attention: str, use_bf16: bool) -> list[dict]:
    """Per row of the batch: its first assistant reply's walked chains, {"rounds": [...], "emitted": [...]} for k = 1..steps
    (the per-sample terms of walked_first_turn_length), with the prompt before that reply ("prompt_ids") and the reply's
    length in tokens ("reply_tokens"): what a decoder serving the prompt replays (eyrie.training.parity_samples)."""
    _, runs, _, first_starts, _ = _hits_and_runs(model, batch, target_lm_head=target_lm_head, draft_ids=draft_ids, t2d=t2d, steps=steps,
                                                 attention=attention, use_bf16=use_bf16)
    reply = first_reply(batch["loss_mask"])
    walks = []
    for row, (sample_runs, sample_first) in enumerate(zip(runs.tolist(), first_starts.tolist())):
        begins = int(reply[row].int().argmax())  # the reply's first token (a trained sample has one)
        per_k = [walk_rounds(sample_runs, sample_first, k) for k in range(1, steps + 1)]
        walks.append({"prompt_ids": batch["input_ids"][row, :begins].tolist(), "reply_tokens": int(reply[row].sum()),
                      "rounds": [r for r, _ in per_k], "emitted": [e for _, e in per_k]})
    return walks


def _hits_and_runs(model, batch: dict, *, target_lm_head, draft_ids, t2d, steps: int, attention: str, use_bf16: bool):
    """(counts [len(ROWS), steps] with the per-step rows filled, runs [B, L]: consecutive draft hits from each position,
    starts [B, L]: where a round can start, first_starts [B, L]: the same within the first reply, top_hits
    [B, len(ONE_STEP_TREES), L]: 1 where the first draft's top N - 1 hold the target's token)."""
    lengths, loss_mask = batch["lengths"], batch["loss_mask"]
    _, target_row, target_arg = target_distribution(batch["final"], needed_targets(loss_mask, lengths), target_lm_head, draft_ids, t2d)
    device_type = batch["aux"].device.type
    counts = torch.zeros(len(ROWS), steps, dtype=torch.int64, device=loss_mask.device)
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_bf16):
        # Eager layers (compiled=None): the same numbers as train.compile's, without compiling a no-grad variant.
        outs = ttt_hidden(model, batch["aux"], batch["input_ids"], lengths, steps, attention=attention)
        chain = torch.ones_like(loss_mask)  # positions whose drafts so far all hit
        runs = torch.zeros(loss_mask.shape, dtype=torch.int64, device=loss_mask.device)
        top_hits = torch.zeros((loss_mask.shape[0], len(ONE_STEP_TREES), loss_mask.shape[1]), dtype=torch.int64, device=loss_mask.device)
        for j, out in enumerate(outs):
            valid, _, arg = step_targets(j, target_row, target_arg, loss_mask, lengths)
            hit = torch.zeros_like(valid)
            logits = model.head(out[valid])
            hit[valid] = logits.argmax(-1) == arg[valid]
            if j == 0:
                for i, tokens in enumerate(ONE_STEP_TREES):
                    top = logits.topk(min(tokens - 1, logits.shape[-1]), dim=-1).indices
                    top_hits[:, i][valid] = (top == arg[valid][:, None]).any(-1).long()
            reach = chain & valid
            chain = reach & hit
            counts[:CHAIN_REACH + 1, j] = torch.stack([hit.sum(), valid.sum(), chain.sum(), reach.sum()])
            runs = runs + chain  # chain: hit at every step so far, so runs ends as the run of consecutive hits
    L = loss_mask.shape[1]
    # A round starts where the bonus token t+1 and the next token t+2 are assistant tokens (a stop ends decoding).
    starts = shift_left(loss_mask, 1, False) & shift_left(loss_mask, 2, False) & (torch.arange(L, device=loss_mask.device)[None, :] + 2 < lengths[:, None])
    first_starts = starts & shift_left(first_reply(loss_mask), 2, False)
    return counts, runs, starts, first_starts, top_hits


def first_reply(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: each row's first contiguous run of loss-mask positions (its first assistant reply)."""
    begun = loss_mask.cumsum(1) > 0
    ended = (begun & ~loss_mask).cumsum(1) > 0
    return loss_mask & ~ended


def simulate_acceptance(model, cache, batches: list, *, rank: int, world: int, device, dtype, source: str, samples: int,
                        datasets: list[str] | None = None, **forward) -> dict:
    """The simulated acceptance of the model on these batches (rank r takes batches r, r + world, ...), the same on every rank.

    datasets: the dataset of each batch (each batch one dataset's samples); the result then also holds each dataset's own
    summary under "by_dataset", so a run that mixes datasets can be compared with one that trained on one of them.
    forward: batch_counts' keyword arguments (target_lm_head, draft_ids, t2d, steps, attention, use_bf16).
    """
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    names = sorted(set(datasets)) if datasets else []
    # Row 0: every batch; row 1 + g: dataset g's batches. One tensor, so one all-reduce.
    totals = torch.zeros(1 + len(names), len(ROWS), forward["steps"], dtype=torch.int64, device=device)
    try:
        for index in range(rank, len(batches), world):
            batch = cache.batch(batches[index], device, dtype=dtype)
            counts = batch_counts(model, batch, **forward)
            totals[0] += counts
            if names:
                totals[1 + names.index(datasets[index])] += counts
            del batch
    finally:
        model.train(was_training)
    if world > 1:
        torch.distributed.all_reduce(totals)
    totals = totals.tolist()
    result = acceptance_summary(totals[0], source=source, samples=samples, seconds=time.perf_counter() - t0)
    if names:
        result["by_dataset"] = {
            name: acceptance_summary(totals[1 + g], source=source, samples=sum(len(b) for b, d in zip(batches, datasets) if d == name))
            for g, name in enumerate(names)
        }
        for summary in result["by_dataset"].values():
            del summary["seconds"]  # the time is the whole simulation's
    return result


def acceptance_summary(totals: list[list[int]], *, source: str, samples: int, seconds: float = 0.0) -> dict:
    """The record of one simulation (training_log.json's eval entries, config.json's eyrie.simulated_acceptance) from its counts."""
    hits, count, chain_hits, chain_reach = totals[:4]
    none = [0] * len(hits)
    rounds, emitted = totals[4:6] if len(totals) >= 6 else (none, none)
    first_rounds, first_emitted = totals[6:8] if len(totals) >= 8 else (none, none)
    copy_positions, copy_drafter, copy_lookup = totals[8:11] if len(totals) >= 11 else (none, none, none)
    n_trees = len(ONE_STEP_TREES)
    has_trees = len(totals) >= TREE_FIRST_EMITTED + n_trees  # counts written before the one-step trees have none

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
        "walked_length": [ratio(e, r) for e, r in zip(emitted, rounds)],
        "walked_rounds": list(rounds),
        "walked_first_turn_length": [ratio(e, r) for e, r in zip(first_emitted, first_rounds)],
        "walked_first_turn_rounds": list(first_rounds),
        "positions_per_step": list(count),
        "copy": {
            "positions": copy_positions[0],
            "drafter_accepted": [ratio(d, copy_positions[0]) for d in copy_drafter],  # drafts accepted per round, chains of k = 1..
            "lookup_accepted": ratio(copy_lookup[0], copy_positions[0]),
            "lookup_k": LOOKUP_K,
            "min_lookup_drafts": COPY_MIN_DRAFTS,
        },
        # The walked acceptance of a one-step tree (1, N, N) over first replies, as the benchmark serves it.
        "one_step_trees": {
            "draft_tokens": list(ONE_STEP_TREES),
            "walked_first_turn_length": [ratio(totals[TREE_FIRST_EMITTED + i][0], totals[TREE_FIRST_ROUNDS + i][0]) for i in range(n_trees)],
        } if has_trees else None,
        "eval_samples": samples,
        "source": source,
        "seconds": seconds,
    }


def copy_line(copy: dict | None) -> str:
    """The progress line's words on the copy slice; empty when it has no positions."""
    if not copy or not copy["positions"]:
        return ""
    k = len(copy["drafter_accepted"])
    return (f"; where prompt lookup copies >= {copy['min_lookup_drafts']} ({copy['positions']} round starts), drafts accepted: "
            f"drafter {copy['drafter_accepted'][-1]:.2f} at k={k}, prompt lookup {copy['lookup_accepted']:.2f} at k={copy['lookup_k']}")


def acceptance_line(result: dict) -> str:
    """The progress line of one simulation."""

    def figures(values, digits):
        return " ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)

    return (
        f"eval epoch {result['epoch']:g}: simulated acceptance (k=1..{len(result['k'])}) {figures(result['length'], 2)}; "
        f"conditional {figures(result['conditional_length'], 2)}; walked {figures(result.get('walked_length') or [], 2)}; "
        f"walked over first replies {figures(result.get('walked_first_turn_length') or [], 2)}; "
        f"step accuracy {figures(result['per_step_accuracy'], 3)} "
        f"({result['eval_samples']} {result['source']})"
        + _trees_line(result.get("one_step_trees"))
        + copy_line(result.get("copy"))
        + "".join(f"; {name} alone, walked over first replies {figures(d.get('walked_first_turn_length') or [], 2)} ({d['eval_samples']})"
                  + _dataset_copy(d.get("copy")) for name, d in (result.get("by_dataset") or {}).items())
    )


def _trees_line(trees: dict | None) -> str:
    if not trees:
        return ""
    return "; one-step trees over first replies " + ", ".join(
        f"(1, {k}, {k}) {'n/a' if v is None else f'{v:.2f}'}" for k, v in zip(trees["draft_tokens"], trees["walked_first_turn_length"]))


def _dataset_copy(copy: dict | None) -> str:
    """One dataset's copy slice in the progress line: held-out sets that mix datasets differ in it (a dataset of
    rework prompts copies far more than ShareGPT), so an A/B that adds a dataset compares each dataset's own."""
    if not copy or not copy["positions"]:
        return ""
    return f", copy slice drafter {copy['drafter_accepted'][-1]:.2f} / prompt lookup {copy['lookup_accepted']:.2f} ({copy['positions']} round starts)"
