"""The extract job: run the target over a token shard and store its hidden states as one cache file.

Samples run in length-sorted, token-budgeted batches (right-padded, no attention mask) through
eyrie.target.states (the forward that online training shares: hooks keep only the three capture
layers' outputs); only real tokens leave the device, and writer threads put each batch's rows straight
to their place in the file, and on the disk, while the next batches run: after the last forward only the
last batches' writes, the digest and a short fsync remain (at the Llama-3.1-8B shape on an H100, 1.2 s after
the 24 s of forwards of a 2^20-token shard, docs/RESULTS.md). The file's layout, its manifest and its readers
belong to eyrie.hidden.cache.

With hidden.compile (auto: on CUDA, for a shard big enough to repay the compile) each of the target's
decoder layers runs through torch.compile, which fuses the elementwise work between its matrix products;
a compile failure leaves extraction eager, with a warning, and the manifest says which ran (compiled).

With hidden.tensor_parallel N the job runs this module as N torchrun ranks (`python -m
eyrie.hidden.extract ARGS.json`, launched by eyrie.hidden.parallel): every rank runs the same batches
on its part of the target, and rank 0 alone writes, the same file one process writes.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eyrie.core.atomic import write_atomically
from eyrie.core.batching import batches_by_tokens
from eyrie.core.errors import ContractError
from eyrie.tokens.shards import read_tokens, shard_template
from eyrie.hidden.cache import (
    FORMAT,
    FP8_SCALES_NOTE,
    HiddenCacheError,
    SafetensorsWriter,
    encode_rows,
    is_fp8,
    storage_dtype,
    storage_specs,
)
from eyrie.hidden.size import ensure_room, shard_bytes
from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids
from eyrie.target.model import check_model_dir, load_model, resolve_device, resolve_dtype
from eyrie.target.states import TargetStates, text_config


def plan_token_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Sample indices grouped so that each batch's padded size (rows x longest) stays within batch_tokens.

    Longest first, so an out-of-memory shows up on the first batch. A sample longer than
    batch_tokens goes alone. Empty samples are left out (they have nothing to compute).
    """
    if batch_tokens < 1:
        raise HiddenCacheError(f"batch_tokens must be positive, got {batch_tokens}")
    lengths = [int(n) for n in lengths]
    nonempty = [k for k, n in enumerate(lengths) if n > 0]
    return [[nonempty[i] for i in batch] for batch in batches_by_tokens([lengths[k] for k in nonempty], batch_tokens)]


class _BackgroundRows:
    """Writes each batch's packed rows to the file on `threads` threads, so the device->host copies and the file writes
    overlap the next batches' forwards; and makes the written bytes durable as they come, so the file's final fsync (at
    8B widths, gigabytes written since the last one) does not wait, alone, for the disk after the last forward.

    At most `depth` batches wait in the queue (put blocks beyond that) and one more per thread is being written, which
    bounds host memory. A failed write is kept, the remaining batches are dropped unwritten, and put/close re-raise it.
    Every `flush_bytes` written (256 MiB: about the most the final fsync finds left, beside what is still being
    written), a flusher thread calls the writer's flush_to_disk (fdatasync) while writing goes on.
    """

    def __init__(self, writer: SafetensorsWriter, depth: int = 2, threads: int = 2, flush_bytes: int = 256 << 20):
        self.writer, self.error, self.flush_bytes = writer, None, flush_bytes
        self.queue = queue.Queue(maxsize=depth)
        self.unflushed, self.lock, self.flush_wanted, self.pending, self.closing = 0, threading.Lock(), threading.Event(), False, False
        self.threads = [threading.Thread(target=self._run, name=f"eyrie-hidden-writer-{k}", daemon=True) for k in range(threads)]
        self.flusher = threading.Thread(target=self._flush, name="eyrie-hidden-flusher", daemon=True)
        for thread in [*self.threads, self.flusher]:
            thread.start()

    def put(self, ready, tensors: dict, placements: list[tuple[int, int, int]]) -> None:
        """tensors: name -> host rows of one batch; placements: (file row, batch row, count); ready: CUDA event or None."""
        self._raise()
        self.queue.put((ready, tensors, placements))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # drain, so put never blocks on a dead writer
            ready, tensors, placements = item
            try:
                if ready is not None:
                    ready.synchronize()  # the non-blocking device->host copies of this batch have landed
                for name, rows in tensors.items():
                    for file_row, batch_row, count in placements:
                        self.writer.write_rows(name, file_row, rows[batch_row : batch_row + count])
                self._written(sum(rows.nbytes for rows in tensors.values()))
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc

    def _written(self, nbytes: int) -> None:
        with self.lock:
            self.unflushed += nbytes
            if self.unflushed >= self.flush_bytes:
                self.unflushed, self.pending = 0, True
                self.flush_wanted.set()

    def _flush(self) -> None:
        while True:
            self.flush_wanted.wait()
            self.flush_wanted.clear()
            if self.pending:  # requests that came while a flush ran are one flush: it covers them all
                self.pending = False
                try:
                    self.writer.flush_to_disk()
                except BaseException as exc:  # noqa: BLE001 -- re-raised on the main thread
                    self.error = self.error or exc
            if self.closing:
                return

    def _raise(self) -> None:
        if self.error is not None:
            raise HiddenCacheError(f"{self.writer.path}: writing the hidden states failed: {self.error}") from self.error

    def close(self, check: bool = True) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for thread in self.threads:
            thread.join()
        self.closing = True
        self.flush_wanted.set()
        self.flusher.join()
        if check:
            self._raise()


