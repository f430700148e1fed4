"""The train-to-serve parity gate: measured chain acceptance against what training predicted for the same k.

The field's most common silent failure is a drafter that scores well in training and poorly when served
(wrong aux layers, another chat template, d2t stored as ids, a rope mismatch): every one of them leaves
training's own numbers intact and shows only when the drafter decodes beside its target. Training records
the acceptance length it expects on held-out cached states (eyrie.training.acceptance, read here through
the drafter artifact); the benchmark measures it. A measured length more than `max_gap` (a share) below
the prediction is an error naming the usual causes, as a drafter that is not engaged is.

Only held-out prompts of the training datasets are gated: HumanEval or MT-bench come from other
distributions, so their gap is recorded, not judged.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.drafter.checkpoint import read_simulated_acceptance

USUAL_CAUSES = (
    "aux layer ids differ between extraction and decoding (an off-by-one in eagle_aux_hidden_state_layer_ids)",
    "the benchmark's chat template or target is not the one the cache was extracted with",
    "d2t read as target ids instead of offsets (target id = i + d2t[i])",
    "rope settings (rope_theta, rope_scaling, max_position_embeddings) differ between training and decoding",
    "benchmark prompts far from the training data (then raise bench.max_parity_gap or set it to null)",
)


def parity(drafter_dir: str | Path | None, measured: float | None, k: int, max_gap: float | None, gated: bool) -> dict:
    """{k, simulated, measured, gap, max_gap, gated, source, eval_samples, error}: gap = 1 - measured / simulated.

    The prediction is training's conditional chain length (each step scored only where every earlier step
    was right, as a chain is verified), else its product form. No drafter directory (an in-memory drafter),
    a drafter trained before training recorded it, or k beyond the trained steps: nothing to compare.
    """
    block = {"k": k, "simulated": None, "measured": measured, "gap": None, "max_gap": max_gap, "gated": gated,
             "source": None, "eval_samples": None, "error": None}
    summary = read_simulated_acceptance(drafter_dir) if drafter_dir is not None else None
    if summary is None or k not in summary["k"]:
        return block
    index = summary["k"].index(k)
    simulated = (summary.get("conditional_length") or summary["length"])[index]
    block.update(simulated=simulated, source=summary.get("source"), eval_samples=summary.get("eval_samples"))
    if simulated is None or measured is None:
        return block
    block["gap"] = 1.0 - measured / simulated
    if gated and max_gap is not None and block["gap"] > max_gap:
        causes = "; ".join(f"({i}) {cause}" for i, cause in enumerate(USUAL_CAUSES, 1))
        block["error"] = (
            f"measured acceptance length {measured:.3f} at k = {k} is {block['gap']:.0%} below the {simulated:.3f} training "
            f"predicted on {summary.get('eval_samples')} {summary.get('source')} (bench.max_parity_gap {max_gap:.0%}): the drafter is "
            f"served differently from how it was trained. Usual causes: {causes}"
        )
    return block
