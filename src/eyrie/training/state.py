"""Resume state: where a run stands, saved so that a killed job goes on with the same weights and log.

``state_dir`` holds one safetensors file of tensors (trained weights, optimizer moments, RNG
states, and with train.keep_best the kept epoch's weights) and state.json (everything else, naming that file). Each is written then renamed, the
tensors first, so state.json always names a complete file; older tensor files go only after.
A state is resumed only by a run of the same inputs and settings (run_identity): the cache's manifests
and content digests, so a re-extracted cache with the same manifest but other values starts over
(hidden.mode online: each token shard's digest and the online settings, with the target's fingerprint).
The tensors file is written with an xxh3-128-tree digest (eyrie.core.digest): it can reach GBs at 8B widths
and is rewritten every few hundred steps.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eyrie.core.atomic import write_json_atomically, write_safetensors_atomically
from eyrie.core.digest import XXH3_128_TREE, verify
from eyrie.training.metrics import new_window

STATE_JSON = "state.json"
STATE_FORMAT = "eyrie-train-state/1"


@dataclass
class RunRecord:
    """What state.json keeps besides the weights and the optimizer: the steps done and their log."""

    step: int  # optimizer steps done
    log: list[dict]  # training_log.json's entries so far
    tokens: int
    seconds: float
    window: dict  # the open logging window (eyrie.training.metrics)
    pending_eval: list[dict] = field(default_factory=list)  # epoch-end simulated acceptances awaiting the next log entry
    best: dict | None = None  # train.keep_best: the kept epoch so far (eyrie.training.keep_best.best_record)

    @classmethod
    def start(cls, ttt_steps: int) -> "RunRecord":
        return cls(step=0, log=[], tokens=0, seconds=0.0, window=new_window(ttt_steps))


def run_identity(manifests: list[dict], d2t: torch.Tensor, drafter_cfg: dict, train_cfg: dict, template_sha256: str, target_fingerprint: str,
                 cache_digests: list[str | None] = ()) -> str:
    """Identity of a training run: what must match for a saved state to be resumed (every train setting but log_every,
    fused_loss, fused_norms, fused_pointwise and fused_weight_grads, which compute the same steps up to rounding: eval_fraction too, since it decides
    which samples train), and the data:
    each shard's manifest and content digest (eyrie.training.inputs.StateSource: a cache shard's, or online a token
    shard's, whose states the target fingerprint pins)."""
    digest = hashlib.sha256()
    for manifest in manifests:
        digest.update(json.dumps({k: v for k, v in manifest.items() if k not in ("file_bytes", "bytes_per_token")}, sort_keys=True).encode())
    digest.update(json.dumps(list(cache_digests)).encode())
    digest.update(d2t.numpy().tobytes())
    settings = {k: v for k, v in train_cfg.items() if k not in ("log_every", "fused_loss", "fused_norms", "fused_pointwise", "fused_weight_grads")}
    digest.update(json.dumps([drafter_cfg, settings, template_sha256, target_fingerprint], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The order of an epoch's n batches: a function of seed and epoch alone, so a resumed run sees the same batches."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n).tolist()


def save_state(state_dir: Path, run_id: str, record: RunRecord, model, optimizer, kept: dict[str, torch.Tensor] | None = None) -> None:
    """Trained weights, optimizer state, RNG states and the kept epoch's weights (kept, train.keep_best) beside the record,
    in the order that keeps resuming safe."""
    tensors = {f"model.{name}": p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad}
    tensors.update({f"kept.{name}": t.contiguous() for name, t in (kept or {}).items()})
    opt = optimizer.state_dict()
    opt_scalars = {}
    for idx, entry in opt["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                opt_scalars[f"{idx}.{key}"] = value
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    name = f"state-{record.step:08d}.safetensors"
    write_safetensors_atomically(tensors, state_dir / name, digest=XXH3_128_TREE)
    meta = {
        "run_id": run_id,
        **asdict(record),
        "format": STATE_FORMAT,
        "tensors": name,
        "optimizer_param_groups": opt["param_groups"],
        "optimizer_scalars": opt_scalars,
    }
    write_json_atomically(state_dir / STATE_JSON, meta, indent=None)
    for old in state_dir.glob("state-*.safetensors"):  # only after state.json names the new file
        if old.name != name:
            old.unlink(missing_ok=True)


def load_state(state_dir: Path, run_id: str, model, optimizer, say: Callable[[str], None]) -> tuple[RunRecord, dict[str, torch.Tensor]] | None:
    """(the saved progress, the kept epoch's weights or {}), with model, optimizer and RNG restored in place;
    None (and why, to say) if there is none to resume."""
    from safetensors.torch import load_file

    path = state_dir / STATE_JSON
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        verify(state_dir / meta["tensors"], "safetensors")  # a damaged state is not resumed: it would carry the damage on
        tensors = load_file(str(state_dir / meta["tensors"]))
    except Exception as exc:  # a half-written or foreign state is not fatal: train from the start
        say(f"train: ignoring unreadable resume state in {state_dir} ({exc}); starting over")
        return None
    if meta.get("format") != STATE_FORMAT or meta.get("run_id") != run_id:
        say(f"train: resume state in {state_dir} is from other inputs or settings; starting over")
        return None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(tensors[f"model.{name}"])
    opt_state: dict = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, idx, field = key.split(".", 2)
            opt_state.setdefault(int(idx), {})[field] = value
    for key, value in meta["optimizer_scalars"].items():
        idx, field = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[field] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["optimizer_param_groups"]})
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    record = RunRecord(meta["step"], meta["log"], meta["tokens"], meta["seconds"], meta["window"], meta.get("pending_eval", []), meta.get("best"))
    kept = {key.removeprefix("kept."): value for key, value in tensors.items() if key.startswith("kept.")}
    return record, kept
