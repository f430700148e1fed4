# Datasets -> prompt shards (assistant turns removed), a held-out benchmark split and a summary.
# One rule per dataset, because each dataset declares its own number of shard outputs.

for _dataset in DATASETS:

    rule:
        name:
            f"build_prompts_{_dataset}"
        input:
            source=dataset_source(_dataset),
        output:
            shards=prompt_shards(_dataset),
            heldout=f"results/prompts/{_dataset}/heldout.parquet",
            summary=f"results/prompts/{_dataset}/summary.json",
        params:
            dataset=_dataset,
            spec=canonical({k: v for k, v in config["datasets"][_dataset].items() if k != "generation"}),
        log:
            f"logs/prompts/{_dataset}.log",
        conda: "../envs/cpu.yaml"
        script:
            "../scripts/build_prompts.py"
