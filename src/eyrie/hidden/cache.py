"""The hidden-state cache: per token, the target's three aux hidden states and its final normed state.

Layer convention (DESIGN.md "Aux layers"): ``aux_layer_ids`` are SGLang's
``eagle_aux_hidden_state_layer_ids``, the 0-based index i of the decoder layer whose OUTPUT is
fused. SGLang captures the residual stream entering layer i + 1, which is transformers'
``output_hidden_states[i + 1]`` (index 0 being the embeddings). ``capture_indices`` is the only
place that mapping is written down; everything else derives the capture from it.

One token shard becomes one safetensors file (see ``extract_shard``); a JSON manifest in its
metadata names the target, the chat template and the layers, so a cache from another target,
template, layer set or width is refused instead of silently training a useless drafter.
"""

from __future__ import annotations

import json
import queue
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eyrie.core.artifacts import MANIFEST_KEY, ArtifactError, read_parquet_metadata, read_safetensors_manifest
from eyrie.core.atomic import write_atomically
from eyrie.target.aux_layers import AuxLayerError, capture_indices
from eyrie.core.batching import batches_by_tokens
from eyrie.core.errors import ContractError, EyrieError

FORMAT = "eyrie-hidden/1"
TENSOR_NAMES = ("aux_hidden", "final_hidden", "input_ids", "loss_mask", "offsets")
# float8 caches store each state tensor with its scales (eyrie.hidden.fp8): name -> (scale tensor, blocks per row).
SCALES = {"aux_hidden": ("aux_scale", 3), "final_hidden": ("final_scale", 1)}
FP8_SCALES_NOTE = "per token and layer block: absmax / 448, float32; value = float(q) * scale"


class HiddenCacheError(EyrieError):
    """The hidden-state cache cannot be built or used."""


class HiddenCacheMismatchError(HiddenCacheError, ContractError):
    """A cache comes from another target, template, layer set or hidden width than the one in use."""


# --------------------------------------------------------------------------- batching


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


# --------------------------------------------------------------------------- extraction


def _read_tokens(tokens_path: str):
    table = pq.read_table(tokens_path, columns=["id", "input_ids", "loss_mask"])
    ids_col = table.column("input_ids").combine_chunks()
    mask_col = table.column("loss_mask").combine_chunks()
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    mask_lengths = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False).astype(np.int64)
    if not np.array_equal(lengths, mask_lengths):
        row = int(np.flatnonzero(lengths != mask_lengths)[0])
        raise HiddenCacheError(f"{tokens_path}: row {row}: input_ids and loss_mask differ in length; re-run the tokenize stage")
    input_ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    loss_mask = mask_col.flatten().to_numpy(zero_copy_only=False).astype(np.int8)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return table.column("id").to_pylist(), input_ids, loss_mask, offsets


def _torch_dtype(name: str):
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or str(name) not in _SAFETENSORS_DTYPES:
        raise HiddenCacheError(
            f"hidden.dtype must be one of bfloat16, float16, float32, float64, float8_e4m3fn; got {name!r}"
        )
    return dtype


def _is_fp8(dtype_name) -> bool:
    from eyrie.hidden.fp8 import FP8_NAME

    return dtype_name == FP8_NAME


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _base_model(model):
    """The decoder stack without the LM head (no full-vocabulary logits are ever computed)."""
    base = getattr(model, "model", None)
    if base is None:
        base = model.base_model
    return base


_SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "int64": "I64",
    "int32": "I32",
    "int8": "I8",
}


