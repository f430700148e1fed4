# Drafter + target -> acceptance length and tokens/s with and without speculation, measured side by side.


rule benchmark_heldout:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts="results/prompts/{dataset}/heldout.parquet",
    output:
        "results/bench/{dataset}.json",
    params:
        # The whole section (draft_tokens, decoder, dtype...): changing any of them reruns the benchmark.
        bench=canonical({k: v for k, v in config["bench"].items() if k != "humaneval"}),
    threads: workflow.cores
    log:
        "logs/bench/{dataset}.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"


rule benchmark_humaneval:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts=lambda wc: downloaded(config["bench"]["humaneval"]["package"], config["bench"]["humaneval"]["member"]),
    output:
        "results/bench/humaneval.json",
    params:
        bench=canonical(config["bench"]),
    threads: workflow.cores
    log:
        "logs/bench/humaneval.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"
