"""Data-parallel training: ranks under torchrun, each training its share of every step's batch.

Each step's batch (batch_tokens padded tokens, as on one GPU) is dealt out by rows, the loss is
normalised over all ranks' positions (eyrie.training.objective.TTTObjective), so the run follows
the one-rank loss curve; rank 0 alone writes the resume state, the checkpoint and the log.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eyrie.target.model import resolve_device
from eyrie.training.errors import TrainingInputError
from eyrie.training.objective import TTTObjective

# Keep NVLink multicast off in every rank: on shared multi-GPU hosts a program using it can take the GPUs down.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_share(refs: list, rank: int, world: int) -> tuple[list, float]:
    """This rank's rows of a step's batch and its loss weight (see TTTObjective.forward).

    Rows are dealt round-robin (the batch is sorted by length, so ranks get similar lengths).
    A rank left without rows trains a stand-in row at weight 0: DDP needs every rank's backward.
    """
    if world == 1:
        return refs, 1.0
    mine = refs[rank::world]
    return (mine, float(world)) if mine else (refs[:1], 0.0)


def data_parallel(objective: TTTObjective, device) -> torch.nn.parallel.DistributedDataParallel:
    """DDP around the objective; the frozen buffers (1 GB of embeddings) are not re-broadcast every step."""
    device = torch.device(device)
    return torch.nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


@dataclass
class DistributedContext:
    """This process's place in the run: rank 0 of 1 alone, or one rank of a torchrun launch."""

    rank: int
    world: int
    device: str
    owns_group: bool  # this process joined the group, so it leaves it

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def distributed_context(device_setting: str) -> DistributedContext:
    """Alone: rank 0 of 1 on the configured device. Under torchrun (WORLD_SIZE > 1): join the group (NCCL on CUDA, one GPU per LOCAL_RANK; gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext(0, 1, resolve_device(device_setting), owns_group=False)
    if "RANK" not in os.environ:
        raise TrainingInputError(f"WORLD_SIZE={world} but RANK is not set; launch with torchrun (python -m torch.distributed.run)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_setting)
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise TrainingInputError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices; use --nproc_per_node <= the GPU count")
        torch.cuda.set_device(local_rank)
        device, backend = f"cuda:{local_rank}", "nccl"
    else:
        backend = "gloo"
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group(backend)
    return DistributedContext(rank, world, device, owns_group)


def launch_data_parallel(train_kwargs: dict, processes: int, args_path: str | Path, log_path: str | Path | None = None) -> None:
    """train_drafter(**train_kwargs) in `processes` ranks under torchrun on this machine; raises if any rank fails.

    The keyword arguments go through a JSON file (args_path, kept beside the resume state) to
    `python -m eyrie.training.train`; the ranks' output is appended to log_path.
    """
    import subprocess

    args_path = Path(args_path)
    args_path.parent.mkdir(parents=True, exist_ok=True)
    args_path.write_text(json.dumps(train_kwargs, indent=1, default=str))
    from eyrie.core.torchrun import torchrun_command

    # The ranks' stores listen on 127.0.0.1 (or the address MASTER_ADDR names), never on every interface.
    command, env = torchrun_command("eyrie.training.train", args_path, processes)
    with open(log_path, "a", encoding="utf-8") if log_path else open(os.devnull, "w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise TrainingInputError(
            f"data-parallel training ({processes} processes, torchrun) failed with exit code {done.returncode}"
            + (f"; the ranks' output is in {log_path}" if log_path else "")
            + "; finished steps are kept in the state directory, rerun to resume"
        )