class _SafetensorsWriter:
    """A safetensors file written in place: header first, then each sample's rows where they belong.

    Extraction runs samples in length-sorted batches but stores them in shard order; writing the
    rows straight to their final byte range keeps memory bounded by one batch instead of the whole
    shard (at 8B-target widths a shard's states are tens of GB). The layout is the format's own
    (8-byte little-endian header length, JSON header padded to 8 bytes, contiguous data), so the file
    loads with safetensors' own readers. Knowing the layout up front also gives the exact file size
    for the manifest before anything is written.
    """

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], manifest: dict):
        import torch

        self.path, self.entries, begin = path, {}, 0
        for name, dtype, shape in specs:
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
            self.entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
            begin += nbytes
        self.data_bytes = begin
        # file_bytes depends on the header, which holds the manifest, which holds file_bytes. Grow the guess
        # until the header fits in it; trailing spaces (legal in the header) fill any slack, so this settles.
        size = 0
        while True:
            manifest["file_bytes"] = size
            manifest["bytes_per_token"] = round(size / manifest["tokens"], 3) if manifest["tokens"] else 0.0
            header = json.dumps({"__metadata__": {MANIFEST_KEY: json.dumps(manifest)}, **self.entries}, separators=(",", ":")).encode()
            room = size - 8 - self.data_bytes
            if len(header) <= room:
                header += b" " * (room - len(header))
                break
            size = 8 + len(header) + (-len(header) % 8) + self.data_bytes
        self.data_start = 8 + len(header)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(header)) + header)
        self.file.truncate(size)

    def write_rows(self, name: str, row: int, values) -> None:
        """Write values (rows of the named tensor, starting at row `row`) at their place in the file."""
        import torch

        if values.numel() == 0:
            return
        entry = self.entries[name]
        row_bytes = (entry["data_offsets"][1] - entry["data_offsets"][0]) // entry["shape"][0]
        data = values.contiguous().view(-1).view(torch.uint8).numpy()
        self.file.seek(self.data_start + entry["data_offsets"][0] + row * row_bytes)
        self.file.write(memoryview(data))

    def close(self) -> None:
        self.file.close()


class _BackgroundRows:
    """Writes each batch's packed rows to the file on a thread, so the device->host copy and the file
    writes of one batch overlap the next batch's forward.

    At most `depth` batches wait in the queue (put blocks beyond that), which bounds host memory. A
    failed write is kept, the remaining batches are dropped unwritten, and put/close re-raise it.
    """

    def __init__(self, writer: _SafetensorsWriter, depth: int = 2):
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


def _decoder_layers(base, num_layers: int):
    """The decoder layers to hook, or None when the model does not expose them as base.layers."""
    layers = getattr(base, "layers", None)
    if layers is None or len(layers) != num_layers:
        return None
    return layers


class _CaptureLayers:
    """Forward hooks that keep the outputs of the layers behind the capture indices (output_hidden_states[c] is
    the output of decoder layer c - 1), so the forward holds three states instead of all num_layers + 1."""

    def __init__(self, layers, capture: list[int]):
        self.layers, self.capture, self.outputs, self.handles = layers, capture, {}, []

    def __enter__(self):
        for c in self.capture:
            self.handles.append(self.layers[c - 1].register_forward_hook(self._keep(c)))
        return self

    def _keep(self, c: int):
        def hook(module, args, output):
            self.outputs[c] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> list:
        states = [self.outputs.pop(c, None) for c in self.capture]
        if any(s is None for s in states):
            raise HiddenCacheError(f"the capture hooks saw no output for capture indices {self.capture}; the target's decoder layers were not called")
        return states

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.outputs.clear()


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


def _encode_rows(aux, final, out_dtype) -> dict:
    """The stored form of packed rows aux [n, 3H], final [n, H] (on the device that computed them)."""
    from eyrie.hidden.fp8 import FP8_DTYPE, quantize_blocks

    if out_dtype == FP8_DTYPE:
        stored = {}
        for name, states in (("aux_hidden", aux), ("final_hidden", final)):
            scale_name, blocks = SCALES[name]
            stored[name], stored[scale_name] = quantize_blocks(states, blocks)
        return stored
    return {"aux_hidden": aux.to(out_dtype), "final_hidden": final.to(out_dtype)}


