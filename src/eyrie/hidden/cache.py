"""The hidden-state cache FORMAT: per token, the target's three aux hidden states and its final normed state.

The manifest records ``aux_layer_ids`` in SGLang's convention and the ``capture_indices`` derived
from them by eyrie.target.aux_layers (docs/DESIGN.md "Aux layers"), the only owner of that mapping.

One token shard becomes one safetensors file (written by the extract job, eyrie.hidden.extract);
a JSON manifest in its metadata names the target, the chat template and the layers, so a cache
from another target, template, layer set or width is refused instead of silently training a
useless drafter. The header also records the file's xxh3-128-tree content digest (eyrie.core.digest:
a check costs about one read of the file, hashed on every core), which the readers
check before using a tensor. This module owns the layout: its storage dtypes and tensors, the
streaming writer, the readers, the manifest check, and re-storing a cache in another dtype.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import numpy as np

from eyrie.core.artifacts import MANIFEST_KEY, ArtifactError, check, load_safetensors, read_safetensors_manifest, rebuild_hint
from eyrie.core.atomic import write_atomically
from eyrie.core.digest import DIGEST_KEY, XXH3_128_TREE, placeholder, seal
from eyrie.core.errors import ContractError, EyrieError
from eyrie.target.aux_layers import AuxLayerError, capture_indices

FORMAT = "eyrie-hidden/1"
TENSOR_NAMES = ("aux_hidden", "final_hidden", "input_ids", "loss_mask", "offsets")
# float8 caches store each state tensor with its scales (eyrie.hidden.fp8): name -> (scale tensor, blocks per row).
SCALES = {"aux_hidden": ("aux_scale", 3), "final_hidden": ("final_scale", 1)}
FP8_SCALES_NOTE = "per token and layer block: absmax / 448, float32; value = float(q) * scale"
WRITTEN_BY = "extract_hidden"  # the Snakemake rule that writes a cache shard, named in read errors
DIGEST = XXH3_128_TREE  # why not sha256, nor one core: eyrie.core.digest


class HiddenCacheError(EyrieError):
    """The hidden-state cache cannot be built or used."""


class HiddenCacheMismatchError(HiddenCacheError, ContractError):
    """A cache comes from another target, template, layer set or hidden width than the one in use."""


# --------------------------------------------------------------------------- storage


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


def storage_dtype(name: str):
    """The torch dtype a cache stores its states in, from hidden.dtype's name; refuses any other name."""
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or str(name) not in _SAFETENSORS_DTYPES:
        raise HiddenCacheError(
            f"hidden.dtype must be one of bfloat16, float16, float32, float64, float8_e4m3fn; got {name!r}"
        )
    return dtype


def is_fp8(dtype_name) -> bool:
    """Whether a cache of this dtype stores float8 states with scales."""
    from eyrie.hidden.fp8 import FP8_NAME

    return dtype_name == FP8_NAME


