# Snakemake entry point: speculative vs plain greedy decoding on one benchmark (see eyrie.bench.benchmark).
import torch

from eyrie.bench.benchmark import run_benchmark_job
from eyrie.core.joblog import job_log

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    run_benchmark_job(
        benchmark=snakemake.wildcards.get("dataset", "humaneval"),
        prompts_path=snakemake.input.prompts,
        drafter_dir=snakemake.input.drafter,
        target_dir=snakemake.input.model,
        bench_cfg=snakemake.params.bench,
        out_path=snakemake.output[0],
        device=snakemake.config["model"]["device"],
        trust_remote_code=snakemake.config["model"]["trust_remote_code"],
    )
