"""The extract job after faults and on nothing: a killed run's temporaries cleared by the rerun, and a shard without tokens
written from the target's config alone, the target never loaded."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from factories import tiny_llama

import eyrie.hidden.extract as extract_module
import eyrie.target.model as target_model
import eyrie.tokens.tokenize as tokenize_module
from eyrie.core.atomic import write_parquet_atomically
from eyrie.hidden.cache import check_cache, load_hidden, read_manifest
from eyrie.hidden.extract import extract_shard, extract_target_shard, remove_stale_temporaries
from eyrie.hidden.size import MARGIN_BYTES, shard_bytes
from eyrie.target.model import load_model
from eyrie.tokens.shards import TOKENS_SCHEMA

TEMPLATE = "t" * 64
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_hidden.py"
MODEL_CFG = {"dtype": "float32", "device": "cpu", "trust_remote_code": False}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("faults") / "target"
    tiny_llama(directory, hidden=64, layers=8, vocab=128, intermediate=128, positions=256)
    return directory


def token_shard(path, lengths):
    generator = torch.Generator().manual_seed(len(lengths))
    rows = []
    for k, n in enumerate(lengths):
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append({"id": f"s{k}", "dataset": "d", "input_ids": torch.randint(0, 128, (n,), generator=generator).tolist(), "loss_mask": mask,
                     "n_tokens": n, "n_assistant_tokens": sum(mask), "truncated": False})
    meta = {"template_sha256": TEMPLATE, "max_seq_len": 256, "stats": {}}
    write_parquet_atomically(pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()}), path)
    return path


def arguments(target_dir, tokens, out) -> dict:
    """What scripts/extract_hidden.py hands extract_target_shard."""
    return {"model_dir": str(target_dir), "model_cfg": MODEL_CFG, "tokens_path": str(tokens), "out_path": str(out), "model_fingerprint": "f" * 64,
            "template_sha256": TEMPLATE, "batch_tokens": 64, "dtype": "bfloat16", "progress": False}


def test_the_rerun_removes_the_temporary_a_killed_extraction_left_and_only_its_own(tmp_path, target_dir):
    tokens = token_shard(tmp_path / "tokens" / "0001.parquet", [9, 30, 4])
    out = tmp_path / "hidden" / "0001.safetensors"
    out.parent.mkdir()
    killed = out.parent / ".0001.safetensors.5e1f09ab.tmp"  # the name eyrie.core.atomic gives the file a SIGTERM interrupted
    killed.write_bytes(b"\0" * 200_000)
    others = [out.parent / ".0002.safetensors.5e1f09ab.tmp",  # another shard's job, maybe running now
              out.parent / ".0001.safetensors.notes.tmp", out.parent / "0001.safetensors.5e1f09ab.tmp"]  # not atomic's names
    for path in others:
        path.write_bytes(b"x")
    manifest = extract_target_shard(**arguments(target_dir, tokens, out))
    assert not killed.exists()
    assert all(path.read_bytes() == b"x" for path in others)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, *(p.name for p in others)])  # no temporary of its own left either
    assert check_cache(out) and read_manifest(out)["tokens"] == manifest["tokens"] == 43


def test_on_a_tight_disk_the_rerun_of_the_job_script_clears_a_killed_runs_full_size_temporary_before_its_room_check(tmp_path, target_dir, monkeypatch):
    lengths = [9, 30, 4]
    out = tmp_path / "hidden" / "0001.safetensors"
    out.parent.mkdir()
    estimate = shard_bytes(64, "bfloat16", len(lengths), sum(lengths))  # what the script's early check asks for
    killed = out.parent / ".0001.safetensors.5e1f09ab.tmp"
    killed.write_bytes(b"\0" * estimate)  # a run killed at its last batch: the file at full size

    # A disk with room for one shard and the margin, less whatever lies in hidden/: the killed file alone leaves too little.
    capacity = MARGIN_BYTES + estimate + estimate // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        capacity, 0, capacity - sum(p.stat().st_size for p in out.parent.iterdir())))
    # Tokenizing is not under test: the token shard is written as tokenize_shard would, with no tokenizer.
    monkeypatch.setattr(target_model, "load_tokenizer", lambda *args: None)
    monkeypatch.setattr(target_model, "template_fingerprint", lambda tokenizer: TEMPLATE)
    monkeypatch.setattr(tokenize_module, "tokenize_shard", lambda *, out_path, **kw: token_shard(out_path, lengths))

    import torch

    snakemake = SimpleNamespace(
        log=[str(tmp_path / "logs" / "0001.log")], threads=torch.get_num_threads(), config={"hidden": {"tensor_parallel": 1}},
        input=SimpleNamespace(model=str(target_dir), completions=str(tmp_path / "completions.parquet")),
        output=SimpleNamespace(tokens=str(tmp_path / "tokens" / "0001.parquet"), hidden=str(out)),
        params=SimpleNamespace(model=MODEL_CFG, max_seq_len=256, aux_layer_ids=None, hidden={"batch_tokens": 64, "dtype": "bfloat16"}),
    )
    runpy.run_path(str(SCRIPT), init_globals={"snakemake": snakemake})
    assert not killed.exists() and [p.name for p in out.parent.iterdir()] == [out.name]
    assert check_cache(out) and read_manifest(out)["tokens"] == sum(lengths)


def test_stale_temporaries_are_matched_by_the_output_name_exactly(tmp_path):
    names = [".0001.safetensors.0123abcd.tmp", ".0001.safetensors.0123abcd.tmp.tmp", ".10001.safetensors.0123abcd.tmp", ".0001.safetensors.0123ABCD.tmp",
             ".0001.safetensors.0123abc.tmp", ".0001.safetensors.0123abcd.old", ".0001Xsafetensors.0123abcd.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path / "0001.safetensors") == [tmp_path / names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    assert remove_stale_temporaries(tmp_path / "absent" / "0001.safetensors") == []


@pytest.mark.parametrize("lengths", [[], [0, 0]], ids=["no samples", "empty samples"])
def test_a_shard_without_tokens_is_written_without_loading_the_target(tmp_path, target_dir, monkeypatch, lengths):
    """The file is the one extraction with the loaded target writes (byte for byte), and the cache's readers take it."""
    tokens = token_shard(tmp_path / "tokens.parquet", lengths)
    with_target = tmp_path / "with-target.safetensors"
    extract_shard(model=load_model(target_dir, **MODEL_CFG), aux_layer_ids=[1, 3, 4],
                  **{k: v for k, v in arguments(target_dir, tokens, with_target).items() if k not in ("model_dir", "model_cfg")})

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded for a shard without tokens")

    monkeypatch.setattr(extract_module, "load_model", refuse)
    out = tmp_path / "hidden.safetensors"
    manifest = extract_target_shard(**arguments(target_dir, tokens, out))
    assert manifest["samples"] == len(lengths) and manifest["tokens"] == 0 and manifest["compute_dtype"] == "float32"
    assert manifest["aux_layer_ids"] == [1, 3, 4]  # the target's default, read from its config
    assert out.read_bytes() == with_target.read_bytes()
    assert check_cache(out)  # its digest holds
    tensors, _ = load_hidden(out)  # what training reads: the shapes the manifest states
    assert tuple(tensors["aux_hidden"].shape) == (0, 3 * 64) and tensors["offsets"].tolist() == [0] * (len(lengths) + 1)


def test_a_shard_with_tokens_still_loads_the_target(tmp_path, target_dir, monkeypatch):
    tokens = token_shard(tmp_path / "tokens.parquet", [0, 5])
    loads = []
    monkeypatch.setattr(extract_module, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    manifest = extract_target_shard(**arguments(target_dir, tokens, tmp_path / "hidden.safetensors"))
    assert len(loads) == 1 and manifest["tokens"] == 5
