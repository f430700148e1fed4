"""Content digests: every artifact records one when it is written, and the stage that reads it checks it.

One rule for every format: an artifact's digest is the hash of its own bytes, read with the digest's
own field holding its placeholder (the algorithm's name and zeros). The writers (eyrie.core.atomic,
and eyrie.hidden.cache's streaming writer) write the file with the placeholder, hash it and overwrite
the placeholder in place before the file is renamed into place; a check puts the placeholder back and
hashes again. So a digest covers every byte, the header or footer metadata included, and lives inside
the artifact it guards: no sidecar to lose or to go stale.

Where the field lives, a string ``"<algorithm>:<hex>"`` under DIGEST_KEY:

    safetensors   the header's __metadata__ (hidden-state caches, the draft vocabulary, drafter weights)
    Parquet       the footer's key-value metadata, beside ARROW:schema (prompts, completions, tokens)
    JSON object   a top-level key (the drafter's config.json, benchmark results, prompt summaries)

The drafter's training_log.json is a JSON list, with no room for a field: config.json records its
digest under ``eyrie.files`` instead (FILES_KEY).

Algorithms: sha256 by default; xxh3-128-tree for the hidden-state cache and the training state. A cache
shard is tens of GB at 8B-target widths, extraction seals each one after its last forward, and training
checks every shard before its first step: sha256 hashes 1.9 GB/s on one core of the 2-core CI machine,
xxh3-128 10 GB/s. xxh3-128-tree is xxh3-128 of the file's 64 MiB blocks' xxh3-128 digests (and its
length), so the blocks hash on every core at once: 1.6x on the 2-core machine, more where there are
more cores, so that sealing after the last forward costs a fraction of a second and a check costs
about one read of the file. The digest sits in the file it guards, so it catches
accidents (bit rot, a copy cut short, an overwritten range) and never a forger, who would rewrite
both: a cryptographic hash buys nothing there, and 128 bits make an accidental match impossible in
practice. xxhash comes with `datasets`, one of eyrie's dependencies. Files sealed with plain xxh3-128
(whole-file, one core) are still checked by it.

A file without the field (written before eyrie recorded digests, or by another tool) is unverified:
the stages read it as before, and `verify_artifact(path, require_digest=True)` reports it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eyrie.core.errors import ArtifactError

DIGEST_KEY = "eyrie_digest"
FILES_KEY = "files"  # under a JSON object's "eyrie" block: {file name: digest} of sibling files without a field of their own
SHA256, XXH3_128, XXH3_128_TREE = "sha256", "xxh3-128", "xxh3-128-tree"
_HEX_DIGITS = {SHA256: 64, XXH3_128: 32, XXH3_128_TREE: 32}
TREE_BLOCK = 64 << 20  # xxh3-128-tree's block: big enough that a block's own hashing dwarfs handing it to a thread
KINDS = ("safetensors", "parquet", "json")


class DigestMismatchError(ArtifactError):
    """The file's bytes are not those its writer hashed: changed, cut short or damaged since."""


class _Problem(Exception):
    """What is wrong with a file, without its name: the public functions add it."""

    def __init__(self, problem: str, mismatch: bool = False):
        super().__init__(problem)
        self.mismatch = mismatch


def placeholder(algorithm: str = SHA256) -> str:
    """The field's value while a file is being hashed: the algorithm's name and zeros, as long as the digest."""
    if algorithm not in _HEX_DIGITS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(_HEX_DIGITS)}")
    return f"{algorithm}:" + "0" * _HEX_DIGITS[algorithm]


def kind_of(path: str | Path) -> str | None:
    """The artifact kind of a file by its suffix ('safetensors', 'parquet', 'json'), or None."""
    suffix = Path(path).suffix.lstrip(".")
    return suffix if suffix in KINDS else None


# --------------------------------------------------------------------------- hashing


def _hasher(algorithm: str):
    if algorithm == SHA256:
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def _algorithm_of(value: str) -> str:
    algorithm, _, hexdigits = value.partition(":")
    if algorithm not in _HEX_DIGITS or len(hexdigits) != _HEX_DIGITS[algorithm] or hexdigits.strip("0123456789abcdef"):
        raise _Problem(f"its recorded digest {value[:80]!r} is malformed", mismatch=True)
    return algorithm


