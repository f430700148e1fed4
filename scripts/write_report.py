# Snakemake entry point: everything built so far -> report.html (see eyrie.report.build).
from eyrie.core.joblog import job_log
from eyrie.report.build import write_report

with job_log(snakemake.log[0]):
    write_report(
        config=snakemake.config,
        prompt_summaries=list(snakemake.input.summaries),
        completions=list(snakemake.input.completions),
        tokens=list(snakemake.input.tokens),
        out_path=snakemake.output[0],
        vocab=snakemake.input.vocab,
        hidden=list(snakemake.input.hidden),
        drafter=snakemake.input.drafter,
        bench=list(snakemake.input.bench),
    )
