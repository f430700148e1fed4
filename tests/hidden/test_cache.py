"""Hidden-state cache with the real target: the aux-layer mapping (off-by-one), the final normed state,
exact round trip of the token shard, batching invariance, and refusal of mismatched caches."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eyrie.core.digest import DigestMismatchError, verify
from eyrie.core.errors import ContractError
from eyrie.tokens.shards import TOKENS_SCHEMA
from eyrie.hidden.cache import HiddenCacheMismatchError, check_manifest, load_hidden, read_manifest
from eyrie.hidden.extract import extract_shard, plan_token_batches
from eyrie.target.aux_layers import AuxLayerError, capture_indices, default_aux_layer_ids

AUX = [1, 14, 26]  # the SmolLM2 (30 layers) default: [1, N//2 - 1, N - 4]
FINGERPRINT = "f" * 64

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is four, as two plus two makes four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [{"role": "user", "content": "List three fruits."}, {"role": "assistant", "content": "Apple, pear, plum and a ripe fig."}],
]


# --------------------------------------------------------------------------- pure functions


def test_default_aux_layers_and_capture_indices():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(32) == [1, 15, 28]
    # SGLang adds one: the output of layer i is transformers' output_hidden_states[i + 1].
    assert capture_indices([1, 14, 26], 30) == [2, 15, 27]
    assert capture_indices([0, 5, 28], 30) == [1, 6, 29]


@pytest.mark.parametrize("ids", [[1, 14, 29], [-1, 2, 3], [1, 14], [1, 14, 26, 27], [3, 3, 5], [1.0, 2, 3], [True, 2, 3]])
def test_capture_indices_refuses_bad_ids(ids):
    with pytest.raises(AuxLayerError):
        capture_indices(ids, 30)


def test_default_refuses_a_too_shallow_target():
    with pytest.raises(AuxLayerError):
        default_aux_layer_ids(4)


def test_token_batches_respect_the_budget():
    lengths = [5, 30, 0, 12, 40, 7, 100]
    batches = plan_token_batches(lengths, 64)
    assert sorted(k for b in batches for k in b) == [0, 1, 3, 4, 5, 6]  # the empty sample needs no forward
    assert batches[0] == [6]  # longer than the budget: alone, and first
    for batch in batches:
        longest = max(lengths[k] for k in batch)
        assert len(batch) == 1 or len(batch) * longest <= 64


def test_writer_settles_its_own_size_for_any_length(tmp_path):
    """The manifest states the file's size, which depends on the manifest: the writer must settle for every length."""
    from safetensors.torch import load_file

    from eyrie.hidden.cache import SafetensorsWriter

    for tokens in range(1, 400, 3):
        path = tmp_path / f"{tokens}.safetensors"
        manifest = {"tokens": tokens, "ids": ["x"] * (tokens % 7)}
        writer = SafetensorsWriter(path, [("a", "bfloat16", (tokens, 3)), ("b", "int8", (tokens,))], manifest)
        values = torch.arange(tokens * 3, dtype=torch.bfloat16).reshape(tokens, 3)
        writer.write_rows("a", 1, values[1:])
        writer.write_rows("a", 0, values[:1])
        writer.write_rows("b", 0, torch.ones(tokens, dtype=torch.int8))
        writer.close()
        assert path.stat().st_size == manifest["file_bytes"]
        assert read_manifest(path) == manifest
        assert verify(path) == writer.digest and writer.digest.startswith("xxh3-128-tree:")  # sealed once every byte was written
        loaded = load_file(str(path))
        assert torch.equal(loaded["a"], values) and loaded["b"].sum() == tokens


# --------------------------------------------------------------------------- with the real target


@pytest.fixture(scope="module")
def template(target):
    from eyrie.target.model import template_fingerprint

    return template_fingerprint(target[1])


