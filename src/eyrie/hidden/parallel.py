"""hidden.tensor_parallel: one target split over N processes (one GPU each) for a shard's extraction.

The extract job starts N ranks under torchrun (`python -m eyrie.hidden.extract ARGS.json`); each loads its
part of the target with transformers' own tensor parallelism (eyrie.target.model.load_model) and runs
every batch, the ranks' matrix products summed by all-reduces, so each holds the whole hidden states;
rank 0 alone writes the cache, the same file a single process writes. N = 1 runs in the job's own process.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.core.torchrun import run_ranks
from eyrie.hidden.cache import HiddenCacheError
from eyrie.target.model import check_experts_split, check_model_dir, check_tensor_parallel, check_tensor_parallel_device, resolve_device


def extraction_gpus(config: dict) -> int:
    """GPUs one extract_hidden job asks Snakemake (and SLURM) for: one per rank, none when model.device is cpu.

    model.device auto counts as a GPU, as for regeneration and training.
    """
    return 0 if config["model"]["device"] == "cpu" else int(config["hidden"].get("tensor_parallel", 1))


def launch_tensor_parallel(arguments: dict, processes: int, args_path: str | Path) -> None:
    """eyrie.hidden.extract.extract_target_shard(**arguments) as `processes` torchrun ranks on this machine; raises if any fails.

    The target and the device are checked here first, so a split that cannot work stops before any rank
    starts, with the reason in the job's log rather than in N ranks' tracebacks. The ranks' output goes
    to this process's stderr (the job log).
    """
    from transformers import AutoConfig

    model = arguments["model_cfg"]
    device = resolve_device(model.get("device", "auto"))
    config = AutoConfig.from_pretrained(check_model_dir(arguments["model_dir"]), trust_remote_code=model.get("trust_remote_code", False))
    check_tensor_parallel(config, processes)
    check_experts_split(arguments["model_dir"], config, processes)  # an MoE target would gain no memory: refused with the bytes
    check_tensor_parallel_device(device, processes)
    code = run_ranks("eyrie.hidden.extract", {**arguments, "tensor_parallel": processes}, processes, args_path)
    if code != 0:
        raise HiddenCacheError(
            f"{arguments['out_path']}: tensor-parallel extraction ({processes} ranks under torchrun, hidden.tensor_parallel) failed "
            f"with exit code {code} (the ranks' output is above; their arguments are in {args_path}); nothing was written"
        )
