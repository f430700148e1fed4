# Snakemake entry point: regenerate one prompt shard with the engine the config names (see eyrie.generation.regenerate; the format is eyrie.generation.conversations).
from contextlib import nullcontext
from pathlib import Path

from eyrie.core.joblog import job_log
from eyrie.generation.engines import open_engine
from eyrie.generation.regenerate import regenerate_shard, shard_answered
from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint

dataset, shard = snakemake.wildcards.dataset, snakemake.wildcards.shard
engine_config = snakemake.config["engine"]

with job_log(snakemake.log[0]):
    # Where the server log goes is not a param: params are rerun triggers.
    server_log = Path("logs/sglang") / dataset / f"{shard}.log"
    fingerprint = model_fingerprint(snakemake.input.model)
    # A shard whose every turn is in its resume log (a job killed while writing, or logs copied from another machine) opens no
    # engine: no model load, no server start.
    if shard_answered(snakemake.params.prompts, snakemake.params.partial_dir, snakemake.params.settings, fingerprint):
        opened = nullcontext((None, load_tokenizer(snakemake.input.model, snakemake.params.model["trust_remote_code"])))
    else:
        opened = open_engine(engine_config, snakemake.input.model, snakemake.params.model, snakemake.threads, server_log,
                             replies=snakemake.params.settings.get("replies", "target"))
    with opened as (engine, tokenizer):
        regenerate_shard(
            prompts_path=snakemake.params.prompts,
            out_path=snakemake.output[0],
            partial_dir=snakemake.params.partial_dir,
            dataset=dataset,
            shard=shard,
            settings=snakemake.params.settings,
            engine_settings=engine_config,
            engine=engine,
            model_fingerprint=fingerprint,
            template_sha256=template_fingerprint(tokenizer),
        )
