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
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eyrie.batching import batches_by_tokens
from eyrie.errors import EyrieError
from eyrie.tokenize import read_eyrie_metadata

MANIFEST_KEY = "manifest"
FORMAT = "eyrie-hidden/1"
TENSOR_NAMES = ("aux_hidden", "final_hidden", "input_ids", "loss_mask", "offsets")


class HiddenCacheError(EyrieError):
    """The hidden-state cache cannot be built or used."""


class AuxLayerError(HiddenCacheError):
    """The aux layer ids do not name three distinct decoder layers of the target."""


class HiddenTemplateError(HiddenCacheError):
    """The token shard was built with another chat template than the one given."""


class HiddenCacheMismatchError(HiddenCacheError):
    """A cache comes from another target, template, layer set or hidden width than the one in use."""


# --------------------------------------------------------------------------- layer ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default, in SGLang's convention: outputs of layers [1, N//2 - 1, N - 4]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    capture_indices(ids, num_layers)  # a target too shallow for the default fails here, clearly
    return ids


def capture_indices(aux_layer_ids, num_layers: int) -> list[int]:
    """transformers' output_hidden_states indices for SGLang-convention aux layer ids: [i + 1 for i in ids]."""
    ids = list(aux_layer_ids)
    if len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
        raise AuxLayerError(f"aux_layer_ids must be three integer layer ids (EAGLE-3 fuses exactly three), got {ids!r}")
    ids = [int(i) for i in ids]
    if len(set(ids)) != 3:
        raise AuxLayerError(f"aux_layer_ids must be three distinct layers, got {ids}")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise AuxLayerError(
            f"aux_layer_ids {ids}: {bad} outside 0..{num_layers - 2} for a target with {num_layers} decoder layers "
            "(SGLang convention: the index of the decoder layer whose output is taken; the last layer's output "
            f"is the final state, not an aux one; default [1, {num_layers // 2 - 1}, {num_layers - 4}])"
        )
    return [i + 1 for i in ids]


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
        raise HiddenCacheError(f"hidden cache dtype must be one of bfloat16, float16, float32, float64; got {name!r}")
    return dtype


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
    """Run the target over a token shard and cache aux [T, 3H] and final normed [T, H] states; returns the manifest."""
    import torch
    from tqdm import tqdm

    shard_template = read_eyrie_metadata(tokens_path).get("template_sha256")
    if shard_template != template_sha256:
        raise HiddenTemplateError(
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
    specs = [
        ("offsets", "int64", (len(sample_ids) + 1,)),
        ("aux_hidden", dtype_name, (total, 3 * hidden)),
        ("final_hidden", dtype_name, (total, hidden)),
        ("input_ids", "int32", (total,)),
        ("loss_mask", "int8", (total,)),
    ]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    ids_t = torch.from_numpy(input_ids)
    bar = tqdm(
        total=len(sample_ids),
        unit="sample",
        desc=f"hidden {Path(tokens_path).name}",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        writer = _SafetensorsWriter(tmp, specs, manifest)
        try:
            writer.write_rows("offsets", 0, torch.from_numpy(offsets))
            writer.write_rows("input_ids", 0, ids_t)
            writer.write_rows("loss_mask", 0, torch.from_numpy(loss_mask))
            start, done_tokens = time.perf_counter(), 0
            with torch.inference_mode():
                for batch in batches:
                    longest = int(lengths[batch[0]])
                    x = torch.zeros(len(batch), longest, dtype=torch.long)
                    attention = torch.zeros(len(batch), longest, dtype=torch.long)
                    for row, k in enumerate(batch):
                        n = int(lengths[k])
                        x[row, :n] = ids_t[offsets[k] : offsets[k] + n]
                        attention[row, :n] = 1
                    out = base(
                        input_ids=x.to(device),
                        attention_mask=attention.to(device),
                        output_hidden_states=True,
                        use_cache=False,
                        return_dict=True,
                    )
                    if len(out.hidden_states) != num_layers + 1:
                        raise HiddenCacheError(
                            f"the target returned {len(out.hidden_states)} hidden states, expected {num_layers + 1} "
                            "(embeddings + one per decoder layer); cannot map aux layer ids"
                        )
                    # last_hidden_state is the decoder stack's output after its final norm: what the LM head reads.
                    batch_aux = torch.cat([out.hidden_states[c] for c in capture], dim=-1).to(out_dtype).cpu()
                    batch_final = out.last_hidden_state.to(out_dtype).cpu()
                    del out
                    for row, k in enumerate(batch):
                        n = int(lengths[k])
                        writer.write_rows("aux_hidden", int(offsets[k]), batch_aux[row, :n])
                        writer.write_rows("final_hidden", int(offsets[k]), batch_final[row, :n])
                    done_tokens += int(lengths[batch].sum())
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
            bar.update(len(sample_ids) - bar.n)  # empty samples need no forward
        finally:
            writer.close()
        if tmp.stat().st_size != manifest["file_bytes"]:
            raise HiddenCacheError(f"{tmp}: wrote {tmp.stat().st_size} bytes, expected {manifest['file_bytes']}")
        os.replace(tmp, out_path)
    finally:
        bar.close()
        tmp.unlink(missing_ok=True)
    return manifest


# --------------------------------------------------------------------------- reading


def read_manifest(path: str | Path) -> dict:
    """The manifest alone, from the safetensors header (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for unreadable headers
        raise HiddenCacheError(f"{path}: not a readable safetensors file ({exc})") from exc
    if MANIFEST_KEY not in metadata:
        raise HiddenCacheError(f"{path}: not an eyrie hidden-state cache (no manifest in its metadata)")
    return json.loads(metadata[MANIFEST_KEY])


def load_hidden(path: str | Path):
    """(tensors dict, manifest) of a cache file; the tensors are checked for the shapes the manifest states."""
    from safetensors.torch import load_file

    manifest = read_manifest(path)
    tensors = load_file(str(path))
    missing = [name for name in TENSOR_NAMES if name not in tensors]
    if missing:
        raise HiddenCacheError(f"{path}: missing tensors {missing}")
    t, h, n = manifest["tokens"], manifest["hidden_size"], manifest["samples"]
    expected = {"aux_hidden": (t, 3 * h), "final_hidden": (t, h), "input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HiddenCacheError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, the manifest says {shape}")
    return tensors, manifest


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