def _batch_inputs(batch, lengths, offsets, ids_t):
    """Right-padded ids (B, L) and the flat positions of real tokens in (B*L) order, plus their placements."""
    import torch

    longest = int(lengths[batch[0]])
    x = torch.zeros(len(batch), longest, dtype=torch.long)
    keep, placements, packed = [], [], 0
    for row, k in enumerate(batch):
        n = int(lengths[k])
        x[row, :n] = ids_t[offsets[k] : offsets[k] + n]
        keep.append(torch.arange(row * longest, row * longest + n))
        placements.append((int(offsets[k]), packed, n))
        packed += n
    return x, torch.cat(keep), placements


def _to_device(t, device):
    """Host -> device without a stall on CUDA (pinned source, non-blocking)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _to_host(tensors: dict, device):
    """(host tensors, ready event): on CUDA the copies are non-blocking into pinned memory and the event marks them done."""
    import torch

    if device.type != "cuda":
        return {name: t.cpu() for name, t in tensors.items()}, None
    host = {name: t.to("cpu", non_blocking=True) for name, t in tensors.items()}  # pinned destination
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


@dataclass(frozen=True)
class _Shard:
    """A token shard as extraction reads it: samples packed end to end, and the batches of those with tokens."""

    sample_ids: list
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    batches: list[list[int]]

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])


def extract_shard(
    *,
    tokens_path: str,
    out_path: str,
    model,
    model_fingerprint: str,
    template_sha256: str,
    aux_layer_ids,
    batch_tokens: int,
    dtype: str = "bfloat16",
    compile: bool | str = "auto",
    progress: bool = True,
    writes: bool = True,
    timings: dict | None = None,
) -> dict:
    """Run the target over a token shard and cache aux [T, 3H] and final normed [T, H] states; returns the manifest.

    With dtype float8_e4m3fn the states are stored quantized with per-token, per-layer-block scales
    (aux_scale [T, 3], final_scale [T, 1], see eyrie.hidden.fp8); load_hidden and the trainer dequantize.
    writes False: a tensor-parallel rank other than 0, which runs the same forwards (its share of each
    matrix product, joined by all-reduces) and keeps nothing.
    compile: hidden.compile, auto, True or False (see compile_layers).
    timings: a dict to receive where the file's time went, in seconds (see _write_cache), for benchmarks.
    """
    shard = _read_shard(tokens_path, template_sha256, batch_tokens)
    compute_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    manifest = _shard_manifest(shard, text_config(model), aux_layer_ids, model_fingerprint, template_sha256, dtype, compute_dtype)
    if shard.batches:  # settled before the file's header, which holds the manifest, is written
        manifest["compiled"] = compile_layers(model, manifest["capture_indices"], compile, _first_batch(shard), shard.tokens)
    if not writes:
        _run_forwards(model, shard, manifest)
        return manifest
    _write_cache(out_path, tokens_path, shard, manifest, model, progress, timings)
    return manifest


def _read_shard(tokens_path: str, template_sha256: str, batch_tokens: int) -> _Shard:
    """The token shard, refused when another chat template made it, and its batches."""
    tokenized_with = shard_template(tokens_path)
    if tokenized_with != template_sha256:
        raise ContractError(
            f"{tokens_path}: tokenized with chat template {tokenized_with!r}, but the target's template is "
            f"{template_sha256!r}; re-tokenize with this target or point model.path at the one used"
        )
    sample_ids, input_ids, loss_mask, offsets = read_tokens(tokens_path, HiddenCacheError)
    lengths = np.diff(offsets)
    return _Shard(sample_ids, input_ids, loss_mask, offsets, lengths, plan_token_batches(lengths, batch_tokens))


def _shard_manifest(shard: _Shard, config, aux_layer_ids, model_fingerprint: str, template_sha256: str, dtype: str, compute_dtype: str) -> dict:
    """What the cache file says of itself (eyrie.hidden.cache): the target's shape, what made the states and the samples held."""
    num_layers = int(config.num_hidden_layers)
    dtype_name = str(storage_dtype(dtype)).removeprefix("torch.")
    manifest = {
        "format": FORMAT,
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "capture_indices": capture_indices(aux_layer_ids, num_layers),
        "num_hidden_layers": num_layers,
        "hidden_size": int(config.hidden_size),
        "target_model_fingerprint": model_fingerprint,
        "template_sha256": template_sha256,
        "dtype": dtype_name,
        "compute_dtype": compute_dtype,
        "compiled": False,  # whether the target's decoder layers ran through torch.compile (hidden.compile)
        "samples": len(shard.sample_ids),
        "tokens": shard.tokens,
        "assistant_tokens": int(shard.loss_mask.sum(dtype=np.int64)),
        "ids": shard.sample_ids,
    }
    if is_fp8(dtype_name):
        manifest["scales"] = FP8_SCALES_NOTE
    return manifest


