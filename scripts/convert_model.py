# Snakemake entry point: GGUF -> HF model directory (see eyrie.target.model).
from eyrie.core.joblog import job_log
from eyrie.target.model import convert_gguf

with job_log(snakemake.log[0]):
    convert_gguf(snakemake.input.gguf, snakemake.output[0])
