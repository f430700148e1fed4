"""What a benchmark checks before it measures: the template and target the drafter was trained for, a readable drafter
config, finite drafter logits. Each failure is an error naming the file, never a figure."""

from __future__ import annotations

from pathlib import Path

from eyrie.bench.errors import BenchmarkError, NonFiniteDrafterError
from eyrie.core.errors import ContractError


def check_template(tokenizer, target_dir, expected: str | None, drafter_config: dict | None, drafter_label: str) -> str:
    """The target's template fingerprint, after refusing any that differs from what the drafter was trained with."""
    from eyrie.target.model import model_fingerprint, template_fingerprint

    actual = template_fingerprint(tokenizer)
    trained = (drafter_config or {}).get("eyrie", {})
    claims = {"template_sha256_expected": expected, f"{drafter_label}/config.json eyrie.template_sha256": trained.get("template_sha256")}
    wrong = {where: sha for where, sha in claims.items() if sha is not None and sha != actual}
    if wrong:
        listing = "; ".join(f"{where} is {sha[:12]}" for where, sha in wrong.items())
        raise ContractError(
            f"{target_dir}: the target's chat template has sha256 {actual[:12]}, but {listing}. A drafter trained on "
            "one template loses acceptance silently under another: benchmark and serve with the tokenizer the "
            "drafter was trained with, or rerun the pipeline from the tokenize stage for this template."
        )
    if trained.get("target_fingerprint") not in (None, model_fingerprint(target_dir)):
        raise ContractError(
            f"{drafter_label}/config.json: the drafter was trained for another target than {target_dir} "
            "(eyrie.target_fingerprint differs); benchmark it with its own target, or retrain it"
        )
    return actual


def read_drafter_config(drafter_dir) -> dict:
    from eyrie.drafter.checkpoint import read_drafter_config as read_checked  # names the file and how to rebuild it

    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise BenchmarkError(f"{drafter_dir}: not a drafter directory (no config.json); run the train stage first")
    return read_checked(drafter_dir)


def check_drafter_logits(model, drafter, prompt_ids: list[int], label: str) -> None:
    """Refuse a drafter whose logits on the first prompt are NaN or infinite: its drafts would all be rejected, and
    the benchmark would report acceptance 1.0 of a broken drafter as a measurement."""
    import torch

    from eyrie.decoding.transformers_path import TransformersVerifier
    from eyrie.drafter.model import DraftCache

    with torch.inference_mode():
        first, aux = TransformersVerifier(model, list(drafter.shape.aux_layer_ids)).prefill(prompt_ids)
        ids = torch.tensor([list(prompt_ids[1:]) + [first]], device=drafter.fc.weight.device)  # position p reads token p + 1
        hidden = drafter.project_aux(aux.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype))
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        logits, _ = drafter.decode(hidden, ids, positions, DraftCache())
        bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise NonFiniteDrafterError(
            f"{label}: the drafter's logits on the first prompt hold {bad} non-finite values (NaN or infinity) of {logits.numel()}: "
            "it cannot draft, so nothing is measured. Retrain it (snakemake --cores all --force results/drafter && "
            "snakemake --cores all report.html); if it recurs, the hidden-state cache or the training diverged: see the training log"
        )
