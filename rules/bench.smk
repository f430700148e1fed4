# Drafter + target -> acceptance length and tokens/s with and without speculation (and of the n-gram
# baseline), measured side by side.


rule benchmark_heldout:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts="results/prompts/{dataset}/heldout.parquet",
    output:
        "results/bench/{dataset}.json",
    params:
        # The whole section (draft_tokens, decoder, dtype...): changing any of them reruns the benchmark.
        bench=bench_settings(),
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
        bench=bench_settings("humaneval"),
    threads: workflow.cores
    log:
        "logs/bench/humaneval.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"


rule benchmark_mtbench:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts=lambda wc: downloaded(config["bench"]["mtbench"]["package"], config["bench"]["mtbench"]["member"]),
    output:
        # The script names the benchmark after the `dataset` wildcard, which is pinned to mtbench here.
        "results/bench/{dataset,mtbench}.json",
    params:
        bench=bench_settings("mtbench"),
    threads: workflow.cores
    log:
        "logs/bench/{dataset}.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"


rule benchmark_bfcl:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts=lambda wc: downloaded(config["bench"]["bfcl"]["package"], config["bench"]["bfcl"]["member"]),
    output:
        # Tool calling: BFCL's questions with their function definitions as the template's tools.
        "results/bench/{dataset,bfcl}.json",
    params:
        bench=bench_settings("bfcl"),
    threads: workflow.cores
    log:
        "logs/bench/{dataset}.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"


rule benchmark_math:
    input:
        drafter="results/drafter",
        model=model_dir(),
        prompts=lambda wc: downloaded(config["bench"]["math"]["package"], config["bench"]["math"]["member"]),
    output:
        # Reasoning: math problems (GSM8K, MATH-500 or CHAMP) with the template's thinking switched on.
        "results/bench/{dataset,math}.json",
    params:
        bench=bench_settings("math"),
    threads: workflow.cores
    log:
        "logs/bench/{dataset}.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/run_benchmark.py"
