"""The train-to-serve parity gate: measured chain acceptance against what training predicted for the same k.

The field's most common silent failure is a drafter that scores well in training and poorly when served
(wrong aux layers, another chat template, d2t stored as ids, a rope mismatch): every one of them leaves
training's own numbers intact and shows only when the drafter decodes beside its target. Training records
the acceptance length it expects on held-out cached states (eyrie.training.acceptance, read here through
the drafter artifact); the benchmark measures it. A measured length more than `max_gap` (a share) below
the prediction is an error naming the usual causes, as a drafter that is not engaged is.

Only a prediction that can be trusted is judged: made on at least MIN_JUDGED_SAMPLES held-out cache
samples (a prediction on training samples is optimistic by construction: the drafter has seen them), and
compared on held-out prompts of the training datasets (HumanEval or MT-bench come from other
distributions). Every other gap is recorded with the reason it is not judged.

Like with like: a drafter that kept parity samples (eyrie.training.parity_samples: the prompts of some of
training's own held-out samples, with the walked chains of their first replies) has those prompts served
here too (serve_parity_samples), and the gate judges that measurement against the walk over exactly those
replies: only serving can part them. The benchmark's own prompts are other prompts, and a handful of them
can sit far from the cache's average (16 ShareGPT prompts: 1.70 served against a 1.98 walk over 256 cache
samples, whose own first 16 prompts served 1.945 against their walk's 1.949); their comparison is recorded
beside it (heldout_prompts), not judged. Drafters without parity samples are judged on the benchmark's prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

from eyrie.drafter.checkpoint import first_turn_prediction, one_step_tree_prediction, read_parity_samples, read_simulated_acceptance

HELD_OUT = "held-out cache samples"  # the source training names for its held-out split
MIN_JUDGED_SAMPLES = 8  # fewer held-out samples make too noisy a prediction to fail a run on
SERVED_FORM = "served_parity_samples"  # the prediction's form when the gate compares like with like

USUAL_CAUSES = (
    "aux layer ids differ between extraction and decoding (an off-by-one in eagle_aux_hidden_state_layer_ids)",
    "the benchmark's chat template or target is not the one the cache was extracted with",
    "d2t read as target ids instead of offsets (target id = i + d2t[i])",
    "rope settings (rope_theta, rope_scaling, max_position_embeddings) differ between training and decoding",
    "benchmark prompts far from the training data (then raise bench.max_parity_gap or set it to null)",
)


def measured_interval(per_prompt: list[dict], draws: int = 2000, seed: int = 0) -> list[float] | None:
    """95% interval of the pooled acceptance length (accepted tokens over rounds, as the benchmark's mean) when the
    prompts are drawn again with replacement: how far another handful of prompts could have moved the measurement.
    Sixteen ShareGPT prompts on the H200 gave 1.70 within 1.55-1.91, ±10%: most of a 15% gate. None under 2 prompts."""
    rows = [(sum(p["acceptance_lengths"]), p["rounds"]) for p in per_prompt if p.get("rounds") and p.get("acceptance_lengths")]
    if len(rows) < 2:
        return None
    pick = random.Random(seed)
    pooled = sorted(
        sum(rows[i][0] for i in drawn) / sum(rows[i][1] for i in drawn)
        for drawn in ([pick.randrange(len(rows)) for _ in rows] for _ in range(draws))
    )
    return [pooled[int(0.025 * draws)], pooled[int(0.975 * draws) - 1]]


def parity_prompts(drafter_dir: str | Path | None, k: int, max_gap: float | None, gated: bool) -> list[dict]:
    """The parity samples this benchmark serves: the drafter's (read_parity_samples) when the gate would judge them
    (a gated benchmark, a max_gap, k among the walked chains, at least MIN_JUDGED_SAMPLES of them), else []."""
    if drafter_dir is None or max_gap is None or not gated:
        return []
    record = read_parity_samples(drafter_dir)
    if record is None or k not in record["k"] or len(record["samples"]) < MIN_JUDGED_SAMPLES:
        return []
    return record["samples"]


def serve_parity_samples(engine, drafter, samples: list[dict], k: int, stop_ids) -> dict | None:
    """Decode each parity sample's prompt with a chain of k drafts for as many tokens as its first reply held, untimed:
    {samples, measured, simulated (the walk over the same replies), interval, per_sample}; None without samples."""
    if not samples:
        return None
    from eyrie.decoding.decode import speculative_decode

    rows = []
    for sample in samples:
        spec = speculative_decode(engine, drafter, sample["prompt_ids"], sample["reply_tokens"], stop_ids, k)
        rows.append({"id": sample["id"], "rounds": spec.rounds, "acceptance_lengths": spec.acceptance_lengths,
                     "walked_rounds": sample["rounds"][k - 1], "walked_emitted": sample["emitted"][k - 1]})
    rounds = sum(r["rounds"] for r in rows)
    walked_rounds = sum(r["walked_rounds"] for r in rows)
    return {
        "samples": len(rows),
        "measured": sum(sum(r["acceptance_lengths"]) for r in rows) / rounds if rounds else None,
        "simulated": sum(r["walked_emitted"] for r in rows) / walked_rounds if walked_rounds else None,
        "interval": measured_interval(rows),
        "per_sample": [{"id": r["id"], "rounds": r["rounds"], "emitted": sum(r["acceptance_lengths"]),
                        "walked_rounds": r["walked_rounds"], "walked_emitted": r["walked_emitted"]} for r in rows],
    }


def parity(drafter_dir: str | Path | None, measured: float | None, k: int, max_gap: float | None, gated: bool,
           interval: list[float] | None = None, served: dict | None = None, dataset: str | None = None) -> dict:
    """{k, simulated, measured, interval, gap, max_gap, judged, not_judged_because, source, eval_samples, error}:
    gap = 1 - measured / simulated; interval: measured_interval's, recorded and named in the error.

    gated: the prompts are held out of the training datasets (the benchmark's own datasets), so a gap can be judged.

    The prediction is training's walked chain length over the first assistant reply of each held-out cache
    sample (a decoder's rounds replayed there: the benchmark serves first turns too), else, for drafters trained
    before it, the walked length over every turn, the conditional or the product form (both per position, and
    optimistic: eyrie.training.acceptance). No drafter directory (an in-memory drafter),
    a drafter trained before training recorded it, or k beyond the trained steps: nothing to compare.

    dataset: the training dataset whose held-out prompts the benchmark served. Where training also walked that
    dataset's held-out samples alone (a run on several datasets), the recorded comparison on the benchmark's own
    prompts (heldout_prompts) is with that walk; the judged one is unchanged.
    """
    block = {"k": k, "simulated": None, "form": None, "measured": measured, "interval": interval, "gap": None, "max_gap": max_gap, "judged": False,
             "not_judged_because": "training recorded no prediction for this k", "source": None, "eval_samples": None, "error": None}
    summary = read_simulated_acceptance(drafter_dir) if drafter_dir is not None else None
    if summary is None or k not in summary["k"]:
        return block
    index = summary["k"].index(k)
    form, lengths = first_turn_prediction(summary)
    simulated = lengths[index]
    block.update(simulated=simulated, form=form, source=summary.get("source"), eval_samples=summary.get("eval_samples"))
    if served is not None and served.get("measured") is not None and served.get("simulated") is not None:
        # Like with like: the benchmark's own prompts are recorded beside, not judged.
        own = summary.get("by_dataset", {}).get(dataset) if dataset else None  # checked by read_simulated_acceptance
        own_form, own_lengths = first_turn_prediction(own) if own is not None and k in own["k"] else (None, None)
        if own_lengths and own_lengths[index] is not None:
            prompts_side = {"simulated": own_lengths[index], "form": own_form, "dataset": dataset, "eval_samples": own["eval_samples"]}
        else:
            prompts_side = {"simulated": simulated, "form": form, "dataset": None, "eval_samples": summary.get("eval_samples")}
        own_simulated = prompts_side["simulated"]
        block["heldout_prompts"] = {"measured": measured, "interval": interval, **prompts_side,
                                    "gap": 1.0 - measured / own_simulated if measured is not None and own_simulated else None}
        measured, simulated, interval = served["measured"], served["simulated"], served["interval"]
        block.update(measured=measured, simulated=simulated, interval=interval, form=SERVED_FORM, eval_samples=served["samples"],
                     served=served)
    if simulated is None or measured is None:
        return block
    block["gap"] = 1.0 - measured / simulated
    block["not_judged_because"] = _why_not_judged(summary, max_gap, gated)
    block["judged"] = block["not_judged_because"] is None
    if block["judged"] and block["gap"] > max_gap:
        like_with_like = block["form"] == SERVED_FORM
        causes = "; ".join(f"({i}) {cause}" for i, cause in enumerate(USUAL_CAUSES[:-1] if like_with_like else USUAL_CAUSES, 1))
        on = (f"on the prompts of {block['eval_samples']} of its own held-out cache samples, served here" if like_with_like
              else f"on {summary.get('eval_samples')} {summary.get('source')}")
        more = f"{block['eval_samples']} parity samples" if like_with_like else "raise bench.prompts_per_dataset"
        block["error"] = (
            f"measured acceptance length {measured:.3f} at k = {k} is {block['gap']:.0%} below the {simulated:.3f} training "
            f"predicted {on} (bench.max_parity_gap {max_gap:.0%}): the drafter is "
            f"served differently from how it was trained. Usual causes: {causes}"
            + (f". The measurement's 95% interval over its prompts is {interval[0]:.3f}-{interval[1]:.3f}"
               + (f" and holds the prediction: few prompts, not a fault, may explain the gap ({more})"
                  if interval[1] >= simulated else "") if interval else "")
        )
    return block


def _why_not_judged(summary: dict, max_gap: float | None, gated: bool) -> str | None:
    if max_gap is None:
        return "bench.max_parity_gap is null"
    if not gated:
        return "these prompts are not from the training datasets"
    if summary.get("source") != HELD_OUT:
        return "training predicted on its own training samples (no held-out cache samples), which is optimistic"
    if (summary.get("eval_samples") or 0) < MIN_JUDGED_SAMPLES:
        return f"training held out {summary.get('eval_samples')} cache samples, fewer than {MIN_JUDGED_SAMPLES}"
    return None


def predict_settings(settings: list[dict], drafter_dir: str | Path | None) -> None:
    """Set training's prediction beside each sweep setting it walked, in place: a chain of k (its walk over first replies
    at k) or a one-step tree (1, N, N) (its one-step trees' walk), as `predicted` {length, gap, form, eval_samples,
    source}, gap = 1 - measured / predicted. Recorded, never judged: the main chain's gate judges the drafter, and a
    setting's prompts here are few (bench.sweep_prompts). Settings training did not walk get nothing."""
    summary = read_simulated_acceptance(drafter_dir) if drafter_dir is not None else None
    if summary is None:
        return
    form, chains = first_turn_prediction(summary)
    trees = one_step_tree_prediction(summary)
    for setting in settings:
        steps, topk, tokens = setting["steps"], setting["topk"], setting["draft_tokens"]
        if topk == 1 and tokens == steps + 1 and steps in summary["k"]:
            length, setting_form = chains[summary["k"].index(steps)], form
        elif steps == 1 and topk == tokens and tokens in trees:
            length, setting_form = trees[tokens], "one_step_trees"
        else:
            continue
        if length is None:
            continue
        measured = setting.get("mean_acceptance_length")
        setting["predicted"] = {"length": length, "gap": None if measured is None else 1.0 - measured / length, "form": setting_form,
                                "eval_samples": summary.get("eval_samples"), "source": summary.get("source")}
