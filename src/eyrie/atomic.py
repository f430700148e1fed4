"""Write-then-rename: readers, and a job killed mid-write, see the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Callable


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call write(temporary) for a temporary path beside `path`, make it durable, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomically(path: str | Path, value: dict) -> None:
    write_text_atomically(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")
