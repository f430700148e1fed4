"""Read raw records from a dataset source, tolerating the damage real files carry.

A reader yields `RawRecord`s: either decoded data or a `BadRecord` explaining why
that one record could not be decoded; it never stops the whole file for one bad
record. Bytes are decoded with errors="surrogateescape", so invalid UTF-8 survives
as lone surrogates U+DC80..U+DCFF and is reported later, per field, by the
normaliser (eyrie.data.normalise).

Locations: lines count from 1 (as editors show them); JSON array records and
Parquet / Hugging Face rows count from 0 (as Python indexes them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyrie.core.errors import BadRecordError, InputFileError

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH_ROWS = 1024


class BadRecord(BadRecordError):
    """A BadRecordError that also carries a short stable `kind` key, used to count problems."""

    def __init__(self, kind: str, file: str, location: str, problem: str,
                 record_id: str | None = None, field: str | None = None):
        self.kind = kind
        super().__init__(file, location, problem, record_id=record_id, field=field)


@dataclass(frozen=True)
class RawRecord:
    """One record as read: `data` is the decoded object, unless `error` says why it could not be decoded."""

    location: str
    data: Any = None
    error: BadRecord | None = None


@dataclass(frozen=True)
class Truncation:
    """Where a JSON array was cut off: the incomplete record starts here, after `records_before` records."""

    byte_offset: int
    line: int
    records_before: int

    def as_dict(self) -> dict[str, int]:
        return {"byte_offset": self.byte_offset, "line": self.line, "records_before": self.records_before}


class RecordReader(Iterator[RawRecord]):
    """Iterator of RawRecords; once exhausted, `truncation` says whether the input was cut off (else None)."""

    def __init__(self, label: str, records: Generator[RawRecord, None, Truncation | None]):
        self.label = label  # names the input in every message
        self.truncation: Truncation | None = None
        self._records = records

    def __iter__(self) -> RecordReader:
        return self

    def __next__(self) -> RawRecord:
        try:
            return next(self._records)
        except StopIteration as finished:
            # the per-format generators return their Truncation (or None) when they end
            self.truncation = finished.value
            raise


# ---------------------------------------------------------------- local files


def iter_file_records(path: str | Path) -> RecordReader:
    """Records of a local .jsonl, .json (top-level array) or .parquet file; missing or unknown files fail now."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: input file not found" + (" (it is a directory)" if path.is_dir() else ""))
    readers = {".jsonl": _jsonl_records, ".json": _json_array_records, ".parquet": _parquet_records}
    read = readers.get(path.suffix.lower())
    if read is None:
        raise InputFileError(
            f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    return RecordReader(str(path), read(path))


def _read_nonempty_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if not raw.strip():
        raise InputFileError(f"{path}: input file is empty" + (" (only whitespace)" if raw else " (0 bytes)"))
    return raw


def _malformed(file: Path, location: str, error: json.JSONDecodeError, whole_file: bool) -> RawRecord:
    # a JSON array is decoded as one text, so the error's own line number is meaningful there
    where = f"line {error.lineno}, column {error.colno}" if whole_file else f"column {error.colno}"
    problem = f"malformed JSON: {error.msg} ({where})"
    return RawRecord(location, error=BadRecord("malformed_json", str(file), location, problem))


def _jsonl_records(path: Path) -> Generator[RawRecord, None, None]:
    raw = _read_nonempty_bytes(path)
    # split the bytes on "\n" only: str.splitlines would also split on U+2028 and friends inside the text
    for line_number, line_bytes in enumerate(raw.split(b"\n"), start=1):
        line = line_bytes.decode("utf-8", errors="surrogateescape")
        if line.startswith("\ufeff"):  # a BOM on the first line is not part of the JSON
            line = line[1:]
        if not line.strip():
            continue
        location = f"line {line_number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            yield _malformed(path, location, error, whole_file=False)
            continue
        yield RawRecord(location, data)


class _TextPosition:
    """Tracks line number and byte offset while moving forward through decoded text, without rescanning."""

    def __init__(self, text: str, start: int):
        self._text, self._pos = text, 0
        self._ascii = text.isascii()  # then characters are bytes and no re-encoding is needed
        self.line, self.byte = 1, 0
        self.move_to(start)

    def move_to(self, pos: int) -> None:
        self.line += self._text.count("\n", self._pos, pos)
        if self._ascii:
            self.byte += pos - self._pos
        else:
            # surrogateescape turns each escaped character back into its one original byte
            self.byte += len(self._text[self._pos:pos].encode("utf-8", errors="surrogateescape"))
        self._pos = pos


_BETWEEN_RECORDS = re.compile(r"[\s,]*")
# a complete string, a lone quote (a string that never ends), or a structural character
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|"|[\[\]{},]', re.DOTALL)


def _end_of_bad_element(text: str, start: int) -> int | None:
    """Index just past the array element that starts at `start` and failed to decode; None if the text ends inside it."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        symbol = token.group()
        if symbol == '"':
            return None
        if symbol in "[{":
            depth += 1
        elif symbol in "]}":
            if depth == 0:
                return max(token.start(), start + 1)  # a stray closer at the start is consumed, so we move on
            depth -= 1
            if depth == 0:
                return token.end()
        elif symbol == "," and depth == 0:
            return max(token.start(), start + 1)
    return None


def _json_array_records(path: Path) -> Generator[RawRecord, None, Truncation | None]:
    # decoded piece by piece: the real ShareGPT file is cut off mid-record, so json.loads would reject all of it
    text = _read_nonempty_bytes(path).decode("utf-8", errors="surrogateescape")
    decoder = json.JSONDecoder()
    pos = _BETWEEN_RECORDS.match(text, 1 if text.startswith("\ufeff") else 0).end()
    if not text.startswith("[", pos):
        raise InputFileError(
            f"{path}: expected a top-level JSON array of records, found {text[pos:pos + 20]!r}; "
            "a file with one JSON object per line should be named .jsonl"
        )
    position = _TextPosition(text, pos)
    pos += 1
    index = 0
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        position.move_to(pos)
        if pos == len(text):  # the array never closed, though every record in it was complete
            return Truncation(position.byte, position.line, index)
        if text[pos] == "]":
            return None
        location = f"record {index} (byte {position.byte}, line {position.line})"
        try:
            data, pos = decoder.raw_decode(text, pos)
            record = RawRecord(location, data)
        except json.JSONDecodeError as error:
            end = _end_of_bad_element(text, pos)
            if end is None:  # no complete record can follow: the file was cut off here
                return Truncation(position.byte, position.line, index)
            record, pos = _malformed(path, location, error, whole_file=True), end
        yield record
        index += 1


def _parquet_records(path: Path) -> Generator[RawRecord, None, None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise InputFileError(f"{path}: input file is empty (0 bytes)")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise InputFileError(f"{path}: not a readable Parquet file: {error}") from error
    yield from _table_rows(parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS))


def _table_rows(batches) -> Generator[RawRecord, None, None]:
    """Rows of Arrow record batches (or tables) as RawRecords located "row N"."""
    row = 0
    for batch in batches:
        for data in batch.to_pylist():
            yield RawRecord(f"row {row}", data)
            row += 1


# ---------------------------------------------------------------- Hugging Face datasets


def iter_hf_records(path: str | Path, split: str = "train") -> RecordReader:
    """Rows of a Hugging Face dataset: a local save_to_disk directory, else anything datasets.load_dataset accepts."""
    dataset = _load_hf_split(str(path), split)
    # the arrow format hands out whole batches, far faster than one Python dict per row
    batches = dataset.with_format("arrow").iter(batch_size=_PARQUET_BATCH_ROWS)
    return RecordReader(f"{path} [split {split}]", _table_rows(batches))


def _is_saved_to_disk(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_hf_split(path: str, split: str):
    import datasets  # imported here: it is slow to import and only this source needs it

    if _is_saved_to_disk(Path(path)):
        try:
            loaded = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError, OSError) as error:
            raise InputFileError(f"{path}: cannot load the saved dataset: {error}") from error
        if not isinstance(loaded, datasets.DatasetDict):
            return loaded  # a single saved Dataset has no splits to choose from
        if split not in loaded:
            raise InputFileError(f"{path}: no split {split!r}; available splits: {', '.join(sorted(loaded))}")
        return loaded[split]
    try:
        return datasets.load_dataset(path, split=split)
    except ValueError as error:
        # datasets reports an unknown split as ValueError("Unknown split ... Should be one of [...]")
        raise InputFileError(f"{path}: cannot load split {split!r}: {error}") from error
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise InputFileError(f"{path}: cannot load the dataset (not a local dataset, and the hub is unreachable or lacks it): {error}") from error


# ---------------------------------------------------------------- one entry point


def read_source(kind: str, path: str | Path, split: str = "train") -> RecordReader:
    """The reader for a dataset source: kind "file" (local JSONL/JSON/Parquet) or "hf" (Hugging Face dataset)."""
    if kind == "file":
        return iter_file_records(path)
    if kind == "hf":
        return iter_hf_records(path, split)
    raise ValueError(f"unknown source kind {kind!r}; expected 'file' or 'hf'")
