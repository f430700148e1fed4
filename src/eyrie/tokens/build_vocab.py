"""The build_vocab job: count assistant tokens over the token shards and keep the most frequent as the draft vocabulary.

With `from_prompts`, the tokens the target read in its prompts but never wrote come after every token it wrote, the
most read first, where never-seen ids would pad. The target copies such tokens from the prompt (names, references,
quoted text), and a drafter can only propose ids its vocabulary holds (`benchmarks/drafter_probe.py copy vocab`).

How the chosen ids are stored (d2t offsets, t2d mask) and checked belongs to eyrie.tokens.vocab.
"""

from __future__ import annotations

import warnings

import numpy as np

from eyrie.core.errors import ContractError
from eyrie.tokens.shards import read_tokens, shard_template
from eyrie.tokens.vocab import WRITTEN_BY, VocabError, VocabSizeError, load_draft_vocab, write_draft_vocab

# The draft head's rows: at 26,641 (not a multiple of 8) cuBLAS ran the head's products in Turing-era kernels on an
# H200, and a training step at the pipeline's shape took 1.39x as long as at 30,952 (`benchmarks/train_throughput.py --shape pipeline`).
ALIGNMENT = 8


class VocabClippedWarning(UserWarning):
    """Fewer distinct tokens were seen (assistant ones, and prompt ones with from_prompts) than the requested draft
    vocabulary size."""