def _hash(source: str | Path | bytes, algorithm: str, at: int | None = None) -> str:
    """``"<algorithm>:<hex>"`` of a file's bytes (or bytes in memory), read with the placeholder at offset `at`."""
    if not isinstance(source, (bytes, bytearray, memoryview)):
        # Mapped rather than read into a buffer: one copy fewer, 1.4-1.7x the hash rate of a cached multi-GB cache
        # shard (6.4-7.0 against 4.0-4.4 GB/s on the 2-core machine, 2 GB in /dev/shm), which sealing and every check pay once.
        with open(source, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:  # mmap refuses an empty file
                return _hash(b"", algorithm, at)
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _hash(memoryview(mapped), algorithm, at)
    hole, view = placeholder(algorithm).encode(), memoryview(source)
    if algorithm == XXH3_128_TREE:
        return f"{algorithm}:{_tree_hex(view, at, hole)}"
    hasher = _hasher(algorithm)
    if at is None:
        hasher.update(view)
    else:
        hasher.update(view[:at])
        hasher.update(hole)
        hasher.update(view[at + len(hole) :])
    return f"{algorithm}:{hasher.hexdigest()}"


def _tree_hex(view: memoryview, at: int | None, hole: bytes) -> str:
    """xxh3-128-tree of view (the placeholder `hole` in place at offset `at`): xxh3-128 over each TREE_BLOCK's xxh3-128
    digest, then the length; the blocks hash on a thread each (xxhash lets go of the GIL while hashing), up to one per
    core, 8 at most."""
    import xxhash

    def block(begin: int) -> bytes:
        end = min(begin + TREE_BLOCK, len(view))
        if at is None or at >= end or at + len(hole) <= begin:
            return xxhash.xxh3_128(view[begin:end]).digest()
        patched = bytearray(view[begin:end])  # the block holding (part of) the field: hashed with the placeholder
        lo, hi = max(at, begin), min(at + len(hole), end)
        patched[lo - begin : hi - begin] = hole[lo - at : hi - at]
        return xxhash.xxh3_128(patched).digest()

    begins = range(0, max(len(view), 1), TREE_BLOCK)
    workers = min(8, os.cpu_count() or 1, len(begins))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="eyrie-digest") as pool:
            parts = list(pool.map(block, begins))
    else:
        parts = [block(begin) for begin in begins]
    return xxhash.xxh3_128(b"".join(parts) + struct.pack("<Q", len(view))).hexdigest()


def file_digest(path: str | Path, algorithm: str = SHA256) -> str:
    """The plain digest of a whole file, for files with no field of their own (training_log.json, legacy caches)."""
    return _hash(path, algorithm)


# --------------------------------------------------------------------------- where each format keeps the field


class _Source:
    """Random access to a file on disk, or to its bytes already in memory."""

    def __init__(self, path: str | Path, data: bytes | None = None):
        self.path, self.data = path, data
        self.size = len(data) if data is not None else os.path.getsize(path)

    def read(self, offset: int, count: int) -> bytes:
        if self.data is not None:
            return bytes(self.data[offset : offset + count])
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            return handle.read(count)

    def hashable(self):
        return self.data if self.data is not None else self.path


def _safetensors_region(source: _Source) -> tuple[int, bytes, dict]:
    """(offset of the header, its bytes, the header parsed), after checking the file holds exactly the data it describes."""
    if source.size < 8:
        raise _Problem(f"not a readable safetensors file ({source.size} bytes: cut short)")
    (length,) = struct.unpack("<Q", source.read(0, 8))
    if length > source.size - 8:
        raise _Problem(f"not a readable safetensors file (its header claims {length} bytes, the file has {source.size}: cut short or not safetensors)")
    raw = source.read(8, length)
    try:
        header = json.loads(raw)
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise _Problem(f"not a readable safetensors file (its header is not a safetensors header: {exc})") from None
    described = 8 + length + max(ends, default=0)
    if described != source.size:
        state = "cut short" if source.size < described else "longer than its header says"
        raise _Problem(f"not a readable safetensors file ({source.size} bytes, its header describes {described}: {state})")
    return 8, raw, header


def _safetensors_field(source: _Source) -> tuple[str | None, int, bytes]:
    start, raw, header = _safetensors_region(source)
    metadata = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
    return metadata.get(DIGEST_KEY), start, raw