@pytest.fixture(scope="module")
def token_shard(target, template, tmp_path_factory):
    from eyrie.target.chat_template import tokenize_conversation

    rows = []
    for k, messages in enumerate(CONVERSATIONS):
        tokens = tokenize_conversation(target[1], messages, 256)
        rows.append(
            {
                "id": f"sample-{k}",
                "dataset": "t",
                "input_ids": tokens.input_ids,
                "loss_mask": tokens.loss_mask,
                "n_tokens": len(tokens.input_ids),
                "n_assistant_tokens": sum(tokens.loss_mask),
                "truncated": tokens.truncated,
            }
        )
    lengths = [r["n_tokens"] for r in rows]
    assert len(set(lengths)) == len(lengths), "the samples must differ in length to exercise padding"
    meta = {"template_sha256": template, "max_seq_len": 256, "stats": {}}
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
    path = tmp_path_factory.mktemp("tokens") / "0000.parquet"
    pq.write_table(table, path)
    return str(path), rows


def extract(target, template, token_shard, out_dir, name, **kwargs):
    out = out_dir / f"{name}.safetensors"
    manifest = extract_shard(
        tokens_path=token_shard[0],
        out_path=str(out),
        model=target[0],
        model_fingerprint=FINGERPRINT,
        template_sha256=template,
        aux_layer_ids=AUX,
        progress=False,
        **kwargs,
    )
    tensors, loaded = load_hidden(out)
    assert loaded == manifest
    return tensors, manifest, out


@pytest.fixture(scope="module")
def caches(target, template, token_shard, tmp_path_factory):
    """fp32 batched (all samples in one padded batch), fp32 one sample per batch, bf16 and fp8 batched."""
    out_dir = tmp_path_factory.mktemp("hidden")
    return {
        "batched": extract(target, template, token_shard, out_dir, "batched", batch_tokens=4096, dtype="float32"),
        "single": extract(target, template, token_shard, out_dir, "single", batch_tokens=1, dtype="float32"),
        "bf16": extract(target, template, token_shard, out_dir, "bf16", batch_tokens=4096),
        "fp8": extract(target, template, token_shard, out_dir, "fp8", batch_tokens=4096, dtype="float8_e4m3fn"),
    }


@pytest.fixture(scope="module")
def reference(target, token_shard):
    """The full model, one sample at a time, fp32: output_hidden_states, logits, and the last layer's raw output."""
    model = target[0]
    raw = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, output: raw.append(output[0] if isinstance(output, tuple) else output))
    out = []
    try:
        with torch.inference_mode():
            for row in token_shard[1]:
                result = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
                out.append(([h[0] for h in result.hidden_states], result.logits[0], raw.pop()[0]))
    finally:
        hook.remove()
    return out


def spans(tensors):
    offsets = tensors["offsets"].tolist()
    return list(zip(offsets[:-1], offsets[1:]))


@pytest.mark.parametrize("mode", ["batched", "single", "bf16"])
def test_aux_slices_are_output_hidden_states_i_plus_1(caches, reference, mode):
    """The off-by-one test: the aux slice for SGLang id i is output_hidden_states[i + 1], not [i] nor [i + 2]."""
    tensors, manifest, _ = caches[mode]
    H = manifest["hidden_size"]
    assert manifest["aux_layer_ids"] == AUX and manifest["capture_indices"] == [i + 1 for i in AUX]
    dtype = tensors["aux_hidden"].dtype
    assert dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    # bf16 caches may differ from the rounded reference by one bf16 step where fp32 batching noise crosses a rounding edge.
    tol = dict(rtol=1e-2, atol=1e-2) if mode == "bf16" else dict(rtol=1e-4, atol=1e-4)
    for (a, b), (hidden_states, _, _) in zip(spans(tensors), reference):
        for j, i in enumerate(AUX):
            cached = tensors["aux_hidden"][a:b, j * H : (j + 1) * H].float()
            expected = hidden_states[i + 1].to(dtype).float()
            torch.testing.assert_close(cached, expected, **tol)
            for wrong in (i, i + 2):
                assert not torch.allclose(cached, hidden_states[wrong].to(dtype).float(), **tol), f"id {i} matches index {wrong}"


