"""core.digest: one rule for every format (the file's bytes, its own digest field read as a placeholder), written in
place before the rename, deterministic, and covering the metadata as much as the data."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eyrie.core.artifacts import ArtifactError, check, load_safetensors, read_json, read_parquet
from eyrie.core.atomic import write_json_atomically, write_parquet_atomically, write_safetensors_atomically
from eyrie.core.digest import DIGEST_KEY, DigestMismatchError, file_digest, verify, verify_artifact


def test_json_digest_reads_back_and_the_value_gains_it(tmp_path):
    value = {"benchmark": "local", "speedup": 1.25, "note": "café"}
    write_json_atomically(tmp_path / "a.json", value)
    assert value[DIGEST_KEY] == verify(tmp_path / "a.json") == read_json(tmp_path / "a.json")[DIGEST_KEY]
    write_json_atomically(tmp_path / "b.json", value)  # written again, with its old digest in it: the same bytes
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    write_json_atomically(tmp_path / "list.json", [1, 2])  # a list has no room for the field
    assert verify(tmp_path / "list.json") is None


def test_parquet_digest_lives_in_the_footer_beside_the_schema_metadata(tmp_path):
    table = pa.table({"id": ["a", "b"], "n": [1, 2]}).replace_schema_metadata({b"eyrie": b'{"shard": "0000"}'})
    write_parquet_atomically(table, tmp_path / "x.parquet")
    digest = verify(tmp_path / "x.parquet")
    assert pq.read_metadata(tmp_path / "x.parquet").metadata[DIGEST_KEY.encode()].decode() == digest
    assert pq.read_schema(tmp_path / "x.parquet").metadata == {b"eyrie": b'{"shard": "0000"}'}  # readers see the table as written
    assert read_parquet(tmp_path / "x.parquet").to_pylist() == table.to_pylist()
    write_parquet_atomically(table, tmp_path / "y.parquet")
    assert (tmp_path / "x.parquet").read_bytes() == (tmp_path / "y.parquet").read_bytes()


def test_safetensors_with_several_metadata_keys_are_written_byte_for_byte_the_same(tmp_path):
    """safetensors orders metadata by a hash map, differently each save: the header is rewritten sorted before hashing."""
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "i": torch.arange(3)}
    written = set()
    for k in range(8):
        write_safetensors_atomically(tensors, tmp_path / f"{k}.safetensors", {"format": "pt", "manifest": json.dumps({"a": "é\"q"})})
        written.add((tmp_path / f"{k}.safetensors").read_bytes())
    assert len(written) == 1
    assert verify(tmp_path / "0.safetensors").startswith("sha256:")
    assert torch.equal(load_safetensors(tmp_path / "0.safetensors")["w"], tensors["w"])


@pytest.mark.parametrize("kind", ["json", "parquet", "safetensors"])
def test_any_changed_byte_is_a_mismatch_naming_the_file_writer_and_rebuild(tmp_path, kind):
    path = tmp_path / f"artifact.{kind}"
    if kind == "json":
        write_json_atomically(path, {"values": list(range(50))})
    elif kind == "parquet":
        write_parquet_atomically(pa.table({"n": list(range(1000))}), path)
    else:
        write_safetensors_atomically({"w": torch.arange(1000.0)}, path)
    original = path.read_bytes()
    for at in (len(original) // 2, len(original) - 20):  # the data, and the footer or the last key
        damaged = bytearray(original)
        damaged[at] = ord("7") if damaged[at] != ord("7") else ord("8")
        path.write_bytes(bytes(damaged))
        with pytest.raises(ArtifactError, match=rf"{path}: .*written by the some_rule job; .*snakemake --cores all --force {path} && snakemake --cores all report.html"):
            check(path, written_by="some_rule")
    path.write_bytes(original)
    assert check(path, written_by="some_rule") == verify(path)


def test_a_malformed_recorded_digest_is_a_mismatch(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"x": 1, DIGEST_KEY: "sha256:nothex"}))
    with pytest.raises(DigestMismatchError, match="malformed"):
        verify(path)


def test_verify_artifact_checks_a_directory_output_and_its_recorded_files(tmp_path):
    directory = tmp_path / "drafter"
    directory.mkdir()
    (directory / "training_log.json").write_text("[]")
    write_safetensors_atomically({"w": torch.ones(2)}, directory / "model.safetensors")
    write_json_atomically(directory / "config.json", {"eyrie": {"files": {"training_log.json": file_digest(directory / "training_log.json")}}})
    assert verify_artifact(directory, require_digest=True) is None
    (directory / "training_log.json").write_text("[{}]")
    assert "training_log.json: its content does not match the digest" in verify_artifact(directory)


def test_the_tree_digest_is_its_blocks_digests_hashed_with_the_length_whatever_the_cores(monkeypatch):
    """xxh3-128-tree, as the module states it: xxh3-128 over each block's xxh3-128 digest, then the length (8 bytes,
    little-endian), the placeholder in place; a field that straddles two blocks is patched into both."""
    import struct

    import xxhash

    from eyrie.core import digest as core_digest

    monkeypatch.setattr(core_digest, "TREE_BLOCK", 64)
    data = bytes(range(256)) * 3 + b"tail"  # 13 blocks, the last one short
    hole = core_digest.placeholder(core_digest.XXH3_128_TREE).encode()
    at = 64 * 5 - 7  # the field runs from block 4 into block 5
    patched = data[:at] + hole + data[at + len(hole) :]
    blocks = [xxhash.xxh3_128(patched[i : i + 64]).digest() for i in range(0, len(patched), 64)]
    expected = "xxh3-128-tree:" + xxhash.xxh3_128(b"".join(blocks) + struct.pack("<Q", len(data))).hexdigest()
    for cores in (1, 2, 16):
        monkeypatch.setattr(core_digest.os, "cpu_count", lambda cores=cores: cores)
        assert core_digest._hash(data, core_digest.XXH3_128_TREE, at) == expected
    assert core_digest._hash(data, core_digest.XXH3_128, at) != expected  # a different algorithm, not a renamed one


def test_a_tree_sealed_safetensors_file_catches_a_change_in_any_block_and_plain_xxh3_files_still_check(tmp_path, monkeypatch):
    from eyrie.core import digest as core_digest

    monkeypatch.setattr(core_digest, "TREE_BLOCK", 256)
    for algorithm in (core_digest.XXH3_128_TREE, core_digest.XXH3_128):
        path = tmp_path / f"{algorithm}.safetensors"
        write_safetensors_atomically({"w": torch.arange(2000.0)}, path, digest=algorithm)
        assert verify(path).startswith(f"{algorithm}:")
        original = path.read_bytes()
        for at in range(100, len(original), 997):  # a byte in most blocks, the header's included
            damaged = bytearray(original)
            damaged[at] ^= 0x01
            path.write_bytes(bytes(damaged))
            with pytest.raises(ArtifactError, match=str(path)):
                check(path, written_by="some_rule")
        path.write_bytes(original)
        assert check(path, written_by="some_rule") == verify(path)
