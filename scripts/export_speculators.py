# Snakemake entry point: drafter + target -> the speculators-format export (see eyrie.drafter.speculators_export).
from eyrie.core.joblog import job_log
from eyrie.drafter.speculators_export import export_speculators

with job_log(snakemake.log[0]):
    export_speculators(
        drafter_dir=snakemake.input.drafter,
        target_dir=snakemake.input.model,
        out_dir=snakemake.output[0],
        speculative_tokens=snakemake.params.speculative_tokens,
        verifier=snakemake.params.served_name,  # None: the target directory's absolute path
        trust_remote_code=bool(snakemake.config["model"]["trust_remote_code"]),
    )
