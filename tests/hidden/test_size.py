"""The cache's size before it is written: the bytes-per-token formula held against files extraction wrote, the plan's
tokens (measured or estimated) and advice, and the extract job's refusal of a shard the disk cannot hold."""

from __future__ import annotations

import json
import shutil
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from factories import tiny_llama

from eyrie import config as cfg
from eyrie.hidden.cache import read_manifest
from eyrie.hidden.extract import extract_shard
from eyrie.hidden.size import (
    HEADROOM,
    ITEM_BYTES,
    MARGIN_BYTES,
    CacheTooLargeError,
    bytes_per_token,
    ensure_shard_fits,
    estimate_cache,
    format_estimate,
    online_mode_exists,
    remedies,
    shard_bytes,
    target_hidden_size,
    token_shard_counts,
)
from eyrie.tokens.shards import TOKENS_SCHEMA

TEMPLATE = "t" * 64
HIDDEN = 64
LENGTHS = [37, 5, 90, 12, 61]  # differing lengths: the shard is padded into batches like a real one


def fake_free(monkeypatch, free: int) -> None:
    """Every shutil.disk_usage call (eyrie.core.disk asks it) reports `free` bytes free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * free + 1, 0, free))


def write_token_shard(path, lengths, stats: bool = True, vocab: int = 128) -> None:
    generator = torch.Generator().manual_seed(len(lengths))
    rows = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append({"id": f"sample-{k:03d}", "dataset": "d", "input_ids": ids, "loss_mask": mask, "n_tokens": n,
                     "n_assistant_tokens": sum(mask), "truncated": False})
    meta = {"template_sha256": TEMPLATE, "max_seq_len": 2048, "stats": {"records": len(rows), "tokens": sum(lengths)} if stats else {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()}), path)


@pytest.fixture(scope="module")
def tiny_target():
    """A random 8-layer Llama of width 64: extraction's real code path in well under a second."""
    return tiny_llama(hidden=HIDDEN, layers=8, vocab=128, intermediate=128, positions=256)


def extract(model, tokens_path, out_path, dtype):
    return extract_shard(tokens_path=str(tokens_path), out_path=str(out_path), model=model, model_fingerprint="f" * 64,
                         template_sha256=TEMPLATE, aux_layer_ids=[1, 3, 4], batch_tokens=128, dtype=dtype, progress=False)


# --------------------------------------------------------------------------- the formula


def test_item_bytes_are_torchs_element_sizes():
    for name, size in ITEM_BYTES.items():
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == size, name


