# Training token shards -> the draft vocabulary (d2t offsets, t2d mask, counts).


rule build_draft_vocab:
    input:
        tokens=all_of("results/tokens/{dataset}/{shard}.parquet"),
        model=model_dir(),
    output:
        "results/vocab/draft_vocab.safetensors",
    params:
        draft_vocab_size=config["drafter"]["draft_vocab_size"],
        from_prompts=config["drafter"]["draft_vocab_from_prompts"],
    log:
        "logs/vocab/draft_vocab.log",
    conda: "../envs/cpu.yaml"
    script:
        "../scripts/build_draft_vocab.py"
