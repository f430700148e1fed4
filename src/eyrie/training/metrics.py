"""The training log: each step's figures summed over a logging window, the log entries, the final metrics.

A window is a plain dict so that it travels in the resume state (state.json) unchanged. An entry
written at or after an epoch's end also carries ``eval``: that epoch's simulated acceptance records
(eyrie.training.acceptance), one per epoch ended since the previous entry, each naming its step.
"""

from __future__ import annotations


def new_window(steps: int) -> dict:
    return {"loss": [0.0] * steps, "steps_with": [0] * steps, "correct": [0] * steps, "count": [0] * steps, "total": 0.0, "n": 0, "tokens": 0, "seconds": 0.0}


def add_step(window: dict, result: dict, seconds: float) -> None:
    """Add one train_step result (and its wall time) to the window."""
    window["total"] += result["loss"]
    window["n"] += 1
    window["tokens"] += result["tokens"]
    window["seconds"] += seconds
    for j, (loss_j, correct, count) in enumerate(result["stats"]):
        if count:
            window["loss"][j] += loss_j
            window["steps_with"][j] += 1
        window["correct"][j] += correct
        window["count"][j] += count


def log_entry(window: dict, step: int, steps_per_epoch: int, lr: float, steps: int) -> dict:
    """training_log.json's entry for the window that ends at `step` (1-based)."""
    return {
        "step": step,
        "epoch": step / steps_per_epoch,
        "lr": lr,
        "loss": window["total"] / window["n"],
        **_per_step(window, steps),
        "tokens_per_second": window["tokens"] / max(window["seconds"], 1e-9),
    }


def log_line(entry: dict, steps: int) -> str:
    """The progress line of a log entry."""
    acc = ["n/a" if a is None else f"{a:.3f}" for a in entry["acc_per_step"]]
    return (
        f"step {entry['step']}: loss {entry['loss']:.4f}, acc@0 {acc[0]}, acc@{steps - 1} {acc[-1]}, "
        f"lr {entry['lr']:.2e}, tok/s {entry['tokens_per_second']:.0f}"
    )


def final_metrics(log: list[dict], steps_per_epoch: int, ttt_steps: int) -> dict:
    """Per-step loss and accuracy over the logged windows of (about) the last epoch."""
    if not log:
        return {}
    last = log[-1]["step"]
    window = [e for e in log if e["step"] > last - steps_per_epoch] or [log[-1]]
    acc, loss = [], []
    for j in range(ttt_steps):
        count = sum(e["positions_per_step"][j] for e in window)
        correct = sum((e["acc_per_step"][j] or 0.0) * e["positions_per_step"][j] for e in window)
        acc.append(correct / count if count else None)
        losses = [e["loss_per_step"][j] for e in window if e["positions_per_step"][j]]
        loss.append(sum(losses) / len(losses) if losses else None)
    return {"accuracy_per_step": acc, "loss_per_step": loss, "loss": sum(e["loss"] for e in window) / len(window), "over_steps": [window[0]["step"], last]}


def _per_step(window: dict, steps: int) -> dict:
    loss = [window["loss"][j] / max(1, window["steps_with"][j]) for j in range(steps)]
    acc = [window["correct"][j] / window["count"][j] if window["count"][j] else None for j in range(steps)]
    return {"loss_per_step": loss, "acc_per_step": acc, "positions_per_step": list(window["count"])}
