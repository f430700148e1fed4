"""train.keep_best: the drafter written at the end is the epoch with the best simulated acceptance.

Each epoch ends with a simulation on the held-out cache samples (eyrie.training.acceptance). Its
score is the simulated acceptance length (the walked chain's where recorded) of the longest measured chain (k = drafter.ttt_steps
unless a step had no positions to measure; the same k every epoch, since which positions are
measured depends on the data alone). An epoch at least as good as the best so far replaces it:
ties go to the later epoch, the one training without keep_best would write.

The kept epoch's weights are held in the checkpoint's dtype (train.dtype: what would be written
then), on the CPU, and saved in the resume state beside the running weights, so a killed and
resumed run keeps the same epoch and writes the same bytes.
"""

from __future__ import annotations

import torch

from eyrie.drafter.checkpoint import predicted_lengths


def acceptance_score(evaluation: dict) -> tuple[int, float] | None:
    """(k, simulated acceptance length) of the longest chain with a length, or None when nothing was measured."""
    for k, length in reversed(list(zip(evaluation["k"], predicted_lengths(evaluation)[1]))):
        if length is not None:
            return int(k), float(length)
    return None


def is_better(evaluation: dict, best: dict | None) -> bool:
    """Whether this epoch's evaluation replaces the best so far (ties and unmeasured bests go to the later epoch)."""
    if best is None or best["length"] is None:
        return True
    score = acceptance_score(evaluation)
    return score is not None and score[1] >= best["length"]


def best_record(evaluation: dict) -> dict:
    """RunRecord.best: the kept epoch, its score and its whole evaluation (what config.json's simulated_acceptance becomes)."""
    score = acceptance_score(evaluation)
    return {"epoch": evaluation["epoch"], "step": evaluation["step"], "k": None if score is None else score[0],
            "length": None if score is None else score[1], "evaluation": evaluation}


def kept_note(best: dict | None, last: dict, keep_best: bool) -> dict:
    """training_log.json's (last entry's) and config.json's ``kept``: which epoch's weights were written, and why."""
    last_score = acceptance_score(last)
    if not keep_best or best is None:
        return {"epoch": last["epoch"], "step": last["step"], "by": "the last epoch (train.keep_best: false)"}
    source = f"{best['evaluation']['eval_samples']} {best['evaluation']['source']}"
    if best["step"] == last["step"]:
        why = "the last epoch is the best"
    else:
        last_text = "unmeasured" if last_score is None else f"{last_score[1]:.4f}"
        why = f"better than the last epoch's {last_text}"
    return {
        "epoch": best["epoch"],
        "step": best["step"],
        "k": best["k"],
        "length": best["length"],
        "last_epoch_length": None if last_score is None else last_score[1],
        "by": f"train.keep_best: best simulated acceptance length at k={best['k']} on {source}; {why}",
    }


def snapshot(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trained weights as they would be written (in dtype), copied to the CPU."""
    return {name: p.detach().to(device="cpu", dtype=dtype, copy=True) for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def restore(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The kept weights into the model's (float32 master) parameters: written again in their dtype, they are the kept bytes."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.copy_(weights[name])
