"""Run a package module as several ranks on this machine under torchrun, its keyword arguments in a JSON file.

Used by hidden-state extraction with hidden.tensor_parallel (eyrie.hidden.parallel). Training with
train.processes launches the same command with the same environment from its own copy
(eyrie.training.distributed.launch_data_parallel, which appends the ranks' output to the log file instead).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Keep NVLink multicast off in every rank: on shared multi-GPU hosts a program using it can take the GPUs down.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_ranks(module: str, kwargs: dict, processes: int, args_path: str | Path) -> int:
    """`python -m torch.distributed.run --standalone --nproc_per_node N -m module args_path`; returns its exit code.

    kwargs go to args_path as JSON (kept, so a failed launch can be rerun by hand). The ranks' output is
    copied to this process's stderr as it comes, so a job log that tees stderr holds it in order. torchrun
    stops every rank as soon as one fails, so none waits forever in a collective.
    """
    import codecs
    import subprocess

    args_path = Path(args_path)
    args_path.parent.mkdir(parents=True, exist_ok=True)
    args_path.write_text(json.dumps(kwargs, indent=1, default=str))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), "-m", module, str(args_path)]
    ranks = subprocess.Popen(command, env={**os.environ, **DISTRIBUTED_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end inside a progress bar's block character
    for chunk in iter(lambda: ranks.stdout.read1(1 << 16), b""):  # as it comes: progress bars end lines with \r
        sys.stderr.write(text.decode(chunk))
    sys.stderr.write(text.decode(b"", final=True))
    return ranks.wait()