_COMPILED_MARK = "_eyrie_layers_compiled"  # on a model: True once its layers ran compiled, else why compiling failed


def compile_layers(model, capture: list[int], setting: bool | str, first_batch: tuple, tokens: int) -> bool:
    """hidden.compile: whether the target's decoder layers run compiled for this extraction.

    Each layer is compiled in place (Module.compile: a capture hook runs inside the compiled call) once per model. The shard's
    first batch (ids, keep) runs through them here, its states dropped: a failure (no C++ compiler for
    inductor's CPU code, an op it cannot trace) then shows before the manifest is written, and inductor
    picks its kernels' configs for the sizes extraction runs (the largest batch comes first). On a failure
    the layers go back to eager with a warning, and this model is not compiled again. Off on a
    tensor-parallel target (its layers' products are split over the ranks).
    """
    import torch

    target = TargetStates(model, capture, HiddenCacheError)
    device = next(model.parameters()).device
    mark = getattr(model, _COMPILED_MARK, None)
    if not _compiles(setting, device, 2 * _decoder_parameters(target.layers) * tokens):
        if mark is True:  # compiled by an earlier extraction with the setting on
            _run_eagerly(target.layers)
            delattr(model, _COMPILED_MARK)
        return False
    if mark is not None:
        return mark is True
    if target.layers is None:
        return _stay_eager(model, [], "the target exposes no decoder layers as base_model.layers")
    try:
        _compile_each(target.layers)
        _first_forward(target, *first_batch, device)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 -- dynamo and inductor raise many types; any of them means: run eagerly
        return _stay_eager(model, target.layers, f"{type(exc).__name__}: {exc}".strip()[:2000])
    setattr(model, _COMPILED_MARK, True)
    return True


# auto compiles a shard whose forward takes at least this many FLOPs (2 x decoder parameters x tokens): ~4 minutes eager
# at the 8B shape on an H100, of which compiling saves ~20% against the tens of seconds it costs once per job. A small
# target's shards (SmolLM2-135M: seconds each) stay eager.
AUTO_COMPILE_FLOPS = 1e17


def _compiles(setting, device, forward_flops: float) -> bool:
    """hidden.compile settled: auto compiles on CUDA only (inductor's CPU code needs a C++ compiler and tens of seconds),
    and only a shard big enough to repay the compile (AUTO_COMPILE_FLOPS)."""
    if setting not in ("auto", True, False):
        raise HiddenCacheError(f"hidden.compile must be auto, true or false, got {setting!r}")
    auto = setting == "auto" and device.type == "cuda" and forward_flops >= AUTO_COMPILE_FLOPS
    return (setting is True or auto) and not _tensor_parallel()


def _decoder_parameters(layers) -> int:
    return sum(p.numel() for layer in layers or [] for p in layer.parameters())


def _stay_eager(model, layers, why: str) -> bool:
    """The layers eager for good on this model, with a warning that says why; False: not compiled."""
    _run_eagerly(layers)
    setattr(model, _COMPILED_MARK, why)
    warnings.warn(f"hidden.compile: the target's decoder layers could not be compiled, extraction goes on eagerly "
                  f"(the same states at eager speed; the manifest says compiled false): {why}", RuntimeWarning, stacklevel=3)
    return False


