# Synthetic prompts (Magpie-style): for a dataset whose source is `synthetic`, the target writes the user turns
# itself; build_prompts_<dataset> then reads the file like any other source (eyrie.data.synthetic).


rule synthesize_prompts:
    input:
        model=model_dir(),
    output:
        "results/synthetic/{dataset}.parquet",
    wildcard_constraints:
        dataset="|".join(SYNTHETIC_DATASETS) or "(?!)",  # no synthetic dataset: matches nothing
    params:
        settings=lambda wc: canonical(config["datasets"][wc.dataset]["source"]["synthetic"]),
        model=canonical({k: config["model"][k] for k in ("dtype", "device", "trust_remote_code")}),
        # Kept outside the declared output so a failed or killed job keeps its finished batches.
        partial_dir="results/partial/synthetic/{dataset}",
    threads: workflow.cores if config["model"]["device"] != "cuda" else min(4, workflow.cores)
    # First among jobs waiting for the GPU: its dataset's shards all wait on it, while another dataset's shard job
    # holds up nothing. Scheduled last, it would run alone after the other datasets' shards.
    priority: 10
    resources:
        gpu=int(config["model"]["device"] != "cpu"),
    log:
        "logs/synthetic/{dataset}.log",
    benchmark:
        "logs/benchmarks/synthetic/{dataset}.tsv"
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/synthesize_prompts.py"