def count_tokens(token_shards: list[str], target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(assistant, prompt): int64 [target_vocab_size] each, how often each id appears where loss_mask is 1 and where
    it is 0 (system and user turns, the template's own tokens), over all shards."""
    assistant = np.zeros(target_vocab_size, dtype=np.int64)
    prompt = np.zeros(target_vocab_size, dtype=np.int64)
    for path in token_shards:
        _, ids, mask, _ = read_tokens(path, VocabError, with_ids=False)
        if ids.size == 0:
            continue
        ids = ids.astype(np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= target_vocab_size:
            raise VocabError(
                f"{path}: token id {hi if hi >= target_vocab_size else lo} is outside the target vocabulary "
                f"[0, {target_vocab_size}); the shard was tokenized for another model"
            )
        mask = mask.astype(bool)
        assistant += np.bincount(ids[mask], minlength=target_vocab_size)
        prompt += np.bincount(ids[~mask], minlength=target_vocab_size)
    return assistant, prompt


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int, prompt_counts: np.ndarray | None = None) -> np.ndarray:
    """The draft_vocab_size most frequent ids, ascending. Ties go to the more frequent in prompts when prompt_counts is
    given (so ids the target read but never wrote come right after those it wrote), then to the lower id (never-seen
    ids last, lowest first)."""
    ids = np.arange(len(counts))
    second = np.zeros_like(counts) if prompt_counts is None else prompt_counts
    # lexsort sorts by the last key first: descending count, descending prompt count, then ascending id.
    order = ids[np.lexsort((ids, -second, -counts))]
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def build_draft_vocab(token_shards: list[str], target_vocab_size: int, draft_vocab_size: int, out_path: str,
                      from_prompts: bool = False) -> dict:
    """Count assistant tokens, keep the most frequent, write d2t/t2d/counts/draft_ids; returns the manifest.
    from_prompts: the ids read in prompts but never written fill what is left before never-seen ids (module doc)."""
    if not token_shards:
        raise VocabError("no token shards given: the draft vocabulary needs at least one")
    _check_size(draft_vocab_size, target_vocab_size)
    templates = {str(p): shard_template(str(p)) for p in token_shards}
    distinct = sorted(set(templates.values()), key=str)
    if len(distinct) != 1 or distinct[0] is None:
        groups = {t: [p for p, tp in templates.items() if tp == t] for t in distinct}
        detail = "; ".join(f"{(t or 'none')[:12]}: {', '.join(ps)}" for t, ps in groups.items())
        raise ContractError(
            f"the token shards do not share one chat template fingerprint ({detail}); "
            "re-tokenize them all with the same target"
        )
    counts, prompt_counts = count_tokens([str(p) for p in token_shards], target_vocab_size)
    if int(counts.sum()) == 0:
        raise VocabError(f"no assistant tokens in {len(token_shards)} shard(s): nothing to build a draft vocabulary from")
    return _write_from_counts(counts, draft_vocab_size, out_path, prompt_counts if from_prompts else None,
                              template_sha256=distinct[0], shards=len(token_shards))


def resize_draft_vocab(vocab_path: str, draft_vocab_size: int, out_path: str) -> dict:
    """The draft vocabulary build_draft_vocab would have written at draft_vocab_size from the same token shards, made
    from the counts a built one stores (so a recipe comparison of vocabulary sizes needs no re-tokenizing); returns
    its manifest, which records the vocabulary it was resized from."""
    from eyrie.core.artifacts import load_safetensors

    _, _, manifest = load_draft_vocab(vocab_path)  # checked against its digest
    stored = load_safetensors(vocab_path, written_by=WRITTEN_BY)
    counts, prompt_counts = stored.get("counts"), stored.get("prompt_counts")
    if counts is None:
        raise VocabError(f"{vocab_path}: stores no 'counts' to choose another size from; rebuild it with build_draft_vocab")
    _check_size(draft_vocab_size, int(counts.numel()))
    return _write_from_counts(counts.numpy().astype(np.int64), draft_vocab_size, out_path,
                              None if prompt_counts is None else prompt_counts.numpy().astype(np.int64),
                              template_sha256=manifest["template_sha256"], shards=manifest.get("shards"), resized_from=str(vocab_path))


def _check_size(draft_vocab_size: int, target_vocab_size: int) -> None:
    if draft_vocab_size < 1:
        raise VocabSizeError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size > target_vocab_size:
        raise VocabSizeError(
            f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({target_vocab_size}); "
            f"set it to at most {target_vocab_size}"
        )


def _write_from_counts(counts: np.ndarray, draft_vocab_size: int, out_path: str, prompt_counts: np.ndarray | None = None,
                       **provenance) -> dict:
    """Keep the draft_vocab_size most frequent ids of `counts` (then of prompt_counts, when given) and write them to
    out_path; returns the manifest (provenance: template_sha256, shards, ...). When fewer ids were seen, all of them,
    with a warning, padded with never-seen ids up to a multiple of ALIGNMENT (at most draft_vocab_size): the drafter's
    head is that many rows."""
    total = int(counts.sum())
    written = counts > 0
    seen_ids = written if prompt_counts is None else written | (prompt_counts > 0)
    seen = int(np.count_nonzero(seen_ids))
    effective = draft_vocab_size
    clipped = seen < draft_vocab_size
    if clipped:
        effective = min(draft_vocab_size, -(-seen // ALIGNMENT) * ALIGNMENT)  # _check_size: draft_vocab_size <= len(counts)
        aligned = f", a multiple of {ALIGNMENT}" if effective % ALIGNMENT == 0 else f" (a multiple of {ALIGNMENT} would exceed the limit)"
        padding = f" and padded with {effective - seen} never-seen ids to {effective}{aligned}" if effective > seen else ""
        what = "assistant tokens" if prompt_counts is None else "tokens (assistant or prompt)"
        warnings.warn(
            f"only {seen} distinct {what} were seen, fewer than draft_vocab_size {draft_vocab_size}; "
            f"the draft vocabulary is clipped to them{padding} (add data or lower draft_vocab_size)",
            VocabClippedWarning,
            stacklevel=3,
        )
    kept = select_draft_ids(counts, effective, prompt_counts)
    manifest = {
        "draft_vocab_size": int(effective),
        "requested_draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": int(len(counts)),
        "assistant_tokens": total,
        "distinct_assistant_tokens": int(np.count_nonzero(written)),
        "coverage": float(counts[kept].sum() / total),
        "clipped": bool(clipped),
        "unseen_padding": int(max(0, effective - seen)),
        "from_prompts": prompt_counts is not None,
        "prompt_only_ids": 0 if prompt_counts is None else int(np.count_nonzero(~written[kept] & (prompt_counts[kept] > 0))),
        **provenance,
    }
    write_draft_vocab(out_path, kept, counts, manifest, prompt_counts)
    return manifest