def _to_host(tensors: dict, device):
    """(host tensors, ready event): on CUDA the copies are non-blocking into pinned memory and the event marks them done."""
    import torch

    if device.type != "cuda":
        return {name: t.cpu() for name, t in tensors.items()}, None
    host = {name: t.to("cpu", non_blocking=True) for name, t in tensors.items()}  # pinned destination
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _storage_specs(dtype_name: str, samples: int, total: int, hidden: int) -> list[tuple[str, str, tuple[int, ...]]]:
    specs = [
        ("offsets", "int64", (samples + 1,)),
        ("aux_hidden", dtype_name, (total, 3 * hidden)),
        ("final_hidden", dtype_name, (total, hidden)),
        ("input_ids", "int32", (total,)),
        ("loss_mask", "int8", (total,)),
    ]
    if _is_fp8(dtype_name):
        specs += [(scale_name, "float32", (total, blocks)) for scale_name, blocks in SCALES.values()]
    return specs


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
) -> dict:
    """Run the target over a token shard and cache aux [T, 3H] and final normed [T, H] states; returns the manifest.

    With dtype float8_e4m3fn the states are stored quantized with per-token, per-layer-block scales
    (aux_scale [T, 3], final_scale [T, 1], see eyrie.hidden.fp8); load_hidden and the trainer dequantize.
    """
    import torch
    from tqdm import tqdm

    shard_template = read_parquet_metadata(tokens_path).get("template_sha256")
    if shard_template != template_sha256:
        raise ContractError(
            f"{tokens_path}: tokenized with chat template {shard_template!r}, but the target's template is "
            f"{template_sha256!r}; re-tokenize with this target or point model.path at the one used"
        )
    config = _text_config(model)
    num_layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    capture = capture_indices(aux_layer_ids, num_layers)
    out_dtype = _torch_dtype(dtype)

    sample_ids, input_ids, loss_mask, offsets = _read_tokens(tokens_path)
    lengths = np.diff(offsets)
    total = int(offsets[-1])
    device = next(model.parameters()).device
    base = _base_model(model)
    layers = _decoder_layers(base, num_layers)
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
    if _is_fp8(dtype_name):
        manifest["scales"] = FP8_SCALES_NOTE
    ids_t = torch.from_numpy(input_ids)
    bar = tqdm(
        total=len(sample_ids),
        unit="sample",
        desc=f"hidden {Path(tokens_path).name}",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )

    def write(temporary: Path) -> None:
        writer = _SafetensorsWriter(temporary, _storage_specs(dtype_name, len(sample_ids), total, hidden), manifest)
        rows = _BackgroundRows(writer)
        failed = True
        try:
            writer.write_rows("offsets", 0, torch.from_numpy(offsets))
            writer.write_rows("input_ids", 0, ids_t)
            writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask))
            start, done_tokens = time.perf_counter(), 0
            with torch.inference_mode(), _CaptureLayers(layers or [], capture if layers else []) as hooks:
                for batch in batches:
                    x, keep, placements = _batch_inputs(batch, lengths, offsets, ids_t)
                    # Right padding needs no attention mask: under the causal mask a real token never sees the
                    # padding after it, and leaving the mask out lets SDPA take its causal (flash) kernels.
                    out = base(
                        input_ids=_to_device(x, device),
                        output_hidden_states=layers is None,
                        use_cache=False,
                        return_dict=True,
                    )
                    if layers is None:
                        if len(out.hidden_states) != num_layers + 1:
                            raise HiddenCacheError(
                                f"the target returned {len(out.hidden_states)} hidden states, expected {num_layers + 1} "
                                "(embeddings + one per decoder layer); cannot map aux layer ids"
                            )
                        states = [out.hidden_states[c] for c in capture]
                    else:
                        states = hooks.take()
                    # Only the real tokens leave the device, gathered by index (no host sync); last_hidden_state is
                    # the decoder stack's output after its final norm: what the LM head reads.
                    keep_d = _to_device(keep, device)
                    aux = torch.cat([s.reshape(-1, hidden).index_select(0, keep_d) for s in states], dim=-1)  # (n, 3H)
                    final = out.last_hidden_state.reshape(-1, hidden).index_select(0, keep_d)  # (n, H)
                    del out, states
                    host, ready = _to_host(_encode_rows(aux, final, out_dtype), device)
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


# --------------------------------------------------------------------------- reading


def read_manifest(path: str | Path) -> dict:
    """The manifest alone, from the safetensors header (no tensor is read)."""
    try:
        return read_safetensors_manifest(path, "eyrie hidden-state cache")
    except ArtifactError as exc:
        raise HiddenCacheError(str(exc)) from None


def stored_names(manifest: dict) -> tuple[str, ...]:
    """The tensors a cache with this manifest holds: the scales too when its states are float8."""
    scales = tuple(scale_name for scale_name, _ in SCALES.values()) if _is_fp8(manifest.get("dtype")) else ()
    return TENSOR_NAMES + scales


