# Snakemake entry point: one dataset -> prompt shards, held-out split, summary (see eyrie.data.dataset_prompts).
from eyrie.core.joblog import job_log
from eyrie.data.dataset_prompts import build_prompts_for_dataset

with job_log(snakemake.log[0]):
    build_prompts_for_dataset(
        dataset=snakemake.params.dataset,
        spec=snakemake.params.spec,
        source_path=snakemake.input.source if snakemake.input.source else None,
        shard_paths=list(snakemake.params.shards),  # all of them; the rule declares only lost ones as outputs
        heldout_path=snakemake.output.heldout,
        summary_path=snakemake.output.summary,
        heldout_of=tuple(snakemake.params.heldout_of) if snakemake.params.heldout_of else None,
    )
