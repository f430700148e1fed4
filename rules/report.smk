# Everything built so far -> one self-contained report.html.


rule write_report:
    localrule: True  # seconds of work: not worth a queue wait
    input:
        summaries=expand("results/prompts/{dataset}/summary.json", dataset=DATASETS),
        completions=all_of("results/completions/{dataset}/{shard}.parquet"),
        tokens=all_of("results/tokens/{dataset}/{shard}.parquet"),
        vocab="results/vocab/draft_vocab.safetensors",
        # A temporary cache (hidden.keep: false) is gone after training: asking for it would retrain for a report.
        # hidden.mode online writes none.
        hidden=all_of("results/hidden/{dataset}/{shard}.safetensors") if config["hidden"]["keep"] and config["hidden"]["mode"] == "offline" else [],
        drafter="results/drafter",
        speculators="results/drafter-speculators",  # the report prints vLLM's command serving it
        bench=expand("results/bench/{benchmark}.json", benchmark=BENCHMARKS),
    output:
        "report.html",
    log:
        "logs/report.log",
    conda: "../envs/cpu.yaml"
    script:
        "../scripts/write_report.py"
