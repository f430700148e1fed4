"""An append-only JSONL log of finished turns: what makes regeneration resumable.

Every finished turn is one line, flushed and fsynced with its batch, keyed by
(prompt id, turn) — never by position. A kill can only tear the last line, which
load() cuts off, so a rerun loses at most the batch that was in flight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable


class PartialLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> dict[tuple[str, int], dict]:
        """Finished turns by (id, turn); a torn trailing line from a kill is removed from the file."""
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        complete_upto = raw.rfind(b"\n") + 1
        if complete_upto < len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(complete_upto)
        rows: dict[tuple[str, int], dict] = {}
        for line in raw[:complete_upto].splitlines():
            if line.strip():
                row = json.loads(line)
                rows[(row["id"], row["turn"])] = row
        return rows

    def append(self, rows: Iterable[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
