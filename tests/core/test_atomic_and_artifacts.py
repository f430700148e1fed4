"""core: every artifact is written whole or not at all, and every metadata read names the file it failed on."""

from __future__ import annotations

import json
import stat

import pyarrow as pa
import pytest
import torch

from eyrie.core.artifacts import ArtifactError, read_parquet_metadata, read_safetensors_manifest
from eyrie.core.atomic import (
    write_atomically,
    write_directory_atomically,
    write_json_atomically,
    write_parquet_atomically,
    write_safetensors_atomically,
)


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    write_json_atomically(path, {"v": 1})

    def crash(temporary):
        temporary.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomically(path, crash)
    assert json.loads(path.read_text())["v"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_directory_is_swapped_whole_and_a_failed_write_keeps_the_old_one(tmp_path):
    out = tmp_path / "drafter"
    write_directory_atomically(out, lambda d: (d / "a.txt").write_text("old"))
    write_directory_atomically(out, lambda d: (d / "b.txt").write_text("new"))
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]  # nothing of the old directory survives

    def crash(d):
        (d / "c.txt").write_text("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_directory_atomically(out, crash)
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_safetensors_are_readable_by_others_and_carry_their_manifest(tmp_path):
    path = tmp_path / "vocab.safetensors"
    write_safetensors_atomically({"x": torch.arange(3)}, path, {"manifest": json.dumps({"format": "t"})})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a server under another account must read it
    assert read_safetensors_manifest(path) == {"format": "t"}


def test_a_directory_written_by_a_library_is_readable_by_others(tmp_path):
    """save_pretrained writes weights through safetensors' save_file, which creates 0600: a converted target under
    resources/models must still be readable by a server running under another account."""
    from safetensors.torch import save_file

    def save(d):
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        (d / "sub").mkdir()
        (d / "sub" / "config.json").write_text("{}")
        (d / "sub" / "config.json").chmod(0o600)

    write_directory_atomically(tmp_path / "model", save)
    for name in ("model.safetensors", "sub/config.json"):
        assert stat.S_IMODE((tmp_path / "model" / name).stat().st_mode) == 0o644, name


def test_manifest_reader_names_the_file_for_garbage_and_for_a_foreign_file(tmp_path):
    garbage = tmp_path / "cut.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ArtifactError, match=r"cut\.safetensors: not a readable safetensors file"):
        read_safetensors_manifest(garbage)
    foreign = tmp_path / "foreign.safetensors"
    write_safetensors_atomically({"x": torch.zeros(1)}, foreign)
    with pytest.raises(ArtifactError, match=r"foreign\.safetensors: not an eyrie hidden-state cache"):
        read_safetensors_manifest(foreign, "eyrie hidden-state cache")


def test_parquet_metadata_reader_names_a_truncated_file_and_reads_a_whole_one(tmp_path):
    path = tmp_path / "0000.parquet"
    table = pa.table({"a": [1, 2]}).replace_schema_metadata({b"eyrie": json.dumps({"shard": "0000"}).encode()})
    write_parquet_atomically(table, path)
    assert read_parquet_metadata(path) == {"shard": "0000"}
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ArtifactError, match=r"0000\.parquet: not a readable Parquet file"):
        read_parquet_metadata(path)
    bare = tmp_path / "bare.parquet"
    write_parquet_atomically(pa.table({"a": [1]}), bare)
    assert read_parquet_metadata(bare) == {}
