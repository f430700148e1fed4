# Datasets -> prompt shards (assistant turns removed), a held-out benchmark split and a summary.
# One rule per dataset, because each declares its own outputs: its held-out split, its summary and its lost shards.

for _dataset in DATASETS:

    rule:
        name:
            f"build_prompts_{_dataset}"
        input:
            source=dataset_source(_dataset),
        # It writes every prompt shard (params.shards; summary.json last) but declares only those lost since it ran
        # (rules/common.smk): one job with N outputs that N regeneration jobs depend on makes Snakemake's planning
        # quadratic in the shard count (`benchmarks/dag_scale.py` measures it).
        output:
            *LOST_PROMPT_SHARDS[_dataset],
            heldout=f"results/prompts/{_dataset}/heldout.parquet",
            summary=prompts_summary(_dataset),
        params:
            dataset=_dataset,
            shards=prompt_shards(_dataset),
            # rework left out while null and replies while target: a run from before the options plans no new prompts job
            spec=canonical({k: v for k, v in config["datasets"][_dataset].items()
                            if k != "generation" and (k, v) not in (("rework", None), ("replies", "target"))}),
            heldout_of=rework_heldout_of(_dataset),
        log:
            f"logs/prompts/{_dataset}.log",
        conda: "../envs/cpu.yaml"
        script:
            "../scripts/build_prompts.py"