def _tensor_parallel() -> bool:
    """Whether this process is one of several ranks sharing the target (hidden.tensor_parallel)."""
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _compile_each(layers) -> None:
    """Each layer compiled in place; dynamic shapes, as batches differ in length (inductor compiles at the first call)."""
    for layer in layers:
        layer.compile(dynamic=True)


def _run_eagerly(layers) -> None:
    for layer in layers:
        layer._compiled_call_impl = None  # the slot Module.compile fills: the layer's own forward again


def _first_batch(shard: _Shard) -> tuple:
    """(ids, keep) of the shard's first batch, on the host."""
    import torch

    x, keep, _ = _batch_inputs(shard.batches[0], shard.lengths, shard.offsets, torch.from_numpy(shard.input_ids))
    return x, keep


def _first_forward(target: TargetStates, ids, keep, device) -> None:
    """One batch through the compiled layers as _run_forwards runs it (the first call compiles); its states are dropped."""
    import torch

    with torch.inference_mode(), target:
        target.states(_to_device(ids, device), _to_device(keep, device))


def _run_forwards(model, shard: _Shard, manifest: dict, on_batch=None) -> None:
    """Every batch through the target; on_batch(batch, aux, final, placements) receives each batch's real tokens' states."""
    import torch

    device = next(model.parameters()).device
    ids_t = torch.from_numpy(shard.input_ids)
    with torch.inference_mode(), TargetStates(model, manifest["capture_indices"], HiddenCacheError) as target:
        for batch in shard.batches:
            x, keep, placements = _batch_inputs(batch, shard.lengths, shard.offsets, ids_t)
            # Only the real tokens leave the device (eyrie.target.states: right padding, no attention mask).
            aux, final = _batch_states(target, _to_device(x, device), _to_device(keep, device), manifest["compiled"])  # (n, 3H), (n, H)
            if on_batch is not None:
                on_batch(batch, aux, final, placements)
            del aux, final


def _batch_states(target: TargetStates, x, keep, compiled: bool):
    """target.states; a compiled layer that fails on a later batch (a recompile for a new shape) says how to go on."""
    import torch

    try:
        return target.states(x, keep)
    except (torch.OutOfMemoryError, HiddenCacheError):
        raise
    except Exception as exc:
        if not compiled:
            raise
        raise HiddenCacheError(f"the target's compiled decoder layers failed on a batch of {x.shape[0]} x {x.shape[1]} tokens "
                               f"({type(exc).__name__}: {exc}); hidden.compile: false extracts eagerly") from exc


def _write_cache(out_path: str, tokens_path: str, shard: _Shard, manifest: dict, model, progress: bool, timings: dict | None = None) -> None:
    """The cache file, written whole or not at all: a killed run's leftovers cleared, room checked, states written as they come.

    timings (when given) receives the seconds of: header (the header and the token tensors), forwards (the forward
    loop, the writes it waited for included), drain (the writes still queued after the last forward), digest (sealing
    the file), durable (the final fsync and the rename)."""
    from tqdm import tqdm

    remove_stale_temporaries(out_path)  # before the room check: a killed run's file counts against the free space
    dtype_name = manifest["dtype"]
    # Refuse before the first forward: a full disk would otherwise fail the job hours in, at the last batch.
    ensure_room(out_path, shard_bytes(manifest["hidden_size"], dtype_name, manifest["samples"], manifest["tokens"], manifest), dtype_name)
    bar = tqdm(total=manifest["samples"], unit="sample", desc=f"hidden {Path(tokens_path).name}", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    timings = {} if timings is None else timings
    start = time.perf_counter()
    try:
        write_atomically(out_path, lambda temporary: _write_file(temporary, shard, manifest, model, bar, timings))
    finally:
        bar.close()
    timings["durable"] = time.perf_counter() - start - sum(timings.get(k, 0.0) for k in ("header", "forwards", "drain", "digest"))


def _write_file(temporary: Path, shard: _Shard, manifest: dict, model, bar, timings: dict) -> None:
    """The packed samples, then each batch's states on the writer threads; the size is checked against the manifest's."""
    import torch

    clock = time.perf_counter()
    out_dtype = storage_dtype(manifest["dtype"])
    writer = SafetensorsWriter(temporary, storage_specs(manifest["dtype"], manifest["samples"], manifest["tokens"], manifest["hidden_size"]), manifest)
    rows = _BackgroundRows(writer)
    failed = True
    try:
        writer.write_rows("offsets", 0, torch.from_numpy(shard.offsets))
        writer.write_rows("input_ids", 0, torch.from_numpy(shard.input_ids))
        writer.write_rows("loss_mask", 0, torch.from_numpy(shard.loss_mask))
        timings["header"], clock = time.perf_counter() - clock, time.perf_counter()
        if shard.batches:  # a shard without tokens needs no forward, and no target
            start, done_tokens = time.perf_counter(), 0
            device = next(model.parameters()).device

            def keep(batch, aux, final, placements):
                nonlocal done_tokens
                host, ready = _to_host(encode_rows(aux, final, out_dtype), device)
                rows.put(ready, host, placements)
                done_tokens += int(shard.lengths[batch].sum())
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - start, 1e-9):.0f}")

            _run_forwards(model, shard, manifest, keep)
        failed = False
    finally:
        timings["forwards"], clock = time.perf_counter() - clock, time.perf_counter()
        rows.close(check=not failed)
        timings["drain"], clock = time.perf_counter() - clock, time.perf_counter()
        writer.close()
        timings["digest"] = time.perf_counter() - clock
    bar.update(manifest["samples"] - bar.n)  # empty samples need no forward
    if temporary.stat().st_size != manifest["file_bytes"]:
        raise HiddenCacheError(f"{temporary}: wrote {temporary.stat().st_size} bytes, expected {manifest['file_bytes']}")


