# Snakemake entry point: regenerate one prompt shard with the in-process engine (see eyrie.generate).
import torch

from eyrie.engine import TransformersEngine
from eyrie.generate import regenerate_shard
from eyrie.joblog import job_log
from eyrie.model import model_fingerprint, template_fingerprint

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    engine = TransformersEngine(snakemake.input.model, **snakemake.params.model)
    regenerate_shard(
        prompts_path=snakemake.input.prompts,
        out_path=snakemake.output[0],
        partial_dir=snakemake.params.partial_dir,
        dataset=snakemake.wildcards.dataset,
        shard=snakemake.wildcards.shard,
        settings=snakemake.params.settings,
        engine_settings=snakemake.config["engine"],
        engine=engine,
        model_fingerprint=model_fingerprint(snakemake.input.model),
        template_sha256=template_fingerprint(engine.tokenizer),
    )
