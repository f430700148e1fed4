# Snakemake entry point: regenerate one prompt shard with the engine the config names (see eyrie.generation.regenerate; the format is eyrie.generation.conversations).
from pathlib import Path

from eyrie.core.joblog import job_log
from eyrie.generation.engines import open_engine
from eyrie.generation.regenerate import regenerate_shard
from eyrie.target.model import model_fingerprint, template_fingerprint

dataset, shard = snakemake.wildcards.dataset, snakemake.wildcards.shard
engine_config = snakemake.config["engine"]

with job_log(snakemake.log[0]):
    # Where the server log goes is not a param: params are rerun triggers.
    server_log = Path("logs/sglang") / dataset / f"{shard}.log"
    with open_engine(engine_config, snakemake.input.model, snakemake.params.model, snakemake.threads, server_log) as (engine, tokenizer):
        regenerate_shard(
            prompts_path=snakemake.params.prompts,
            out_path=snakemake.output[0],
            partial_dir=snakemake.params.partial_dir,
            dataset=dataset,
            shard=shard,
            settings=snakemake.params.settings,
            engine_settings=engine_config,
            engine=engine,
            model_fingerprint=model_fingerprint(snakemake.input.model),
            template_sha256=template_fingerprint(tokenizer),
        )