def remove_stale_temporaries(out_path: str | Path) -> list[Path]:
    """Remove what a killed run of this job left beside its output: the temporaries eyrie.core.atomic names
    `.<output name>.<8 hex digits>.tmp`, and only those of this output. Returns the paths removed."""
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out_path.name)}\.[0-9a-f]{{8}}\.tmp")
    removed = []
    for path in out_path.parent.iterdir():
        if pattern.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def extract_target_shard(
    *, model_dir: str, model_cfg: dict, aux_layer_ids=None, tensor_parallel: int = 1, threads: int | None = None, progress: bool = True, **shard
) -> dict | None:
    """Load the target and extract one shard (extract_shard's keyword arguments in `shard`); the extract job's body.

    tensor_parallel > 1: this process is one of that many torchrun ranks and loads its part of the target;
    only rank 0 writes the file and returns the manifest, the others return None.
    model_cfg: model.dtype, model.device, model.trust_remote_code; aux_layer_ids None: the target's default.
    A shard without tokens (no samples, or only empty ones) is written from the target's config, the target unloaded.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    tokens = _read_shard(shard["tokens_path"], shard["template_sha256"], shard["batch_tokens"])  # refused here, before a long load
    if not tokens.batches:
        return _extract_without_target(tokens, model_dir, model_cfg, aux_layer_ids, tensor_parallel, progress, **shard)
    model = load_model(model_dir, **model_cfg, tensor_parallel=tensor_parallel)
    rank = torch.distributed.get_rank() if tensor_parallel > 1 else 0
    try:
        aux_layer_ids = aux_layer_ids or default_aux_layer_ids(text_config(model).num_hidden_layers)
        manifest = extract_shard(model=model, aux_layer_ids=aux_layer_ids, writes=rank == 0, progress=progress and rank == 0, **shard)
    finally:
        if tensor_parallel > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # transformers joined the group while loading
    return manifest if rank == 0 else None


def _extract_without_target(shard: _Shard, model_dir, model_cfg: dict, aux_layer_ids, tensor_parallel: int, progress: bool, *, tokens_path: str,
                            out_path: str, model_fingerprint: str, template_sha256: str, batch_tokens: int, dtype: str = "bfloat16",
                            compile: bool | str = "auto") -> dict | None:
    """extract_shard's file for a shard without tokens, from the target's config alone: the compute dtype is the one
    load_model would give it, and nothing is compiled (no forward runs). Under torchrun only rank 0 (RANK) writes."""
    import os

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_dir(model_dir), trust_remote_code=bool(model_cfg.get("trust_remote_code", False)))
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    aux_layer_ids = aux_layer_ids or default_aux_layer_ids(config.num_hidden_layers)
    compute_dtype = str(resolve_dtype(model_cfg.get("dtype", "auto"), resolve_device(model_cfg.get("device", "auto")))).removeprefix("torch.")
    manifest = _shard_manifest(shard, config, aux_layer_ids, model_fingerprint, template_sha256, dtype, compute_dtype)
    if tensor_parallel > 1 and int(os.environ.get("RANK", "0")) != 0:
        return None
    _write_cache(out_path, tokens_path, shard, manifest, None, progress)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.hidden.extract ARGS.json`: one torchrun rank of a tensor-parallel extraction (eyrie.hidden.parallel)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eyrie.hidden.extract ARGS.json (extract_target_shard's keyword arguments)", file=sys.stderr)
        return 2
    extract_target_shard(**json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
