# Everything built so far -> one self-contained report.html.


rule write_report:
    input:
        summaries=expand("results/prompts/{dataset}/summary.json", dataset=DATASETS),
        completions=all_of("results/completions/{dataset}/{shard}.parquet"),
        tokens=all_of("results/tokens/{dataset}/{shard}.parquet"),
    output:
        "report.html",
    log:
        "logs/report.log",
    script:
        "../scripts/write_report.py"
