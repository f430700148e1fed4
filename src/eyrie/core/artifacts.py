"""The one reader of each kind of metadata eyrie stores inside its artifacts.

Parquet shards (completions, tokens) carry a JSON object under the schema key ``eyrie``;
safetensors artifacts (hidden caches, the draft vocabulary) carry a JSON manifest under the
header key ``manifest``. Every error names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.core.errors import InputFileError

PARQUET_KEY = b"eyrie"
MANIFEST_KEY = "manifest"


class ArtifactError(InputFileError):
    """An artifact cannot be read, or carries no (or broken) eyrie metadata."""


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


def read_parquet_metadata(path: str | Path) -> dict:
    """The ``eyrie`` object of a Parquet file, from its footer alone (no row is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: not a readable Parquet file ({exc})") from None
    return parquet_metadata(schema.metadata, path)


def read_safetensors_manifest(path: str | Path, what: str = "eyrie artifact") -> dict:
    """The JSON manifest in a safetensors header (no tensor is read); `what` names the artifact in errors."""
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