@pytest.mark.parametrize("mode", ["batched", "single"])
def test_final_hidden_is_the_normed_state_that_gives_the_logits(target, caches, reference, mode):
    model = target[0]
    tensors, _, _ = caches[mode]
    with torch.inference_mode():
        for (a, b), (_, logits, raw_last) in zip(spans(tensors), reference):
            final = tensors["final_hidden"][a:b]
            ours = model.lm_head(final)
            torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-3)
            assert torch.equal(ours.argmax(-1), logits.argmax(-1))
            # The last decoder layer's raw (pre-norm) output is not what the cache must hold.
            assert not torch.allclose(final, raw_last, atol=1e-2)
            torch.testing.assert_close(final, model.model.norm(raw_last), rtol=1e-4, atol=1e-4)


def test_bf16_final_hidden_keeps_the_argmax_mostly(target, caches, reference):
    model = target[0]
    tensors, _, _ = caches["bf16"]
    agree = total = 0
    with torch.inference_mode():
        for (a, b), (_, logits, _) in zip(spans(tensors), reference):
            ours = model.lm_head(tensors["final_hidden"][a:b].float())
            agree += int((ours.argmax(-1) == logits.argmax(-1)).sum())
            total += b - a
    assert agree / total > 0.9


@pytest.mark.parametrize("mode", ["batched", "single", "bf16"])
def test_tokens_round_trip_exactly(caches, token_shard, mode):
    tensors, manifest, _ = caches[mode]
    rows = token_shard[1]
    assert manifest["ids"] == [r["id"] for r in rows]  # shard order, not the length-sorted batch order
    assert manifest["samples"] == len(rows)
    assert manifest["tokens"] == sum(r["n_tokens"] for r in rows)
    assert tensors["input_ids"].dtype == torch.int32 and tensors["loss_mask"].dtype == torch.int8
    assert tensors["offsets"].dtype == torch.int64 and tensors["offsets"][0] == 0
    for (a, b), row in zip(spans(tensors), rows):
        assert tensors["input_ids"][a:b].tolist() == row["input_ids"]
        assert tensors["loss_mask"][a:b].tolist() == row["loss_mask"]


def test_batching_by_tokens_matches_one_sample_batches(caches, token_shard):
    lengths = [r["n_tokens"] for r in token_shard[1]]
    assert plan_token_batches(lengths, 4096) == [sorted(range(len(lengths)), key=lambda k: -lengths[k])]
    batched, single = caches["batched"][0], caches["single"][0]
    for name in ("aux_hidden", "final_hidden"):
        torch.testing.assert_close(batched[name], single[name], rtol=1e-4, atol=1e-4)
    for name in ("input_ids", "loss_mask", "offsets"):
        assert torch.equal(batched[name], single[name])


def test_manifest_and_file(caches, target, template):
    tensors, manifest, path = caches["bf16"]
    config = target[0].config
    assert manifest["num_hidden_layers"] == config.num_hidden_layers == 30
    assert manifest["hidden_size"] == config.hidden_size == 576
    assert manifest["target_model_fingerprint"] == FINGERPRINT and manifest["template_sha256"] == template
    assert manifest["dtype"] == "bfloat16"
    assert tensors["aux_hidden"].shape == (manifest["tokens"], 3 * 576)
    assert tensors["final_hidden"].shape == (manifest["tokens"], 576)
    size = os.path.getsize(path)
    assert manifest["file_bytes"] == size
    assert manifest["bytes_per_token"] == pytest.approx(size / manifest["tokens"], abs=1e-3)
    assert read_manifest(path) == manifest
    # 3H + H bf16 values, an int32 id and an int8 mask per token; the rest is offsets and the header.
    assert manifest["bytes_per_token"] > 8 * 576 + 5
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_an_extracted_cache_records_its_digest_and_a_changed_byte_is_refused_naming_the_rebuild(caches, tmp_path):
    from eyrie.hidden.cache import HiddenCacheError, convert_cache

    source = caches["bf16"][2]
    assert verify(source).startswith("xxh3-128-tree:")
    damaged = tmp_path / "0000.safetensors"
    data = bytearray(source.read_bytes())
    data[-100] ^= 0x40
    damaged.write_bytes(bytes(data))
    with pytest.raises(HiddenCacheError, match=rf"{damaged}: its content does not match .*extract_hidden job.*--force {damaged}"):
        load_hidden(damaged)
    with pytest.raises(HiddenCacheError, match="does not match"):
        convert_cache(damaged, tmp_path / "fp8.safetensors", "float8_e4m3fn")
    with pytest.raises(DigestMismatchError):
        verify(damaged)


