"""The draft vocabulary: the target ids the drafter predicts, chosen by assistant-token frequency.

Draft id i stands for target id ``draft_ids[i]``. SGLang's EAGLE-3 loader reads ``d2t`` as
OFFSETS (target id = i + d2t[i]), not as the target ids themselves: storing the ids is a known
failure that loads without complaint and drafts garbage. ``t2d`` is a bool mask over the target
vocabulary, True at the kept ids. Both are stored, plus the counts they came from, in one
safetensors file (never pickle) with a JSON manifest in its metadata.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eyrie.core.artifacts import MANIFEST_KEY, ArtifactError, read_parquet_metadata, read_safetensors_manifest
from eyrie.core.atomic import write_safetensors_atomically
from eyrie.core.errors import ContractError, EyrieError



class VocabError(EyrieError):
    """The draft vocabulary cannot be built or does not hold together."""


class VocabSizeError(VocabError):
    pass


class VocabClippedWarning(UserWarning):
    """Fewer distinct assistant tokens were seen than the requested draft vocabulary size."""


def _shard_template(path: str) -> str | None:
    return read_parquet_metadata(path).get("template_sha256")


def count_assistant_tokens(token_shards: list[str], target_vocab_size: int) -> np.ndarray:
    """int64 [target_vocab_size]: how often each id appears where loss_mask is 1, over all shards."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for path in token_shards:
        table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        ids_col = table.column("input_ids").combine_chunks()
        mask_col = table.column("loss_mask").combine_chunks()
        same_length = pc.all(pc.equal(pc.list_value_length(ids_col), pc.list_value_length(mask_col))).as_py()
        if same_length is False:
            raise VocabError(f"{path}: a row's input_ids and loss_mask differ in length; re-run the tokenize stage")
        ids = ids_col.flatten().to_numpy(zero_copy_only=False)
        mask = mask_col.flatten().to_numpy(zero_copy_only=False).astype(bool)
        ids = ids[mask].astype(np.int64)
        if ids.size == 0:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= target_vocab_size:
            raise VocabError(
                f"{path}: token id {hi if hi >= target_vocab_size else lo} is outside the target vocabulary "
                f"[0, {target_vocab_size}); the shard was tokenized for another model"
            )
        counts += np.bincount(ids, minlength=target_vocab_size)
    return counts


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The draft_vocab_size most frequent seen ids (ties to the lower id), ascending."""
    seen = np.flatnonzero(counts)
    # lexsort sorts by the last key first: descending count, then ascending id.
    order = seen[np.lexsort((seen, -counts[seen]))]
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def build_draft_vocab(token_shards: list[str], target_vocab_size: int, draft_vocab_size: int, out_path: str) -> dict:
    """Count assistant tokens, keep the most frequent, write d2t/t2d/counts/draft_ids; returns the manifest."""
    import torch

    if not token_shards:
        raise VocabError("no token shards given: the draft vocabulary needs at least one")
    if draft_vocab_size < 1:
        raise VocabSizeError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size > target_vocab_size:
        raise VocabSizeError(
            f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({target_vocab_size}); "
            f"set it to at most {target_vocab_size}"
        )

    templates = {str(p): _shard_template(str(p)) for p in token_shards}
    distinct = sorted(set(templates.values()), key=str)
    if len(distinct) != 1 or distinct[0] is None:
        groups = {t: [p for p, tp in templates.items() if tp == t] for t in distinct}
        detail = "; ".join(f"{(t or 'none')[:12]}: {', '.join(ps)}" for t, ps in groups.items())
        raise ContractError(
            f"the token shards do not share one chat template fingerprint ({detail}); "
            "re-tokenize them all with the same target"
        )
    template_sha256 = distinct[0]

    counts = count_assistant_tokens([str(p) for p in token_shards], target_vocab_size)
    total = int(counts.sum())
    seen = int(np.count_nonzero(counts))
    if total == 0:
        raise VocabError(f"no assistant tokens in {len(token_shards)} shard(s): nothing to build a draft vocabulary from")
    effective = draft_vocab_size
    clipped = seen < draft_vocab_size
    if clipped:
        effective = seen
        warnings.warn(
            f"only {seen} distinct assistant tokens were seen, fewer than draft_vocab_size {draft_vocab_size}; "
            f"the draft vocabulary is clipped to {seen} (add data or lower draft_vocab_size)",
            VocabClippedWarning,
            stacklevel=2,
        )

    kept = select_draft_ids(counts, effective)
    d2t = kept - np.arange(effective, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[kept] = True
    manifest = {
        "draft_vocab_size": int(effective),
        "requested_draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": int(target_vocab_size),
        "assistant_tokens": total,
        "distinct_assistant_tokens": seen,
        "coverage": float(counts[kept].sum() / total),
        "template_sha256": template_sha256,
        "clipped": bool(clipped),
        "shards": len(token_shards),
    }
    tensors = {
        "d2t": torch.from_numpy(d2t),
        "t2d": torch.from_numpy(t2d),
        "counts": torch.from_numpy(counts),
        "draft_ids": torch.from_numpy(kept),
    }
    check_vocab(tensors["d2t"], tensors["t2d"])
    write_safetensors_atomically(tensors, out_path, {MANIFEST_KEY: json.dumps(manifest)})
    return manifest


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


def load_draft_vocab(path: str | Path):
    """(d2t int64 [Vd], t2d bool [V], manifest dict), checked to agree."""
    from safetensors.torch import load_file

    try:
        manifest = read_safetensors_manifest(path, "eyrie draft vocabulary")
    except ArtifactError as exc:
        raise VocabError(str(exc)) from None
    tensors = load_file(str(path))
    for key in ("d2t", "t2d"):
        if key not in tensors:
            raise VocabError(f"{path}: has no {key!r} tensor")
    try:
        check_vocab(tensors["d2t"], tensors["t2d"])
    except VocabError as exc:
        raise VocabError(f"{path}: {exc}") from None
    return tensors["d2t"], tensors["t2d"], manifest
