"""The draft vocabulary FORMAT: the target ids the drafter predicts, and how they are stored and checked.

Draft id i stands for target id ``draft_ids[i]``. SGLang's EAGLE-3 loader reads ``d2t`` as
OFFSETS (target id = i + d2t[i]), not as the target ids themselves: storing the ids is a known
failure that loads without complaint and drafts garbage. ``t2d`` is a bool mask over the target
vocabulary, True at the kept ids. Both are stored, plus the counts they came from, in one
safetensors file (never pickle) with a JSON manifest and its content digest in its metadata
(eyrie.core.digest; load_draft_vocab checks it). The build job (eyrie.tokens.build_vocab) chooses the
ids by assistant-token frequency.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eyrie.core.artifacts import MANIFEST_KEY, ArtifactError, load_safetensors, read_safetensors_manifest, rebuild_hint
from eyrie.core.atomic import write_safetensors_atomically
from eyrie.core.errors import EyrieError

WRITTEN_BY = "build_draft_vocab"  # the Snakemake rule that writes the draft vocabulary, named in read errors


class VocabError(EyrieError):
    """The draft vocabulary cannot be built or does not hold together."""


class VocabSizeError(VocabError):
    pass


def check_vocab(d2t, t2d) -> None:
    """Raise VocabError unless d2t (int64 offsets) and t2d (bool mask) describe the same ascending id set."""
    import torch

    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise VocabError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} with shape {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise VocabError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} with shape {tuple(t2d.shape)}")
    target_ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel()):
        raise VocabError(
            f"d2t maps draft ids to target ids outside [0, {t2d.numel()}): d2t must hold offsets "
            "(target id = i + d2t[i]), not the target ids themselves"
        )
    if d2t.numel() > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise VocabError("d2t's target ids (i + d2t[i]) are not strictly ascending")
    marked = t2d.nonzero().flatten()
    if marked.numel() != d2t.numel() or not torch.equal(marked, target_ids):
        raise VocabError(
            f"t2d marks {marked.numel()} target ids but d2t maps {d2t.numel()} draft ids, or they differ; "
            "d2t must hold offsets (target id = i + d2t[i]) of exactly the ids t2d marks"
        )


def write_draft_vocab(path: str | Path, draft_ids: np.ndarray, counts: np.ndarray, manifest: dict,
                      prompt_counts: np.ndarray | None = None) -> None:
    """Store the ascending target ids `draft_ids` as d2t offsets and a t2d mask over the len(counts) target ids,
    with the counts they were chosen from (prompt_counts too, when they were) and `manifest`."""
    import torch

    d2t = draft_ids - np.arange(len(draft_ids), dtype=np.int64)
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[draft_ids] = True
    tensors = {
        "d2t": torch.from_numpy(d2t),
        "t2d": torch.from_numpy(t2d),
        "counts": torch.from_numpy(counts),
        "draft_ids": torch.from_numpy(draft_ids),
    }
    if prompt_counts is not None:
        tensors["prompt_counts"] = torch.from_numpy(prompt_counts)
    check_vocab(tensors["d2t"], tensors["t2d"])
    write_safetensors_atomically(tensors, path, {MANIFEST_KEY: json.dumps(manifest)})


def load_draft_vocab(path: str | Path):
    """(d2t int64 [Vd], t2d bool [V], manifest dict), the file checked against its digest, d2t and t2d checked to agree."""
    try:
        manifest = read_safetensors_manifest(path, "eyrie draft vocabulary", written_by=WRITTEN_BY)
        tensors = load_safetensors(path, written_by=WRITTEN_BY)
    except ArtifactError as exc:
        raise VocabError(str(exc)) from None
    for key in ("d2t", "t2d"):
        if key not in tensors:
            raise VocabError(f"{path}: has no {key!r} tensor; {rebuild_hint(WRITTEN_BY, path)}")
    try:
        check_vocab(tensors["d2t"], tensors["t2d"])
    except VocabError as exc:
        raise VocabError(f"{path}: {exc}; {rebuild_hint(WRITTEN_BY, path)}") from None
    return tensors["d2t"], tensors["t2d"], manifest