def _parquet_region(source: _Source) -> tuple[int, bytes]:
    """(offset of the footer, its bytes)."""
    if source.size < 12 or source.read(0, 4) != b"PAR1" or source.read(source.size - 4, 4) != b"PAR1":
        raise _Problem(f"not a readable Parquet file ({source.size} bytes without the PAR1 marks at both ends: cut short or not Parquet)")
    (length,) = struct.unpack("<I", source.read(source.size - 8, 4))
    if length > source.size - 12:
        raise _Problem(f"not a readable Parquet file (its footer claims {length} bytes, the file has {source.size})")
    start = source.size - 8 - length
    return start, source.read(start, length)


def _parquet_field(source: _Source) -> tuple[str | None, int, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    start, footer = _parquet_region(source)
    try:  # the footer's own key-value metadata: Arrow's schema metadata is another copy (ARROW:schema), without the digest
        metadata = pq.read_metadata(pa.BufferReader(source.data) if source.data is not None else str(source.path)).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        raise _Problem(f"not a readable Parquet file ({exc})") from None
    value = metadata.get(DIGEST_KEY.encode())
    return (value.decode("ascii", "replace") if value is not None else None), start, footer


def _json_field(source: _Source) -> tuple[str | None, int, bytes]:
    raw = source.read(0, source.size)
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Problem(f"not readable JSON ({exc})") from None
    recorded = value.get(DIGEST_KEY) if isinstance(value, dict) else None
    return (str(recorded) if recorded is not None else None), 0, raw


_FIELDS = {"safetensors": _safetensors_field, "parquet": _parquet_field, "json": _json_field}


def _check(source: _Source, kind: str) -> str | None:
    """The recorded digest after checking the bytes against it; None when the file records none."""
    if kind not in _FIELDS:
        raise ValueError(f"unknown artifact kind {kind!r}; known: {', '.join(KINDS)}")
    recorded, start, region = _FIELDS[kind](source)
    if recorded is None:
        return None
    algorithm = _algorithm_of(recorded)
    at = region.rfind(recorded.encode())
    if at < 0:  # the parsed value is not in the raw bytes: only escapes could do that, and digests have none
        raise _Problem(f"its recorded digest {recorded!r} could not be located in the file", mismatch=True)
    found = _hash(source.hashable(), algorithm, start + at)
    if found != recorded:
        raise _Problem(
            f"its content does not match the digest recorded when it was written ({recorded[:24]}... recorded, {found[:24]}... now): "
            "it changed, was cut short or was damaged since",
            mismatch=True,
        )
    return recorded


# --------------------------------------------------------------------------- writing and checking


def seal(path: str | Path, kind: str) -> str:
    """Fill in the digest of a file just written with a placeholder in its field (before it is renamed into place); returns it."""
    source = _Source(path)
    if kind == "safetensors":
        start, region = _canonical_safetensors_header(path, *_safetensors_region(source))
    elif kind == "parquet":
        start, region = _parquet_region(source)
    else:
        raise ValueError(f"seal() takes 'safetensors' or 'parquet'; JSON is sealed in memory (json_with_digest), not {kind!r}")
    found = [(algorithm, region.find(placeholder(algorithm).encode())) for algorithm in _HEX_DIGITS]
    found = [(algorithm, at) for algorithm, at in found if at >= 0]
    if len(found) != 1 or region.count(placeholder(found[0][0]).encode()) != 1:
        raise ValueError(f"{path}: expected exactly one digest placeholder in its {kind} metadata, found {len(found)}")
    algorithm, at = found[0]
    digest = _hash(path, algorithm)  # the placeholder is in place: the plain hash is the digest
    with open(path, "r+b") as handle:
        handle.seek(start + at)
        handle.write(digest.encode())
    return digest


def _canonical_safetensors_header(path, start: int, raw: bytes, header: dict) -> tuple[int, bytes]:
    """Rewrite the header with its __metadata__ keys sorted, in place; (its offset, its new bytes).

    safetensors writes the metadata from a Rust HashMap, in a different order from one save to the next:
    with two keys or more the same tensors would give other bytes, and another digest, every time.
    """
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or len(metadata) < 2:
        return start, raw
    canonical = {"__metadata__": dict(sorted(metadata.items())), **{k: v for k, v in header.items() if k != "__metadata__"}}
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > len(raw) or raw[len(text) :].strip(b" "):  # the same entries take the same bytes; the rest is padding
        raise ValueError(f"{path}: its safetensors header could not be rewritten in sorted order")
    text += b" " * (len(raw) - len(text))
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(text)
    return start, text


def json_with_digest(value: dict, indent: int | None = 2, algorithm: str = SHA256) -> str:
    """The JSON text of `value` with its digest under DIGEST_KEY; `value` gains the same key and digest."""
    hole = placeholder(algorithm)
    value[DIGEST_KEY] = hole
    data = (json.dumps(value, indent=indent, ensure_ascii=False) + "\n").encode()
    mark = json.dumps(hole).encode()
    if data.count(mark) != 1:
        raise ValueError(f"the JSON value holds the digest placeholder {hole!r} elsewhere too")
    value[DIGEST_KEY] = digest = _hash(data, algorithm)
    at = data.index(mark)
    return (data[:at] + json.dumps(digest).encode() + data[at + len(mark) :]).decode()


def verify(path: str | Path, kind: str | None = None, data: bytes | None = None) -> str | None:
    """Check a file (or its bytes, `data`, already read) against the digest it records.

    Returns the recorded digest, or None for a file that records none. Raises DigestMismatchError
    when the bytes differ from what was hashed, ArtifactError when the file cannot be read as its
    kind (both naming the file). kind: 'safetensors', 'parquet' or 'json'; by the suffix when None.
    """
    kind = kind or kind_of(path)
    try:
        return _check(_Source(path, data), kind)
    except _Problem as exc:
        raise (DigestMismatchError if exc.mismatch else ArtifactError)(f"{path}: {exc}") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def recorded_files(config: dict) -> dict[str, str]:
    """{file name: digest} a JSON object records for its sibling files (config.json's eyrie.files)."""
    own = config.get("eyrie") if isinstance(config, dict) else None
    files = own.get(FILES_KEY) if isinstance(own, dict) else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def verify_recorded_files(directory: str | Path, config: dict) -> None:
    """Check each sibling file config.json records a digest of (eyrie.files) against it; raises like verify()."""
    for name, recorded in recorded_files(config).items():
        path = Path(directory) / name
        try:
            found = _hash(path, _algorithm_of(recorded))
        except _Problem as exc:
            raise DigestMismatchError(f"{path}: {exc}") from None
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        if found != recorded:
            raise DigestMismatchError(
                f"{path}: its content does not match the digest {Path(directory) / 'config.json'} recorded for it "
                f"({recorded[:24]}... recorded, {found[:24]}... now): it changed, was cut short or was damaged since"
            )


def verify_artifact(path: str | Path, require_digest: bool = False) -> str | None:
    """What is wrong with one artifact, as one line naming the file, or None when nothing is: for `eyrie verify`.

    path: a .safetensors, .parquet or .json file, or a directory output (the drafter, its speculators
    export), whose every such file is checked, and the files its config.json records digests of
    (training_log.json). A file is wrong when it cannot be read as its kind or its bytes differ from
    its recorded digest; with require_digest, also when it records no digest (written before eyrie
    recorded them: rebuilding it records one). Files of other kinds, and JSON lists, are not checked.
    The whole file is read: seconds per GB of sha256 (Parquet, JSON, vocabulary, drafter), about one
    disk read for a hidden-state cache (xxh3-128).
    """
    path = Path(path)
    if not path.exists():
        return f"{path}: missing"
    if path.is_dir():
        problems = [problem for child in sorted(path.iterdir()) if kind_of(child) and (problem := verify_artifact(child, require_digest))]
        config = path / "config.json"
        if not problems and config.is_file():
            try:
                verify_recorded_files(path, json.loads(config.read_bytes()))
            except ArtifactError as exc:
                problems.append(str(exc))
        return "; ".join(problems) or None
    kind = kind_of(path)
    if kind is None:
        return None
    try:
        recorded = verify(path, kind)
    except ArtifactError as exc:
        return str(exc)
    if recorded is None and require_digest and not (kind == "json" and not _is_json_object(path)):
        return f"{path}: records no content digest (written before eyrie recorded them, or by another tool); rebuild it to record one"
    return None


def _is_json_object(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (OSError, ValueError):
        return False
