"""The extract job: run the target over a token shard and store its hidden states as one cache file.

Samples run in length-sorted, token-budgeted batches (right-padded, no attention mask) through
eyrie.target.states (the forward that online training shares: hooks keep only the three capture
layers' outputs); only real tokens leave the device, and a background thread writes each batch's
rows straight to their place in the file while the next batch runs. The file's layout, its
manifest and its readers belong to eyrie.hidden.cache.

With hidden.tensor_parallel N the job runs this module as N torchrun ranks (`python -m
eyrie.hidden.extract ARGS.json`, launched by eyrie.hidden.parallel): every rank runs the same batches
on its part of the target, and rank 0 alone writes, the same file one process writes.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
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
from eyrie.target.model import load_model
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
    """Writes each batch's packed rows to the file on a thread, so the device->host copy and the file
    writes of one batch overlap the next batch's forward.

    At most `depth` batches wait in the queue (put blocks beyond that), which bounds host memory. A
    failed write is kept, the remaining batches are dropped unwritten, and put/close re-raise it.
    """

    def __init__(self, writer: SafetensorsWriter, depth: int = 2):
        self.writer, self.error = writer, None
        self.queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, name="eyrie-hidden-writer", daemon=True)
        self.thread.start()

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
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise HiddenCacheError(f"{self.writer.path}: writing the hidden states failed: {self.error}") from self.error

    def close(self, check: bool = True) -> None:
        self.queue.put(None)
        self.thread.join()
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
    progress: bool = True,
    writes: bool = True,
) -> dict:
    """Run the target over a token shard and cache aux [T, 3H] and final normed [T, H] states; returns the manifest.

    With dtype float8_e4m3fn the states are stored quantized with per-token, per-layer-block scales
    (aux_scale [T, 3], final_scale [T, 1], see eyrie.hidden.fp8); load_hidden and the trainer dequantize.
    writes False: a tensor-parallel rank other than 0, which runs the same forwards (its share of each
    matrix product, joined by all-reduces) and keeps nothing.
    """
    import torch
    from tqdm import tqdm

    tokenized_with = shard_template(tokens_path)
    if tokenized_with != template_sha256:
        raise ContractError(
            f"{tokens_path}: tokenized with chat template {tokenized_with!r}, but the target's template is "
            f"{template_sha256!r}; re-tokenize with this target or point model.path at the one used"
        )
    config = text_config(model)
    num_layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    capture = capture_indices(aux_layer_ids, num_layers)
    out_dtype = storage_dtype(dtype)

    sample_ids, input_ids, loss_mask, offsets = read_tokens(tokens_path, HiddenCacheError)
    lengths = np.diff(offsets)
    total = int(offsets[-1])
    device = next(model.parameters()).device
    batches = plan_token_batches(lengths, batch_tokens)
    dtype_name = str(out_dtype).removeprefix("torch.")

    manifest = {
        "format": FORMAT,
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "capture_indices": capture,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "target_model_fingerprint": model_fingerprint,
        "template_sha256": template_sha256,
        "dtype": dtype_name,
        "compute_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "samples": len(sample_ids),
        "tokens": total,
        "assistant_tokens": int(loss_mask.sum(dtype=np.int64)),
        "ids": sample_ids,
    }
    if is_fp8(dtype_name):
        manifest["scales"] = FP8_SCALES_NOTE
    ids_t = torch.from_numpy(input_ids)
    if not writes:
        with torch.inference_mode(), TargetStates(model, capture, HiddenCacheError) as target:
            for batch in batches:
                x, keep, _ = _batch_inputs(batch, lengths, offsets, ids_t)
                target.states(_to_device(x, device), _to_device(keep, device))
        return manifest
    # Refuse before the first forward: a full disk would otherwise fail the job hours in, at the last batch.
    ensure_room(out_path, shard_bytes(hidden, dtype_name, len(sample_ids), total, manifest), dtype_name)
    bar = tqdm(
        total=len(sample_ids),
        unit="sample",
        desc=f"hidden {Path(tokens_path).name}",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )

    def write(temporary: Path) -> None:
        writer = SafetensorsWriter(temporary, storage_specs(dtype_name, len(sample_ids), total, hidden), manifest)
        rows = _BackgroundRows(writer)
        failed = True
        try:
            writer.write_rows("offsets", 0, torch.from_numpy(offsets))
            writer.write_rows("input_ids", 0, ids_t)
            writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask))
            start, done_tokens = time.perf_counter(), 0
            with torch.inference_mode(), TargetStates(model, capture, HiddenCacheError) as target:
                for batch in batches:
                    x, keep, placements = _batch_inputs(batch, lengths, offsets, ids_t)
                    # Only the real tokens leave the device (eyrie.target.states: right padding, no attention mask).
                    aux, final = target.states(_to_device(x, device), _to_device(keep, device))  # (n, 3H), (n, H)
                    host, ready = _to_host(encode_rows(aux, final, out_dtype), device)
                    del aux, final
                    rows.put(ready, host, placements)
                    done_tokens += int(lengths[batch].sum())
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
            failed = False
        finally:
            rows.close(check=not failed)
            writer.close()
        bar.update(len(sample_ids) - bar.n)  # empty samples need no forward
        if temporary.stat().st_size != manifest["file_bytes"]:
            raise HiddenCacheError(f"{temporary}: wrote {temporary.stat().st_size} bytes, expected {manifest['file_bytes']}")

    try:
        write_atomically(out_path, write)
    finally:
        bar.close()
    return manifest


def extract_target_shard(
    *, model_dir: str, model_cfg: dict, aux_layer_ids=None, tensor_parallel: int = 1, threads: int | None = None, progress: bool = True, **shard
) -> dict | None:
    """Load the target and extract one shard (extract_shard's keyword arguments in `shard`); the extract job's body.

    tensor_parallel > 1: this process is one of that many torchrun ranks and loads its part of the target;
    only rank 0 writes the file and returns the manifest, the others return None.
    model_cfg: model.dtype, model.device, model.trust_remote_code; aux_layer_ids None: the target's default.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = load_model(model_dir, **model_cfg, tensor_parallel=tensor_parallel)
    rank = torch.distributed.get_rank() if tensor_parallel > 1 else 0
    try:
        aux_layer_ids = aux_layer_ids or default_aux_layer_ids(text_config(model).num_hidden_layers)
        manifest = extract_shard(model=model, aux_layer_ids=aux_layer_ids, writes=rank == 0, progress=progress and rank == 0, **shard)
    finally:
        if tensor_parallel > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # transformers joined the group while loading
    return manifest if rank == 0 else None


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
