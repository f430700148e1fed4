"""The one reader of each kind of metadata eyrie stores inside its artifacts, and of the artifacts themselves.

Parquet shards (completions, tokens) carry a JSON object under the schema key ``eyrie``;
safetensors artifacts (hidden caches, the draft vocabulary) carry a JSON manifest under the
header key ``manifest``. Every error names the file.

The whole-artifact readers (read_parquet, load_safetensors, read_json, and check for readers that
open a file themselves) check the content digest first (eyrie.core.digest) and turn every library
error (ArrowInvalid, SafetensorError, JSONDecodeError, a file cut short) into an ArtifactError that
names the file, the job that wrote it and the command that rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.core.digest import verify
from eyrie.core.errors import ArtifactError

PARQUET_KEY = b"eyrie"
MANIFEST_KEY = "manifest"


def rebuild_hint(written_by: str, target: str | Path) -> str:
    """Who wrote an artifact and the commands that rebuild it (then everything downstream of it), for error messages.

    target: the Snakemake output holding the file (the file itself, or a directory output such as results/drafter).
    """
    return (
        f"written by the {written_by} job; rebuild it (in the workflow's directory): "
        f"snakemake --cores all --force {target} && snakemake --cores all report.html"
    )


def _named(exc: ArtifactError, written_by: str | None, target) -> ArtifactError:
    """exc with the writer and the rebuild command added, same class."""
    if written_by is None:
        return exc
    return type(exc)(f"{exc}; {rebuild_hint(written_by, target)}")


def check(path: str | Path, kind: str | None = None, *, written_by: str | None = None, rebuild: str | Path | None = None) -> str | None:
    """Check a file against its recorded digest before reading it some other way (lazily, by slices): the digest, or None
    when it records none. Errors name the file, the job that wrote it (written_by) and how to rebuild it (rebuild:
    the Snakemake output holding it, the file itself by default)."""
    try:
        return verify(path, kind)
    except ArtifactError as exc:
        raise _named(exc, written_by, rebuild or path) from None


def _read_bytes(path: str | Path, written_by: str | None, rebuild) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _named(ArtifactError(f"{path}: cannot be read ({exc.strerror or exc})"), written_by, rebuild or path) from None


def read_parquet(path: str | Path, columns: list[str] | None = None, *, written_by: str | None = None, rebuild: str | Path | None = None):
    """The table of a Parquet artifact (only `columns` when given), its digest checked first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = _read_bytes(path, written_by, rebuild)
    try:
        verify(path, "parquet", data)
        return pq.read_table(pa.BufferReader(data), columns=columns)
    except ArtifactError as exc:
        raise _named(exc, written_by, rebuild or path) from None
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _named(ArtifactError(f"{path}: not a readable Parquet file ({exc})"), written_by, rebuild or path) from None


def load_safetensors(path: str | Path, *, written_by: str | None = None, rebuild: str | Path | None = None) -> dict:
    """Every tensor of a safetensors artifact (torch), its digest checked first."""
    from safetensors.torch import load_file

    check(path, "safetensors", written_by=written_by, rebuild=rebuild)
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise _named(ArtifactError(f"{path}: not a readable safetensors file ({exc})"), written_by, rebuild or path) from None


def read_json(path: str | Path, *, written_by: str | None = None, rebuild: str | Path | None = None):
    """The value of a JSON artifact, its digest checked first (a JSON object records one)."""
    data = _read_bytes(path, written_by, rebuild)
    try:
        verify(path, "json", data)
        return json.loads(data)
    except ArtifactError as exc:
        raise _named(exc, written_by, rebuild or path) from None
    except (ValueError, UnicodeDecodeError) as exc:  # verify() parsed it already; kept for safety
        raise _named(ArtifactError(f"{path}: not readable JSON ({exc})"), written_by, rebuild or path) from None


def parquet_metadata(schema_metadata: dict | None, path: str | Path) -> dict:
    """The ``eyrie`` object of an already-read Parquet schema's metadata; {} when the shard has none."""
    raw = (schema_metadata or {}).get(PARQUET_KEY)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise ArtifactError(f"{path}: its eyrie metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{path}: its eyrie metadata is {type(meta).__name__}, not an object")
    return meta


def read_parquet_metadata(path: str | Path, *, written_by: str | None = None, rebuild: str | Path | None = None) -> dict:
    """The ``eyrie`` object of a Parquet file, from its footer alone (no row is read, the digest is not checked)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise _named(ArtifactError(f"{path}: not a readable Parquet file ({exc})"), written_by, rebuild or path) from None
    return parquet_metadata(schema.metadata, path)


def read_safetensors_manifest(path: str | Path, what: str = "eyrie artifact", *, written_by: str | None = None,
                              rebuild: str | Path | None = None) -> dict:
    """The JSON manifest in a safetensors header (no tensor is read, the digest is not checked); `what` names the artifact in errors."""
    try:
        return _safetensors_manifest(path, what)
    except ArtifactError as exc:
        raise _named(exc, written_by, rebuild or path) from None


def _safetensors_manifest(path: str | Path, what: str) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for unreadable headers
        raise ArtifactError(f"{path}: not a readable safetensors file ({exc})") from None
    if MANIFEST_KEY not in metadata:
        raise ArtifactError(f"{path}: not an {what} (no manifest in its metadata)")
    try:
        manifest = json.loads(metadata[MANIFEST_KEY])
    except ValueError as exc:
        raise ArtifactError(f"{path}: its manifest is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: its manifest is {type(manifest).__name__}, not an object")
    return manifest
