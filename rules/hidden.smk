# Token shard -> the target's aux and final hidden states for every token (the drafter's training input).


rule extract_hidden:
    input:
        tokens="results/tokens/{dataset}/{shard}.parquet",
        model=model_dir(),
    output:
        # hidden.keep: false makes it temp(): deleted once the drafter is trained (rules/common.smk hidden_cache).
        hidden_cache("results/hidden/{dataset}/{shard}.safetensors"),
    params:
        aux_layer_ids=config["drafter"]["aux_layer_ids"],
        # keep says whether the cache stays, not what is in it: switching it must not re-extract.
        hidden=canonical({k: v for k, v in config["hidden"].items() if k != "keep"}),
        model=canonical({k: config["model"][k] for k in ("dtype", "device", "trust_remote_code")}),
    # On a GPU the forward is a small share of a job (model load, writing the cache): a few cores each let
    # shards overlap on one card (`--resources gpu=N` caps how many); on the CPU a shard takes every core.
    threads: workflow.cores if config["model"]["device"] != "cuda" else min(4, workflow.cores)
    resources:
        gpu=int(config["model"]["device"] == "cuda"),
    log:
        "logs/hidden/{dataset}/{shard}.log",
    benchmark:
        "logs/benchmarks/hidden/{dataset}/{shard}.tsv"
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/extract_hidden.py"
