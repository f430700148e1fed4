"""Where inductor keeps what it compiled and what max-autotune timed: a directory of the workspace, not the node's /tmp.

A benchmark fused with bench.compile_mode max-autotune-no-cudagraphs spends minutes timing Triton templates for each
matrix product's shape; kept in the workspace, a rerun (a resumed call, a new drafter on the same target) finds the
timings and the compiled kernels and spends seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

ENVIRONMENT_KEY = "TORCHINDUCTOR_CACHE_DIR"  # inductor reads it at each compile; the user's own setting wins


def use_inductor_cache(directory: str | Path | None) -> str | None:
    """Point inductor's cache at `directory` (created) unless the environment already names one; the directory in use,
    or None when neither names one (inductor's default under the system temp dir)."""
    if os.environ.get(ENVIRONMENT_KEY):
        return os.environ[ENVIRONMENT_KEY]
    if not directory:
        return None
    path = Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[ENVIRONMENT_KEY] = str(path)
    return str(path)