def load_hidden(path: str | Path, dequantize: bool = True):
    """(tensors dict, manifest) of a cache file; the tensors are checked for the shapes the manifest states.

    A float8 cache comes back dequantized to float32 aux_hidden/final_hidden (its scale tensors used
    up), unless dequantize=False, which returns the stored float8 values and their scales.
    """
    from safetensors.torch import load_file

    from eyrie.hidden.fp8 import dequantize_blocks

    manifest = read_manifest(path)
    tensors = load_file(str(path))
    missing = [name for name in stored_names(manifest) if name not in tensors]
    if missing:
        raise HiddenCacheError(f"{path}: missing tensors {missing}; rebuild the cache")
    t, h, n = manifest["tokens"], manifest["hidden_size"], manifest["samples"]
    expected = {"aux_hidden": (t, 3 * h), "final_hidden": (t, h), "input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,)}
    if _is_fp8(manifest["dtype"]):
        expected.update({scale_name: (t, blocks) for scale_name, blocks in SCALES.values()})
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HiddenCacheError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, the manifest says {shape}")
    if dequantize and _is_fp8(manifest["dtype"]):
        for name, (scale_name, _) in SCALES.items():
            tensors[name] = dequantize_blocks(tensors[name], tensors.pop(scale_name))
    return tensors, manifest


def read_state_rows(handle, name: str, start: int, stop: int, fp8: bool):
    """Rows start:stop of aux_hidden or final_hidden from an open safetensors handle, as float32 (dequantized if fp8)."""
    from eyrie.hidden.fp8 import dequantize_blocks

    rows = handle.get_slice(name)[start:stop]
    if not fp8:
        return rows.float()
    return dequantize_blocks(rows, handle.get_slice(SCALES[name][0])[start:stop])


def convert_cache(src_path: str | Path, out_path: str | Path, dtype: str, rows_per_chunk: int = 4096) -> dict:
    """Re-store a cache's states in another dtype with extract_shard's own encoder (e.g. a bf16 cache as float8).

    Everything else (tokens, offsets, manifest fields) is carried over; returns the new manifest. A
    float8 source is dequantized first, so converting back gives its float values, not the originals.
    """
    from safetensors import safe_open

    out_dtype = _torch_dtype(dtype)
    dtype_name = str(out_dtype).removeprefix("torch.")
    manifest = read_manifest(src_path)
    source_fp8 = _is_fp8(manifest.get("dtype"))
    total, hidden, samples = int(manifest["tokens"]), int(manifest["hidden_size"]), int(manifest["samples"])
    manifest = {k: v for k, v in manifest.items() if k not in ("file_bytes", "bytes_per_token", "scales")}
    manifest["dtype"] = dtype_name
    if _is_fp8(dtype_name):
        manifest["scales"] = FP8_SCALES_NOTE
    def write(temporary: Path) -> None:
        writer = _SafetensorsWriter(temporary, _storage_specs(dtype_name, samples, total, hidden), manifest)
        try:
            with safe_open(str(src_path), framework="pt") as f:
                for name in ("offsets", "input_ids", "loss_mask"):
                    writer.write_rows(name, 0, f.get_tensor(name))
                for start in range(0, total, rows_per_chunk):
                    stop = min(total, start + rows_per_chunk)
                    aux = read_state_rows(f, "aux_hidden", start, stop, source_fp8)
                    final = read_state_rows(f, "final_hidden", start, stop, source_fp8)
                    for name, rows in _encode_rows(aux, final, out_dtype).items():
                        writer.write_rows(name, start, rows)
        finally:
            writer.close()

    write_atomically(out_path, write)
    return manifest


def check_manifest(
    manifest: dict,
    *,
    target_model_fingerprint: str,
    template_sha256: str,
    aux_layer_ids,
    hidden_size: int,
    path: str | Path | None = None,
) -> None:
    """Raise HiddenCacheMismatchError (naming the file and both values) unless the cache fits this target and drafter."""
    where = f"{path}: " if path is not None else "hidden-state cache: "
    redo = "; delete the cache (results/hidden/) so it is rebuilt for the current target and settings"
    try:
        wanted_capture = capture_indices(aux_layer_ids, int(manifest["num_hidden_layers"]))
    except AuxLayerError as exc:
        raise AuxLayerError(f"{where}{exc}") from None
    checks = [
        ("target model fingerprint", "target_model_fingerprint", target_model_fingerprint),
        ("chat template fingerprint", "template_sha256", template_sha256),
        ("hidden size", "hidden_size", int(hidden_size)),
        ("aux layer ids (SGLang convention)", "aux_layer_ids", [int(i) for i in aux_layer_ids]),
        ("capture indices (output_hidden_states)", "capture_indices", wanted_capture),
    ]
    for label, key, expected in checks:
        found = manifest.get(key)
        if found != expected:
            raise HiddenCacheMismatchError(f"{where}{label} is {found!r} in the cache but {expected!r} is in use{redo}")