def storage_specs(dtype_name: str, samples: int, total: int, hidden: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of a cache, in file order: the layout SafetensorsWriter lays out."""
    specs = [
        ("offsets", "int64", (samples + 1,)),
        ("aux_hidden", dtype_name, (total, 3 * hidden)),
        ("final_hidden", dtype_name, (total, hidden)),
        ("input_ids", "int32", (total,)),
        ("loss_mask", "int8", (total,)),
    ]
    if is_fp8(dtype_name):
        specs += [(scale_name, "float32", (total, blocks)) for scale_name, blocks in SCALES.values()]
    return specs


def encode_rows(aux, final, out_dtype) -> dict:
    """The stored form of packed rows aux [n, 3H], final [n, H] (on the device that computed them)."""
    from eyrie.hidden.fp8 import FP8_DTYPE, quantize_blocks

    if out_dtype == FP8_DTYPE:
        stored = {}
        for name, states in (("aux_hidden", aux), ("final_hidden", final)):
            scale_name, blocks = SCALES[name]
            stored[name], stored[scale_name] = quantize_blocks(states, blocks)
        return stored
    return {"aux_hidden": aux.to(out_dtype), "final_hidden": final.to(out_dtype)}


class SafetensorsWriter:
    """A safetensors file written in place: header first, then each sample's rows where they belong.

    Extraction runs samples in length-sorted batches but stores them in shard order; writing the
    rows straight to their final byte range keeps memory bounded by one batch instead of the whole
    shard (at 8B-target widths a shard's states are tens of GB). The layout is the format's own
    (8-byte little-endian header length, JSON header padded to 8 bytes, contiguous data), so the file
    loads with safetensors' own readers. Knowing the layout up front also gives the exact file size
    for the manifest before anything is written. Once every byte of the data has been written,
    close() records the file's content digest in the header's placeholder (eyrie.core.digest.seal);
    a file left incomplete by a failure keeps the placeholder and is never renamed into place.
    """

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], manifest: dict):
        import torch

        self.path, self.entries, begin = path, {}, 0
        for name, dtype, shape in specs:
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
            self.entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
            begin += nbytes
        self.data_bytes, self.written_bytes, self.digest = begin, 0, None
        # file_bytes depends on the header, which holds the manifest, which holds file_bytes. Grow the guess
        # until the header fits in it; trailing spaces (legal in the header) fill any slack, so this settles.
        size = 0
        while True:
            manifest["file_bytes"] = size
            manifest["bytes_per_token"] = round(size / manifest["tokens"], 3) if manifest["tokens"] else 0.0
            metadata = {MANIFEST_KEY: json.dumps(manifest), DIGEST_KEY: placeholder(DIGEST)}
            header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
            room = size - 8 - self.data_bytes
            if len(header) <= room:
                header += b" " * (room - len(header))
                break
            size = 8 + len(header) + (-len(header) % 8) + self.data_bytes
        self.data_start = 8 + len(header)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(header)) + header)
        self.file.truncate(size)
        self.file.flush()  # from here on every write is a positioned os.pwrite, so threads may write side by side
        self._count = threading.Lock()

    def write_rows(self, name: str, row: int, values) -> None:
        """Write values (rows of the named tensor, starting at row `row`) at their place in the file; safe from several
        threads at once (each call writes its own byte range)."""
        import torch

        if values.numel() == 0:
            return
        entry = self.entries[name]
        row_bytes = (entry["data_offsets"][1] - entry["data_offsets"][0]) // entry["shape"][0]
        data = memoryview(values.contiguous().view(-1).view(torch.uint8).numpy())
        at, done = self.data_start + entry["data_offsets"][0] + row * row_bytes, 0
        while done < len(data):  # pwrite may write less than asked (Linux: at most ~2 GiB a call)
            done += os.pwrite(self.file.fileno(), data[done:], at + done)
        with self._count:
            self.written_bytes += len(data)

    def flush_to_disk(self) -> None:
        """Write the file's dirty pages to the device now (fdatasync), so that the final fsync finds little left."""
        os.fdatasync(self.file.fileno())

    def close(self) -> None:
        """Close the file; when every byte of its data was written, record its content digest (self.digest)."""
        self.file.close()
        if self.written_bytes >= self.data_bytes:
            self.digest = seal(self.path, "safetensors")


# --------------------------------------------------------------------------- reading


def read_manifest(path: str | Path) -> dict:
    """The manifest alone, from the safetensors header (no tensor is read, the digest is not checked)."""
    try:
        return read_safetensors_manifest(path, "eyrie hidden-state cache", written_by=WRITTEN_BY)
    except ArtifactError as exc:
        raise HiddenCacheError(str(exc)) from None


def check_cache(path: str | Path) -> str | None:
    """Check a cache file against its recorded content digest (one read of the file): the digest, or None for a cache
    written before eyrie recorded digests. Raises HiddenCacheError naming the file and the command that rebuilds it."""
    try:
        return check(path, "safetensors", written_by=WRITTEN_BY)
    except ArtifactError as exc:
        raise HiddenCacheError(str(exc)) from None


def stored_names(manifest: dict) -> tuple[str, ...]:
    """The tensors a cache with this manifest holds: the scales too when its states are float8."""
    scales = tuple(scale_name for scale_name, _ in SCALES.values()) if is_fp8(manifest.get("dtype")) else ()
    return TENSOR_NAMES + scales


def load_hidden(path: str | Path, dequantize: bool = True):
    """(tensors dict, manifest) of a cache file; the tensors are checked for the shapes the manifest states.

    A float8 cache comes back dequantized to float32 aux_hidden/final_hidden (its scale tensors used
    up), unless dequantize=False, which returns the stored float8 values and their scales.
    """
    from eyrie.hidden.fp8 import dequantize_blocks

    manifest = read_manifest(path)
    try:
        tensors = load_safetensors(path, written_by=WRITTEN_BY)  # its digest checked first
    except ArtifactError as exc:
        raise HiddenCacheError(str(exc)) from None
    missing = [name for name in stored_names(manifest) if name not in tensors]
    if missing:
        raise HiddenCacheError(f"{path}: missing tensors {missing}; {rebuild_hint(WRITTEN_BY, path)}")
    t, h, n = manifest["tokens"], manifest["hidden_size"], manifest["samples"]
    expected = {"aux_hidden": (t, 3 * h), "final_hidden": (t, h), "input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,)}
    if is_fp8(manifest["dtype"]):
        expected.update({scale_name: (t, blocks) for scale_name, blocks in SCALES.values()})
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HiddenCacheError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, the manifest says {shape}")
    if dequantize and is_fp8(manifest["dtype"]):
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


def convert_cache(src_path: str | Path, out_path: str | Path, dtype: str, rows_per_chunk: int = 4096) -> dict:
    """Re-store a cache's states in another dtype with extract_shard's own encoder (e.g. a bf16 cache as float8).

    Everything else (tokens, offsets, manifest fields) is carried over; returns the new manifest. A
    float8 source is dequantized first, so converting back gives its float values, not the originals.
    """
    from safetensors import safe_open

    out_dtype = storage_dtype(dtype)
    dtype_name = str(out_dtype).removeprefix("torch.")
    manifest = read_manifest(src_path)
    check_cache(src_path)
    source_fp8 = is_fp8(manifest.get("dtype"))
    total, hidden, samples = int(manifest["tokens"]), int(manifest["hidden_size"]), int(manifest["samples"])
    manifest = {k: v for k, v in manifest.items() if k not in ("file_bytes", "bytes_per_token", "scales")}
    manifest["dtype"] = dtype_name
    if is_fp8(dtype_name):
        manifest["scales"] = FP8_SCALES_NOTE
    def write(temporary: Path) -> None:
        writer = SafetensorsWriter(temporary, storage_specs(dtype_name, samples, total, hidden), manifest)
        try:
            with safe_open(str(src_path), framework="pt") as f:
                for name in ("offsets", "input_ids", "loss_mask"):
                    writer.write_rows(name, 0, f.get_tensor(name))
                for start in range(0, total, rows_per_chunk):
                    stop = min(total, start + rows_per_chunk)
                    aux = read_state_rows(f, "aux_hidden", start, stop, source_fp8)
                    final = read_state_rows(f, "final_hidden", start, stop, source_fp8)
                    for name, rows in encode_rows(aux, final, out_dtype).items():
                        writer.write_rows(name, start, rows)
        finally:
            writer.close()

    write_atomically(out_path, write)
    return manifest