def test_bytes_per_token_are_the_figures_measured_on_real_caches():
    assert bytes_per_token(4096, "bfloat16") == 8 * 4096 + 5 == 32_773
    assert bytes_per_token(4096, "float8_e4m3fn") == 4 * 4096 + 21 == 16_405
    # A real SmolLM2 run (H = 576) measured 4,613.1 and 2,325.1 bytes per token with its headers and offsets.
    assert bytes_per_token(576, "bfloat16") == 4_613 and bytes_per_token(576, "float8_e4m3fn") == 2_325
    assert bytes_per_token(576, "float32") == 16 * 576 + 5
    assert bytes_per_token(7168, "bfloat16") == 57_349  # ~57 KB per token at H = 7168 (docs/USAGE.md)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_the_formula_is_what_extraction_writes(tiny_target, tmp_path, dtype):
    tokens_path, out = tmp_path / "tokens" / "0000.parquet", tmp_path / "hidden" / "0000.safetensors"
    write_token_shard(tokens_path, LENGTHS)
    manifest = extract(tiny_target, tokens_path, out, dtype)
    size, samples, tokens = out.stat().st_size, len(LENGTHS), sum(LENGTHS)
    assert manifest["file_bytes"] == size and read_manifest(out)["tokens"] == tokens
    with open(out, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    # Everything after the header is the offsets and, per token, exactly bytes_per_token.
    assert size - 8 - header - 8 * (samples + 1) == tokens * bytes_per_token(HIDDEN, dtype)
    # The shard figure bounds the file from above by a few KiB, with the manifest or with the per-sample guess.
    for bound in (shard_bytes(HIDDEN, dtype, samples, tokens, manifest), shard_bytes(HIDDEN, dtype, samples, tokens)):
        assert size <= bound <= size + 8192


def test_token_counts_come_from_the_footer_or_the_n_tokens_column(tmp_path):
    write_token_shard(tmp_path / "with.parquet", LENGTHS)
    write_token_shard(tmp_path / "without.parquet", LENGTHS, stats=False)
    assert token_shard_counts(tmp_path / "with.parquet") == token_shard_counts(tmp_path / "without.parquet") == (5, sum(LENGTHS))


# --------------------------------------------------------------------------- the refusal


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_extraction_refuses_a_shard_the_disk_cannot_hold_and_writes_nothing(tiny_target, tmp_path, monkeypatch, dtype):
    tokens_path, out = tmp_path / "tokens" / "0000.parquet", tmp_path / "hidden" / "0000.safetensors"
    write_token_shard(tokens_path, LENGTHS)
    out.parent.mkdir()  # as Snakemake makes it before the job
    needed = shard_bytes(HIDDEN, dtype, len(LENGTHS), sum(LENGTHS))
    fake_free(monkeypatch, needed + MARGIN_BYTES // 2)
    with pytest.raises(CacheTooLargeError) as refused:
        extract(tiny_target, tokens_path, out, dtype)
    message = str(refused.value)
    assert str(out) in message and f"{needed + MARGIN_BYTES // 2:,} bytes) free" in message
    assert "nothing was written" in message and "hidden.keep: false" in message and "larger filesystem" in message
    assert ("hidden.dtype: float8_e4m3fn" in message) == (dtype == "bfloat16")  # an fp8 cache cannot halve again
    assert not out.exists() and not list(out.parent.iterdir())  # not even the temporary beside it
    # The job's early check, before the target loads, refuses the same shard.
    with pytest.raises(CacheTooLargeError):
        ensure_shard_fits(tokens_path, out, HIDDEN, dtype)
    fake_free(monkeypatch, needed + 2 * MARGIN_BYTES)
    ensure_shard_fits(tokens_path, out, HIDDEN, dtype)
    extract(tiny_target, tokens_path, out, dtype)
    assert out.stat().st_size <= needed


# --------------------------------------------------------------------------- the plan


def plan_config(tmp_path, hidden_size: int | None = HIDDEN, **hidden):
    config = cfg.validate(
        {
            "model": {"name": "m", "path": "model"},
            "datasets": {"d": {"source": {"file": "x.jsonl"}, "shards": 2, "limit": 100, "heldout_fraction": 0.2}},
            "plan": {"guess_prompt_tokens": 150, "guess_completion_tokens": 250},
            "hidden": hidden,
        }
    )
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({} if hidden_size is None else {"hidden_size": hidden_size}))
    return config


def estimate(config, tmp_path):
    return estimate_cache(config, tmp_path, [("d", "0000"), ("d", "0001")], "model")


def test_before_anything_ran_the_tokens_are_estimated_from_the_limit_and_the_guesses(tmp_path, monkeypatch):
    fake_free(monkeypatch, 10**12)
    e = estimate(plan_config(tmp_path), tmp_path)
    # 100 prompts, 20% held out, over 2 shards: 40 samples each of 150 + 250 tokens.
    assert [c.samples for c in e.counts] == [40, 40] and e.tokens == 80 * 400
    assert e.bytes_per_token == 8 * HIDDEN + 5
    assert e.total_bytes() == 2 * shard_bytes(HIDDEN, "bfloat16", 40, 40 * 400)
    assert e.total_bytes("float8_e4m3fn") == 2 * shard_bytes(HIDDEN, "float8_e4m3fn", 40, 40 * 400)
    text = format_estimate(e)
    assert "hidden-state cache" in text and "~32,000 (estimated, no token shard yet: 80 samples (datasets.d.limit) x 400 tokens per sample" in text
    assert "plan.guess_prompt_tokens 150 + plan.guess_completion_tokens 250" in text
    assert f"bytes/token: {8 * HIDDEN + 5:,} (H = 64 from model/config.json)" in text
    assert "free space:" in text and "fits:" in text and "to make room" not in text


def test_token_shards_are_measured_and_the_rest_estimated_from_their_mean(tmp_path, monkeypatch):
    fake_free(monkeypatch, 10**12)
    config = plan_config(tmp_path)
    write_token_shard(tmp_path / "results/tokens/d/0000.parquet", LENGTHS)
    pq.write_table(pa.Table.from_pylist([{"id": str(k)} for k in range(7)]), tmp_path / "prompts.parquet")
    (tmp_path / "results/prompts/d").mkdir(parents=True)
    shutil.move(tmp_path / "prompts.parquet", tmp_path / "results/prompts/d/0001.parquet")
    e = estimate(config, tmp_path)
    assert e.counts[0].measured and e.counts[0].tokens == sum(LENGTHS)
    assert not e.counts[1].measured and e.counts[1].samples == 7  # the prompt shard's rows
    assert e.tokens == pytest.approx(sum(LENGTHS) + 7 * sum(LENGTHS) / len(LENGTHS))
    assert "measured from 1 of 2 token shards, the other 1 estimated: 7 samples (the prompt shards) x 41 tokens per sample (the mean" in format_estimate(e)

    write_token_shard(tmp_path / "results/tokens/d/0001.parquet", LENGTHS[:2])
    e = estimate(config, tmp_path)
    assert e.tokens == sum(LENGTHS) + sum(LENGTHS[:2])
    assert f"  tokens:      {e.tokens:,} (measured: 2 of 2 token shards)" in format_estimate(e)


def test_a_cache_that_does_not_fit_gets_advice_and_one_that_is_tight_too(tmp_path, monkeypatch):
    config = plan_config(tmp_path)
    total = estimate(config, tmp_path).total_bytes()
    fake_free(monkeypatch, total // 2)
    e = estimate(config, tmp_path)
    assert e.fits is False
    text = format_estimate(e)
    assert "the cache does not fit" in text and "hidden.dtype: float8_e4m3fn" in text and "hidden.keep: false" in text
    assert ("hidden.mode: online" in text) == online_mode_exists()
    # Fits, but would leave less than HEADROOM of the free space.
    fake_free(monkeypatch, int(total / (1 - HEADROOM / 2)))
    text = format_estimate(estimate(config, tmp_path))
    assert "less than 10% headroom" in text and "to make room" in text
    # Already fp8 and temporary: neither is suggested again.
    fake_free(monkeypatch, 1000)
    text = format_estimate(estimate(plan_config(tmp_path, dtype="float8_e4m3fn", keep=False), tmp_path))
    assert "to make room" in text and "hidden.dtype:" not in text and "hidden.keep:" not in text and "larger filesystem" in text


def test_written_shards_count_as_written_and_an_unknown_width_is_said(tmp_path, monkeypatch):
    fake_free(monkeypatch, 10**12)
    config = plan_config(tmp_path, hidden_size=None)
    e = estimate(config, tmp_path)
    assert e.hidden_size is None and e.total_bytes() is None and e.fits is None
    assert "bytes/token: unknown until the target is at model (its config.json" in format_estimate(e)
    (tmp_path / "results/hidden/d").mkdir(parents=True)
    (tmp_path / "results/hidden/d/0000.safetensors").write_bytes(b"\0" * 1000)
    assert estimate(plan_config(tmp_path), tmp_path).written_bytes == 1000


def test_remedies_name_online_mode_only_where_the_schema_has_it():
    assert any("hidden.mode: online" in step for step in remedies("bfloat16")) == online_mode_exists()


def test_target_hidden_size_reads_the_text_config_of_a_multimodal_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 4096}, "vision_config": {"hidden_size": 1152}}))
    assert target_hidden_size(tmp_path) == 4096
    assert target_hidden_size(tmp_path / "missing") is None
