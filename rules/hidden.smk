# Token shard -> the target's aux and final hidden states for every token (the drafter's training input).


rule extract_hidden:
    input:
        tokens="results/tokens/{dataset}/{shard}.parquet",
        model=model_dir(),
    output:
        "results/hidden/{dataset}/{shard}.safetensors",
    params:
        aux_layer_ids=config["drafter"]["aux_layer_ids"],
        hidden=canonical(config["hidden"]),
        model=canonical({k: config["model"][k] for k in ("dtype", "device", "trust_remote_code")}),
    threads: workflow.cores
    log:
        "logs/hidden/{dataset}/{shard}.log",
    benchmark:
        "logs/benchmarks/hidden/{dataset}/{shard}.tsv"
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/extract_hidden.py"