def test_template_mismatch_refused(target, token_shard, tmp_path):
    out = tmp_path / "x.safetensors"
    with pytest.raises(ContractError, match="0000.parquet") as excinfo:
        extract_shard(
            tokens_path=token_shard[0],
            out_path=str(out),
            model=target[0],
            model_fingerprint=FINGERPRINT,
            template_sha256="0" * 64,
            aux_layer_ids=AUX,
            batch_tokens=4096,
            progress=False,
        )
    assert "0" * 64 in str(excinfo.value)
    assert not out.exists()


def test_check_manifest_refuses_mismatches(caches, template):
    _, manifest, path = caches["bf16"]
    good = dict(target_model_fingerprint=FINGERPRINT, template_sha256=template, aux_layer_ids=AUX, hidden_size=576)
    check_manifest(manifest, **good, path=path)
    with pytest.raises(HiddenCacheMismatchError) as excinfo:
        check_manifest(manifest, **{**good, "target_model_fingerprint": "e" * 64}, path=path)
    message = str(excinfo.value)
    assert str(path) in message and "e" * 64 in message and FINGERPRINT in message
    with pytest.raises(AuxLayerError, match=r"29.*outside 0\.\.28") as excinfo:
        check_manifest(manifest, **{**good, "aux_layer_ids": [1, 14, 29]}, path=path)
    assert str(path) in str(excinfo.value)
    with pytest.raises(HiddenCacheMismatchError, match="aux layer ids"):
        check_manifest(manifest, **{**good, "aux_layer_ids": [2, 15, 27]}, path=path)
    with pytest.raises(HiddenCacheMismatchError, match="chat template"):
        check_manifest(manifest, **{**good, "template_sha256": "1" * 64}, path=path)
    with pytest.raises(HiddenCacheMismatchError, match="hidden size"):
        check_manifest(manifest, **{**good, "hidden_size": 960}, path=path)


