"""Write-then-rename: readers, and a job killed mid-write, see the old file or the new one, never half of one.

Every file and directory eyrie produces goes through `write_atomically` or `write_directory_atomically`;
each caller passes its own writer. The Parquet, safetensors and JSON writers record the file's content
digest in it (eyrie.core.digest) before the rename, so a file in place always carries its digest.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from eyrie.core.digest import DIGEST_KEY, SHA256, json_with_digest, placeholder, seal

READABLE = 0o644  # artifacts are read by other users too (a server running under its own account)


def _temporary_beside(path: Path, suffix: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.{suffix}"


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call write(temporary) for a temporary path beside `path`, make it durable, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_beside(path, "tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_directory_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call write(temporary_dir) for a fresh directory beside `path`, then swap it in for the old one.

    The old directory is renamed aside before the new one takes its name, so at every moment `path`
    is either the whole old directory or the whole new one (or, between two renames, absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, old = _temporary_beside(path, "tmp"), _temporary_beside(path, "old")
    temporary.mkdir()
    try:
        write(temporary)
        for written in temporary.rglob("*"):
            if written.is_file() and not written.is_symlink():
                os.chmod(written, READABLE)  # safetensors' save_file creates 0600 (a converted model's weights too)
        if path.exists():
            os.replace(path, old)
        os.replace(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomically(path: str | Path, value, indent: int | None = 2) -> None:
    """A JSON object records its digest under eyrie_digest, and `value` gains the same key (what was written
    reads back equal to it); a list is written as it is."""
    text = json_with_digest(value, indent) if isinstance(value, dict) else json.dumps(value, indent=indent, ensure_ascii=False) + "\n"
    write_text_atomically(path, text)


def write_parquet_atomically(table, path: str | Path, digest: str = SHA256) -> None:
    """The table, with its digest in the footer's key-value metadata (the table's schema metadata is kept as is)."""
    import pyarrow.parquet as pq

    def write(temporary: Path) -> None:
        with pq.ParquetWriter(str(temporary), table.schema) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata({DIGEST_KEY: placeholder(digest)})
        seal(temporary, "parquet")

    write_atomically(path, write)


def write_safetensors_atomically(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None, digest: str = SHA256) -> None:
    """safetensors written straight to disk (no second copy in memory), readable by others, its digest in the header."""
    from safetensors.torch import save_file

    def write(temporary: Path) -> None:
        save_file(tensors, str(temporary), metadata={**(metadata or {}), DIGEST_KEY: placeholder(digest)})
        seal(temporary, "safetensors")
        os.chmod(temporary, READABLE)  # save_file creates 0600

    write_atomically(path, write)
