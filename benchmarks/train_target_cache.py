"""Training with each batch's target view kept across epochs against recomputing it every step, side by side.

eyrie.training.target_cache keeps objective.target_distribution's result per batch while it fits a byte budget (small
draft vocabularies: the CPU default). This trains the same drafter twice on one pipeline run's cache, budget 0 (as
before) then the default budget, checks the weights are bit for bit equal and prints both speeds and their ratio.

    python benchmarks/train_target_cache.py <pipeline dir> --epochs 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_ablation import pipeline_inputs

from eyrie.training import target_cache
from eyrie.training.train import train_drafter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--epochs", type=float, default=3)
    args = parser.parse_args()
    inputs = pipeline_inputs(args.workdir.resolve())
    budgets = {"recomputed every step (budget 0)": 0, f"kept (budget {target_cache.BUDGET_BYTES >> 20} MiB)": target_cache.BUDGET_BYTES}
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, budget in budgets.items():
            target_cache.BUDGET_BYTES = budget
            out = Path(scratch) / str(budget)
            t0 = time.perf_counter()
            summary = train_drafter(
                hidden_paths=inputs["hidden_paths"], vocab_path=inputs["vocab_path"], target_dir=inputs["target_dir"], out_dir=str(out),
                state_dir=str(out) + ".state", drafter_cfg=inputs["drafter_cfg"], train_cfg={**inputs["train_cfg"], "epochs": args.epochs},
                template_sha256=inputs["template_sha256"], target_fingerprint=inputs["target_fingerprint"], progress=False,
            )
            rows[label] = (summary["tokens_per_second"], time.perf_counter() - t0, load_file(str(out / "model.safetensors")))
            print(f"{label}: {summary['tokens_per_second']:.0f} tok/s in the steps, {rows[label][1]:.1f} s in all", flush=True)
    (before, _, a), (after, _, b) = rows.values()
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"kept / recomputed: {after / before:.2f}x tok/s; weights bit for bit equal: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
