"""Free disk space where an artifact will land, and byte counts as a person reads them.

The directory an output goes to often does not exist yet (results/ before the first job), so the
space is asked of its nearest existing parent: the filesystem the directory will be created on.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def free_space(path: str | Path) -> tuple[int, Path]:
    """(bytes free to this user, the existing directory asked) on the filesystem that holds or will hold `path`."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free, where


def human_bytes(count: float) -> str:
    """Binary units, one decimal: 4.5 KiB, 9.1 TiB (the report's tables keep the exact counts)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
