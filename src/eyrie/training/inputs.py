"""What training reads, checked to fit together before the first step.

The target's states come from a source (StateSource): the hidden-state cache (HiddenCache, read
lazily, one batch's rows at a time; hidden.mode offline) or the target itself, run in the training job
(eyrie.training.online.OnlineStates; hidden.mode online). Both hold the same samples in the same order
and return the same batches, so a seed trains the same drafter either way. With the draft vocabulary
and the target's config, every guard runs in read_inputs, so a run that would train a useless drafter
stops before it writes anything. Each shard is checked against its content digest first (one read of
the file, eyrie.hidden.cache.check_cache for a cache shard); the digests also name the data in the run's
resume identity (eyrie.training.state.run_identity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyrie.core.artifacts import rebuild_hint
from eyrie.core.batching import batches_by_tokens
from eyrie.core.digest import file_digest
from eyrie.core.errors import EyrieError
from eyrie.tokens.vocab import VocabError, load_draft_vocab
from eyrie.drafter.model import DrafterShape, shape_settings
from eyrie.hidden.cache import DIGEST, SCALES, WRITTEN_BY, HiddenCacheError, check_cache, check_manifest, read_manifest, read_state_rows, stored_names
from eyrie.hidden.fp8 import FP8_NAME, SCALE_DTYPE, dequantize_blocks
from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids
from eyrie.target.head import target_text_config
from eyrie.training.errors import TrainingInputError
from eyrie.training.holdout import MIN_CACHE_SAMPLES, held_out_indices, held_out_note, spread_batches

Sample = tuple[int, int, int]  # (shard, first token, length)


class StateSource:
    """Training's samples and, batch by batch, the target's states for them.

    What both sources share: each shard's token columns (input_ids, loss_mask, offsets: sample k is
    offsets[k]:offsets[k + 1]) and sample ids, and from them the samples, their ids and the padded token
    tensors of a batch. A source adds the states (batch, non_finite), its own checks (check) and what the
    resume identity records of each shard (manifests, digests).
    """

    paths: list[str]  # one per shard
    manifests: list[dict]  # what the resume identity records of each shard
    digests: list[str]  # each shard's content digest, also in the identity
    states_name: str  # how error messages name the states ("cached states")
    input_ids: list[torch.Tensor]  # per shard: long [T]
    loss_mask: list[torch.Tensor]  # per shard: bool [T]
    offsets: list[torch.Tensor]  # per shard: long [samples + 1]
    names: list[list | None]  # per shard: the sample ids in offsets order (None: not recorded)
    # to_device only copies and converts what load() returned (no model runs), so training may run it in its
    # background thread, on CUDA on a side stream (eyrie.training.batches_ahead).
    moves_ahead: bool = False

    def samples(self, max_len: int) -> tuple[list[Sample], int, int]:
        """(shard, start, length) of every sample with something to train on; also (#truncated, #skipped)."""
        out, truncated, skipped = [], 0, 0
        for s, (offsets, mask) in enumerate(zip(self.offsets, self.loss_mask)):
            for k in range(offsets.numel() - 1):
                a, b = int(offsets[k]), int(offsets[k + 1])
                n = b - a
                if n > max_len:
                    truncated += 1
                    n = max_len
                # Trainable positions predict tokens 2..n-1 (the first needs aux at 0 and token 1).
                if n < 3 or not bool(mask[a + 2 : a + n].any()):
                    skipped += 1
                    continue
                out.append((s, a, n))
        return out, truncated, skipped

    def sample_ids(self, samples: list[Sample]) -> list[str]:
        """The id of each sample (a shard's ids name its samples in offsets order)."""
        by_start = {}
        for s, (path, ids, offsets) in enumerate(zip(self.paths, self.names, self.offsets)):
            if not isinstance(ids, list) or len(ids) != offsets.numel() - 1:
                raise TrainingInputError(
                    f"{path}: the manifest's ids do not name its {offsets.numel() - 1} samples, so no held-out samples can be chosen; "
                    "rebuild the cache, or set train.eval_fraction: 0"
                )
            for k, sample_id in enumerate(ids):  # ascending: an empty sample's start is the next one's, which wins
                by_start[(s, int(offsets[k]))] = str(sample_id)
        return [by_start[(s, a)] for s, a, _ in samples]

    def describe(self, refs: list[Sample]) -> dict[str, list[str]]:
        """{shard path: the samples' ids} of refs, for error messages (a token offset where the shard has no ids)."""
        named: dict[str, list[str]] = {}
        for s, a, _ in refs:
            ids, offsets = self.names[s], self.offsets[s].tolist()
            starts = [k for k in range(len(offsets) - 1) if offsets[k] == a]  # the last: an empty sample shares its start
            usable = isinstance(ids, list) and len(ids) == len(offsets) - 1 and starts
            named.setdefault(self.paths[s], []).append(str(ids[starts[-1]]) if usable else f"the sample at token {a}")
        return named

    def tokens(self, refs: list[Sample], pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, loss_mask [B, L] right-padded with zeros (L: the longest of refs) and lengths [B], on the host
        (in pinned memory with pin, which needs CUDA)."""
        B, L = len(refs), max(n for _, _, n in refs)
        ids = torch.zeros(B, L, dtype=torch.long, pin_memory=pin)
        mask = torch.zeros(B, L, dtype=torch.bool, pin_memory=pin)
        for row, (s, a, n) in enumerate(refs):
            ids[row, :n] = self.input_ids[s][a : a + n]
            mask[row, :n] = self.loss_mask[s][a : a + n]
        return ids, mask, torch.tensor([n for _, _, n in refs], dtype=torch.long, pin_memory=pin)

    def check(self, *, target_config, aux_layer_ids: list[int], template_sha256: str, target_fingerprint: str) -> list[int]:
        """Raise unless the source fits this target, template and layer set; returns the aux layer ids its states are of."""
        raise NotImplementedError

    def load(self, refs: list[Sample], pin: bool = False) -> Any:
        """The host's share of batch(refs): reading and padding, no device work, so training can run it in a
        background thread while the previous step computes (by default nothing: to_device does it all).
        pin: into pinned host memory, which to_device copies to a CUDA device asynchronously."""
        return refs

    def to_device(self, loaded: Any, device, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """batch()'s result from what load() returned."""
        raise NotImplementedError

    def batch(self, refs: list[Sample], device, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Padded tensors for these samples: aux [B, L, 3H], final [B, L, H] (in dtype), input_ids, loss_mask [B, L], lengths [B]."""
        return self.to_device(self.load(refs), device, dtype)

    def non_finite(self, refs: list[Sample]) -> list[Sample]:
        """The refs whose states (aux or final) hold a NaN or an infinity."""
        raise NotImplementedError

    def not_finite_cause(self, path: str, ids: list[str]) -> str:
        """Why these samples' states are not finite, and the fix, for the NonFiniteError message."""
        raise NotImplementedError


def padded_batch(aux: torch.Tensor, final: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, device) -> dict:
    """The batch dict training reads (StateSource.batch), every tensor on device, and the host's loss_mask and lengths
    (train_step finds the trained positions there without waiting for the GPU)."""
    return {
        "aux": _moved(aux, device),
        "final": _moved(final, device),
        "input_ids": _moved(ids, device),
        "loss_mask": _moved(mask, device),
        "lengths": _moved(lengths, device),
        "tokens": int(lengths.sum()),
        "loss_mask_host": mask,
        "lengths_host": lengths,
    }


class HiddenCache(StateSource):
    """The shards of the hidden-state cache, read lazily: only each batch's rows leave the files (hidden.mode offline).

    Every shard is checked against its recorded content digest before any tensor is read; `digests`
    holds them (computed here for a shard written before eyrie recorded digests), so the resume identity
    covers the values, not only the manifests.
    """

    states_name = "cached states"
    moves_ahead = True

    def __init__(self, paths: list[str]):
        if not paths:
            raise TrainingInputError("no hidden-state cache shards given")
        self.paths = [str(p) for p in paths]
        self.manifests = [read_manifest(p) for p in self.paths]
        self.digests = [check_cache(p) or file_digest(p, DIGEST) for p in self.paths]
        self.names = [m.get("ids") for m in self.manifests]
        self._handles = [_open(p) for p in self.paths]
        # float8 shards carry per-token scales; batch() dequantizes, so training sees float32 either way.
        self.fp8 = [m.get("dtype") == FP8_NAME for m in self.manifests]
        self.input_ids, self.loss_mask, self.offsets, self.widths = [], [], [], []
        for path, f, manifest in zip(self.paths, self._handles, self.manifests):
            names = set(f.keys())
            missing = [n for n in stored_names(manifest) if n not in names]
            if missing:
                raise TrainingInputError(f"{path}: hidden-state cache lacks tensors {missing}")
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
            offsets = f.get_tensor("offsets").long()
            aux_shape = f.get_slice("aux_hidden").get_shape()
            final_shape = f.get_slice("final_hidden").get_shape()
            T = ids.numel()
            if mask.numel() != T or aux_shape[0] != T or final_shape[0] != T or len(aux_shape) != 2 or len(final_shape) != 2:
                raise TrainingInputError(
                    f"{path}: tensors disagree in token count (input_ids {T}, loss_mask {mask.numel()}, "
                    f"aux_hidden {aux_shape}, final_hidden {final_shape}); rebuild the cache"
                )
            if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != T or bool((offsets[1:] < offsets[:-1]).any()):
                raise TrainingInputError(f"{path}: offsets do not partition the {T} cached tokens; rebuild the cache")
            self.input_ids.append(ids)
            self.loss_mask.append(mask)
            self.offsets.append(offsets)
            self.widths.append((int(aux_shape[1]), int(final_shape[1])))

    def check(self, *, target_config, aux_layer_ids: list[int], template_sha256: str, target_fingerprint: str) -> list[int]:
        """One target, template, layer set and width for all shards, and the ones in use; returns the cache's aux layer ids."""
        H = int(target_config.hidden_size)
        first = self.manifests[0]
        for path, manifest in zip(self.paths, self.manifests):
            for key in ("aux_layer_ids", "target_model_fingerprint", "template_sha256", "hidden_size"):
                if manifest.get(key) != first.get(key):
                    raise TrainingInputError(
                        f"hidden-state caches disagree on {key}: {self.paths[0]} has {first.get(key)!r}, {path} has {manifest.get(key)!r}; "
                        "delete results/hidden/ so all shards are rebuilt with one target and settings"
                    )
            check_manifest(
                manifest,
                target_model_fingerprint=target_fingerprint,
                template_sha256=template_sha256,
                aux_layer_ids=aux_layer_ids,
                hidden_size=H,
                path=path,
            )
        for path, (aux_w, final_w) in zip(self.paths, self.widths):
            if aux_w != 3 * H:
                raise TrainingInputError(
                    f"{path}: aux_hidden is {aux_w} wide, but the drafter's fc takes 3 x target hidden = {3 * H} "
                    "(three concatenated aux layers, not the final state); rebuild the cache"
                )
            if final_w != H:
                raise TrainingInputError(f"{path}: final_hidden is {final_w} wide, the target's hidden size is {H}; rebuild the cache")
        return [int(i) for i in first.get("aux_layer_ids")]

    def non_finite(self, refs: list[Sample]) -> list[Sample]:
        """The refs whose cached states (aux or final, as stored and dequantized) hold a NaN or an infinity."""
        bad = []
        for s, a, n in refs:
            rows = [read_state_rows(self._handles[s], name, a, a + n, self.fp8[s]) for name in ("aux_hidden", "final_hidden")]
            if not all(bool(torch.isfinite(r).all()) for r in rows):
                bad.append((s, a, n))
        return bad

    def not_finite_cause(self, path: str, ids: list[str]) -> str:
        return f"the cached states of {', '.join(ids)} in {path} are not finite: the cache is corrupt, {rebuild_hint(WRITTEN_BY, path)}"

    def load(self, refs: list[Sample], pin: bool = False) -> StoredRows:
        """These samples' rows as stored (fp8 with their scales, or bf16), zero-padded to [B, L, width]: a copy of
        bytes, with no conversion on the host (dequantizing 16K tokens of fp8 there took 431 ms on 2 cores, against
        ~200 ms for a whole training step on an H200). pin: every tensor in pinned host memory (needs CUDA)."""
        ids, mask, lengths = self.tokens(refs, pin)
        L = ids.shape[1]
        handles = [(self._handles[s], a, n, self.fp8[s]) for s, a, n in refs]
        stored = {bool(self.fp8[s]) for s, _, _ in refs}
        if len(stored) > 1:  # shards stored in different dtypes: one float32 batch, dequantized here
            rows = {name: _padded([read_state_rows(f, name, a, a + n, fp8) for f, a, n, fp8 in handles], L, torch.float32, pin)
                    for name in ("aux_hidden", "final_hidden")}
            return StoredRows(ids, mask, lengths, rows["aux_hidden"], rows["final_hidden"])
        fp8 = stored.pop()
        aux = [f.get_slice("aux_hidden")[a : a + n] for f, a, n, _ in handles]
        final = [f.get_slice("final_hidden")[a : a + n] for f, a, n, _ in handles]
        loaded = StoredRows(ids, mask, lengths, _padded(aux, L, aux[0].dtype, pin), _padded(final, L, final[0].dtype, pin))
        if fp8:
            loaded.aux_scale = _padded([f.get_slice(SCALES["aux_hidden"][0])[a : a + n] for f, a, n, _ in handles], L, SCALE_DTYPE, pin)
            loaded.final_scale = _padded([f.get_slice(SCALES["final_hidden"][0])[a : a + n] for f, a, n, _ in handles], L, SCALE_DTYPE, pin)
        return loaded

    def to_device(self, loaded: StoredRows, device, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Padded tensors for the loaded samples: aux [B, L, 3H], final [B, L, H] (in dtype, fp8 dequantized on device),
        input_ids, loss_mask [B, L], lengths [B]."""
        aux = _on_device(loaded.aux, loaded.aux_scale, device, dtype)
        final = _on_device(loaded.final, loaded.final_scale, device, dtype)
        return padded_batch(aux, final, loaded.ids, loaded.mask, loaded.lengths, device)


@dataclass
class StoredRows:
    """A batch as HiddenCache.load reads it: token tensors [B, L], lengths [B], and the states as stored, zero-padded."""

    ids: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    aux: torch.Tensor  # [B, L, 3H]: float8_e4m3fn, bfloat16 or float32
    final: torch.Tensor  # [B, L, H]
    aux_scale: torch.Tensor | None = None  # [B, L, 3] float32 for fp8 rows (eyrie.hidden.fp8's blocks)
    final_scale: torch.Tensor | None = None  # [B, L, 1]


def _padded(rows: list[torch.Tensor], L: int, dtype, pin: bool = False) -> torch.Tensor:
    """[B, L, width] in dtype from B row blocks [n_b, width], zeros after each block's end (pinned with pin)."""
    out = torch.zeros(len(rows), L, rows[0].shape[-1], dtype=dtype, pin_memory=pin)
    for b, block in enumerate(rows):
        out[b, : block.shape[0]] = block
    return out


def _on_device(stored: torch.Tensor, scale: torch.Tensor | None, device, dtype) -> torch.Tensor:
    """Stored rows moved as they are (a quarter of float32's bytes for fp8) and converted there, as read_state_rows
    converts on the host: float32 (times the block scales for fp8), then dtype. Padding stays zero (scale 0)."""
    B, L, width = stored.shape
    if scale is None and stored.dtype == dtype and dtype in (torch.bfloat16, torch.float16, torch.float32):
        # rows stored as training reads them and float32 holds exactly: the round trip through float32 is the identity
        return _moved(stored, device)
    rows = _moved(stored, device).float()
    if scale is not None:
        rows = dequantize_blocks(rows.reshape(B * L, width), _moved(scale, device).reshape(B * L, -1)).reshape(B, L, width)
    return rows.to(dtype)


def _moved(host: torch.Tensor, device) -> torch.Tensor:
    """host on device; from pinned memory without waiting for the copy (it is ordered on the current stream)."""
    return host.to(device, non_blocking=host.is_pinned())


def _open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error types (the digest check before catches nearly all)
        raise HiddenCacheError(f"{path}: not a readable safetensors file ({exc})") from None


@dataclass
class TrainingInputs:
    """Everything a run trains on, checked to fit together."""

    states: StateSource  # the samples and their target states: HiddenCache, or OnlineStates (hidden.mode online)
    target_config: Any  # the target's transformers (text) config
    d2t: torch.Tensor  # int64 offsets: draft id i is target id i + d2t[i]
    t2d: torch.Tensor  # bool over the target vocabulary
    vocab_manifest: dict
    shape: DrafterShape
    samples: list[Sample]
    batches: list[list[Sample]]  # one optimizer step each, longest first; each epoch shuffles their order
    truncated: int  # samples cut to batch_tokens
    skipped: int  # samples with nothing to train on
    held_out: list[Sample] = field(default_factory=list)  # kept out of training (train.eval_fraction, eyrie.training.holdout)
    eval_batches: list[list[Sample]] = field(default_factory=list)  # what the simulated acceptance runs on: held_out, else a few training batches
    eval_note: str = ""  # the log line saying which, and why
    # The dataset of each eval batch, when held-out samples of two or more datasets are simulated (each batch holds one
    # dataset's): the simulation then also reports each dataset alone. Empty otherwise.
    eval_datasets: list[str] = field(default_factory=list)


def read_inputs(
    *,
    vocab_path: str,
    target_dir: str,
    drafter_cfg: dict,
    batch_tokens: int,
    template_sha256: str,
    target_fingerprint: str,
    eval_fraction: float = 0.0,
    hidden_paths: list[str] | None = None,
    states: StateSource | None = None,
    trust_remote_code: bool = False,
) -> TrainingInputs:
    """Read the states' source (states, or a HiddenCache over hidden_paths), the draft vocabulary and the target's config,
    run every guard, hold out eval_fraction of the samples, and plan the batches."""
    ttt_steps = int(drafter_cfg["ttt_steps"])
    if ttt_steps < 1:
        raise TrainingInputError(f"drafter.ttt_steps must be at least 1, got {ttt_steps}")
    target_config = target_text_config(target_dir, trust_remote_code)  # model.trust_remote_code, never a prompt
    try:
        d2t, t2d, vocab_manifest = load_draft_vocab(vocab_path)  # checks d2t (int64 offsets) against t2d (bool)
    except VocabError as exc:  # names the file
        raise TrainingInputError(str(exc)) from None
    if states is None:
        states = HiddenCache(hidden_paths or [])
    aux_ids = _check_inputs(
        states=states, target_config=target_config, d2t=d2t, t2d=t2d, vocab_manifest=vocab_manifest, vocab_path=str(vocab_path),
        drafter_cfg=drafter_cfg, template_sha256=template_sha256, target_fingerprint=target_fingerprint,
    )
    shape = DrafterShape.from_target(target_config, int(d2t.numel()), aux_ids, norm_before_fc=bool(drafter_cfg.get("norm_before_fc", False)),
                                     norm_output=bool(drafter_cfg.get("norm_output", False)), **shape_settings(drafter_cfg))
    samples, truncated, skipped = states.samples(batch_tokens)
    if not samples:
        raise TrainingInputError(
            f"no trainable samples in {len(states.paths)} shard(s) ({skipped} too short or without assistant tokens after position 2)"
        )
    cache_samples = len(samples)
    holds_out = eval_fraction > 0 and cache_samples >= MIN_CACHE_SAMPLES  # a tiny cache's samples all train (and need no ids)
    held_out_at = set(held_out_indices(states.sample_ids(samples), eval_fraction)) if holds_out else set()
    held_out = [sample for k, sample in enumerate(samples) if k in held_out_at]
    samples = [sample for k, sample in enumerate(samples) if k not in held_out_at]
    if not samples:
        raise TrainingInputError(f"train.eval_fraction {eval_fraction} holds out all {cache_samples} trainable samples; lower it")
    batches = _plan(samples, batch_tokens)
    eval_batches, eval_datasets = _plan_by_dataset(held_out, states.paths, batch_tokens) if held_out else (spread_batches(batches), [])
    return TrainingInputs(states, target_config, d2t, t2d, vocab_manifest, shape, samples, batches, truncated, skipped,
                          held_out, eval_batches, held_out_note(eval_fraction, cache_samples, len(held_out)),
                          eval_datasets if len(set(eval_datasets)) > 1 else [])


def dataset_of(shard_path: str) -> str:
    """The dataset a shard belongs to: the name of its folder (results/hidden/<dataset>/, or results/tokens/<dataset>/ online)."""
    return Path(shard_path).parent.name


def _plan(samples: list[Sample], batch_tokens: int) -> list[list[Sample]]:
    return [[samples[k] for k in b] for b in batches_by_tokens([n for _, _, n in samples], batch_tokens)]


def _plan_by_dataset(samples: list[Sample], paths: list[str], batch_tokens: int) -> tuple[list[list[Sample]], list[str]]:
    """Batches that each hold one dataset's samples, and the dataset of each (sorted by name)."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(dataset_of(paths[sample[0]]), []).append(sample)
    planned = [(name, batch) for name in sorted(groups) for batch in _plan(groups[name], batch_tokens)]
    return [batch for _, batch in planned], [name for name, _ in planned]


def _check_inputs(*, states: StateSource, target_config, d2t, t2d, vocab_manifest: dict, vocab_path: str, drafter_cfg: dict, template_sha256: str,
                  target_fingerprint: str) -> list[int]:
    """Every guard that must pass before a single step; returns the aux layer ids to train with."""
    V, N = int(target_config.vocab_size), int(target_config.num_hidden_layers)

    # Draft vocabulary: fits the target (load_draft_vocab checked that d2t and t2d agree).
    Vd = int(d2t.numel())
    if Vd > V:
        raise TrainingInputError(
            f"{vocab_path}: draft vocabulary has {Vd} ids, more than the target's vocabulary ({V}); "
            "it was built for another target: rebuild it (draft_vocab_size <= target vocab)"
        )
    if t2d.numel() != V:
        raise TrainingInputError(f"{vocab_path}: t2d covers {t2d.numel()} target ids, the target has {V}; rebuild the draft vocabulary for this target")
    vocab_template = vocab_manifest.get("template_sha256")
    if vocab_template is not None and vocab_template != template_sha256:
        raise TrainingInputError(
            f"{vocab_path}: built from tokens of chat template {vocab_template[:12]}, but the target's template is "
            f"{template_sha256[:12]}; rebuild the draft vocabulary"
        )

    # States: of the layers in use, this target and template (each source checks its own way).
    configured = drafter_cfg.get("aux_layer_ids")
    wanted = list(configured) if configured is not None else default_aux_layer_ids(N)
    try:
        capture_indices(wanted, N)
    except EyrieError as exc:
        raise TrainingInputError(f"drafter.aux_layer_ids: {exc}") from None
    aux_ids = states.check(target_config=target_config, aux_layer_ids=wanted, template_sha256=template_sha256, target_fingerprint=target_fingerprint)
    for path, ids in zip(states.paths, states.input_ids):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise TrainingInputError(f"{path}: token ids outside the target vocabulary [0, {V}); the shard was tokenized for another target")
    return aux_ids
