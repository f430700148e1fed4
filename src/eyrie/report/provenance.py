"""Provenance, the page's last section: where and with what the report was made.

The config as YAML, the versions of the packages that shape the results, Python and the
platform, the GPU torch sees, and the git commit of the repository (marked when the working tree
has uncommitted changes). Deliberately no environment variables: they may hold secrets. A probe
that fails (no torch, no git, a broken CUDA setup) says "unknown" instead of stopping the report.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
from typing import Any

import yaml

from eyrie.core.schema import REPO_ROOT

PACKAGES = ("torch", "transformers", "safetensors", "snakemake", "datasets", "pyarrow", "pandas", "eyrie")


def provenance(config: dict) -> dict[str, Any]:
    """Where and with what the report was made; deliberately no environment variables."""
    return {
        "config_yaml": _config_yaml(config),
        "packages": _package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu": _gpu_name(),
        "git_commit": _git_commit(),
        "repo_root": str(REPO_ROOT),
    }


def _config_yaml(config: dict) -> str:
    try:
        return yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    except yaml.YAMLError:
        return json.dumps(config, indent=2, default=str)  # a config with non-YAML values still shows


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _gpu_name() -> str:
    if importlib.util.find_spec("torch") is None:
        return "unknown (torch not installed)"
    try:
        import torch

        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception as err:  # a broken CUDA setup must not stop the report
        return f"unknown ({type(err).__name__})"
    return "none (CUDA not available)"


def _git_commit() -> str:
    if not (REPO_ROOT / ".git").exists():
        return "unknown"
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()