def test_empty_shard_gives_an_empty_cache(target, template, tmp_path):
    meta = {"template_sha256": template, "max_seq_len": 256, "stats": {}}
    table = pa.Table.from_pylist([], schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
    pq.write_table(table, tmp_path / "empty.parquet")
    manifest = extract_shard(
        tokens_path=str(tmp_path / "empty.parquet"),
        out_path=str(tmp_path / "empty.safetensors"),
        model=target[0],
        model_fingerprint=FINGERPRINT,
        template_sha256=template,
        aux_layer_ids=AUX,
        batch_tokens=64,
        progress=False,
    )
    tensors, loaded = load_hidden(tmp_path / "empty.safetensors")
    assert loaded == manifest and manifest["samples"] == 0 and manifest["tokens"] == 0
    assert tensors["aux_hidden"].shape == (0, 3 * 576) and tensors["offsets"].tolist() == [0]


# --------------------------------------------------------------------------- float8 cache


def test_fp8_cache_dequantizes_close_to_the_fp32_states(caches):
    """load_hidden returns float32 states within e4m3's error of the unquantized ones, per token and layer block."""
    fp8, manifest, _ = caches["fp8"]
    exact = caches["batched"][0]
    H = manifest["hidden_size"]
    assert manifest["dtype"] == "float8_e4m3fn" and "absmax / 448" in manifest["scales"]
    assert "aux_scale" not in fp8  # used up by the dequantization
    for name, blocks in (("aux_hidden", 3), ("final_hidden", 1)):
        assert fp8[name].dtype == torch.float32
        x = exact[name].reshape(-1, blocks, H)
        error = (fp8[name].reshape(-1, blocks, H) - x).norm(dim=-1) / x.norm(dim=-1)
        assert error.mean() < 0.03 and error.max() < 0.05, name
    for name in ("input_ids", "loss_mask", "offsets"):
        assert torch.equal(fp8[name], exact[name])


def test_fp8_cache_stores_float8_and_scales(caches):
    from eyrie.hidden.fp8 import quantize_blocks

    stored, manifest = load_hidden(caches["fp8"][2], dequantize=False)
    T = manifest["tokens"]
    assert stored["aux_hidden"].dtype == stored["final_hidden"].dtype == torch.float8_e4m3fn
    assert stored["aux_scale"].shape == (T, 3) and stored["final_scale"].shape == (T, 1)
    assert stored["aux_scale"].dtype == torch.float32
    # The same fp32 states through the quantizer give the same bytes: extraction uses eyrie.hidden.fp8 as is.
    q, scale = quantize_blocks(caches["batched"][0]["aux_hidden"], 3)
    assert torch.equal(stored["aux_hidden"].view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(stored["aux_scale"], scale, rtol=0, atol=0)


def test_fp8_cache_halves_the_bytes_per_token(caches):
    _, bf16, bf16_path = caches["bf16"]
    _, fp8, fp8_path = caches["fp8"]
    H, T = fp8["hidden_size"], fp8["tokens"]
    assert fp8["file_bytes"] == os.path.getsize(fp8_path)
    assert fp8["bytes_per_token"] == pytest.approx(os.path.getsize(fp8_path) / T, abs=1e-3)
    # Payload: 3H + H e4m3 bytes, 3 + 1 float32 scales, an int32 id and an int8 mask; the rest is offsets and the header.
    payload = 4 * H + 4 * 4 + 5
    header_and_offsets = bf16["file_bytes"] - T * (8 * H + 5)
    assert fp8["file_bytes"] - T * payload == pytest.approx(header_and_offsets, abs=256)
    assert fp8["bytes_per_token"] / bf16["bytes_per_token"] < 0.52


def test_trainer_reads_fp8_and_bf16_caches_as_stored(caches):
    """HiddenCache.batch (what training reads) dequantizes fp8 and returns bf16 values unchanged."""
    from eyrie.training.inputs import HiddenCache

    for mode in ("fp8", "bf16"):
        tensors, manifest, path = caches[mode]
        cache = HiddenCache([str(path)])
        refs = [(0, a, b - a) for a, b in spans(tensors)]
        batch = cache.batch(refs, "cpu")
        for row, (_, a, n) in enumerate(refs):
            assert torch.equal(batch["aux"][row, :n], tensors["aux_hidden"][a : a + n].float()), mode
            assert torch.equal(batch["final"][row, :n], tensors["final_hidden"][a : a + n].float()), mode
            assert not batch["aux"][row, n:].any()



def test_trainer_loads_rows_as_stored_and_converts_them_on_the_device(caches):
    """HiddenCache.load (training's background read) copies the stored bytes, fp8 with its scales; to_device then
    gives what dequantizing on the host gave, in float32 and in bf16, also for a batch over an fp8 and a bf16 shard."""
    from eyrie.hidden.cache import read_state_rows
    from eyrie.training.inputs import HiddenCache

    fp8_tensors, _, fp8_path = caches["fp8"]
    bf16_tensors, _, bf16_path = caches["bf16"]
    cache = HiddenCache([str(fp8_path), str(bf16_path)])
    fp8_refs = [(0, a, b - a) for a, b in spans(fp8_tensors)]
    loaded = cache.load(fp8_refs)
    assert loaded.aux.dtype == loaded.final.dtype == torch.float8_e4m3fn
    assert loaded.aux_scale.shape[-1] == 3 and loaded.final_scale.shape[-1] == 1
    assert cache.load([(1, a, b - a) for a, b in spans(bf16_tensors)]).aux.dtype == torch.bfloat16
    mixed = fp8_refs[:2] + [(1, a, b - a) for a, b in spans(bf16_tensors)][:2]
    for refs in (fp8_refs, mixed):
        for dtype in (torch.float32, torch.bfloat16):
            batch = cache.batch(refs, "cpu", dtype=dtype)
            for row, (s, a, n) in enumerate(refs):
                for key, name in (("aux", "aux_hidden"), ("final", "final_hidden")):
                    host = read_state_rows(cache._handles[s], name, a, a + n, cache.fp8[s]).to(dtype)
                    assert batch[key].dtype == dtype and torch.equal(batch[key][row, :n], host), (key, row, dtype)
                    assert not batch[key][row, n:].any()

def test_convert_cache_to_fp8_matches_extraction(caches, tmp_path):
    """A bf16/fp32 cache re-stored as fp8 (cache_precision benchmark) uses the extraction's quantizer."""
    from eyrie.hidden.cache import convert_cache

    _, source_manifest, source = caches["batched"]
    manifest = convert_cache(source, tmp_path / "fp8.safetensors", "float8_e4m3fn", rows_per_chunk=7)
    converted, loaded = load_hidden(tmp_path / "fp8.safetensors", dequantize=False)
    extracted, _ = load_hidden(caches["fp8"][2], dequantize=False)
    assert loaded == manifest and manifest["dtype"] == "float8_e4m3fn"
    assert {k: v for k, v in manifest.items() if k not in ("dtype", "scales", "file_bytes", "bytes_per_token")} == {
        k: v for k, v in source_manifest.items() if k not in ("dtype", "file_bytes", "bytes_per_token")
    }
    assert set(converted) == set(extracted)
    for name, values in extracted.items():
        assert converted[name].dtype == values.dtype
        assert torch.equal(converted[name].view(torch.uint8), values.view(torch.uint8)), name  # bytewise: fp8 has no ==


def test_a_failed_background_write_is_raised(tmp_path):
    from eyrie.hidden.cache import HiddenCacheError
    from eyrie.hidden.extract import _BackgroundRows

    class FailingWriter:
        path = tmp_path / "x.safetensors"

        def write_rows(self, name, row, values):
            raise OSError("disk full")

    rows = _BackgroundRows(FailingWriter(), depth=1)
    for _ in range(4):  # more than the queue holds: put must not block on the failed writer
        try:
            rows.put(None, {"aux_hidden": torch.zeros(2, 3)}, [(0, 0, 2)])
        except HiddenCacheError:
            break
    with pytest.raises(HiddenCacheError, match="x.safetensors.*disk full"):
        rows.close()


def test_unknown_cache_dtype_is_refused_with_the_choices(target, template, token_shard, tmp_path):
    from eyrie.hidden.cache import HiddenCacheError

    with pytest.raises(HiddenCacheError, match="hidden.dtype.*float8_e4m3fn"):
        extract(target, template, token_shard, tmp_path, "bad", batch_tokens=64, dtype="float8_e5m2")


def test_background_rows_write_on_several_threads_and_flush_to_disk_as_bytes_accumulate(tmp_path):
    import threading

    from eyrie.hidden.extract import _BackgroundRows

    class RecordingWriter:
        path = tmp_path / "x.safetensors"

        def __init__(self):
            self.rows, self.flushes, self.threads = {}, 0, set()

        def write_rows(self, name, row, values):
            self.threads.add(threading.current_thread().name)
            self.rows[(name, row)] = values.clone()

        def flush_to_disk(self):
            self.flushes += 1

    writer = RecordingWriter()
    rows = _BackgroundRows(writer, depth=2, threads=2, flush_bytes=4 * 3 * 4)  # a flush every 4 rows of 3 float32
    batches = [torch.full((2, 3), float(k)) for k in range(20)]
    for k, batch in enumerate(batches):
        rows.put(None, {"aux_hidden": batch}, [(2 * k, 0, 1), (2 * k + 1, 1, 1)])
    rows.close()
    assert all(torch.equal(writer.rows[("aux_hidden", 2 * k + j)], batch[j : j + 1]) for k, batch in enumerate(batches) for j in (0, 1))
    assert writer.threads <= {"eyrie-hidden-writer-0", "eyrie-hidden-writer-1"} and writer.threads
    assert 1 <= writer.flushes <= 10  # 40 rows, one flush wanted per 4: requests that come while one runs are merged


def test_extraction_reports_where_the_files_time_went(target, template, token_shard, tmp_path):
    import time

    timings = {}
    start = time.perf_counter()
    extract(target, template, token_shard, tmp_path, "timed", batch_tokens=64, timings=timings)
    wall = time.perf_counter() - start
    assert set(timings) == {"header", "forwards", "drain", "digest", "durable"}
    assert all(seconds >= 0 for seconds in timings.values()) and timings["forwards"] > 0
    assert sum(timings.values()) <= wall
