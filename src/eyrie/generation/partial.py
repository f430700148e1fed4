"""An append-only JSONL log of finished turns: what makes regeneration resumable.

Every finished turn is one line, flushed and fsynced with its batch, keyed by
(prompt id, turn) — never by position; a turn logged twice counts as its newest row. A kill can
only tear the last line. Only the job that owns the log writes it: `load()` (that job's read)
cuts a torn last line off before the job appends, while `read()` — for everyone else: `eyrie plan`,
`eyrie verify`, the report — ignores it and never opens the file for writing, so a reader beside
a running job cannot cut a line the job has just finished.

A shard's logs live in its partial directory, one per identity of what answers: `<key>.jsonl`
for the settings and the local model (eyrie.generation.conversations.settings_key), and
`<key>-<served>.jsonl` when a server answers, `served` naming the model it serves
(eyrie.generation.openai_engine), so turns from another served model are never reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from eyrie.core.errors import EyrieError, InputFileError


class PartialLogWriteError(EyrieError):
    """Finished turns could not be written to the resume log (disk full, ...): the job stops before asking for more."""


def log_path(partial_dir: str | Path, key: str, served: str | None = None) -> Path:
    """The resume log of one settings key, for the local model (served None) or for the model a server serves."""
    return Path(partial_dir) / (f"{key}-{served}.jsonl" if served else f"{key}.jsonl")


def logs_of(partial_dir: str | Path, key: str) -> list[Path]:
    """Every resume log of this settings key in partial_dir (local and served), the most recently written first."""
    folder = Path(partial_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"{key}*.jsonl") if p.name == f"{key}.jsonl" or p.name.startswith(f"{key}-")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


class PartialLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> dict[tuple[str, int], dict]:
        """Finished turns by (id, turn), the file left as it is: a torn trailing line (a kill, or a write still under
        way) is not counted. For readers beside a job that may be appending."""
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        return self._rows(raw[: raw.rfind(b"\n") + 1])

    def repair(self) -> int:
        """Cut a torn trailing line off the file; the bytes cut. Only for the job that owns the log, before it appends."""
        if not self.path.exists():
            return 0
        raw = self.path.read_bytes()
        complete_upto = raw.rfind(b"\n") + 1
        if complete_upto < len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(complete_upto)
        return len(raw) - complete_upto

    def load(self) -> dict[tuple[str, int], dict]:
        """The owning job's read: repair(), then read()."""
        self.repair()
        return self.read()

    def _rows(self, raw: bytes) -> dict[tuple[str, int], dict]:
        rows: dict[tuple[str, int], dict] = {}
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows[(row["id"], row["turn"])] = row
            except (ValueError, KeyError, TypeError) as err:
                raise InputFileError(
                    f"{self.path}: line {number} is not a finished turn ({type(err).__name__}: {err}); the log was written by "
                    "another program or damaged. Move it away to answer the shard's turns again"
                ) from None
        return rows

    def append(self, rows: Iterable[dict]) -> None:
        """Append finished turns and fsync them; PartialLogWriteError names the file when they cannot be written."""
        payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise PartialLogWriteError(
                f"{self.path}: cannot save {payload.count(chr(10))} finished turn(s) to the resume log ({type(err).__name__}: {err}); "
                "turns saved before are kept. Free the space (or fix the error) and rerun to go on"
            ) from err
